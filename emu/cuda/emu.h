// What the parts of the CUDA driver emulator share (driver.cpp: devices, contexts, streams,
// events, copies; memory.cpp: device and pinned memory, VMM, IPC; kernels.cpp: modules and
// launches).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>

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

constexpr int kDevices = 2;
constexpr size_t kDeviceBytes = size_t(16) << 30;  // what each device reports

enum : CUresult {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    MAPPING_FAILED = 205,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    HOST_MEMORY_ALREADY_REGISTERED = 712,
    HOST_MEMORY_NOT_REGISTERED = 713,
    NOT_SUPPORTED = 801,
};

// SUCCESS once cuInit ran and this thread has a current context, unless the context has a
// sticky error.
CUresult ready();
// SUCCESS once cuInit ran: for the functions the driver answers without a current context
// (pointer attributes, VMM handles).
CUresult initialised();
// The current context's device (0 without one).
int current_device();
// Device `device`'s primary context.
CUcontext primary_context(int device);
// Runs `work` on stream `s`'s worker (the null stream when `s` is null), after its earlier work
// and with the legacy default stream's ordering.
void enqueue(CUstream s, std::function<void()> work);
// Until all work enqueued so far on every stream completed.
void synchronize_device();

// Reserves the device address range (cuInit).
CUresult memory_init();
// Whether `d` lies in the device address range.
bool is_device(CUdeviceptr d);
// The host address of bytes [d, d + n) of device memory or pinned host memory; null if they
// are not all usable (unallocated, freed, unmapped, not accessible).
void* translate(CUdeviceptr d, size_t n);
// The host address of `d` and how many bytes from it on are usable (null / 0 if none).
std::pair<void*, size_t> rest(CUdeviceptr d);
// Work on a stream touched memory that is not allocated: the context's sticky error.
void fault();
// A process's start time (field 22 of /proc/PID/stat); 0 if it does not exist. IPC handles
// carry their exporter's, so that a reused pid is not taken for it.
uint64_t process_start_time(int pid);

}  // namespace emu
