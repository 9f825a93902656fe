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
// Overflow: a float32 thread sum (bf16, fp16, float32 buffers) overflows from squares of about 1.8e19, the square
// root of FLT_MAX, where the float64 energy does not. Every thread receives the tile's totals (block_sum's
// `everyone`); where one is not finite, the block takes the tile again, each thread forming its terms in float64 (T
// with the float64 eta) and summing them in float64, the same threads, vectors and tree: a finite gradient gives a
// finite energy, and only an inf or a NaN in it (or a sum past DBL_MAX) a non-finite one. A uniform branch per tile;
// float64 buffers have no wider type to take.
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

// This thread's terms of the tile starting at `first`, formed and summed in compute_t (float64 for the rescue). No
// restrict here: friendly_energy_kernel's rescue reads back what its threads have just written.
template <Term kTerm, typename compute_t, typename scalar_t, int Vec>
__device__ __forceinline__ void thread_sums(const scalar_t* grad, const scalar_t* second, int64_t first, int64_t tile,
                                            compute_t eta, compute_t& sum, compute_t& products) {
  using pack_t = Pack<scalar_t, Vec>;
  for (int64_t i = int64_t(threadIdx.x) * Vec; i < tile; i += int64_t(kThreads) * Vec) {
    const pack_t g = *reinterpret_cast<const pack_t*>(grad + first + i);
    pack_t w;
    if constexpr (kTerm != Term::kSquare) w = *reinterpret_cast<const pack_t*>(second + first + i);
    add_terms<kTerm, scalar_t, Vec, compute_t>(g, w, eta, sum, products);
  }
}

// The tile's totals, in every thread: float64 sums of the threads' compute_t sums; a float32 total that is not finite
// is taken again by thread_sums in float64 (the file's overflow rule). partials[t] and, for kSquareAndProduct,
// partials[n_tiles + t] written by thread 0.
template <Term kTerm, typename scalar_t, int Vec>
__device__ __forceinline__ void store_totals(const scalar_t* grad, const scalar_t* second, double* partials,
                                             int64_t n_tiles, int64_t t, int64_t tile, double eta,
                                             at::opmath_type<scalar_t> sum, at::opmath_type<scalar_t> products,
                                             double* scratch, double* everyone) {
  using compute_t = at::opmath_type<scalar_t>;
  constexpr bool kProducts = kTerm == Term::kSquareAndProduct;
  double total = block_sum(static_cast<double>(sum), scratch, everyone);
  double product_total = kProducts ? block_sum(static_cast<double>(products), scratch, everyone) : 0.0;
  if constexpr (!std::is_same_v<compute_t, double>) {
    const bool square_over = !isfinite(total), product_over = kProducts && !isfinite(product_total);
    if (square_over || product_over) {  // the same in every thread: the block takes the branch together
      double wide = 0, wide_products = 0;
      thread_sums<kTerm, double, scalar_t, Vec>(grad, second, t * tile, tile, eta, wide, wide_products);
      const double wide_total = block_sum(wide, scratch);
      if (square_over) total = wide_total;
      if constexpr (kProducts) {
        const double wide_product_total = block_sum(wide_products, scratch);
        if (product_over) product_total = wide_product_total;
      }
    }
  }
  if (threadIdx.x == 0) {
    partials[t] = total;
    if constexpr (kProducts) partials[n_tiles + t] = product_total;
  }
}

// second is param for the adaptive square, other for the products, unread for the plain square.
template <typename scalar_t, int Vec, Term kTerm>
__global__ void tile_energy_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ second,
                                   double* __restrict__ partials, int64_t n_tiles, int64_t tile, double eta) {
  using compute_t = at::opmath_type<scalar_t>;
  __shared__ double scratch[kThreads / kWarp];
  __shared__ double everyone;
  const auto eta_c = static_cast<compute_t>(eta);
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    compute_t sum = 0, products = 0;
    thread_sums<kTerm, compute_t, scalar_t, Vec>(grad, second, t * tile, tile, eta_c, sum, products);
    store_totals<kTerm, scalar_t, Vec>(grad, second, partials, n_tiles, t, tile, eta, sum, products, scratch,
                                       &everyone);
  }
}

// tile_energy_kernel's sums (kSquare or kAdaptiveSquare) of the gradient after F-SAM's ascent, which each thread takes
// on its vectors first (or, first, copies them into momentum). The rescue reads back the gradient each thread has
// just written (its own elements).
template <typename scalar_t, int Vec, Term kTerm>
__global__ void friendly_energy_kernel(scalar_t* __restrict__ grad, scalar_t* __restrict__ momentum,
                                       const scalar_t* __restrict__ param, double* __restrict__ partials,
                                       int64_t n_tiles, int64_t tile, double eta, double sigma, double lmbda,
                                       bool first_step) {
  using compute_t = at::opmath_type<scalar_t>;
  using pack_t = Pack<scalar_t, Vec>;
  __shared__ double scratch[kThreads / kWarp];
  __shared__ double everyone;
  const Friendly<compute_t> ascent(sigma, lmbda);
  const auto eta_c = static_cast<compute_t>(eta);
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
      add_terms<kTerm>(g, w, eta_c, sum, unused);
    }
    store_totals<kTerm, scalar_t, Vec>(grad, param, partials, n_tiles, t, tile, eta, sum, unused, scratch, &everyone);
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
      tile, eta);
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
      partials.mutable_data_ptr<double>(), n_tiles, tile, eta, sigma, lmbda, first);
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
