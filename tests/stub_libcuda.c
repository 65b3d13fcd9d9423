// A stand-in libcuda.so.1 for tests/launcher_stub.py: the driver entry points that Triton's generated CUDA launcher
// and dsa_triton/launcher.c call, each noted in a call log; cuLaunchKernelEx records its launch (the function, the
// configuration, the attributes and each kernel parameter's bytes, by the sizes stub_expect gave) instead of running
// anything. Built with Triton's cuda.h (its types); no GPU needed.
#include "cuda.h"
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 1024
static int sizes[MAX_PARAMS];
static int n_sizes;
static unsigned char record[1 << 16];  // the last launch
static size_t record_length;
static char log_[1 << 12];  // one letter a driver call since stub_reset
static size_t log_length;
static int recording = 1;
static CUresult launch_result = CUDA_SUCCESS;
static CUcontext current;

static void note(char c) {
  if (log_length < sizeof(log_)) log_[log_length++] = c;
}

static void put(const void* data, size_t n) {
  if (record_length + n <= sizeof(record)) {
    memcpy(record + record_length, data, n);
    record_length += n;
  }
}

// The kernel parameters' sizes of the next launches (their number, then each one's bytes).
void stub_expect(int n, const int* each) {
  n_sizes = n < MAX_PARAMS ? n : MAX_PARAMS;
  memcpy(sizes, each, sizeof(int) * (size_t)n_sizes);
}

// Clear the record and the log; record launches or not (a benchmark's); the result launches return; whether the
// thread has a current context (else the launchers retain device 0's primary context).
void stub_reset(int record_launches, int result, int context) {
  record_length = log_length = 0;
  recording = record_launches;
  launch_result = (CUresult)result;
  current = context ? (CUcontext)(uintptr_t)0xC0 : NULL;
}

size_t stub_record(const unsigned char** out) {
  *out = record;
  return record_length;
}

size_t stub_log(const char** out) {
  *out = log_;
  return log_length;
}

CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
  note('l');
  if (!recording) return launch_result;
  record_length = 0;
  const uint64_t function = (uint64_t)(uintptr_t)f, stream = (uint64_t)(uintptr_t)config->hStream;
  const uint64_t has_extra = extra != NULL;
  put(&function, 8);
  put(&config->gridDimX, 4);
  put(&config->gridDimY, 4);
  put(&config->gridDimZ, 4);
  put(&config->blockDimX, 4);
  put(&config->blockDimY, 4);
  put(&config->blockDimZ, 4);
  put(&config->sharedMemBytes, 4);
  put(&stream, 8);
  put(&has_extra, 8);
  put(&config->numAttrs, 4);
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    put(&config->attrs[i].id, 4);
    put(&config->attrs[i].value, sizeof(config->attrs[i].value));
  }
  for (int i = 0; i < n_sizes; ++i) put(params[i], (size_t)sizes[i]);
  return launch_result;
}

CUresult cuCtxGetCurrent(CUcontext* pctx) {
  note('g');
  *pctx = current;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  note('d');
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  note('r');
  *pctx = (CUcontext)(uintptr_t)(0xD0 + dev);
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  note('s');
  current = ctx;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** text) {
  note('e');
  *text = error == CUDA_ERROR_INVALID_VALUE ? "invalid argument" : "stub error";
  return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attrib, int value) {
  note('f');
  return CUDA_SUCCESS;
}

CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  note('p');
  *(uint64_t*)data = ptr;
  return CUDA_SUCCESS;
}
