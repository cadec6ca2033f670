//! KV pools in host memory: one page-aligned mapping holding every block of a [`KvLayout`].
//!
//! A pool is either anonymous memory of this process or a shared-memory file (on /dev/shm) that
//! an engine process and the agent both map. The creator of a shared-memory pool reserves the
//! whole file up front (`fallocate`), so a full /dev/shm is an error at creation instead of a
//! SIGBUS at the first write, and unlinks the file when it drops the pool; processes that open
//! an existing file by its [`PoolDescriptor`] never unlink it.
//!
//! Invariant: the mapping is exactly `layout.pool_bytes(num_pages)` bytes, so every offset the
//! layout computes for an in-range (layer, plane, page) lies inside it. The pool never hands out
//! references into its memory (another process may write it at any time); bytes move through
//! raw copies: the kernels, and [`HostPool::read`] / [`HostPool::write`].
//!
//! Which pages may be written when is the agents' business (page ownership, docs/engines.md);
//! [`allocator`] hands out the pages the agent owns.
#![allow(unsafe_code)]

pub mod allocator;

use std::fmt;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use memmap2::{MmapOptions, MmapRaw};

use crate::layout::{KvLayout, LayoutError};

/// Errors creating, opening or addressing a pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The layout is invalid or the pool size overflows.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A pool needs at least one page.
    #[error("a pool needs at least one page")]
    Empty,
    /// Creating, reserving or mapping the backing memory failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The file (or "anonymous memory").
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// An existing shared-memory file has another size than the layout needs.
    #[error("{path} holds {actual} bytes but the layout needs {expected} for {pages} pages")]
    SizeMismatch {
        /// The file.
        path: String,
        /// Bytes the layout needs.
        expected: u64,
        /// Bytes the file has.
        actual: u64,
        /// Pages asked for.
        pages: usize,
    },
    /// A descriptor string that does not parse.
    #[error("bad pool descriptor {0}")]
    BadDescriptor(String),
    /// A device-memory pool where only host pools can be served.
    #[error("cannot serve {descriptor}: {reason}")]
    DeviceMemory {
        /// The descriptor.
        descriptor: String,
        /// Why (no GPU, no driver, ...).
        reason: String,
    },
    /// Engine regions that do not fit the layout.
    #[error("engine memory: {0}")]
    Regions(String),
    /// A byte range outside the pool.
    #[error("byte range {offset}+{len} is outside the pool's {size} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The pool's size.
        size: usize,
    },
    /// A (layer, plane, page) outside the pool.
    #[error("block (layer {layer}, plane {plane}, page {page}) is outside the pool")]
    BadBlock {
        /// Local layer.
        layer: usize,
        /// Plane (0 = K or latent, 1 = V).
        plane: usize,
        /// Page index.
        page: usize,
    },
}

/// Names the memory a pool lives in, so that another process can map the same pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolDescriptor {
    /// Private anonymous memory of one process.
    Anonymous,
    /// A shared-memory file.
    Shm(PathBuf),
    /// Memory of the engine in this process, registered through the library (never by name).
    Engine,
    /// Device memory of another process, by CUDA IPC handle:
    /// `cuda-ipc:<device ordinal>:<128 hex digits of the 64-byte cudaIpcMemHandle_t>`.
    CudaIpc {
        /// Device ordinal.
        device: u32,
        /// The IPC memory handle.
        handle: [u8; 64],
    },
    /// Device memory of another process, by VMM shareable handles that the engine sends over
    /// its Unix socket: `cuda-vmm:<device ordinal>:<socket path>`.
    CudaVmm {
        /// Device ordinal.
        device: u32,
        /// The engine's socket.
        socket: PathBuf,
    },
}

impl fmt::Display for PoolDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolDescriptor::Anonymous => f.write_str("anon"),
            PoolDescriptor::Engine => f.write_str("engine"),
            PoolDescriptor::Shm(path) => write!(f, "shm:{}", path.display()),
            PoolDescriptor::CudaIpc { device, handle } => {
                write!(f, "cuda-ipc:{device}:")?;
                handle.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
            PoolDescriptor::CudaVmm { device, socket } => {
                write!(f, "cuda-vmm:{device}:{}", socket.display())
            }
        }
    }
}

impl FromStr for PoolDescriptor {
    type Err = PoolError;
    fn from_str(s: &str) -> Result<Self, PoolError> {
        let bad = |why: &str| PoolError::BadDescriptor(format!("{s:?}: {why}"));
        match s.split_once(':') {
            None if s == "anon" => Ok(PoolDescriptor::Anonymous),
            Some(("shm", path)) if !path.is_empty() => Ok(PoolDescriptor::Shm(path.into())),
            Some(("cuda-ipc", rest)) => {
                let (device, hex) = rest
                    .split_once(':')
                    .ok_or_else(|| bad("expected cuda-ipc:<device>:<handle>"))?;
                let device = device
                    .parse()
                    .map_err(|_| bad("the device ordinal is not a number"))?;
                if hex.len() != 128 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(bad("the handle must be 128 hex digits (64 bytes)"));
                }
                let mut handle = [0u8; 64];
                for (i, byte) in handle.iter_mut().enumerate() {
                    *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                        .map_err(|_| bad("the handle is not hex"))?;
                }
                Ok(PoolDescriptor::CudaIpc { device, handle })
            }
            Some(("cuda-vmm", rest)) => {
                let (device, socket) = rest
                    .split_once(':')
                    .filter(|(_, path)| !path.is_empty())
                    .ok_or_else(|| bad("expected cuda-vmm:<device>:<socket path>"))?;
                let device = device
                    .parse()
                    .map_err(|_| bad("the device ordinal is not a number"))?;
                Ok(PoolDescriptor::CudaVmm {
                    device,
                    socket: socket.into(),
                })
            }
            _ => Err(bad(
                "expected `anon`, `shm:<path>`, `cuda-ipc:<device>:<handle>` or `cuda-vmm:<device>:<socket>`",
            )),
        }
    }
}

/// One region of engine memory: an allocation the engine made and keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineRegion {
    /// Address of its first byte in this process.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
}

/// Checks engine regions against a layout: one per [`KvLayout::num_regions`], each non-null and
/// at least [`KvLayout::region_bytes`] long, none overlapping another. Returns the regions'
/// used parts `(address, region bytes)`, sorted by address. Host and device pools share it.
pub fn check_regions(
    layout: &KvLayout,
    num_pages: usize,
    regions: &[EngineRegion],
) -> Result<Vec<(usize, usize)>, PoolError> {
    checked_size(layout, num_pages)?;
    let need = layout.region_bytes(num_pages)?;
    if regions.len() != layout.num_regions() {
        return Err(PoolError::Regions(format!(
            "the layout spans {} regions, {} were given",
            layout.num_regions(),
            regions.len()
        )));
    }
    let mut sorted: Vec<(usize, usize)> = Vec::with_capacity(regions.len());
    for (i, r) in regions.iter().enumerate() {
        if r.addr == 0 || r.len < need || r.addr.checked_add(r.len).is_none() {
            return Err(PoolError::Regions(format!(
                "region {i} at {:#x} holds {} bytes; {need} needed for {num_pages} pages",
                r.addr, r.len
            )));
        }
        sorted.push((r.addr, need));
    }
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(PoolError::Regions(format!(
            "regions at {:#x} and {:#x} overlap",
            w[0].0, w[1].0
        )));
    }
    Ok(sorted)
}

/// The lowest address of checked regions (see [`check_regions`]) and the byte ranges of memory
/// from there, `(offset, len)` sorted; adjacent regions make one range (a run may span them:
/// they are one memory).
pub fn memory_ranges(sorted: &[(usize, usize)]) -> (usize, Vec<(usize, usize)>) {
    let low = sorted.first().map_or(0, |r| r.0);
    let mut ranges: Vec<(usize, usize)> = sorted.iter().map(|&(a, l)| (a - low, l)).collect();
    ranges.dedup_by(|next, prev| {
        let joined = prev.0 + prev.1 == next.0;
        if joined {
            prev.1 += next.1;
        }
        joined
    });
    (low, ranges)
}

/// Whether a pool of `num_pages` of `layout`, whose memory is `ranges` and whose regions start
/// at `starts` (offsets, in the layout's region order), is one range with its regions back to
/// back: where a peer computes every offset from the layout alone.
pub(crate) fn back_to_back(
    layout: &KvLayout,
    num_pages: usize,
    ranges: &[(usize, usize)],
    starts: &[usize],
) -> bool {
    let region = layout.region_bytes(num_pages).unwrap_or(0);
    ranges.len() == 1
        && starts
            .iter()
            .enumerate()
            .all(|(i, &start)| start == i * region)
}

/// Whether `len` bytes at `offset` lie inside one of `ranges` (`(offset, len)`, as
/// [`memory_ranges`] gives them).
pub fn within(ranges: &[(usize, usize)], offset: usize, len: usize) -> bool {
    let end = offset.checked_add(len);
    ranges
        .iter()
        .any(|&(start, n)| offset >= start && end.is_some_and(|e| e <= start + n))
}

/// The memory under a pool: a mapping the pool owns, or the engine's regions, borrowed.
#[derive(Debug)]
enum Memory {
    Mapped(MmapRaw),
    /// From the lowest region's first byte to the highest region's last; only the regions
    /// themselves are ever touched. Never freed or unmapped by kvferry.
    Engine {
        base: *mut u8,
        span: usize,
    },
}

/// A KV pool in host memory.
#[derive(Debug)]
pub struct HostPool {
    layout: KvLayout,
    num_pages: usize,
    descriptor: PoolDescriptor,
    /// Unlink the shared-memory file on drop (this process created it).
    unlink_on_drop: bool,
    /// The file the pool's memory is, when it is one (a shared-memory or memory file).
    file: Option<File>,
    mem: Memory,
    /// Offset of each region from the base, when they are not back to back (engine memory).
    starts: Vec<usize>,
    /// The byte ranges of the pool that are memory (offset, len), sorted.
    ranges: Vec<(usize, usize)>,
}

// SAFETY: the pool's memory is raw memory reached only through raw copies (never references),
// valid for the pool's life (its own mapping, or engine memory the constructor's caller
// vouched for); sharing the address across threads is what the kernels do by design.
unsafe impl Send for HostPool {}
// SAFETY: as above.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// A pool in anonymous page-aligned memory of this process, zero-filled and faulted in
    /// (on transparent huge pages where available).
    pub fn anonymous(layout: KvLayout, num_pages: usize) -> Result<Self, PoolError> {
        let size = checked_size(&layout, num_pages)?;
        let mem = MmapOptions::new()
            .len(size)
            .map_anon()
            .map_err(|source| io_err("map", "anonymous memory", source))?;
        // Transparent huge pages where the kernel offers them (fewer faults and TLB misses);
        // refusal only costs speed.
        #[cfg(target_os = "linux")]
        if let Err(e) = mem.advise(memmap2::Advice::HugePage) {
            tracing::debug!(error = %e, "no transparent huge pages for the pool");
        }
        let mem: MmapRaw = mem.into();
        // Fault every page in now, so no transfer pays for first touches.
        // SAFETY: writes exactly the fresh mapping's bytes; nothing else references it yet.
        unsafe { std::ptr::write_bytes(mem.as_mut_ptr(), 0, size) };
        Ok(HostPool::mapped(
            layout,
            num_pages,
            PoolDescriptor::Anonymous,
            mem,
        ))
    }

    /// A pool in a new memory file of this process (`memfd_create`), zero-filled and faulted
    /// in: anonymous, but a file another process on this host can be handed
    /// ([`HostPool::memory_file`]) to map the same pages. The file is sealed at its size
    /// ([`is_sealed`]): no process can shrink it under another's mapping, which would make the
    /// mapping's next access a SIGBUS. Shared memory has no transparent huge pages unless the
    /// host enables them for it (`shmem_enabled`).
    pub fn shareable(layout: KvLayout, num_pages: usize) -> Result<Self, PoolError> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let size = checked_size(&layout, num_pages)?;
        let what = "memory file";
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        let fd = rustix::fs::memfd_create("kvferry-pool", flags)
            .map_err(|errno| io_err("create", what, errno.into()))?;
        let file = File::from(fd);
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, size as u64)
            .map_err(|errno| io_err("reserve", what, errno.into()))?;
        let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
        rustix::fs::fcntl_add_seals(&file, seals)
            .map_err(|errno| io_err("seal", what, errno.into()))?;
        let mut pool = Self::map_file(&file, Path::new(what), layout, num_pages, size)?;
        pool.descriptor = PoolDescriptor::Anonymous;
        pool.file = Some(file);
        Ok(pool)
    }

    /// Creates a pool in a new shared-memory file at `path`, reserving all of its bytes now.
    /// The file is unlinked when this pool drops.
    pub fn create_shm(
        path: impl AsRef<Path>,
        layout: KvLayout,
        num_pages: usize,
    ) -> Result<Self, PoolError> {
        let path = path.as_ref();
        let (file, size, shown) = open_pool_file(path, &layout, num_pages, true)?;
        let reserve =
            rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, size as u64);
        if let Err(errno) = reserve {
            let _ = std::fs::remove_file(path);
            return Err(io_err("reserve", &shown, errno.into()));
        }
        let mut pool = Self::map_file(&file, path, layout, num_pages, size)?;
        pool.unlink_on_drop = true;
        pool.file = Some(file);
        Ok(pool)
    }

    /// Maps an existing shared-memory pool created by another process with the same layout.
    pub fn open_shm(
        path: impl AsRef<Path>,
        layout: KvLayout,
        num_pages: usize,
    ) -> Result<Self, PoolError> {
        let path = path.as_ref();
        let (file, size, shown) = open_pool_file(path, &layout, num_pages, false)?;
        let actual = file
            .metadata()
            .map_err(|source| io_err("stat", &shown, source))?
            .len();
        if actual != size as u64 {
            return Err(PoolError::SizeMismatch {
                path: shown,
                expected: size as u64,
                actual,
                pages: num_pages,
            });
        }
        let mut pool = Self::map_file(&file, path, layout, num_pages, size)?;
        pool.file = Some(file);
        Ok(pool)
    }

    /// Opens the pool a descriptor names (a new anonymous pool for `anon`).
    pub fn open(
        descriptor: &PoolDescriptor,
        layout: KvLayout,
        num_pages: usize,
    ) -> Result<Self, PoolError> {
        match descriptor {
            PoolDescriptor::Anonymous => Self::anonymous(layout, num_pages),
            PoolDescriptor::Shm(path) => Self::open_shm(path, layout, num_pages),
            PoolDescriptor::Engine => Err(PoolError::Regions(
                "engine memory is registered in process (HostPool::engine), not opened by name"
                    .to_owned(),
            )),
            PoolDescriptor::CudaIpc { .. } | PoolDescriptor::CudaVmm { .. } => {
                Err(PoolError::DeviceMemory {
                    descriptor: descriptor.to_string(),
                    reason: "it names device memory; a host pool cannot map it (device pools need \
                         the CUDA kernel and a GPU)"
                        .to_owned(),
                })
            }
        }
    }

    fn map_file(
        file: &File,
        path: &Path,
        layout: KvLayout,
        num_pages: usize,
        size: usize,
    ) -> Result<Self, PoolError> {
        // MAP_POPULATE: map every page of the (already reserved) file now, not at first touch.
        let mem = MmapOptions::new()
            .len(size)
            .populate()
            .map_raw(file)
            .map_err(|source| io_err("map", &path.display().to_string(), source))?;
        Ok(HostPool::mapped(
            layout,
            num_pages,
            PoolDescriptor::Shm(path.to_owned()),
            mem,
        ))
    }

    fn mapped(
        layout: KvLayout,
        num_pages: usize,
        descriptor: PoolDescriptor,
        mem: MmapRaw,
    ) -> Self {
        let size = mem.len();
        HostPool {
            layout,
            num_pages,
            descriptor,
            unlink_on_drop: false,
            file: None,
            mem: Memory::Mapped(mem),
            starts: Vec::new(),
            ranges: vec![(0, size)],
        }
    }

    /// A pool over memory the engine allocated: one region per [`KvLayout::num_regions`], in
    /// the layout's region order (layer by layer, K before V), each at least
    /// [`KvLayout::region_bytes`] long. The pool reads and writes the regions in place and never
    /// frees or unmaps them.
    ///
    /// # Safety
    /// Every region must be mapped, readable and writable, and stay so (at the same address)
    /// for as long as the pool lives; the engine keeps the allocations alive and does not hand
    /// them to anything that frees them meanwhile. The engine may write the pages kvferry is not
    /// transferring at any time (the pool never forms references into them).
    pub unsafe fn engine(
        layout: KvLayout,
        num_pages: usize,
        regions: &[EngineRegion],
    ) -> Result<Self, PoolError> {
        let (low, ranges) = memory_ranges(&check_regions(&layout, num_pages, regions)?);
        let high = low + ranges.last().map_or(0, |r| r.0 + r.1);
        let starts: Vec<usize> = regions.iter().map(|r| r.addr - low).collect();
        Ok(HostPool {
            layout,
            num_pages,
            descriptor: PoolDescriptor::Engine,
            unlink_on_drop: false,
            file: None,
            mem: Memory::Engine {
                base: low as *mut u8,
                span: high - low,
            },
            starts,
            ranges,
        })
    }

    /// The file the pool's memory is (a shared-memory pool, or a [`HostPool::shareable`] one),
    /// which another process may map; `None` for anonymous or engine memory.
    pub fn memory_file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    /// The layout of this pool.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages in this pool.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Bytes from the pool's first byte to its last (for engine memory, holes included).
    pub fn size(&self) -> usize {
        match &self.mem {
            Memory::Mapped(m) => m.len(),
            Memory::Engine { span, .. } => *span,
        }
    }

    /// Offset of each region from the pool's base; empty when the regions lie back to back
    /// (a pool of one mapping), as [`KvLayout::plane_offset`] computes them.
    pub fn region_starts(&self) -> &[usize] {
        &self.starts
    }

    /// Whether the pool is one contiguous range of memory whose regions lie back to back in the
    /// layout's order (its own mapping, or engine regions that happen to lie so), where a peer
    /// computes every offset from the layout alone: only such a pool is registered with a
    /// transport for one-sided or placed writes.
    pub fn contiguous(&self) -> bool {
        back_to_back(&self.layout, self.num_pages, &self.ranges, &self.starts)
    }

    /// What another process needs to map this pool.
    pub fn descriptor(&self) -> &PoolDescriptor {
        &self.descriptor
    }

    /// Base address of the mapping. Writes through it must stay inside [`Self::size`] bytes.
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        match &self.mem {
            Memory::Mapped(m) => m.as_mut_ptr(),
            Memory::Engine { base, .. } => *base,
        }
    }

    /// Offset of one block (local layer, plane, page) in the pool.
    pub fn block_offset(
        &self,
        layer: usize,
        plane: usize,
        page: usize,
    ) -> Result<usize, PoolError> {
        let l = &self.layout;
        if layer >= l.num_layers() || plane >= l.planes() || page >= self.num_pages {
            return Err(PoolError::BadBlock { layer, plane, page });
        }
        let base = match self.starts.as_slice() {
            [] => l.plane_offset(layer, plane, self.num_pages)?,
            starts => {
                let (region, offset) = l.plane_location(layer, plane, self.num_pages)?;
                starts[region] + offset
            }
        };
        Ok(base + page * l.page_stride()?)
    }

    /// Refuses a range that is not inside one range of the pool's memory.
    pub(crate) fn check(&self, offset: usize, len: usize) -> Result<(), PoolError> {
        match within(&self.ranges, offset, len) {
            true => Ok(()),
            false => Err(PoolError::OutOfBounds {
                offset,
                len,
                size: self.size(),
            }),
        }
    }

    /// Copies `len` bytes at `offset` out of the pool.
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, PoolError> {
        self.check(offset, len)?;
        let mut out = vec![0u8; len];
        self.read_into(offset, &mut out)?;
        Ok(out)
    }

    /// Copies `out.len()` bytes at `offset` out of the pool into `out` (no allocation: the
    /// synthetic engine reads a few bytes of every head slice this way).
    pub fn read_into(&self, offset: usize, out: &mut [u8]) -> Result<(), PoolError> {
        self.check(offset, out.len())?;
        // SAFETY: offset..offset+out.len() is inside the mapping (checked above) and `out` is
        // a distinct allocation of that length; no reference into the mapping exists.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// Copies `data` into the pool at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), PoolError> {
        self.check(offset, data.len())?;
        // SAFETY: the destination range is inside the mapping (checked above); `data` cannot
        // alias the mapping because the pool never hands out references into it.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.base_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Copies `data` into the pool in pieces of `data.len() / at.len()` bytes, piece `i` at
    /// `offset + at[i]`: many small writes into one part of the pool (the synthetic engine's
    /// stamps) for one bounds check of that part.
    pub fn write_pieces(&self, offset: usize, at: &[usize], data: &[u8]) -> Result<(), PoolError> {
        let len = self.check_pieces(offset, at, data.len())?;
        for (&a, piece) in at.iter().zip(data.chunks_exact(len)) {
            let dst = self.base_ptr().wrapping_add(offset + a);
            // SAFETY: offset + a .. + len lies inside the part checked above; `data` cannot
            // alias the mapping because the pool never hands out references into it. (A
            // length known here makes the copy one move instead of a call.)
            unsafe {
                match len {
                    8 => std::ptr::copy_nonoverlapping(piece.as_ptr(), dst, 8),
                    _ => std::ptr::copy_nonoverlapping(piece.as_ptr(), dst, len),
                }
            };
        }
        Ok(())
    }

    /// Copies pieces of `out.len() / at.len()` bytes out of the pool into `out`, piece `i`
    /// from `offset + at[i]`: [`Self::write_pieces`] the other way.
    pub fn read_pieces(
        &self,
        offset: usize,
        at: &[usize],
        out: &mut [u8],
    ) -> Result<(), PoolError> {
        let len = self.check_pieces(offset, at, out.len())?;
        for (&a, piece) in at.iter().zip(out.chunks_exact_mut(len)) {
            let src = self.base_ptr().wrapping_add(offset + a);
            // SAFETY: as in `write_pieces`; `out` is a distinct allocation.
            unsafe {
                match len {
                    8 => std::ptr::copy_nonoverlapping(src, piece.as_mut_ptr(), 8),
                    _ => std::ptr::copy_nonoverlapping(src, piece.as_mut_ptr(), len),
                }
            };
        }
        Ok(())
    }

    /// The piece length of [`Self::write_pieces`] / [`Self::read_pieces`] after checking that
    /// `bytes` splits evenly over `at` and that every piece lies in one range of the pool.
    fn check_pieces(&self, offset: usize, at: &[usize], bytes: usize) -> Result<usize, PoolError> {
        let bad = || PoolError::OutOfBounds {
            offset,
            len: bytes,
            size: self.size(),
        };
        let (Some(&low), Some(&high)) = (at.iter().min(), at.iter().max()) else {
            return if bytes == 0 { Ok(1) } else { Err(bad()) };
        };
        let len = bytes / at.len();
        if len == 0 || len * at.len() != bytes {
            return Err(bad());
        }
        let start = offset.checked_add(low).ok_or_else(bad)?;
        let end = offset
            .checked_add(high)
            .and_then(|e| e.checked_add(len))
            .ok_or_else(bad)?;
        // One range of memory holding the lowest piece and the end of the highest holds every
        // piece.
        self.check(start, end - start)?;
        Ok(len)
    }

    /// Sets every byte of the pool's memory to `byte` (tests poison destinations with 0xDE).
    pub fn fill(&self, byte: u8) {
        for &(start, len) in &self.ranges {
            // SAFETY: writes exactly one of the pool's ranges of memory.
            unsafe { std::ptr::write_bytes(self.base_ptr().add(start), byte, len) };
        }
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        if let (true, PoolDescriptor::Shm(path)) = (self.unlink_on_drop, &self.descriptor)
            && let Err(e) = std::fs::remove_file(path)
        {
            tracing::warn!(path = %path.display(), error = %e, "could not unlink pool file");
        }
    }
}

/// Whether `file` is a memory file sealed against shrinking, so that a mapping of it can never
/// fault on a page cut off under it ([`HostPool::shareable`] makes such files; a file on
/// /dev/shm cannot be sealed).
pub fn is_sealed(file: &File) -> bool {
    rustix::fs::fcntl_get_seals(file).is_ok_and(|s| s.contains(rustix::fs::SealFlags::SHRINK))
}

/// Opens the pool file at `path` for reading and writing, a new one when `create`; with the
/// size a pool of `num_pages` takes and the path as errors show it.
fn open_pool_file(
    path: &Path,
    layout: &KvLayout,
    num_pages: usize,
    create: bool,
) -> Result<(File, usize, String), PoolError> {
    let size = checked_size(layout, num_pages)?;
    let shown = path.display().to_string();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .open(path)
        .map_err(|source| io_err(if create { "create" } else { "open" }, &shown, source))?;
    Ok((file, size, shown))
}

fn checked_size(layout: &KvLayout, num_pages: usize) -> Result<usize, PoolError> {
    layout.validate()?;
    if num_pages == 0 {
        return Err(PoolError::Empty);
    }
    let size = layout.pool_bytes(num_pages)?;
    // Page indices travel as u32 on the wire.
    if u32::try_from(num_pages).is_err() {
        return Err(LayoutError::Overflow { what: "page index" }.into());
    }
    Ok(size)
}

fn io_err(op: &'static str, path: &str, source: std::io::Error) -> PoolError {
    PoolError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
/// Pools and contents the unit tests of several modules share.
pub(crate) mod testing {
    use super::HostPool;
    use crate::layout::{KvLayout, ModelSpec};

    /// A pool of 8 `tiny` pages: a sealed memory file when `shareable` (one a decode serves for
    /// mapped writes), anonymous memory otherwise.
    pub(crate) fn tiny_pool(shareable: bool) -> HostPool {
        let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
        match shareable {
            true => HostPool::shareable(layout, 8).unwrap(),
            false => HostPool::anonymous(layout, 8).unwrap(),
        }
    }

    /// `n` bytes of a xorshift sequence: no period a misplaced run could hide in.
    pub(crate) fn xorshift_bytes(n: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
