//! The CPU transfer kernel: gather and scatter between host pools and staging with memcpy.
//!
//! A transfer is planned as a list of runs (pool offset, staging offset, length), each run the
//! longest stretch that is contiguous on both sides: a page block's selected heads of one token
//! (token-major), its selected tokens of one head (head-major), a whole block when every head is
//! selected, and consecutive pages merge into one run when they sit next to each other in the
//! pool. The runs are then copied with `copy_nonoverlapping` (libc memcpy), split by bytes across
//! the kernel's threads when the transfer is large enough to pay for them.
//!
//! The kernel is synchronous and runs on the caller's thread plus scoped threads of its own;
//! async callers run it on a blocking thread, never on the reactor (design.md part 10).
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

use crate::layout::{Granularity, KvLayout, LayoutError, PageOrder, element_offset};
use crate::pool::HostPool;

use super::{KernelError, Selection};
use crate::memory::{Span, WriteRun};

/// Below this many bytes a transfer runs on one thread: spawning costs more than it saves.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// The bounce buffer [`CpuKernel::checksum`] copies pool bytes through before hashing them:
/// small enough to stay in cache between the copy and the hash.
const CHECKSUM_BOUNCE: usize = 64 << 10;

/// Gather and scatter for host pools.
#[derive(Clone, Copy, Debug)]
pub struct CpuKernel {
    threads: usize,
}

impl Default for CpuKernel {
    /// One thread per available core.
    fn default() -> Self {
        CpuKernel::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl CpuKernel {
    /// A kernel that splits large transfers across `threads` threads (at least one).
    pub fn new(threads: usize) -> Self {
        CpuKernel {
            threads: threads.max(1),
        }
    }

    /// Threads a large transfer is split across.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Copies the selection of `pool` into `staging`, in `wire` order.
    pub fn gather(
        &self,
        pool: &HostPool,
        sel: &Selection<'_>,
        wire: PageOrder,
        staging: &mut [u8],
    ) -> Result<(), KernelError> {
        sel.validate(pool, staging.len(), false)?;
        let runs = plan(Geometry::of(pool), sel, wire)?;
        let src = Ptr(pool.base_ptr());
        let dst = Ptr(staging.as_mut_ptr());
        let stream = streams(staging.len());
        // SAFETY: every run lies inside the pool (the selection was validated against it and
        // the layout's offsets stay within `pool_bytes`) and inside `staging` (its length equals
        // the selection's bytes, which the runs tile exactly). `staging` is exclusively
        // borrowed and is not pool memory, so source and destination do not overlap.
        unsafe { self.copy(&runs, src, &[dst], stream, |r| (r.pool, r.staging)) };
        Ok(())
    }

    /// Copies `staging`, in `wire` order, into the selection of `pool`.
    pub fn scatter(
        &self,
        staging: &[u8],
        wire: PageOrder,
        pool: &HostPool,
        sel: &Selection<'_>,
    ) -> Result<(), KernelError> {
        self.scatter_pieces(&[staging], wire, pool, sel)
    }

    /// [`CpuKernel::scatter`] of a staging stream that arrived in `pieces` (one after the
    /// other, cut anywhere: a chunk sent from the sender's pool without a gather), without
    /// joining them first.
    pub fn scatter_pieces(
        &self,
        pieces: &[&[u8]],
        wire: PageOrder,
        pool: &HostPool,
        sel: &Selection<'_>,
    ) -> Result<(), KernelError> {
        let total = pieces.iter().map(|p| p.len()).sum();
        sel.validate(pool, total, true)?;
        let mut runs = plan(Geometry::of(pool), sel, wire)?;
        runs.sort_unstable_by_key(|r| r.staging);
        let dst = Ptr(pool.base_ptr());
        let stream = streams(pool.size());
        let (mut next, mut start) = (0, 0);
        for piece in pieces {
            let end = start + piece.len();
            let mut mine = Vec::new();
            // The runs (or their parts) within this piece, counted from its start.
            while let Some(r) = runs.get_mut(next) {
                if r.staging >= end {
                    break;
                }
                let len = r.len.min(end - r.staging);
                mine.push(Run {
                    staging: r.staging - start,
                    len,
                    ..*r
                });
                if len == r.len {
                    next += 1;
                } else {
                    (r.pool, r.staging, r.len) = (r.pool + len, r.staging + len, r.len - len);
                }
            }
            let src = Ptr(piece.as_ptr().cast_mut());
            // SAFETY: as in `gather`, each run lies inside the pool and inside its piece (the
            // runs tile the selection's bytes, which the pieces add up to, and each was cut at
            // the piece's end); additionally the destination pages are distinct (validated),
            // so no two runs write the same pool bytes, and the agent's page ownership
            // guarantees nothing else writes these pages meanwhile.
            unsafe { self.copy(&mine, src, &[dst], stream, |r| (r.staging, r.pool)) };
            start = end;
        }
        Ok(())
    }

    /// xxh3-64 of the selection's bytes in `wire` order (the bytes a gather would produce),
    /// without staging the chunk: how the direct path checksums it. The pool's bytes are
    /// copied through a small bounce buffer ([`CHECKSUM_BOUNCE`]) and hashed from there.
    pub fn checksum(
        &self,
        pool: &HostPool,
        sel: &Selection<'_>,
        wire: PageOrder,
    ) -> Result<u64, KernelError> {
        let bytes = sel.bytes(pool)?;
        sel.validate(pool, bytes, false)?;
        let mut runs = plan(Geometry::of(pool), sel, wire)?;
        runs.sort_unstable_by_key(|r| r.staging); // hash in wire order (see `pool_to_pool`)
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut bounce = vec![0u8; CHECKSUM_BOUNCE.min(bytes.max(1))];
        for r in runs {
            for start in (0..r.len).step_by(bounce.len()) {
                let len = (r.len - start).min(bounce.len());
                // SAFETY: the run lies inside the pool (validated selection), and `bounce`
                // holds `len` bytes. A raw copy, never a `&[u8]` over the pool: the engine or
                // a misbehaving peer may write these pages meanwhile, which then spoils the
                // checksum (that is what it is for), never Rust's aliasing guarantees.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        pool.base_ptr().add(r.pool + start).cast_const(),
                        bounce.as_mut_ptr(),
                        len,
                    )
                };
                hasher.update(&bounce[..len]);
            }
        }
        Ok(hasher.digest())
    }

    /// Copies every run of `runs[i]` from `src` into destination `i` of `dsts` (the address
    /// and length of another pool's memory mapped into this process, `transport/mapped.rs`),
    /// with streaming stores: those pools are cold. Every run is checked against both sides
    /// before a byte moves. The runs go row by row, the `k`-th run of each list in turn: one
    /// chunk planned for several decode ranks gives lists whose `k`-th runs come from the same
    /// token's row (one prefill rank feeding several decode ranks their heads of each token),
    /// so the copy reads the source once, in order, instead of once per list, in strides.
    ///
    /// Many short runs (head slices) are shared out by rows: each thread checks and copies its
    /// own rows, and none copies until all have checked. Fewer, longer runs are checked here
    /// and shared out by bytes.
    ///
    /// # Safety
    /// Each `dst..dst + len` of `dsts` must stay mapped and writable for the call, and must
    /// overlap neither `src`'s memory nor another destination.
    pub unsafe fn write_runs(
        &self,
        src: &HostPool,
        runs: &[&[WriteRun]],
        dsts: &[(*mut u8, usize)],
    ) -> Result<(), KernelError> {
        let rows = runs.iter().map(|r| r.len()).max().unwrap_or(0);
        let bytes: u64 = runs
            .iter()
            .flat_map(|list| list.iter())
            .map(|r| r.len)
            .sum();
        let parts = (self.threads)
            .min(rows / ROW_SHARE_MIN_RUNS)
            .min(usize::try_from(bytes).unwrap_or(usize::MAX) / PARALLEL_MIN_BYTES)
            .max(1);
        let from = Ptr(src.base_ptr());
        let (to, sizes): (Vec<Ptr>, Vec<usize>) = dsts.iter().map(|&(at, n)| (Ptr(at), n)).unzip();
        let sizes = &sizes;
        let ends = |r: &Run| (r.pool, r.staging);
        if parts == 1 {
            let planned = in_rows(src, runs, sizes, 0..rows)?;
            // SAFETY: every run lies inside the source pool and its destination (checked);
            // the caller guarantees the destinations are writable and apart from the source
            // and from each other.
            unsafe { self.copy(&planned, from, &to, true, ends) };
            return Ok(());
        }
        let (checked, refused) = (std::sync::Barrier::new(parts), AtomicBool::new(false));
        let (one, to) = (CpuKernel::new(1), &to);
        let share = |part: usize| -> Result<(), KernelError> {
            let planned = in_rows(
                src,
                runs,
                sizes,
                rows * part / parts..rows * (part + 1) / parts,
            );
            if planned.is_err() {
                refused.store(true, Ordering::Relaxed);
            }
            checked.wait();
            let planned = planned?;
            if !refused.load(Ordering::Relaxed) {
                // SAFETY: as above, once every share is checked; the shares' rows are apart,
                // and so are their destination bytes.
                unsafe { one.copy(&planned, from, to, true, ends) };
            }
            Ok(())
        };
        std::thread::scope(|scope| {
            let share = &share;
            let others: Vec<_> = (1..parts)
                .map(|part| scope.spawn(move || share(part)))
                .collect();
            let mine = share(0);
            others.into_iter().fold(mine, |outcome, other| {
                let theirs = other
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                outcome.and(theirs)
            })
        })
    }

    /// Copies every run from `src` to its destination `dst[run.to]`, with streaming stores when
    /// `stream` ([`streams`]); `ends` picks (source, destination) offsets.
    ///
    /// # Safety
    /// Every run must lie inside both buffers, the buffers must not overlap, and no two runs
    /// may write the same destination bytes.
    unsafe fn copy(
        &self,
        runs: &[Run],
        src: Ptr,
        dst: &[Ptr],
        stream: bool,
        ends: fn(&Run) -> (usize, usize),
    ) {
        let total: usize = runs.iter().map(|r| r.len).sum();
        let parts = self.threads.min(total / PARALLEL_MIN_BYTES.max(1)).max(1);
        let copy_all = |runs: &[Run]| {
            for r in runs {
                let (s, d) = ends(r);
                // SAFETY: guaranteed by the caller for every run.
                unsafe { copy_run(src.at(s), dst[r.to].at(d), r.len, stream) };
            }
            if stream {
                fence();
            }
        };
        if parts == 1 {
            copy_all(runs);
            return;
        }
        let shares = split(runs, total, parts);
        std::thread::scope(|scope| {
            if let Some((mine, others)) = shares.split_first() {
                for share in others {
                    scope.spawn(move || copy_all(share));
                }
                copy_all(mine);
            }
        });
    }
}

/// From this many bytes a destination buffer is written with streaming stores ([`streams`]).
const STREAM_MIN_BYTES: usize = 16 << 20;

/// Whether copies into a destination buffer of `dst_bytes` stream their stores (non-temporal:
/// the destination is not read first, read-for-ownership, and does not evict the cache). What
/// decides is whether the destination's lines can be in the cache, so the size of the whole
/// buffer counts, not of one transfer: a decode's scatter of one 1 MiB chunk lands in a pool
/// of many GiB, cold, while a gather fills a staging slot that the sender reads next. Measured
/// here (docs/benchmarks.md, CPU transfer kernel): into a 1 GiB buffer, 1 KiB pieces (the
/// heterogeneous-TP head slices) go 5-6 GB/s with memcpy and 16-19 GB/s streamed, 1 MiB pieces
/// 10-14 and 21-25; into a buffer of 8 MiB, which stays in the cache, ordinary stores win.
fn streams(dst_bytes: usize) -> bool {
    dst_bytes >= STREAM_MIN_BYTES
}

/// Copies `len` bytes, with non-temporal stores when `stream` and the target supports them.
///
/// # Safety
/// `src..src+len` must be readable, `dst..dst+len` writable, and the two must not overlap.
unsafe fn copy_run(src: *const u8, dst: *mut u8, len: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream && len >= 256 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Align the destination to 16 bytes with an ordinary copy of the head.
        let head = dst.align_offset(16).min(len);
        // SAFETY: within the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let (mut s, mut d, mut left) = (src.wrapping_add(head), dst.wrapping_add(head), len - head);
        while left >= 64 {
            // SAFETY: 64 readable bytes at `s`, 64 writable 16-aligned bytes at `d`, both
            // within the caller's ranges; SSE2 is part of the x86_64 baseline.
            unsafe {
                let (s4, d4) = (s.cast::<__m128i>(), d.cast::<__m128i>());
                let x0 = _mm_loadu_si128(s4);
                let x1 = _mm_loadu_si128(s4.add(1));
                let x2 = _mm_loadu_si128(s4.add(2));
                let x3 = _mm_loadu_si128(s4.add(3));
                _mm_stream_si128(d4, x0);
                _mm_stream_si128(d4.add(1), x1);
                _mm_stream_si128(d4.add(2), x2);
                _mm_stream_si128(d4.add(3), x3);
            }
            (s, d, left) = (s.wrapping_add(64), d.wrapping_add(64), left - 64);
        }
        // SAFETY: the tail is within the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping(s, d, left) };
        return;
    }
    let _ = stream;
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Copies `len` bytes into a cold destination (a pool's pages) with streaming stores, for
/// copies made piece by piece outside the kernel (a UCX receive's unpack callback);
/// [`fence_streams`] after the last piece, before the bytes are announced.
///
/// # Safety
/// As [`copy_run`].
pub(crate) unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_run(src, dst, len, true) }
}

/// Orders the stores of [`copy_streaming`] before what follows.
pub(crate) fn fence_streams() {
    fence();
}

/// Orders streamed stores before whatever follows the copy (the staging is handed to another
/// thread or the pool's bytes are announced).
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// A raw buffer pointer that may cross to the kernel's scoped threads.
#[derive(Clone, Copy)]
struct Ptr(*mut u8);

impl Ptr {
    /// The address `offset` bytes in (taking `self` whole, so closures capture the `Send`
    /// wrapper rather than the raw field).
    fn at(self, offset: usize) -> *mut u8 {
        self.0.wrapping_add(offset)
    }
}
// SAFETY: the pointer is only dereferenced inside `CpuKernel::copy`, whose scoped threads end
// before it returns and write disjoint bytes.
unsafe impl Send for Ptr {}
// SAFETY: as above.
unsafe impl Sync for Ptr {}

/// One contiguous copy: `len` bytes at `pool` in the pool and at `staging` in staging, the
/// `to`-th of the copy's destinations (0 but for a write into several pools at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    pool: usize,
    staging: usize,
    len: usize,
    to: usize,
}

/// Appends a run, merging it into the previous one when both sides continue contiguously.
fn push(runs: &mut Vec<Run>, run: Run) {
    if let Some(last) = runs.last_mut() {
        if last.pool + last.len == run.pool
            && last.staging + last.len == run.staging
            && last.to == run.to
        {
            last.len += run.len;
            return;
        }
    }
    runs.push(run);
}

/// Where a pool's planes are: its layout, its pages, and where each of its regions starts
/// relative to the pool's base (empty: regions back to back, as in a pool of one mapping).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry<'a> {
    pub(crate) layout: &'a KvLayout,
    pub(crate) num_pages: usize,
    pub(crate) starts: &'a [usize],
}

impl<'a> Geometry<'a> {
    /// A pool whose regions lie back to back (one mapping; every pool exposed to peers).
    fn back_to_back(layout: &'a KvLayout, num_pages: usize) -> Self {
        Geometry {
            layout,
            num_pages,
            starts: &[],
        }
    }

    fn of(pool: &'a HostPool) -> Self {
        Geometry {
            layout: pool.layout(),
            num_pages: pool.num_pages(),
            starts: pool.region_starts(),
        }
    }

    /// Offset of page 0 of a plane from the pool's base.
    fn plane_base(&self, layer: usize, plane: usize) -> Result<usize, LayoutError> {
        if self.starts.is_empty() {
            return self.layout.plane_offset(layer, plane, self.num_pages);
        }
        let (region, offset) = self.layout.plane_location(layer, plane, self.num_pages)?;
        self.starts
            .get(region)
            .and_then(|s| s.checked_add(offset))
            .ok_or(LayoutError::Overflow {
                what: "region offset",
            })
    }
}

/// Plans a validated selection of a pool as coalesced runs in staging order.
fn plan(pool: Geometry<'_>, sel: &Selection<'_>, wire: PageOrder) -> Result<Vec<Run>, LayoutError> {
    let layout = pool.layout;
    if layout.order.granularity() == Granularity::Head || wire.granularity() == Granularity::Head {
        return plan_head_slices(pool, sel, wire);
    }
    let page_size = layout.page_size;
    let held = layout.num_heads();
    let hb = layout.head_bytes();
    // A plane's heads are one cell apart: adjacent only when a cell is one head.
    let cell = layout.cell_bytes();
    let adjacent = cell == hb;
    let nh = sel.heads.len();
    let h0 = sel.heads.start;
    // Validated layouts have a valid stride; the fallback is never taken.
    let stride = layout.page_stride().unwrap_or(0);
    let mut runs = Vec::new();
    let mut staging = 0;
    for layer in sel.layers.clone() {
        for plane in 0..layout.planes() {
            let plane_base = pool.plane_base(layer, plane)?;
            let mut t = sel.tokens.start;
            while t < sel.tokens.end {
                let in_page = t % page_size;
                let nt = (page_size - in_page).min(sel.tokens.end - t);
                let block = plane_base + sel.pages[t / page_size] as usize * stride;
                let pool_at = |tok: usize, h: usize| {
                    block
                        + element_offset(layout.order, in_page + tok, h0 + h, page_size, held, cell)
                };
                let wire_at =
                    |tok: usize, h: usize| staging + element_offset(wire, tok, h, nt, nh, hb);
                let mut emit = |tok, h, len| {
                    push(
                        &mut runs,
                        Run {
                            pool: pool_at(tok, h),
                            staging: wire_at(tok, h),
                            len,
                            to: 0,
                        },
                    )
                };
                match (layout.order, wire) {
                    (PageOrder::TokenMajor, PageOrder::TokenMajor) if adjacent && nh == held => {
                        emit(0, 0, nt * nh * hb)
                    }
                    (PageOrder::TokenMajor, PageOrder::TokenMajor) if adjacent => {
                        (0..nt).for_each(|tok| emit(tok, 0, nh * hb))
                    }
                    (PageOrder::HeadMajor, PageOrder::HeadMajor) if adjacent => {
                        (0..nh).for_each(|h| emit(0, h, nt * hb))
                    }
                    _ => (0..nt).for_each(|tok| (0..nh).for_each(|h| emit(tok, h, hb))),
                }
                staging += nt * nh * hb;
                t += nt;
            }
        }
    }
    Ok(runs)
}

/// [`plan`] for a head-granular order: every page the tokens touch moves whole, as one run per
/// selected head, in staging `[layer][plane][page][head][head slice as stored]`.
fn plan_head_slices(
    pool: Geometry<'_>,
    sel: &Selection<'_>,
    wire: PageOrder,
) -> Result<Vec<Run>, LayoutError> {
    let layout = pool.layout;
    let page_size = layout.page_size;
    if layout.order != wire {
        return Err(LayoutError::Invalid {
            field: "wire order",
            reason: format!(
                "{} pages move only as themselves, not in {} order",
                layout.order.name(),
                wire.name()
            ),
        });
    }
    layout.check_piece_start(sel.tokens.start)?;
    let (held, hb) = (layout.num_heads(), layout.head_bytes());
    let slice = page_size * hb;
    let stride = layout.page_stride().unwrap_or(0);
    let pages = sel.tokens.start / page_size..layout.pages_for(sel.tokens.end);
    let mut runs = Vec::new();
    let mut staging = 0;
    for layer in sel.layers.clone() {
        for plane in 0..layout.planes() {
            let plane_base = pool.plane_base(layer, plane)?;
            for p in pages.clone() {
                let block = plane_base + sel.pages[p] as usize * stride;
                for h in sel.heads.clone() {
                    let at = element_offset(layout.order, 0, h, page_size, held, hb);
                    push(
                        &mut runs,
                        Run {
                            pool: block + at,
                            staging,
                            len: slice,
                            to: 0,
                        },
                    );
                    staging += slice;
                }
            }
        }
    }
    Ok(runs)
}

/// One side of a copy from pool to pool: a pool's layout and page count (it may be in another
/// process; its regions lie back to back) and the selection in it.
#[derive(Clone, Copy, Debug)]
pub struct PoolSide<'a> {
    /// The pool's layout.
    pub layout: &'a KvLayout,
    /// Pages in the pool.
    pub num_pages: usize,
    /// What moves.
    pub sel: &'a Selection<'a>,
}

impl<'a> PoolSide<'a> {
    fn geometry(&self) -> Geometry<'a> {
        Geometry::back_to_back(self.layout, self.num_pages)
    }
}

/// The contiguous copies that move a selection from one pool into another (the direct path's
/// one-sided writes), after validating both sides. Both selections are planned against the
/// same staging stream in `wire` order and their runs paired by staging offset, so any pair of
/// layouts works; when they line up (same heads and order) a run spans whole blocks and
/// consecutive pages.
pub fn pool_to_pool(
    src: PoolSide<'_>,
    dst: PoolSide<'_>,
    wire: PageOrder,
) -> Result<Vec<WriteRun>, KernelError> {
    let bytes = src.sel.bytes_in(src.layout)?;
    src.sel
        .validate_in(src.layout, src.num_pages, bytes, false)?;
    dst.sel
        .validate_in(dst.layout, dst.num_pages, bytes, true)?;
    // A plan lists its runs in pool order, which is staging order only when the pool and
    // the wire share an order: sort both by staging offset (they tile it without overlap).
    let by_staging = |mut runs: Vec<Run>| {
        runs.sort_unstable_by_key(|r| r.staging);
        runs
    };
    let from = by_staging(plan(src.geometry(), src.sel, wire)?);
    let to = by_staging(plan(dst.geometry(), dst.sel, wire)?);
    let mut out: Vec<WriteRun> = Vec::new();
    let (mut i, mut j) = (from.iter().copied(), to.iter().copied());
    let (mut a, mut b) = (i.next(), j.next());
    while let (Some(x), Some(y)) = (a.as_mut(), b.as_mut()) {
        // Both lists tile the same staging stream in order: their heads start together.
        let len = x.len.min(y.len);
        let run = WriteRun {
            src: x.pool as u64,
            dst: y.pool as u64,
            len: len as u64,
        };
        match out.last_mut() {
            Some(last) if last.src + last.len == run.src && last.dst + last.len == run.dst => {
                last.len += run.len;
            }
            _ => out.push(run),
        }
        for r in [x, y] {
            r.pool += len;
            r.staging += len;
            r.len -= len;
        }
        if a.is_some_and(|r| r.len == 0) {
            a = i.next();
        }
        if b.is_some_and(|r| r.len == 0) {
            b = j.next();
        }
    }
    Ok(out)
}

/// A selection of `pool` as the pieces of its staging stream: contiguous ranges of the pool in
/// `wire` order (offsets from its base, wherever its regions lie), each as long as the pool
/// allows. Sent one after the other they make the bytes a gather would have staged (a staged
/// chunk sent straight from the pool).
pub fn source_spans(
    pool: &HostPool,
    sel: &Selection<'_>,
    wire: PageOrder,
) -> Result<Vec<Span>, KernelError> {
    let g = Geometry::of(pool);
    spans_in(g.layout, g.num_pages, g.starts, sel, wire, false)
}

/// [`source_spans`] of a pool whose regions start at `starts` (offsets from the pool's base,
/// in the layout's region order; empty: back to back); `destination` refuses duplicate pages
/// as a scatter does.
pub fn spans_in(
    layout: &KvLayout,
    num_pages: usize,
    starts: &[usize],
    sel: &Selection<'_>,
    wire: PageOrder,
    destination: bool,
) -> Result<Vec<Span>, KernelError> {
    let bytes = sel.bytes_in(layout)?;
    sel.validate_in(layout, num_pages, bytes, destination)?;
    let geometry = Geometry {
        layout,
        num_pages,
        starts,
    };
    let mut runs = plan(geometry, sel, wire)?;
    runs.sort_unstable_by_key(|r| r.staging);
    let mut out: Vec<Span> = Vec::new();
    for r in runs {
        match out.last_mut() {
            Some(last) if last.offset + last.len == r.pool as u64 => last.len += r.len as u64,
            _ => out.push(Span {
                offset: r.pool as u64,
                len: r.len as u64,
            }),
        }
    }
    Ok(out)
}

/// Where the messages of a placed chunk land in a pool: `lens` cut the selection's bytes, in
/// `wire` order, into consecutive runs (the sender's), and each lands in the pieces of this
/// pool its bytes belong to, in order. Without `scatter` each run must be one contiguous piece
/// (a receiver that lands a run straight into one buffer); with it a run may cover several (a
/// receiver whose unpack callback copies each part of a message into place: head slices of
/// several token rows). The receiver computes the places from its own layout and pages, so a
/// sender only chooses how the bytes it was asked for are cut, never where they go.
pub fn placements(
    layout: &KvLayout,
    num_pages: usize,
    sel: &Selection<'_>,
    wire: PageOrder,
    lens: &[u64],
    scatter: bool,
) -> Result<Vec<Vec<Span>>, KernelError> {
    let total = lens
        .iter()
        .try_fold(0u64, |sum, &len| sum.checked_add(len))
        .and_then(|t| usize::try_from(t).ok())
        .unwrap_or(usize::MAX);
    sel.validate_in(layout, num_pages, total, true)?;
    let mut runs = plan(Geometry::back_to_back(layout, num_pages), sel, wire)?;
    runs.sort_unstable_by_key(|r| r.staging);
    let mut runs = runs.into_iter();
    let mut current = runs.next();
    let (mut out, mut at) = (Vec::with_capacity(lens.len()), 0usize);
    for &len in lens {
        let mut pieces: Vec<Span> = Vec::with_capacity(1);
        let mut left = usize::try_from(len).unwrap_or(usize::MAX);
        while let Some(r) = current.as_mut().filter(|_| left > 0) {
            let take = left.min(r.len);
            match pieces.last_mut() {
                Some(p) if p.offset + p.len == r.pool as u64 => p.len += take as u64,
                Some(_) if !scatter => break,
                _ => pieces.push(Span {
                    offset: r.pool as u64,
                    len: take as u64,
                }),
            }
            (r.pool, r.len, left) = (r.pool + take, r.len - take, left - take);
            if r.len == 0 {
                current = runs.next();
            }
        }
        if len == 0 || left > 0 {
            return Err(KernelError::NotContiguous { at, len });
        }
        out.push(pieces);
        at += len as usize;
    }
    Ok(out)
}

/// Splits runs into `parts` shares of about `total / parts` bytes, cutting runs where needed.
fn split(runs: &[Run], total: usize, parts: usize) -> Vec<Vec<Run>> {
    let target = total.div_ceil(parts);
    let mut shares = vec![Vec::new()];
    let mut filled = 0;
    for &run in runs {
        let mut run = run;
        while run.len > 0 {
            if filled == target {
                shares.push(Vec::new());
                filled = 0;
            }
            let take = run.len.min(target - filled);
            if let Some(share) = shares.last_mut() {
                share.push(Run { len: take, ..run });
            }
            filled += take;
            run.pool += take;
            run.staging += take;
            run.len -= take;
        }
    }
    shares
}

/// From this many runs in each list per thread, [`CpuKernel::write_runs`] shares a write out by
/// rows rather than by bytes.
const ROW_SHARE_MIN_RUNS: usize = 1024;

/// Rows `rows` of `runs` (the `k`-th run of each list in turn, lists that end early leaving
/// their place empty) as runs into destination `i` for list `i`, each checked against the
/// source pool and its destination's size, `sizes[i]`.
fn in_rows(
    src: &HostPool,
    runs: &[&[WriteRun]],
    sizes: &[usize],
    rows: std::ops::Range<usize>,
) -> Result<Vec<Run>, KernelError> {
    let outside = |side, r: &WriteRun, size| KernelError::RunOutside {
        side,
        offset: if side == "destination" { r.dst } else { r.src },
        len: r.len,
        size,
    };
    let mut planned = Vec::with_capacity(rows.len() * runs.len());
    for k in rows {
        for (to, list) in runs.iter().enumerate() {
            let Some(r) = list.get(k) else {
                continue;
            };
            let (s, d, len) = (r.src as usize, r.dst as usize, r.len as usize);
            if src.check(s, len).is_err() {
                return Err(outside("source pool", r, src.size()));
            }
            let size = sizes.get(to).copied().unwrap_or(0);
            if d.checked_add(len).is_none_or(|end| end > size) {
                return Err(outside("destination", r, size));
            }
            planned.push(Run {
                pool: s,
                staging: d,
                len,
                to,
            });
        }
    }
    Ok(planned)
}

#[cfg(test)]
mod tests;
