// The eleven kernels as operators of torch.library: torch.ops.gearsam_fused.<name>, with the names and keyword arguments
// of the Triton launchers (gearsam_fused.triton_kernels), so one backend class drives both. As operators they pass
// through the dispatcher, so torch.compile, fake tensors and functionalisation see them: each schema declares the
// inputs it writes (Tensor(a!)), and gearsam_fused/backends/cpp_fakes.py registers their fake implementations
// (output shapes, and the checks of layouts, dtypes, devices and sizes a trace needs; also the Meta kernels). The
// schemas below are the contract's signatures, stated here only; what each operator computes is stated once, in
// csrc/README.md's table (the base steps' update in gearsam_fused/base_step.py).
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
  m.impl("restore_discarding_backup_", &gearsam::restore_discarding_backup_);
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

  m.def(
      "block_energy(Tensor grad, Tensor param, Tensor first_tile_of_block, Tensor(a!) partials, *, int tile, "
      "bool adaptive, float eta, Tensor? other=None) -> Tensor");
  m.def(
      "allocate(Tensor energy, Tensor(a!) ema, *, bool gear, float rho, float beta, float delta, "
      "Tensor? scalars=None, Tensor? found_inf=None) -> (Tensor, Tensor)");
  m.def(
      "perturb_(Tensor(a!) param, Tensor grad, Tensor(b!) backup, Tensor scale, Tensor block_of_tile, *, int tile, "
      "bool adaptive, float eta, Tensor(c!)? kept=None) -> ()");
  m.def("restore_(Tensor(a!) param, Tensor backup, *, int tile) -> ()");
  m.def("restore_discarding_backup_(Tensor(a!) param, Tensor(b!) backup, *, int tile) -> ()");
  m.def(
      "mix_gradient_(Tensor(a!) grad, Tensor correction, Tensor grad_scale, Tensor correction_scale, "
      "Tensor block_of_tile, *, int tile) -> ()");
  m.def("exchange_sharpness_(Tensor(a!) grad, Tensor(b!) correction, *, int tile) -> ()");
  m.def("friendly_ascent_(Tensor(a!) grad, Tensor(b!) momentum, *, float sigma, float lmbda, bool first) -> ()");
  m.def(
      "friendly_energy_(Tensor(a!) grad, Tensor(b!) momentum, Tensor param, Tensor first_tile_of_block, "
      "Tensor(c!) partials, *, int tile, bool adaptive, float eta, float sigma, float lmbda, bool first) -> Tensor");
  m.def(
      "sgd_step_(Tensor(a!) param, Tensor grad, Tensor(c!)? backup, Tensor(b!)? momentum_buffer, *, int tile, "
      "float lr, float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, bool first, "
      "Tensor? correction=None, Tensor? correction_scale=None, Tensor? block_of_tile=None, Tensor? scalars=None, "
      "Tensor? found_inf=None, Tensor? grad_scale=None, float sharpness=0., Tensor? first_tile_of_block=None, "
      "Tensor(d!)? partials=None, Tensor(e!)? momentum_energy=None) -> ()");
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
