// The lean launch path's own launcher of compiled kernels: what Triton 3.6's CUDA launcher (the C source that
// triton/backends/nvidia/driver.py's make_launcher generates per signature) does for a kernel without scratch memory,
// clusters or a cooperative grid, given the arguments of a hit (addresses for pointers). dsa_triton/launcher.py
// builds it as Triton builds its launchers (triton.runtime.build.compile_module_from_src, against the cuda.h Triton
// ships) and describes each compiled kernel (describe); dsa_triton/launch.py calls launch() on a hit.
//
// A kernel's arguments are those of Triton's launcher: the entries of the kernel's signature, in order, constexprs
// included (a descriptor may leave out the last ones when they are all constexprs: those are passed as nothing
// anyway). Each entry has a type code (TYPES, keyed by Triton's own names for it: launcher.py's type_codes), which
// says how the argument is converted, as PyArg_ParseTuple converts it for Triton (the format make_launcher's
// format_of gives the type), and how many bytes the kernel parameter takes; constexprs are converted to nothing and
// passed as nothing. The kernel's parameters are then the entries not skipped, in order, followed by the global and
// the profile scratch pointers (0: no scratch).
#include "cuda.h"
#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

// Type codes. The conversion, as Triton's launcher's format character converts the argument:
enum {
  SKIP,     // constexpr ("O", not passed)
  POINTER,  // CUdeviceptr: an int (an address, as getPointer takes one) or None (0), 8 bytes
  I8,       // int8_t ("b": 0..255, else OverflowError), 1 byte
  I16,      // int16_t ("h": a short's range), 2 bytes
  I32,      // int32_t ("i": an int's range), 4 bytes
  I64,      // int64_t ("L"), 8 bytes
  U8,       // uint8_t ("B": masked to 8 bits), 1 byte
  U16,      // uint16_t ("H": masked), 2 bytes
  U32,      // uint32_t ("I": masked), 4 bytes
  U64,      // uint64_t ("K": masked; an int, nothing else), 8 bytes
  FP16,     // "d", then pack_fp16 (PyFloat_Pack2), 2 bytes
  BF16,     // "d", then pack_bf16 (the top half of the float32), 2 bytes
  FP32,     // "d", then pack_fp32 (the double rounded to a float32), 4 bytes
  FP64,     // "d", then pack_fp64, 8 bytes
  N_CODES
};
static const int SIZES[N_CODES] = {0, 8, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8};
#define MAX_ENTRIES 512  // signature entries a described kernel may have
#define SCRATCH 2        // the trailing global and profile scratch pointers

static const char* const KERNEL = "dsa_launcher.kernel";  // the name of a descriptor capsule

// A described kernel (describe): its handle, launch dimensions and attributes, and each signature entry's code.
typedef struct {
  CUfunction function;
  unsigned int block;   // threads a block: 32 * num_warps
  unsigned int shared;  // dynamic shared memory, bytes
  int pdl;              // launch_pdl: the programmatic stream serialization attribute
  Py_ssize_t n;         // signature entries (arguments of launch and pack after the descriptor)
  Py_ssize_t params;    // kernel parameters: entries not skipped, then the scratch pointers
  unsigned char codes[MAX_ENTRIES];
} Kernel;

// The arguments of kernel k converted into slots (one 8-byte slot a parameter, the value in its first bytes, the
// scratch slots 0), as Triton's launcher converts them; -1 with a Python exception set on an argument it refuses.
static int fill(const Kernel* k, PyObject* const* args, uint64_t* slots) {
  Py_ssize_t p = 0;
  for (Py_ssize_t i = 0; i < k->n; ++i) {
    PyObject* o = args[i];
    const int code = k->codes[i];
    if (code == SKIP) {
      continue;
    }
    void* slot = &slots[p++];
    if (code == POINTER) {
      uint64_t v = 0;
      if (PyLong_Check(o)) {
        v = PyLong_AsUnsignedLongLong(o);
        if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
      } else if (o != Py_None) {
        PyErr_Format(PyExc_TypeError, "argument %zd: a pointer is passed as an address (int) or None", i);
        return -1;
      }
      memcpy(slot, &v, 8);
    } else if (code >= I8 && code <= I32) {
      const long v = PyLong_AsLong(o);
      if (v == -1 && PyErr_Occurred()) return -1;
      const long lo = code == I8 ? 0 : code == I16 ? SHRT_MIN : INT_MIN;
      const long hi = code == I8 ? UCHAR_MAX : code == I16 ? SHRT_MAX : INT_MAX;
      if (v < lo || v > hi) {
        PyErr_Format(PyExc_OverflowError, "argument %zd: %ld is out of range", i, v);
        return -1;
      }
      if (code == I8) {
        const uint8_t b = (uint8_t)v;
        memcpy(slot, &b, 1);
      } else if (code == I16) {
        const int16_t h = (int16_t)v;
        memcpy(slot, &h, 2);
      } else {
        const int32_t w = (int32_t)v;
        memcpy(slot, &w, 4);
      }
    } else if (code == I64) {
      const long long v = PyLong_AsLongLong(o);
      if (v == -1 && PyErr_Occurred()) return -1;
      memcpy(slot, &v, 8);
    } else if (code >= U8 && code <= U32) {
      const unsigned long v = PyLong_AsUnsignedLongMask(o);
      if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
      const uint8_t b = (uint8_t)v;
      const uint16_t h = (uint16_t)v;
      const uint32_t w = (uint32_t)v;
      memcpy(slot, code == U8 ? (const void*)&b : code == U16 ? (const void*)&h : (const void*)&w, SIZES[code]);
    } else if (code == U64) {
      if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "argument %zd: an int is required", i);
        return -1;
      }
      const unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
      if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
      memcpy(slot, &v, 8);
    } else {  // FP16 .. FP64
      const double d = PyFloat_AsDouble(o);
      if (d == -1.0 && PyErr_Occurred()) return -1;
      if (code == FP16) {
        uint16_t h;
#if 0x030600B1 <= PY_VERSION_HEX && PY_VERSION_HEX <= 0x030B00A1 && !defined(PYPY_VERSION)
        if (_PyFloat_Pack2(d, (unsigned char*)&h, 1) < 0) return -1;
#else
        if (PyFloat_Pack2(d, (char*)&h, 1) < 0) return -1;  // (Triton launches, then raises: here it raises)
#endif
        memcpy(slot, &h, 2);
      } else if (code == FP64) {
        memcpy(slot, &d, 8);
      } else {
        const float f = (float)d;
        uint32_t w;
        memcpy(&w, &f, 4);
        const uint16_t h = (uint16_t)(w >> 16);
        memcpy(slot, code == BF16 ? (const void*)&h : (const void*)&w, SIZES[code]);
      }
    }
  }
  slots[p] = slots[p + 1] = 0;  // global_scratch, profile_scratch
  return 0;
}

static void release(PyObject* capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, KERNEL)); }

// describe(function, num_warps, shared, pdl, codes) -> the kernel's descriptor (a capsule), for launch and pack.
static PyObject* describe(PyObject* self, PyObject* args) {
  unsigned long long function;
  int num_warps, pdl;
  unsigned int shared;
  const char* codes;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "KiIpy#", &function, &num_warps, &shared, &pdl, &codes, &n)) return NULL;
  if (n > MAX_ENTRIES || num_warps < 1 || num_warps > 32) {
    PyErr_SetString(PyExc_ValueError, "describe: more than 512 signature entries, or num_warps outside 1..32");
    return NULL;
  }
  Kernel* k = PyMem_Calloc(1, sizeof(Kernel));
  if (k == NULL) return PyErr_NoMemory();
  k->function = (CUfunction)(uintptr_t)function;
  k->block = 32u * (unsigned)num_warps;
  k->shared = shared;
  k->pdl = pdl;
  k->n = n;
  k->params = SCRATCH;
  for (Py_ssize_t i = 0; i < n; ++i) {
    k->codes[i] = (unsigned char)codes[i];
    if (k->codes[i] >= N_CODES) {
      PyMem_Free(k);
      PyErr_Format(PyExc_ValueError, "describe: no type code %d", (int)k->codes[i]);
      return NULL;
    }
    k->params += k->codes[i] != SKIP;
  }
  PyObject* capsule = PyCapsule_New(k, KERNEL, release);
  if (capsule == NULL) PyMem_Free(k);
  return capsule;
}

// The descriptor and the kernel's arguments of a launch or pack call (args[0], args[1:]); NULL with an exception.
static const Kernel* described(PyObject* const* args, Py_ssize_t nargs) {
  const Kernel* k = nargs > 0 ? PyCapsule_GetPointer(args[0], KERNEL) : NULL;
  if (k != NULL && nargs - 1 != k->n) {
    PyErr_Format(PyExc_TypeError, "the kernel takes %zd arguments, %zd given", k->n, nargs - 1);
    return NULL;
  }
  if (k == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "no descriptor");
  return k;
}

// pack(descriptor, *args) -> bytes: the kernel parameters launch passes for these arguments, each one's bytes in
// order (the scratch pointers' last), from the code launch runs (fill).
static PyObject* pack(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  const Kernel* k = described(args, nargs);
  uint64_t slots[MAX_ENTRIES + SCRATCH];
  if (k == NULL || fill(k, args + 1, slots) < 0) return NULL;
  char out[8 * (MAX_ENTRIES + SCRATCH)];
  Py_ssize_t size = 0, p = 0;
  for (Py_ssize_t i = 0; i < k->n; ++i) {
    if (k->codes[i] != SKIP) {
      memcpy(out + size, &slots[p++], SIZES[k->codes[i]]);
      size += SIZES[k->codes[i]];
    }
  }
  memcpy(out + size, &slots[p], 8 * SCRATCH);
  return PyBytes_FromStringAndSize(out, size + 8 * SCRATCH);
}

// The driver entry points, resolved from libcuda.so.1 at the first launch (cuLaunchKernelEx as Triton's launcher
// resolves it; the others are those it links).
typedef CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
static struct {
  LaunchKernelEx launch;
  CUresult (*ctx_get_current)(CUcontext*);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*get_error_string)(CUresult, const char**);
} driver;

static int load_driver(void) {
  if (driver.launch != NULL) return 0;
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY);
  if (lib == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Failed to open libcuda.so.1");
    return -1;
  }
  void* found[6] = {dlsym(lib, "cuCtxGetCurrent"), dlsym(lib, "cuDeviceGet"), dlsym(lib, "cuDevicePrimaryCtxRetain"),
                    dlsym(lib, "cuCtxSetCurrent"), dlsym(lib, "cuGetErrorString"), dlsym(lib, "cuLaunchKernelEx")};
  for (int i = 0; i < 6; ++i) {
    if (found[i] == NULL) {
      PyErr_SetString(PyExc_RuntimeError, "Failed to retrieve the CUDA driver's entry points from libcuda.so.1");
      return -1;
    }
  }
  driver.ctx_get_current = (CUresult(*)(CUcontext*))found[0];
  driver.device_get = (CUresult(*)(CUdevice*, int))found[1];
  driver.primary_ctx_retain = (CUresult(*)(CUcontext*, CUdevice))found[2];
  driver.ctx_set_current = (CUresult(*)(CUcontext))found[3];
  driver.get_error_string = (CUresult(*)(CUresult, const char**))found[4];
  driver.launch = (LaunchKernelEx)found[5];
  return 0;
}

// 0, or -1 with Triton's exception for a failed driver call (RuntimeError "Triton Error [CUDA]: ...").
static int checked(CUresult code) {
  if (code == CUDA_SUCCESS) return 0;
  const char* text = NULL;
  driver.get_error_string(code, &text);
  PyErr_Format(PyExc_RuntimeError, "Triton Error [CUDA]: %s", text != NULL ? text : "unknown error");
  return -1;
}

// Triton's ensureCudaContext: a thread without a current context gets device 0's primary context.
static int ensure_context(void) {
  CUcontext context = NULL;
  if (checked(driver.ctx_get_current(&context)) < 0) return -1;
  if (context == NULL) {
    CUdevice device;
    if (checked(driver.device_get(&device, 0)) < 0 || checked(driver.primary_ctx_retain(&context, device)) < 0 ||
        checked(driver.ctx_set_current(context)) < 0) {
      return -1;
    }
  }
  return 0;
}

// A grid size as "i" takes it.
static int grid_size(PyObject* o, int* out) {
  const long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (v < INT_MIN || v > INT_MAX) {
    PyErr_SetString(PyExc_OverflowError, "a grid size is out of an int's range");
    return -1;
  }
  *out = (int)v;
  return 0;
}

// launch(grid_x, grid_y, grid_z, stream, descriptor, *args): Triton's launcher's launch of the described kernel
// (the attributes, block and dynamic shared memory of its _launch, num_ctas 1, no cooperative grid, no scratch), the
// GIL released around the driver call; no launch for an empty grid. Arguments it refuses raise before any launch.
static PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 5) {
    PyErr_SetString(PyExc_TypeError, "launch(grid_x, grid_y, grid_z, stream, descriptor, *args)");
    return NULL;
  }
  int grid[3];
  if (grid_size(args[0], &grid[0]) < 0 || grid_size(args[1], &grid[1]) < 0 || grid_size(args[2], &grid[2]) < 0) {
    return NULL;
  }
  if (!PyLong_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "the stream is an int (a CUstream)");
    return NULL;
  }
  const CUstream stream = (CUstream)(uintptr_t)PyLong_AsUnsignedLongLongMask(args[3]);
  const Kernel* k = described(args + 4, nargs - 4);
  uint64_t slots[MAX_ENTRIES + SCRATCH];
  if (k == NULL || fill(k, args + 5, slots) < 0 || load_driver() < 0 || ensure_context() < 0) return NULL;
  // (Triton's test: the product as its int arithmetic wraps)
  if ((int)((unsigned)grid[0] * (unsigned)grid[1] * (unsigned)grid[2]) <= 0) Py_RETURN_NONE;
  void* params[MAX_ENTRIES + SCRATCH];
  for (Py_ssize_t p = 0; p < k->params; ++p) params[p] = &slots[p];
  CUlaunchAttribute attrs[1];
  memset(attrs, 0, sizeof(attrs));
  CUlaunchConfig config;
  config.gridDimX = (unsigned)grid[0];
  config.gridDimY = (unsigned)grid[1];
  config.gridDimZ = (unsigned)grid[2];
  config.blockDimX = k->block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = k->shared;
  config.hStream = stream;
  config.attrs = attrs;
  config.numAttrs = 0;
  if (k->pdl) {
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[0].value.programmaticStreamSerializationAllowed = 1;
    config.numAttrs = 1;
  }
  CUresult code;
  Py_BEGIN_ALLOW_THREADS;
  code = driver.launch(&config, k->function, params, NULL);
  Py_END_ALLOW_THREADS;
  if (checked(code) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"describe", describe, METH_VARARGS,
     "describe(function, num_warps, shared, pdl, codes) -> descriptor: a compiled kernel for launch and pack"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(grid_x, grid_y, grid_z, stream, descriptor, *args): launch the described kernel"},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(descriptor, *args) -> bytes: the kernel parameters launch would pass, each one's bytes in order"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dsa_launcher", NULL, -1, methods};

PyMODINIT_FUNC PyInit_dsa_launcher(void) {
  static const struct {
    const char* name;
    int code;
  } types[] = {{"constexpr", SKIP},   {"CUdeviceptr", POINTER}, {"int8_t", I8},         {"int16_t", I16},
               {"int32_t", I32},      {"int64_t", I64},         {"uint8_t", U8},        {"uint16_t", U16},
               {"uint32_t", U32},     {"uint64_t", U64},        {"pack_fp16", FP16},    {"pack_bf16", BF16},
               {"pack_fp32", FP32},   {"pack_fp64", FP64}};
  PyObject* m = PyModule_Create(&module);
  PyObject* table = PyDict_New();  // TYPES: Triton's name of a conversion -> its code
  PyObject* sizes = NULL;          // SIZES: a code's kernel parameter bytes
  if (m == NULL || table == NULL) goto fail;
  for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); ++i) {
    PyObject* code = PyLong_FromLong(types[i].code);
    if (code == NULL || PyDict_SetItemString(table, types[i].name, code) < 0) {
      Py_XDECREF(code);
      goto fail;
    }
    Py_DECREF(code);
  }
  if (PyModule_AddObject(m, "TYPES", table) < 0) goto fail;
  table = NULL;
  sizes = PyTuple_New(N_CODES);
  for (int i = 0; sizes != NULL && i < N_CODES; ++i) {
    PyObject* size = PyLong_FromLong(SIZES[i]);
    if (size == NULL) goto fail;
    PyTuple_SET_ITEM(sizes, i, size);
  }
  if (sizes == NULL || PyModule_AddObject(m, "SIZES", sizes) < 0) goto fail;
  return m;
fail:
  Py_XDECREF(table);
  Py_XDECREF(sizes);
  Py_XDECREF(m);
  return NULL;
}
