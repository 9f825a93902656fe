// The SAM family's element-wise work on CUDA, in place on the second gradient and the kept first one (csrc/README.md):
//
//   mix:       g_i <- fma(c, correction_i, a * g_i)    a = grad_scale[block], c = correction_scale[block] of tile(i),
//                                                      both rounded to the compute type: float32 (float64 for
//                                                      float64 buffers); the product rounded on its own (mul_rn),
//                                                      one rounding to the stored dtype
//   exchange:  (g_i, correction_i) <- (correction_i, g_i - correction_i)    the difference in the compute type
//                                                                           (sub_rn), rounded once to the stored dtype
//   friendly:  (g_i, m_i) <- (fma(-s, m_i, g_i), lerp(m_i, g_i, w)), or m_i <- g_i on the first step: F-SAM's ascent,
//              formula and roundings in cpu/mix.cpp (Friendly, common.cuh)
//
// Grid-stride over 16-byte vectors with 64-bit indices; a vector never straddles two tiles, so it has one block.

#include <ATen/Dispatch.h>

#include "../gearsam.h"
#include "common.cuh"

namespace gearsam::cuda {
namespace {

template <typename scalar_t, int Vec>
__global__ void mix_kernel(scalar_t* __restrict__ grad, const scalar_t* __restrict__ correction,
                           const double* __restrict__ grad_scale, const double* __restrict__ correction_scale,
                           const int32_t* __restrict__ block_of_tile, int64_t n_vectors, int64_t tile) {
  using compute_t = at::opmath_type<scalar_t>;
  using pack_t = Pack<scalar_t, Vec>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += stride) {
    const int64_t i = v * Vec;
    const int32_t b = block_of_tile[i / tile];
    const auto a = static_cast<compute_t>(grad_scale[b]), c = static_cast<compute_t>(correction_scale[b]);
    const pack_t g = *reinterpret_cast<const pack_t*>(grad + i);
    const pack_t kept = *reinterpret_cast<const pack_t*>(correction + i);
    pack_t out;
#pragma unroll
    for (int k = 0; k < Vec; ++k)
      out.v[k] = static_cast<scalar_t>(
          fma_rn(c, static_cast<compute_t>(kept.v[k]), mul_rn(a, static_cast<compute_t>(g.v[k]))));
    *reinterpret_cast<pack_t*>(grad + i) = out;
  }
}

template <typename scalar_t, int Vec>
__global__ void exchange_kernel(scalar_t* __restrict__ grad, scalar_t* __restrict__ correction, int64_t n_vectors) {
  using compute_t = at::opmath_type<scalar_t>;
  using pack_t = Pack<scalar_t, Vec>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += stride) {
    const int64_t i = v * Vec;
    const pack_t g = *reinterpret_cast<const pack_t*>(grad + i);
    const pack_t kept = *reinterpret_cast<const pack_t*>(correction + i);
    pack_t sharpness;
#pragma unroll
    for (int k = 0; k < Vec; ++k)
      sharpness.v[k] = static_cast<scalar_t>(sub_rn(static_cast<compute_t>(g.v[k]), static_cast<compute_t>(kept.v[k])));
    *reinterpret_cast<pack_t*>(grad + i) = kept;
    *reinterpret_cast<pack_t*>(correction + i) = sharpness;
  }
}

template <typename scalar_t, int Vec>
__global__ void friendly_kernel(scalar_t* __restrict__ grad, scalar_t* __restrict__ momentum, int64_t n_vectors,
                                double sigma, double lmbda, bool first) {
  using pack_t = Pack<scalar_t, Vec>;
  const Friendly<at::opmath_type<scalar_t>> ascent(sigma, lmbda);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += stride) {
    const int64_t i = v * Vec;
    pack_t g = *reinterpret_cast<const pack_t*>(grad + i);
    if (first) {
      *reinterpret_cast<pack_t*>(momentum + i) = g;
      continue;
    }
    pack_t m = *reinterpret_cast<const pack_t*>(momentum + i);
#pragma unroll
    for (int k = 0; k < Vec; ++k) ascent(g.v[k], m.v[k]);
    *reinterpret_cast<pack_t*>(grad + i) = g;
    *reinterpret_cast<pack_t*>(momentum + i) = m;
  }
}

template <typename scalar_t, int Vec>
void launch_friendly(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda, bool first,
                     cudaStream_t stream) {
  const int64_t n_vectors = grad.numel() / Vec;
  const int blocks = grid_for((n_vectors + kThreads - 1) / kThreads, grad.get_device());
  friendly_kernel<scalar_t, Vec><<<blocks, kThreads, 0, stream>>>(
      grad.mutable_data_ptr<scalar_t>(), momentum.mutable_data_ptr<scalar_t>(), n_vectors, sigma, lmbda, first);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int Vec>
void launch_exchange(const at::Tensor& grad, const at::Tensor& correction, cudaStream_t stream) {
  const int64_t n_vectors = grad.numel() / Vec;
  const int blocks = grid_for((n_vectors + kThreads - 1) / kThreads, grad.get_device());
  exchange_kernel<scalar_t, Vec><<<blocks, kThreads, 0, stream>>>(grad.mutable_data_ptr<scalar_t>(),
                                                                  correction.mutable_data_ptr<scalar_t>(), n_vectors);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int Vec>
void launch_mix(const at::Tensor& grad, const at::Tensor& correction, const at::Tensor& grad_scale,
                const at::Tensor& correction_scale, const at::Tensor& block_of_tile, int64_t tile,
                cudaStream_t stream) {
  const int64_t n_vectors = grad.numel() / Vec;
  const int blocks = grid_for((n_vectors + kThreads - 1) / kThreads, grad.get_device());
  mix_kernel<scalar_t, Vec><<<blocks, kThreads, 0, stream>>>(
      grad.mutable_data_ptr<scalar_t>(), correction.const_data_ptr<scalar_t>(), grad_scale.const_data_ptr<double>(),
      correction_scale.const_data_ptr<double>(), block_of_tile.const_data_ptr<int32_t>(), n_vectors, tile);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void mix_gradient(const at::Tensor& grad, const at::Tensor& correction, const at::Tensor& grad_scale,
                  const at::Tensor& correction_scale, const at::Tensor& block_of_tile, int64_t tile) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_mix_gradient_cuda", [&] {
    constexpr int vec = kVec<scalar_t>;
    if (vectorizable<vec>(tile, {grad.const_data_ptr(), correction.const_data_ptr()}))
      launch_mix<scalar_t, vec>(grad, correction, grad_scale, correction_scale, block_of_tile, tile, stream);
    else
      launch_mix<scalar_t, 1>(grad, correction, grad_scale, correction_scale, block_of_tile, tile, stream);
  });
}

void exchange_sharpness(const at::Tensor& grad, const at::Tensor& correction) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_exchange_sharpness_cuda", [&] {
    constexpr int vec = kVec<scalar_t>;
    // one vector per element run of the whole buffer: any length that is a whole number of vectors
    if (grad.numel() % vec == 0 && vectorizable<vec>(vec, {grad.const_data_ptr(), correction.const_data_ptr()}))
      launch_exchange<scalar_t, vec>(grad, correction, stream);
    else
      launch_exchange<scalar_t, 1>(grad, correction, stream);
  });
}

void friendly_ascent(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda, bool first) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gearsam_friendly_ascent_cuda", [&] {
    constexpr int vec = kVec<scalar_t>;
    // a range of a bucket: vectors only where it is a whole number of them and both starts are aligned
    if (grad.numel() % vec == 0 && vectorizable<vec>(vec, {grad.const_data_ptr(), momentum.const_data_ptr()}))
      launch_friendly<scalar_t, vec>(grad, momentum, sigma, lmbda, first, stream);
    else
      launch_friendly<scalar_t, 1>(grad, momentum, sigma, lmbda, first, stream);
  });
}

}  // namespace gearsam::cuda
