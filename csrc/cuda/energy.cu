// Block gradient energy on CUDA: a deterministic two-stage reduction, no atomics.
//
//   stage 1 (one thread block per tile, grid-stride over tiles):
//     partial_t = sum_{i in tile t} (T_i g_i)^2    T_i = |w_i| + eta (ASAM) or 1; each thread sums its elements in
//                                                  float32 (float64 for float64), the block adds the threads' sums
//                                                  in float64 along a fixed tree; with other (T = 1), in the same
//                                                  read, also the products g_i other_i, summed the same way into
//                                                  partial_{n_tiles + t}
//   stage 2 (one thread block per block and row, grid-stride over them):
//     e_b = sum_{t = first_tile_of_block[b]}^{first_tile_of_block[b+1]-1} partial_t
//     float64, fixed thread assignment and tree; with other a second row from the products' partials
//
// Which thread reads which element depends only on the tile size and kThreads, so results are bitwise reproducible.
//
// friendly_energy: stage 1 takes F-SAM's ascent (Friendly, common.cuh) on each element first and sums the new
// gradient's squares by the same threads, vectors and tree: the bits of friendly_ascent followed by block_energy, in
// one read.

#include <ATen/Dispatch.h>

#include <type_traits>

#include "../gearsam.h"
#include "common.cuh"

namespace gearsam::cuda {
namespace {

// What a tile sums per element: (T g)^2, or (T = 1) g^2 and g * other.
enum class Term { kSquare, kAdaptiveSquare, kSquareAndProduct };

// One vector's terms added to a thread's sums: (T g)^2 to sum, and g * other to products (kSquareAndProduct).
template <Term kTerm, typename scalar_t, int Vec, typename compute_t = at::opmath_type<scalar_t>>
__device__ __forceinline__ void add_terms(const Pack<scalar_t, Vec>& g, const Pack<scalar_t, Vec>& w, compute_t eta,
                                          compute_t& sum, compute_t& products) {
#pragma unroll
  for (int k = 0; k < Vec; ++k) {
    compute_t v = static_cast<compute_t>(g.v[k]);
    if constexpr (kTerm == Term::kSquareAndProduct) products += v * static_cast<compute_t>(w.v[k]);
    if constexpr (kTerm == Term::kAdaptiveSquare) v = (fabs(static_cast<compute_t>(w.v[k])) + eta) * v;
    sum += v * v;
  }
}

// second is param for the adaptive square, other for the products, unread for the plain square.
template <typename scalar_t, int Vec, Term kTerm>
__global__ void tile_energy_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ second,
                                   double* __restrict__ partials, int64_t n_tiles, int64_t tile,
                                   at::opmath_type<scalar_t> eta) {
  using compute_t = at::opmath_type<scalar_t>;
  using pack_t = Pack<scalar_t, Vec>;
  __shared__ double scratch[kThreads / kWarp];
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    const int64_t first = t * tile;
    compute_t sum = 0, products = 0;
    for (int64_t i = int64_t(threadIdx.x) * Vec; i < tile; i += int64_t(kThreads) * Vec) {
      const pack_t g = *reinterpret_cast<const pack_t*>(grad + first + i);
      pack_t w;
      if constexpr (kTerm != Term::kSquare) w = *reinterpret_cast<const pack_t*>(second + first + i);
      add_terms<kTerm>(g, w, eta, sum, products);
    }
    const double total = block_sum(static_cast<double>(sum), scratch);
    if (threadIdx.x == 0) partials[t] = total;
    if constexpr (kTerm == Term::kSquareAndProduct) {
      const double product_total = block_sum(static_cast<double>(products), scratch);
      if (threadIdx.x == 0) partials[n_tiles + t] = product_total;
    }
  }
}

// tile_energy_kernel's sums (kSquare or kAdaptiveSquare) of the gradient after F-SAM's ascent, which each thread takes
// on its vectors first (or, first, copies them into momentum).
template <typename scalar_t, int Vec, Term kTerm>
__global__ void friendly_energy_kernel(scalar_t* __restrict__ grad, scalar_t* __restrict__ momentum,
                                       const scalar_t* __restrict__ param, double* __restrict__ partials,
                                       int64_t n_tiles, int64_t tile, at::opmath_type<scalar_t> eta, double sigma,
                                       double lmbda, bool first_step) {
  using compute_t = at::opmath_type<scalar_t>;
  using pack_t = Pack<scalar_t, Vec>;
  __shared__ double scratch[kThreads / kWarp];
  const Friendly<compute_t> ascent(sigma, lmbda);
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    const int64_t first = t * tile;
    compute_t sum = 0, unused = 0;
    for (int64_t i = int64_t(threadIdx.x) * Vec; i < tile; i += int64_t(kThreads) * Vec) {
      pack_t g = *reinterpret_cast<const pack_t*>(grad + first + i);
      if (first_step) {
        *reinterpret_cast<pack_t*>(momentum + first + i) = g;
      } else {
        pack_t m = *reinterpret_cast<const pack_t*>(momentum + first + i);
#pragma unroll
        for (int k = 0; k < Vec; ++k) ascent(g.v[k], m.v[k]);
        *reinterpret_cast<pack_t*>(grad + first + i) = g;
        *reinterpret_cast<pack_t*>(momentum + first + i) = m;
      }
      pack_t w;
      if constexpr (kTerm == Term::kAdaptiveSquare) w = *reinterpret_cast<const pack_t*>(param + first + i);
      add_terms<kTerm>(g, w, eta, sum, unused);
    }
    const double total = block_sum(static_cast<double>(sum), scratch);
    if (threadIdx.x == 0) partials[t] = total;
  }
}

// energy[r * n_blocks + b] = the sum of block b's tiles in row r of partials (n_tiles each); rows: 1, or 2 with other.
__global__ void block_sum_kernel(const double* __restrict__ partials, const int64_t* __restrict__ first_tile_of_block,
                                 double* __restrict__ energy, int64_t n_blocks, int64_t n_tiles, int64_t rows) {
  __shared__ double scratch[kThreads / kWarp];
  for (int64_t i = blockIdx.x; i < rows * n_blocks; i += gridDim.x) {
    const int64_t b = i % n_blocks;
    const double* row = partials + (i / n_blocks) * n_tiles;
    double sum = 0.0;
    for (int64_t t = first_tile_of_block[b] + threadIdx.x; t < first_tile_of_block[b + 1]; t += kThreads)
      sum += row[t];
    const double total = block_sum(sum, scratch);
    if (threadIdx.x == 0) energy[i] = total;
  }
}

template <typename scalar_t, int Vec, Term kTerm>
void launch_tile_energy(const at::Tensor& grad, const at::Tensor& second, const at::Tensor& partials, int64_t tile,
                        double eta, cudaStream_t stream) {
  const int64_t n_tiles = grad.numel() / tile;
  tile_energy_kernel<scalar_t, Vec, kTerm><<<grid_for(n_tiles, grad.get_device()), kThreads, 0, stream>>>(
      grad.const_data_ptr<scalar_t>(), second.const_data_ptr<scalar_t>(), partials.mutable_data_ptr<double>(), n_tiles,
      tile, static_cast<at::opmath_type<scalar_t>>(eta));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_block_sums(const at::Tensor& partials, const at::Tensor& first_tile_of_block, const at::Tensor& energy,
                       int64_t n_tiles, int64_t rows, cudaStream_t stream) {
  const int64_t n_blocks = first_tile_of_block.numel() - 1;
  if (n_blocks == 0) return;
  block_sum_kernel<<<grid_for(rows * n_blocks, partials.get_device()), kThreads, 0, stream>>>(
      partials.const_data_ptr<double>(), first_tile_of_block.const_data_ptr<int64_t>(),
      energy.mutable_data_ptr<double>(), n_blocks, n_tiles, rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int Vec, Term kTerm>
void launch_friendly_energy(const at::Tensor& grad, const at::Tensor& momentum, const at::Tensor& param,
                            const at::Tensor& partials, int64_t tile, double eta, double sigma, double lmbda,
                            bool first, cudaStream_t stream) {
  const int64_t n_tiles = grad.numel() / tile;
  friendly_energy_kernel<scalar_t, Vec, kTerm><<<grid_for(n_tiles, grad.get_device()), kThreads, 0, stream>>>(
      grad.mutable_data_ptr<scalar_t>(), momentum.mutable_data_ptr<scalar_t>(), param.const_data_ptr<scalar_t>(),
      partials.mutable_data_ptr<double>(), n_tiles, tile, static_cast<at::opmath_type<scalar_t>>(eta), sigma, lmbda,
      first);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void block_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& first_tile_of_block,
                  const at::Tensor& partials, const at::Tensor& energy, int64_t tile, bool adaptive, double eta,
                  const at::Tensor& other) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (partials.numel() > 0) {
    const at::Tensor& second = other.defined() ? other : param;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_block_energy_cuda", [&] {
      constexpr int vec = kVec<scalar_t>;
      const bool wide = vectorizable<vec>(tile, {grad.const_data_ptr(), second.const_data_ptr()});
      auto launch = [&](auto term) {
        constexpr Term kTerm = decltype(term)::value;
        wide ? launch_tile_energy<scalar_t, vec, kTerm>(grad, second, partials, tile, eta, stream)
             : launch_tile_energy<scalar_t, 1, kTerm>(grad, second, partials, tile, eta, stream);
      };
      if (other.defined())
        launch(std::integral_constant<Term, Term::kSquareAndProduct>{});
      else if (adaptive)
        launch(std::integral_constant<Term, Term::kAdaptiveSquare>{});
      else
        launch(std::integral_constant<Term, Term::kSquare>{});
    });
  }
  launch_block_sums(partials, first_tile_of_block, energy, grad.numel() / tile, other.defined() ? 2 : 1, stream);
}

void friendly_energy(const at::Tensor& grad, const at::Tensor& momentum, const at::Tensor& param,
                     const at::Tensor& first_tile_of_block, const at::Tensor& partials, const at::Tensor& energy,
                     int64_t tile, bool adaptive, double eta, double sigma, double lmbda, bool first) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  bool fused = true;
  if (partials.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_friendly_energy_cuda", [&] {
      constexpr int vec = kVec<scalar_t>;
      // block_energy's vectors (and so its sums) are decided by grad and param; momentum must allow the same ones
      const bool wide = vectorizable<vec>(tile, {grad.const_data_ptr(), param.const_data_ptr()});
      if (wide != vectorizable<vec>(tile, {grad.const_data_ptr(), param.const_data_ptr(), momentum.const_data_ptr()})) {
        fused = false;
        return;
      }
      auto launch = [&](auto term) {
        constexpr Term kTerm = decltype(term)::value;
        wide ? launch_friendly_energy<scalar_t, vec, kTerm>(grad, momentum, param, partials, tile, eta, sigma, lmbda,
                                                           first, stream)
             : launch_friendly_energy<scalar_t, 1, kTerm>(grad, momentum, param, partials, tile, eta, sigma, lmbda,
                                                         first, stream);
      };
      if (adaptive)
        launch(std::integral_constant<Term, Term::kAdaptiveSquare>{});
      else
        launch(std::integral_constant<Term, Term::kSquare>{});
    });
  }
  if (!fused) {  // the two kernels, one after the other: the same bits, two reads
    friendly_ascent(grad, momentum, sigma, lmbda, first);
    block_energy(grad, param, first_tile_of_block, partials, energy, tile, adaptive, eta, at::Tensor());
    return;
  }
  launch_block_sums(partials, first_tile_of_block, energy, grad.numel() / tile, 1, stream);
}

}  // namespace gearsam::cuda
