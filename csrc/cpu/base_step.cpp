// SAM's restore fused with the base optimizer's update on the CPU: one pass reads backup (w; param holds w + eps and
// is never read), writes param and the optimizer state. backup may be param itself: every loop reads an element
// before writing it, and no pointer is declared restrict. Past the stream threshold param and backup first exchange
// their memory (exchange.h), and the pass then updates param in place. The update and its roundings are stated once,
// in gearsam_fused/base_step.py; here each scalar is rounded once to the buffers' type (SgdConstants / AdamConstants),
// only the std::fma calls fuse (the build uses -ffp-contract=off), and the square root is correctly rounded, so the
// results equal restore_ followed by torch.optim.SGD / Adam / AdamW (foreach=False) bit for bit wherever torch's own
// square root is correctly rounded (see base_step.py for where it is not). Zero padding stays zero (with eps > 0 for
// Adam).
//
// Structure (csrc/README.md, "Memory traffic"): tiles split between threads, in runs of a tile (for_each_run); a
// parameter larger than the stream threshold is written from a vector loop as it loads (vec.h) where the CPU has AVX2
// and FMA, else from a scratch run, with non-temporal stores (stream.h) where the pass does not read it. The loops
// take their constants by value: a copy that no store of theirs can reach, so the compiler keeps them in registers and
// tests the flags once. Taken by reference, they might be written by any store to a buffer of their type, so the
// compiler would load each of them again after every store, in every iteration.
//
// Asked for the new momentum's block energies (MomentumEnergy, gearsam.h), a step sums each tile's momentum by
// tile_sum (tile_sum.h) as soon as the tile's runs have written it, while it is in cache (TileEnergy), then the
// blocks' sums: block_energy's bits without a read of the momentum from memory.
//
// Capturable arguments (csrc/README.md) are CPU tensors here, read on the host before the step: scalars' (lr, k) replace
// the options' through at_step, so the constants are those of the host call with the same lr and k; found_inf
// nonzero turns the step into restore (param = backup, nothing where backup is param itself) and touches no state.

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../gearsam.h"
#include "exchange.h"
#include "stream.h"
#include "tile_sum.h"
#include "tiles.h"
#include "vec.h"

namespace gearsam::cpu {
namespace {

// torch.maximum's rule: NaN from either side wins, so a NaN second moment stays visible instead of being dropped.
template <typename T>
T nan_max(T a, T b) {
  return (a < b || std::isnan(b)) ? b : a;
}

// Where one tile's gradient comes from: grad, and with a correction the tile's values and its block's scales
// rounded once to scalar_t (C(c[block]) and C(a[block]) in gearsam_fused/base_step.py; a is 1 where grad_scale is not
// given, a product that leaves grad as it is); and the sharpness step's factor C(-lr * sharpness) (gearsam.h).
template <typename scalar_t>
struct TileGrad {
  const scalar_t* grad;
  const scalar_t* correction;  // null without a correction
  scalar_t scale, grad_scale, sharpness_step;

  // The same source from element `offset` on.
  TileGrad at(int64_t offset) const {
    return {grad + offset, correction ? correction + offset : nullptr, scale, grad_scale, sharpness_step};
  }
};

// The correction's data (null without one), read per tile by TileGrad.
template <typename scalar_t>
struct CorrectionData {
  const scalar_t* values = nullptr;
  const double* scale = nullptr;
  const double* grad_scale = nullptr;  // null for 1
  const int32_t* block_of_tile = nullptr;
  scalar_t sharpness_step = 0;

  // lr: the step's, for the sharpness step's factor
  CorrectionData(const Correction& c, double lr) {
    if (!c.given()) return;
    values = c.values.const_data_ptr<scalar_t>();
    scale = c.scale.const_data_ptr<double>();
    if (c.grad_scale.defined()) grad_scale = c.grad_scale.const_data_ptr<double>();
    block_of_tile = c.block_of_tile.const_data_ptr<int32_t>();
    sharpness_step = static_cast<scalar_t>(gearsam::sharpness_step(lr, c.sharpness));
  }
  TileGrad<scalar_t> tile(const scalar_t* grad, int64_t t) const {
    if (!values) return {grad, nullptr, scalar_t(0), scalar_t(1), scalar_t(0)};
    const int32_t block = block_of_tile[t];
    return {grad, values, static_cast<scalar_t>(scale[block]),
            grad_scale ? static_cast<scalar_t>(grad_scale[block]) : scalar_t(1), sharpness_step};
  }
};

// Calls fn(corrected, sharpened), two std::integral_constant<bool> template flags: whether the step's gradient is
// corrected, and whether the sharpness step follows the update (only where it is).
template <typename Fn>
void with_correction_flags(const Correction& c, const Fn& fn) {
  if (!c.given())
    fn(std::false_type{}, std::false_type{});
  else if (c.sharpness == 0.0)
    fn(std::true_type{}, std::false_type{});
  else
    fn(std::true_type{}, std::true_type{});
}

// The gradient element i the step uses, before maximize's negation: a template flag, so that a step without a
// correction loads nothing more.
template <bool kCorrected, typename scalar_t>
GEARSAM_INLINE scalar_t step_grad(const TileGrad<scalar_t>& g, int64_t i) {
  if constexpr (kCorrected)
    return std::fma(g.scale, g.correction[i], g.grad_scale * g.grad[i]);
  else
    return g.grad[i];
}

// The parameter w_new after the update (rounded to scalar_t), followed by the sharpness step where kSharpened:
// fma(C(-lr * sharpness), grad - correction, w_new), the difference rounded on its own.
template <bool kSharpened, typename scalar_t>
GEARSAM_INLINE scalar_t sharpened(const TileGrad<scalar_t>& g, int64_t i, scalar_t w_new) {
  if constexpr (kSharpened)
    return std::fma(g.sharpness_step, g.grad[i] - g.correction[i], w_new);
  else
    return w_new;
}

// Elements a pass computes into a scratch buffer before streaming them to an output it does not read (stream.h).
constexpr int64_t kScratch = 2048;

// Offsets a pointer that may be null (a buffer the optimizer does not have).
template <typename T>
T* offset(T* p, int64_t i) {
  return p ? p + i : nullptr;
}

// The momentum's partial energy of each tile, taken right after the step has written the tile's momentum, while it is
// in cache: tile_sum's square sum (tile_sum.h), so the partials are block_energy's bits. Nothing without partials.
template <typename scalar_t>
struct TileEnergy {
  const scalar_t* momentum;
  double* partials;  // null: the step sums nothing
  int64_t tile;
  bool avx2;

  TileEnergy(const at::Tensor& momentum_state, const MomentumEnergy& e, int64_t tile_size)
      : momentum(e.given() ? momentum_state.const_data_ptr<scalar_t>() : nullptr),
        partials(e.given() ? e.partials.mutable_data_ptr<double>() : nullptr),
        tile(tile_size),
        avx2(cpu_has_fma()) {}
  void operator()(int64_t t) const {
    if (!partials) return;
    const scalar_t* m = momentum + t * tile;
    partials[t] = tile_sum_here<Term::kSquare>(avx2, m, m, tile, 0.0);
  }
};

// Calls run(g, start, n, scratch) for every run [start, start + n) of at most kScratch elements of each tile, the
// tiles split between threads, and then energy(t) for the tile; g is the run's gradient source and scratch a run's
// worth of the thread's memory.
template <typename scalar_t, typename Run>
void for_each_run(int64_t n_tiles, int64_t tile, const CorrectionData<scalar_t>& correction, const scalar_t* g_in,
                  const TileEnergy<scalar_t>& energy, const Run& run) {
  for_each_tile(n_tiles, tile, [&](int64_t t) {
    const TileGrad<scalar_t> g = correction.tile(g_in, t);
    scalar_t scratch[kScratch];
    for (int64_t start = t * tile; start < (t + 1) * tile; start += kScratch)
      run(g.at(start), start, std::min(kScratch, (t + 1) * tile - start), scratch);
    energy(t);
  });
}

// The flags that decide whether a buffer is loaded or stored are template parameters: a loop without control flow
// vectorises. The others are loop-invariant selects, which the compiler turns into blends. Every pointer points at the
// run's first element.
template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected, bool kSharpened>
GEARSAM_INLINE void sgd_loop(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf,
                             int64_t n, const SgdConstants<scalar_t> c) {
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t w = w_in[i];  // read before out[i] is written: backup may be param
    scalar_t g = step_grad<kCorrected>(g_in, i);
    g = c.maximize ? -g : g;
    g = c.l2 ? std::fma(c.weight_decay, w, g) : g;
    scalar_t d = g;
    if constexpr (kMomentum) {
      // first: torch clones the gradient into the new buffer, so the old contents (zeros, garbage) never matter
      scalar_t b = g;
      if constexpr (!kFirst) b = std::fma(c.one_minus_dampening, g, buf[i] * c.momentum);
      buf[i] = b;
      d = c.nesterov ? std::fma(c.momentum, b, g) : b;
    }
    out[i] = sharpened<kSharpened>(g_in, i, std::fma(c.neg_lr, d, w));
  }
}

template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected, bool kSharpened>
void sgd_run(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf, int64_t n,
             const SgdConstants<scalar_t>& c) {
  sgd_loop<scalar_t, kMomentum, kFirst, kCorrected, kSharpened>(out, g_in, w_in, buf, n, c);
}

template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected, bool kSharpened>
GEARSAM_FMA_CLONE void sgd_run_fma(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf,
                                   int64_t n, const SgdConstants<scalar_t>& c) {
  sgd_loop<scalar_t, kMomentum, kFirst, kCorrected, kSharpened>(out, g_in, w_in, buf, n, c);
}

#if defined(GEARSAM_VEC)
// The step's gradient for vector i of a run, as in the scalar loops: step_grad, negated for maximize, plus L2 weight
// decay of w where the optimizer couples it (SgdConstants and AdamConstants name these fields alike).
template <bool kCorrected, typename scalar_t, typename Constants>
GEARSAM_INLINE GEARSAM_FMA_CLONE typename Vec<scalar_t>::V vec_step_grad(const TileGrad<scalar_t>& g_in, int64_t i,
                                                                        typename Vec<scalar_t>::V w,
                                                                        const Constants& c) {
  using V = Vec<scalar_t>;
  auto g = V::load(g_in.grad + i);
  if constexpr (kCorrected)
    g = V::fma(V::set1(g_in.scale), V::load(g_in.correction + i), V::mul(V::set1(g_in.grad_scale), g));
  if (c.maximize) g = V::neg(g);
  if (c.l2) g = V::fma(V::set1(c.weight_decay), w, g);
  return g;
}

// A vector of the new parameter to memory: streamed past the caches, or stored where the pass has just read the line.
template <bool kStream, typename scalar_t>
GEARSAM_INLINE GEARSAM_FMA_CLONE void put(scalar_t* out, typename Vec<scalar_t>::V x) {
  if constexpr (kStream)
    Vec<scalar_t>::stream(out, x);
  else
    Vec<scalar_t>::store(out, x);
}

// sharpened for vector i of a run.
template <bool kSharpened, typename scalar_t>
GEARSAM_INLINE GEARSAM_FMA_CLONE typename Vec<scalar_t>::V vec_sharpened(const TileGrad<scalar_t>& g_in, int64_t i,
                                                                        typename Vec<scalar_t>::V w_new) {
  using V = Vec<scalar_t>;
  if constexpr (kSharpened)
    return V::fma(V::set1(g_in.sharpness_step), V::sub(V::load(g_in.grad + i), V::load(g_in.correction + i)), w_new);
  else
    return w_new;
}

// sgd_loop in vectors (vec.h), operation for operation, the parameter streamed out (kStream) or stored in place.
template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected, bool kSharpened, bool kStream>
GEARSAM_FMA_CLONE void sgd_vector(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf,
                                  int64_t n, const SgdConstants<scalar_t> c) {
  using V = Vec<scalar_t>;
  const auto momentum = V::set1(c.momentum);
  const auto one_minus_dampening = V::set1(c.one_minus_dampening), neg_lr = V::set1(c.neg_lr);
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const auto w = V::load(w_in + i);
    const auto g = vec_step_grad<kCorrected>(g_in, i, w, c);
    auto d = g;
    if constexpr (kMomentum) {
      auto b = g;
      if constexpr (!kFirst) b = V::fma(one_minus_dampening, g, V::mul(V::load(buf + i), momentum));
      V::store(buf + i, b);
      d = c.nesterov ? V::fma(momentum, b, g) : b;
    }
    put<kStream, scalar_t>(out + i, vec_sharpened<kSharpened>(g_in, i, V::fma(neg_lr, d, w)));
  }
}
#endif

// Each tile in runs of at most kScratch elements; a run's parameter is written in place, or, past the caches
// (`past`), by the vector loop (where vec_streams: the stores then leave while the loop still loads, which keeps the
// memory busier than a burst of stores after each run) or into scratch and streamed out. The vector loop streams its
// stores where the parameter is not its input (w_in is the backup), and stores them plainly where it is (w_in == out):
// those lines were just read, so a plain store reads nothing more.
template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected, bool kSharpened>
void sgd_tiles(scalar_t* out, const scalar_t* g_in, const CorrectionData<scalar_t>& correction, const scalar_t* w_in,
               scalar_t* buf, int64_t n_tiles, int64_t tile, bool past, const SgdConstants<scalar_t>& c,
               const TileEnergy<scalar_t>& energy) {
  const bool fma = cpu_has_fma(), stream = past && w_in != out;
  for_each_run(n_tiles, tile, correction, g_in, energy, [&](const TileGrad<scalar_t>& g, int64_t start, int64_t n,
                                                     scalar_t* scratch) {
#if defined(GEARSAM_VEC)
    if (past && vec_streams(out + start, n))
      return with_flag(stream, [&](auto s) {
        sgd_vector<scalar_t, kMomentum, kFirst, kCorrected, kSharpened, decltype(s)::value>(
            out + start, g, w_in + start, offset(buf, start), n, c);
      });
#endif
    scalar_t* dst = stream ? scratch : out + start;
    if (fma)
      sgd_run_fma<scalar_t, kMomentum, kFirst, kCorrected, kSharpened>(dst, g, w_in + start, offset(buf, start), n,
                                                                       c);
    else
      sgd_run<scalar_t, kMomentum, kFirst, kCorrected, kSharpened>(dst, g, w_in + start, offset(buf, start), n, c);
    if (stream) stream_copy(out + start, scratch, n * sizeof(scalar_t));
  });
}

template <typename scalar_t>
void sgd_tiles(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,
               const at::Tensor& momentum_buffer, int64_t tile, const SgdOptions& o, const Correction& correction,
               const MomentumEnergy& e) {
  const SgdConstants<scalar_t> c(o);
  scalar_t* out = param.mutable_data_ptr<scalar_t>();
  const scalar_t* g_in = grad.const_data_ptr<scalar_t>();
  const CorrectionData<scalar_t> cd(correction, o.lr);
  const scalar_t* w_in = backup.const_data_ptr<scalar_t>();
  scalar_t* buf = c.with_momentum ? momentum_buffer.mutable_data_ptr<scalar_t>() : nullptr;
  const int64_t n_tiles = param.numel() / tile;
  const bool past = stream_stores(param.nbytes());
  const TileEnergy<scalar_t> energy(momentum_buffer, e, tile);
  with_correction_flags(correction, [&](auto corrected, auto sharpened) {
    constexpr bool kC = decltype(corrected)::value, kS = decltype(sharpened)::value;
    if (!c.with_momentum)
      sgd_tiles<scalar_t, false, false, kC, kS>(out, g_in, cd, w_in, buf, n_tiles, tile, past, c, energy);
    else if (c.first)
      sgd_tiles<scalar_t, true, true, kC, kS>(out, g_in, cd, w_in, buf, n_tiles, tile, past, c, energy);
    else
      sgd_tiles<scalar_t, true, false, kC, kS>(out, g_in, cd, w_in, buf, n_tiles, tile, past, c, energy);
  });
}

// Adam's pass 1 over a run of n elements: the moments, and into second[i] the second moment to take the root of.
template <typename scalar_t, bool kAmsgrad, bool kCorrected>
GEARSAM_INLINE void adam_moments_loop(const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io,
                                      scalar_t* v_io, scalar_t* vmax_io, scalar_t* second, int64_t n,
                                      const AdamConstants<scalar_t> c) {
  for (int64_t i = 0; i < n; ++i) {
    scalar_t g = step_grad<kCorrected>(g_in, i);
    g = c.maximize ? -g : g;
    g = c.l2 ? std::fma(c.weight_decay, w_in[i], g) : g;
    // ATen's lerp: from m for a small weight, from the end point g otherwise (lerp_weight is then weight - 1)
    const scalar_t m = m_io[i];
    m_io[i] = std::fma(c.lerp_weight, g - m, c.lerp_small ? m : g);
    const scalar_t v = std::fma(c.one_minus_beta2 * g, g, v_io[i] * c.beta2);
    v_io[i] = v;
    scalar_t s = v;
    if constexpr (kAmsgrad) {
      s = nan_max(vmax_io[i], v);
      vmax_io[i] = s;
    }
    second[i] = s;
  }
}

// Adam's pass 2 over the same run, while it is in L1: the parameter from the backup (decayed first for AdamW, as
// torch decays before it steps). Element i of the backup is read before out[i] is written, so backup may be param.
// The square root is the correctly rounded one (std::sqrt; the build's -fno-math-errno lets the loop vectorise), as
// on CUDA and in Triton; then a multiply, an add and two true divisions, each rounding on its own (no fma), so the
// bits do not depend on the instruction set the loop is compiled for. Two loops, not one: GCC vectorises each, not
// their fusion.
template <typename scalar_t, bool kSharpened>
GEARSAM_INLINE void adam_update_loop(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in,
                                     const scalar_t* m_io, const scalar_t* second, int64_t n,
                                     const AdamConstants<scalar_t> c) {
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t w = c.decoupled ? w_in[i] * c.decay : w_in[i];
    const scalar_t denom = std::sqrt(second[i]) / c.bias_correction2_sqrt + c.eps;
    out[i] = sharpened<kSharpened>(g_in, i, w + (c.neg_step_size * m_io[i]) / denom);
  }
}

// One run: pass 1, then pass 2 into dst, while the run is in L1.
template <typename scalar_t, bool kAmsgrad, bool kCorrected, bool kSharpened>
GEARSAM_INLINE void adam_loop(scalar_t* dst, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io,
                              scalar_t* v_io, scalar_t* vmax_io, int64_t n, const AdamConstants<scalar_t>& c) {
  scalar_t second[kScratch];
  adam_moments_loop<scalar_t, kAmsgrad, kCorrected>(g_in, w_in, m_io, v_io, vmax_io, second, n, c);
  adam_update_loop<scalar_t, kSharpened>(dst, g_in, w_in, m_io, second, n, c);
}

template <typename scalar_t, bool kAmsgrad, bool kCorrected, bool kSharpened>
void adam_run(scalar_t* dst, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io, scalar_t* v_io,
              scalar_t* vmax_io, int64_t n, const AdamConstants<scalar_t>& c) {
  adam_loop<scalar_t, kAmsgrad, kCorrected, kSharpened>(dst, g_in, w_in, m_io, v_io, vmax_io, n, c);
}

template <typename scalar_t, bool kAmsgrad, bool kCorrected, bool kSharpened>
GEARSAM_FMA_CLONE void adam_run_fma(scalar_t* dst, const TileGrad<scalar_t> g_in, const scalar_t* w_in,
                                    scalar_t* m_io, scalar_t* v_io, scalar_t* vmax_io, int64_t n,
                                    const AdamConstants<scalar_t>& c) {
  adam_loop<scalar_t, kAmsgrad, kCorrected, kSharpened>(dst, g_in, w_in, m_io, v_io, vmax_io, n, c);
}

#if defined(GEARSAM_VEC)
// adam_loop's two passes fused into one vector loop (vec.h), operation for operation, the parameter streamed out
// (kStream) or stored in place: past the caches the memory then stays busy while the divider works (two passes leave
// it idle during the second).
template <typename scalar_t, bool kAmsgrad, bool kCorrected, bool kSharpened, bool kStream>
GEARSAM_FMA_CLONE void adam_vector(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in,
                                   scalar_t* m_io, scalar_t* v_io, scalar_t* vmax_io, int64_t n,
                                   const AdamConstants<scalar_t> c) {
  using V = Vec<scalar_t>;
  const auto lerp_weight = V::set1(c.lerp_weight), one_minus_beta2 = V::set1(c.one_minus_beta2);
  const auto beta2 = V::set1(c.beta2), decay = V::set1(c.decay);
  const auto bias_correction2_sqrt = V::set1(c.bias_correction2_sqrt), eps = V::set1(c.eps);
  const auto neg_step_size = V::set1(c.neg_step_size);
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const auto w_old = V::load(w_in + i);
    const auto g = vec_step_grad<kCorrected>(g_in, i, w_old, c);
    const auto m_old = V::load(m_io + i);
    const auto m = V::fma(lerp_weight, V::sub(g, m_old), c.lerp_small ? m_old : g);
    V::store(m_io + i, m);
    const auto v = V::fma(V::mul(one_minus_beta2, g), g, V::mul(V::load(v_io + i), beta2));
    V::store(v_io + i, v);
    auto second = v;
    if constexpr (kAmsgrad) {
      second = V::nan_max(V::load(vmax_io + i), v);
      V::store(vmax_io + i, second);
    }
    const auto w = c.decoupled ? V::mul(w_old, decay) : w_old;
    const auto denom = V::add(V::div(V::sqrt(second), bias_correction2_sqrt), eps);
    const auto updated = V::add(w, V::div(V::mul(neg_step_size, m), denom));
    put<kStream, scalar_t>(out + i, vec_sharpened<kSharpened>(g_in, i, updated));
  }
}
#endif

// Each tile in runs of at most kScratch elements, as sgd_tiles.
template <typename scalar_t, bool kAmsgrad, bool kCorrected, bool kSharpened>
void adam_tiles(scalar_t* out, const scalar_t* g_in, const CorrectionData<scalar_t>& correction,
                const scalar_t* w_in, scalar_t* m, scalar_t* v, scalar_t* vmax, int64_t n_tiles, int64_t tile,
                bool past, const AdamConstants<scalar_t>& c, const TileEnergy<scalar_t>& energy) {
  const bool fma = cpu_has_fma(), stream = past && w_in != out;
  for_each_run(n_tiles, tile, correction, g_in, energy, [&](const TileGrad<scalar_t>& g, int64_t start, int64_t n,
                                                     scalar_t* scratch) {
    scalar_t* vmax_at = offset(vmax, start);
#if defined(GEARSAM_VEC)
    if (past && vec_streams(out + start, n))
      return with_flag(stream, [&](auto s) {
        adam_vector<scalar_t, kAmsgrad, kCorrected, kSharpened, decltype(s)::value>(out + start, g, w_in + start,
                                                                                   m + start, v + start, vmax_at, n, c);
      });
#endif
    scalar_t* dst = stream ? scratch : out + start;
    if (fma)
      adam_run_fma<scalar_t, kAmsgrad, kCorrected, kSharpened>(dst, g, w_in + start, m + start, v + start, vmax_at,
                                                               n, c);
    else
      adam_run<scalar_t, kAmsgrad, kCorrected, kSharpened>(dst, g, w_in + start, m + start, v + start, vmax_at, n,
                                                           c);
    if (stream) stream_copy(out + start, scratch, n * sizeof(scalar_t));
  });
}

template <typename scalar_t>
void adam_tiles(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t tile,
                const AdamOptions& o, const Correction& correction, const MomentumEnergy& e) {
  const AdamConstants<scalar_t> c(o);
  scalar_t* out = param.mutable_data_ptr<scalar_t>();
  const scalar_t* g_in = grad.const_data_ptr<scalar_t>();
  const CorrectionData<scalar_t> cd(correction, o.lr);
  const scalar_t* w_in = backup.const_data_ptr<scalar_t>();
  scalar_t* m = exp_avg.mutable_data_ptr<scalar_t>();
  scalar_t* v = exp_avg_sq.mutable_data_ptr<scalar_t>();
  scalar_t* vmax = c.amsgrad ? max_exp_avg_sq.mutable_data_ptr<scalar_t>() : nullptr;
  const int64_t n_tiles = param.numel() / tile;
  const bool past = stream_stores(param.nbytes());
  const TileEnergy<scalar_t> energy(exp_avg, e, tile);
  with_correction_flags(correction, [&](auto corrected, auto sharpened) {
    with_flag(c.amsgrad, [&](auto amsgrad) {
      constexpr bool kA = decltype(amsgrad)::value, kC = decltype(corrected)::value, kS = decltype(sharpened)::value;
      adam_tiles<scalar_t, kA, kC, kS>(out, g_in, cd, w_in, m, v, vmax, n_tiles, tile, past, c, energy);
    });
  });
}

// found_inf nonzero: the step is skipped, param brought back to backup (a no-op where backup is param itself).
bool skip_step(const at::Tensor& param, const at::Tensor& backup, const DeviceStep& device_step) {
  if (!device_step.found_inf.defined() || *device_step.found_inf.const_data_ptr<float>() == 0) return false;
  if (!backup.is_same(param)) restore(param, backup);
  return true;
}

// Where param and backup may exchange their memory (exchange.h), they do, and the step reads w from param and
// updates it in place (param is returned): the same bytes as reading the backup and streaming param out, every store
// to a line just read; backup then holds w + eps. Else backup.
const at::Tensor& weights_in_place(const at::Tensor& param, const at::Tensor& backup) {
  return try_exchange_memory(param, backup) ? param : backup;  // never where backup is param: one storage
}

// The options of this step: the host's, or those at the (lr, k) of scalars.
template <typename Options>
Options step_options(const Options& options, const DeviceStep& device_step) {
  if (!device_step.scalars.defined()) return options;
  const double* s = device_step.scalars.const_data_ptr<double>();
  return options.at_step(s[0], s[1]);
}

}  // namespace

void sgd_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,
              const at::Tensor& momentum_buffer, int64_t tile, const SgdOptions& options,
              const Correction& correction, const DeviceStep& device_step, const MomentumEnergy& energy) {
  if (skip_step(param, backup, device_step)) return;
  const SgdOptions o = step_options(options, device_step);
  const at::Tensor& w = weights_in_place(param, backup);
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_sgd_step_cpu", [&] {
    sgd_tiles<scalar_t>(param, grad, w, momentum_buffer, tile, o, correction, energy);
  });
  if (energy.given()) block_sums(energy.partials, energy.first_tile_of_block, energy.energy, param.numel() / tile);
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t tile,
               const AdamOptions& options, const Correction& correction, const DeviceStep& device_step,
               const MomentumEnergy& energy) {
  if (skip_step(param, backup, device_step)) return;
  const AdamOptions o = step_options(options, device_step);
  const at::Tensor& w = weights_in_place(param, backup);
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_adam_step_cpu", [&] {
    adam_tiles<scalar_t>(param, grad, w, exp_avg, exp_avg_sq, max_exp_avg_sq, tile, o, correction, energy);
  });
  if (energy.given()) block_sums(energy.partials, energy.first_tile_of_block, energy.energy, param.numel() / tile);
}

}  // namespace gearsam::cpu
