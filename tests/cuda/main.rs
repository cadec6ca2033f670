//! The CUDA path: NVRTC compiling the kernel, the kernel source run on the CPU, the CUDA driver
//! emulator (emu/cuda) against the driver's documented behaviour, and the tests a GPU runs
//! (`kernel_gpu`, `e2e_device`), which scripts/test runs again on the emulator and
//! `scripts/gpu-check` on a real device.

#[path = "../common/mod.rs"]
mod common;
mod driver;
mod kv_cases;

mod cuda_emu_driver;
mod cuda_emu_ipc;
mod e2e_device;
mod kernel_cuda;
mod kernel_cuda_emu;
mod kernel_gpu;
