// The sync's common case in C++ (gearsam_fused/flat.py, Bucket.owns_every_tensor): is every parameter of a bucket
// still a view of its flat buffer and every gradient the view the bucket installed. It runs over every tensor of a
// bucket at every sync; here a tensor costs two pointer comparisons where Python spends a function call or two on it.

#include "host_checks.h"

#include <torch/csrc/autograd/python_variable.h>

#include <string>

namespace gearsam::host {
namespace {

// The length of list `obj`, which must have `expected` items where that is not negative; `name` names it in errors.
Py_ssize_t list_size(py::handle obj, const char* name, Py_ssize_t expected = -1) {
  if (!PyList_Check(obj.ptr())) {
    throw py::type_error(std::string(name) + " must be a list, got " + std::string(py::str(obj.get_type())));
  }
  const Py_ssize_t size = PyList_GET_SIZE(obj.ptr());
  if (expected >= 0 && size != expected) {
    throw py::value_error(std::string(name) + " has " + std::to_string(size) + " items where the parameters are " +
                          std::to_string(expected));
  }
  return size;
}

const at::Tensor& tensor_at(py::handle list, Py_ssize_t i, const char* name) {
  PyObject* obj = PyList_GET_ITEM(list.ptr(), i);
  if (!THPVariable_Check(obj)) {
    throw py::type_error(std::string(name) + "[" + std::to_string(i) + "] is not a tensor");
  }
  return THPVariable_Unpack(obj);
}

// The same TensorImpl is the same Python object: a TensorImpl keeps the one PyObject that wraps it.
bool is_tensor(PyObject* obj, const at::Tensor& tensor) {
  return tensor.defined() && THPVariable_Check(obj) &&
         THPVariable_Unpack(obj).unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl();
}

}  // namespace

bool owns_every_tensor(py::handle params, py::handle addresses, py::handle grads) {
  const Py_ssize_t n = list_size(params, "params");
  list_size(addresses, "addresses", n);
  list_size(grads, "grads", n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor& param = tensor_at(params, i, "params");
    void* address = PyLong_AsVoidPtr(PyList_GET_ITEM(addresses.ptr(), i));
    if (address == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (param.data_ptr() != address || !is_tensor(PyList_GET_ITEM(grads.ptr(), i), param.grad())) return false;
  }
  return true;
}

void bind(py::module_& m) {
  m.def("owns_every_tensor", &owns_every_tensor, py::arg("params"), py::arg("addresses"), py::arg("grads"),
        "Whether params[i].data_ptr() == addresses[i] and params[i].grad is grads[i] for every i.");
}

}  // namespace gearsam::host
