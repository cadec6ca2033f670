//! Gather and scatter of the CPU kernel against a plain memcpy of the same bytes.
//!
//! llama3-8b layout (32 layers, 8 KV heads, head dim 128, bf16) at page sizes 16 and 64 tokens:
//! one page's run per layer and per K or V is then 32 KiB or 128 KiB. Pages are a random
//! permutation of the pool (a fragmented pool: nothing coalesces across pages), from 1 page up
//! to about 1 GiB of KV per point. Each point is measured single-threaded and with two threads,
//! beside memcpy with the same thread count.
//!
//! `cargo bench --bench kernel`; docs/benchmarks.md quotes the medians.

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
            let bytes = sel.bytes(&pool).expect("bytes");
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

criterion_group!(benches, bench);
criterion_main!(benches);
