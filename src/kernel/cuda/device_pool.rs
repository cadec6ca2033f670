//! A KV pool in device memory ([`DevicePool`]): memory of its own, the engine's allocations
//! in this process, another process's allocation by CUDA IPC handle, or its VMM pieces
//! ([`super::vmm`]). Laid out like a host pool of the same layout, plus its plane table (the
//! address of page 0 of every (layer, plane)), uploaded once and passed to every launch; and
//! the kernel's gathers and scatters of a pool ([`CudaKernel::gather`],
//! [`CudaKernel::scatter`]), which validate the selection against it before a launch.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use super::launch;
use super::{CudaError, CudaKernel, Staging, driver};
use crate::kernel::{KernelError, Selection};
use crate::layout::{KvLayout, LayoutError, PageOrder};
use crate::memory::Span;
use crate::pool::EngineRegion;

/// The device memory under a pool.
enum Backing {
    /// Allocated for the pool, freed with it.
    Owned { _alloc: CudaSlice<u8> },
    /// The engine's allocations in this process, borrowed: never freed by kvferry.
    Engine,
    /// Another process's allocation, mapped by CUDA IPC handle; closed with the pool.
    Ipc { _mapping: IpcMapping },
    /// Another process's VMM pieces, imported and mapped; released with the pool.
    Vmm { _mapped: super::vmm::Mapped },
}

/// A KV pool in device memory, laid out like a host pool of the same layout: memory of its
/// own, the engine's allocations in this process, or another process's allocation opened by
/// CUDA IPC handle.
pub struct DevicePool {
    pub(super) layout: KvLayout,
    pub(super) num_pages: usize,
    pub(super) ordinal: usize,
    /// The memory, which goes with the pool.
    mem: Backing,
    /// Device address of pool offset 0 (the lowest region's first byte).
    base: u64,
    /// The byte ranges of the pool that are memory (offset, len), sorted.
    ranges: Vec<(usize, usize)>,
    /// Where each region starts (offset from `base`), in the layout's region order.
    starts: Vec<usize>,
    /// Address of page 0 of every (layer, plane): see [`launch::plane_table`].
    pub(super) table: CudaSlice<u64>,
    stream: Arc<CudaStream>,
}

impl fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePool")
            .field("layout", &self.layout)
            .field("num_pages", &self.num_pages)
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

/// Another process's allocation opened by CUDA IPC handle, closed when dropped (in its
/// context, whatever the thread).
struct IpcMapping {
    addr: u64,
    ctx: Arc<CudaContext>,
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Work on the pool is waited for by every launch and copy; nothing is in flight.
        // SAFETY: `addr` was returned by cuIpcOpenMemHandle and is closed once, here.
        let closed = self
            .ctx
            .bind_to_thread()
            .and_then(|()| unsafe { cudarc::driver::sys::cuIpcCloseMemHandle(self.addr) }.result());
        if let Err(e) = closed {
            tracing::warn!(error = %e, "closing a CUDA IPC mapping failed");
        }
    }
}

impl DevicePool {
    /// Allocates a zeroed pool of `num_pages` pages on the kernel's device and uploads its
    /// plane table.
    pub fn new(
        kernel: &CudaKernel,
        layout: KvLayout,
        num_pages: usize,
    ) -> Result<Self, KernelError> {
        let size = checked_size(&layout, num_pages)?;
        let mem = kernel
            .stream
            .alloc_zeros::<u8>(size)
            .map_err(driver("allocate device pool"))?;
        let base = {
            let (base, _guard) = mem.device_ptr(&kernel.stream);
            base
        };
        let each = layout.region_bytes(num_pages)?;
        let regions: Vec<EngineRegion> = launch::one_buffer(&layout, num_pages, base)?
            .into_iter()
            .map(|addr| EngineRegion {
                addr: addr as usize,
                len: each,
            })
            .collect();
        Self::over(
            kernel,
            layout,
            num_pages,
            &regions,
            Backing::Owned { _alloc: mem },
        )
    }

    /// A pool over device memory the engine allocated in this process: one region per
    /// [`KvLayout::num_regions`], in the layout's region order, each at least
    /// [`KvLayout::region_bytes`] long and inside one allocation on the kernel's device (the
    /// driver is asked). kvferry reads and writes the regions in place and never frees them.
    ///
    /// # Safety
    /// The regions must stay allocated (at the same addresses) for as long as the pool lives.
    /// The engine may write the pages kvferry is not transferring at any time.
    pub unsafe fn engine(
        kernel: &CudaKernel,
        layout: KvLayout,
        num_pages: usize,
        regions: &[EngineRegion],
    ) -> Result<Self, KernelError> {
        for (i, r) in regions.iter().enumerate() {
            let (start, len) = kernel.allocation_of(r.addr as u64)?;
            if (r.addr as u64) + (r.len as u64) > start + len as u64 {
                return Err(regions_error(format!(
                    "region {i} at {:#x} holds {} bytes, but its allocation on device {} ends at {:#x}",
                    r.addr,
                    r.len,
                    kernel.ordinal,
                    start + len as u64
                )));
            }
        }
        Self::over(kernel, layout, num_pages, regions, Backing::Engine)
    }

    /// A pool over another process's device allocation, opened by its CUDA IPC handle
    /// (`cuIpcGetMemHandle` of the allocation's base). The layout must be one region (the
    /// allocation), at least [`KvLayout::pool_bytes`] long. The mapping is closed with the pool.
    pub fn open_ipc(
        kernel: &CudaKernel,
        layout: KvLayout,
        num_pages: usize,
        handle: &[u8; 64],
    ) -> Result<Self, KernelError> {
        let size = checked_size(&layout, num_pages)?;
        if layout.num_regions() != 1 {
            return Err(regions_error(format!(
                "one CUDA IPC handle names one allocation; the layout spans {} regions",
                layout.num_regions()
            )));
        }
        kernel.bind()?;
        let mut raw = cudarc::driver::sys::CUipcMemHandle { reserved: [0; 64] };
        for (to, from) in raw.reserved.iter_mut().zip(handle) {
            *to = *from as std::ffi::c_char;
        }
        let mut addr = 0;
        // SAFETY: a valid out-pointer; the handle is plain bytes the driver validates.
        unsafe {
            cudarc::driver::sys::cuIpcOpenMemHandle_v2(
                &mut addr,
                raw,
                cudarc::driver::sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(driver("open the CUDA IPC handle"))?;
        // Closed on every way out from here, the pool's or an error's.
        let mem = Backing::Ipc {
            _mapping: IpcMapping {
                addr,
                ctx: kernel.ctx.clone(),
            },
        };
        let (_, len) = kernel.allocation_of(addr)?;
        let regions = [EngineRegion {
            addr: addr as usize,
            len,
        }];
        if len < size {
            return Err(regions_error(format!(
                "the allocation behind the CUDA IPC handle holds {len} bytes; {size} needed for {num_pages} pages"
            )));
        }
        Self::over(kernel, layout, num_pages, &regions, mem)
    }

    /// A pool over another process's VMM allocation (e.g. PyTorch's expandable segments),
    /// received as shareable handles from the engine's Unix socket at `socket` (see
    /// [`super::vmm`]), each read bounded by `timeout`. The layout must be one region, the
    /// pieces together at least [`KvLayout::pool_bytes`] long.
    pub fn import_vmm(
        kernel: &CudaKernel,
        layout: KvLayout,
        num_pages: usize,
        socket: &std::path::Path,
        timeout: std::time::Duration,
    ) -> Result<Self, KernelError> {
        let size = checked_size(&layout, num_pages)?;
        if layout.num_regions() != 1 {
            return Err(regions_error(format!(
                "VMM pieces make one range; the layout spans {} regions",
                layout.num_regions()
            )));
        }
        let pieces = super::vmm::receive_pieces(socket, timeout)?;
        let mapped = super::vmm::Mapped::map(kernel, pieces)?;
        if mapped.len < size {
            return Err(regions_error(format!(
                "the engine's pieces hold {} bytes; {size} needed for {num_pages} pages",
                mapped.len
            )));
        }
        let regions = [EngineRegion {
            addr: mapped.base as usize,
            len: mapped.len,
        }];
        Self::over(
            kernel,
            layout,
            num_pages,
            &regions,
            Backing::Vmm { _mapped: mapped },
        )
    }

    /// The pool over `regions` (validated), with its plane table uploaded.
    fn over(
        kernel: &CudaKernel,
        layout: KvLayout,
        num_pages: usize,
        regions: &[EngineRegion],
        mem: Backing,
    ) -> Result<Self, KernelError> {
        launch::order_code(layout.order)?;
        let sorted =
            crate::pool::check_regions(&layout, num_pages, regions).map_err(regions_error)?;
        let (base, ranges) = crate::pool::memory_ranges(&sorted);
        let addrs: Vec<u64> = regions.iter().map(|r| r.addr as u64).collect();
        let starts = regions.iter().map(|r| r.addr - base).collect();
        let stream = kernel.stream.clone();
        let table = stream
            .clone_htod(&launch::plane_table(&layout, num_pages, &addrs)?)
            .map_err(driver("upload plane table"))?;
        stream.synchronize().map_err(driver("synchronize"))?;
        Ok(DevicePool {
            layout,
            num_pages,
            ordinal: kernel.ordinal,
            mem,
            base: base as u64,
            ranges,
            starts,
            table,
            stream,
        })
    }

    /// The layout of this pool.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages in this pool.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Bytes from the pool's first byte to its last (regions apart leave gaps).
    pub fn size(&self) -> usize {
        self.ranges.last().map_or(0, |&(start, len)| start + len)
    }

    /// The device address of the pool's first byte (offset 0).
    pub fn device_ptr(&self) -> u64 {
        self.base
    }

    /// Whether a transport may register this pool, send runs from it and place runs into it:
    /// one contiguous range of memory whose regions lie back to back in the layout's order
    /// (as [`crate::pool::HostPool::contiguous`]), allocated in this process (its own, or the
    /// engine's). Memory opened from another process's
    /// handle is not: UCX's `cuda_ipc` lets a peer map memory by exporting its allocation, and
    /// CUDA exports only allocations of this process (`cuIpcGetMemHandle` takes `cuMemAlloc`'s
    /// memory).
    pub fn registrable(&self) -> bool {
        matches!(self.mem, Backing::Owned { .. } | Backing::Engine)
            && crate::pool::back_to_back(&self.layout, self.num_pages, &self.ranges, &self.starts)
    }

    /// The device holding this pool.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes the pool's context current on this thread (for raw driver calls).
    fn bind(&self) -> Result<(), CudaError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver("make the context current"))
    }

    /// The device address of `len` bytes at pool offset `offset`, when they lie inside one
    /// range of the pool's memory.
    fn address(&self, offset: usize, len: usize) -> Result<u64, CudaError> {
        match crate::pool::within(&self.ranges, offset, len) {
            true => Ok(self.base + offset as u64),
            false => Err(CudaError::OutOfBounds {
                offset,
                len,
                size: self.size(),
            }),
        }
    }

    /// The selection as the pool's contiguous ranges in `wire` order, when it is at most `max`
    /// of them: such a selection moves by plain copies ([`Self::read_spans`],
    /// [`Self::write_spans`]), without a launch or device staging. `destination` checks it as
    /// a scatter's.
    pub fn spans(
        &self,
        sel: &Selection<'_>,
        wire: PageOrder,
        max: usize,
        destination: bool,
    ) -> Result<Option<Vec<Span>>, KernelError> {
        let spans = crate::kernel::cpu::spans_in(
            &self.layout,
            self.num_pages,
            &self.starts,
            sel,
            wire,
            destination,
        )?;
        Ok((spans.len() <= max).then_some(spans))
    }

    /// Copies `spans` into `out`, back to back, on the pool's stream.
    pub fn read_spans(&self, spans: &[Span], out: &mut [u8]) -> Result<(), CudaError> {
        self.copy_spans(spans, out.len(), |addr, at, len| {
            // SAFETY: the span is device memory of this pool (checked by `copy_spans`), the
            // slice `len` bytes of `out`; copies are waited for before `out` is used.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut out[at..at + len],
                    addr,
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver("copy pool to host"))
        })
    }

    /// Copies `input`, cut back to back into `spans`, into the pool.
    pub fn write_spans(&self, spans: &[Span], input: &[u8]) -> Result<(), CudaError> {
        self.copy_spans(spans, input.len(), |addr, at, len| {
            // SAFETY: as in `read_spans`; `input` outlives the copies, which are waited for.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    addr,
                    &input[at..at + len],
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver("copy host to pool"))
        })
    }

    /// Runs `copy(device address, host offset, len)` for each span of a host buffer of
    /// `host_len` bytes, then waits for the stream.
    fn copy_spans(
        &self,
        spans: &[Span],
        host_len: usize,
        mut copy: impl FnMut(u64, usize, usize) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let total: u64 = spans.iter().map(|s| s.len).sum();
        if total != host_len as u64 {
            return Err(CudaError::OutOfBounds {
                offset: 0,
                len: host_len,
                size: total as usize,
            });
        }
        self.bind()?;
        let mut at = 0;
        for s in spans {
            let len = s.len as usize;
            let addr = self.address(s.offset as usize, len)?;
            copy(addr, at, len)?;
            at += len;
        }
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// Copies `len` bytes at `offset` out of the pool.
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, CudaError> {
        let addr = self.address(offset, len)?;
        self.bind()?;
        let mut out = vec![0u8; len];
        // SAFETY: `addr..addr+len` is device memory of this pool (checked above); `out` holds
        // `len` bytes; the copy is waited for before `out` is used.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out, addr, self.stream.cu_stream())
        }
        .map_err(driver("copy pool to host"))?;
        self.stream.synchronize().map_err(driver("synchronize"))?;
        Ok(out)
    }

    /// Copies `data` into the pool at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        let addr = self.address(offset, data.len())?;
        self.bind()?;
        // SAFETY: as in `read`; `data` outlives the copy, which is waited for.
        unsafe { cudarc::driver::result::memcpy_htod_async(addr, data, self.stream.cu_stream()) }
            .map_err(driver("copy host to pool"))?;
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// Sets every byte of the pool's memory to `byte` (tests poison destinations with 0xDE).
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        self.bind()?;
        for &(start, len) in &self.ranges {
            // SAFETY: writes exactly one range of the pool's memory, on the pool's stream.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    self.base + start as u64,
                    byte,
                    len,
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver("fill pool"))?;
        }
        self.stream.synchronize().map_err(driver("synchronize"))
    }
}

/// The pool's byte size, refusing layouts and page counts the kernel cannot address.
fn checked_size(layout: &KvLayout, num_pages: usize) -> Result<usize, KernelError> {
    layout.validate()?;
    if num_pages == 0 || u32::try_from(num_pages).is_err() {
        return Err(LayoutError::Invalid {
            field: "num_pages",
            reason: format!("{num_pages} must be within 1..=u32::MAX"),
        }
        .into());
    }
    Ok(layout.pool_bytes(num_pages)?)
}

fn regions_error(reason: impl ToString) -> KernelError {
    CudaError::Regions(reason.to_string()).into()
}

/// The kernel's launches over a pool.
impl CudaKernel {
    /// Copies the selection of `pool` into `staging`, in `wire` order.
    pub fn gather<S: Staging>(
        &self,
        pool: &DevicePool,
        sel: &Selection<'_>,
        wire: PageOrder,
        staging: &mut S,
    ) -> Result<(), KernelError> {
        self.same_device(pool.ordinal)?;
        self.same_device(staging.ordinal())?;
        let plan = launch::plan(
            &pool.layout,
            pool.num_pages,
            sel,
            wire,
            staging.len(),
            false,
        )?;
        match plan {
            Some(plan) => Ok(self.run(&self.gather, plan, &pool.table, staging.device_addr())?),
            None => Ok(()),
        }
    }

    /// Copies `staging`, in `wire` order, into the selection of `pool`.
    pub fn scatter<S: Staging>(
        &self,
        staging: &S,
        wire: PageOrder,
        pool: &DevicePool,
        sel: &Selection<'_>,
    ) -> Result<(), KernelError> {
        self.same_device(pool.ordinal)?;
        self.same_device(staging.ordinal())?;
        let plan = launch::plan(&pool.layout, pool.num_pages, sel, wire, staging.len(), true)?;
        match plan {
            Some(plan) => Ok(self.run(&self.scatter, plan, &pool.table, staging.device_addr())?),
            None => Ok(()),
        }
    }
}
