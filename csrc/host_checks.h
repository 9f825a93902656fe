// The sync's ownership check in C++ (host_checks.cpp).

#pragma once

#include <torch/extension.h>

namespace gearsam::host {

// Whether params[i].data_ptr() == addresses[i] and params[i].grad is grads[i] for every i.
bool owns_every_tensor(py::handle params, py::handle addresses, py::handle grads);

// Adds it to the module gearsam_fused._C.
void bind(py::module_& m);

}  // namespace gearsam::host
