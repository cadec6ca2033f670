//! Memory that a worker registers for peers to put into: the [`RegisterableMemory`] contract,
//! implemented by the KV pools ([`HostPool`], [`DevicePool`]), by [`Region`], a standalone page-aligned
//! buffer (staging, tests), and by `OnDevice`, device memory the data plane sends from and
//! receives into.
//!
//! Invariant: registered memory is never handed out as a Rust reference, because a peer may
//! write it at any time; bytes move in and out by raw copies ([`Region::read`] /
//! [`Region::write`], as the pool does).
#![allow(unsafe_code)]

use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

use super::memory_type::MemoryType;
use crate::kernel::cuda::DevicePool;
use crate::pool::HostPool;
use crate::transport::{DeviceBytes, PoolMemory};

/// Memory at a fixed address that a worker may register for remote writes, send from and
/// receive into.
///
/// # Safety
/// Implementors guarantee that `base()..base() + size()` is allocated, writable (by UCX: host
/// memory mapped in this process, or CUDA device memory of a context current where UCX uses
/// it, as [`RegisterableMemory::memory_type`] says), at the same address and never exposed as
/// `&`/`&mut` references for as long as the value lives (the worker keeps the value alive,
/// through an `Arc`, for as long as it is registered or an operation uses it).
pub unsafe trait RegisterableMemory: Send + Sync + 'static {
    /// First byte.
    fn base(&self) -> *mut u8;
    /// Bytes.
    fn size(&self) -> usize;
    /// Where the bytes are: host memory (the default) or CUDA device memory, which host code
    /// never dereferences and UCX moves only where its context handles CUDA memory
    /// ([`super::memory_type::MemoryTypes::sends_device_memory`]).
    fn memory_type(&self) -> MemoryType {
        MemoryType::Host
    }
}

// SAFETY: a HostPool's mapping is fixed for its lifetime and the pool never hands out
// references into it (src/pool/mod.rs invariant).
unsafe impl RegisterableMemory for HostPool {
    fn base(&self) -> *mut u8 {
        self.base_ptr()
    }
    fn size(&self) -> usize {
        HostPool::size(self)
    }
}

// SAFETY: a DevicePool's memory is fixed for its lifetime, device memory that host code never
// dereferences (the memory type says CUDA: UCX reaches it through its CUDA transports only).
unsafe impl RegisterableMemory for DevicePool {
    fn base(&self) -> *mut u8 {
        self.device_ptr() as usize as *mut u8
    }
    fn size(&self) -> usize {
        DevicePool::size(self)
    }
    fn memory_type(&self) -> MemoryType {
        MemoryType::Cuda
    }
}

/// The pool as memory a worker sends from, receives into and registers.
pub(super) fn of_pool(pool: PoolMemory) -> Arc<dyn RegisterableMemory> {
    match pool {
        PoolMemory::Host(pool) => pool,
        PoolMemory::Device(pool) => pool,
    }
}

/// An anonymous, page-aligned, zero-filled buffer for registration.
#[derive(Debug)]
pub struct Region {
    mem: MmapRaw,
}

/// A range outside a [`Region`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("range {offset}+{len} is outside the region of {size} bytes")]
pub struct OutOfRegion {
    /// Start of the range.
    pub offset: usize,
    /// Bytes of the range.
    pub len: usize,
    /// Bytes of the region.
    pub size: usize,
}

impl Region {
    /// A region of `size` bytes (at least 1), faulted in.
    pub fn new(size: usize) -> std::io::Result<Region> {
        let mem: MmapRaw = MmapOptions::new().len(size.max(1)).map_anon()?.into();
        // SAFETY: writes exactly the fresh mapping's bytes; nothing else references it yet.
        unsafe { std::ptr::write_bytes(mem.as_mut_ptr(), 0, mem.len()) };
        Ok(Region { mem })
    }

    /// Bytes of the region.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Never true (a region has at least one byte); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.mem.len() == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), OutOfRegion> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(OutOfRegion {
                offset,
                len,
                size: self.len(),
            }),
        }
    }

    /// Copies `len` bytes at `offset` out.
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, OutOfRegion> {
        self.check(offset, len)?;
        let mut out = Vec::with_capacity(len);
        // SAFETY: offset..offset+len lies inside the mapping (checked); `out` is a distinct
        // allocation with capacity len, and exactly len bytes are initialised before set_len.
        unsafe {
            std::ptr::copy_nonoverlapping(self.mem.as_ptr().add(offset), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        Ok(out)
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), OutOfRegion> {
        self.check(offset, data.len())?;
        // SAFETY: the destination lies inside the mapping (checked); `data` cannot alias it
        // because the region never hands out references into its memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.mem.as_mut_ptr().add(offset),
                data.len(),
            )
        };
        Ok(())
    }

    /// Sets every byte to `byte` (tests poison destinations with 0xDE).
    pub fn fill(&self, byte: u8) {
        // SAFETY: writes exactly the mapping's bytes.
        unsafe { std::ptr::write_bytes(self.mem.as_mut_ptr(), byte, self.len()) };
    }
}

// SAFETY: the mapping is fixed until drop and Region never hands out references into it.
unsafe impl RegisterableMemory for Region {
    fn base(&self) -> *mut u8 {
        self.mem.as_mut_ptr()
    }
    fn size(&self) -> usize {
        self.len()
    }
}

/// Device memory as UCX sees it: a payload of
/// [`DataSender::send_device`](crate::transport::DataSender::send_device) or a buffer of the
/// receiver's [`DeviceSink`](crate::transport::DeviceSink), registered and moved as
/// `UCS_MEMORY_TYPE_CUDA`.
pub(super) struct OnDevice(pub(super) Arc<dyn DeviceBytes>);

// SAFETY: `DeviceBytes` guarantees the device range stays allocated, unused by anything else
// and never referenced by host code while the value lives; UCX reaches it only through its
// CUDA transports (the memory type says CUDA), and the Arc keeps it alive for as long as the
// progress thread holds this value.
unsafe impl RegisterableMemory for OnDevice {
    fn base(&self) -> *mut u8 {
        self.0.device_ptr() as usize as *mut u8
    }
    fn size(&self) -> usize {
        self.0.len()
    }
    fn memory_type(&self) -> MemoryType {
        MemoryType::Cuda
    }
}
