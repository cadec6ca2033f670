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
        // SAFETY: every run lies inside the pool (the selection was validated against it and
        // the layout's offsets stay within `pool_bytes`) and inside `staging` (its length equals
        // the selection's bytes, which the runs tile exactly). `staging` is exclusively
        // borrowed and is not pool memory, so source and destination do not overlap.
        unsafe { self.copy(&runs, src, dst, |r| (r.pool, r.staging)) };
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
        // SAFETY: as in `gather`; additionally the destination pages are distinct (validated),
        // so no two runs write the same pool bytes, and the agent's page ownership guarantees
        // nothing else writes these pages meanwhile.
        unsafe { self.copy(&runs, src, dst, |r| (r.staging, r.pool)) };
        Ok(())
    }

    /// Copies every run from `src` to `dst`; `ends` picks (source, destination) offsets.
    ///
    /// # Safety
    /// Every run must lie inside both buffers, the buffers must not overlap, and no two runs
    /// may write the same destination bytes.
    unsafe fn copy(&self, runs: &[Run], src: Ptr, dst: Ptr, ends: fn(&Run) -> (usize, usize)) {
        let total: usize = runs.iter().map(|r| r.len).sum();
        let parts = self.threads.min(total / PARALLEL_MIN_BYTES.max(1)).max(1);
        // Transfers beyond the last-level cache stream their stores: the destination is not
        // read first (read-for-ownership), as glibc's memcpy does for one large buffer.
        let stream = total >= STREAM_MIN_BYTES;
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

/// From this many bytes a transfer streams its stores: measured here, 8 MiB copies are faster
/// through the cache and 16 MiB ones faster streamed.
const STREAM_MIN_BYTES: usize = 16 << 20;

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
        assert!(runs.iter().all(|r| r.len == 10 * 32768));
        // Head-major pools coalesce the same way when whole pages are selected.
        let runs = plan(&llama(PageOrder::HeadMajor), 64, &sel, PageOrder::HeadMajor);
        assert_eq!(runs.len(), 64);
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
