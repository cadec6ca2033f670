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
//! async callers run it on a blocking thread, never on the reactor.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

use crate::layout::PageOrder;
use crate::pool::HostPool;

use super::{KernelError, Selection};
use crate::memory::WriteRun;

mod plan;
use plan::{Geometry, Run, plan};
pub use plan::{PoolSide, placements, pool_to_pool, source_spans, spans_in};

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
        sel.validate(pool, wire, staging.len(), false)?;
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
        sel.validate(pool, wire, total, true)?;
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
        let bytes = sel.bytes(pool, wire)?;
        sel.validate(pool, wire, bytes, false)?;
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
/// of many GiB, cold, while a gather fills a staging slot that the sender reads next. Into a
/// large buffer, pieces of 1 KiB (the heterogeneous-TP head slices) as of 1 MiB go much faster
/// streamed than with memcpy; into a buffer small enough to stay in the cache, ordinary stores
/// win (docs/benchmarks.md, "CPU transfer kernel" and "Figures behind design choices": the
/// scatter of 1 MiB chunks into a cold 1 GiB pool, `cargo bench --bench kernel -- 1GiB-pool`).
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
#[cfg(feature = "ucx")]
pub(crate) unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_run(src, dst, len, true) }
}

/// Orders the stores of [`copy_streaming`] before what follows.
#[cfg(feature = "ucx")]
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
