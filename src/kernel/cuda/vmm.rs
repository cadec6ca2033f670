//! Device memory another process shares by VMM handles (`cuMemExportToShareableHandle` with
//! POSIX file descriptors): allocations made with the virtual memory management API, such as
//! PyTorch's expandable segments, which CUDA IPC handles cannot name.
//!
//! The engine serves a Unix socket (`--pool cuda-vmm:<device>:<socket path>`). An agent that
//! connects receives the pool's pieces, one message each: 16 bytes (the piece's offset in the
//! pool and its length, little-endian u64s) with the piece's file descriptor attached
//! (`SCM_RIGHTS`), then a message of 16 zero bytes. The agent imports each piece, maps them
//! back to back at their offsets in an address range of its own, and grants itself access; the
//! pool is that range. Unmapped and released when the pool drops.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use cudarc::driver::sys;

use super::{CudaError, CudaKernel};
use crate::fd_passing::{receive, send};

/// One piece of a pool as the engine sends it.
#[derive(Debug)]
pub struct Piece {
    /// Offset in the pool.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The exported handle.
    pub fd: OwnedFd,
}

/// Pieces an agent takes at most from one engine.
pub const MAX_PIECES: usize = 65_536;

fn vmm_error(op: &'static str) -> impl Fn(sys::CUresult) -> CudaError {
    move |r| CudaError::Driver {
        op,
        message: format!("{r:?}"),
    }
}

fn regions_error(reason: impl Into<String>) -> CudaError {
    CudaError::Regions(reason.into())
}

/// Receives the pool's pieces from the engine's socket at `path`, each read bounded by
/// `timeout`.
pub fn receive_pieces(path: &Path, timeout: Duration) -> Result<Vec<Piece>, CudaError> {
    let socket = UnixStream::connect(path)
        .map_err(|e| regions_error(format!("connecting to {}: {e}", path.display())))?;
    socket
        .set_read_timeout(Some(timeout))
        .map_err(|e| regions_error(e.to_string()))?;
    receive_pieces_from(&socket).map_err(|e| regions_error(format!("{}: {e}", path.display())))
}

/// Receives pieces from a connected socket, until the end message.
pub fn receive_pieces_from(socket: &UnixStream) -> Result<Vec<Piece>, CudaError> {
    let mut pieces = Vec::new();
    loop {
        let (header, fd) =
            receive(socket).map_err(|e| regions_error(format!("reading pieces: {e}")))?;
        let offset = u64::from_le_bytes(header[..8].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(header[8..].try_into().unwrap_or_default());
        match (len, fd) {
            (0, None) => return Ok(pieces),
            (0, Some(_)) => return Err(regions_error("an empty piece with a descriptor")),
            (_, None) => {
                return Err(regions_error(format!(
                    "the piece at {offset} came without a descriptor"
                )));
            }
            (_, Some(fd)) if pieces.len() < MAX_PIECES => pieces.push(Piece { offset, len, fd }),
            _ => return Err(regions_error(format!("more than {MAX_PIECES} pieces"))),
        }
    }
}

/// The engine's side: sends a pool's pieces `(offset, len, fd)` to an agent connected to its
/// socket, then the end.
pub fn send_pieces(socket: &UnixStream, pieces: &[(u64, u64, RawFd)]) -> std::io::Result<()> {
    for &(offset, len, fd) in pieces {
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(&offset.to_le_bytes());
        header[8..].copy_from_slice(&len.to_le_bytes());
        send(socket, &header, Some(fd))?;
    }
    send(socket, &[0u8; 16], None)
}

/// The pieces imported and mapped back to back in an address range of this process.
#[derive(Debug)]
pub(super) struct Mapped {
    pub(super) base: u64,
    pub(super) len: usize,
    handles: Vec<(u64, u64, u64)>,
    /// Made current to release them, whatever the thread.
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl Mapped {
    /// Imports `pieces`, which must tile `[0, len)` without gaps or overlaps on granularity
    /// boundaries, and maps them with read and write access for the kernel's device.
    pub(super) fn map(kernel: &CudaKernel, pieces: Vec<Piece>) -> Result<Mapped, CudaError> {
        kernel.bind()?;
        let mut pieces = pieces;
        pieces.sort_by_key(|p| p.offset);
        let mut end = 0u64;
        for p in &pieces {
            if p.offset != end {
                return Err(regions_error(format!(
                    "the pieces leave bytes {end}..{} unnamed or overlap",
                    p.offset
                )));
            }
            end = p
                .offset
                .checked_add(p.len)
                .ok_or_else(|| regions_error("a piece's end overflows"))?;
        }
        if end == 0 {
            return Err(regions_error("the engine sent no pieces"));
        }
        let len = usize::try_from(end).map_err(|_| regions_error("the pool is too large"))?;
        let mut base = 0;
        // SAFETY: a valid out-pointer; no fixed address asked for.
        unsafe { sys::cuMemAddressReserve(&mut base, len, 0, 0, 0) }
            .result()
            .map_err(|e| vmm_error("reserve an address range")(e.0))?;
        let mut mapped = Mapped {
            base,
            len,
            handles: Vec::new(),
            ctx: kernel.context().clone(),
        };
        for p in pieces {
            let mut handle = 0;
            // SAFETY: `fd` is a live descriptor of ours; the driver dups what it keeps.
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    p.fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            }
            .result()
            .map_err(|e| vmm_error("import a shareable handle")(e.0))?;
            // SAFETY: inside our reservation, at a piece boundary; the handle just imported.
            let done =
                unsafe { sys::cuMemMap(base + p.offset, p.len as usize, 0, handle, 0) }.result();
            if let Err(e) = done {
                // SAFETY: our handle, released once.
                let _ = unsafe { sys::cuMemRelease(handle) };
                return Err(vmm_error("map a piece")(e.0));
            }
            mapped.handles.push((handle, base + p.offset, p.len));
        }
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: kernel.ordinal() as i32,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole reservation is mapped; one descriptor.
        unsafe { sys::cuMemSetAccess(base, len, &access, 1) }
            .result()
            .map_err(|e| vmm_error("grant access")(e.0))?;
        Ok(mapped)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!(error = %e, "releasing VMM pieces: no CUDA context");
            return;
        }
        // SAFETY: our mappings, handles and reservation, each released once (the pool's work
        // is waited for by every launch and copy).
        let failed = unsafe {
            let mut results: Vec<sys::CUresult> = Vec::new();
            for &(handle, at, len) in &self.handles {
                results.push(sys::cuMemUnmap(at, len as usize));
                results.push(sys::cuMemRelease(handle));
            }
            results.push(sys::cuMemAddressFree(self.base, self.len));
            results
                .into_iter()
                .find(|r| *r != sys::CUresult::CUDA_SUCCESS)
        };
        if let Some(r) = failed {
            tracing::warn!(result = ?r, "releasing VMM pieces failed");
        }
    }
}
