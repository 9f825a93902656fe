// Python bindings of gearsam_fused._C. Same names and keyword arguments as the Triton launchers in
// gearsam_fused.triton_kernels, so both serve the same backend code. Every call releases the GIL.

#include <torch/extension.h>

#include "cpu/stream.h"
#include "gearsam.h"

namespace py = pybind11;

using OptionalTensor = c10::optional<at::Tensor>;

// The base steps' optional gradient correction (LookSAM): keywords defaulting to None, all three given or none.
#define CORRECTION_ARGS \
  py::arg("correction") = py::none(), py::arg("correction_scale") = py::none(), py::arg("tile_block") = py::none()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused GEAR-SAM / SAM step kernels (CPU, and CUDA when built with it) over flat parameter buckets.";
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("block_energy", &gearsam::block_energy, no_gil, py::arg("grad"), py::arg("param"), py::arg("block_tiles"),
        py::arg("partials"), py::kw_only(), py::arg("tile"), py::arg("adaptive"), py::arg("eta"),
        "float64 [B]: e_b = sum over block b of (T g)^2, T = |w| + eta if adaptive else 1; per-tile partials are "
        "written to `partials`, then summed per block in tile order.");
  m.def("allocate", &gearsam::allocate, no_gil, py::arg("energy"), py::arg("ema"), py::kw_only(), py::arg("gear"),
        py::arg("rho"), py::arg("beta"), py::arg("delta"),
        "(scale, radius), float64 [B], by the GEAR rule (gear=True, updates ema in place) or the SAM rule.");
  m.def("perturb_", &gearsam::perturb_, no_gil, py::arg("param"), py::arg("grad"), py::arg("backup"),
        py::arg("scale"), py::arg("tile_block"), py::kw_only(), py::arg("tile"), py::arg("adaptive"), py::arg("eta"),
        "backup = param; param += scale[tile_block[tile]] * T^2 * grad, in place.");
  m.def("restore_", &gearsam::restore_, no_gil, py::arg("param"), py::arg("backup"), py::kw_only(), py::arg("tile"),
        "param = backup, bit for bit.");
  // The base steps take their hyperparameters as flat keywords, like the Triton launchers, and pack them here.
  m.def(
      "sgd_step_",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup,
         const c10::optional<at::Tensor>& momentum_buffer, int64_t tile, double lr, double weight_decay,
         double momentum, double dampening, bool nesterov, bool maximize, bool first, const OptionalTensor& correction,
         const OptionalTensor& correction_scale, const OptionalTensor& tile_block) {
        gearsam::sgd_step_(param, grad, backup, momentum_buffer, tile,
                           {lr, weight_decay, momentum, dampening, nesterov, maximize, first},
                           {correction, correction_scale, tile_block});
      },
      no_gil, py::arg("param"), py::arg("grad"), py::arg("backup"), py::arg("momentum_buffer").none(true),
      py::kw_only(), py::arg("tile"), py::arg("lr"), py::arg("weight_decay"), py::arg("momentum"),
      py::arg("dampening"), py::arg("nesterov"), py::arg("maximize"), py::arg("first"), CORRECTION_ARGS,
      "param = backup after one step of torch.optim.SGD on grad, bit for bit; momentum_buffer (given iff momentum "
      "!= 0) is updated in place, or set to the step's gradient when first. backup may be param. With correction, "
      "correction_scale and tile_block (all or none) the step's gradient is "
      "fma(correction_scale[tile_block[tile]], correction, grad).");
  m.def(
      "adam_step_",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& exp_avg,
         const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& max_exp_avg_sq, int64_t tile, double beta1,
         double beta2, double eps, double weight_decay, bool decoupled, bool amsgrad, bool maximize, double step_size,
         double bias_correction2_sqrt, double decay, const OptionalTensor& correction,
         const OptionalTensor& correction_scale, const OptionalTensor& tile_block) {
        gearsam::adam_step_(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, tile,
                            {beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, step_size,
                             bias_correction2_sqrt, decay},
                            {correction, correction_scale, tile_block});
      },
      no_gil, py::arg("param"), py::arg("grad"), py::arg("backup"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("max_exp_avg_sq").none(true), py::kw_only(), py::arg("tile"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"),
      py::arg("step_size"), py::arg("bias_correction2_sqrt"), py::arg("decay"), CORRECTION_ARGS,
      "param = backup after one step of torch.optim.Adam (AdamW when decoupled) on grad, bit for bit; exp_avg, "
      "exp_avg_sq and max_exp_avg_sq (given iff amsgrad) are updated in place. step_size = lr / (1 - beta1^k), "
      "bias_correction2_sqrt = (1 - beta2^k)^0.5 and decay = 1 - lr * weight_decay, computed in Python as torch does. "
      "backup may be param; correction, correction_scale and tile_block as for sgd_step_.");
  m.def("cpu_stream_threshold_bytes", &gearsam::cpu::stream_threshold_bytes,
        "The CPU kernels write outputs they do not read (backup, restored or updated parameter) with non-temporal "
        "stores where the output is larger than this many bytes (the last-level cache); -1 where they never do.");
  m.def("built_with_cuda", &gearsam::built_with_cuda, "Whether this build contains the CUDA kernels.");
}
