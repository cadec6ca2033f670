//! The memory an agent serves, with the kernel that moves its bytes: a host pool (the CPU
//! kernel) or a device pool (the CUDA kernel).
//!
//! The data path asks it for the three things it does to pool memory: gather a selection into
//! a chunk's host buffer, scatter a chunk's host bytes into a selection, and hash a selection in
//! place. A device pool gathers on the device into device staging and copies the result to the
//! host buffer once (one D2H), and scatters after one H2D into device staging: the transports
//! send host memory. A selection that is a few whole contiguous ranges of the pool skips the
//! kernel: it is copied straight between the pool and the host buffer. Only host pools are read or written by the transports themselves (direct
//! writes, sends from the pool, placed receives): `AgentPool::host`.

use std::sync::{Arc, Mutex};

use crate::kernel::cpu::CpuKernel;
use crate::kernel::cuda::{
    CudaError, CudaKernel, DevicePool, DeviceStaging, IpcEventHandle, IpcEvents, ReadyEvent,
};
use crate::kernel::{KernelError, Selection};
use crate::layout::{KvLayout, PageOrder};
use crate::memory::MemoryKind;
use crate::pool::HostPool;

/// What an agent is started on: a host pool or a device pool.
#[derive(Debug)]
pub enum EnginePool {
    /// Host memory.
    Host(HostPool),
    /// Device memory.
    Device(DevicePool),
}

impl From<HostPool> for EnginePool {
    fn from(pool: HostPool) -> Self {
        EnginePool::Host(pool)
    }
}

impl From<DevicePool> for EnginePool {
    fn from(pool: DevicePool) -> Self {
        EnginePool::Device(pool)
    }
}

/// An agent's pool and its kernel; clones share both.
#[derive(Clone, Debug)]
pub(crate) enum AgentPool {
    Host {
        pool: Arc<HostPool>,
        kernel: CpuKernel,
    },
    Device {
        pool: Arc<DevicePool>,
        kernel: Arc<CudaKernel>,
        /// Device staging buffers free for reuse (a chunk takes one while it is gathered or
        /// scattered).
        staging: Arc<Mutex<Vec<DeviceStaging>>>,
        /// The engine's interprocess events this agent opened (a sidecar's readiness events),
        /// destroyed with the last clone.
        events: Arc<IpcEvents>,
    },
}

/// Device staging kept for reuse at most; more chunks at once allocate and free their own.
const KEPT_STAGING: usize = 8;

/// A device selection of at most this many contiguous ranges moves by plain copies between
/// the pool and the host buffer: no launch, no device staging.
const PLAIN_COPIES: usize = 8;

impl AgentPool {
    /// The pool with its kernel: `copy_threads` for the CPU kernel; a device pool's kernel is
    /// its device's shared one.
    pub(crate) fn new(pool: EnginePool, copy_threads: usize) -> Result<Self, KernelError> {
        Ok(match pool {
            EnginePool::Host(pool) => AgentPool::Host {
                pool: Arc::new(pool),
                kernel: CpuKernel::new(copy_threads),
            },
            EnginePool::Device(pool) => {
                let kernel = CudaKernel::shared(pool.ordinal())?;
                AgentPool::Device {
                    events: Arc::new(IpcEvents::new(kernel.clone())),
                    kernel,
                    pool: Arc::new(pool),
                    staging: Arc::default(),
                }
            }
        })
    }

    pub(crate) fn layout(&self) -> &KvLayout {
        match self {
            AgentPool::Host { pool, .. } => pool.layout(),
            AgentPool::Device { pool, .. } => pool.layout(),
        }
    }

    pub(crate) fn num_pages(&self) -> usize {
        match self {
            AgentPool::Host { pool, .. } => pool.num_pages(),
            AgentPool::Device { pool, .. } => pool.num_pages(),
        }
    }

    /// Where the pool's memory is.
    pub(crate) fn kind(&self) -> MemoryKind {
        match self {
            AgentPool::Host { .. } => MemoryKind::Host,
            AgentPool::Device { pool, .. } => MemoryKind::Device {
                ordinal: pool.ordinal(),
            },
        }
    }

    /// The host pool, which transports may read and write themselves; `None` for device pools.
    pub(crate) fn host(&self) -> Option<&Arc<HostPool>> {
        match self {
            AgentPool::Host { pool, .. } => Some(pool),
            AgentPool::Device { .. } => None,
        }
    }

    /// Whether the pool is one range of host memory (direct writes and sends from the pool
    /// need that).
    pub(crate) fn contiguous(&self) -> bool {
        self.host().is_some_and(|p| p.contiguous())
    }

    /// The pool for the buffers chunks are gathered into: pinned for a device pool.
    pub(crate) fn slots(&self) -> super::staging::SlotPool {
        match self {
            AgentPool::Host { .. } => super::staging::SlotPool::default(),
            AgentPool::Device { kernel, .. } => {
                super::staging::SlotPool::pinned(Arc::new(DevicePinner(kernel.clone())))
            }
        }
    }

    /// What `/metrics` says of the pool (`kvferry_pool_info`): where its memory is, and where
    /// its chunks are staged for the transport.
    pub(crate) fn labels(&self) -> (&'static str, &'static str) {
        match self {
            AgentPool::Host { .. } => ("host", "host"),
            AgentPool::Device { .. } => ("device", "pinned_host"),
        }
    }

    /// The CUDA device of a device pool.
    pub(crate) fn device(&self) -> Option<usize> {
        match self {
            AgentPool::Host { .. } => None,
            AgentPool::Device { pool, .. } => Some(pool.ordinal()),
        }
    }

    /// Follows another process's CUDA event by its IPC handle (opened once per handle value):
    /// [`IpcEvents::follow`]. `None` for a host pool.
    pub(crate) fn follow_ipc(
        &self,
        handle: &IpcEventHandle,
    ) -> Option<Result<ReadyEvent, CudaError>> {
        match self {
            AgentPool::Host { .. } => None,
            AgentPool::Device { events, .. } => Some(events.follow(handle)),
        }
    }

    /// Copies the selection into `out` (host memory), in `wire` order; on a device pool, after
    /// `ready` completes.
    pub(crate) fn gather(
        &self,
        sel: &Selection<'_>,
        wire: PageOrder,
        out: &mut [u8],
        ready: Option<&ReadyEvent>,
    ) -> Result<(), KernelError> {
        match self {
            AgentPool::Host { pool, kernel } => kernel.gather(pool, sel, wire, out),
            AgentPool::Device {
                pool,
                kernel,
                staging,
                ..
            } => {
                if let Some(ready) = ready {
                    kernel.wait_for(ready)?;
                }
                if let Some(spans) = pool.spans(sel, wire, PLAIN_COPIES, false)? {
                    return Ok(pool.read_spans(&spans, out)?);
                }
                let mut buf = take(kernel, staging, out.len())?;
                kernel.gather(pool, sel, wire, &mut buf)?;
                buf.copy_to_host(out)?;
                keep(staging, buf);
                Ok(())
            }
        }
    }

    /// Copies `input` (host memory, in `wire` order) into the selection.
    pub(crate) fn scatter(
        &self,
        input: &[u8],
        wire: PageOrder,
        sel: &Selection<'_>,
    ) -> Result<(), KernelError> {
        match self {
            AgentPool::Host { pool, kernel } => kernel.scatter(input, wire, pool, sel),
            AgentPool::Device {
                pool,
                kernel,
                staging,
                ..
            } => {
                if let Some(spans) = pool.spans(sel, wire, PLAIN_COPIES, true)? {
                    return Ok(pool.write_spans(&spans, input)?);
                }
                let mut buf = take(kernel, staging, input.len())?;
                buf.copy_from_host(input)?;
                kernel.scatter(&buf, wire, pool, sel)?;
                keep(staging, buf);
                Ok(())
            }
        }
    }

    /// The xxh3-64 of the selection's bytes in `wire` order, read in place (a device pool's are
    /// gathered to the host first).
    pub(crate) fn checksum(
        &self,
        sel: &Selection<'_>,
        wire: PageOrder,
    ) -> Result<u64, KernelError> {
        match self {
            AgentPool::Host { pool, kernel } => kernel.checksum(pool, sel, wire),
            AgentPool::Device { .. } => {
                let mut bytes = vec![0u8; sel.bytes_in(self.layout())?];
                self.gather(sel, wire, &mut bytes, None)?;
                Ok(xxhash_rust::xxh3::xxh3_64(&bytes))
            }
        }
    }
}

/// Pins a device pool's chunk buffers ([`super::staging::SlotPool::pinned`]).
#[derive(Debug)]
struct DevicePinner(Arc<CudaKernel>);

impl super::staging::Pinner for DevicePinner {
    fn pin(&self, addr: usize, len: usize) -> Result<(), String> {
        // SAFETY: the slot pool unpins every buffer it pinned before freeing it.
        #[allow(unsafe_code)]
        let pinned = unsafe { self.0.pin(addr, len) };
        pinned.map_err(|e| e.to_string())
    }

    fn unpin(&self, addr: usize) {
        if let Err(e) = self.0.unpin(addr) {
            tracing::warn!(error = %e, "unpinning a staging slot failed");
        }
    }
}

/// A device staging buffer of `len` bytes: a kept one that is large enough, or a new one.
fn take(
    kernel: &CudaKernel,
    free: &Mutex<Vec<DeviceStaging>>,
    len: usize,
) -> Result<DeviceStaging, KernelError> {
    let kept = {
        let mut free = free.lock().unwrap_or_else(|e| e.into_inner());
        let fit = free.iter().position(|s| s.capacity() >= len);
        fit.map(|i| free.swap_remove(i))
    };
    let mut buf = match kept {
        Some(buf) => buf,
        None => DeviceStaging::new(kernel, len)?,
    };
    buf.set_len(len)?;
    Ok(buf)
}

/// Keeps `buf` for reuse, up to [`KEPT_STAGING`] buffers.
fn keep(free: &Mutex<Vec<DeviceStaging>>, buf: DeviceStaging) {
    let mut free = free.lock().unwrap_or_else(|e| e.into_inner());
    if free.len() < KEPT_STAGING {
        free.push(buf);
    }
}
