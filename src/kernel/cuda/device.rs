//! The CUDA transfer kernel (cudarc): its launches, readiness events and staging buffers.
//!
//! A [`CudaKernel`] owns one device's context, a stream and the loaded module, and launches
//! gathers and scatters over a [`DevicePool`](super::DevicePool) (their entry points are in
//! device_pool.rs, next to the pool they validate against). Staging is either pinned host
//! memory mapped into the device's address space ([`PinnedStaging`]: the kernel writes it over
//! the bus, the host reads it with no extra copy) or device memory ([`DeviceStaging`]: full device bandwidth, for
//! GPU-direct transports and for measuring the kernel itself).
//!
//! Gather and scatter are synchronous: validate, upload the page list, one launch, wait. Every
//! driver call's error is returned as [`CudaError::Driver`] naming the operation; nothing here
//! unwraps an FFI result, and sizes are checked before cudarc sees them (its allocation and copy
//! helpers assert on bad sizes).

use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use super::launch::{KvXferParams, LaunchPlan};
use super::{CudaError, GATHER_ENTRY, SCATTER_ENTRY, compile_ptx, driver, driver_present};

// SAFETY: `KvXferParams` is `#[repr(C)]`, made of u64 and u32 fields only (no pointers Rust
// owns, no padding holes the device reads), and mirrors the kernel's by-value parameter.
unsafe impl DeviceRepr for KvXferParams {}

/// The CUDA transfer kernel of one device.
pub struct CudaKernel {
    pub(super) ordinal: usize,
    arch: String,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) gather: CudaFunction,
    pub(super) scatter: CudaFunction,
    _module: Arc<CudaModule>,
}

impl fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKernel")
            .field("ordinal", &self.ordinal)
            .field("arch", &self.arch)
            .finish_non_exhaustive()
    }
}

impl CudaKernel {
    /// Opens device `ordinal` and loads the kernel, compiled by NVRTC for the device's
    /// architecture (cached per architecture). Without libcuda: [`CudaError::DriverMissing`];
    /// without the device: [`CudaError::NoDevice`]; without libnvrtc: [`CudaError::NvrtcMissing`].
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::DriverMissing);
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| match e.0 {
            CUresult::CUDA_ERROR_NO_DEVICE
            | CUresult::CUDA_ERROR_INVALID_DEVICE
            | CUresult::CUDA_ERROR_NOT_INITIALIZED => CudaError::NoDevice {
                ordinal,
                reason: e.to_string(),
            },
            _ => driver("open device")(e),
        })?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("query compute capability"))?;
        let arch = format!("compute_{major}{minor}");
        let ptx = compile_ptx(&arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()))
            .map_err(driver("load module"))?;
        let gather = module
            .load_function(GATHER_ENTRY)
            .map_err(driver("load kv_gather"))?;
        let scatter = module
            .load_function(SCATTER_ENTRY)
            .map_err(driver("load kv_scatter"))?;
        let stream = ctx.new_stream().map_err(driver("create stream"))?;
        Ok(CudaKernel {
            ordinal,
            arch,
            ctx,
            stream,
            gather,
            scatter,
            _module: module,
        })
    }

    /// The process-wide kernel of device `ordinal`, created on first use. A failed creation is
    /// not cached: a later call tries again.
    pub fn shared(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        static KERNELS: Mutex<Vec<Arc<CudaKernel>>> = Mutex::new(Vec::new());
        // The list is only pushed to; a panic elsewhere cannot leave it inconsistent.
        let mut kernels = KERNELS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = kernels.iter().find(|k| k.ordinal == ordinal) {
            return Ok(k.clone());
        }
        let kernel = Arc::new(CudaKernel::new(ordinal)?);
        kernels.push(kernel.clone());
        Ok(kernel)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name, as the driver reports it.
    pub fn device_name(&self) -> Result<String, CudaError> {
        self.ctx.name().map_err(driver("read the device name"))
    }

    /// Waits until all work of the device's context is done.
    pub(super) fn synchronize_context(&self) -> Result<(), DriverError> {
        self.ctx.synchronize()
    }

    /// The virtual architecture the kernel was compiled for, e.g. `compute_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Follows the engine's CUDA event `event` (recorded on the engine's stream once a piece's
    /// KV was written): returns an event of the kernel's own that completes when the engine's
    /// record does ([`ReadyEvent::is_complete`]). Nothing waits here and the engine's stream is
    /// never synchronized; the engine may record or destroy its event again as soon as this
    /// returns. Each follow waits on a stream of its own, destroyed at once (the driver runs
    /// its work first): an engine event that never completes holds nothing but that stream, and
    /// the kernel's launches never wait on the device for an engine.
    ///
    /// The engine's event is a `CUevent` of this process: the engine's own (an in-process
    /// agent), or one opened from the engine's CUDA IPC handle ([`super::IpcEvents`], a
    /// sidecar). Both are followed by this same code.
    ///
    /// # Safety
    /// `event` must be a live `CUevent` of this process (created, or opened by IPC handle) in
    /// this device's primary context.
    pub unsafe fn follow(&self, event: u64) -> Result<ReadyEvent, CudaError> {
        self.bind()?;
        let waits = self.ctx.new_stream().map_err(driver("create a stream"))?;
        // SAFETY: the caller's live event; a stream of ours in the same context.
        unsafe {
            cudarc::driver::sys::cuStreamWaitEvent(
                waits.cu_stream(),
                event as cudarc::driver::sys::CUevent,
                0,
            )
        }
        .result()
        .map_err(driver("wait for the engine's event"))?;
        let own = self
            .ctx
            .new_event(None)
            .map_err(driver("create an event"))?;
        own.record(&waits).map_err(driver("record an event"))?;
        Ok(ReadyEvent {
            event: own,
            ordinal: self.ordinal,
        })
    }

    /// Pins (page-locks and registers with the driver) `len` bytes of host memory at `addr`,
    /// so that copies between it and the device run at the bus's speed.
    ///
    /// # Safety
    /// The memory must stay allocated until [`CudaKernel::unpin`] is called for `addr`.
    pub unsafe fn pin(&self, addr: usize, len: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller's live allocation; the driver checks the range.
        unsafe { cudarc::driver::sys::cuMemHostRegister_v2(addr as *mut _, len, 0) }
            .result()
            .map_err(driver("pin host memory"))
    }

    /// Unpins memory [`CudaKernel::pin`] pinned at `addr`.
    pub fn unpin(&self, addr: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the driver refuses an address it did not register.
        unsafe { cudarc::driver::sys::cuMemHostUnregister(addr as *mut _) }
            .result()
            .map_err(driver("unpin host memory"))
    }

    /// The device's context.
    pub(super) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the device's context current on this thread (for raw driver calls).
    pub(super) fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("make the context current"))
    }

    /// The allocation on this device holding device address `addr`: its base and length.
    pub(super) fn allocation_of(&self, addr: u64) -> Result<(u64, usize), CudaError> {
        self.bind()?;
        let (mut base, mut len) = (0, 0);
        // SAFETY: valid out-pointers; the driver validates the address.
        unsafe { cudarc::driver::sys::cuMemGetAddressRange_v2(&mut base, &mut len, addr) }
            .result()
            .map_err(|e| {
                CudaError::Regions(format!(
                    "{addr:#x} is not device memory of device {}: {e}",
                    self.ordinal
                ))
            })?;
        Ok((base, len))
    }

    pub(super) fn same_device(&self, buffer: usize) -> Result<(), CudaError> {
        if buffer != self.ordinal {
            return Err(CudaError::WrongDevice {
                buffer,
                kernel: self.ordinal,
            });
        }
        Ok(())
    }

    /// One launch of `func` for a plan validated against a pool whose plane table is
    /// `planes`, then waits for it.
    pub(super) fn run(
        &self,
        func: &CudaFunction,
        plan: LaunchPlan<'_>,
        planes: &CudaSlice<u64>,
        staging: u64,
    ) -> Result<(), CudaError> {
        let pages = self
            .stream
            .clone_htod(plan.pages)
            .map_err(driver("upload page list"))?;
        let (pages_addr, pages_guard) = pages.device_ptr(&self.stream);
        let (table_addr, table_guard) = planes.device_ptr(&self.stream);
        let params = KvXferParams {
            planes: table_addr,
            pages: pages_addr,
            staging,
            ..plan.params
        };
        let cfg = LaunchConfig {
            grid_dim: (plan.grid.0, plan.grid.1, 1),
            block_dim: (plan.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(func);
        launch.arg(&params);
        // SAFETY: `launch::plan` validated the selection against the pool's layout and size and
        // the staging length, so every address the kernel forms lies inside the pool (through
        // its plane table, whose entries are the pool's own plane offsets), the uploaded page
        // list or the staging buffer. `params` matches the kernel's single by-value parameter.
        // The page list, the table, the pool and the staging buffer outlive the launch: it is
        // waited for below, before any of them can drop.
        unsafe { launch.launch(cfg) }.map_err(driver("launch"))?;
        self.stream.synchronize().map_err(driver("synchronize"))?;
        drop((pages_guard, table_guard));
        Ok(())
    }
}

/// The point after which a piece's KV is written, as an event of the kernel's own
/// ([`CudaKernel::follow`]).
pub struct ReadyEvent {
    event: cudarc::driver::CudaEvent,
    ordinal: usize,
}

impl ReadyEvent {
    /// The device whose kernel made it.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Whether the engine's writes behind it ran (`cuEventQuery`; never waits). An error is
    /// the driver's, e.g. a fault of earlier work.
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        self.event
            .context()
            .bind_to_thread()
            .map_err(driver("make the context current"))?;
        self.event
            .try_is_complete()
            .map_err(driver("query a readiness event"))
    }
}

impl fmt::Debug for ReadyEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadyEvent")
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

/// A staging buffer the kernel can address: [`PinnedStaging`] or [`DeviceStaging`].
/// Sealed: the kernel writes through the address it reports.
pub trait Staging: sealed::Sealed {
    /// Bytes of the buffer.
    fn len(&self) -> usize;
    /// Whether the buffer holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device the buffer is addressed from.
    fn ordinal(&self) -> usize;
}

mod sealed {
    /// Seals [`super::Staging`]: the device address must come from this module.
    #[allow(unreachable_pub)]
    pub trait Sealed {
        /// Device address of the first byte, valid for `len()` bytes.
        fn device_addr(&self) -> u64;
    }
}

/// Pinned (page-locked) host memory mapped into the device's address space.
pub struct PinnedStaging {
    /// At least one byte: the driver refuses empty allocations.
    buf: PinnedHostSlice<u8>,
    len: usize,
    addr: u64,
    ordinal: usize,
}

impl fmt::Debug for PinnedStaging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedStaging")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl PinnedStaging {
    /// Allocates `len` bytes of pinned host memory (not write-combined: the host reads it).
    pub fn new(kernel: &CudaKernel, len: usize) -> Result<Self, CudaError> {
        if len >= isize::MAX as usize {
            return Err(CudaError::TooLarge {
                what: "pinned staging bytes",
                value: len as u64,
                limit: isize::MAX as u64 - 1,
            });
        }
        let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE
            | cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: the size is checked above; the memory is uninitialised, so it is zeroed below
        // before any safe read.
        let mut buf = unsafe { kernel.ctx.alloc_pinned_with_flags::<u8>(len.max(1), flags) }
            .map_err(driver("allocate pinned memory"))?;
        let host = buf.as_mut_ptr().map_err(driver("map pinned memory"))?;
        // SAFETY: `host` points to `len.max(1)` bytes just allocated and not yet shared.
        unsafe { std::ptr::write_bytes(host, 0, len.max(1)) };
        let mut addr: cudarc::driver::sys::CUdeviceptr = 0;
        // SAFETY: `host` is a live allocation of cuMemHostAlloc with DEVICEMAP in this context;
        // `addr` is a valid out-pointer.
        unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut addr, host.cast(), 0) }
            .result()
            .map_err(driver("map pinned memory into the device"))?;
        Ok(PinnedStaging {
            buf,
            len,
            addr,
            ordinal: kernel.ordinal,
        })
    }

    /// The bytes, after any kernel writing them has finished.
    pub fn as_slice(&self) -> Result<&[u8], CudaError> {
        let all = self
            .buf
            .as_slice()
            .map_err(driver("wait for pinned memory"))?;
        Ok(&all[..self.len])
    }

    /// The bytes, writable, after any kernel using them has finished.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], CudaError> {
        let len = self.len;
        let all = self
            .buf
            .as_mut_slice()
            .map_err(driver("wait for pinned memory"))?;
        Ok(&mut all[..len])
    }
}

impl Staging for PinnedStaging {
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl sealed::Sealed for PinnedStaging {
    fn device_addr(&self) -> u64 {
        self.addr
    }
}

/// Device memory staging.
pub struct DeviceStaging {
    /// At least one byte, as for pinned staging.
    buf: CudaSlice<u8>,
    len: usize,
    ordinal: usize,
    stream: Arc<CudaStream>,
}

impl fmt::Debug for DeviceStaging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceStaging")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl DeviceStaging {
    /// Allocates `len` zeroed bytes on the kernel's device. Returns once the allocation and
    /// its zeroing (stream-ordered where the device has memory pools) have run, so that a
    /// transport that writes it from its own streams (UCX) never races them.
    pub fn new(kernel: &CudaKernel, len: usize) -> Result<Self, CudaError> {
        let buf = kernel
            .stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(driver("allocate device staging"))?;
        kernel
            .stream
            .synchronize()
            .map_err(driver("synchronize a device staging allocation"))?;
        Ok(DeviceStaging {
            buf,
            len,
            ordinal: kernel.ordinal,
            stream: kernel.stream.clone(),
        })
    }

    /// Bytes the buffer can hold: [`Self::set_len`] up to this without allocating.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// The device address of the first byte, for a transport that moves device memory itself
    /// (UCX built with CUDA). Host code never dereferences it.
    pub fn device_ptr(&self) -> u64 {
        sealed::Sealed::device_addr(self)
    }

    /// Makes the buffer `len` bytes long, within its capacity (contents unspecified).
    pub fn set_len(&mut self, len: usize) -> Result<(), CudaError> {
        if len > self.capacity() {
            return Err(CudaError::OutOfBounds {
                offset: 0,
                len,
                size: self.capacity(),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Copies the buffer into `out`, which must have exactly its length.
    pub fn copy_to_host(&self, out: &mut [u8]) -> Result<(), CudaError> {
        if out.len() != self.len {
            return Err(CudaError::OutOfBounds {
                offset: 0,
                len: out.len(),
                size: self.len,
            });
        }
        if let Some(view) = self.buf.try_slice(..self.len) {
            self.stream
                .memcpy_dtoh(&view, out)
                .map_err(driver("copy staging to host"))?;
            self.stream.synchronize().map_err(driver("synchronize"))?;
        }
        Ok(())
    }

    /// Copies the buffer to host memory.
    pub fn to_host(&self) -> Result<Vec<u8>, CudaError> {
        let mut out = vec![0u8; self.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Replaces the buffer's bytes; `data` must have exactly its length.
    pub fn copy_from_host(&mut self, data: &[u8]) -> Result<(), CudaError> {
        if data.len() != self.len {
            return Err(CudaError::OutOfBounds {
                offset: 0,
                len: data.len(),
                size: self.len,
            });
        }
        let len = self.len;
        if let Some(mut view) = self.buf.try_slice_mut(..len) {
            self.stream
                .memcpy_htod(data, &mut view)
                .map_err(driver("copy staging to device"))?;
            self.stream.synchronize().map_err(driver("synchronize"))?;
        }
        Ok(())
    }
}

impl Staging for DeviceStaging {
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl sealed::Sealed for DeviceStaging {
    fn device_addr(&self) -> u64 {
        let (addr, _guard) = self.buf.device_ptr(&self.stream);
        addr
    }
}
