//! Planning copies as runs: where a selection of a pool lies, in staging order
//! ([`plan`]), how two pools' selections pair up ([`pool_to_pool`]), and where a sender's
//! runs land in a receiver's pages ([`placements`]).

use crate::kernel::{KernelError, Selection};
use crate::layout::{Granularity, KvLayout, LayoutError, PageOrder, element_offset};
use crate::memory::{Span, WriteRun};
use crate::pool::HostPool;

/// One contiguous copy: `len` bytes at `pool` in the pool and at `staging` in staging, the
/// `to`-th of the copy's destinations (0 but for a write into several pools at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) pool: usize,
    pub(super) staging: usize,
    pub(super) len: usize,
    pub(super) to: usize,
}

/// Appends a run, merging it into the previous one when both sides continue contiguously.
fn push(runs: &mut Vec<Run>, run: Run) {
    if let Some(last) = runs.last_mut()
        && last.pool + last.len == run.pool
        && last.staging + last.len == run.staging
        && last.to == run.to
    {
        last.len += run.len;
        return;
    }
    runs.push(run);
}

/// Where a pool's planes are: its layout, its pages, and where each of its regions starts
/// relative to the pool's base (empty: regions back to back, as in a pool of one mapping).
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry<'a> {
    pub(super) layout: &'a KvLayout,
    pub(super) num_pages: usize,
    pub(super) starts: &'a [usize],
}

impl<'a> Geometry<'a> {
    /// A pool whose regions lie back to back (one mapping; every pool exposed to peers).
    pub(super) fn back_to_back(layout: &'a KvLayout, num_pages: usize) -> Self {
        Geometry {
            layout,
            num_pages,
            starts: &[],
        }
    }

    pub(super) fn of(pool: &'a HostPool) -> Self {
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
pub(super) fn plan(
    pool: Geometry<'_>,
    sel: &Selection<'_>,
    wire: PageOrder,
) -> Result<Vec<Run>, LayoutError> {
    let layout = pool.layout;
    if wire == PageOrder::VllmCpuVecSpan {
        return plan_vec_span(pool, sel);
    }
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

/// [`plan`] of a `vllm_cpu_vec` pool in `vllm_cpu_vec_span` order (pages re-blocked between
/// page sizes): staging `[layer][head][K: dim x nt][V: nt x dim]` over the selection's `nt`
/// tokens, as one vec block of exactly those tokens. In the pool each head of a page holds K
/// `[dim][page_size]` (transposed) then V `[page_size][dim]`, so each page the tokens touch
/// gives one run of its tokens per K dim and one run of its V rows.
fn plan_vec_span(pool: Geometry<'_>, sel: &Selection<'_>) -> Result<Vec<Run>, LayoutError> {
    let layout = pool.layout;
    if layout.order != PageOrder::VllmCpuVec {
        return Err(LayoutError::Invalid {
            field: "wire order",
            reason: format!(
                "{} is a transfer between {} pools, not from {} pages",
                PageOrder::VllmCpuVecSpan,
                PageOrder::VllmCpuVec,
                layout.order
            ),
        });
    }
    let (page_size, held, hb) = (layout.page_size, layout.num_heads(), layout.head_bytes());
    let elem = layout.model.dtype.bytes();
    let dims = hb / elem;
    let nt = sel.tokens.len();
    let stride = layout.page_stride().unwrap_or(0);
    let mut runs = Vec::new();
    let mut staging = 0;
    for layer in sel.layers.clone() {
        let base = pool.plane_base(layer, 0)?;
        for h in sel.heads.clone() {
            let (k, v) = (staging, staging + nt * hb);
            let mut t = sel.tokens.start;
            while t < sel.tokens.end {
                let in_page = t % page_size;
                let n = (page_size - in_page).min(sel.tokens.end - t);
                let done = t - sel.tokens.start;
                let head = base
                    + sel.pages[t / page_size] as usize * stride
                    + element_offset(layout.order, 0, h, page_size, held, hb);
                for d in 0..dims {
                    push(
                        &mut runs,
                        Run {
                            pool: head + (d * page_size + in_page) * elem,
                            staging: k + (d * nt + done) * elem,
                            len: n * elem,
                            to: 0,
                        },
                    );
                }
                push(
                    &mut runs,
                    Run {
                        pool: head + page_size * hb + in_page * hb,
                        staging: v + done * hb,
                        len: n * hb,
                        to: 0,
                    },
                );
                t += n;
            }
            staging += 2 * nt * hb;
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
    let bytes = src.sel.bytes_in(src.layout, wire)?;
    src.sel
        .validate_in(src.layout, src.num_pages, wire, bytes, false)?;
    dst.sel
        .validate_in(dst.layout, dst.num_pages, wire, bytes, true)?;
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
    let bytes = sel.bytes_in(layout, wire)?;
    sel.validate_in(layout, num_pages, wire, bytes, destination)?;
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
    sel.validate_in(layout, num_pages, wire, total, true)?;
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
