// What the parts of the CUDA driver emulator share (driver.cpp: devices, contexts, memory,
// streams, events; kernels.cpp: modules and launches).
#pragma once

#include <cstddef>
#include <functional>

extern "C" {
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
}

namespace emu {

enum : CUresult {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
};

// SUCCESS once cuInit ran and this thread has a current context.
CUresult ready();
// Runs `work` on stream `s`'s worker (the null stream when `s` is null), after its earlier work.
void enqueue(CUstream s, std::function<void()> work);
// The host address of bytes [d, d + n) of one live allocation or pinned host range; null if
// they are not all inside one.
void* translate(CUdeviceptr d, size_t n);
// The host address of `d` and the bytes from it to the end of its allocation (null / 0 if none).
void* translate_rest(CUdeviceptr d);
size_t bytes_from(CUdeviceptr d);
// Work on a stream touched memory that is not allocated: the context's sticky error.
void fault();

}  // namespace emu
