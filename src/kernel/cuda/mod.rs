//! The CUDA transfer kernel: `kernels/kv_transfer.cu`, compiled by NVRTC at first use, gathers
//! and scatters device pools with the CPU kernel's contract (see [`super`]).
//!
//! This file owns the error type (with the conversion of driver errors into it), the run-time
//! probes for the CUDA driver and NVRTC, and the PTX compilation with its per-architecture
//! cache. [`launch`] turns a validated selection into
//! the kernel's parameters and geometry (plain Rust, shared with the host emulation test);
//! [`device`] owns the kernel, its launches and pinned staging; `device_pool.rs` the device
//! pools and the gathers and scatters of them.
//!
//! Nothing CUDA is needed to build: cudarc loads libcuda when first asked, and [`nvrtc`] loads
//! libnvrtc. cudarc's loader panics when the driver is missing, so every path first probes it
//! ([`driver_present`]) and returns [`CudaError::DriverMissing`] instead; a missing NVRTC is
//! [`CudaError::NvrtcMissing`]. NVRTC is found through the ordinary library search
//! (`LD_LIBRARY_PATH`) under CUDA 12's and 13's names ([`nvrtc::CANDIDATES`]; the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12` ships `libnvrtc.so.12`; `scripts/nvrtc-env` prints the variable).
#![allow(unsafe_code)]

pub mod device;
mod device_pool;
mod ipc;
pub mod launch;
pub mod nvrtc;
pub mod vmm;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use device::{CudaKernel, DeviceStaging, PinnedStaging, ReadyEvent, Staging};
pub use device_pool::DevicePool;
pub use ipc::{ExportedMemory, IpcEventHandle, IpcEvents, MAX_OPEN_EVENTS};

/// The conversion of a cudarc driver error from `op` into [`CudaError::Driver`].
fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        message: e.to_string(),
    }
}

/// The CUDA source of the transfer kernels.
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/kv_transfer.cu");

/// Entry point names in [`KERNEL_SOURCE`] (`extern "C"`, so unmangled).
pub const GATHER_ENTRY: &str = "kv_gather";
/// See [`GATHER_ENTRY`].
pub const SCATTER_ENTRY: &str = "kv_scatter";

/// Errors of the CUDA kernel. Availability errors come first: a caller matches them to fall
/// back or to report a misconfigured node; the others are failures of a present CUDA.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum CudaError {
    /// libcuda cannot be loaded: no NVIDIA driver on this machine.
    #[error("the CUDA driver library (libcuda.so) is not loadable on this machine")]
    DriverMissing,
    /// The driver is present but the device is not.
    #[error("no CUDA device {ordinal}: {reason}")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// What the driver said.
        reason: String,
    },
    /// libnvrtc cannot be loaded.
    #[error(
        "NVRTC (libnvrtc.so.12 or libnvrtc.so.13) is not loadable; put the directory that holds \
         it on LD_LIBRARY_PATH (the wheel nvidia-cuda-nvrtc-cu12 ships one: \
         eval \"$(scripts/nvrtc-env)\")"
    )]
    NvrtcMissing,
    /// NVRTC refused the kernel source.
    #[error("NVRTC failed to compile kv_transfer.cu for {arch}: {log}")]
    Compile {
        /// The virtual architecture, e.g. `compute_90`.
        arch: String,
        /// NVRTC's message and log.
        log: String,
    },
    /// A driver call failed.
    #[error("CUDA {op} failed: {message}")]
    Driver {
        /// The operation.
        op: &'static str,
        /// The driver's error.
        message: String,
    },
    /// The driver refused a CUDA IPC event handle (`cuIpcOpenEventHandle`): its exporter
    /// exited or destroyed the event, or the bytes are no handle. The caller's input is wrong.
    #[error("the CUDA driver refused the IPC event handle: {message}")]
    EventHandle {
        /// The driver's error.
        message: String,
    },
    /// A selection dimension beyond what the kernel's 32-bit indexing or the grid can hold.
    #[error("{what} = {value} is too large for the CUDA kernel (limit {limit})")]
    TooLarge {
        /// The quantity.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The largest accepted value.
        limit: u64,
    },
    /// Device memory given for a pool that does not fit its layout, or is not device memory.
    #[error("device pool memory: {0}")]
    Regions(String),
    /// A byte range outside a device pool or staging buffer.
    #[error("byte range {offset}+{len} is outside the buffer's {size} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The buffer's size.
        size: usize,
    },
    /// A pool or staging buffer belongs to another device than the kernel.
    #[error("buffer on device {buffer} used with the kernel of device {kernel}")]
    WrongDevice {
        /// The buffer's device ordinal.
        buffer: usize,
        /// The kernel's device ordinal.
        kernel: usize,
    },
}

impl CudaError {
    /// True when CUDA is absent (driver, device or NVRTC) rather than failing.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::DriverMissing | CudaError::NoDevice { .. } | CudaError::NvrtcMissing
        )
    }
}

/// Whether libcuda can be loaded. Probed once per process.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries dlopen on cudarc's candidate names; resolves no symbol.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Whether libnvrtc can be loaded. Probed once per process.
pub fn nvrtc_present() -> bool {
    nvrtc::get().is_some()
}

/// The PTX of [`KERNEL_SOURCE`] for virtual architecture `arch` (e.g. `compute_90`), compiled by
/// NVRTC on first request and cached for the life of the process.
pub fn compile_ptx(arch: &str) -> Result<Arc<str>, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<str>>>> = OnceLock::new();
    let nvrtc = nvrtc::get().ok_or(CudaError::NvrtcMissing)?;
    let cache = CACHE.get_or_init(Default::default);
    // A panic while holding the lock cannot leave the map inconsistent (one insert).
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ptx) = cache.get(arch) {
        return Ok(ptx.clone());
    }
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
    ];
    let ptx = nvrtc
        .compile(KERNEL_SOURCE, "kv_transfer.cu", &options)
        .map_err(|f| CudaError::Compile {
            arch: arch.to_owned(),
            log: format!("{}: {}", f.error, f.log),
        })?;
    let text: Arc<str> = ptx.into();
    cache.insert(arch.to_owned(), text.clone());
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_has_no_includes_and_unmangled_entry_points() {
        // The code, without comments (which may name what the code must not use).
        let code: Vec<&str> = KERNEL_SOURCE
            .lines()
            .map(|line| line.split("//").next().unwrap_or(""))
            .collect();
        let code = code.join("\n");
        assert!(!code.contains("#include"));
        let forbidden = [
            "__shared__",
            "__syncthreads",
            "__shfl",
            "__ballot",
            "__any_sync",
        ];
        for word in forbidden {
            assert!(!code.contains(word), "{word}");
        }
        for entry in [GATHER_ENTRY, SCATTER_ENTRY] {
            assert!(
                KERNEL_SOURCE.contains(&format!("extern \"C\" __global__ void {entry}(")),
                "{entry}"
            );
        }
    }

    #[test]
    fn unavailability_is_classified() {
        assert!(CudaError::DriverMissing.is_unavailable());
        assert!(CudaError::NvrtcMissing.is_unavailable());
        let failed = CudaError::Driver {
            op: "launch",
            message: "x".to_owned(),
        };
        assert!(!failed.is_unavailable());
    }
}
