// SAM's restore fused with the base optimizer's update on the CPU: one pass reads backup (w; param holds w + eps and
// is never read), writes param and the optimizer state. backup may be param itself: every loop reads an element
// before writing it, and no pointer is declared restrict. The update and its roundings are stated once, in
// gearsam_fused/base_step.py; here each scalar is rounded once to the buffers' type (SgdConstants / AdamConstants),
// only the std::fma calls fuse (the build uses -ffp-contract=off), and the square root is ATen's own (see
// torch_sqrt_), so the results equal restore_ followed by torch.optim.SGD / Adam / AdamW (foreach=False), bit for bit.
// Zero padding stays zero (with eps > 0 for Adam).
//
// Structure (csrc/README.md, "Memory traffic"): tiles split between threads; a parameter larger than the last-level
// cache is written with non-temporal stores (stream.h), from a scratch run or, for Adam, from AVX2 registers; Adam runs
// in chunks of a thread's tiles, so that ATen's square root is called once per chunk.
//
// Capturable arguments (gearsam.h) are CPU tensors here, read on the host before the step: scalars' (lr, k) replace
// the options' through at_step, so the constants are those of the host call with the same lr and k; found_inf
// nonzero turns the step into restore (param = backup, nothing where backup is param itself) and touches no state.

#include <ATen/Dispatch.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sqrt.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../gearsam.h"
#include "stream.h"
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

  // The same source from element `offset` on.
  TileGrad at(int64_t offset) const { return {grad + offset, correction ? correction + offset : nullptr, scale}; }
};

// The correction's data (null without one), read per tile by TileGrad.
template <typename scalar_t>
struct CorrectionData {
  const scalar_t* values = nullptr;
  const double* scale = nullptr;
  const int32_t* block_of_tile = nullptr;

  explicit CorrectionData(const Correction& c) {
    if (!c.given()) return;
    values = c.values.const_data_ptr<scalar_t>();
    scale = c.scale.const_data_ptr<double>();
    block_of_tile = c.block_of_tile.const_data_ptr<int32_t>();
  }
  TileGrad<scalar_t> tile(const scalar_t* grad, int64_t t) const {
    return {grad, values, values ? static_cast<scalar_t>(scale[block_of_tile[t]]) : scalar_t(0)};
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

// Elements a pass computes into a scratch buffer before streaming them to an output it does not read (stream.h).
constexpr int64_t kScratch = 2048;

// Offsets a pointer that may be null (a buffer the optimizer does not have).
template <typename T>
T* offset(T* p, int64_t i) {
  return p ? p + i : nullptr;
}

// The flags that decide whether a buffer is loaded or stored are template parameters: a loop without control flow
// vectorises. The others are loop-invariant selects, which the compiler turns into blends. Every pointer points at the
// run's first element.
template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
GEARSAM_INLINE void sgd_loop(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf,
                             int64_t n, const SgdConstants<scalar_t>& c) {
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
    out[i] = std::fma(c.neg_lr, d, w);
  }
}

template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
void sgd_run(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf, int64_t n,
             const SgdConstants<scalar_t>& c) {
  sgd_loop<scalar_t, kMomentum, kFirst, kCorrected>(out, g_in, w_in, buf, n, c);
}

template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
GEARSAM_FMA_CLONE void sgd_run_fma(scalar_t* out, const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* buf,
                                   int64_t n, const SgdConstants<scalar_t>& c) {
  sgd_loop<scalar_t, kMomentum, kFirst, kCorrected>(out, g_in, w_in, buf, n, c);
}

// Each tile in runs of at most kScratch elements; a run's parameter is written in place, or into scratch and streamed
// out when `stream`.
template <typename scalar_t, bool kMomentum, bool kFirst, bool kCorrected>
void sgd_tiles(scalar_t* out, const scalar_t* g_in, const CorrectionData<scalar_t>& correction, const scalar_t* w_in,
               scalar_t* buf, int64_t n_tiles, int64_t tile, bool stream, const SgdConstants<scalar_t>& c) {
  const bool fma = cpu_has_fma();
  for_each_tile(n_tiles, tile, [&](int64_t t) {
    const TileGrad<scalar_t> g = correction.tile(g_in, t);
    scalar_t scratch[kScratch];
    for (int64_t start = t * tile; start < (t + 1) * tile; start += kScratch) {
      const int64_t n = std::min(kScratch, (t + 1) * tile - start);
      scalar_t* dst = stream ? scratch : out + start;
      if (fma)
        sgd_run_fma<scalar_t, kMomentum, kFirst, kCorrected>(dst, g.at(start), w_in + start, offset(buf, start), n, c);
      else
        sgd_run<scalar_t, kMomentum, kFirst, kCorrected>(dst, g.at(start), w_in + start, offset(buf, start), n, c);
      if (stream) stream_copy(out + start, scratch, n * sizeof(scalar_t));
    }
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
  const bool stream = stream_stores(param.nbytes());
  with_flag(correction.given(), [&](auto corrected) {
    constexpr bool kC = decltype(corrected)::value;
    if (!c.with_momentum)
      sgd_tiles<scalar_t, false, false, kC>(out, g_in, cd, w_in, buf, n_tiles, tile, stream, c);
    else if (c.first)
      sgd_tiles<scalar_t, true, true, kC>(out, g_in, cd, w_in, buf, n_tiles, tile, stream, c);
    else
      sgd_tiles<scalar_t, true, false, kC>(out, g_in, cd, w_in, buf, n_tiles, tile, stream, c);
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

// Elements per call of torch_sqrt_: long enough that ATen's dispatch (a few microseconds per call) is small beside
// the chunk's memory traffic, short enough that the chunk's roots, moments and weights stay in L2 between the passes.
constexpr int64_t kSqrtChunk = 16384;

// Adam's pass 1 over n elements: the moments, and into root[i] the second moment to take the root of.
template <typename scalar_t, bool kAmsgrad, bool kCorrected>
GEARSAM_INLINE void adam_moments_loop(const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io,
                                      scalar_t* v_io, scalar_t* vmax_io, scalar_t* root, int64_t n,
                                      const AdamConstants<scalar_t>& c) {
  for (int64_t i = 0; i < n; ++i) {
    scalar_t g = step_grad<kCorrected>(g_in, i);
    g = c.maximize ? -g : g;
    g = c.l2 ? std::fma(c.weight_decay, w_in[i], g) : g;
    // ATen's lerp: from m for a small weight, from the end point g otherwise (lerp_weight is then weight - 1)
    const scalar_t m = m_io[i];
    m_io[i] = std::fma(c.lerp_weight, g - m, c.lerp_small ? m : g);
    const scalar_t v = std::fma(c.one_minus_beta2 * g, g, v_io[i] * c.beta2);
    v_io[i] = v;
    scalar_t second = v;
    if constexpr (kAmsgrad) {
      second = nan_max(vmax_io[i], v);
      vmax_io[i] = second;
    }
    root[i] = second;
  }
}

// Adam's pass 2: the parameter from the backup (decayed first for AdamW, as torch decays before it steps). Element i
// of the backup is read before out[i] is written, so backup may be param. A multiply, an add and two divisions, each
// rounding on its own (no fma), so the bits do not depend on the instruction set the loop is compiled for.
template <typename scalar_t>
GEARSAM_INLINE void adam_update_loop(scalar_t* out, const scalar_t* w_in, const scalar_t* m_io, const scalar_t* root,
                                     int64_t n, const AdamConstants<scalar_t>& c) {
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t w = c.decoupled ? w_in[i] * c.decay : w_in[i];
    const scalar_t denom = root[i] / c.bias_correction2_sqrt + c.eps;
    out[i] = w + (c.neg_step_size * m_io[i]) / denom;
  }
}

template <typename scalar_t, bool kAmsgrad, bool kCorrected>
void adam_moments(const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io, scalar_t* v_io,
                  scalar_t* vmax_io, scalar_t* root, int64_t n, const AdamConstants<scalar_t>& c) {
  adam_moments_loop<scalar_t, kAmsgrad, kCorrected>(g_in, w_in, m_io, v_io, vmax_io, root, n, c);
}

template <typename scalar_t, bool kAmsgrad, bool kCorrected>
GEARSAM_FMA_CLONE void adam_moments_fma(const TileGrad<scalar_t> g_in, const scalar_t* w_in, scalar_t* m_io,
                                        scalar_t* v_io, scalar_t* vmax_io, scalar_t* root, int64_t n,
                                        const AdamConstants<scalar_t>& c) {
  adam_moments_loop<scalar_t, kAmsgrad, kCorrected>(g_in, w_in, m_io, v_io, vmax_io, root, n, c);
}

template <typename scalar_t>
void adam_update(scalar_t* out, const scalar_t* w_in, const scalar_t* m_io, const scalar_t* root, int64_t n,
                 const AdamConstants<scalar_t>& c) {
  adam_update_loop(out, w_in, m_io, root, n, c);
}

// The same loop at AVX2's width, where the divisions that dominate it do twice the work per instruction.
template <typename scalar_t>
GEARSAM_FMA_CLONE void adam_update_fma(scalar_t* out, const scalar_t* w_in, const scalar_t* m_io,
                                       const scalar_t* root, int64_t n, const AdamConstants<scalar_t>& c) {
  adam_update_loop(out, w_in, m_io, root, n, c);
}

#if defined(__GNUC__) && defined(__x86_64__)
#define GEARSAM_AVX2_STREAM 1
// Pass 2 for a streamed parameter in AVX2, with adam_update_loop's operations one for one (the same bits), each
// result stored straight to memory: no round trip through scratch. n a multiple of the vector width, out 32-byte
// aligned (adam_chunk checks).
GEARSAM_FMA_CLONE void adam_update_stream(float* out, const float* w_in, const float* m_io, const float* root,
                                          int64_t n, const AdamConstants<float>& c) {
  const __m256 decay = _mm256_set1_ps(c.decay), bias_correction2_sqrt = _mm256_set1_ps(c.bias_correction2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps), step = _mm256_set1_ps(c.neg_step_size);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 w = c.decoupled ? _mm256_mul_ps(_mm256_loadu_ps(w_in + i), decay) : _mm256_loadu_ps(w_in + i);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(root + i), bias_correction2_sqrt), eps);
    _mm256_stream_ps(out + i, _mm256_add_ps(w, _mm256_div_ps(_mm256_mul_ps(step, _mm256_loadu_ps(m_io + i)), denom)));
  }
}

GEARSAM_FMA_CLONE void adam_update_stream(double* out, const double* w_in, const double* m_io, const double* root,
                                          int64_t n, const AdamConstants<double>& c) {
  const __m256d decay = _mm256_set1_pd(c.decay), bias_correction2_sqrt = _mm256_set1_pd(c.bias_correction2_sqrt);
  const __m256d eps = _mm256_set1_pd(c.eps), step = _mm256_set1_pd(c.neg_step_size);
  for (int64_t i = 0; i < n; i += 4) {
    const __m256d w = c.decoupled ? _mm256_mul_pd(_mm256_loadu_pd(w_in + i), decay) : _mm256_loadu_pd(w_in + i);
    const __m256d denom = _mm256_add_pd(_mm256_div_pd(_mm256_loadu_pd(root + i), bias_correction2_sqrt), eps);
    _mm256_stream_pd(out + i, _mm256_add_pd(w, _mm256_div_pd(_mm256_mul_pd(step, _mm256_loadu_pd(m_io + i)), denom)));
  }
}
#endif

template <typename scalar_t>
void adam_moments_dispatch(bool fma, const TileGrad<scalar_t>& g_in, const scalar_t* w_in, scalar_t* m_io,
                           scalar_t* v_io, scalar_t* vmax_io, scalar_t* root, int64_t n,
                           const AdamConstants<scalar_t>& c) {
  with_flag(g_in.correction != nullptr, [&](auto corrected) {
    with_flag(c.amsgrad, [&](auto amsgrad) {
      constexpr bool kA = decltype(amsgrad)::value, kC = decltype(corrected)::value;
      if (fma)
        adam_moments_fma<scalar_t, kA, kC>(g_in, w_in, m_io, v_io, vmax_io, root, n, c);
      else
        adam_moments<scalar_t, kA, kC>(g_in, w_in, m_io, v_io, vmax_io, root, n, c);
    });
  });
}

// The buffers of one Adam step, and where it writes the parameter.
template <typename scalar_t>
struct AdamBuffers {
  scalar_t* out;
  const scalar_t* grad;
  CorrectionData<scalar_t> correction;
  const scalar_t* w_in;
  scalar_t *m, *v, *vmax;
  bool stream;  // the parameter written with non-temporal stores
};

// Elements [begin, end) of one thread's tiles: pass 1 tile by tile (each tile has its own correction scale), the
// square roots of the whole chunk in one call, then pass 2, into scratch and streamed out when b.stream.
template <typename scalar_t>
void adam_chunk(bool fma, const AdamBuffers<scalar_t>& b, scalar_t* root, scalar_t* scratch, int64_t begin,
                int64_t end, int64_t tile, const AdamConstants<scalar_t>& c) {
  for (int64_t start = begin; start < end; start = (start / tile + 1) * tile) {
    const int64_t stop = std::min(end, (start / tile + 1) * tile);
    adam_moments_dispatch(fma, b.correction.tile(b.grad, start / tile).at(start), b.w_in + start, b.m + start,
                          b.v + start, offset(b.vmax, start), root + (start - begin), stop - start, c);
  }
  const int64_t n = end - begin;
  torch_sqrt_(root, n);
#if defined(GEARSAM_AVX2_STREAM)
  if (b.stream && fma && n % (32 / sizeof(scalar_t)) == 0 && reinterpret_cast<uintptr_t>(b.out + begin) % 32 == 0) {
    adam_update_stream(b.out + begin, b.w_in + begin, b.m + begin, root, n, c);
    return;
  }
#endif
  scalar_t* dst = b.stream ? scratch : b.out + begin;
  if (fma)
    adam_update_fma(dst, b.w_in + begin, b.m + begin, root, n, c);
  else
    adam_update(dst, b.w_in + begin, b.m + begin, root, n, c);
  if (b.stream) stream_copy(b.out + begin, scratch, n * sizeof(scalar_t));
}

template <typename scalar_t>
void adam_tiles(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t tile,
                const AdamConstants<scalar_t>& c, const Correction& correction) {
  const AdamBuffers<scalar_t> b{param.mutable_data_ptr<scalar_t>(),
                                grad.const_data_ptr<scalar_t>(),
                                CorrectionData<scalar_t>(correction),
                                backup.const_data_ptr<scalar_t>(),
                                exp_avg.mutable_data_ptr<scalar_t>(),
                                exp_avg_sq.mutable_data_ptr<scalar_t>(),
                                c.amsgrad ? max_exp_avg_sq.mutable_data_ptr<scalar_t>() : nullptr,
                                stream_stores(param.nbytes())};
  const bool fma = cpu_has_fma();
  for_each_tile_range(param.numel() / tile, tile, [&](int64_t first_tile, int64_t last_tile) {
    std::vector<scalar_t> work(2 * kSqrtChunk);  // roots and scratch, per task: the tasks' stacks may be small
    for (int64_t begin = first_tile * tile; begin < last_tile * tile; begin += kSqrtChunk) {
      const int64_t end = std::min(begin + kSqrtChunk, last_tile * tile);
      adam_chunk(fma, b, work.data(), work.data() + kSqrtChunk, begin, end, tile, c);
    }
  });
}

// found_inf nonzero: the step is skipped, param brought back to backup (a no-op where backup is param itself).
bool skip_step(const at::Tensor& param, const at::Tensor& backup, const DeviceStep& device_step) {
  if (!device_step.found_inf.defined() || *device_step.found_inf.const_data_ptr<float>() == 0) return false;
  if (!backup.is_same(param)) restore(param, backup);
  return true;
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
              const Correction& correction, const DeviceStep& device_step) {
  if (skip_step(param, backup, device_step)) return;
  const SgdOptions o = step_options(options, device_step);
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_sgd_step_cpu", [&] {
    sgd_tiles<scalar_t>(param, grad, backup, momentum_buffer, tile, SgdConstants<scalar_t>(o), correction);
  });
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t tile,
               const AdamOptions& options, const Correction& correction, const DeviceStep& device_step) {
  if (skip_step(param, backup, device_step)) return;
  const AdamOptions o = step_options(options, device_step);
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_adam_step_cpu", [&] {
    adam_tiles<scalar_t>(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, tile, AdamConstants<scalar_t>(o),
                         correction);
  });
}

}  // namespace gearsam::cpu
