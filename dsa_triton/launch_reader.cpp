// The tensors' part of a lean launch's fast key and their addresses, read in one call. dsa_triton/launch.py builds
// this at first use against the torch it runs with (launch_reader.py) and calls read() from each layout's hit
// function; the Python lines that function holds (launch.py, _tensor_lines) are the reference it must equal.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace {

// read(device_type, *tensors) -> ((dtype, ..., residues), address, ...): each tensor's dtype and address (as
// Tensor.dtype and Tensor.data_ptr() give them) and residues, 0 when every address is a multiple of 16, else the
// tuple of each address modulo 16. None where the Python reference must read instead: an argument that is not
// exactly a torch.Tensor or nn.Parameter (a subclass may override what Python reads), an active torch function mode
// (it may too), a tensor on a device of another type than device_type (a c10::DeviceType), or a tensor whose address
// torch refuses (no storage).
PyObject* read(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "read(device_type, *tensors)");
    return nullptr;
  }
  const long device_type = PyLong_AsLong(args[0]);
  if (device_type == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t n = nargs - 1;
  PyObject* out = PyTuple_New(n + 1);  // (key part, addresses...)
  PyObject* key = PyTuple_New(n + 1);  // (dtypes..., residues)
  if (out == nullptr || key == nullptr) {
    Py_XDECREF(out);
    Py_XDECREF(key);
    return nullptr;
  }
  PyTuple_SET_ITEM(out, 0, key);
  uintptr_t any = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = args[i + 1];
    if (!THPVariable_CheckExact(obj)) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    void* data = nullptr;
    PyObject* dtype = nullptr;
    try {  // (no C++ exception may leave this function)
      if (static_cast<long>(t.device().type()) == device_type) {
        data = t.data_ptr();
        dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
      }
    } catch (...) {
      dtype = nullptr;
    }
    if (dtype == nullptr) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    PyObject* address = PyLong_FromVoidPtr(data);
    if (address == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    Py_INCREF(dtype);
    PyTuple_SET_ITEM(key, i, dtype);
    PyTuple_SET_ITEM(out, i + 1, address);
    any |= reinterpret_cast<uintptr_t>(data);
  }
  PyObject* residues = nullptr;
  if (any & 15) {
    residues = PyTuple_New(n);
    for (Py_ssize_t i = 0; residues != nullptr && i < n; ++i) {  // (0..15: cached ints, no allocation)
      const uintptr_t address = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(out, i + 1)));
      PyTuple_SET_ITEM(residues, i, PyLong_FromLong(static_cast<long>(address & 15)));
    }
  } else {
    residues = PyLong_FromLong(0);
  }
  if (residues == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  PyTuple_SET_ITEM(key, n, residues);
  return out;
}

PyMethodDef methods[] = {
    {"read", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(read)), METH_FASTCALL,
     "read(device_type, *tensors) -> ((dtype, ..., residues), address, ...), or None (see launch_reader.cpp)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "dsa_launch_reader", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_dsa_launch_reader() {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr || PyModule_AddIntConstant(m, "CPU", static_cast<long>(c10::DeviceType::CPU)) < 0 ||
      PyModule_AddIntConstant(m, "CUDA", static_cast<long>(c10::DeviceType::CUDA)) < 0) {
    Py_XDECREF(m);
    return nullptr;
  }
  return m;
}
