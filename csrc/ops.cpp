// The public operations: check every argument (a wrong buffer fails here with a message naming it, never with
// garbage), allocate the outputs, and call the implementation for the tensors' device.

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>
#include <string>

#include "gearsam.h"
#include "cpu/exchange.h"

namespace gearsam {
namespace {

// Types, shapes and strides spelled as Python prints them, so messages read the same from every backend.
std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return std::string("torch.") + c10::toString(type);
  }
}

std::string as_tuple(at::IntArrayRef values) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << (values.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << dtype_name(t.scalar_type()) << " " << as_tuple(t.sizes()) << " on " << t.device();
  return out.str();
}

// Same rules and messages as the Triton launchers (triton_kernels/_common.py). The operators' fakes
// (gearsam_fused/backends/cpp_fakes.py) check what a trace needs (layouts, dtypes, devices, sizes) in their own words.
void check_flat(const char* name, const at::Tensor& t, int64_t tile = 0, c10::optional<at::ScalarType> dtype = {},
                const at::Tensor* on_device_of = nullptr) {
  TORCH_CHECK_VALUE(t.defined(), name, " is undefined");
  if (on_device_of != nullptr)
    TORCH_CHECK_VALUE(t.device() == on_device_of->device(), name, " is on ", t.device(), ", the buffers on ",
                      on_device_of->device());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D tensor, got shape ",
                    as_tuple(t.sizes()), ", strides ", as_tuple(t.strides()));
  if (tile > 0)
    TORCH_CHECK_VALUE(t.numel() % tile == 0, name, " has ", t.numel(), " elements, not a multiple of the tile (", tile,
                      ")");
  if (dtype.has_value())
    TORCH_CHECK_VALUE(t.scalar_type() == *dtype, name, " must be ", dtype_name(*dtype), ", got ",
                      dtype_name(t.scalar_type()));
}

// A buffer read or written beside another: flat itself (a strided view of the right length would be read as if it
// were contiguous), then of the other's size, dtype and device.
void check_same(const char* name, const at::Tensor& t, const char* like_name, const at::Tensor& like) {
  check_flat(name, t);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes() && t.dtype() == like.dtype() && t.device() == like.device(), name, " (",
                    describe(t), ") must match ", like_name, " (", describe(like), ")");
}

// The block of each of `like`'s tiles: int32, flat, on like's device, one entry per tile.
void check_block_of_tile(const at::Tensor& block_of_tile, const at::Tensor& like, int64_t tile) {
  check_flat("block_of_tile", block_of_tile, 0, at::kInt, &like);
  const int64_t n_tiles = like.numel() / tile;
  TORCH_CHECK_VALUE(block_of_tile.numel() == n_tiles, "block_of_tile has ", block_of_tile.numel(), " entries for ",
                    n_tiles, " tiles");
}

void check_tile(int64_t tile) { TORCH_CHECK_VALUE(tile > 0, "tile must be positive, got ", tile); }

void check_floating(const char* name, const at::Tensor& t) {
  const auto type = t.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16, name,
                    " must be float32, float64, float16 or bfloat16, got ", dtype_name(type));
}

// The fused base steps compute in the buffers' own type, as torch's optimizers do; bf16 and fp16 would need their
// own rounding rules to stay bitwise equal to torch, so they are refused rather than approximated.
void check_base_step_dtype(const at::Tensor& param) {
  const auto type = param.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kDouble,
                    "fused base step supports float32 and float64 buffers, got ", dtype_name(type), " for param");
}

// An optional tensor argument that was passed (None arrives as nullopt; an undefined tensor counts as None too).
bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The weights a base step reads: backup, checked like param, or param itself where there is none.
const at::Tensor& weights_source(const c10::optional<at::Tensor>& backup, const at::Tensor& param) {
  if (!given(backup)) return param;
  check_same("backup", *backup, "param", param);
  return *backup;
}

// A state buffer the optimizer keeps exactly when `needed` (`why` says when that is): given without it or missing
// with it means the caller's state and options disagree, which no kernel can resolve.
void check_optional_state(const char* name, const c10::optional<at::Tensor>& t, bool needed, const char* why,
                          const at::Tensor& param) {
  const bool is_given = given(t);
  TORCH_CHECK_VALUE(!needed || is_given, name, " is required when ", why, ", got None");
  TORCH_CHECK_VALUE(needed || !is_given, name, " must be None unless ", why);
  if (is_given) check_same(name, *t, "param", param);
}

// mix_gradient_'s per-block coefficients (and a base step's, with grad_scale): float64, flat, on the device of `like`,
// one per block each (the messages of gearsam_fused/checks.py's check_scales).
void check_scales(const at::Tensor& grad_scale, const at::Tensor& correction_scale, const at::Tensor& like) {
  check_flat("grad_scale", grad_scale, 0, at::kDouble, &like);
  check_flat("correction_scale", correction_scale, 0, at::kDouble, &like);
  TORCH_CHECK_VALUE(correction_scale.numel() == grad_scale.numel(), "correction_scale has ", correction_scale.numel(),
                    " entries, grad_scale ", grad_scale.numel(), ": one per block each");
}

// LookSAM's correction: all three tensors or none, checked as perturb_ checks its scale and block_of_tile (same
// messages as gearsam_fused/checks.py). Given in part, the caller's correction state is broken: refused. grad_scale
// only beside them, sharpness (finite) only beside grad_scale.
Correction check_correction(const CorrectionArgs& args, const at::Tensor& param, int64_t tile) {
  const bool any = given(args.correction) || given(args.correction_scale) || given(args.block_of_tile);
  TORCH_CHECK_VALUE(std::isfinite(args.sharpness), "sharpness must be a finite real number, got ", args.sharpness);
  TORCH_CHECK_VALUE(args.sharpness == 0.0 || given(args.grad_scale),
                    "sharpness steps along grad - correction after the update from a mixed gradient: give grad_scale, "
                    "correction, correction_scale and block_of_tile with it");
  TORCH_CHECK_VALUE(any || !given(args.grad_scale),
                    "grad_scale scales the gradient beside a correction: give correction, correction_scale and "
                    "block_of_tile with it");
  if (!any) return {};
  std::string missing;
  const auto note = [&](const char* name, const c10::optional<at::Tensor>& t) {
    if (!given(t)) missing += (missing.empty() ? "" : ", ") + std::string(name);
  };
  note("correction", args.correction);
  note("correction_scale", args.correction_scale);
  note("block_of_tile", args.block_of_tile);
  TORCH_CHECK_VALUE(missing.empty(), "correction, correction_scale and block_of_tile must be given together, missing ",
                    missing);
  const Correction c{*args.correction, *args.correction_scale, *args.block_of_tile,
                     args.grad_scale.value_or(at::Tensor()), args.sharpness};
  check_flat("correction", c.values);
  check_same("correction", c.values, "param", param);
  check_flat("correction_scale", c.scale, 0, at::kDouble, &param);
  if (c.grad_scale.defined()) check_scales(c.grad_scale, c.scale, param);
  check_block_of_tile(c.block_of_tile, param, tile);
  return c;
}

// A capturable step's scalars: float64, contiguous 1-D, on the buffers' device, with one entry per `names` (what
// `op` reads from them, e.g. "lr, step").
void check_scalars(const at::Tensor& scalars, const char* op, int64_t count, const char* names,
                   const at::Tensor& like) {
  check_flat("scalars", scalars, 0, at::kDouble, &like);
  TORCH_CHECK_VALUE(scalars.numel() == count, "scalars has ", scalars.numel(), " elements; ", op, " takes ", count,
                    " (", names, ")");
}

// GradScaler's found_inf: float32, one element on the buffers' device. GradScaler's own is 0-d, so any shape with one
// element is accepted (the kernels load its single value).
void check_found_inf(const at::Tensor& found_inf, const at::Tensor& like) {
  TORCH_CHECK_VALUE(found_inf.device() == like.device(), "found_inf is on ", found_inf.device(), ", the buffers on ",
                    like.device());
  TORCH_CHECK_VALUE(found_inf.scalar_type() == at::kFloat, "found_inf must be torch.float32, got ",
                    dtype_name(found_inf.scalar_type()));
  TORCH_CHECK_VALUE(found_inf.numel() == 1, "found_inf has ", found_inf.numel(), " elements, expected 1");
}

// Both checked, as the implementations take them (undefined where not given); scalars as for check_scalars.
DeviceStep check_device_step(const DeviceStepArgs& args, const char* op, int64_t count, const char* names,
                             const at::Tensor& like) {
  DeviceStep step;
  if (given(args.scalars)) check_scalars(step.scalars = *args.scalars, op, count, names, like);
  if (given(args.found_inf)) check_found_inf(step.found_inf = *args.found_inf, like);
  return step;
}

bool on_cuda(const at::Tensor& t) {
  if (t.is_cpu()) return false;
  TORCH_CHECK_VALUE(t.is_cuda(), "tensors on ", t.device(), " are not supported; use CPU or CUDA tensors");
  TORCH_CHECK_VALUE(built_with_cuda(),
                    "this build of gearsam_fused._C has no CUDA kernels; reinstall with nvcc on PATH and a CUDA "
                    "build of torch (GEARSAM_BUILD_CUDA=1 makes a failed CUDA build an error)");
  return true;
}

}  // namespace

// Runs namespace cuda's or cpu's `fn` for the device of `tensor` (on_cuda refuses CUDA tensors in a CPU-only build).
#ifdef WITH_CUDA
#define GEARSAM_ON_DEVICE_OF(tensor, fn, ...) (on_cuda(tensor) ? cuda::fn(__VA_ARGS__) : cpu::fn(__VA_ARGS__))
#else
#define GEARSAM_ON_DEVICE_OF(tensor, fn, ...) (on_cuda(tensor), cpu::fn(__VA_ARGS__))
#endif

// The energy kernels' common arguments (rows: partials per tile); returns the number of blocks.
int64_t check_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& first_tile_of_block,
                     const at::Tensor& partials, int64_t tile, int64_t rows) {
  check_tile(tile);
  check_flat("grad", grad, tile);
  check_floating("grad", grad);
  check_same("param", param, "grad", grad);
  check_flat("first_tile_of_block", first_tile_of_block, 0, at::kLong, &grad);
  check_flat("partials", partials, 0, at::kDouble, &grad);
  const int64_t n_tiles = grad.numel() / tile;
  TORCH_CHECK_VALUE(partials.numel() == rows * n_tiles, "partials has ", partials.numel(), " entries for ", n_tiles,
                    " tiles", rows == 2 ? " (two per tile with other)" : "");
  TORCH_CHECK_VALUE(first_tile_of_block.numel() >= 1,
                    "first_tile_of_block needs at least one entry (B + 1 for B blocks)");
  return first_tile_of_block.numel() - 1;
}

void check_friendly(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda) {
  check_same("momentum", momentum, "grad", grad);
  TORCH_CHECK_VALUE(std::isfinite(sigma), "sigma must be a finite real number, got ", sigma);
  TORCH_CHECK_VALUE(std::isfinite(lmbda), "lmbda must be a finite real number, got ", lmbda);
}

at::Tensor block_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& first_tile_of_block,
                        const at::Tensor& partials, int64_t tile, bool adaptive, double eta,
                        const c10::optional<at::Tensor>& other) {
  if (other.has_value()) {
    check_same("other", *other, "grad", grad);
    TORCH_CHECK_VALUE(!adaptive,
                      "block_energy with other takes the inner product of the two beside the plain energies, which "
                      "has no adaptive form; pass adaptive=False");
  }
  const int64_t n_blocks =
      check_energy(grad, param, first_tile_of_block, partials, tile, other.has_value() ? 2 : 1);
  at::Tensor energy = other.has_value() ? at::empty({2, n_blocks}, grad.options().dtype(at::kDouble))
                                        : at::empty({n_blocks}, grad.options().dtype(at::kDouble));
  GEARSAM_ON_DEVICE_OF(grad, block_energy, grad, param, first_tile_of_block, partials, energy, tile, adaptive, eta,
                       other.value_or(at::Tensor()));
  return energy;
}

std::tuple<at::Tensor, at::Tensor> allocate(const at::Tensor& energy, const at::Tensor& ema, bool gear, double rho,
                                            double beta, double delta, const c10::optional<at::Tensor>& scalars,
                                            const c10::optional<at::Tensor>& found_inf) {
  check_flat("energy", energy, 0, at::kDouble);
  check_same("ema", ema, "energy", energy);
  const DeviceStep step = check_device_step({scalars, found_inf}, "allocate", 1, "rho", energy);
  // a host rho beside the scalars would be silently ignored
  TORCH_CHECK_VALUE(!step.scalars.defined() || rho == 0.0,
                    "rho is read from scalars when it is given; pass rho=0.0, got ", rho);
  at::Tensor scale = at::empty_like(energy);
  at::Tensor radius = at::empty_like(energy);
  GEARSAM_ON_DEVICE_OF(energy, allocate, energy, ema, scale, radius, gear, rho, beta, delta, step);
  return {scale, radius};
}

void perturb_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
              const at::Tensor& block_of_tile, int64_t tile, bool adaptive, double eta,
              const c10::optional<at::Tensor>& kept) {
  check_tile(tile);
  check_flat("param", param, tile);
  check_floating("param", param);
  check_same("grad", grad, "param", param);
  check_same("backup", backup, "param", param);
  check_flat("scale", scale, 0, at::kDouble, &param);
  check_block_of_tile(block_of_tile, param, tile);
  if (given(kept)) check_same("kept", *kept, "param", param);
  if (block_of_tile.numel() == 0) return;
  GEARSAM_ON_DEVICE_OF(param, perturb, param, grad, backup, scale, block_of_tile, tile, adaptive, eta,
                       kept.value_or(at::Tensor()));
}

namespace {

void check_restore(const at::Tensor& param, const at::Tensor& backup, int64_t tile) {
  check_tile(tile);
  check_flat("param", param, tile);
  check_same("backup", backup, "param", param);
}

}  // namespace

void restore_(const at::Tensor& param, const at::Tensor& backup, int64_t tile) {
  check_restore(param, backup, tile);
  if (param.numel() == 0) return;
  GEARSAM_ON_DEVICE_OF(param, restore, param, backup);
}

void restore_discarding_backup_(const at::Tensor& param, const at::Tensor& backup, int64_t tile) {
  check_restore(param, backup, tile);
  // CPU buffers past the stream threshold only (exchange.h); elsewhere restore_'s copy
  if (!cpu::try_exchange_memory(param, backup)) restore_(param, backup, tile);
}

void mix_gradient_(const at::Tensor& grad, const at::Tensor& correction, const at::Tensor& grad_scale,
                   const at::Tensor& correction_scale, const at::Tensor& block_of_tile, int64_t tile) {
  check_tile(tile);
  check_flat("grad", grad, tile);
  check_floating("grad", grad);
  check_same("correction", correction, "grad", grad);
  check_scales(grad_scale, correction_scale, grad);
  check_block_of_tile(block_of_tile, grad, tile);
  if (block_of_tile.numel() == 0) return;
  GEARSAM_ON_DEVICE_OF(grad, mix_gradient, grad, correction, grad_scale, correction_scale, block_of_tile, tile);
}

void exchange_sharpness_(const at::Tensor& grad, const at::Tensor& correction, int64_t tile) {
  check_tile(tile);
  check_flat("grad", grad, tile);
  check_floating("grad", grad);
  check_same("correction", correction, "grad", grad);
  if (grad.numel() == 0) return;
  GEARSAM_ON_DEVICE_OF(grad, exchange_sharpness, grad, correction);
}

void friendly_ascent_(const at::Tensor& grad, const at::Tensor& momentum, double sigma, double lmbda, bool first) {
  check_flat("grad", grad);
  check_floating("grad", grad);
  check_friendly(grad, momentum, sigma, lmbda);
  if (grad.numel() == 0) return;
  GEARSAM_ON_DEVICE_OF(grad, friendly_ascent, grad, momentum, sigma, lmbda, first);
}

at::Tensor friendly_energy_(const at::Tensor& grad, const at::Tensor& momentum, const at::Tensor& param,
                            const at::Tensor& first_tile_of_block, const at::Tensor& partials, int64_t tile,
                            bool adaptive, double eta, double sigma, double lmbda, bool first) {
  const int64_t n_blocks = check_energy(grad, param, first_tile_of_block, partials, tile, 1);
  check_friendly(grad, momentum, sigma, lmbda);
  at::Tensor energy = at::empty({n_blocks}, grad.options().dtype(at::kDouble));
  GEARSAM_ON_DEVICE_OF(grad, friendly_energy, grad, momentum, param, first_tile_of_block, partials, energy, tile,
                       adaptive, eta, sigma, lmbda, first);
  return energy;
}

namespace {

// A base step's momentum energy outputs (gearsam.h, MomentumEnergyArgs): all three or none, beside a momentum and
// without found_inf, checked as block_energy checks its own. Same words as gearsam_fused/checks.py.
MomentumEnergy check_momentum_energy(const MomentumEnergyArgs& args, bool has_momentum, const DeviceStep& step,
                                     const at::Tensor& param, int64_t tile) {
  const int given_count = given(args.first_tile_of_block) + given(args.partials) + given(args.momentum_energy);
  if (given_count == 0) return {};
  TORCH_CHECK_VALUE(given_count == 3,
                    "first_tile_of_block, partials and momentum_energy are given together or not at all");
  TORCH_CHECK_VALUE(has_momentum, "momentum_energy sums the momentum the step writes: this step keeps none");
  TORCH_CHECK_VALUE(!step.found_inf.defined(),
                    "momentum_energy is not taken with found_inf: a skipped step writes no momentum");
  const MomentumEnergy e{*args.first_tile_of_block, *args.partials, *args.momentum_energy};
  check_flat("first_tile_of_block", e.first_tile_of_block, 0, at::kLong, &param);
  check_flat("partials", e.partials, 0, at::kDouble, &param);
  check_flat("momentum_energy", e.energy, 0, at::kDouble, &param);
  const int64_t n_tiles = param.numel() / tile;
  TORCH_CHECK_VALUE(e.partials.numel() == n_tiles, "partials has ", e.partials.numel(), " entries for ", n_tiles,
                    " tiles");
  TORCH_CHECK_VALUE(e.first_tile_of_block.numel() >= 1,
                    "first_tile_of_block needs at least one entry (B + 1 for B blocks)");
  TORCH_CHECK_VALUE(e.energy.numel() == e.first_tile_of_block.numel() - 1, "momentum_energy has ", e.energy.numel(),
                    " entries for ", e.first_tile_of_block.numel() - 1, " blocks");
  return e;
}

}  // namespace

void sgd_step_(const at::Tensor& param, const at::Tensor& grad, const c10::optional<at::Tensor>& backup,
               const c10::optional<at::Tensor>& momentum_buffer, int64_t tile, const SgdOptions& options,
               const CorrectionArgs& correction, const DeviceStepArgs& device_step,
               const MomentumEnergyArgs& momentum_energy) {
  check_tile(tile);
  check_flat("param", param, tile);
  check_base_step_dtype(param);
  check_same("grad", grad, "param", param);
  // None: the implementation reads w from param itself, each element before it writes it
  const at::Tensor& w = weights_source(backup, param);
  check_optional_state("momentum_buffer", momentum_buffer, options.momentum != 0, "momentum != 0", param);
  const Correction c = check_correction(correction, param, tile);
  const DeviceStep step = check_device_step(device_step, "sgd_step_", 2, "lr, step", param);
  // host values beside the scalars would be silently ignored
  TORCH_CHECK_VALUE(!step.scalars.defined() || (options.lr == 0.0 && !options.first),
                    "lr and first are read from scalars when it is given; pass lr=0.0 and first=False");
  const MomentumEnergy e = check_momentum_energy(momentum_energy, given(momentum_buffer), step, param, tile);
  if (param.numel() == 0) {
    if (e.given()) e.energy.zero_();
    return;
  }
  GEARSAM_ON_DEVICE_OF(param, sgd_step, param, grad, w, momentum_buffer.value_or(at::Tensor()), tile, options, c,
                       step, e);
}

void adam_step_(const at::Tensor& param, const at::Tensor& grad, const c10::optional<at::Tensor>& backup,
                const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const c10::optional<at::Tensor>& max_exp_avg_sq, int64_t tile, const AdamOptions& options,
                const CorrectionArgs& correction, const DeviceStepArgs& device_step,
                const MomentumEnergyArgs& momentum_energy) {
  check_tile(tile);
  check_flat("param", param, tile);
  check_base_step_dtype(param);
  check_same("grad", grad, "param", param);
  const at::Tensor& w = weights_source(backup, param);  // as in sgd_step_
  check_same("exp_avg", exp_avg, "param", param);
  check_same("exp_avg_sq", exp_avg_sq, "param", param);
  check_optional_state("max_exp_avg_sq", max_exp_avg_sq, options.amsgrad, "amsgrad=True", param);
  const Correction c = check_correction(correction, param, tile);
  const DeviceStep step = check_device_step(device_step, "adam_step_", 2, "lr, step", param);
  TORCH_CHECK_VALUE(!step.scalars.defined() || (options.lr == 0.0 && options.k == 0.0),  // as in sgd_step_
                    "lr and step are read from scalars when it is given; pass lr=0.0 and step=0");
  const MomentumEnergy e = check_momentum_energy(momentum_energy, true, step, param, tile);
  if (param.numel() == 0) {
    if (e.given()) e.energy.zero_();
    return;
  }
  GEARSAM_ON_DEVICE_OF(param, adam_step, param, grad, w, exp_avg, exp_avg_sq,
                       max_exp_avg_sq.value_or(at::Tensor()), tile, options, c, step, e);
}

bool built_with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace gearsam
