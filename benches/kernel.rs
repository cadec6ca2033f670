//! Gather and scatter of the CPU kernel against a plain memcpy of the same bytes.
//!
//! llama3-8b layout (32 layers, 8 KV heads, head dim 128, bf16) at page sizes 16 and 64 tokens:
//! one page's run per layer and per K or V is then 32 KiB or 128 KiB. Pages are a random
//! permutation of the pool (a fragmented pool: nothing coalesces across pages), from 1 page up
//! to about 1 GiB of KV per point. Each point is measured single-threaded and with two threads,
//! beside memcpy with the same thread count.
//!
//! A second group scatters 1 MiB chunks, as a decode lands them, into a 1 GiB pool whose lines
//! are not in the cache: whole heads (equal TP) and half the heads (TP2 -> TP1, 1 KiB per
//! token), each chunk at other pages, beside memcpy of 1 MiB into a 1 GiB buffer the same way.
//!
//! `cargo bench --bench kernel`; docs/benchmarks.md, "CPU transfer kernel", quotes the first
//! group's medians.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvferry::kernel::Selection;
use kvferry::kernel::cpu::CpuKernel;
use kvferry::layout::{KvLayout, ModelSpec, PageOrder};
use kvferry::pool::HostPool;
use rand::SeedableRng;
use rand::seq::SliceRandom;

/// memcpy of `src` into `dst` split in `threads` equal parts, as the kernel splits its runs.
fn memcpy(dst: &mut [u8], src: &[u8], threads: usize) {
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let part = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(part).zip(src.chunks(part)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

fn bench(c: &mut Criterion) {
    let model = ModelSpec::preset("llama3-8b").expect("preset");
    for (page_size, page_counts) in [(16usize, [1usize, 8, 64, 512]), (64, [1, 4, 32, 128])] {
        let layout = KvLayout::new(model, page_size).expect("layout");
        let mut group = c.benchmark_group(format!("llama3-8b/page{page_size}"));
        group.sample_size(10);
        group.warm_up_time(std::time::Duration::from_millis(500));
        group.measurement_time(std::time::Duration::from_secs(2));
        for pages in page_counts {
            let pool = HostPool::anonymous(layout.clone(), pages).expect("pool");
            pool.fill(0x5A);
            let mut list: Vec<u32> = (0..pages as u32).collect();
            list.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
            let sel = Selection::whole(&pool, &list, pages * page_size);
            let bytes = sel.bytes(&pool, PageOrder::TokenMajor).expect("bytes");
            let mut staging = vec![1u8; bytes];
            let other = vec![2u8; bytes];
            let mib = bytes >> 20;
            group.throughput(Throughput::Bytes(bytes as u64));
            for threads in [1usize, 2] {
                let kernel = CpuKernel::new(threads);
                let label = format!("{mib}MiB/{threads}t");
                group.bench_function(BenchmarkId::new("gather", &label), |b| {
                    b.iter(|| {
                        kernel
                            .gather(&pool, &sel, PageOrder::TokenMajor, black_box(&mut staging))
                            .expect("gather")
                    })
                });
                group.bench_function(BenchmarkId::new("scatter", &label), |b| {
                    b.iter(|| {
                        kernel
                            .scatter(black_box(&staging), PageOrder::TokenMajor, &pool, &sel)
                            .expect("scatter")
                    })
                });
                group.bench_function(BenchmarkId::new("memcpy", &label), |b| {
                    b.iter(|| memcpy(black_box(&mut staging), &other, threads))
                });
            }
        }
        group.finish();
    }
}

/// Pages of llama3-8b at page size 16 in the cold pool: 2 MiB each, 1 GiB in all.
const COLD_PAGES: usize = 512;

fn chunks_into_a_cold_pool(c: &mut Criterion) {
    let model = ModelSpec::preset("llama3-8b").expect("preset");
    let layout = KvLayout::new(model, 16).expect("layout");
    let pool = HostPool::anonymous(layout.clone(), COLD_PAGES).expect("pool");
    pool.fill(0x5A);
    let mut list: Vec<u32> = (0..COLD_PAGES as u32).collect();
    list.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let chunk = 1usize << 20;
    let staging = vec![1u8; chunk];
    let mut group = c.benchmark_group("llama3-8b/1MiB-chunks-into-1GiB-pool");
    group.sample_size(10);
    group.warm_up_time(std::time::Duration::from_millis(500));
    group.measurement_time(std::time::Duration::from_secs(2));
    group.throughput(Throughput::Bytes(chunk as u64));
    let kernel = CpuKernel::new(1);
    for heads in [layout.num_heads(), layout.num_heads() / 2] {
        // One layer's K and V of `pages` pages make the chunk.
        let pages = chunk / (layout.planes() * heads * layout.page_size * layout.head_bytes());
        let mut at = 0usize;
        let label = format!("{heads}-of-{}-heads", layout.num_heads());
        group.bench_function(BenchmarkId::new("scatter", label), |b| {
            b.iter(|| {
                // Each chunk lands in the next layer, and in other pages once every layer had one.
                let layer = at % layout.num_layers();
                let first = (at / layout.num_layers() * pages) % (COLD_PAGES - pages);
                at += 1;
                let sel = Selection {
                    pages: &list[first..first + pages],
                    tokens: 0..pages * layout.page_size,
                    layers: layer..layer + 1,
                    heads: 0..heads,
                };
                kernel
                    .scatter(black_box(&staging), PageOrder::TokenMajor, &pool, &sel)
                    .expect("scatter")
            })
        });
    }
    let mut cold = vec![2u8; pool.size()];
    let mut at = 0usize;
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            let first = at * chunk % (cold.len() - chunk);
            at += 1;
            memcpy(black_box(&mut cold[first..first + chunk]), &staging, 1)
        })
    });
    group.finish();
}

criterion_group!(benches, bench, chunks_into_a_cold_pool);
criterion_main!(benches);
