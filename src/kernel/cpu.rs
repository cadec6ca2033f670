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

use crate::layout::{KvLayout, PageOrder, element_offset};
use crate::pool::HostPool;

use super::{KernelError, Selection};
use crate::transport::{Span, WriteRun};

/// Below this many bytes a transfer runs on one thread: spawning costs more than it saves.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

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
        let runs = plan(pool.layout(), pool.num_pages(), sel, wire);
        let src = Ptr(pool.base_ptr());
        let dst = Ptr(staging.as_mut_ptr());
        let stream = streams(staging.len());
        // SAFETY: every run lies inside the pool (the selection was validated against it and
        // the layout's offsets stay within `pool_bytes`) and inside `staging` (its length equals
        // the selection's bytes, which the runs tile exactly). `staging` is exclusively
        // borrowed and is not pool memory, so source and destination do not overlap.
        unsafe { self.copy(&runs, src, dst, stream, |r| (r.pool, r.staging)) };
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
        sel.validate(pool, staging.len(), true)?;
        let runs = plan(pool.layout(), pool.num_pages(), sel, wire);
        let src = Ptr(staging.as_ptr().cast_mut());
        let dst = Ptr(pool.base_ptr());
        let stream = streams(pool.size());
        // SAFETY: as in `gather`; additionally the destination pages are distinct (validated),
        // so no two runs write the same pool bytes, and the agent's page ownership guarantees
        // nothing else writes these pages meanwhile.
        unsafe { self.copy(&runs, src, dst, stream, |r| (r.staging, r.pool)) };
        Ok(())
    }

    /// xxh3-64 of the selection's bytes in `wire` order (the bytes a gather would produce),
    /// read in place: how the direct path checksums a chunk without staging it.
    pub fn checksum(
        &self,
        pool: &HostPool,
        sel: &Selection<'_>,
        wire: PageOrder,
    ) -> Result<u64, KernelError> {
        let bytes = sel.bytes(pool)?;
        sel.validate(pool, bytes, false)?;
        let mut runs = plan(pool.layout(), pool.num_pages(), sel, wire);
        runs.sort_unstable_by_key(|r| r.staging); // hash in wire order (see `pool_to_pool`)
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        for r in runs {
            // SAFETY: the run lies inside the pool (validated selection). The agents hash a
            // selection only while its pages are theirs and quiescent: a prefill's ready
            // pages, or a decode room's pages after the writer flushed them.
            let run = unsafe { std::slice::from_raw_parts(pool.base_ptr().add(r.pool), r.len) };
            hasher.update(run);
        }
        Ok(hasher.digest())
    }

    /// Copies every run from `src` to `dst`, with streaming stores when `stream` ([`streams`]);
    /// `ends` picks (source, destination) offsets.
    ///
    /// # Safety
    /// Every run must lie inside both buffers, the buffers must not overlap, and no two runs
    /// may write the same destination bytes.
    unsafe fn copy(
        &self,
        runs: &[Run],
        src: Ptr,
        dst: Ptr,
        stream: bool,
        ends: fn(&Run) -> (usize, usize),
    ) {
        let total: usize = runs.iter().map(|r| r.len).sum();
        let parts = self.threads.min(total / PARALLEL_MIN_BYTES.max(1)).max(1);
        let copy_all = |runs: &[Run]| {
            for r in runs {
                let (s, d) = ends(r);
                // SAFETY: guaranteed by the caller for every run.
                unsafe { copy_run(src.at(s), dst.at(d), r.len, stream) };
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

/// One contiguous copy: `len` bytes at `pool` in the pool and at `staging` in staging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    pool: usize,
    staging: usize,
    len: usize,
}

/// Appends a run, merging it into the previous one when both sides continue contiguously.
fn push(runs: &mut Vec<Run>, run: Run) {
    if let Some(last) = runs.last_mut() {
        if last.pool + last.len == run.pool && last.staging + last.len == run.staging {
            last.len += run.len;
            return;
        }
    }
    runs.push(run);
}

/// Plans a validated selection of a pool as coalesced runs in staging order.
fn plan(layout: &KvLayout, num_pages: usize, sel: &Selection<'_>, wire: PageOrder) -> Vec<Run> {
    let page_size = layout.page_size;
    let held = layout.num_heads();
    let hb = layout.head_bytes();
    let nh = sel.heads.len();
    let h0 = sel.heads.start;
    // Validated layouts have a valid stride; the fallback is never taken.
    let stride = layout.page_stride().unwrap_or(0);
    let mut runs = Vec::new();
    let mut staging = 0;
    for layer in sel.layers.clone() {
        for plane in 0..layout.planes() {
            let plane_base = layout.plane_offset(layer, plane, num_pages);
            let mut t = sel.tokens.start;
            while t < sel.tokens.end {
                let in_page = t % page_size;
                let nt = (page_size - in_page).min(sel.tokens.end - t);
                let block = plane_base + sel.pages[t / page_size] as usize * stride;
                let pool_at = |tok: usize, h: usize| {
                    block + element_offset(layout.order, in_page + tok, h0 + h, page_size, held, hb)
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
                        },
                    )
                };
                match (layout.order, wire) {
                    (PageOrder::TokenMajor, PageOrder::TokenMajor) if nh == held => {
                        emit(0, 0, nt * nh * hb)
                    }
                    (PageOrder::TokenMajor, PageOrder::TokenMajor) => {
                        (0..nt).for_each(|tok| emit(tok, 0, nh * hb))
                    }
                    (PageOrder::HeadMajor, PageOrder::HeadMajor) => {
                        (0..nh).for_each(|h| emit(0, h, nt * hb))
                    }
                    _ => (0..nt).for_each(|tok| (0..nh).for_each(|h| emit(tok, h, hb))),
                }
                staging += nt * nh * hb;
                t += nt;
            }
        }
    }
    runs
}

/// One side of a copy from pool to pool: a pool's layout and page count (it may be in another
/// process) and the selection in it.
#[derive(Clone, Copy, Debug)]
pub struct PoolSide<'a> {
    /// The pool's layout.
    pub layout: &'a KvLayout,
    /// Pages in the pool.
    pub num_pages: usize,
    /// What moves.
    pub sel: &'a Selection<'a>,
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
    let from = by_staging(plan(src.layout, src.num_pages, src.sel, wire));
    let to = by_staging(plan(dst.layout, dst.num_pages, dst.sel, wire));
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

/// A selection of a pool as the pieces of its staging stream: contiguous ranges of the pool in
/// `wire` order, each as long as the pool allows. Sent one after the other they make the bytes
/// a gather would have staged (a staged chunk sent straight from the pool).
pub fn source_spans(
    layout: &KvLayout,
    num_pages: usize,
    sel: &Selection<'_>,
    wire: PageOrder,
) -> Result<Vec<Span>, KernelError> {
    let bytes = sel.bytes_in(layout)?;
    sel.validate_in(layout, num_pages, bytes, false)?;
    let mut runs = plan(layout, num_pages, sel, wire);
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
/// `wire` order, into consecutive runs (the sender's, from [`pool_to_pool`]), and each must be
/// contiguous in this pool. The receiver computes the places from its own layout and pages, so
/// a sender only chooses how the bytes it was asked for are cut, never where they go.
pub fn placements(
    layout: &KvLayout,
    num_pages: usize,
    sel: &Selection<'_>,
    wire: PageOrder,
    lens: &[u64],
) -> Result<Vec<Span>, KernelError> {
    let total = lens
        .iter()
        .try_fold(0u64, |sum, &len| sum.checked_add(len))
        .and_then(|t| usize::try_from(t).ok())
        .unwrap_or(usize::MAX);
    sel.validate_in(layout, num_pages, total, true)?;
    let mut runs = plan(layout, num_pages, sel, wire);
    runs.sort_unstable_by_key(|r| r.staging);
    let mut runs = runs.into_iter();
    let mut current = runs.next();
    let (mut out, mut at) = (Vec::with_capacity(lens.len()), 0usize);
    for &len in lens {
        let (start, mut end, mut left) = (current.map_or(0, |r| r.pool), None, len as usize);
        while left > 0 {
            match current.as_mut() {
                Some(r) if end.is_none_or(|e| e == r.pool) => {
                    let take = left.min(r.len);
                    (r.pool, r.len, left) = (r.pool + take, r.len - take, left - take);
                    end = Some(r.pool);
                    if r.len == 0 {
                        current = runs.next();
                    }
                }
                _ => break,
            }
        }
        if len == 0 || left > 0 {
            return Err(KernelError::NotContiguous { at, len });
        }
        out.push(Span {
            offset: start as u64,
            len,
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvPlacement, ModelSpec};

    fn llama(order: PageOrder) -> KvLayout {
        KvLayout::new(ModelSpec::preset("llama3-8b").unwrap(), 16)
            .unwrap()
            .with_order(order, KvPlacement::Planes)
            .unwrap()
    }

    #[test]
    fn whole_heads_and_consecutive_pages_coalesce_into_one_run_per_plane() {
        let l = llama(PageOrder::TokenMajor);
        let pages: Vec<u32> = (10..20).collect();
        let sel = Selection {
            pages: &pages,
            tokens: 0..160,
            layers: 0..32,
            heads: 0..8,
        };
        let runs = plan(&l, 64, &sel, PageOrder::TokenMajor);
        assert_eq!(runs.len(), 64, "one run per (layer, plane)");
        // Sent from the pool: one span per (layer, plane) too (the planes are apart).
        let spans = source_spans(&l, 64, &sel, PageOrder::TokenMajor).unwrap();
        assert_eq!(spans.len(), 64);
        assert!(spans.iter().all(|s| s.len == 10 * 32768));
        // Pages out of range are refused, as by a gather.
        let far = [64u32];
        let bad = Selection {
            pages: &far,
            tokens: 0..16,
            layers: 0..1,
            heads: 0..8,
        };
        assert!(source_spans(&l, 64, &bad, PageOrder::TokenMajor).is_err());
        assert!(runs.iter().all(|r| r.len == 10 * 32768));
        // Head-major pools coalesce the same way when whole pages are selected.
        let runs = plan(&llama(PageOrder::HeadMajor), 64, &sel, PageOrder::HeadMajor);
        assert_eq!(runs.len(), 64);
    }

    /// Applies `runs` from `src` to `dst` the way a one-sided write would.
    fn apply(runs: &[WriteRun], src: &HostPool, dst: &HostPool) {
        for r in runs {
            let bytes = src.read(r.src as usize, r.len as usize).unwrap();
            dst.write(r.dst as usize, &bytes).unwrap();
        }
    }

    #[test]
    fn pool_to_pool_writes_land_what_gather_then_scatter_lands() {
        use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};
        let model = ModelSpec::preset("tiny").unwrap(); // 4 layers, 4 heads
        let mut rng = StdRng::seed_from_u64(9);
        let cases = 300;
        for case in 0..cases {
            let page_size = [1, 4, 16][rng.random_range(0..3)];
            let order = |rng: &mut StdRng| {
                [PageOrder::TokenMajor, PageOrder::HeadMajor][rng.random_range(0..2)]
            };
            let (src_order, dst_order, wire) = (order(&mut rng), order(&mut rng), order(&mut rng));
            // The prefill holds a head slice (TP) and the decode another that overlaps it.
            let src_heads = [0..4, 0..2, 2..4][rng.random_range(0..3)].clone();
            let dst_heads = [0..4, src_heads.clone()][rng.random_range(0..2)].clone();
            let heads = src_heads.start.max(dst_heads.start)..src_heads.end.min(dst_heads.end);
            let layout = |order, heads: std::ops::Range<usize>| {
                KvLayout::new(model, page_size)
                    .unwrap()
                    .with_order(order, KvPlacement::Planes)
                    .unwrap()
                    .with_slice(heads, 0..4)
                    .unwrap()
            };
            let (sl, dl) = (
                layout(src_order, src_heads.clone()),
                layout(dst_order, dst_heads.clone()),
            );
            let tokens_total = rng.random_range(1..40usize);
            let pages = tokens_total.div_ceil(page_size);
            let (src_n, dst_n) = (
                pages + rng.random_range(0..4),
                pages + rng.random_range(0..4),
            );
            let pick = |n: usize, rng: &mut StdRng| {
                let mut all: Vec<u32> = (0..n as u32).collect();
                // Consecutive pages sometimes, to exercise coalescing across pages.
                if rng.random_bool(0.5) {
                    all.shuffle(rng);
                }
                all.truncate(pages);
                all
            };
            let (src_pages, dst_pages) = (pick(src_n, &mut rng), pick(dst_n, &mut rng));
            let start = rng.random_range(0..tokens_total);
            let layers = rng.random_range(0..2)..rng.random_range(2..5);
            let src_pool = HostPool::anonymous(sl.clone(), src_n).unwrap();
            let fill: Vec<u8> = (0..src_pool.size()).map(|i| (i * 7 + case) as u8).collect();
            src_pool.write(0, &fill).unwrap();
            let src = Selection {
                pages: &src_pages,
                tokens: start..tokens_total,
                layers: layers.clone(),
                heads: heads.start - src_heads.start..heads.end - src_heads.start,
            };
            let dst = Selection {
                pages: &dst_pages,
                tokens: start..tokens_total,
                layers: layers.clone(),
                heads: heads.start - dst_heads.start..heads.end - dst_heads.start,
            };
            let runs = pool_to_pool(
                PoolSide {
                    layout: &sl,
                    num_pages: src_n,
                    sel: &src,
                },
                PoolSide {
                    layout: &dl,
                    num_pages: dst_n,
                    sel: &dst,
                },
                wire,
            )
            .unwrap();
            let direct = HostPool::anonymous(dl.clone(), dst_n).unwrap();
            apply(&runs, &src_pool, &direct);
            let staged = HostPool::anonymous(dl.clone(), dst_n).unwrap();
            let k = CpuKernel::new(1);
            let mut buf = vec![0; src.bytes(&src_pool).unwrap()];
            k.gather(&src_pool, &src, wire, &mut buf).unwrap();
            k.scatter(&buf, wire, &staged, &dst).unwrap();
            // Sent straight from the pool, the source's spans make the gathered bytes.
            let spans = source_spans(&sl, src_n, &src, wire).unwrap();
            let mut sent = Vec::new();
            for s in &spans {
                sent.extend(src_pool.read(s.offset as usize, s.len as usize).unwrap());
            }
            assert!(
                sent == buf,
                "case {case}: source spans differ from the gather"
            );
            assert!(
                spans
                    .windows(2)
                    .all(|w| w[0].offset + w[0].len != w[1].offset)
            );
            let (d, st) = (
                direct.read(0, direct.size()).unwrap(),
                staged.read(0, staged.size()).unwrap(),
            );
            let first_diff = d.iter().zip(&st).position(|(a, b)| a != b);
            assert_eq!(
                first_diff, None,
                "case {case}: first differing byte of the pools"
            );
            // In place, the checksum of either side is the checksum of the staged bytes.
            let want = xxhash_rust::xxh3::xxh3_64(&buf);
            assert_eq!(k.checksum(&src_pool, &src, wire).unwrap(), want);
            assert_eq!(k.checksum(&direct, &dst, wire).unwrap(), want);
            // The receiver of placed runs finds the same places from the lengths alone.
            let lens: Vec<u64> = runs.iter().map(|r| r.len).collect();
            let places = placements(&dl, dst_n, &dst, wire, &lens).unwrap();
            let want: Vec<Span> = runs.iter().map(WriteRun::destination).collect();
            assert_eq!(places, want, "case {case}: placements");
        }
        println!("{cases} random pool-to-pool cases matched gather + scatter");
    }

    #[test]
    fn placements_refuse_runs_that_are_not_contiguous_or_do_not_add_up() {
        let l = llama(PageOrder::TokenMajor);
        let pages: Vec<u32> = vec![3, 1]; // not consecutive: each layer's plane is two runs
        let sel = Selection {
            pages: &pages,
            tokens: 0..32,
            layers: 0..1,
            heads: 0..8,
        };
        let page = 16 * 8 * 128 * 2; // one page of one plane of one layer
        let wire = PageOrder::TokenMajor;
        let exact = placements(&l, 4, &sel, wire, &[page; 4]).unwrap();
        assert_eq!(exact.len(), 4);
        assert!(exact.iter().all(|s| s.len == page));
        // A run across the gap between page 3 and page 1.
        let across = placements(&l, 4, &sel, wire, &[page / 2, page, page / 2, 2 * page]);
        assert_eq!(
            across,
            Err(KernelError::NotContiguous {
                at: page as usize / 2,
                len: page
            })
        );
        // Lengths that do not add up to the selection, and empty runs.
        assert!(matches!(
            placements(&l, 4, &sel, wire, &[page; 3]),
            Err(KernelError::StagingSize { .. })
        ));
        assert!(matches!(
            placements(&l, 4, &sel, wire, &[0, page, page, page, page]),
            Err(KernelError::NotContiguous { at: 0, len: 0 })
        ));
        assert!(matches!(
            placements(&l, 4, &sel, wire, &[u64::MAX, 2]),
            Err(KernelError::StagingSize { .. })
        ));
    }

    #[test]
    fn matching_layouts_write_whole_blocks_and_refuse_pages_out_of_range() {
        let l = llama(PageOrder::TokenMajor);
        let pages: Vec<u32> = (0..4).collect();
        let sel = Selection {
            pages: &pages,
            tokens: 0..64,
            layers: 0..32,
            heads: 0..8,
        };
        let side = |n, sel| PoolSide {
            layout: &l,
            num_pages: n,
            sel,
        };
        let runs = pool_to_pool(side(8, &sel), side(8, &sel), PageOrder::TokenMajor).unwrap();
        assert_eq!(
            runs.len(),
            64,
            "one run per (layer, plane): four consecutive pages"
        );
        assert!(runs.iter().all(|r| r.len == 4 * 32768));
        let far: Vec<u32> = vec![0, 1, 2, 99];
        let out = Selection {
            pages: &far,
            ..sel.clone()
        };
        assert!(matches!(
            pool_to_pool(side(8, &sel), side(8, &out), PageOrder::TokenMajor),
            Err(KernelError::PageOutOfRange { page: 99, .. })
        ));
    }

    #[test]
    fn head_slices_are_one_run_per_token_or_per_head() {
        let sel = Selection {
            pages: &[3],
            tokens: 0..16,
            layers: 0..1,
            heads: 2..6,
        };
        let tm = plan(
            &llama(PageOrder::TokenMajor),
            8,
            &sel,
            PageOrder::TokenMajor,
        );
        assert_eq!(tm.len(), 2 * 16);
        assert!(tm.iter().all(|r| r.len == 4 * 256));
        // Head-major: a head slice of a page is contiguous, so one run per plane.
        let hm = plan(&llama(PageOrder::HeadMajor), 8, &sel, PageOrder::HeadMajor);
        assert_eq!(hm.len(), 2);
        assert!(hm.iter().all(|r| r.len == 4 * 16 * 256));
    }

    #[test]
    fn streamed_copies_match_plain_ones_at_every_alignment() {
        let src: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in [0usize, 1, 15, 63, 64, 255, 256, 257, 1000, 3000] {
            for src_off in [0usize, 1, 7, 16] {
                for dst_off in [0usize, 3, 16, 33] {
                    let mut dst = vec![0xDEu8; 4096 + 64];
                    // SAFETY: both ranges lie inside their vectors, which do not overlap.
                    unsafe {
                        copy_run(
                            src.as_ptr().add(src_off),
                            dst.as_mut_ptr().add(dst_off),
                            len,
                            true,
                        )
                    };
                    fence();
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "{len} {src_off} {dst_off}"
                    );
                    assert!(dst[..dst_off].iter().all(|b| *b == 0xDE));
                    assert!(dst[dst_off + len..].iter().all(|b| *b == 0xDE));
                }
            }
        }
    }

    #[test]
    fn head_slices_scattered_into_a_pool_that_streams_land_exactly() {
        // 16 pages of llama3-8b are 32 MiB: scatters into this pool stream their stores,
        // whatever the chunk's size.
        let pool = HostPool::anonymous(llama(PageOrder::TokenMajor), 16).unwrap();
        assert!(streams(pool.size()) && !streams(1 << 20));
        pool.fill(0xDE);
        let pages = [9u32, 2, 14];
        let sel = Selection {
            pages: &pages,
            tokens: 5..40,
            layers: 3..5,
            heads: 2..6,
        };
        let chunk: Vec<u8> = (0..sel.bytes(&pool).unwrap() as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let kernel = CpuKernel::new(1);
        kernel
            .scatter(&chunk, PageOrder::TokenMajor, &pool, &sel)
            .unwrap();
        let mut back = vec![0u8; chunk.len()];
        kernel
            .gather(&pool, &sel, PageOrder::TokenMajor, &mut back)
            .unwrap();
        assert_eq!(back, chunk);
        // Every other byte of the pool kept its fill.
        let landed: usize = plan(pool.layout(), 16, &sel, PageOrder::TokenMajor)
            .iter()
            .map(|r| r.len)
            .sum();
        // SAFETY: the pool is this test's alone and no copy is running.
        let all = unsafe { std::slice::from_raw_parts(pool.base_ptr(), pool.size()) };
        let kept = all.iter().filter(|b| **b == 0xDE).count();
        let landed_de = chunk.iter().filter(|b| **b == 0xDE).count();
        assert_eq!(kept + landed - landed_de, pool.size());
    }

    #[test]
    fn split_cuts_runs_into_equal_shares() {
        let runs = [
            Run {
                pool: 0,
                staging: 0,
                len: 10,
            },
            Run {
                pool: 100,
                staging: 10,
                len: 5,
            },
        ];
        let shares = split(&runs, 15, 2);
        assert_eq!(shares.len(), 2);
        assert_eq!(
            shares[0],
            vec![Run {
                pool: 0,
                staging: 0,
                len: 8
            }]
        );
        assert_eq!(
            shares[1],
            vec![
                Run {
                    pool: 8,
                    staging: 8,
                    len: 2
                },
                Run {
                    pool: 100,
                    staging: 10,
                    len: 5
                }
            ]
        );
    }
}
