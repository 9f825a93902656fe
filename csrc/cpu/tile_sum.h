// One tile's sum of squares (or products) on the CPU, the first stage of the block energy's two-stage reduction
// (energy.cpp), shared with the base steps (base_step.cpp), which sum the momentum they have just written by this
// same code: the bits of block_energy's partials.
//
// Overflow: float32 squares (and short sums of them) overflow from about 1.8e19 (the square root of FLT_MAX) although
// the energy, a float64, holds up to 1.8e308. A tile whose sum in float32 is not finite is summed again with every term
// formed and summed in float64 (tile_sum_wide): a finite gradient then gives a finite energy, and only a gradient that
// holds an inf or a NaN (or a sum past DBL_MAX) keeps a non-finite one. The common case pays one test per tile.

#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace gearsam::cpu {

// Independent accumulators: the inner loop has no loop-carried dependency, so the compiler vectorises it. Each lane
// sums kChunk / kLanes squares in the compute type, then adds that short sum to its float64 total.
constexpr int64_t kLanes = 8;
constexpr int64_t kChunk = 64;

// How far ahead of its loads the loop asks for the lines it will read: a pass that only reads waits on memory for
// every line the hardware prefetcher has not fetched yet. The passes that also write gain nothing from it, so only
// this one does it.
constexpr uintptr_t kPrefetchBytes = 8192;

// Asks for the lines of the chunk at p, kPrefetchBytes ahead: a hint, which never faults, so it may point past the
// buffer's end (computed as an integer, not as a pointer past the end).
template <typename scalar_t>
GEARSAM_INLINE void prefetch_chunk(const scalar_t* p) {
#if defined(__GNUC__)
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + kPrefetchBytes;
  for (uintptr_t line = 0; line < kChunk * sizeof(scalar_t); line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(ahead + line), 0, 3);
#endif
}

// What a tile sums per element: (T g)^2, or g * other.
enum class Term { kSquare, kAdaptiveSquare, kProduct };

template <Term kTerm, typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
GEARSAM_INLINE double tile_sum_loop(const scalar_t* grad, const scalar_t* second, int64_t n, compute_t eta) {
  double total[kLanes] = {};
  auto term = [&](int64_t i) {
    const compute_t v = static_cast<compute_t>(grad[i]);
    if constexpr (kTerm == Term::kProduct) return v * static_cast<compute_t>(second[i]);
    if constexpr (kTerm == Term::kAdaptiveSquare) {
      const compute_t a = (std::abs(static_cast<compute_t>(second[i])) + eta) * v;
      return a * a;
    }
    return v * v;
  };
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    prefetch_chunk(grad + i);
    if constexpr (kTerm != Term::kSquare) prefetch_chunk(second + i);
    compute_t lane[kLanes] = {};
    for (int64_t j = 0; j < kChunk; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lane[l] += term(i + j + l);
    for (int64_t l = 0; l < kLanes; ++l) total[l] += lane[l];
  }
  for (int64_t l = 0; i < n; ++i, l = (l + 1) % kLanes) total[l] += term(i);
  for (int64_t width = kLanes / 2; width > 0; width /= 2)  // pairwise, always the same tree
    for (int64_t l = 0; l < width; ++l) total[l] += total[l + width];
  return total[0];
}

template <Term kTerm, typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
double tile_sum(const scalar_t* grad, const scalar_t* second, int64_t n, compute_t eta) {
  return tile_sum_loop<kTerm>(grad, second, n, eta);
}

// The same loop compiled for AVX2 (vec.h): the eight lanes become one register, the same sums in the same order.
template <Term kTerm, typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
GEARSAM_FMA_CLONE double tile_sum_avx2(const scalar_t* grad, const scalar_t* second, int64_t n, compute_t eta) {
  return tile_sum_loop<kTerm>(grad, second, n, eta);
}

// The tile's sum with every term formed in float64 (T = |w| + eta with eta unrounded) and summed in float64, by the
// same lanes in the same order: the rescue of a float32 sum that overflowed. Out of line: it is the rare case.
template <Term kTerm, typename scalar_t>
GEARSAM_COLD double tile_sum_wide(const scalar_t* grad, const scalar_t* second, int64_t n, double eta) {
  return tile_sum_loop<kTerm, scalar_t, double>(grad, second, n, eta);
}

// One tile's sum, by the loop compiled for this CPU, in the compute type (float32, float64 for float64 buffers), eta
// rounded to it; where a float32 sum is not finite, tile_sum_wide's instead (float64 buffers have no wider type: a
// float64 sum that overflows is an energy past DBL_MAX).
template <Term kTerm, typename scalar_t>
double tile_sum_here(bool avx2, const scalar_t* grad, const scalar_t* second, int64_t n, double eta) {
  using compute_t = at::opmath_type<scalar_t>;
  const auto eta_c = static_cast<compute_t>(eta);
  const double sum = avx2 ? tile_sum_avx2<kTerm>(grad, second, n, eta_c) : tile_sum<kTerm>(grad, second, n, eta_c);
  if constexpr (!std::is_same_v<compute_t, double>) {
    if (!std::isfinite(sum)) [[unlikely]]
      return tile_sum_wide<kTerm>(grad, second, n, eta);
  }
  return sum;
}

// energy[r * n_blocks + b] = the sum of block b's tiles in row r of partials (n_tiles entries a row), in tile order.
void block_sums(const at::Tensor& partials, const at::Tensor& first_tile_of_block, const at::Tensor& energy,
                int64_t n_tiles);

}  // namespace gearsam::cpu
