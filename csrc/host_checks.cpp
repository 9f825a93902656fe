// The host's checks of a step in C++: gearsam_fused/host_checks.py states what each one answers and holds the same
// checks in Python, for an install without this extension. Each runs over every tensor of a bucket at every step;
// here a tensor costs a few pointer comparisons where Python spends a function call or two on it.

#include "host_checks.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>
#include <vector>

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

// Open addressing over object addresses, to find a dict's entries without hashing its keys again (a tensor's hash is
// a Python function, Tensor.__hash__). Values are borrowed: the dict they came from outlives the table.
class AddressTable {
 public:
  explicit AddressTable(Py_ssize_t count) {
    while (capacity_ < 2 * static_cast<size_t>(count)) capacity_ <<= 1;
    keys_.assign(capacity_, nullptr);
    values_.assign(capacity_, nullptr);
  }
  void insert(PyObject* key) { keys_[probe(key)] = key; }
  // Where the value of `key` is held, nullptr where `key` was never inserted.
  PyObject** value(PyObject* key) {
    const size_t at = probe(key);
    return keys_[at] == key ? &values_[at] : nullptr;
  }

 private:
  // the slot of `key`, or the empty slot where it would go (Fibonacci hashing of the address without its alignment)
  size_t probe(PyObject* key) const {
    size_t at = ((reinterpret_cast<uintptr_t>(key) >> 4) * 0x9E3779B97F4A7C15ull) & (capacity_ - 1);
    while (keys_[at] != nullptr && keys_[at] != key) at = (at + 1) & (capacity_ - 1);
    return at;
  }
  size_t capacity_ = 1;
  std::vector<PyObject*> keys_;
  std::vector<PyObject*> values_;
};

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

py::list state_entries(py::handle state, py::handle params) {
  if (!PyDict_Check(state.ptr())) {
    throw py::type_error("state must be a dict, got " + std::string(py::str(state.get_type())));
  }
  const Py_ssize_t n = list_size(params, "params");
  AddressTable entries(n);
  for (Py_ssize_t i = 0; i < n; ++i) entries.insert(PyList_GET_ITEM(params.ptr(), i));
  PyObject* key;
  PyObject* entry;
  Py_ssize_t position = 0;
  while (PyDict_Next(state.ptr(), &position, &key, &entry)) {
    if (PyObject** held = entries.value(key)) *held = entry;
  }
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* found = *entries.value(PyList_GET_ITEM(params.ptr(), i));
    PyObject* value = found != nullptr ? found : Py_None;
    Py_INCREF(value);
    PyList_SET_ITEM(out.ptr(), i, value);
  }
  return out;
}

bool entries_hold(py::handle entries, py::handle views) {
  const Py_ssize_t n = list_size(entries, "entries");
  if (!PyDict_Check(views.ptr())) {
    throw py::type_error("views must be a dict, got " + std::string(py::str(views.get_type())));
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyDict_Check(PyList_GET_ITEM(entries.ptr(), i))) return false;
  }
  PyObject* key;
  PyObject* tensors;
  Py_ssize_t position = 0;
  while (PyDict_Next(views.ptr(), &position, &key, &tensors)) {
    const std::string name = "views[" + std::string(py::repr(key)) + "]";
    list_size(tensors, name.c_str(), n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* held = PyDict_GetItemWithError(PyList_GET_ITEM(entries.ptr(), i), key);
      if (held == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (held != PyList_GET_ITEM(tensors, i)) return false;
    }
  }
  return true;
}

void bind(py::module_& m) {
  m.def("owns_every_tensor", &owns_every_tensor, py::arg("params"), py::arg("addresses"), py::arg("grads"),
        "Whether params[i].data_ptr() == addresses[i] and params[i].grad is grads[i] for every i.");
  m.def("state_entries", &state_entries, py::arg("state"), py::arg("params"),
        "state's entry for each of params, found by identity, None where it has none.");
  m.def("entries_hold", &entries_hold, py::arg("entries"), py::arg("views"),
        "Whether every entry is a dict and entries[i].get(key) is views[key][i] for every key of views.");
}

}  // namespace gearsam::host
