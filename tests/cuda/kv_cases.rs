//! Random transfer cases shared by the CUDA kernel tests (host emulation and GPU): every
//! attention kind, dtype width, page order, placement and wire order, with head dims chosen so
//! that some cases take the 16-byte vector path and others the narrow and scalar paths.

#![allow(dead_code)]

use kvferry::kernel::Selection;
use kvferry::layout::{Dtype, KvLayout, KvPlacement, ModelSpec, PageOrder};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

pub(crate) const POISON: u8 = 0xDE;
pub(crate) const ORDERS: [PageOrder; 2] = [PageOrder::TokenMajor, PageOrder::HeadMajor];
pub(crate) const PLACEMENTS: [KvPlacement; 3] = [
    KvPlacement::Planes,
    KvPlacement::Interleaved,
    KvPlacement::Cells,
];

/// A fresh seeded generator; the seed is printed and `KVFERRY_SEED` replays it.
pub(crate) fn rng() -> StdRng {
    let seed: u64 = rand::rng().random();
    let seed = std::env::var("KVFERRY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(seed);
    println!("seed {seed} (rerun with KVFERRY_SEED={seed})");
    StdRng::seed_from_u64(seed)
}

/// Models covering MHA and MLA, dtype widths 1, 2 and 4, and head sizes that are multiples of
/// 16 bytes (vector path), of 8 or 4 only, and odd (byte path).
pub(crate) fn models() -> Vec<ModelSpec> {
    let mut v: Vec<ModelSpec> = Dtype::ALL
        .iter()
        .map(|&d| ModelSpec::mha(3, 5, 8, d))
        .collect();
    v.push(ModelSpec::mha(2, 4, 64, Dtype::Bf16)); // 128-byte heads
    v.push(ModelSpec::mha(2, 3, 72, Dtype::Fp8E4m3)); // 72-byte heads: 8-byte units, tails
    v.push(ModelSpec::mha(2, 3, 5, Dtype::Fp8E5m2)); // 5-byte heads: bytes
    v.push(ModelSpec::mha(2, 2, 3, Dtype::Fp32)); // 12-byte heads: 4-byte units
    v.push(ModelSpec::preset("tiny").unwrap());
    v.push(ModelSpec::preset("tiny-mla").unwrap());
    v
}

/// One gather from a source pool and scatter into a destination pool of the same model, of the
/// same page size or another.
#[derive(Clone, Debug)]
pub(crate) struct Case {
    pub(crate) src_layout: KvLayout,
    pub(crate) dst_layout: KvLayout,
    pub(crate) num_pages: usize,
    pub(crate) wire: PageOrder,
    pub(crate) src_pages: Vec<u32>,
    pub(crate) dst_pages: Vec<u32>,
    pub(crate) tokens: std::ops::Range<usize>,
    pub(crate) src_layers: std::ops::Range<usize>,
    pub(crate) dst_layers: std::ops::Range<usize>,
    pub(crate) src_heads: std::ops::Range<usize>,
    pub(crate) dst_heads: std::ops::Range<usize>,
}

impl Case {
    pub(crate) fn src_sel(&self) -> Selection<'_> {
        Selection {
            pages: &self.src_pages,
            tokens: self.tokens.clone(),
            layers: self.src_layers.clone(),
            heads: self.src_heads.clone(),
        }
    }

    pub(crate) fn dst_sel(&self) -> Selection<'_> {
        Selection {
            pages: &self.dst_pages,
            tokens: self.tokens.clone(),
            layers: self.dst_layers.clone(),
            heads: self.dst_heads.clone(),
        }
    }
}

fn random_range(rng: &mut StdRng, n: usize) -> std::ops::Range<usize> {
    let a = rng.random_range(0..=n);
    let b = rng.random_range(0..=n);
    a.min(b)..a.max(b)
}

fn random_pages(rng: &mut StdRng, num_pages: usize, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..num_pages as u32).collect();
    all.shuffle(rng);
    if rng.random_bool(0.3) {
        all.sort_unstable();
    }
    all.truncate(n);
    all
}

/// A random case; selections are non-empty three times in four and whole otherwise random.
pub(crate) fn random_case(
    rng: &mut StdRng,
    model: ModelSpec,
    src: (PageOrder, KvPlacement),
    dst: (PageOrder, KvPlacement),
    wire: PageOrder,
) -> Case {
    const PAGE_SIZES: [usize; 4] = [1, 3, 4, 16];
    let page_size = PAGE_SIZES[rng.random_range(0..4)];
    let src_layout = KvLayout::new(model, page_size)
        .unwrap()
        .with_order(src.0, src.1)
        .unwrap();
    // Half the token-major transfers go to pages of another size (kvferry_wire::wire_order:
    // token rows meet whatever the blocks).
    let dst_page_size = match wire == PageOrder::TokenMajor && rng.random_bool(0.5) {
        true => PAGE_SIZES[rng.random_range(0..4)],
        false => page_size,
    };
    let dst_layout = KvLayout::new(model, dst_page_size)
        .unwrap()
        .with_order(dst.0, dst.1)
        .unwrap();
    let n_pages = rng.random_range(0..=5);
    let dst_n_pages = (n_pages * page_size).div_ceil(dst_page_size);
    let num_pages = 9.max(dst_n_pages);
    let src_pages = random_pages(rng, num_pages, n_pages);
    let dst_pages = random_pages(rng, num_pages, dst_n_pages);
    let whole = rng.random_bool(0.25);
    let tokens = if whole {
        0..n_pages * page_size
    } else {
        random_range(rng, n_pages * page_size)
    };
    let layers = if whole {
        0..model.num_layers
    } else {
        random_range(rng, model.num_layers)
    };
    let heads = if whole {
        0..model.num_kv_heads
    } else {
        random_range(rng, model.num_kv_heads)
    };
    let l0 = rng.random_range(0..=model.num_layers - layers.len());
    let h0 = rng.random_range(0..=model.num_kv_heads - heads.len());
    Case {
        dst_layers: l0..l0 + layers.len(),
        dst_heads: h0..h0 + heads.len(),
        src_layout,
        dst_layout,
        num_pages,
        wire,
        src_pages,
        dst_pages,
        tokens,
        src_layers: layers,
        src_heads: heads,
    }
}

/// Every (model, source order and placement, destination order and placement, wire order).
pub(crate) fn all_cases(rng: &mut StdRng, per_combination: usize) -> Vec<Case> {
    let mut cases = Vec::new();
    for model in models() {
        for src_order in ORDERS {
            for src_placement in PLACEMENTS {
                for dst_order in ORDERS {
                    for wire in ORDERS {
                        for _ in 0..per_combination {
                            let dst_placement = PLACEMENTS[rng.random_range(0..PLACEMENTS.len())];
                            cases.push(random_case(
                                rng,
                                model,
                                (src_order, src_placement),
                                (dst_order, dst_placement),
                                wire,
                            ));
                        }
                    }
                }
            }
        }
    }
    cases
}
