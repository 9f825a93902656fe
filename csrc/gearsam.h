// The public operations of the extension over one flat bucket (see gearsam_fused/flat.py for the layout): what each
// computes is stated once, in csrc/README.md's table (the base steps' update in gearsam_fused/base_step.py), and
// their schemas in library.cpp. This header declares them with the structures their optional arguments are packed
// in (the base steps' options and constants, LookSAM's correction, the capturable step's device values, the
// momentum's energy outputs), and the per-device implementations both devices provide.
//
// library.cpp registers these eleven as the operators torch.ops.gearsam_fused.<name> (schemas there). ops.cpp checks
// the arguments and calls the implementation for the tensors' device: namespace cpu (cpu/*.cpp) or namespace cuda
// (cuda/*.cu, declared and compiled only when WITH_CUDA is defined). Every implementation receives tensors that
// ops.cpp has already checked, and allocates nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/Optional.h>

#include <cmath>
#include <tuple>

// The options and constants below are built on the device too (from scalars read there): __host__ __device__ under
// nvcc, nothing for the host compiler, which compiles this header as well.
#ifdef __CUDACC__
#define GEARSAM_HOST_DEVICE __host__ __device__
#else
#define GEARSAM_HOST_DEVICE
#endif

namespace gearsam {

at::Tensor block_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& first_tile_of_block,
                        const at::Tensor& partials, int64_t tile, bool adaptive, double eta,
                        const c10::optional<at::Tensor>& other = {});
std::tuple<at::Tensor, at::Tensor> allocate(const at::Tensor& energy, const at::Tensor& ema, bool gear, double rho,
                                            double beta, double delta, const c10::optional<at::Tensor>& scalars = {},
                                            const c10::optional<at::Tensor>& found_inf = {});
void perturb_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
              const at::Tensor& block_of_tile, int64_t tile, bool adaptive, double eta,
              const c10::optional<at::Tensor>& kept = {});
void restore_(const at::Tensor& param, const at::Tensor& backup, int64_t tile);
void restore_discarding_backup_(const at::Tensor& param, const at::Tensor& backup, int64_t tile);
void mix_gradient_(const at::Tensor& grad, const at::Tensor& correction, const at::Tensor& grad_scale,
                   const at::Tensor& correction_scale, const at::Tensor& block_of_tile, int64_t tile);
void exchange_sharpness_(const at::Tensor& grad, const at::Tensor& correction, int64_t tile);
void friendly_ascent_(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda, bool first);
at::Tensor friendly_energy_(const at::Tensor& grad, const at::Tensor& momentum, const at::Tensor& param,
                            const at::Tensor& first_tile_of_block, const at::Tensor& partials, int64_t tile,
                            bool adaptive, double eta, double sigma, double lmbda, bool first);

// b - c * d with the product rounded on its own: in device code nvcc would contract a plain `b - c * d` into an fma
// (the host code is built with -ffp-contract=off).
GEARSAM_HOST_DEVICE inline double sub_product(double b, double c, double d) {
#ifdef __CUDA_ARCH__
  return __dsub_rn(b, __dmul_rn(c, d));
#else
  return b - c * d;
#endif
}

// The hyperparameters of the fused base steps (double), with the two that change per step: lr and SGD's first (the
// momentum buffer starts from this step's gradient) or Adam's step count k (1 for the first). at_step replaces them
// by the (lr, k) a capturable step reads from its scalars, so both paths build the same constants from the same
// doubles.
struct SgdOptions {
  double lr, weight_decay, momentum, dampening;
  bool nesterov, maximize, first;

  GEARSAM_HOST_DEVICE SgdOptions at_step(double step_lr, double k) const {
    SgdOptions o = *this;
    o.lr = step_lr;
    o.first = k == 1.0;
    return o;
  }
};
struct AdamOptions {
  double beta1, beta2, eps, weight_decay;
  bool decoupled, amsgrad, maximize;
  double lr, k;

  GEARSAM_HOST_DEVICE AdamOptions at_step(double step_lr, double step_k) const {
    AdamOptions o = *this;
    o.lr = step_lr;
    o.k = step_k;
    return o;
  }
  // What torch's Adam derives from lr, the betas and k in Python (gearsam_fused.base_step.adam_scalars), operation
  // for operation: Python's float ** is C's pow. (On the device, CUDA's pow: within 2 ulp where glibc's is within 1,
  // so a CUDA step given scalars may differ from the host-valued one in a constant's last bit.)
  GEARSAM_HOST_DEVICE double step_size() const { return lr / (1.0 - ::pow(beta1, k)); }
  GEARSAM_HOST_DEVICE double bias_correction2_sqrt() const { return ::pow(1.0 - ::pow(beta2, k), 0.5); }
  GEARSAM_HOST_DEVICE double decay() const { return sub_product(1.0, lr, weight_decay); }
};

// The base step's corrected gradient as the public operations take it: correction (like grad), correction_scale
// (float64 [B]) and block_of_tile (int32, the block of each tile), all three given or none (LookSAM's correction); and
// grad_scale (float64 [B]), only with them (the SAM family's descent gradient, mix_gradient_'s formula); sharpness, a
// weight, only with grad_scale (WSAM's decoupled sharpness step, 0 for none).
struct CorrectionArgs {
  c10::optional<at::Tensor> correction, correction_scale, block_of_tile, grad_scale;
  double sharpness = 0.0;
};

// A capturable step's device values as the public base steps take them (csrc/README.md): either may be absent.
struct DeviceStepArgs {
  c10::optional<at::Tensor> scalars, found_inf;
};

// The block energies of the new momentum (SGD's momentum_buffer, Adam's exp_avg) as a base step may sum them while
// it writes the momentum (MomentumSAM's look-ahead): first_tile_of_block (int64 [B + 1]), partials (float64, one per
// tile, overwritten) and momentum_energy (float64 [B], written), all three or none; momentum_energy then holds
// block_energy(momentum, adaptive=False), bit for bit. Not with found_inf: a skipped step writes no momentum.
struct MomentumEnergyArgs {
  c10::optional<at::Tensor> first_tile_of_block, partials, momentum_energy;
};

// backup: the weights w to step from, or nullopt for param's own (a step with no perturbation to undo).
void sgd_step_(const at::Tensor& param, const at::Tensor& grad, const c10::optional<at::Tensor>& backup,
               const c10::optional<at::Tensor>& momentum_buffer, int64_t tile, const SgdOptions& options,
               const CorrectionArgs& correction = {}, const DeviceStepArgs& device_step = {},
               const MomentumEnergyArgs& momentum_energy = {});
void adam_step_(const at::Tensor& param, const at::Tensor& grad, const c10::optional<at::Tensor>& backup,
                const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const c10::optional<at::Tensor>& max_exp_avg_sq, int64_t tile, const AdamOptions& options,
                const CorrectionArgs& correction = {}, const DeviceStepArgs& device_step = {},
                const MomentumEnergyArgs& momentum_energy = {});

// The checked correction the implementations receive: g = fma(C(scale[block]), values, C(grad_scale[block]) * grad)
// for the elements of tile t, block = block_of_tile[t], C rounding once to the buffers' type; grad_scale undefined
// stands for 1 (the product is then grad itself). All undefined where the step has none. A nonzero sharpness (only
// with grad_scale) adds the decoupled sharpness step after the update: param = fma(C(sharpness_step(lr, sharpness)),
// grad - values, param), the difference rounded on its own, the parameter as rounded to T.
struct Correction {
  at::Tensor values, scale, block_of_tile, grad_scale;
  double sharpness = 0.0;
  bool given() const { return values.defined(); }
};

// The sharpness step's factor of grad - correction at the step's lr, in double: Python's -lr * weight.
GEARSAM_HOST_DEVICE inline double sharpness_step(double lr, double sharpness) { return -(lr * sharpness); }

// The checked scalars and found_inf, undefined where not given. The CPU implementations read them on the host (they
// are CPU tensors there), the CUDA kernels from device memory, without a synchronisation.
struct DeviceStep {
  at::Tensor scalars, found_inf;
};

// The checked momentum energy outputs (MomentumEnergyArgs), all undefined where the step sums none.
struct MomentumEnergy {
  at::Tensor first_tile_of_block, partials, energy;
  bool given() const { return energy.defined(); }
};

// The options with every scalar rounded once to the buffers' type T, as torch rounds a Python-scalar alpha or value
// (differences such as 1 - dampening are taken in double first, as Python does). Both implementations start from
// these, so the CPU and CUDA kernels multiply by the very same constants. Plain values: they are kernel arguments,
// and a CUDA kernel given scalars builds them itself from options.at_step(lr, k), with the same operations.
template <typename T>
struct SgdConstants {
  T neg_lr, weight_decay, momentum, one_minus_dampening;
  bool l2, with_momentum, nesterov, maximize, first;

  GEARSAM_HOST_DEVICE explicit SgdConstants(const SgdOptions& o)
      : neg_lr(static_cast<T>(-o.lr)),
        weight_decay(static_cast<T>(o.weight_decay)),
        momentum(static_cast<T>(o.momentum)),
        one_minus_dampening(static_cast<T>(1.0 - o.dampening)),
        l2(o.weight_decay != 0),  // tested in double, as torch tests the Python float
        with_momentum(o.momentum != 0),
        nesterov(o.nesterov),
        maximize(o.maximize),
        first(o.first) {}
};

template <typename T>
struct AdamConstants {
  // lerp_weight is 1 - beta1 where |1 - beta1| < 0.5, else (1 - beta1) - 1 rounded in T: ATen's lerp takes the
  // second form for large weights, and the branch depends on the weight alone, so it is chosen here once.
  T weight_decay, decay, lerp_weight, beta2, one_minus_beta2, eps, bias_correction2_sqrt, neg_step_size;
  bool l2, decoupled, lerp_small, amsgrad, maximize;

  GEARSAM_HOST_DEVICE explicit AdamConstants(const AdamOptions& o)
      : weight_decay(static_cast<T>(o.weight_decay)),
        decay(static_cast<T>(o.decay())),
        lerp_weight(static_cast<T>(1.0 - o.beta1)),
        beta2(static_cast<T>(o.beta2)),
        one_minus_beta2(static_cast<T>(1.0 - o.beta2)),
        eps(static_cast<T>(o.eps)),
        bias_correction2_sqrt(static_cast<T>(o.bias_correction2_sqrt())),
        neg_step_size(static_cast<T>(-o.step_size())),
        l2(o.weight_decay != 0 && !o.decoupled),
        decoupled(o.weight_decay != 0 && o.decoupled),
        lerp_small(lerp_weight < T(0.5) && lerp_weight > T(-0.5)),  // |lerp_weight| < 0.5, on either device
        amsgrad(o.amsgrad),
        maximize(o.maximize) {
    if (!lerp_small) lerp_weight = lerp_weight - T(1);
  }
};

// momentum_buffer and max_exp_avg_sq are undefined tensors where the optimizer has none; backup is param itself
// where the public operation was given none (so a skipped step, found_inf nonzero, then writes nothing at all).
#define GEARSAM_DEVICE_IMPLEMENTATIONS                                                                              \
  void block_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& first_tile_of_block,         \
                    const at::Tensor& partials, const at::Tensor& energy, int64_t tile, bool adaptive, double eta,  \
                    const at::Tensor& other);                                                                       \
  void allocate(const at::Tensor& energy, const at::Tensor& ema, const at::Tensor& scale, const at::Tensor& radius, \
                bool gear, double rho, double beta, double delta, const DeviceStep& device_step);                   \
  void perturb(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,  \
               const at::Tensor& block_of_tile, int64_t tile, bool adaptive, double eta, const at::Tensor& kept);      \
  void restore(const at::Tensor& param, const at::Tensor& backup);                                                   \
  void mix_gradient(const at::Tensor& grad, const at::Tensor& correction, const at::Tensor& grad_scale,              \
                    const at::Tensor& correction_scale, const at::Tensor& block_of_tile, int64_t tile);              \
  void exchange_sharpness(const at::Tensor& grad, const at::Tensor& correction);                                     \
  void friendly_ascent(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda, bool first);   \
  void friendly_energy(const at::Tensor& grad, const at::Tensor& momentum, const at::Tensor& param,                  \
                       const at::Tensor& first_tile_of_block, const at::Tensor& partials, const at::Tensor& energy,  \
                       int64_t tile, bool adaptive, double eta, double sigma, double lmbda, bool first);             \
  void sgd_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,                           \
                const at::Tensor& momentum_buffer, int64_t tile, const SgdOptions& options,                          \
                const Correction& correction, const DeviceStep& device_step, const MomentumEnergy& energy);          \
  void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,                          \
                 const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,          \
                 int64_t tile, const AdamOptions& options, const Correction& correction,                             \
                 const DeviceStep& device_step, const MomentumEnergy& energy);

namespace cpu {
GEARSAM_DEVICE_IMPLEMENTATIONS
}  // namespace cpu

#ifdef WITH_CUDA
namespace cuda {
GEARSAM_DEVICE_IMPLEMENTATIONS
}  // namespace cuda
#endif

#undef GEARSAM_DEVICE_IMPLEMENTATIONS

// Whether this build contains the CUDA implementations.
bool built_with_cuda();

}  // namespace gearsam
