// Radius allocation on CUDA: one thread block, float64, no host synchronisation.
//
// The GEAR and SAM rules (EMA, radii, scales; a block whose energy is not finite skipped for the step) are stated
// once, in gearsam_fused/allocation.py (gear_allocate, sam_allocate). Here, as there, ||s||_2 is taken through
// t_b = s_b / max_j s_j, so that squaring tiny or huge float64 scores neither underflows nor overflows.
//
// Passes over the blocks: for GEAR max s, then ||t|| (for SAM sum e), each a fixed-order block reduction; last s, r
// and scale. Each thread handles the same blocks in every pass, so the EMA it writes in the last is read by no other
// thread.
//
// Capturable (csrc/README.md): rho and found_inf are loaded from device memory where given (null pointers where not), so a
// CUDA graph replays the kernel with their current values. found_inf is the same for every thread, so a skipped step
// leaves the kernel as a whole, before any barrier: scale and radius 0, the EMA neither read nor written.

#include "../gearsam.h"
#include "common.cuh"

namespace gearsam::cuda {
namespace {

template <bool Gear>
__global__ void allocate_kernel(const double* __restrict__ energy, double* __restrict__ ema, double* __restrict__ scale,
                                double* __restrict__ radius, int64_t n_blocks, double rho, double beta, double delta,
                                const double* __restrict__ rho_in, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) {
    for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) scale[b] = radius[b] = 0.0;
    return;
  }
  if (rho_in != nullptr) rho = *rho_in;
  __shared__ double scratch[kThreads / kWarp];
  __shared__ double peak_shared;
  __shared__ double norm_shared;
  // the EMA's next value, or the current one where the energy is not finite
  auto smoothed = [&](int64_t b) {
    return isfinite(energy[b]) ? add_rn(mul_rn(beta, ema[b]), mul_rn(1.0 - beta, energy[b])) : ema[b];
  };
  double peak = 1.0;
  if constexpr (Gear) {
    double largest = 0.0;
    for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) largest = fmax(largest, smoothed(b));
    largest = block_reduce(largest, scratch, 0.0, [](double x, double y) { return fmax(x, y); });
    if (threadIdx.x == 0) peak_shared = largest > 0 ? largest : 1.0;  // s = 0: t = 0 and every radius is 0
    __syncthreads();
    peak = peak_shared;
  }
  double sum = 0.0;
  for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) {
    if constexpr (Gear) {
      const double t = smoothed(b) / peak;
      sum = add_rn(sum, mul_rn(t, t));
    } else {
      sum += energy[b];
    }
  }
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) norm_shared = sqrt(sum);
  __syncthreads();
  const double norm = norm_shared;
  for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) {
    const double root = sqrt(energy[b]);
    if constexpr (Gear) {
      const bool finite = isfinite(energy[b]);
      const double s = smoothed(b);
      ema[b] = s;
      radius[b] = norm > 0 && finite ? rho * ((s / peak) / norm) : 0.0;
      scale[b] = finite ? radius[b] / (root + delta) : 0.0;
    } else {
      const bool finite = isfinite(norm);
      radius[b] = norm > 0 && finite ? rho * (root / norm) : 0.0;
      scale[b] = finite ? rho / (norm + delta) : 0.0;
    }
  }
}

}  // namespace

void allocate(const at::Tensor& energy, const at::Tensor& ema, const at::Tensor& scale, const at::Tensor& radius,
              bool gear, double rho, double beta, double delta, const DeviceStep& device_step) {
  const int64_t n_blocks = energy.numel();
  if (n_blocks == 0) return;
  const c10::cuda::CUDAGuard guard(energy.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto kernel = gear ? allocate_kernel<true> : allocate_kernel<false>;
  kernel<<<1, kThreads, 0, stream>>>(energy.const_data_ptr<double>(), ema.mutable_data_ptr<double>(),
                                     scale.mutable_data_ptr<double>(), radius.mutable_data_ptr<double>(), n_blocks, rho,
                                     beta, delta, optional_data<double>(device_step.scalars),
                                     optional_data<float>(device_step.found_inf));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace gearsam::cuda
