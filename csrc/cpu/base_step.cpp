// SAM's restore fused with the base optimizer's update on the CPU: one pass reads backup (w; param holds w + eps and
// is never read), writes param and the optimizer state. backup may be param itself: every loop reads an element
// before writing it, and no pointer is declared restrict. Per element, in the buffers' type, each scalar rounded once
// to it (SgdConstants / AdamConstants), fma rounding once, every other operation rounding on its own:
//
//   both:  g = fma(C(c[block]), correction, grad) if correction      (c = correction_scale, C rounds once to the type)
//   sgd:   g = g (negated if maximize);  g = fma(wd, w, g) if wd != 0
//          b = g (first) or fma(1 - dampening, g, buf * momentum);  buf = b;  d = fma(momentum, b, g) (nesterov) or b
//          (d = g without momentum);  w <- fma(-lr, d, w)
//   adam:  g = g (negated if maximize);  w = w * decay (AdamW) or g = fma(wd, w, g) (Adam), if wd != 0
//          m = lerp(m, g, 1 - beta1);  v = fma((1 - beta2) * g, g, v * beta2);  vmax = max(vmax, v) (amsgrad)
//          w <- w + (-step_size * m) / (sqrt(v or vmax) / bias_correction2_sqrt + eps)
//
// These are the roundings of ATen's CPU kernels for add(alpha=), mul_, lerp_, addcmul_, div and addcdiv_, and the
// square root is ATen's own (see torch_sqrt_), so the results equal restore_ followed by torch.optim.SGD / Adam /
// AdamW (foreach=False), bit for bit. The build uses -ffp-contract=off, so only the std::fma calls fuse. Zero padding
// stays zero (with eps > 0 for Adam).

#include <ATen/Dispatch.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sqrt.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../gearsam.h"
#include "tiles.h"

namespace gearsam::cpu {
namespace {

// torch.maximum's rule: NaN from either side wins, so a NaN second moment stays visible instead of being dropped.
template <typename T>
T nan_max(T a, T b) {
  return (a < b || std::isnan(b)) ? b : a;
}

// x86-64 CPUs without FMA exist, so the build cannot assume it, and std::fma is then a call into libm per element:
// correct, but it stops vectorisation (6x slower than the perturbation). So every loop below is compiled twice, once
// for AVX2 + FMA, where the fma is one instruction and the loop vectorises, and the CPU picks at run time. Both give
// the same bits: an fma rounds once either way.
#if defined(__GNUC__) && defined(__x86_64__)
#define GEARSAM_FMA_CLONE __attribute__((target("avx2,fma")))
bool cpu_has_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#else
#define GEARSAM_FMA_CLONE
bool cpu_has_fma() { return false; }
#endif

#if defined(__GNUC__)
#define GEARSAM_INLINE inline __attribute__((always_inline))
#else
#define GEARSAM_INLINE inline
#endif

// Calls fn with std::true_type or std::false_type: a run-time flag turned into a template parameter.
template <typename Fn>
void with_flag(bool flag, const Fn& fn) {
  if (flag)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

// Where one tile's gradient comes from: grad, and with LookSAM's correction the tile's values and its block's scale
// rounded once to scalar_t (C(c[block]) above).
template <typename scalar_t>
struct TileGrad {
  const scalar_t* grad;
  const scalar_t* correction;  // null without a correction
  scalar_t scale;
};

// The correction's data (null without one), read per tile by TileGrad.
template <typename scalar_t>
struct CorrectionData {
  const scalar_t* values = nullptr;
  const double* scale = nullptr;
  const int32_t* tile_block = nullptr;

  explicit CorrectionData(const Correction& c) {
    if (!c.given()) return;
    values = c.values.const_data_ptr<scalar_t>();
    scale = c.scale.const_data_ptr<double>();
    tile_block = c.tile_block.const_data_ptr<int32_t>();
  }
  TileGrad<scalar_t> tile(const scalar_t* grad, int64_t t) const {
    return {grad, values, values ? static_cast<scalar_t>(scale[tile_block[t]]) : scalar_t(0)};
  }
};

// The gradient element i the step uses, before maximize's negation: a template flag, so that a step without a
// correction loads nothing more.
template <bool kCorrected, typename scalar_t>
GEARSAM_INLINE scalar_t step_grad(const TileGrad<scalar_t>& g, int64_t i) {
  if constexpr (kCorrected)
    return std::fma(g.scale, g.correction[i], g.grad[i]);
  else
    return g.grad[i];
}

// The flags that decide whether a buffer is loaded or stored are template parameters: a loop without control flow
// vectorises. The others are loop-invariant selects, which the compiler turns into blends.
template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
GEARSAM_INLINE void sgd_loop(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf,
                             int64_t begin, int64_t end, const SgdConstants<scalar_t>& c) {
  for (int64_t i = begin; i < end; ++i) {
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
    out[i] = std::fma(c.neg_lr, d, w);
  }
}

template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
void sgd_range(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf, int64_t begin,
               int64_t end, const SgdConstants<scalar_t>& c) {
  sgd_loop<scalar_t, kMomentum, kFirst, kCorrected>(out, g_in, w_in, buf, begin, end, c);
}

template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
GEARSAM_FMA_CLONE void sgd_range_fma(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in,
                                     scalar_t* buf, int64_t begin, int64_t end, const SgdConstants<scalar_t>& c) {
  sgd_loop<scalar_t, kMomentum, kFirst, kCorrected>(out, g_in, w_in, buf, begin, end, c);
}

template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
void sgd_tiles(scalar_t* out, const scalar_t* g_in, const CorrectionData<scalar_t>& correction, const scalar_t* w_in,
               scalar_t* buf, int64_t n_tiles, int64_t tile, const SgdConstants<scalar_t>& c) {
  const bool fma = cpu_has_fma();
  for_each_tile(n_tiles, tile, [&](int64_t t) {
    const TileGrad<scalar_t> g = correction.tile(g_in, t);
    if (fma)
      sgd_range_fma<scalar_t, kMomentum, kFirst, kCorrected>(out, g, w_in, buf, t * tile, (t + 1) * tile, c);
    else
      sgd_range<scalar_t, kMomentum, kFirst, kCorrected>(out, g, w_in, buf, t * tile, (t + 1) * tile, c);
  });
}

template <typename scalar_t>
void sgd_tiles(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,
               const at::Tensor& momentum_buffer, int64_t tile, const SgdConstants<scalar_t>& c,
               const Correction& correction) {
  scalar_t* out = param.mutable_data_ptr<scalar_t>();
  const scalar_t* g_in = grad.const_data_ptr<scalar_t>();
  const CorrectionData<scalar_t> cd(correction);
  const scalar_t* w_in = backup.const_data_ptr<scalar_t>();
  scalar_t* buf = c.with_momentum ? momentum_buffer.mutable_data_ptr<scalar_t>() : nullptr;
  const int64_t n_tiles = param.numel() / tile;
  with_flag(correction.given(), [&](auto corrected) {
    constexpr bool kC = decltype(corrected)::value;
    if (!c.with_momentum)
      sgd_tiles<scalar_t, false, false, kC>(out, g_in, cd, w_in, buf, n_tiles, tile, c);
    else if (c.first)
      sgd_tiles<scalar_t, true, true, kC>(out, g_in, cd, w_in, buf, n_tiles, tile, c);
    else
      sgd_tiles<scalar_t, true, false, kC>(out, g_in, cd, w_in, buf, n_tiles, tile, c);
  });
}

// torch.sqrt on the CPU is not always correctly rounded: where torch is built with MKL (the x86 wheels), ATen takes
// square roots with MKL's vector math, within 1 ulp but off the correctly rounded value for about 1 in 6 float32 and
// 1 in 80 float64 inputs. Running ATen's own sqrt over each chunk keeps the step bitwise equal to torch.optim on any
// build; it is elementwise, so the chunking does not change its bits.
template <typename scalar_t>
void torch_sqrt_(scalar_t* values, int64_t n) {
  at::Tensor chunk = at::from_blob(values, {n}, at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
  at::sqrt_(chunk);
}

// Elements per call of torch_sqrt_: long enough to amortise the dispatch, short enough to stay in L1 between passes.
constexpr int64_t kSqrtChunk = 2048;

// Adam's pass 1 over elements [begin, end): the moments, and into root[] the second moment to take the root of.
template <typename scalar_t, bool kAmsgrad, bool kCorrected>
GEARSAM_INLINE void adam_moments_loop(const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io,
                                      scalar_t* v_io, scalar_t* vmax_io, scalar_t* root, int64_t begin, int64_t end,
                                      const AdamConstants<scalar_t>& c) {
  for (int64_t i = begin; i < end; ++i) {
    scalar_t g = step_grad<kCorrected>(g_in, i);
    g = c.maximize ? -g : g;
    g = c.l2 ? std::fma(c.weight_decay, w_in[i], g) : g;
    // ATen's lerp: from m for a small weight, from the end point g otherwise (lerp_weight is then weight - 1)
    const scalar_t m = m_io[i];
    m_io[i] = std::fma(c.lerp_weight, g - m, c.small_weight ? m : g);
    const scalar_t v = std::fma(c.one_minus_beta2 * g, g, v_io[i] * c.beta2);
    v_io[i] = v;
    scalar_t second = v;
    if constexpr (kAmsgrad) {
      second = nan_max(vmax_io[i], v);
      vmax_io[i] = second;
    }
    root[i - begin] = second;
  }
}

// Adam's pass 2: the parameter from the backup (decayed first for AdamW, as torch decays before it steps). Element i
// of the backup is read before out[i] is written, so backup may be param.
template <typename scalar_t>
GEARSAM_INLINE void adam_update_loop(scalar_t* out, const scalar_t* w_in, const scalar_t* m_io, const scalar_t* root,
                                     int64_t begin, int64_t end, const AdamConstants<scalar_t>& c) {
  for (int64_t i = begin; i < end; ++i) {
    const scalar_t w = c.decoupled ? w_in[i] * c.decay : w_in[i];
    const scalar_t denom = root[i - begin] / c.bias_correction2_sqrt + c.eps;
    out[i] = w + (c.neg_step_size * m_io[i]) / denom;
  }
}

template <typename scalar_t, bool kAmsgrad, bool kCorrected>
void adam_moments(const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io, scalar_t* v_io,
                  scalar_t* vmax_io, scalar_t* root, int64_t begin, int64_t end, const AdamConstants<scalar_t>& c) {
  adam_moments_loop<scalar_t, kAmsgrad, kCorrected>(g_in, w_in, m_io, v_io, vmax_io, root, begin, end, c);
}

template <typename scalar_t, bool kAmsgrad, bool kCorrected>
GEARSAM_FMA_CLONE void adam_moments_fma(const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io,
                                        scalar_t* v_io, scalar_t* vmax_io, scalar_t* root, int64_t begin, int64_t end,
                                        const AdamConstants<scalar_t>& c) {
  adam_moments_loop<scalar_t, kAmsgrad, kCorrected>(g_in, w_in, m_io, v_io, vmax_io, root, begin, end, c);
}

template <typename scalar_t>
void adam_moments_dispatch(bool fma, const TileGrad<scalar_t>& g_in, const scalar_t* w_in, scalar_t* m_io,
                           scalar_t* v_io, scalar_t* vmax_io, scalar_t* root, int64_t begin, int64_t end,
                           const AdamConstants<scalar_t>& c) {
  with_flag(g_in.correction != nullptr, [&](auto corrected) {
    with_flag(c.amsgrad, [&](auto amsgrad) {
      constexpr bool kA = decltype(amsgrad)::value, kC = decltype(corrected)::value;
      if (fma)
        adam_moments_fma<scalar_t, kA, kC>(g_in, w_in, m_io, v_io, vmax_io, root, begin, end, c);
      else
        adam_moments<scalar_t, kA, kC>(g_in, w_in, m_io, v_io, vmax_io, root, begin, end, c);
    });
  });
}

template <typename scalar_t>
void adam_tiles(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t tile,
                const AdamConstants<scalar_t>& c, const Correction& correction) {
  scalar_t* out = param.mutable_data_ptr<scalar_t>();
  const scalar_t* g_in = grad.const_data_ptr<scalar_t>();
  const CorrectionData<scalar_t> cd(correction);
  const scalar_t* w_in = backup.const_data_ptr<scalar_t>();
  scalar_t* m_io = exp_avg.mutable_data_ptr<scalar_t>();
  scalar_t* v_io = exp_avg_sq.mutable_data_ptr<scalar_t>();
  scalar_t* vmax_io = c.amsgrad ? max_exp_avg_sq.mutable_data_ptr<scalar_t>() : nullptr;
  const bool fma = cpu_has_fma();
  for_each_tile(param.numel() / tile, tile, [&](int64_t t) {
    const TileGrad<scalar_t> g = cd.tile(g_in, t);
    scalar_t root[kSqrtChunk];
    for (int64_t start = t * tile; start < (t + 1) * tile; start += kSqrtChunk) {
      const int64_t end = std::min(start + kSqrtChunk, (t + 1) * tile);
      adam_moments_dispatch(fma, g, w_in, m_io, v_io, vmax_io, root, start, end, c);
      torch_sqrt_(root, end - start);
      adam_update_loop(out, w_in, m_io, root, start, end, c);  // no fma: the same code for every CPU
    }
  });
}

}  // namespace

void sgd_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,
              const at::Tensor& momentum_buffer, int64_t tile, const SgdOptions& options,
              const Correction& correction) {
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_sgd_step_cpu", [&] {
    sgd_tiles<scalar_t>(param, grad, backup, momentum_buffer, tile, SgdConstants<scalar_t>(options), correction);
  });
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t tile,
               const AdamOptions& options, const Correction& correction) {
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_adam_step_cpu", [&] {
    adam_tiles<scalar_t>(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, tile,
                         AdamConstants<scalar_t>(options), correction);
  });
}

}  // namespace gearsam::cpu
