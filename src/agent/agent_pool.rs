//! The memory an agent serves, with the kernel that moves its bytes: a host pool (the CPU
//! kernel) or a device pool (the CUDA kernel).
//!
//! The data path asks it for the three things it does to pool memory: gather a selection into
//! a chunk's host buffer, scatter a chunk's host bytes into a selection, and hash a selection in
//! place. A device pool gathers on the device into device staging and copies the result to the
//! host buffer once (one D2H), and scatters after one H2D into device staging, where the
//! transport sends host memory ([`StagingMode::PinnedHost`]). Where it sends device memory
//! ([`StagingMode::Device`]) the chunk stays in device staging ([`DeviceChunk`]): gathered into it,
//! sent and received by the transport, scattered from it. A selection that is a few whole
//! contiguous ranges of the pool skips the kernel: it is copied straight between the pool and
//! the host buffer. The transport reads and writes a pool itself (sends from the pool, placed
//! receives) where it is one range and the transport moves its memory (`AgentPool::direct`);
//! only host pools are mapped by peers, written from by one-sided puts, or sent from in
//! pieces without a gather (`AgentPool::host`).

use std::sync::{Arc, Mutex};

use crate::kernel::cpu::CpuKernel;
use crate::kernel::cuda::{
    CudaError, CudaKernel, DevicePool, DeviceStaging, IpcEventHandle, IpcEvents, ReadyEvent,
};
use crate::kernel::{KernelError, Selection};
use crate::layout::{KvLayout, PageOrder};
use crate::memory::MemoryKind;
use crate::pool::HostPool;
use crate::transport::PoolMemory;

use super::staging::StagingMode;

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
        /// scattered, or, with [`StagingMode::Device`], while the transport sends or receives it).
        staging: Arc<Mutex<Vec<DeviceStaging>>>,
        /// Where chunks wait for the transport: decided once at start ([`AgentPool::staged`]).
        mode: StagingMode,
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
                    mode: StagingMode::PinnedHost,
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

    /// The pool as one range that the transport reads and writes itself (the direct ways:
    /// sends from the pool, placed receives, registration for peers): a contiguous host pool,
    /// or a device pool a transport may register ([`DevicePool::registrable`]) where it moves
    /// device memory ([`StagingMode::Device`]). Only a host pool is also mapped by peers or
    /// written from by one-sided puts.
    pub(crate) fn direct(&self) -> Option<PoolMemory> {
        match self {
            AgentPool::Host { pool, .. } => {
                pool.contiguous().then(|| PoolMemory::Host(pool.clone()))
            }
            AgentPool::Device { pool, mode, .. } => (pool.registrable()
                && *mode == StagingMode::Device)
                .then(|| PoolMemory::Device(pool.clone())),
        }
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
            AgentPool::Host { .. } => ("host", StagingMode::Host.label()),
            AgentPool::Device { mode, .. } => ("device", mode.label()),
        }
    }

    /// Where chunks are staged for the transport.
    pub(crate) fn staging(&self) -> StagingMode {
        match self {
            AgentPool::Host { .. } => StagingMode::Host,
            AgentPool::Device { mode, .. } => *mode,
        }
    }

    /// The pool with chunks staged as `mode` says (a device pool's choice; a host pool stages
    /// on the host whatever it is told).
    pub(crate) fn staged(mut self, to: StagingMode) -> Self {
        if let AgentPool::Device { mode, .. } = &mut self {
            *mode = to;
        }
        self
    }

    /// Gathers the selection into device staging, for a transport that sends device memory
    /// ([`StagingMode::Device`]): one launch; no copy to the host.
    pub(crate) fn gather_device(
        &self,
        sel: &Selection<'_>,
        wire: PageOrder,
    ) -> Result<DeviceChunk, KernelError> {
        let AgentPool::Device {
            pool,
            kernel,
            staging,
            ..
        } = self
        else {
            return Err(KernelError::Unsupported(
                "device staging of a host pool".into(),
            ));
        };
        let mut buf = take(kernel, staging, sel.bytes_in(pool.layout(), wire)?)?;
        kernel.gather(pool, sel, wire, &mut buf)?;
        Ok(DeviceChunk::new(buf, staging.clone()))
    }

    /// Where a transport that sends device memory lands received payloads: device staging of
    /// this pool's device, returned for reuse when the payload is dropped. `None` for a host
    /// pool.
    pub(crate) fn device_sink(&self) -> Option<Arc<dyn crate::transport::DeviceSink>> {
        match self {
            AgentPool::Host { .. } => None,
            AgentPool::Device {
                kernel, staging, ..
            } => Some(Arc::new(DeviceSink {
                kernel: kernel.clone(),
                staging: staging.clone(),
            })),
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

    /// Copies the selection into `out` (host memory), in `wire` order.
    pub(crate) fn gather(
        &self,
        sel: &Selection<'_>,
        wire: PageOrder,
        out: &mut [u8],
    ) -> Result<(), KernelError> {
        match self {
            AgentPool::Host { pool, kernel } => kernel.gather(pool, sel, wire, out),
            AgentPool::Device {
                pool,
                kernel,
                staging,
                ..
            } => {
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

    /// Copies a received payload into the selection: host bytes as [`AgentPool::scatter`]
    /// does, device staging (a [`DeviceChunk`] of this pool's, [`StagingMode::Device`]) with one
    /// launch straight from it.
    pub(crate) fn scatter_payload(
        &self,
        payload: &crate::transport::Payload,
        wire: PageOrder,
        sel: &Selection<'_>,
    ) -> Result<(), KernelError> {
        use crate::transport::Payload;
        let device = match payload {
            Payload::Host(bytes) => return self.scatter(bytes, wire, sel),
            Payload::Pieces(pieces) => {
                let pieces: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
                return match self {
                    AgentPool::Host { pool, kernel } => {
                        kernel.scatter_pieces(&pieces, wire, pool, sel)
                    }
                    // A device pool lands host bytes through one staging buffer.
                    AgentPool::Device { .. } => self.scatter(&pieces.concat(), wire, sel),
                };
            }
            Payload::Device(device) => device,
        };
        let chunk = device.as_any().downcast_ref::<DeviceChunk>();
        match (self, chunk) {
            (AgentPool::Device { pool, kernel, .. }, Some(chunk)) => {
                let buf = chunk.staging()?;
                Ok(kernel.scatter(buf, wire, pool, sel)?)
            }
            _ => Err(KernelError::Unsupported(
                "a device payload that is not this pool's device staging".into(),
            )),
        }
    }

    /// The wire checksum of a received payload: of host bytes as they are; of device staging
    /// through a copy to the host (one D2H: an agent that checksums stages on the host,
    /// `staging::choose`, so this is only a payload a peer sent from its device).
    pub(crate) fn payload_checksum(
        &self,
        payload: &crate::transport::Payload,
    ) -> Result<u64, KernelError> {
        use crate::transport::Payload;
        match payload {
            Payload::Host(bytes) => Ok(super::checksum(bytes)),
            Payload::Pieces(pieces) => {
                let mut hasher = xxhash_rust::xxh3::Xxh3::new();
                pieces.iter().for_each(|p| hasher.update(p));
                Ok(super::checksum_digest(hasher.digest()))
            }
            Payload::Device(device) => match device.as_any().downcast_ref::<DeviceChunk>() {
                Some(chunk) => Ok(super::checksum(&chunk.to_host()?)),
                None => Err(KernelError::Unsupported(
                    "a device payload that is not this pool's device staging".into(),
                )),
            },
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
                let mut bytes = vec![0u8; sel.bytes_in(self.layout(), wire)?];
                self.gather(sel, wire, &mut bytes)?;
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

/// A chunk in device staging ([`StagingMode::Device`]): gathered there by a prefill, or received
/// there by a decode. The staging returns for reuse when the last holder (the transport, the
/// scatter) drops it.
pub(crate) struct DeviceChunk {
    buf: Option<DeviceStaging>,
    ptr: u64,
    len: usize,
    free: Arc<Mutex<Vec<DeviceStaging>>>,
}

impl DeviceChunk {
    fn new(buf: DeviceStaging, free: Arc<Mutex<Vec<DeviceStaging>>>) -> Self {
        DeviceChunk {
            ptr: buf.device_ptr(),
            len: crate::kernel::cuda::Staging::len(&buf),
            buf: Some(buf),
            free,
        }
    }

    fn staging(&self) -> Result<&DeviceStaging, KernelError> {
        self.buf
            .as_ref()
            .ok_or_else(|| KernelError::Unsupported("device staging already returned".into()))
    }

    /// The chunk's bytes copied to host memory (one D2H).
    pub(crate) fn to_host(&self) -> Result<Vec<u8>, KernelError> {
        Ok(self.staging()?.to_host()?)
    }
}

impl Drop for DeviceChunk {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            keep(&self.free, buf);
        }
    }
}

// SAFETY: the range is the staging's own device allocation, which this value owns until it
// drops (then it returns to the free list, and is reused only by a later chunk); the gather
// that fills it synchronizes before the chunk is made, and a received chunk is written only by
// the transport that received it, before the scatter reads it.
#[allow(unsafe_code)]
unsafe impl crate::transport::DeviceBytes for DeviceChunk {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Device staging for a decode's received payloads ([`AgentPool::device_sink`]).
struct DeviceSink {
    kernel: Arc<CudaKernel>,
    staging: Arc<Mutex<Vec<DeviceStaging>>>,
}

impl crate::transport::DeviceSink for DeviceSink {
    fn take(&self, len: usize) -> Result<Arc<dyn crate::transport::DeviceBytes>, String> {
        let buf = take(&self.kernel, &self.staging, len).map_err(|e| e.to_string())?;
        Ok(Arc::new(DeviceChunk::new(buf, self.staging.clone())))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ModelSpec;
    use crate::transport::Payload;

    /// Whether a CUDA driver and NVRTC are there (the emulator in scripts/test); without them
    /// the test says so and passes, unless `KVFERRY_REQUIRE_GPU=1`.
    fn gpu_or_skip() -> bool {
        let (driver, nvrtc) = (
            crate::kernel::cuda::driver_present(),
            crate::kernel::cuda::nvrtc_present(),
        );
        if driver && nvrtc {
            return true;
        }
        assert!(
            std::env::var("KVFERRY_REQUIRE_GPU").as_deref() != Ok("1"),
            "KVFERRY_REQUIRE_GPU=1 but CUDA driver: {driver}, NVRTC: {nvrtc}"
        );
        println!("skipped: CUDA driver loadable: {driver}, NVRTC loadable: {nvrtc}");
        false
    }

    /// The device staging path of `StagingMode::Device` as far as it runs without a transport
    /// that sends device memory: a prefill's gather into device staging, a decode's device
    /// staging from its sink, the scatter from it, the checksum through the host, and the
    /// staging's return for reuse. The transport's part (UCX reading one device buffer and
    /// writing the other) is stood in for by a copy through the host, outside the path.
    #[test]
    fn device_staging_gathers_into_and_scatters_from_device_memory() {
        if !gpu_or_skip() {
            return;
        }
        let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
        let (pages, wire) = (16, PageOrder::TokenMajor);
        let kernel = CudaKernel::shared(0).unwrap();
        let src = DevicePool::new(&kernel, layout.clone(), pages).unwrap();
        let fill: Vec<u8> = (0..src.size()).map(|i| (i * 7 % 251) as u8).collect();
        src.write(0, &fill).unwrap();
        let dst = DevicePool::new(&kernel, layout.clone(), pages).unwrap();
        dst.fill(0xDE).unwrap();
        let src = AgentPool::new(src.into(), 1)
            .unwrap()
            .staged(StagingMode::Device);
        let dst = AgentPool::new(dst.into(), 1)
            .unwrap()
            .staged(StagingMode::Device);
        assert_eq!(dst.labels(), ("device", "device"));
        let whole = |pages| Selection {
            pages,
            tokens: 0..40,
            layers: 0..layout.num_layers(),
            heads: 0..layout.num_heads(),
        };
        let (from, to) = ([3u32, 11, 6], [9u32, 0, 14]);
        let chunk = src.gather_device(&whole(&from), wire).unwrap();
        let mut want = vec![0u8; chunk.len];
        src.gather(&whole(&from), wire, &mut want).unwrap();
        assert_ne!(chunk.ptr, 0);
        // The transport's part, stood in for.
        let sink = dst.device_sink().expect("a device pool has a sink");
        let landed = sink.take(chunk.len).unwrap();
        assert_eq!(landed.len(), chunk.len);
        let AgentPool::Device { staging, .. } = &dst else {
            unreachable!("a device pool")
        };
        drop(landed);
        assert_eq!(
            staging.lock().unwrap().len(),
            1,
            "the sink's staging came back"
        );
        let mut buf = take(&kernel, staging, chunk.len).unwrap();
        buf.copy_from_host(&chunk.to_host().unwrap()).unwrap();
        let payload = Payload::Device(Arc::new(DeviceChunk::new(buf, staging.clone())));
        assert_eq!(
            dst.payload_checksum(&payload).unwrap(),
            super::super::checksum(&want)
        );
        dst.scatter_payload(&payload, wire, &whole(&to)).unwrap();
        drop(payload);
        assert_eq!(
            staging.lock().unwrap().len(),
            1,
            "the payload's staging came back"
        );
        let mut got = vec![0u8; want.len()];
        dst.gather(&whole(&to), wire, &mut got).unwrap();
        assert!(got == want, "the scattered bytes are the gathered ones");
        // Another pool's device payload, or device staging of a host pool, is refused.
        assert!(matches!(
            src.scatter_payload(&Payload::Device(Arc::new(Foreign)), wire, &whole(&from)),
            Err(KernelError::Unsupported(_))
        ));
        drop(chunk);
    }

    /// Device memory that is not an agent's staging.
    struct Foreign;

    // SAFETY: never handed to a transport; the pool refuses it before any copy.
    #[allow(unsafe_code)]
    unsafe impl crate::transport::DeviceBytes for Foreign {
        fn device_ptr(&self) -> u64 {
            0
        }
        fn len(&self) -> usize {
            0
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }
}
