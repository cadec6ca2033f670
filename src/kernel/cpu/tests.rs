//! Tests of `kernel::cpu`.

use super::*;
use crate::layout::{KvLayout, KvPlacement, ModelSpec};
use crate::memory::Span;

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
    let runs = plan(Geometry::back_to_back(&l, 64), &sel, PageOrder::TokenMajor).unwrap();
    assert_eq!(runs.len(), 64, "one run per (layer, plane)");
    // Sent from the pool: one span per (layer, plane) too (the planes are apart).
    let pool = HostPool::anonymous(l.clone(), 64).unwrap();
    let spans = source_spans(&pool, &sel, PageOrder::TokenMajor).unwrap();
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
    assert!(source_spans(&pool, &bad, PageOrder::TokenMajor).is_err());
    assert!(runs.iter().all(|r| r.len == 10 * 32768));
    // Head-major pools coalesce the same way when whole pages are selected.
    let runs = plan(
        Geometry::back_to_back(&llama(PageOrder::HeadMajor), 64),
        &sel,
        PageOrder::HeadMajor,
    )
    .unwrap();
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
        let mut buf = vec![0; src.bytes(&src_pool, wire).unwrap()];
        k.gather(&src_pool, &src, wire, &mut buf).unwrap();
        k.scatter(&buf, wire, &staged, &dst).unwrap();
        // Sent straight from the pool, the source's spans make the gathered bytes.
        let spans = source_spans(&src_pool, &src, wire).unwrap();
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
        let places = placements(&dl, dst_n, &dst, wire, &lens, false).unwrap();
        let want: Vec<Vec<Span>> = runs.iter().map(|r| vec![r.destination()]).collect();
        assert_eq!(places, want, "case {case}: placements");
        // Runs cut as the source's spans (contiguous in the source only) land, scattered,
        // where gather + scatter puts them.
        let lens: Vec<u64> = spans.iter().map(|s| s.len).collect();
        let places = placements(&dl, dst_n, &dst, wire, &lens, true).unwrap();
        let scattered = HostPool::anonymous(dl.clone(), dst_n).unwrap();
        for (span, pieces) in spans.iter().zip(&places) {
            let mut bytes = src_pool
                .read(span.offset as usize, span.len as usize)
                .unwrap();
            for p in pieces {
                let rest = bytes.split_off(p.len as usize);
                scattered.write(p.offset as usize, &bytes).unwrap();
                bytes = rest;
            }
            assert!(bytes.is_empty(), "case {case}: pieces add up to the run");
        }
        assert!(
            scattered.read(0, scattered.size()).unwrap() == st,
            "case {case}: scattered placements"
        );
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
    let exact = placements(&l, 4, &sel, wire, &[page; 4], false).unwrap();
    assert_eq!(exact.len(), 4);
    assert!(exact.iter().all(|s| s.len() == 1 && s[0].len == page));
    // A run across the gap between page 3 and page 1.
    let cuts = [page / 2, page, page / 2, 2 * page];
    let across = placements(&l, 4, &sel, wire, &cuts, false);
    assert_eq!(
        across,
        Err(KernelError::NotContiguous {
            at: page as usize / 2,
            len: page
        })
    );
    // Scattered, it lands in two pieces: the end of page 3, the start of page 1.
    let across = placements(&l, 4, &sel, wire, &cuts, true).unwrap();
    let piece = |offset, len| Span { offset, len };
    assert_eq!(
        across[1],
        [piece(3 * page + page / 2, page / 2), piece(page, page / 2)]
    );
    // Lengths that do not add up to the selection, and empty runs.
    assert!(matches!(
        placements(&l, 4, &sel, wire, &[page; 3], true),
        Err(KernelError::StagingSize { .. })
    ));
    assert!(matches!(
        placements(&l, 4, &sel, wire, &[0, page, page, page, page], true),
        Err(KernelError::NotContiguous { at: 0, len: 0 })
    ));
    assert!(matches!(
        placements(&l, 4, &sel, wire, &[u64::MAX, 2], true),
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
        Geometry::back_to_back(&llama(PageOrder::TokenMajor), 8),
        &sel,
        PageOrder::TokenMajor,
    )
    .unwrap();
    assert_eq!(tm.len(), 2 * 16);
    assert!(tm.iter().all(|r| r.len == 4 * 256));
    // Head-major: a head slice of a page is contiguous, so one run per plane.
    let hm = plan(
        Geometry::back_to_back(&llama(PageOrder::HeadMajor), 8),
        &sel,
        PageOrder::HeadMajor,
    )
    .unwrap();
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
    let chunk: Vec<u8> = (0..sel.bytes(&pool, PageOrder::TokenMajor).unwrap() as u32)
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
    let landed: usize = plan(
        Geometry::back_to_back(pool.layout(), 16),
        &sel,
        PageOrder::TokenMajor,
    )
    .unwrap()
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
fn split_cuts_runs_into_equal_shares_each_piece_to_its_destination() {
    let run = |pool, staging, len, to| Run {
        pool,
        staging,
        len,
        to,
    };
    let runs = [run(0, 0, 10, 0), run(100, 10, 5, 1)];
    let shares = split(&runs, 15, 2);
    assert_eq!(
        shares,
        [
            vec![run(0, 0, 8, 0)],
            vec![run(8, 8, 2, 0), run(100, 10, 5, 1)]
        ]
    );
}

/// A write of many short runs into two destinations (TP1 -> TP2 head slices: each 2 KiB row
/// of the source, its first KiB to one destination, its second to the other) is shared out
/// by rows over the kernel's threads: every byte lands where its run says and nowhere else,
/// also from a list that ends early; a run outside its destination, in either thread's rows,
/// is refused before a byte moves into either.
#[test]
fn rows_of_short_runs_land_in_each_destination_and_one_bad_run_moves_nothing() {
    let src = HostPool::anonymous(llama(PageOrder::TokenMajor), 4).unwrap();
    let bytes = crate::pool::testing::xorshift_bytes(src.size());
    src.write(0, &bytes).unwrap();
    let rows = 4 * ROW_SHARE_MIN_RUNS;
    let half = |k: usize, second: bool| WriteRun {
        src: (k * 2048 + usize::from(second) * 1024) as u64,
        dst: (k * 1024 + 64) as u64,
        len: 1024,
    };
    let first: Vec<WriteRun> = (0..rows).map(|k| half(k, false)).collect();
    // The second list ends 100 rows early.
    let second: Vec<WriteRun> = (0..rows - 100).map(|k| half(k, true)).collect();
    let size = rows * 1024 + 4096;
    for threads in [1, 2] {
        let kernel = CpuKernel::new(threads);
        let mut dsts = [vec![0xAAu8; size], vec![0xBBu8; size]];
        let write = |lists: &[&[WriteRun]], dsts: &mut [Vec<u8>; 2]| {
            let [a, b] = dsts;
            let at = [(a.as_mut_ptr(), a.len()), (b.as_mut_ptr(), b.len())];
            // SAFETY: two buffers of their own, apart from the source, alive for the call.
            unsafe { kernel.write_runs(&src, lists, &at) }
        };
        write(&[&first, &second], &mut dsts).unwrap();
        for (dst, list, poison) in [(&dsts[0], &first, 0xAA), (&dsts[1], &second, 0xBB)] {
            let mut want = vec![poison; size];
            for r in list.iter() {
                let (s, d, n) = (r.src as usize, r.dst as usize, r.len as usize);
                want[d..d + n].copy_from_slice(&bytes[s..s + n]);
            }
            assert!(*dst == want, "{threads} threads, destination {poison:#x}");
        }
        // One run outside the second destination, in the first rows or the last.
        for k in [0, rows - 101] {
            let mut dsts = [vec![0xAAu8; size], vec![0xBBu8; size]];
            let mut bad = second.clone();
            bad[k].dst = size as u64 - 512;
            let e = write(&[&first, &bad], &mut dsts).unwrap_err();
            assert!(e.to_string().contains("destination"), "{e}");
            assert!(
                dsts[0].iter().all(|&x| x == 0xAA),
                "{threads} threads, row {k}"
            );
            assert!(
                dsts[1].iter().all(|&x| x == 0xBB),
                "{threads} threads, row {k}"
            );
        }
    }
}

/// The checksum copies runs through its bounce buffer in pieces: runs longer than the buffer
/// (10 pages x 32 KiB per plane here, against 64 KiB) and not multiples of it hash to the
/// gathered bytes' xxh3, in both orders.
#[test]
fn checksum_through_the_bounce_buffer_matches_the_gathered_bytes() {
    for order in [PageOrder::TokenMajor, PageOrder::HeadMajor] {
        let l = llama(order);
        let pool = HostPool::anonymous(l.clone(), 64).unwrap();
        let fill: Vec<u8> = (0..pool.size()).map(|i| (i * 7 + i / 4099) as u8).collect();
        pool.write(0, &fill).unwrap();
        let pages: Vec<u32> = (10..20).chain([40, 3, 41]).collect();
        for heads in [0..8, 1..6] {
            let sel = Selection {
                pages: &pages,
                tokens: 0..13 * 16 - 5,
                layers: 0..32,
                heads,
            };
            let k = CpuKernel::new(1);
            let mut staged = vec![0; sel.bytes(&pool, order).unwrap()];
            k.gather(&pool, &sel, order, &mut staged).unwrap();
            let longest = plan(Geometry::back_to_back(&l, 64), &sel, order)
                .unwrap()
                .iter()
                .map(|r| r.len)
                .max();
            if sel.heads.len() == 8 {
                assert!(longest > Some(CHECKSUM_BOUNCE), "{longest:?}");
            }
            let want = xxhash_rust::xxh3::xxh3_64(&staged);
            assert_eq!(k.checksum(&pool, &sel, order).unwrap(), want, "{order:?}");
        }
    }
}

/// A destination pool of more pages than memory can hold (a peer's exposed size): the plan
/// is refused with the overflow, not computed with wrapped offsets.
#[test]
fn a_pool_to_pool_plan_into_an_impossible_pool_is_refused() {
    let l = llama(PageOrder::TokenMajor);
    let pages: Vec<u32> = vec![0, 1];
    let sel = Selection {
        pages: &pages,
        tokens: 0..32,
        layers: 0..32,
        heads: 0..8,
    };
    let huge = usize::MAX / l.page_span().unwrap() + 1;
    let side = |num_pages| PoolSide {
        layout: &l,
        num_pages,
        sel: &sel,
    };
    let planned = pool_to_pool(side(4), side(huge), PageOrder::TokenMajor);
    assert!(
        matches!(planned, Err(KernelError::Layout(_))),
        "{planned:?}"
    );
    assert!(pool_to_pool(side(4), side(4), PageOrder::TokenMajor).is_ok());
}

#[test]
fn a_chunk_scattered_from_pieces_lands_as_the_whole_chunk_does() {
    let layout = llama(PageOrder::HeadMajor);
    let pages = [3u32, 0, 2];
    let sel = Selection {
        pages: &pages,
        tokens: 1..45,
        layers: 2..4,
        heads: 1..7,
    };
    let whole = HostPool::anonymous(layout.clone(), 4).unwrap();
    let bytes = sel.bytes(&whole, PageOrder::TokenMajor).unwrap();
    let chunk: Vec<u8> = (0..bytes as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let kernel = CpuKernel::new(2);
    whole.fill(0xA5);
    kernel
        .scatter(&chunk, PageOrder::TokenMajor, &whole, &sel)
        .unwrap();
    // SAFETY: the pools are this test's alone and no copy is running.
    let image =
        |p: &HostPool| unsafe { std::slice::from_raw_parts(p.base_ptr(), p.size()) }.to_vec();
    // Cut anywhere: inside runs, on their edges, an empty piece, one byte.
    for cuts in [
        vec![bytes],
        vec![1, bytes - 1],
        vec![0, 4096, 0, bytes - 4096],
        vec![777, 1, bytes / 2, bytes - 777 - 1 - bytes / 2],
    ] {
        let mut pieces = Vec::new();
        let mut at = 0;
        for len in &cuts {
            pieces.push(&chunk[at..at + len]);
            at += len;
        }
        let pool = HostPool::anonymous(layout.clone(), 4).unwrap();
        pool.fill(0xA5);
        kernel
            .scatter_pieces(&pieces, PageOrder::TokenMajor, &pool, &sel)
            .unwrap();
        assert!(image(&pool) == image(&whole), "pieces {cuts:?}");
    }
    // Pieces that do not add up to the selection are refused before a byte moves.
    let pool = HostPool::anonymous(layout, 4).unwrap();
    pool.fill(0xA5);
    let short = [&chunk[..100], &chunk[100..bytes - 1]];
    assert!(
        kernel
            .scatter_pieces(&short, PageOrder::TokenMajor, &pool, &sel)
            .is_err()
    );
    assert!(image(&pool).iter().all(|b| *b == 0xA5));
}

/// An engine's regions in one buffer, back to back in the layout's order or the reverse.
fn engine_pool(l: &KvLayout, pages: usize, buf: &mut [u8], reversed: bool) -> HostPool {
    let region = l.region_bytes(pages).unwrap();
    let n = l.num_regions();
    let base = buf.as_mut_ptr() as usize;
    let regions: Vec<crate::pool::EngineRegion> = (0..n)
        .map(|i| crate::pool::EngineRegion {
            addr: base + region * if reversed { n - 1 - i } else { i },
            len: region,
        })
        .collect();
    // SAFETY: the regions lie inside `buf`, which outlives the pool in the test.
    unsafe { HostPool::engine(l.clone(), pages, &regions) }.unwrap()
}

#[test]
fn spans_sent_from_an_engine_pool_follow_its_regions_wherever_they_lie() {
    // SGLang's buffers: one region per layer's plane.
    let l = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16)
        .unwrap()
        .with_format(&crate::layout::KvFormat::named("sglang-mha").unwrap())
        .unwrap();
    assert_eq!(l.num_regions(), 8);
    let pages = 8;
    // No two regions alike (a pattern with a period would hide a span in the wrong region).
    let mut buf = crate::pool::testing::xorshift_bytes(l.pool_bytes(pages).unwrap());
    let page = [5u32];
    // One token of one layer: two spans (K and V), sent from the pool without a gather.
    let sel = Selection {
        pages: &page,
        tokens: 0..1,
        layers: 3..4,
        heads: 0..4,
    };
    for reversed in [false, true] {
        let pool = engine_pool(&l, pages, &mut buf, reversed);
        assert_eq!(
            pool.contiguous(),
            !reversed,
            "regions out of order are no flat pool"
        );
        let mut gathered = vec![0; sel.bytes(&pool, PageOrder::TokenMajor).unwrap()];
        CpuKernel::new(1)
            .gather(&pool, &sel, PageOrder::TokenMajor, &mut gathered)
            .unwrap();
        let spans = source_spans(&pool, &sel, PageOrder::TokenMajor).unwrap();
        assert_eq!(spans.len(), 2);
        let sent: Vec<u8> = spans
            .iter()
            .flat_map(|s| pool.read(s.offset as usize, s.len as usize).unwrap())
            .collect();
        assert!(
            sent == gathered,
            "reversed regions {reversed}: spans read other bytes"
        );
    }
}
