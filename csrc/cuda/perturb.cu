// Perturbation to w + eps and its exact undoing on CUDA.
//
//   perturb:  backup_i = w_i;   w_i <- w_i + scale[block_of_tile[tile(i)]] * T_i^2 * g_i   (w_i kept where scale is 0)
//             T_i = |w_i| + eta (ASAM) or 1; float32 arithmetic (float64 for float64), multiply and add rounded
//             separately (__fmul_rn / __fadd_rn), one rounding to the stored dtype (round to nearest even);
//             with kept, kept_i = g_i as well (a copy of the stored bits, in every block)
//   restore:  w_i <- backup_i   (a device-to-device copy on the current stream)
//
// Grid-stride over 16-byte vectors with 64-bit indices; a vector never straddles two tiles, so it has one scale.

#include <ATen/Dispatch.h>

#include "../gearsam.h"
#include "common.cuh"

namespace gearsam::cuda {
namespace {

// kept: null, or where the gradient is copied (one uniform branch, not a template parameter: the kernels compiled per
// dtype and vector width stay as many).
template <typename scalar_t, int Vec, bool Adaptive>
__global__ void perturb_kernel(scalar_t* __restrict__ param, const scalar_t* __restrict__ grad,
                               scalar_t* __restrict__ backup, scalar_t* __restrict__ kept,
                               const double* __restrict__ scale, const int32_t* __restrict__ block_of_tile,
                               int64_t n_vectors, int64_t tile, at::opmath_type<scalar_t> eta) {
  using compute_t = at::opmath_type<scalar_t>;
  using pack_t = Pack<scalar_t, Vec>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += stride) {
    const int64_t i = v * Vec;
    const compute_t s = static_cast<compute_t>(scale[block_of_tile[i / tile]]);
    const pack_t w = *reinterpret_cast<const pack_t*>(param + i);
    const pack_t g = *reinterpret_cast<const pack_t*>(grad + i);
    *reinterpret_cast<pack_t*>(backup + i) = w;
    if (kept != nullptr) *reinterpret_cast<pack_t*>(kept + i) = g;
    pack_t out;
#pragma unroll
    for (int k = 0; k < Vec; ++k) {
      const compute_t x = static_cast<compute_t>(w.v[k]);
      compute_t direction = static_cast<compute_t>(g.v[k]);
      if constexpr (Adaptive) {
        const compute_t T = add_rn(fabs(x), eta);
        direction = mul_rn(mul_rn(T, T), direction);
      }
      // a block skipped this step (scale 0) keeps its bits, even where its gradient is inf or NaN
      out.v[k] = s == 0 ? w.v[k] : static_cast<scalar_t>(add_rn(x, mul_rn(direction, s)));
    }
    *reinterpret_cast<pack_t*>(param + i) = out;
  }
}

template <typename scalar_t, int Vec, bool Adaptive>
void launch_perturb(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
                    const at::Tensor& block_of_tile, int64_t tile, double eta, const at::Tensor& kept,
                    cudaStream_t stream) {
  const int64_t n_vectors = param.numel() / Vec;
  const int blocks = grid_for((n_vectors + kThreads - 1) / kThreads, param.get_device());
  perturb_kernel<scalar_t, Vec, Adaptive><<<blocks, kThreads, 0, stream>>>(
      param.mutable_data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(), backup.mutable_data_ptr<scalar_t>(),
      kept.defined() ? kept.mutable_data_ptr<scalar_t>() : nullptr, scale.const_data_ptr<double>(),
      block_of_tile.const_data_ptr<int32_t>(), n_vectors, tile, static_cast<at::opmath_type<scalar_t>>(eta));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void perturb(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
             const at::Tensor& block_of_tile, int64_t tile, bool adaptive, double eta, const at::Tensor& kept) {
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "gearsam_perturb_cuda", [&] {
    constexpr int vec = kVec<scalar_t>;
    const bool wide = vectorizable<vec>(tile, {param.const_data_ptr(), grad.const_data_ptr(), backup.const_data_ptr(),
                                               kept.defined() ? kept.const_data_ptr() : nullptr});
    if (adaptive)
      wide ? launch_perturb<scalar_t, vec, true>(param, grad, backup, scale, block_of_tile, tile, eta, kept, stream)
           : launch_perturb<scalar_t, 1, true>(param, grad, backup, scale, block_of_tile, tile, eta, kept, stream);
    else
      wide ? launch_perturb<scalar_t, vec, false>(param, grad, backup, scale, block_of_tile, tile, eta, kept, stream)
           : launch_perturb<scalar_t, 1, false>(param, grad, backup, scale, block_of_tile, tile, eta, kept, stream);
  });
}

void restore(const at::Tensor& param, const at::Tensor& backup) {
  const c10::cuda::CUDAGuard guard(param.device());
  C10_CUDA_CHECK(cudaMemcpyAsync(param.mutable_data_ptr(), backup.const_data_ptr(),
                                 param.numel() * param.element_size(), cudaMemcpyDeviceToDevice,
                                 c10::cuda::getCurrentCUDAStream()));
}

}  // namespace gearsam::cuda
