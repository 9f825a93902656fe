// SAM's restore fused with the base optimizer's update on CUDA: one pass reads backup (w; param holds w + eps and is
// never read), writes param and the optimizer state; backup may be param itself. The update and its roundings are
// stated once, in gearsam_fused/base_step.py: the roundings of ATen's CPU kernels (a true division by
// bias_correction2_sqrt, not torch's CUDA multiply by its reciprocal), so a step gives the same bits on either device
// but for the square root, correctly rounded here and ATen's own on the CPU. Each scalar is rounded once to the
// buffers' type (SgdConstants / AdamConstants), fma_rn rounds once and every other operation goes through its own
// _rn intrinsic, so nvcc can neither contract nor approximate anything. Grid-stride over 16-byte vectors with
// 64-bit indices.
//
// Capturable (csrc/README.md): scalars and found_inf are loaded in the kernel, never on the host, so a CUDA graph replays
// the step with their current values. Given scalars, each thread rebuilds the constants from options.at_step(lr, k),
// the constructor the host runs (the double arithmetic the same, but for the device's pow, within 2 ulp); found_inf
// nonzero turns the step into a copy of backup into param, the state and grad untouched.

#include <ATen/Dispatch.h>

#include "../gearsam.h"
#include "common.cuh"

namespace gearsam::cuda {
namespace {

// torch.maximum's rule: NaN from either side wins, so a NaN second moment stays visible instead of being dropped.
template <typename T>
__device__ __forceinline__ T nan_max(T a, T b) {
  return (a < b || isnan(b)) ? b : a;
}

// The correction as the kernels take it: values null without one, grad_scale null for 1, sharpness 0 for no sharpness
// step. Run-time flags, the same for every thread: a step without them loads nothing more, at the cost of a uniform
// branch, where template parameters would multiply the kernels compiled per dtype and vector width.
template <typename scalar_t>
struct CorrectionPtrs {
  const scalar_t* values;
  const double* scale;
  const double* grad_scale;
  const int32_t* block_of_tile;
  int64_t tile;
  double sharpness;
};

template <typename scalar_t>
CorrectionPtrs<scalar_t> correction_ptrs(const Correction& c, int64_t tile) {
  if (!c.given()) return {nullptr, nullptr, nullptr, nullptr, tile, 0.0};
  return {c.values.const_data_ptr<scalar_t>(), c.scale.const_data_ptr<double>(), optional_data<double>(c.grad_scale),
          c.block_of_tile.const_data_ptr<int32_t>(), tile, c.sharpness};
}

// The Vec gradients from element i on, corrected where a correction is given:
// fma(C(scale[block]), correction, C(grad_scale[block]) * grad), the scales rounded once to scalar_t, no product where
// grad_scale is not given. A vector never spans two tiles (vectorised only where Vec divides the tile).
template <typename scalar_t, int Vec>
__device__ __forceinline__ Pack<scalar_t, Vec> load_grad(const scalar_t* __restrict__ grad,
                                                         const CorrectionPtrs<scalar_t>& corr, int64_t i) {
  using pack_t = Pack<scalar_t, Vec>;
  pack_t g = *reinterpret_cast<const pack_t*>(grad + i);
  if (corr.values != nullptr) {
    const int32_t block = corr.block_of_tile[i / corr.tile];
    const scalar_t s = static_cast<scalar_t>(corr.scale[block]);
    const pack_t x = *reinterpret_cast<const pack_t*>(corr.values + i);
    if (corr.grad_scale != nullptr) {
      const scalar_t a = static_cast<scalar_t>(corr.grad_scale[block]);
#pragma unroll
      for (int k = 0; k < Vec; ++k) g.v[k] = mul_rn(a, g.v[k]);
    }
#pragma unroll
    for (int k = 0; k < Vec; ++k) g.v[k] = fma_rn(s, x.v[k], g.v[k]);
  }
  return g;
}

// The updated parameters `out` from element i on, followed by the sharpness step where corr.sharpness is nonzero (a
// uniform branch): fma(C(sharpness_step(lr, sharpness)), grad - correction, out), the difference rounded on its own.
template <typename scalar_t, int Vec>
__device__ __forceinline__ void sharpen(Pack<scalar_t, Vec>& out, const scalar_t* __restrict__ grad,
                                        const CorrectionPtrs<scalar_t>& corr, double lr, int64_t i) {
  using pack_t = Pack<scalar_t, Vec>;
  if (corr.sharpness == 0.0) return;
  const scalar_t f = static_cast<scalar_t>(sharpness_step(lr, corr.sharpness));
  const pack_t h = *reinterpret_cast<const pack_t*>(grad + i);
  const pack_t g = *reinterpret_cast<const pack_t*>(corr.values + i);
#pragma unroll
  for (int k = 0; k < Vec; ++k) out.v[k] = fma_rn(f, sub_rn(h.v[k], g.v[k]), out.v[k]);
}

// What a capturable step reads from device memory, null where not given: the (lr, k) of scalars, with the options to
// rebuild the constants from, and found_inf.
template <typename Options>
struct DeviceStepPtrs {
  const double* scalars;
  const float* found_inf;
  Options options;

  // The step's lr: the host's, or scalars' where given.
  __device__ __forceinline__ double lr() const { return scalars != nullptr ? scalars[0] : options.lr; }
};

template <typename Options>
DeviceStepPtrs<Options> device_step_ptrs(const DeviceStep& step, const Options& options) {
  return {optional_data<double>(step.scalars), optional_data<float>(step.found_inf), options};
}

// found_inf nonzero: the step is skipped. One load per thread; the value, and so the branch, is the same for all.
__device__ __forceinline__ bool skipped(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.0f; }

// A skipped step: param = backup, nothing where backup is param itself (a step from the current weights).
template <typename scalar_t, int Vec>
__device__ void copy_backup(scalar_t* param, const scalar_t* backup, int64_t n_vectors) {
  using pack_t = Pack<scalar_t, Vec>;
  if (param == backup) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += stride)
    *reinterpret_cast<pack_t*>(param + v * Vec) = *reinterpret_cast<const pack_t*>(backup + v * Vec);
}

// param and backup carry no __restrict__: backup may be param itself (a step from the current weights). Each thread
// reads its elements of backup before it writes the same elements of param, which is well defined only while the
// compiler must assume the two may alias (no reordering across the store, no read-only cache path for backup).
template <typename scalar_t, int Vec>
__global__ void sgd_kernel(scalar_t* param, const scalar_t* __restrict__ grad, const scalar_t* backup,
                           scalar_t* __restrict__ momentum_buffer, CorrectionPtrs<scalar_t> corr, int64_t n_vectors,
                           SgdConstants<scalar_t> c, DeviceStepPtrs<SgdOptions> step) {
  using pack_t = Pack<scalar_t, Vec>;
  if (skipped(step.found_inf)) return copy_backup<scalar_t, Vec>(param, backup, n_vectors);
  if (step.scalars != nullptr) c = SgdConstants<scalar_t>(step.options.at_step(step.scalars[0], step.scalars[1]));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += stride) {
    const int64_t i = v * Vec;
    const pack_t w = *reinterpret_cast<const pack_t*>(backup + i);
    const pack_t g = load_grad<scalar_t, Vec>(grad, corr, i);
    pack_t buf, out;
    // first: torch clones the gradient into the new buffer, so the old contents (zeros, garbage) are never read
    if (c.with_momentum && !c.first) buf = *reinterpret_cast<const pack_t*>(momentum_buffer + i);
#pragma unroll
    for (int k = 0; k < Vec; ++k) {
      scalar_t gk = c.maximize ? -g.v[k] : g.v[k];
      if (c.l2) gk = fma_rn(c.weight_decay, w.v[k], gk);
      scalar_t d = gk;
      if (c.with_momentum) {
        const scalar_t b = c.first ? gk : fma_rn(c.one_minus_dampening, gk, mul_rn(buf.v[k], c.momentum));
        buf.v[k] = b;
        d = c.nesterov ? fma_rn(c.momentum, b, gk) : b;
      }
      out.v[k] = fma_rn(c.neg_lr, d, w.v[k]);
    }
    sharpen<scalar_t, Vec>(out, grad, corr, step.lr(), i);
    *reinterpret_cast<pack_t*>(param + i) = out;
    if (c.with_momentum) *reinterpret_cast<pack_t*>(momentum_buffer + i) = buf;
  }
}

// param and backup without __restrict__, as in sgd_kernel: backup may be param.
template <typename scalar_t, int Vec>
__global__ void adam_kernel(scalar_t* param, const scalar_t* __restrict__ grad, const scalar_t* backup,
                            scalar_t* __restrict__ exp_avg, scalar_t* __restrict__ exp_avg_sq,
                            scalar_t* __restrict__ max_exp_avg_sq, CorrectionPtrs<scalar_t> corr, int64_t n_vectors,
                            AdamConstants<scalar_t> c, DeviceStepPtrs<AdamOptions> step) {
  using pack_t = Pack<scalar_t, Vec>;
  if (skipped(step.found_inf)) return copy_backup<scalar_t, Vec>(param, backup, n_vectors);  // as in sgd_kernel
  if (step.scalars != nullptr) c = AdamConstants<scalar_t>(step.options.at_step(step.scalars[0], step.scalars[1]));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vectors; v += stride) {
    const int64_t i = v * Vec;
    const pack_t w = *reinterpret_cast<const pack_t*>(backup + i);
    const pack_t g = load_grad<scalar_t, Vec>(grad, corr, i);
    pack_t m = *reinterpret_cast<const pack_t*>(exp_avg + i);
    pack_t sq = *reinterpret_cast<const pack_t*>(exp_avg_sq + i);
    pack_t sq_max, out;
    if (c.amsgrad) sq_max = *reinterpret_cast<const pack_t*>(max_exp_avg_sq + i);
#pragma unroll
    for (int k = 0; k < Vec; ++k) {
      scalar_t wk = w.v[k];
      scalar_t gk = c.maximize ? -g.v[k] : g.v[k];
      if (c.decoupled)
        wk = mul_rn(wk, c.decay);
      else if (c.l2)
        gk = fma_rn(c.weight_decay, wk, gk);
      // ATen's lerp: from m for a small weight, from the end point g otherwise (lerp_weight is then weight - 1)
      const scalar_t diff = sub_rn(gk, m.v[k]);
      m.v[k] = fma_rn(c.lerp_weight, diff, c.lerp_small ? m.v[k] : gk);
      sq.v[k] = fma_rn(mul_rn(c.one_minus_beta2, gk), gk, mul_rn(sq.v[k], c.beta2));
      scalar_t second = sq.v[k];
      if (c.amsgrad) {
        second = nan_max(sq_max.v[k], second);
        sq_max.v[k] = second;
      }
      const scalar_t denom = add_rn(div_rn(sqrt_rn(second), c.bias_correction2_sqrt), c.eps);
      out.v[k] = add_rn(wk, div_rn(mul_rn(c.neg_step_size, m.v[k]), denom));
    }
    sharpen<scalar_t, Vec>(out, grad, corr, step.lr(), i);
    *reinterpret_cast<pack_t*>(param + i) = out;
    *reinterpret_cast<pack_t*>(exp_avg + i) = m;
    *reinterpret_cast<pack_t*>(exp_avg_sq + i) = sq;
    if (c.amsgrad) *reinterpret_cast<pack_t*>(max_exp_avg_sq + i) = sq_max;
  }
}

// Enough threads for one vector each, capped by grid_for: the kernels loop over the rest.
inline int blocks_for(int64_t n_vectors, const at::Tensor& param) {
  return grid_for((n_vectors + kThreads - 1) / kThreads, param.get_device());
}

template <typename scalar_t, int Vec>
void launch_sgd(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,
                const at::Tensor& momentum_buffer, const SgdOptions& options, const Correction& correction,
                const DeviceStep& device_step, int64_t tile, cudaStream_t stream) {
  const int64_t n_vectors = param.numel() / Vec;
  const SgdConstants<scalar_t> c(options);
  sgd_kernel<scalar_t, Vec><<<blocks_for(n_vectors, param), kThreads, 0, stream>>>(
      param.mutable_data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(), backup.const_data_ptr<scalar_t>(),
      c.with_momentum ? momentum_buffer.mutable_data_ptr<scalar_t>() : nullptr,
      correction_ptrs<scalar_t>(correction, tile), n_vectors, c, device_step_ptrs(device_step, options));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int Vec>
void launch_adam(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, const AdamOptions& options,
                 const Correction& correction, const DeviceStep& device_step, int64_t tile, cudaStream_t stream) {
  const int64_t n_vectors = param.numel() / Vec;
  const AdamConstants<scalar_t> c(options);  // with scalars, from lr = k = 0: a placeholder the kernel replaces
  adam_kernel<scalar_t, Vec><<<blocks_for(n_vectors, param), kThreads, 0, stream>>>(
      param.mutable_data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(), backup.const_data_ptr<scalar_t>(),
      exp_avg.mutable_data_ptr<scalar_t>(), exp_avg_sq.mutable_data_ptr<scalar_t>(),
      c.amsgrad ? max_exp_avg_sq.mutable_data_ptr<scalar_t>() : nullptr, correction_ptrs<scalar_t>(correction, tile),
      n_vectors, c, device_step_ptrs(device_step, options));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Data pointer of an optional buffer, null where it is absent (null is aligned, so it never blocks vector access).
const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

// The new momentum's block energies, where the step was asked for them: block_energy's two stages on the momentum,
// launched after the step on the same stream. A second read of the momentum: these kernels walk the bucket in a
// grid-stride over vectors, the energy's first stage one thread block per tile.
void sum_momentum(const at::Tensor& momentum, const MomentumEnergy& energy, int64_t tile) {
  if (energy.given())
    block_energy(momentum, momentum, energy.first_tile_of_block, energy.partials, energy.energy, tile, false, 0.0,
                 at::Tensor());
}

}  // namespace

void sgd_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,
              const at::Tensor& momentum_buffer, int64_t tile, const SgdOptions& options,
              const Correction& correction, const DeviceStep& device_step, const MomentumEnergy& energy) {
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_sgd_step_cuda", [&] {
    constexpr int vec = kVec<scalar_t>;
    const bool wide = vectorizable<vec>(tile, {param.const_data_ptr(), grad.const_data_ptr(), backup.const_data_ptr(),
                                               data_or_null(momentum_buffer), data_or_null(correction.values)});
    wide ? launch_sgd<scalar_t, vec>(param, grad, backup, momentum_buffer, options, correction, device_step, tile,
                                     stream)
         : launch_sgd<scalar_t, 1>(param, grad, backup, momentum_buffer, options, correction, device_step, tile,
                                   stream);
  });
  sum_momentum(momentum_buffer, energy, tile);
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t tile,
               const AdamOptions& options, const Correction& correction, const DeviceStep& device_step,
               const MomentumEnergy& energy) {
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "gearsam_adam_step_cuda", [&] {
    constexpr int vec = kVec<scalar_t>;
    const bool wide = vectorizable<vec>(tile, {param.const_data_ptr(), grad.const_data_ptr(), backup.const_data_ptr(),
                                               exp_avg.const_data_ptr(), exp_avg_sq.const_data_ptr(),
                                               data_or_null(max_exp_avg_sq), data_or_null(correction.values)});
    wide ? launch_adam<scalar_t, vec>(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, options, correction,
                                      device_step, tile, stream)
         : launch_adam<scalar_t, 1>(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, options, correction,
                                    device_step, tile, stream);
  });
  sum_momentum(exp_avg, energy, tile);
}

}  // namespace gearsam::cuda
