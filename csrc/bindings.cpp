// Python bindings of gearsam_fused._C. Same names and keyword arguments as the Triton launchers in
// gearsam_fused.triton_kernels, so both serve the same backend code. Every call releases the GIL.

#include <torch/extension.h>

#include "gearsam.h"

namespace py = pybind11;

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
  m.def("built_with_cuda", &gearsam::built_with_cuda, "Whether this build contains the CUDA kernels.");
}
