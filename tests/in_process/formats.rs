//! Every engine format against the engines' documented tensor shapes (numpy-style strides,
//! `common/reference.rs`, written apart from kvferry's layout arithmetic), and the CPU kernel
//! working in place over engine memory in every format: regions the "engine" allocated apart
//! from each other, gathered from and scattered into, checked byte for byte.

// Registering engine memory is `unsafe` by contract (the engine vouches for its buffers).
#![allow(unsafe_code)]

use crate::common;

use common::reference::{Dims, element_offsets, engine_offset};
use kvferry::kernel::Selection;
use kvferry::kernel::cpu::CpuKernel;
use kvferry::layout::{
    AttentionKind, FORMATS, Granularity, KvFormat, KvLayout, ModelSpec, PageOrder,
};
use kvferry::pool::{EngineRegion, HostPool};
use rand::{Rng, RngCore, SeedableRng};

/// Every format puts every (layer, plane, page, token, head) where the engine's documented
/// tensor shape puts it (numpy-style strides, `reference.rs`), for random cells.
#[test]
fn every_format_matches_the_engines_tensor_strides() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for format in FORMATS {
        let model = match format.only {
            Some(AttentionKind::Mla) => ModelSpec::preset("tiny-mla").unwrap(),
            _ => ModelSpec::preset("tiny").unwrap(),
        };
        for page_size in [1, 16, 128] {
            let layout = KvLayout::new(model, page_size)
                .unwrap()
                .with_format(format)
                .unwrap();
            let pages = 7;
            let dims = Dims {
                layers: layout.num_layers(),
                planes: layout.planes(),
                pages,
                page_size,
                heads: layout.num_heads(),
                head_bytes: layout.head_bytes(),
            };
            assert_eq!(
                layout.region_bytes(pages).unwrap() * layout.num_regions(),
                layout.pool_bytes(pages).unwrap(),
                "{}",
                format.name
            );
            for _ in 0..500 {
                let l = rng.random_range(0..dims.layers);
                let p = rng.random_range(0..dims.planes);
                let page = rng.random_range(0..pages);
                let h = rng.random_range(0..dims.heads);
                // vLLM CPU's K is transposed: only the start of a head's K block is a place.
                let t = match (format.order, p) {
                    (PageOrder::VllmCpuVec, 0) => 0,
                    (PageOrder::VllmCpuAmx, _) => 0,
                    _ => rng.random_range(0..page_size),
                };
                let (region, offset) = layout.plane_location(l, p, pages).unwrap();
                let ours = (
                    region,
                    offset + page * layout.page_stride().unwrap() + layout.element_offset(t, h),
                );
                let theirs = engine_offset(format.name, dims, (l, p, page, t, h));
                assert_eq!(
                    ours, theirs,
                    "{} page size {page_size}: layer {l} plane {p} page {page} token {t} head {h}",
                    format.name
                );
            }
        }
    }
}

/// The engine's allocations: one buffer per region, apart from each other.
struct Engine {
    buffers: Vec<Vec<u8>>,
}

impl Engine {
    fn new(layout: &KvLayout, pages: usize, rng: &mut impl RngCore) -> Engine {
        let size = layout.region_bytes(pages).unwrap();
        let buffers = (0..layout.num_regions())
            .map(|_| {
                let mut b = vec![0u8; size];
                rng.fill_bytes(&mut b);
                b
            })
            .collect();
        Engine { buffers }
    }

    /// A pool over the buffers. The buffers outlive the pool (it is dropped first).
    fn pool(&mut self, layout: &KvLayout, pages: usize) -> HostPool {
        let regions = common::reference::regions(&mut self.buffers);
        // SAFETY: the buffers stay allocated and unmoved while the pool lives (each test drops
        // the pool before the engine), and nothing references them meanwhile.
        unsafe { HostPool::engine(layout.clone(), pages, &regions) }.unwrap()
    }
}

fn layout_of(format: &KvFormat, page_size: usize) -> KvLayout {
    let model = match format.only {
        Some(AttentionKind::Mla) => ModelSpec::preset("tiny-mla").unwrap(),
        _ => ModelSpec::preset("tiny").unwrap(),
    };
    KvLayout::new(model, page_size)
        .unwrap()
        .with_format(format)
        .unwrap()
}

fn dims(layout: &KvLayout, pages: usize) -> Dims {
    Dims {
        layers: layout.num_layers(),
        planes: layout.planes(),
        pages,
        page_size: layout.page_size,
        heads: layout.num_heads(),
        head_bytes: layout.head_bytes(),
    }
}

/// Where each unit of a selection sits in staging, and where the engine keeps it: token rows
/// (`[layer][plane][token][head]`, token-major wire) for token-granular formats, whole head
/// slices of whole pages (`[layer][plane][page][head]`) for vLLM CPU.
fn units(format: &KvFormat, d: Dims, sel: &Selection<'_>) -> Vec<(usize, (usize, usize), usize)> {
    let (bs, hb) = (d.page_size, d.head_bytes);
    let mut out = Vec::new();
    let mut staging = 0;
    for l in sel.layers.clone() {
        for p in 0..d.planes {
            match format.order {
                PageOrder::VllmCpuVec | PageOrder::VllmCpuAmx => {
                    for page in sel.tokens.start / bs..sel.tokens.end.div_ceil(bs) {
                        for h in sel.heads.clone() {
                            let cell = (l, p, sel.pages[page] as usize, 0, h);
                            out.push((staging, engine_offset(format.name, d, cell), bs * hb));
                            staging += bs * hb;
                        }
                    }
                }
                _ => {
                    for t in sel.tokens.clone() {
                        for h in sel.heads.clone() {
                            let cell = (l, p, sel.pages[t / bs] as usize, t % bs, h);
                            out.push((staging, engine_offset(format.name, d, cell), hb));
                            staging += hb;
                        }
                    }
                }
            }
        }
    }
    out
}

/// A selection of `tokens` in the source's pages and the same in the destination's: a random
/// tail of the layers and a random range of the heads.
fn selections<'a>(
    rng: &mut impl Rng,
    d: Dims,
    (src_pages, dst_pages): (&'a [u32], &'a [u32]),
    tokens: std::ops::Range<usize>,
) -> (Selection<'a>, Selection<'a>) {
    let h0 = rng.random_range(0..d.heads);
    let src = Selection {
        pages: src_pages,
        tokens,
        layers: rng.random_range(0..d.layers)..d.layers,
        heads: h0..rng.random_range(h0 + 1..=d.heads),
    };
    let dst = Selection {
        pages: dst_pages,
        ..src.clone()
    };
    (src, dst)
}

/// For every format and page size: a random selection of an engine's regions gathers into the
/// bytes the engine's tensors hold there, and scatters into another engine's regions exactly
/// there, leaving every other byte of them as it was.
#[test]
fn gather_and_scatter_work_in_place_in_every_engine_format() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let kernel = CpuKernel::new(2);
    for format in FORMATS {
        for page_size in [1, 16] {
            let layout = layout_of(format, page_size);
            let pages = 24;
            let d = dims(&layout, pages);
            let mut source = Engine::new(&layout, pages, &mut rng);
            let mut dest = Engine::new(&layout, pages, &mut rng);
            let before = dest.buffers.clone();
            for round in 0..20 {
                let tokens_total = rng.random_range(1..=pages * page_size / 2);
                let mut table: Vec<u32> = (0..pages as u32).collect();
                let mut other = table.clone();
                rand::seq::SliceRandom::shuffle(&mut table[..], &mut rng);
                rand::seq::SliceRandom::shuffle(&mut other[..], &mut rng);
                let n = tokens_total.div_ceil(page_size);
                let (src_pages, dst_pages) = (&table[..n], &other[..n]);
                // Head-granular pieces start on a page boundary.
                let start = match format.order.granularity() {
                    Granularity::Head => rng.random_range(0..n) * page_size,
                    Granularity::Token => rng.random_range(0..tokens_total),
                };
                let (src_sel, dst_sel) =
                    selections(&mut rng, d, (src_pages, dst_pages), start..tokens_total);
                let what = format!("{} page size {page_size} round {round}", format.name);
                let src_pool = source.pool(&layout, pages);
                // Token rows on the wire for token-granular formats, whatever their own order.
                let wire = match format.order.granularity() {
                    Granularity::Head => format.order,
                    Granularity::Token => PageOrder::TokenMajor,
                };
                let mut staging = vec![0u8; src_sel.bytes(&src_pool, wire).unwrap()];
                kernel
                    .gather(&src_pool, &src_sel, wire, &mut staging)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                drop(src_pool);
                for (at, (region, offset), len) in units(format, d, &src_sel) {
                    assert_eq!(
                        staging[at..at + len],
                        source.buffers[region][offset..offset + len],
                        "{what}: gathered unit at staging {at}"
                    );
                }
                let dst_pool = dest.pool(&layout, pages);
                kernel
                    .scatter(&staging, wire, &dst_pool, &dst_sel)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                drop(dst_pool);
                let mut expected = before.clone();
                for (at, (region, offset), len) in units(format, d, &dst_sel) {
                    expected[region][offset..offset + len].copy_from_slice(&staging[at..at + len]);
                }
                for (r, (got, want)) in dest.buffers.iter().zip(&expected).enumerate() {
                    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                        panic!("{what}: region {r} byte {i} is {} not {}", got[i], want[i]);
                    }
                }
                dest.buffers.clone_from(&before);
            }
        }
    }
}

#[test]
fn engine_regions_that_do_not_fit_the_layout_are_refused() {
    let layout = layout_of(&KvFormat::named("sglang-mha").unwrap(), 16);
    let need = layout.region_bytes(8).unwrap();
    let mut buffers: Vec<Vec<u8>> = (0..layout.num_regions()).map(|_| vec![0; need]).collect();
    let mut regions = common::reference::regions(&mut buffers);
    let refused = |regions: &[EngineRegion]| {
        // SAFETY: refused before any byte is touched; the buffers outlive the call.
        unsafe { HostPool::engine(layout.clone(), 8, regions) }
            .unwrap_err()
            .to_string()
    };
    let e = refused(&regions[1..]);
    assert!(e.contains("spans 8 regions, 7 were given"), "{e}");
    regions[3].len -= 1;
    assert!(refused(&regions).contains("region 3"), "short region");
    regions[3].len += 1;
    regions[4].addr = regions[5].addr + 8;
    assert!(refused(&regions).contains("overlap"), "overlapping regions");
    regions[4].addr = buffers[4].as_mut_ptr() as usize;
    // SAFETY: as above; the pool is dropped before the buffers.
    let pool = unsafe { HostPool::engine(layout.clone(), 8, &regions) }.unwrap();
    assert_eq!(pool.region_starts().len(), 8);
    // A range that is not inside a region (the space between two allocations) is refused.
    let gap = pool.region_starts().iter().max().unwrap() + need;
    assert!(pool.read(gap, 1).is_err());
    drop(pool);
}

/// `vllm-cpu-vec` pools of other page sizes (vLLM CPU servers with other block sizes) move KV
/// re-blocked in `vllm_cpu_vec_span` order: every element of the selection lands where the
/// destination's vec layout keeps that token (K transposed within each block, so element by
/// element against `reference.rs`), for token ranges starting anywhere, and nothing else of
/// the destination changes.
#[test]
fn vllm_cpu_vec_pages_of_other_sizes_land_re_blocked_element_by_element() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let kernel = CpuKernel::new(2);
    let format = KvFormat::named("vllm-cpu-vec").unwrap();
    for (from, to) in [(32, 64), (64, 32), (16, 48), (128, 32)] {
        assert_eq!(
            kvferry::layout::wire_order(&layout_of(&format, from), &layout_of(&format, to)),
            Ok(PageOrder::VllmCpuVecSpan)
        );
        let (src_layout, dst_layout) = (layout_of(&format, from), layout_of(&format, to));
        let pages = 12;
        let (sd, dd) = (dims(&src_layout, pages), dims(&dst_layout, pages));
        let elem = src_layout.model.dtype.bytes();
        let mut source = Engine::new(&src_layout, pages, &mut rng);
        let mut dest = Engine::new(&dst_layout, pages, &mut rng);
        let before = dest.buffers.clone();
        for round in 0..10 {
            let most = pages * from.min(to);
            let tokens_total = rng.random_range(1..=most);
            let mut a: Vec<u32> = (0..pages as u32).collect();
            let mut b = a.clone();
            rand::seq::SliceRandom::shuffle(&mut a[..], &mut rng);
            rand::seq::SliceRandom::shuffle(&mut b[..], &mut rng);
            let (src_pages, dst_pages) = (
                &a[..tokens_total.div_ceil(from)],
                &b[..tokens_total.div_ceil(to)],
            );
            let start = rng.random_range(0..tokens_total);
            let (src_sel, dst_sel) =
                selections(&mut rng, sd, (src_pages, dst_pages), start..tokens_total);
            let (layers, heads) = (src_sel.layers.clone(), src_sel.heads.clone());
            let what = format!("{from} to {to} round {round}");
            let src_pool = source.pool(&src_layout, pages);
            let mut staging =
                vec![0u8; src_sel.bytes(&src_pool, PageOrder::VllmCpuVecSpan).unwrap()];
            kernel
                .gather(&src_pool, &src_sel, PageOrder::VllmCpuVecSpan, &mut staging)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            drop(src_pool);
            let dst_pool = dest.pool(&dst_layout, pages);
            kernel
                .scatter(&staging, PageOrder::VllmCpuVecSpan, &dst_pool, &dst_sel)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            drop(dst_pool);
            let mut expected = before.clone();
            for l in layers.clone() {
                for p in 0..2 {
                    for t in start..tokens_total {
                        for h in heads.clone() {
                            let src_cell = (l, p, src_pages[t / from] as usize, t % from, h);
                            let dst_cell = (l, p, dst_pages[t / to] as usize, t % to, h);
                            let (sr, so) = element_offsets(format.name, sd, elem, src_cell);
                            let (dr, dst_offsets) =
                                element_offsets(format.name, dd, elem, dst_cell);
                            for (s, d) in so.into_iter().zip(dst_offsets) {
                                expected[dr][d..d + elem]
                                    .copy_from_slice(&source.buffers[sr][s..s + elem]);
                            }
                        }
                    }
                }
            }
            for (r, (got, want)) in dest.buffers.iter().zip(&expected).enumerate() {
                if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                    panic!("{what}: region {r} byte {i} is {} not {}", got[i], want[i]);
                }
            }
            dest.buffers.clone_from(&before);
        }
    }
    // amx tiles move only between pages of one size.
    let amx = KvFormat::named("vllm-cpu-amx").unwrap();
    let why = kvferry::layout::wire_order(&layout_of(&amx, 32), &layout_of(&amx, 64)).unwrap_err();
    assert!(why.contains("page_size must match"), "{why}");
}
