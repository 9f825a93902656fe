// The SAM family's element-wise work on the CPU, in place on the second gradient and the kept first one (csrc/README.md):
//
//   mix:       g_i <- fma(c, correction_i, a * g_i)    a = grad_scale[block], c = correction_scale[block] of tile(i),
//                                                      both rounded to the compute type: float32 (float64 for
//                                                      float64 buffers); the product a * g_i rounded on its own, one
//                                                      rounding to the stored dtype
//   exchange:  (g_i, correction_i) <- (correction_i, g_i - correction_i)    the difference in the compute type,
//                                                                           rounded once to the stored dtype
//   friendly:  (g_i, m_i) <- (fma(-s, m_i, g_i), lerp(m_i, g_i, w))    F-SAM's ascent; s = sigma, w = 1 - lmbda
//                                                                     (in float64, then) in the compute type;
//              lerp(m, g, w) = |w| < 0.5 ? fma(w, g - m, m) : fma(w - 1, g - m, g), g - m rounded on its own;
//              on the first step m_i <- g_i instead (g unchanged)
//
// as torch's `g.mul_(a).addcmul_(correction, c)`, `g - correction`, `g.sub_(m, alpha=s)` and `m.lerp_(g, w)` compute
// them on the CPU (its addcmul, its add with alpha and its lerp are fmas). The mix's and the ascent's loops are
// compiled twice, with and without the FMA instruction (vec.h): std::fma is exact either way, a libm call without it.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "../gearsam.h"
#include "friendly.h"
#include "tiles.h"
#include "vec.h"

namespace gearsam::cpu {
namespace {

template <typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
GEARSAM_INLINE void mix_loop(scalar_t* g, const scalar_t* kept, int64_t n, compute_t a, compute_t c) {
  for (int64_t i = 0; i < n; ++i)
    g[i] = static_cast<scalar_t>(std::fma(c, static_cast<compute_t>(kept[i]), a * static_cast<compute_t>(g[i])));
}

template <typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
void mix_run(scalar_t* g, const scalar_t* kept, int64_t n, compute_t a, compute_t c) {
  mix_loop(g, kept, n, a, c);
}

template <typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
GEARSAM_FMA_CLONE void mix_run_fma(scalar_t* g, const scalar_t* kept, int64_t n, compute_t a, compute_t c) {
  mix_loop(g, kept, n, a, c);
}

template <typename scalar_t>
void mix_tiles(const at::Tensor& grad, const at::Tensor& correction, const at::Tensor& grad_scale,
               const at::Tensor& correction_scale, const at::Tensor& block_of_tile, int64_t tile) {
  using compute_t = at::opmath_type<scalar_t>;
  scalar_t* g = grad.mutable_data_ptr<scalar_t>();
  const scalar_t* kept = correction.const_data_ptr<scalar_t>();
  const double* a_of = grad_scale.const_data_ptr<double>();
  const double* c_of = correction_scale.const_data_ptr<double>();
  const int32_t* block_of = block_of_tile.const_data_ptr<int32_t>();
  const bool fma = cpu_has_fma();
  for_each_tile(block_of_tile.numel(), tile, [&](int64_t t) {
    const int32_t b = block_of[t];
    const auto a = static_cast<compute_t>(a_of[b]), c = static_cast<compute_t>(c_of[b]);
    if (fma)
      mix_run_fma(g + t * tile, kept + t * tile, tile, a, c);
    else
      mix_run(g + t * tile, kept + t * tile, tile, a, c);
  });
}

template <typename scalar_t>
void exchange_tiles(const at::Tensor& grad, const at::Tensor& correction) {
  using compute_t = at::opmath_type<scalar_t>;
  scalar_t* g = grad.mutable_data_ptr<scalar_t>();
  scalar_t* kept = correction.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, grad.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t first = kept[i];
      kept[i] = static_cast<scalar_t>(static_cast<compute_t>(g[i]) - static_cast<compute_t>(first));
      g[i] = first;
    }
  });
}

template <typename scalar_t>
void friendly_elements(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda, bool first) {
  using compute_t = at::opmath_type<scalar_t>;
  scalar_t* g = grad.mutable_data_ptr<scalar_t>();
  scalar_t* m = momentum.mutable_data_ptr<scalar_t>();
  const auto s = static_cast<compute_t>(sigma), w = static_cast<compute_t>(1.0 - lmbda);
  const bool fma = cpu_has_fma();
  at::parallel_for(0, grad.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    friendly::span(g + begin, m + begin, end - begin, s, w, first, fma);
  });
}

}  // namespace

void friendly_ascent(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda, bool first) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_friendly_ascent_cpu", [&] {
    friendly_elements<scalar_t>(grad, momentum, sigma, lmbda, first);
  });
}

void exchange_sharpness(const at::Tensor& grad, const at::Tensor& correction) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_exchange_sharpness_cpu",
                                  [&] { exchange_tiles<scalar_t>(grad, correction); });
}

void mix_gradient(const at::Tensor& grad, const at::Tensor& correction, const at::Tensor& grad_scale,
                  const at::Tensor& correction_scale, const at::Tensor& block_of_tile, int64_t tile) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_mix_gradient_cpu", [&] {
    mix_tiles<scalar_t>(grad, correction, grad_scale, correction_scale, block_of_tile, tile);
  });
}

}  // namespace gearsam::cpu
