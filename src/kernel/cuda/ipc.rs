//! Device memory another process maps: an allocation of this process exported by CUDA IPC
//! handle (`cuIpcGetMemHandle`). An engine that runs its agents as sidecars allocates its pools
//! this way and names them to the agents (`--pool cuda-ipc:<device>:<handle>`); `kvferry demo
//! --pool device` does. The allocation is a plain `cuMemAlloc` (stream-ordered allocations
//! cannot be exported) and is freed when this value drops.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CudaError, CudaKernel};
use crate::pool::PoolDescriptor;

/// A device allocation exported by CUDA IPC handle.
pub struct ExportedMemory {
    kernel: Arc<CudaKernel>,
    addr: u64,
    len: usize,
}

impl fmt::Debug for ExportedMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportedMemory")
            .field("device", &self.kernel.ordinal())
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl ExportedMemory {
    /// Allocates `len` bytes on the kernel's device, each set to `fill`.
    pub fn new(kernel: &Arc<CudaKernel>, len: usize, fill: u8) -> Result<Self, CudaError> {
        kernel.bind()?;
        let mut addr = 0;
        // SAFETY: a valid out-pointer, in the kernel's current context.
        unsafe { sys::cuMemAlloc_v2(&mut addr, len) }
            .result()
            .map_err(|e| CudaError::Driver {
                op: "allocate exported device memory",
                message: e.to_string(),
            })?;
        let memory = ExportedMemory {
            kernel: kernel.clone(),
            addr,
            len,
        };
        // SAFETY: `len` bytes of the allocation just made; synchronous.
        unsafe { sys::cuMemsetD8_v2(addr, fill, len) }
            .result()
            .and_then(|()| kernel.synchronize_context())
            .map_err(|e| CudaError::Driver {
                op: "fill exported device memory",
                message: e.to_string(),
            })?;
        Ok(memory)
    }

    /// Its device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pool descriptor another process opens it by.
    pub fn descriptor(&self) -> Result<PoolDescriptor, CudaError> {
        self.kernel.bind()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: a valid out-pointer; `addr` is the base of our cuMemAlloc allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.addr) }
            .result()
            .map_err(|e| CudaError::Driver {
                op: "export a CUDA IPC handle",
                message: e.to_string(),
            })?;
        Ok(PoolDescriptor::CudaIpc {
            device: self.kernel.ordinal() as u32,
            handle: handle.reserved.map(|b| b as u8),
        })
    }

    /// Copies its bytes to the host.
    pub fn read(&self) -> Result<Vec<u8>, CudaError> {
        self.kernel.bind()?;
        let mut out = vec![0u8; self.len];
        // SAFETY: `out` holds `len` bytes; the copy is synchronous.
        unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.addr, self.len) }
            .result()
            .map_err(|e| CudaError::Driver {
                op: "copy exported device memory to the host",
                message: e.to_string(),
            })?;
        Ok(out)
    }
}

impl Drop for ExportedMemory {
    fn drop(&mut self) {
        // SAFETY: our own allocation, freed once (the driver waits for work using it).
        let freed = self
            .kernel
            .bind()
            .map(|()| unsafe { sys::cuMemFree_v2(self.addr) });
        if !matches!(freed, Ok(sys::CUresult::CUDA_SUCCESS)) {
            tracing::warn!(addr = self.addr, "freeing exported device memory failed");
        }
    }
}
