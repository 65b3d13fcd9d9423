// A lean launch's hit in one compiled call. dsa_triton/launch.py builds this at first use against the torch it runs
// with (launch_hit.py) and makes one Hit per argument layout; the layout's Python hit function (launch.py, _SOURCE)
// is the reference: a Hit does what it does for the calls it takes and hands every other call to it unchanged.
//
// Hit(scope, kinds, names, device_type)(grid, args, meta): scope holds the layout's Python functions and state as
// launch.py's layout_functions made them ("hit", "key_of", "fast", "lean", "fn", "TOKENS", "_meta_token", "knobs",
// "HookChain", "lean_module", "LAYOUT"); kinds has one letter a positional argument (t tensor, i int, b bool, f
// float, n None); names are the keyword names, in the order the layout's token part takes them. A call is taken
// when each argument is of its kind (a tensor exactly a torch.Tensor or nn.Parameter on a device of device_type
// with storage, no torch function mode on, an int within int64), meta has exactly those names, grid is a tuple of
// 1 to 3 sizes, knobs.runtime.debug is a bool and the instrumentation mode is "". Its fast key is then bytes, not
// the Python function's tuple (the two never compare equal, so both live in the layout's table "fast"): the layout
// number, the device, debug, per tensor its dtype and address modulo 16, per int its value, per bool its value, the
// keyword token (the last call's while each value is the same object, else _meta_token's). An entry found with
// Triton's launch hooks idle, no pre-run hook and the kernel's globals unchanged launches as the Python function
// does: run(gx, gy, gz, stream, *head, *arguments with the tensors' addresses, *tail); any other calls lean.miss
// with the bytes key. Nothing a call reads is kept for the next but the keyword values (for the token) and the int of
// each tensor's address (reused while a tensor at that position has the same address).
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr Py_ssize_t MAX_ARGS = 512;                       // positional arguments a Hit takes
constexpr Py_ssize_t MAX_NAMES = 128;                      // keyword names
constexpr Py_ssize_t KEY_BYTES = 8 * (MAX_ARGS + 4);       // the bytes key, at most
constexpr Py_ssize_t MAX_LAUNCH = 4 + 2 * MAX_ARGS + 64;  // run's arguments, at most

// Interned attribute and scope names (module init).
PyObject *s_runtime, *s_compilation, *s_debug, *s_instrumentation_mode, *s_enter, *s_exit, *s_calls, *s_pre_run,
    *s_used, *s_watched, *s_watched_of, *s_globals_changed, *s_miss, *s_device, *s_stream, *s_one;

// A tensor's address and the int that holds it (kept for the next call: a tensor at the same address, as a
// persistent buffer or a recycled allocation is, costs no new int).
struct Address {
  uintptr_t value;
  PyObject* object;  // (strong; nullptr until a tensor has been read there)
};

struct Hit {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* python;      // the layout's Python hit function (the reference; takes what this declines)
  PyObject* key_of;      // the layout's key function (lean.miss takes it)
  PyObject* fast;        // fast key -> entry (shared with the Python function)
  PyObject* lean;        // the LeanKernel
  PyObject* fn;          // the JITFunction
  PyObject* tokens;      // the layout's keyword-set tokens
  PyObject* meta_token;  // launch._meta_token
  PyObject* knobs;       // triton.knobs
  PyObject* hook_chain;  // triton.knobs.HookChain
  PyObject* module;      // dsa_triton.launch's dict (_device, _stream: read each call, as the Python function does)
  PyObject* names;       // tuple of the keyword names
  PyObject* last;        // list: the last call's keyword values, then their token
  PyObject* kinds;       // bytes: a letter per positional argument
  long long layout;      // the layout's number (the first 8 bytes of each key)
  long device_type;      // a c10::DeviceType
  Py_ssize_t n;          // positional arguments
  Address* addresses;    // per positional argument: the int of the last address a tensor there had
};

// The call's fast key into key (its length into *size) and the launch's arguments into launched (new references:
// the tensors' addresses, the other arguments as they are), its device into *device (new); 1 when taken, 0 when
// declined (no exception set, nothing to release).
int read_call(Hit* self, PyObject* runtime, PyObject* args, PyObject* meta, char* key, Py_ssize_t* size,
              PyObject** launched, PyObject** device) {
  const Py_ssize_t n = self->n;
  const char* kinds = PyBytes_AS_STRING(self->kinds);
  const Py_ssize_t n_names = PyTuple_GET_SIZE(self->names);
  if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != n || !PyDict_CheckExact(meta) ||
      PyDict_GET_SIZE(meta) != n_names || at::impl::torch_function_mode_enabled()) {
    return 0;
  }
  char* at = key;
  std::memcpy(at, &self->layout, 8);
  at += 16;  // (the device's 8 bytes, once the arguments are read)
  Py_ssize_t made = 0;  // launched[0:made] hold new references
  auto decline = [&]() {
    for (Py_ssize_t i = 0; i < made; ++i) Py_DECREF(launched[i]);
    PyErr_Clear();
    return 0;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    switch (kinds[i]) {
      case 't': {
        if (!THPVariable_CheckExact(a)) return decline();
        const at::Tensor& t = THPVariable_Unpack(a);
        void* data = nullptr;
        int8_t dtype = 0;
        try {  // (no C++ exception may leave this function)
          if (static_cast<long>(t.device().type()) != self->device_type) return decline();
          data = t.data_ptr();
          dtype = static_cast<int8_t>(t.scalar_type());
        } catch (...) {
          return decline();
        }
        Address& kept = self->addresses[i];
        if (kept.object == nullptr || kept.value != reinterpret_cast<uintptr_t>(data)) {
          PyObject* address = PyLong_FromVoidPtr(data);
          if (address == nullptr) return decline();
          Py_XSETREF(kept.object, address);
          kept.value = reinterpret_cast<uintptr_t>(data);
        }
        Py_INCREF(kept.object);
        launched[made++] = kept.object;
        *at++ = static_cast<char>(dtype);
        *at++ = static_cast<char>(reinterpret_cast<uintptr_t>(data) & 15);
        continue;
      }
      case 'i': {
        if (!PyLong_CheckExact(a)) return decline();
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) return decline();
        std::memcpy(at, &v, 8);
        at += 8;
        break;
      }
      case 'b':
        if (a != Py_True && a != Py_False) return decline();
        *at++ = static_cast<char>(a == Py_True);
        break;
      case 'f':
        if (!PyFloat_CheckExact(a)) return decline();
        break;
      default:  // 'n'
        if (a != Py_None) return decline();
    }
    Py_INCREF(a);
    launched[made++] = a;
  }
  // The keyword token (none without keywords): the last call's while each value is the same object, else the token
  // of this part.
  PyObject* values[MAX_NAMES];
  bool same = n_names > 0;
  for (Py_ssize_t j = 0; j < n_names; ++j) {
    values[j] = PyDict_GetItemWithError(meta, PyTuple_GET_ITEM(self->names, j));  // (borrowed)
    if (values[j] == nullptr) return decline();
    same = same && values[j] == PyList_GET_ITEM(self->last, j);
  }
  if (n_names > 0 && !same) {
    PyObject* part = PyTuple_New(2 * n_names);
    for (Py_ssize_t j = 0; part != nullptr && j < n_names; ++j) {
      Py_INCREF(values[j]);
      Py_INCREF(Py_TYPE(values[j]));
      PyTuple_SET_ITEM(part, 2 * j, values[j]);
      PyTuple_SET_ITEM(part, 2 * j + 1, reinterpret_cast<PyObject*>(Py_TYPE(values[j])));
    }
    // (part holds the values while _meta_token runs Python: their hashes)
    PyObject* token = part == nullptr ? nullptr : PyObject_CallFunctionObjArgs(self->meta_token, self->tokens, part,
                                                                                nullptr);
    if (token == nullptr || !PyLong_CheckExact(token)) {
      Py_XDECREF(token);
      Py_XDECREF(part);
      return decline();
    }
    for (Py_ssize_t j = 0; j < n_names; ++j) {
      Py_INCREF(values[j]);
      PyList_SetItem(self->last, j, values[j]);
    }
    PyList_SetItem(self->last, n_names, token);
    Py_DECREF(part);
  }
  if (n_names > 0) {
    const long long token = PyLong_AsLongLong(PyList_GET_ITEM(self->last, n_names));
    if (token == -1 && PyErr_Occurred()) return decline();
    std::memcpy(at, &token, 8);
    at += 8;
  }
  // The device, Triton's debug knob and instrumentation mode.
  PyObject* device_of = PyDict_GetItemWithError(self->module, s_device);
  PyObject* now = device_of == nullptr ? nullptr : PyObject_CallNoArgs(device_of);
  int overflow = 0;
  const long long d = now != nullptr && PyLong_CheckExact(now) ? PyLong_AsLongLongAndOverflow(now, &overflow) : 0;
  if (now == nullptr || !PyLong_CheckExact(now) || overflow) {
    Py_XDECREF(now);
    return decline();
  }
  std::memcpy(key + 8, &d, 8);
  PyObject* debug = PyObject_GetAttr(runtime, s_debug);
  PyObject* compilation = PyObject_GetAttr(self->knobs, s_compilation);
  PyObject* mode = compilation == nullptr ? nullptr : PyObject_GetAttr(compilation, s_instrumentation_mode);
  const bool plain = (debug == Py_True || debug == Py_False) && mode != nullptr && PyUnicode_CheckExact(mode) &&
                     PyUnicode_GET_LENGTH(mode) == 0;
  *at++ = static_cast<char>(debug == Py_True);
  Py_XDECREF(debug);
  Py_XDECREF(compilation);
  Py_XDECREF(mode);
  if (!plain) {
    Py_DECREF(now);
    return decline();
  }
  *device = now;
  *size = at - key;
  return 1;
}

// 1 when the hook (Triton's launch_enter_hook or launch_exit_hook) does nothing: None or an empty HookChain; 0 when
// it may; -1 with an exception.
int idle(Hit* self, PyObject* runtime, PyObject* name) {
  PyObject* hook = PyObject_GetAttr(runtime, name);
  if (hook == nullptr) return -1;
  int result = hook == Py_None;
  if (!result && Py_TYPE(hook) == reinterpret_cast<PyTypeObject*>(self->hook_chain)) {
    PyObject* calls = PyObject_GetAttr(hook, s_calls);
    const int busy = calls == nullptr ? -1 : PyObject_IsTrue(calls);
    Py_XDECREF(calls);
    result = busy < 0 ? -1 : !busy;
  }
  Py_DECREF(hook);
  return result;
}

// 1 when a launch may go ahead as the Python function's checks let it (no pre-run hook, Triton's launch hooks idle,
// the globals the kernel read unchanged: lean.watched, else lean.globals_changed()); 0 when not; -1 with an exception.
int checks_pass(Hit* self, PyObject* runtime) {
  PyObject* pre_run = PyObject_GetAttr(self->fn, s_pre_run);
  const int hooked = pre_run == nullptr ? -1 : PyObject_IsTrue(pre_run);
  Py_XDECREF(pre_run);
  if (hooked != 0) return hooked < 0 ? -1 : 0;
  int result = idle(self, runtime, s_enter);
  result = result == 1 ? idle(self, runtime, s_exit) : result;
  if (result != 1) return result;
  PyObject* used = PyObject_GetAttr(self->fn, s_used);
  PyObject* watched_of = PyObject_GetAttr(self->lean, s_watched_of);
  PyObject* watched = PyObject_GetAttr(self->lean, s_watched);
  bool unchanged = used != nullptr && used == watched_of && PyDict_Check(used) && watched != nullptr &&
                   PyTuple_CheckExact(watched) && PyDict_GET_SIZE(used) == PyTuple_GET_SIZE(watched);
  for (Py_ssize_t i = 0; unchanged && i < PyTuple_GET_SIZE(watched); ++i) {
    PyObject* seen = PyTuple_GET_ITEM(watched, i);  // (scope, name, the object last found equal)
    PyObject* scope = PyTuple_CheckExact(seen) && PyTuple_GET_SIZE(seen) == 3 ? PyTuple_GET_ITEM(seen, 0) : nullptr;
    unchanged = scope != nullptr && PyDict_CheckExact(scope) &&
                PyDict_GetItemWithError(scope, PyTuple_GET_ITEM(seen, 1)) == PyTuple_GET_ITEM(seen, 2);
  }
  Py_XDECREF(used);
  Py_XDECREF(watched_of);
  Py_XDECREF(watched);
  if (PyErr_Occurred()) return -1;
  if (unchanged) return 1;
  PyObject* changed = PyObject_CallMethodNoArgs(self->lean, s_globals_changed);
  const int truth = changed == nullptr ? -1 : PyObject_IsTrue(changed);
  Py_XDECREF(changed);
  return truth < 0 ? -1 : !truth;
}

// Whether a fast entry is (run, head, tail, kernel, checked) with head and tail tuples, and run's arguments fit.
bool launchable(PyObject* entry, Py_ssize_t n) {
  if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5) return false;
  PyObject* head = PyTuple_GET_ITEM(entry, 1);
  PyObject* tail = PyTuple_GET_ITEM(entry, 2);
  return PyTuple_CheckExact(head) && PyTuple_CheckExact(tail) &&
         4 + PyTuple_GET_SIZE(head) + n + PyTuple_GET_SIZE(tail) <= MAX_LAUNCH;
}

// run(gx, gy, gz, stream, *head, *launched, *tail) of a launchable fast entry (run, head, tail, kernel, checked) ->
// the kernel (new), or nullptr with an exception.
PyObject* launch(PyObject* entry, PyObject* grid, PyObject* device, PyObject* module, PyObject* const* launched,
                 Py_ssize_t n) {
  PyObject* run = PyTuple_GET_ITEM(entry, 0);
  PyObject* head = PyTuple_GET_ITEM(entry, 1);
  PyObject* tail = PyTuple_GET_ITEM(entry, 2);
  PyObject* stream_of = PyDict_GetItemWithError(module, s_stream);
  PyObject* stream = stream_of == nullptr ? nullptr : PyObject_CallOneArg(stream_of, device);
  if (stream == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "dsa_triton.launch has no _stream");
    return nullptr;
  }
  PyObject* stack[MAX_LAUNCH];
  const Py_ssize_t dims = PyTuple_GET_SIZE(grid);
  Py_ssize_t k = 0;
  for (Py_ssize_t i = 0; i < 3; ++i) stack[k++] = i < dims ? PyTuple_GET_ITEM(grid, i) : s_one;
  stack[k++] = stream;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(head); ++i) stack[k++] = PyTuple_GET_ITEM(head, i);
  for (Py_ssize_t i = 0; i < n; ++i) stack[k++] = launched[i];
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tail); ++i) stack[k++] = PyTuple_GET_ITEM(tail, i);
  PyObject* done = PyObject_Vectorcall(run, stack, k, nullptr);
  Py_DECREF(stream);
  if (done == nullptr) return nullptr;
  Py_DECREF(done);
  PyObject* kernel = PyTuple_GET_ITEM(entry, 3);
  Py_INCREF(kernel);
  return kernel;
}

PyObject* hit_call(PyObject* object, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  Hit* self = reinterpret_cast<Hit*>(object);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject* grid = nargs == 3 ? argv[0] : nullptr;
  PyObject* runtime = nullptr;  // (knobs.runtime, as the Python function reads it once a call)
  char key[KEY_BYTES];
  PyObject* launched[MAX_ARGS];
  Py_ssize_t size = 0;
  PyObject* device = nullptr;
  if (kwnames != nullptr || grid == nullptr || !PyTuple_CheckExact(grid) || PyTuple_GET_SIZE(grid) < 1 ||
      PyTuple_GET_SIZE(grid) > 3 || (runtime = PyObject_GetAttr(self->knobs, s_runtime)) == nullptr ||
      !read_call(self, runtime, argv[1], argv[2], key, &size, launched, &device)) {
    PyErr_Clear();
    Py_XDECREF(runtime);
    return PyObject_Vectorcall(self->python, argv, nargsf, kwnames);
  }
  PyObject* fast_key = PyBytes_FromStringAndSize(key, size);
  PyObject* entry = fast_key == nullptr ? nullptr : PyDict_GetItemWithError(self->fast, fast_key);
  Py_XINCREF(entry);  // (the checks and the launch may run Python that changes the table)
  const int go = entry == nullptr ? (PyErr_Occurred() ? -1 : 0) : checks_pass(self, runtime);
  const bool taken = go != 1 || launchable(entry, self->n);  // (else the Python function launches it)
  PyObject* result = nullptr;
  if (go == 1 && taken) {
    result = launch(entry, grid, device, self->module, launched, self->n);
  } else if (go == 0) {
    PyObject* miss = PyObject_GetAttr(self->lean, s_miss);
    PyObject* call[] = {grid, argv[1], argv[2], fast_key, device, self->key_of};
    result = miss == nullptr ? nullptr : PyObject_Vectorcall(miss, call, 6, nullptr);
    Py_XDECREF(miss);
  }
  for (Py_ssize_t i = 0; i < self->n; ++i) Py_DECREF(launched[i]);
  Py_XDECREF(entry);
  Py_XDECREF(fast_key);
  Py_DECREF(device);
  Py_DECREF(runtime);
  return taken ? result : PyObject_Vectorcall(self->python, argv, nargsf, kwnames);
}

int hit_traverse(PyObject* object, visitproc visit, void* arg) {
  Hit* self = reinterpret_cast<Hit*>(object);
  Py_VISIT(self->python);
  Py_VISIT(self->key_of);
  Py_VISIT(self->fast);
  Py_VISIT(self->lean);
  Py_VISIT(self->fn);
  Py_VISIT(self->tokens);
  Py_VISIT(self->meta_token);
  Py_VISIT(self->knobs);
  Py_VISIT(self->hook_chain);
  Py_VISIT(self->module);
  Py_VISIT(self->names);
  Py_VISIT(self->last);
  Py_VISIT(self->kinds);
  return 0;
}

int hit_clear(PyObject* object) {
  Hit* self = reinterpret_cast<Hit*>(object);
  Py_CLEAR(self->python);
  Py_CLEAR(self->key_of);
  Py_CLEAR(self->fast);
  Py_CLEAR(self->lean);
  Py_CLEAR(self->fn);
  Py_CLEAR(self->tokens);
  Py_CLEAR(self->meta_token);
  Py_CLEAR(self->knobs);
  Py_CLEAR(self->hook_chain);
  Py_CLEAR(self->module);
  Py_CLEAR(self->names);
  Py_CLEAR(self->last);
  Py_CLEAR(self->kinds);
  return 0;
}

// The kept addresses' ints released (at dealloc: none is another object's).
void release_addresses(Hit* self) {
  if (self->addresses == nullptr) return;
  for (Py_ssize_t i = 0; i < self->n; ++i) Py_XDECREF(self->addresses[i].object);
  PyMem_Free(self->addresses);
  self->addresses = nullptr;
}

void hit_dealloc(PyObject* object) {
  PyObject_GC_UnTrack(object);
  hit_clear(object);
  release_addresses(reinterpret_cast<Hit*>(object));
  Py_TYPE(object)->tp_free(object);
}

// Hit(scope, kinds, names, device_type): see the top of this file.
PyObject* hit_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *scope, *kinds, *names;
  long device_type;
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "Hit(scope, kinds, names, device_type)");
    return nullptr;
  }
  if (!PyArg_ParseTuple(args, "O!SO!l", &PyDict_Type, &scope, &kinds, &PyTuple_Type, &names, &device_type)) {
    return nullptr;
  }
  if (PyBytes_GET_SIZE(kinds) > MAX_ARGS || PyTuple_GET_SIZE(names) > MAX_NAMES ||
      std::strspn(PyBytes_AS_STRING(kinds), "tibfn") != static_cast<size_t>(PyBytes_GET_SIZE(kinds))) {
    PyErr_SetString(PyExc_ValueError, "Hit: more than 512 arguments or 128 keywords, or a kind not of 'tibfn'");
    return nullptr;
  }
  const char* wanted[] = {"hit", "key_of", "fast", "lean", "fn", "TOKENS", "_meta_token", "knobs", "HookChain",
                          "lean_module", "LAYOUT"};
  PyObject* found[11];
  for (int i = 0; i < 11; ++i) {
    found[i] = PyDict_GetItemString(scope, wanted[i]);
    if (found[i] == nullptr) {
      PyErr_Format(PyExc_KeyError, "Hit: the scope has no %s", wanted[i]);
      return nullptr;
    }
  }
  const long long layout = PyLong_AsLongLong(found[10]);
  if ((layout == -1 && PyErr_Occurred()) || !PyModule_Check(found[9]) || !PyType_Check(found[8]) ||
      !PyDict_Check(found[2])) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Hit: a scope entry of another type");
    return nullptr;
  }
  Hit* self = reinterpret_cast<Hit*>(type->tp_alloc(type, 0));
  PyObject* last = PyList_New(PyTuple_GET_SIZE(names) + 1);
  if (self == nullptr || last == nullptr) {
    Py_XDECREF(self);
    Py_XDECREF(last);
    return nullptr;
  }
  self->n = PyBytes_GET_SIZE(kinds);
  self->addresses = static_cast<Address*>(PyMem_Calloc(self->n + 1, sizeof(Address)));
  if (self->addresses == nullptr) {
    Py_DECREF(self);
    Py_DECREF(last);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t j = 0; j <= PyTuple_GET_SIZE(names); ++j) {
    Py_INCREF(Py_None);
    PyList_SET_ITEM(last, j, Py_None);
  }
  PyObject** fields[] = {&self->python, &self->key_of, &self->fast, &self->lean, &self->fn, &self->tokens,
                         &self->meta_token, &self->knobs, &self->hook_chain};
  for (int i = 0; i < 9; ++i) {
    Py_INCREF(found[i]);
    *fields[i] = found[i];
  }
  // (the last values start as the list itself, which no call passes: the first call makes its token)
  for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(names); ++j) {
    Py_INCREF(last);
    PyList_SetItem(last, j, last);
  }
  self->module = PyModule_GetDict(found[9]);
  Py_INCREF(self->module);
  Py_INCREF(names);
  self->names = names;
  self->last = last;
  Py_INCREF(kinds);
  self->kinds = kinds;
  self->layout = layout;
  self->device_type = device_type;
  self->vectorcall = hit_call;
  return reinterpret_cast<PyObject*>(self);
}

PyTypeObject HitType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "dsa_launch_hit", nullptr, -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_dsa_launch_hit() {
  HitType.tp_name = "dsa_launch_hit.Hit";
  HitType.tp_basicsize = sizeof(Hit);
  HitType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  HitType.tp_doc = "Hit(scope, kinds, names, device_type)(grid, args, meta): a lean launch's hit (launch_hit.cpp)";
  HitType.tp_new = hit_new;
  HitType.tp_call = PyVectorcall_Call;
  HitType.tp_vectorcall_offset = offsetof(Hit, vectorcall);
  HitType.tp_traverse = hit_traverse;
  HitType.tp_clear = hit_clear;
  HitType.tp_dealloc = hit_dealloc;
  const char* names[] = {"runtime", "compilation", "debug", "instrumentation_mode", "launch_enter_hook",
                         "launch_exit_hook", "calls", "pre_run_hooks", "used_global_vals", "watched", "watched_of",
                         "globals_changed", "miss", "_device", "_stream"};
  PyObject** interned[] = {&s_runtime, &s_compilation, &s_debug, &s_instrumentation_mode, &s_enter, &s_exit,
                           &s_calls, &s_pre_run, &s_used, &s_watched, &s_watched_of, &s_globals_changed, &s_miss,
                           &s_device, &s_stream};
  for (int i = 0; i < 15; ++i) {
    if ((*interned[i] = PyUnicode_InternFromString(names[i])) == nullptr) return nullptr;
  }
  s_one = PyLong_FromLong(1);
  if (s_one == nullptr || PyType_Ready(&HitType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&HitType);
  if (PyModule_AddObject(m, "Hit", reinterpret_cast<PyObject*>(&HitType)) < 0 ||
      PyModule_AddIntConstant(m, "CPU", static_cast<long>(c10::DeviceType::CPU)) < 0 ||
      PyModule_AddIntConstant(m, "CUDA", static_cast<long>(c10::DeviceType::CUDA)) < 0) {
    Py_DECREF(&HitType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
