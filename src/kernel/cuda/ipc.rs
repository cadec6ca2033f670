//! CUDA IPC: device memory another process maps, and events of another process.
//!
//! [`ExportedMemory`] is an allocation of this process exported by CUDA IPC handle
//! (`cuIpcGetMemHandle`). An engine that runs its agents as sidecars allocates its pools this
//! way and names them to the agents (`--pool cuda-ipc:<device>:<handle>`); `kvferry demo --pool
//! device` does. The allocation is a plain `cuMemAlloc` (stream-ordered allocations cannot be
//! exported) and is freed when this value drops.
//!
//! [`IpcEvents`] are the engine's interprocess events as a sidecar opens them
//! (`cuIpcOpenEventHandle`): each handle value is opened once and kept, at most
//! [`MAX_OPEN_EVENTS`] at a time, and every one is destroyed when the value drops (with the
//! agent's pool). Following one is [`CudaKernel::follow`], as for an event of this process.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::{CudaError, CudaKernel, ReadyEvent};
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

/// A CUDA IPC event handle (`CUipcEventHandle`, 64 bytes) as `cuIpcGetEventHandle` gives it
/// for an event created with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`. In JSON and on
/// the command line: 128 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle(pub [u8; 64]);

impl fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcEventHandle({self})")
    }
}

impl fmt::Display for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::str::FromStr for IpcEventHandle {
    type Err = String;

    /// 128 hex digits (either case).
    fn from_str(s: &str) -> Result<Self, String> {
        if s.len() != 128 {
            return Err(format!(
                "must be 128 hex digits (a 64-byte CUipcEventHandle), got {} characters",
                s.len()
            ));
        }
        let digit = |c: u8| (c as char).to_digit(16);
        let mut out = [0u8; 64];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            match (digit(pair[0]), digit(pair[1])) {
                (Some(hi), Some(lo)) => out[i] = (hi * 16 + lo) as u8,
                _ => return Err(format!("is not hex (at character {})", 2 * i)),
            }
        }
        Ok(IpcEventHandle(out))
    }
}

/// Event handles a sidecar keeps open at most; opening one more destroys the one opened
/// first (a wait already queued on it still waits, as the driver documents for destroy).
pub const MAX_OPEN_EVENTS: usize = 64;

/// Events of other processes opened by CUDA IPC handle on one device, each handle once.
pub struct IpcEvents {
    kernel: Arc<CudaKernel>,
    open: Mutex<OpenEvents>,
}

#[derive(Default)]
struct OpenEvents {
    /// The `CUevent` each handle opened as (an address).
    events: HashMap<IpcEventHandle, usize>,
    /// Handles in the order they were opened.
    order: VecDeque<IpcEventHandle>,
}

impl fmt::Debug for IpcEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcEvents")
            .field("device", &self.kernel.ordinal())
            .finish_non_exhaustive()
    }
}

impl IpcEvents {
    /// None open yet, on the kernel's device.
    pub fn new(kernel: Arc<CudaKernel>) -> Self {
        IpcEvents {
            kernel,
            open: Mutex::default(),
        }
    }

    /// Follows the other process's event `handle` names, opened on first use
    /// ([`CudaKernel::follow`]): an event of the kernel's own that completes when the latest
    /// record of the engine's event at the time of this call does. A handle the driver
    /// refuses (a dead exporter, a destroyed event, bytes that are no handle) is
    /// [`CudaError::EventHandle`].
    pub fn follow(&self, handle: &IpcEventHandle) -> Result<ReadyEvent, CudaError> {
        // Held while following, so that no other call destroys the event meanwhile. A panic
        // while holding it leaves the map and the order consistent (each updated in one step).
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let event = match open.events.get(handle) {
            Some(&event) => event,
            None => {
                let event = self.open_handle(handle)?;
                if open.order.len() >= MAX_OPEN_EVENTS
                    && let Some(first) = open.order.pop_front()
                    && let Some(old) = open.events.remove(&first)
                {
                    self.destroy(old);
                }
                open.events.insert(*handle, event);
                open.order.push_back(*handle);
                event
            }
        };
        // SAFETY: an event opened in this device's primary context by `open_handle`, live
        // until this value destroys it, which needs the lock held here.
        unsafe { self.kernel.follow(event as u64) }
    }

    fn open_handle(&self, handle: &IpcEventHandle) -> Result<usize, CudaError> {
        self.kernel.bind()?;
        let raw = sys::CUipcEventHandle {
            reserved: handle.0.map(|b| b as core::ffi::c_char),
        };
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a 64-byte handle by value; the driver validates it.
        unsafe { sys::cuIpcOpenEventHandle(&mut event, raw) }
            .result()
            .map_err(|e| CudaError::EventHandle {
                message: e.to_string(),
            })?;
        if event.is_null() {
            return Err(CudaError::EventHandle {
                message: "the driver opened it as a null CUevent".to_owned(),
            });
        }
        Ok(event as usize)
    }

    fn destroy(&self, event: usize) {
        // SAFETY: an event `open_handle` opened, destroyed once (it left the map); work that
        // waits on it still waits, as the driver documents.
        let destroyed = self
            .kernel
            .bind()
            .map(|()| unsafe { sys::cuEventDestroy_v2(event as sys::CUevent) });
        if !matches!(destroyed, Ok(sys::CUresult::CUDA_SUCCESS)) {
            tracing::warn!("destroying an opened CUDA IPC event failed");
        }
    }
}

impl Drop for IpcEvents {
    fn drop(&mut self) {
        let open = std::mem::take(self.open.get_mut().unwrap_or_else(|e| e.into_inner()));
        for event in open.events.into_values() {
            self.destroy(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_128_hex_digits() {
        let text: String = (0..64u8).map(|b| format!("{b:02X}")).collect();
        let handle: IpcEventHandle = text.parse().expect("hex");
        assert_eq!(handle.0[10], 10);
        assert_eq!(handle.to_string(), text.to_lowercase());
        let short = "ab".repeat(63);
        assert!(
            short
                .parse::<IpcEventHandle>()
                .unwrap_err()
                .contains("128 hex digits")
        );
        let bad = format!("zz{}", "00".repeat(63));
        assert!(
            bad.parse::<IpcEventHandle>()
                .unwrap_err()
                .contains("not hex")
        );
        // Multi-byte characters are not hex digits (and never split a char boundary).
        let wide = format!("é{}", "0".repeat(126));
        assert_eq!(wide.len(), 128);
        assert!(wide.parse::<IpcEventHandle>().is_err());
    }
}
