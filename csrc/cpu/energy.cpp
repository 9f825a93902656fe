// Block gradient energy on the CPU, deterministic for any number of threads.
//
//   partial_t = sum_{i in tile t} (T_i g_i)^2     T_i = |w_i| + eta (ASAM) or 1; squares in float32 (float64 for
//                                                 float64 buffers), summed 8 at a time in 8 lanes, each lane's short
//                                                 sums added in float64, the lanes combined pairwise; where that sum
//                                                 of float32 terms is not finite, the same sum with every term formed
//                                                 and summed in float64 (tile_sum.h: no finite gradient overflows)
//   e_b       = sum_{t = first_tile_of_block[b]}^{first_tile_of_block[b+1]-1} partial_t     float64, in tile order
//
// With other (T = 1), in the same read of each tile: the energies as above in partials[0, n_tiles), and the products
// g_i other_i summed the same way in partials[n_tiles, 2 n_tiles), per block into energy's second row.
//
// friendly_energy: F-SAM's ascent (friendly.h) on each tile, then that tile's partial of the new g, taken from L1 by
// the same loop: one read of memory for both, the bits of friendly_ascent followed by block_energy.
//
// The first stage's loop and the second stage are in tile_sum.h, where the base steps find them (they sum the
// momentum they write by the same code). Threads split the tiles (then the blocks) between them, but every sum runs
// over a fixed range in a fixed order, so the result does not depend on how the work was split.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "../gearsam.h"
#include "friendly.h"
#include "tile_sum.h"
#include "tiles.h"

namespace gearsam::cpu {
namespace {

// second is param for the adaptive square, unread for the plain square. With other, each tile's squares and then,
// while the tile is in L1, its products: one read of memory for both.
template <Term kTerm, typename scalar_t>
void tile_sums(const at::Tensor& grad, const at::Tensor& second, const at::Tensor& other, const at::Tensor& partials,
               int64_t tile, double eta) {
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  const scalar_t* s = second.const_data_ptr<scalar_t>();
  const scalar_t* o = other.defined() ? other.const_data_ptr<scalar_t>() : nullptr;
  double* out = partials.mutable_data_ptr<double>();
  const int64_t n_tiles = grad.numel() / tile;
  const bool avx2 = cpu_has_fma();
  for_each_tile(n_tiles, tile, [&](int64_t t) {
    out[t] = tile_sum_here<kTerm>(avx2, g + t * tile, s + t * tile, tile, eta);
    if (o) out[n_tiles + t] = tile_sum_here<Term::kProduct>(avx2, g + t * tile, o + t * tile, tile, eta);
  });
}

template <Term kTerm, typename scalar_t>
void friendly_tile_sums(const at::Tensor& grad, const at::Tensor& momentum, const at::Tensor& param,
                        const at::Tensor& partials, int64_t tile, double eta, double sigma, double lmbda, bool first) {
  using compute_t = at::opmath_type<scalar_t>;
  scalar_t* g = grad.mutable_data_ptr<scalar_t>();
  scalar_t* m = momentum.mutable_data_ptr<scalar_t>();
  const scalar_t* p = param.const_data_ptr<scalar_t>();
  double* out = partials.mutable_data_ptr<double>();
  const auto s = static_cast<compute_t>(sigma);
  const auto w = static_cast<compute_t>(1.0 - lmbda);
  const bool avx2 = cpu_has_fma();
  for_each_tile(grad.numel() / tile, tile, [&](int64_t t) {
    friendly::span(g + t * tile, m + t * tile, tile, s, w, first, avx2);
    out[t] = tile_sum_here<kTerm>(avx2, g + t * tile, p + t * tile, tile, eta);
  });
}

}  // namespace

void block_sums(const at::Tensor& partials, const at::Tensor& first_tile_of_block, const at::Tensor& energy,
                int64_t n_tiles) {
  const int64_t n_blocks = first_tile_of_block.numel() - 1;
  const double* part = partials.const_data_ptr<double>();
  const int64_t* range = first_tile_of_block.const_data_ptr<int64_t>();
  double* out = energy.mutable_data_ptr<double>();
  at::parallel_for(0, energy.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / n_blocks, b = i % n_blocks;
      double sum = 0.0;
      for (int64_t t = range[b]; t < range[b + 1]; ++t) sum += part[row * n_tiles + t];
      out[i] = sum;
    }
  });
}


void block_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& first_tile_of_block,
                  const at::Tensor& partials, const at::Tensor& energy, int64_t tile, bool adaptive, double eta,
                  const at::Tensor& other) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_block_energy_cpu", [&] {
    if (adaptive)
      tile_sums<Term::kAdaptiveSquare, scalar_t>(grad, param, other, partials, tile, eta);
    else
      tile_sums<Term::kSquare, scalar_t>(grad, param, other, partials, tile, eta);
  });
  block_sums(partials, first_tile_of_block, energy, grad.numel() / tile);  // [B], or [2, B] with other
}

void friendly_energy(const at::Tensor& grad, const at::Tensor& momentum, const at::Tensor& param,
                     const at::Tensor& first_tile_of_block, const at::Tensor& partials, const at::Tensor& energy,
                     int64_t tile, bool adaptive, double eta, double sigma, double lmbda, bool first) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_friendly_energy_cpu", [&] {
    if (adaptive)
      friendly_tile_sums<Term::kAdaptiveSquare, scalar_t>(grad, momentum, param, partials, tile, eta, sigma, lmbda,
                                                          first);
    else
      friendly_tile_sums<Term::kSquare, scalar_t>(grad, momentum, param, partials, tile, eta, sigma, lmbda, first);
  });
  block_sums(partials, first_tile_of_block, energy, grad.numel() / tile);
}

}  // namespace gearsam::cpu
