// The host's checks of a step in C++ (host_checks.cpp); gearsam_fused/host_checks.py states what each one answers.

#pragma once

#include <torch/extension.h>

namespace gearsam::host {

bool owns_every_tensor(py::handle params, py::handle addresses, py::handle grads);
py::list state_entries(py::handle state, py::handle params);
bool entries_hold(py::handle entries, py::handle views);

// Adds the three to the module gearsam_fused._C.
void bind(py::module_& m);

}  // namespace gearsam::host
