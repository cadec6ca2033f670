//! The CUDA kernel on a real device against the CPU kernel: device pools, gather to pinned and
//! to device staging, scatter back into poisoned device pools, every byte compared.
//!
//! Built only with `--features gpu-tests`. Without a device (or driver, or NVRTC) the test
//! prints why it skipped; with `KVFERRY_REQUIRE_GPU=1` it fails instead.
#![cfg(feature = "gpu-tests")]

mod kv_cases;

use kv_cases::{Case, POISON, all_cases, rng};
use kvferry::kernel::cpu::CpuKernel;
use kvferry::kernel::cuda::{CudaKernel, DevicePool, DeviceStaging, PinnedStaging};
use kvferry::layout::{KvLayout, ModelSpec, PageOrder};
use kvferry::pool::HostPool;
use rand::RngCore;
use rand::rngs::StdRng;

fn kernel_or_skip() -> Option<std::sync::Arc<CudaKernel>> {
    match CudaKernel::shared(0) {
        Ok(k) => {
            println!("running on {k:?}");
            Some(k)
        }
        Err(e) => {
            let required = std::env::var("KVFERRY_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "KVFERRY_REQUIRE_GPU=1 but {e}");
            println!("skipped: {e}");
            None
        }
    }
}

fn random_pool(layout: &KvLayout, num_pages: usize, rng: &mut StdRng) -> HostPool {
    let pool = HostPool::anonymous(layout.clone(), num_pages).unwrap();
    let mut bytes = vec![0u8; pool.size()];
    rng.fill_bytes(&mut bytes);
    pool.write(0, &bytes).unwrap();
    pool
}

fn check(kernel: &CudaKernel, cpu: &CpuKernel, case: &Case, rng: &mut StdRng) {
    let ctx = format!("{case:?}");
    let src = random_pool(&case.src_layout, case.num_pages, rng);
    let src_bytes = src.read(0, src.size()).unwrap();
    let sel = case.src_sel();
    let bytes = sel.bytes(&src).unwrap();
    let mut expected = vec![POISON; bytes];
    cpu.gather(&src, &sel, case.wire, &mut expected).unwrap();

    let dev = DevicePool::new(kernel, case.src_layout.clone(), case.num_pages).unwrap();
    dev.write(0, &src_bytes).unwrap();
    let mut pinned = PinnedStaging::new(kernel, bytes).unwrap();
    pinned.as_mut_slice().unwrap().fill(POISON);
    kernel.gather(&dev, &sel, case.wire, &mut pinned).unwrap();
    assert!(
        pinned.as_slice().unwrap() == expected.as_slice(),
        "pinned gather: {ctx}"
    );
    let mut staged = DeviceStaging::new(kernel, bytes).unwrap();
    kernel.gather(&dev, &sel, case.wire, &mut staged).unwrap();
    assert!(
        staged.to_host().unwrap() == expected,
        "device gather: {ctx}"
    );

    let dst_sel = case.dst_sel();
    let dst = HostPool::anonymous(case.dst_layout.clone(), case.num_pages).unwrap();
    dst.fill(POISON);
    cpu.scatter(&expected, case.wire, &dst, &dst_sel).unwrap();
    let want = dst.read(0, dst.size()).unwrap();
    let dev_dst = DevicePool::new(kernel, case.dst_layout.clone(), case.num_pages).unwrap();
    for staging in [0, 1] {
        dev_dst.fill(POISON).unwrap();
        if staging == 0 {
            kernel
                .scatter(&pinned, case.wire, &dev_dst, &dst_sel)
                .unwrap();
        } else {
            kernel
                .scatter(&staged, case.wire, &dev_dst, &dst_sel)
                .unwrap();
        }
        let got = dev_dst.read(0, dev_dst.size()).unwrap();
        if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
            panic!("scatter from staging {staging}: first wrong byte at {i}: {ctx}");
        }
    }
}

#[test]
fn gpu_kernel_matches_the_cpu_kernel_for_every_layout() {
    let Some(kernel) = kernel_or_skip() else {
        return;
    };
    let mut rng = rng();
    let cpu = CpuKernel::new(2);
    let cases = all_cases(&mut rng, 2);
    for case in &cases {
        check(&kernel, &cpu, case, &mut rng);
    }
    println!("{} cases", cases.len());
}

#[test]
fn gpu_kernel_moves_a_llama3_8b_room() {
    let Some(kernel) = kernel_or_skip() else {
        return;
    };
    let mut rng = rng();
    let layout = KvLayout::new(ModelSpec::preset("llama3-8b").unwrap(), 16).unwrap();
    let pages: Vec<u32> = (0..256).rev().collect();
    let case = Case {
        src_layout: layout.clone(),
        dst_layout: layout.clone(),
        num_pages: 256,
        wire: PageOrder::TokenMajor,
        src_pages: pages.clone(),
        dst_pages: pages,
        tokens: 0..4096,
        src_layers: 0..32,
        dst_layers: 0..32,
        src_heads: 0..8,
        dst_heads: 0..8,
    };
    check(&kernel, &CpuKernel::new(2), &case, &mut rng);
}
