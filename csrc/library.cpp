// The eleven kernels as operators of torch.library: torch.ops.gearsam_fused.<name>, with the names and keyword arguments
// of the Triton launchers (gearsam_fused.triton_kernels), so one backend class drives both. As operators they pass
// through the dispatcher, so torch.compile, fake tensors and functionalisation see them: each schema declares the
// inputs it writes (Tensor(a!)), and gearsam_fused/backends/cpp_fakes.py registers their fake implementations
// (shapes and the argument checks that need no data; also the Meta kernels). Formulas: gearsam.h.
//
// The CPU and the CUDA key both run the checked entry points of ops.cpp, which pick the implementation by the
// tensors' device: a build without CUDA kernels then still refuses CUDA tensors with a message that says how to get
// them, rather than the dispatcher's "could not run" for a missing key. Python calls release the GIL in the
// dispatcher.

#include <torch/library.h>

#include "gearsam.h"

namespace {

using OptionalTensor = c10::optional<at::Tensor>;

// The base steps take their hyperparameters as flat keywords, like the Triton launchers, and pack them here.
void sgd_step(const at::Tensor& param, const at::Tensor& grad, const OptionalTensor& backup,
              const OptionalTensor& momentum_buffer, int64_t tile, double lr, double weight_decay, double momentum,
              double dampening, bool nesterov, bool maximize, bool first, const OptionalTensor& correction,
              const OptionalTensor& correction_scale, const OptionalTensor& block_of_tile,
              const OptionalTensor& scalars, const OptionalTensor& found_inf, const OptionalTensor& grad_scale,
              double sharpness, const OptionalTensor& first_tile_of_block, const OptionalTensor& partials,
              const OptionalTensor& momentum_energy) {
  gearsam::sgd_step_(param, grad, backup, momentum_buffer, tile,
                     {lr, weight_decay, momentum, dampening, nesterov, maximize, first},
                     {correction, correction_scale, block_of_tile, grad_scale, sharpness}, {scalars, found_inf},
                     {first_tile_of_block, partials, momentum_energy});
}

// step_size, bias_correction2_sqrt and decay are derived from lr and k = step where the constants are built
// (AdamOptions in gearsam.h), so that the same code derives them from the (lr, k) of scalars.
void adam_step(const at::Tensor& param, const at::Tensor& grad, const OptionalTensor& backup,
               const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const OptionalTensor& max_exp_avg_sq,
               int64_t tile, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
               bool amsgrad, bool maximize, double lr, int64_t step, const OptionalTensor& correction,
               const OptionalTensor& correction_scale, const OptionalTensor& block_of_tile,
               const OptionalTensor& scalars, const OptionalTensor& found_inf, const OptionalTensor& grad_scale,
               double sharpness, const OptionalTensor& first_tile_of_block, const OptionalTensor& partials,
               const OptionalTensor& momentum_energy) {
  gearsam::adam_step_(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, tile,
                      {beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, lr, static_cast<double>(step)},
                      {correction, correction_scale, block_of_tile, grad_scale, sharpness}, {scalars, found_inf},
                      {first_tile_of_block, partials, momentum_energy});
}

void register_kernels(torch::Library& m) {
  m.impl("block_energy", &gearsam::block_energy);
  m.impl("allocate", &gearsam::allocate);
  m.impl("perturb_", &gearsam::perturb_);
  m.impl("restore_", &gearsam::restore_);
  m.impl("restore_consuming_", &gearsam::restore_consuming_);
  m.impl("mix_gradient_", &gearsam::mix_gradient_);
  m.impl("exchange_sharpness_", &gearsam::exchange_sharpness_);
  m.impl("friendly_ascent_", &gearsam::friendly_ascent_);
  m.impl("friendly_energy_", &gearsam::friendly_energy_);
  m.impl("sgd_step_", &sgd_step);
  m.impl("adam_step_", &adam_step);
}

}  // namespace

TORCH_LIBRARY(gearsam_fused, m) {
  // Where the fake implementations live: torch requires this link for an operator defined in C++ whose fake is
  // registered from Python.
  m.set_python_module("gearsam_fused.backends.cpp_fakes");

  // float64 [B]: e_b = sum over block b of (T g)^2, T = |w| + eta if adaptive else 1; per-tile partials are written
  // to `partials` (one per tile), then summed per block in tile order. With other (adaptive False), [2, B]: the
  // energies, and the sums of g * other by the same reduction in the same read of g (partials: two per tile).
  m.def(
      "block_energy(Tensor grad, Tensor param, Tensor first_tile_of_block, Tensor(a!) partials, *, int tile, "
      "bool adaptive, float eta, Tensor? other=None) -> Tensor");
  // (scale, radius), float64 [B], by the GEAR rule (gear=True, which updates ema in place) or the SAM rule (ema
  // untouched; declared written all the same, as a schema cannot make that depend on gear). Capturable (gearsam.h):
  // scalars, float64 [1], holds rho (then rho=0.0); found_inf, float32 with one element, nonzero gives scale = radius
  // = 0 and leaves ema unwritten. Both read from device memory, so a CUDA graph replays them with their current values.
  m.def(
      "allocate(Tensor energy, Tensor(a!) ema, *, bool gear, float rho, float beta, float delta, "
      "Tensor? scalars=None, Tensor? found_inf=None) -> (Tensor, Tensor)");
  // backup = param; param += scale[block_of_tile[tile]] * T^2 * grad, in place; with kept, kept = grad too (the SAM
  // family's first gradient, or LookSAM's, kept in the same pass). On the CPU past the stream threshold, w + eps is
  // written to backup and the two exchange their memory (csrc/cpu/exchange.h): the same values in the same tensors.
  m.def(
      "perturb_(Tensor(a!) param, Tensor grad, Tensor(b!) backup, Tensor scale, Tensor block_of_tile, *, int tile, "
      "bool adaptive, float eta, Tensor(c!)? kept=None) -> ()");
  // param = backup, bit for bit.
  m.def("restore_(Tensor(a!) param, Tensor backup, *, int tile) -> ()");
  // param = backup, bit for bit, where backup's values are not needed after: SAM's restore. Past the stream threshold
  // the CPU buffers exchange their memory instead of copying (cpu/exchange.h), so backup is declared written.
  m.def("restore_consuming_(Tensor(a!) param, Tensor(b!) backup, *, int tile) -> ()");
  // grad = fma(correction_scale[block], correction, grad_scale[block] * grad) in place, block = block_of_tile[tile],
  // in float32 (float64 for float64) with the product rounded on its own: the SAM family's descent gradient.
  m.def(
      "mix_gradient_(Tensor(a!) grad, Tensor correction, Tensor grad_scale, Tensor correction_scale, "
      "Tensor block_of_tile, *, int tile) -> ()");
  // (grad, correction) = (correction, grad - correction) in place, the difference in float32 (float64 for float64):
  // WSAM's decoupled step takes the base step with the first gradient, then the sharpness h - g.
  m.def("exchange_sharpness_(Tensor(a!) grad, Tensor(b!) correction, *, int tile) -> ()");
  // (grad, momentum) = (fma(-sigma, momentum, grad), lerp(momentum, grad, 1 - lmbda)) in place, in float32 (float64
  // for float64), torch's lerp rule; with first, momentum = grad (grad unchanged): F-SAM's ascent direction and its
  // gradient EMA. Any contiguous range of a bucket (no tiles), so that a parameter without a gradient can be left out.
  m.def("friendly_ascent_(Tensor(a!) grad, Tensor(b!) momentum, *, float sigma, float lmbda, bool first) -> ()");
  // friendly_ascent_ on a whole bucket, then block_energy of the new grad (its partials, one per tile, in the same
  // read): float64 [B], bit for bit the two operations one after the other.
  m.def(
      "friendly_energy_(Tensor(a!) grad, Tensor(b!) momentum, Tensor param, Tensor first_tile_of_block, "
      "Tensor(c!) partials, *, int tile, bool adaptive, float eta, float sigma, float lmbda, bool first) -> Tensor");
  // param = backup (param's own values where backup is None) after one step of torch.optim.SGD on grad, bit for bit;
  // momentum_buffer (given iff momentum != 0) is updated in place, or set to the step's gradient when first. With
  // correction, correction_scale and block_of_tile (all or none) the step's gradient is
  // fma(correction_scale[block], correction, grad_scale[block] * grad), block = block_of_tile[tile], mix_gradient_'s
  // formula; grad_scale is only given with the other three, and stands for 1 where it is not. A nonzero sharpness
  // (only with grad_scale) then steps param = fma(-lr * sharpness, grad - correction, param) after the update, the
  // difference rounded on its own (WSAM's decoupled sharpness step; lr the step's). Capturable (gearsam.h): scalars,
  // float64 [2], holds (lr, k), k the step count (first = k == 1; then lr=0.0 and first=False); found_inf, float32
  // with one element, nonzero writes param = backup (nothing without backup) and nothing else, without reading grad.
  // backup is written too: on the CPU past the stream threshold param and backup first exchange their memory and the
  // step updates param in place (csrc/cpu/exchange.h), which leaves backup holding param's old values. With
  // first_tile_of_block, partials and momentum_energy (all or none; not with found_inf), momentum_energy receives
  // block_energy(momentum_buffer, adaptive=False) of the new buffer, bit for bit (gearsam.h, MomentumEnergyArgs).
  m.def(
      "sgd_step_(Tensor(a!) param, Tensor grad, Tensor(c!)? backup, Tensor(b!)? momentum_buffer, *, int tile, "
      "float lr, float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, bool first, "
      "Tensor? correction=None, Tensor? correction_scale=None, Tensor? block_of_tile=None, Tensor? scalars=None, "
      "Tensor? found_inf=None, Tensor? grad_scale=None, float sharpness=0., Tensor? first_tile_of_block=None, "
      "Tensor(d!)? partials=None, Tensor(e!)? momentum_energy=None) -> ()");
  // param = backup (or param's own values) after one step of torch.optim.Adam (AdamW when decoupled) on grad, bit for
  // bit with a correctly rounded square root (gearsam_fused/base_step.py); exp_avg, exp_avg_sq and max_exp_avg_sq
  // (given iff amsgrad) are updated in place. step is the step count k of this update (1 for the first), a SymInt so
  // that a compiled step does not specialise on it; step_size = lr / (1 - beta1^k), bias_correction2_sqrt =
  // (1 - beta2^k)^0.5 and decay = 1 - lr * weight_decay are derived from them as torch derives them in Python;
  // correction, correction_scale, block_of_tile, grad_scale and sharpness as for sgd_step_. Capturable: scalars,
  // float64 [2], holds (lr, k) (then lr=0.0 and step=0), from which the same operations derive the three; found_inf as
  // for sgd_step_ (exp_avg, exp_avg_sq and max_exp_avg_sq keep their bits); backup as for sgd_step_; the momentum
  // energy as for sgd_step_, of exp_avg.
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(e!)? backup, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? max_exp_avg_sq, *, int tile, float beta1, float beta2, float eps, float weight_decay, "
      "bool decoupled, bool amsgrad, bool maximize, float lr, SymInt step, "
      "Tensor? correction=None, Tensor? correction_scale=None, Tensor? block_of_tile=None, Tensor? scalars=None, "
      "Tensor? found_inf=None, Tensor? grad_scale=None, float sharpness=0., Tensor? first_tile_of_block=None, "
      "Tensor(f!)? partials=None, Tensor(g!)? momentum_energy=None) -> ()");
}

TORCH_LIBRARY_IMPL(gearsam_fused, CPU, m) { register_kernels(m); }

TORCH_LIBRARY_IMPL(gearsam_fused, CUDA, m) { register_kernels(m); }
