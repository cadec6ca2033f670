// A stand-in for NVML (libnvidia-ml.so.1) beside the CUDA driver emulator: UCX's CUDA transports
// (libuct_cuda of UCX 1.22) link NVML, so without a library of that name they do not load at all.
// NVML itself is not emulated: nvmlInit_v2 fails, as on a machine whose driver NVML cannot reach,
// and UCX goes on without what it would learn from NVML (NVLink topology).

extern "C" {

enum { NVML_SUCCESS = 0, NVML_ERROR_DRIVER_NOT_LOADED = 9 };

int nvmlInit_v2() { return NVML_ERROR_DRIVER_NOT_LOADED; }

int nvmlShutdown() { return NVML_SUCCESS; }

const char* nvmlErrorString(int result) {
    return result == NVML_SUCCESS ? "Success" : "Driver Not Loaded (the kvferry CUDA emulator has no NVML)";
}

}  // extern "C"
