//! The CPU transfer kernel against a per-element reference: every layout kind, page order,
//! placement and dtype width, random page lists and sub-ranges, poisoned destinations, every
//! byte checked.

use kvferry::kernel::cpu::CpuKernel;
use kvferry::kernel::{KernelError, Selection};
use kvferry::layout::{
    AttentionKind, Dtype, KvLayout, KvPlacement, ModelSpec, PageOrder, element_offset,
};
use kvferry::pool::HostPool;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};

const POISON: u8 = 0xDE;
const ORDERS: [PageOrder; 2] = [PageOrder::TokenMajor, PageOrder::HeadMajor];
const PLACEMENTS: [KvPlacement; 3] = [
    KvPlacement::Planes,
    KvPlacement::Interleaved,
    KvPlacement::Cells,
];

fn rng() -> StdRng {
    let seed: u64 = rand::rng().random();
    println!("seed {seed} (rerun with KVFERRY_SEED={seed})");
    let seed = std::env::var("KVFERRY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(seed);
    StdRng::seed_from_u64(seed)
}

/// Models covering both attention kinds and every dtype width.
fn models() -> Vec<ModelSpec> {
    let mut v: Vec<ModelSpec> = Dtype::ALL
        .iter()
        .map(|&d| ModelSpec::mha(3, 5, 8, d))
        .collect();
    v.push(ModelSpec::preset("tiny").unwrap());
    v.push(ModelSpec::preset("tiny-mla").unwrap());
    v
}

/// (pool offset, staging offset) of every selected element, derived from the definitions.
fn reference(pool: &HostPool, sel: &Selection<'_>, wire: PageOrder) -> Vec<(usize, usize)> {
    let l = pool.layout();
    let (p, hb, nh) = (l.page_size, l.head_bytes(), sel.heads.len());
    let ntok = sel.tokens.len();
    let mut out = Vec::new();
    for (li, layer) in sel.layers.clone().enumerate() {
        for plane in 0..l.planes() {
            let plane_base = (li * l.planes() + plane) * ntok * nh * hb;
            for t in sel.tokens.clone() {
                let block_start = sel.tokens.start.max(t / p * p);
                let block_end = sel.tokens.end.min((t / p + 1) * p);
                let nt = block_end - block_start;
                let block_base = plane_base + (block_start - sel.tokens.start) * nh * hb;
                for (hi, h) in sel.heads.clone().enumerate() {
                    let staging =
                        block_base + element_offset(wire, t - block_start, hi, nt, nh, hb);
                    let pool_off = pool
                        .block_offset(layer, plane, sel.pages[t / p] as usize)
                        .unwrap()
                        + l.element_offset(t % p, h);
                    out.push((pool_off, staging));
                }
            }
        }
    }
    out
}

fn random_range(rng: &mut StdRng, n: usize) -> std::ops::Range<usize> {
    let a = rng.random_range(0..=n);
    let b = rng.random_range(0..=n);
    a.min(b)..a.max(b)
}

fn random_pages(rng: &mut StdRng, num_pages: usize, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..num_pages as u32).collect();
    all.shuffle(rng);
    // Sometimes a consecutive run, to exercise coalescing across pages.
    if rng.random_bool(0.3) {
        all.sort_unstable();
    }
    all.truncate(n);
    all
}

fn pool(layout: &KvLayout, pages: usize, rng: &mut StdRng) -> HostPool {
    let pool = HostPool::anonymous(layout.clone(), pages).unwrap();
    let mut bytes = vec![0u8; pool.size()];
    rng.fill_bytes(&mut bytes);
    pool.write(0, &bytes).unwrap();
    pool
}

#[test]
fn gather_matches_reference_and_scatter_round_trips_for_every_layout() {
    let mut rng = rng();
    let kernel = CpuKernel::new(2);
    let mut cases = 0;
    for model in models() {
        for order in ORDERS {
            for placement in PLACEMENTS {
                for dst_order in ORDERS {
                    for wire in ORDERS {
                        for _ in 0..3 {
                            let page_size = [1, 4, 16][rng.random_range(0..3)];
                            let src_layout = KvLayout::new(model, page_size)
                                .unwrap()
                                .with_order(order, placement)
                                .unwrap();
                            let dst_placement = PLACEMENTS[rng.random_range(0..PLACEMENTS.len())];
                            let dst_layout = src_layout
                                .clone()
                                .with_order(dst_order, dst_placement)
                                .unwrap();
                            round_trip(&mut rng, &kernel, &src_layout, &dst_layout, wire);
                            cases += 1;
                        }
                    }
                }
            }
        }
    }
    println!("{cases} cases");
}

fn round_trip(
    rng: &mut StdRng,
    kernel: &CpuKernel,
    src_layout: &KvLayout,
    dst_layout: &KvLayout,
    wire: PageOrder,
) {
    let num_pages = 11;
    let src = pool(src_layout, num_pages, rng);
    let n_pages = rng.random_range(0..=6);
    let src_pages = random_pages(rng, num_pages, n_pages);
    let dst_pages = random_pages(rng, num_pages, n_pages);
    let tokens = random_range(rng, n_pages * src_layout.page_size);
    let layers = random_range(rng, src_layout.num_layers());
    let heads = random_range(rng, src_layout.num_heads());
    let dst_h0 = rng.random_range(0..=dst_layout.num_heads() - heads.len());
    let src_sel = Selection {
        pages: &src_pages,
        tokens: tokens.clone(),
        layers: layers.clone(),
        heads: heads.clone(),
    };
    let dst_layers = {
        let l0 = rng.random_range(0..=dst_layout.num_layers() - layers.len());
        l0..l0 + layers.len()
    };
    let dst_sel = Selection {
        pages: &dst_pages,
        tokens,
        layers: dst_layers,
        heads: dst_h0..dst_h0 + heads.len(),
    };
    let ctx = format!(
        "{:?} {:?}->{:?} wire {:?} pages {src_pages:?}->{dst_pages:?} {src_sel:?} -> {dst_sel:?}",
        src_layout.model, src_layout.order, dst_layout.order, wire
    );

    let mut staging = vec![POISON; src_sel.bytes(&src, wire).unwrap()];
    kernel.gather(&src, &src_sel, wire, &mut staging).unwrap();
    let src_bytes = src.read(0, src.size()).unwrap();
    let hb = src_layout.head_bytes();
    let elements = reference(&src, &src_sel, wire);
    assert_eq!(elements.len() * hb, staging.len(), "{ctx}");
    for &(p, s) in &elements {
        assert_eq!(&staging[s..s + hb], &src_bytes[p..p + hb], "gather {ctx}");
    }

    let dst = HostPool::anonymous(dst_layout.clone(), num_pages).unwrap();
    dst.fill(POISON);
    kernel.scatter(&staging, wire, &dst, &dst_sel).unwrap();
    let mut expected = vec![POISON; dst.size()];
    for (&(p, _), &(d, s)) in elements.iter().zip(&reference(&dst, &dst_sel, wire)) {
        expected[d..d + hb].copy_from_slice(&src_bytes[p..p + hb]);
        assert_eq!(&staging[s..s + hb], &src_bytes[p..p + hb], "{ctx}");
    }
    let landed = dst.read(0, dst.size()).unwrap();
    if let Some(i) = (0..landed.len()).find(|&i| landed[i] != expected[i]) {
        panic!(
            "scatter: first wrong byte at {i} of {}: {ctx}",
            landed.len()
        );
    }
}

#[test]
fn empty_selections_move_nothing() {
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let pool = HostPool::anonymous(layout, 4).unwrap();
    pool.fill(POISON);
    let kernel = CpuKernel::default();
    let empty = Selection::whole(&pool, &[], 0);
    kernel
        .gather(&pool, &empty, PageOrder::TokenMajor, &mut [])
        .unwrap();
    kernel
        .scatter(&[], PageOrder::TokenMajor, &pool, &empty)
        .unwrap();
    let no_heads = Selection {
        heads: 1..1,
        ..Selection::whole(&pool, &[0, 1], 20)
    };
    assert_eq!(no_heads.bytes(&pool, PageOrder::TokenMajor).unwrap(), 0);
    kernel
        .scatter(&[], PageOrder::TokenMajor, &pool, &no_heads)
        .unwrap();
    assert!(
        pool.read(0, pool.size())
            .unwrap()
            .iter()
            .all(|b| *b == POISON)
    );
}

#[test]
fn bad_selections_are_refused_before_any_byte_moves() {
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let pool = HostPool::anonymous(layout.clone(), 4).unwrap();
    pool.fill(POISON);
    let kernel = CpuKernel::default();
    let room_bytes = layout.room_bytes(32).unwrap();
    let staging = vec![7u8; room_bytes];
    let cases: Vec<(Selection<'_>, KernelError)> = vec![
        (
            Selection::whole(&pool, &[0, 4], 32),
            KernelError::PageOutOfRange {
                page: 4,
                num_pages: 4,
            },
        ),
        (
            Selection::whole(&pool, &[2, 2], 32),
            KernelError::DuplicatePage { page: 2 },
        ),
        (
            Selection::whole(&pool, &[1], 32),
            KernelError::TooFewPages {
                start: 0,
                end: 32,
                needed: 2,
                listed: 1,
            },
        ),
        (
            Selection {
                layers: 0..5,
                ..Selection::whole(&pool, &[0, 1], 32)
            },
            KernelError::RangeOutOfPool {
                what: "layers",
                start: 0,
                end: 5,
                held: 4,
            },
        ),
        (
            Selection {
                heads: 3..5,
                ..Selection::whole(&pool, &[0, 1], 32)
            },
            KernelError::RangeOutOfPool {
                what: "heads",
                start: 3,
                end: 5,
                held: 4,
            },
        ),
        (
            Selection::whole(&pool, &[0, 1], 31),
            KernelError::StagingSize {
                expected: room_bytes / 32 * 31,
                actual: room_bytes,
            },
        ),
    ];
    for (sel, want) in cases {
        let got = kernel.scatter(&staging, PageOrder::TokenMajor, &pool, &sel);
        assert_eq!(got, Err(want.clone()), "{sel:?}");
        println!("refused: {want}");
    }
    assert!(
        pool.read(0, pool.size())
            .unwrap()
            .iter()
            .all(|b| *b == POISON),
        "a refused scatter wrote into the pool"
    );
    // A gather may read a page twice; only destinations refuse duplicates.
    let mut out = vec![0u8; room_bytes];
    kernel
        .gather(
            &pool,
            &Selection::whole(&pool, &[2, 2], 32),
            PageOrder::TokenMajor,
            &mut out,
        )
        .unwrap();
    // Pages before the tokens are not touched, so they may repeat (the empty block an engine
    // leaves before a sliding window): only the touched page is written.
    let tail = Selection {
        tokens: 32..48,
        ..Selection::whole(&pool, &[0, 0, 3], 48)
    };
    let part = vec![9u8; tail.bytes(&pool, PageOrder::TokenMajor).unwrap()];
    kernel
        .scatter(&part, PageOrder::TokenMajor, &pool, &tail)
        .unwrap();
    let after = pool.read(0, pool.size()).unwrap();
    assert_eq!(after.iter().filter(|b| **b == 9).count(), part.len());
    assert_eq!(
        after.iter().filter(|b| **b == POISON).count(),
        pool.size() - part.len()
    );
}

#[test]
fn threaded_transfers_match_single_threaded_ones() {
    let mut rng = rng();
    let layout = KvLayout::new(ModelSpec::preset("llama3-8b").unwrap(), 16).unwrap();
    assert_eq!(layout.model.kind, AttentionKind::Mha);
    let num_pages = 40;
    let src = pool(&layout, num_pages, &mut rng);
    let pages = random_pages(&mut rng, num_pages, 32);
    // Heads 1..7 of 8: runs of 1.5 KiB at odd offsets; over 40 MiB, so copies stream.
    let sel = Selection {
        heads: 1..7,
        tokens: 5..500,
        ..Selection::whole(&src, &pages, 500)
    };
    let bytes = sel.bytes(&src, PageOrder::TokenMajor).unwrap();
    assert!(
        bytes > 40 << 20,
        "large enough to be split and streamed: {bytes}"
    );
    let mut one = vec![POISON; bytes];
    let mut two = vec![0u8; bytes];
    CpuKernel::new(1)
        .gather(&src, &sel, PageOrder::TokenMajor, &mut one)
        .unwrap();
    CpuKernel::new(2)
        .gather(&src, &sel, PageOrder::TokenMajor, &mut two)
        .unwrap();
    assert!(one == two, "threaded gather differs");
    let dst = HostPool::anonymous(layout, num_pages).unwrap();
    dst.fill(POISON);
    CpuKernel::new(2)
        .scatter(&two, PageOrder::TokenMajor, &dst, &sel)
        .unwrap();
    let mut back = vec![0u8; bytes];
    CpuKernel::new(1)
        .gather(&dst, &sel, PageOrder::TokenMajor, &mut back)
        .unwrap();
    assert!(back == one, "threaded scatter differs");
}
