//! The CUDA kernel source run on the CPU: `kernels/kv_transfer.cu` compiled as C++ with the host
//! shim (tests/cuda/kv_transfer_host.cpp, by `$CXX` or g++ into a shared object), launched with
//! exactly the parameters and geometry a GPU launch gets (`kernel::cuda::launch`), and compared
//! byte for byte with the Rust CPU kernel: every layout kind, dtype width, page order, placement
//! and wire order, random selections, poisoned destinations, and staging buffers at aligned and
//! misaligned addresses so both the 16-byte vector path and the narrow/scalar paths run.
#![allow(unsafe_code)]

use crate::kv_cases;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use kv_cases::{Case, POISON, all_cases, rng};
use kvferry::kernel::cpu::CpuKernel;
use kvferry::kernel::cuda::launch::{self, KvXferParams};
use kvferry::kernel::{KernelError, Selection};
use kvferry::layout::{Dtype, KvLayout, ModelSpec, PageOrder};
use kvferry::pool::HostPool;
use rand::rngs::StdRng;
use rand::{Rng, RngCore};

type TransferFn = unsafe extern "C" fn(i32, u32, u32, u32, *const KvXferParams);

struct Emulator {
    transfer: TransferFn,
    _lib: libloading::Library,
}

/// Builds and loads the emulated kernel once per test process.
fn emulator() -> &'static Emulator {
    static EMU: OnceLock<Emulator> = OnceLock::new();
    EMU.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("kv_transfer_host-{}.so", std::process::id()));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".to_owned());
        let status = Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-shared",
                "-fPIC",
                "-I",
            ])
            .arg(root.join("kernels"))
            .arg(root.join("tests/cuda/kv_transfer_host.cpp"))
            .arg("-o")
            .arg(&out)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {cxx}: {e}"));
        assert!(
            status.success(),
            "{cxx} failed to compile the kernel for the host"
        );
        // SAFETY: the library is the one just built from our sources; its initialisers only set
        // up thread-local index variables.
        let lib = unsafe { libloading::Library::new(&out) }.expect("load emulated kernel");
        // SAFETY: `kvf_host_transfer` has this signature in tests/cuda/kv_transfer_host.cpp.
        let transfer = unsafe { lib.get::<TransferFn>(b"kvf_host_transfer") }.expect("symbol");
        let transfer = *transfer;
        let _ = std::fs::remove_file(&out);
        Emulator {
            transfer,
            _lib: lib,
        }
    })
}

/// Host memory standing in for device memory: `len` bytes starting `misalign` bytes past a
/// 256-byte boundary (device allocations are 256-byte aligned).
struct Buf {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, misalign: usize, fill: u8) -> Self {
        let mem = vec![fill; len + 512];
        let start = (256 - mem.as_ptr() as usize % 256) % 256 + misalign;
        Buf { mem, start, len }
    }
    fn bytes(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.mem[self.start..self.start + self.len]
    }
    fn addr(&mut self) -> u64 {
        self.bytes_mut().as_mut_ptr() as u64
    }
}

/// One emulated launch, planned exactly as `CudaKernel` plans it.
fn emulate(
    gather: bool,
    layout: &KvLayout,
    num_pages: usize,
    pool: &mut Buf,
    sel: &Selection<'_>,
    wire: PageOrder,
    staging: &mut Buf,
) -> Result<(), KernelError> {
    assert_eq!(pool.len, layout.pool_bytes(num_pages).unwrap());
    let Some(plan) = launch::plan(layout, num_pages, sel, wire, staging.len, !gather)? else {
        return Ok(());
    };
    let table = launch::plane_table(
        layout,
        num_pages,
        &launch::one_buffer(layout, num_pages, pool.addr())?,
    )?;
    let params = KvXferParams {
        planes: table.as_ptr() as u64,
        pages: plan.pages.as_ptr() as u64,
        staging: staging.addr(),
        ..plan.params
    };
    // SAFETY: `plan` validated the selection against the layout, the pool buffer holds exactly
    // `pool_bytes(num_pages)` bytes, the staging buffer exactly the selection's bytes; the
    // table, page list and both buffers outlive the call, which runs every emulated thread
    // before returning.
    unsafe { (emulator().transfer)(gather as i32, plan.grid.0, plan.grid.1, plan.block, &params) };
    Ok(())
}

fn random_pool(layout: &KvLayout, num_pages: usize, rng: &mut StdRng) -> HostPool {
    let pool = HostPool::anonymous(layout.clone(), num_pages).unwrap();
    let mut bytes = vec![0u8; pool.size()];
    rng.fill_bytes(&mut bytes);
    pool.write(0, &bytes).unwrap();
    pool
}

/// Gather with both kernels, compare; scatter the staging with both into poisoned pools,
/// compare every byte.
fn check(case: &Case, rng: &mut StdRng, cpu: &CpuKernel) {
    let ctx = format!("{case:?}");
    let src = random_pool(&case.src_layout, case.num_pages, rng);
    let src_sel = case.src_sel();
    let bytes = src_sel.bytes(&src, case.wire).unwrap();
    let mut expected = vec![POISON; bytes];
    cpu.gather(&src, &src_sel, case.wire, &mut expected)
        .unwrap();

    let src_bytes = src.read(0, src.size()).unwrap();
    // Pools are 256-byte aligned like device memory, now and then 2 bytes off; staging lands
    // at aligned and misaligned offsets.
    let pool_misalign = if rng.random_bool(0.15) { 2 } else { 0 };
    let mut pool = Buf::new(src.size(), pool_misalign, 0);
    pool.bytes_mut().copy_from_slice(&src_bytes);
    let staging_misalign = [0, 0, 8, 4, 1][rng.random_range(0..5)];
    let mut staging = Buf::new(bytes, staging_misalign, POISON);
    let layout = &case.src_layout;
    emulate(
        true,
        layout,
        case.num_pages,
        &mut pool,
        &src_sel,
        case.wire,
        &mut staging,
    )
    .unwrap();
    assert!(
        staging.bytes() == expected.as_slice(),
        "emulated gather differs: {ctx}"
    );
    assert!(
        pool.bytes() == src_bytes.as_slice(),
        "emulated gather wrote its source: {ctx}"
    );

    let dst_sel = case.dst_sel();
    let dst = HostPool::anonymous(case.dst_layout.clone(), case.num_pages).unwrap();
    dst.fill(POISON);
    cpu.scatter(&expected, case.wire, &dst, &dst_sel).unwrap();
    let want = dst.read(0, dst.size()).unwrap();
    let mut pool = Buf::new(dst.size(), pool_misalign, POISON);
    let layout = &case.dst_layout;
    emulate(
        false,
        layout,
        case.num_pages,
        &mut pool,
        &dst_sel,
        case.wire,
        &mut staging,
    )
    .unwrap();
    let got = pool.bytes();
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "emulated scatter: first wrong byte at {i} of {}: {ctx}",
            got.len()
        );
    }
}

#[test]
fn emulated_cuda_kernel_matches_the_cpu_kernel_for_every_layout() {
    let mut rng = rng();
    let cpu = CpuKernel::new(1);
    let cases = all_cases(&mut rng, 2);
    for case in &cases {
        check(case, &mut rng, &cpu);
    }
    println!("{} cases", cases.len());
}

#[test]
fn emulated_cuda_kernel_splits_large_pages_across_blocks() {
    let mut rng = rng();
    let cpu = CpuKernel::new(1);
    // 512 tokens x 2 heads x 256 bytes: 256 KiB segments, split over 8 blocks of 256 threads.
    let layout = KvLayout::new(ModelSpec::mha(2, 2, 128, Dtype::Bf16), 512).unwrap();
    for wire in [PageOrder::TokenMajor, PageOrder::HeadMajor] {
        let case = Case {
            src_layout: layout.clone(),
            dst_layout: layout.clone(),
            num_pages: 3,
            wire,
            src_pages: vec![2, 0],
            dst_pages: vec![1, 2],
            tokens: 100..1024,
            src_layers: 0..2,
            dst_layers: 0..2,
            src_heads: 0..2,
            dst_heads: 0..2,
        };
        let bytes = case.src_sel().bytes_in(&layout, wire).unwrap();
        let plan = launch::plan(&layout, 3, &case.src_sel(), wire, bytes, false)
            .unwrap()
            .unwrap();
        assert_eq!(plan.grid, (2 * 2 * 2, 8), "{wire:?}");
        check(&case, &mut rng, &cpu);
    }
}

#[test]
fn emulated_launches_refuse_what_the_cpu_kernel_refuses() {
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let size = layout.pool_bytes(4).unwrap();
    let mut pool = Buf::new(size, 0, POISON);
    let room = layout.room_bytes(32).unwrap();
    let mut staging = Buf::new(room, 0, 7);
    let whole = |pages| Selection {
        pages,
        tokens: 0..32,
        layers: 0..4,
        heads: 0..4,
    };
    let tm = PageOrder::TokenMajor;
    let err = emulate(
        false,
        &layout,
        4,
        &mut pool,
        &whole(&[2, 2]),
        tm,
        &mut staging,
    );
    assert_eq!(err, Err(KernelError::DuplicatePage { page: 2 }));
    let err = emulate(
        false,
        &layout,
        4,
        &mut pool,
        &whole(&[0, 4]),
        tm,
        &mut staging,
    );
    assert_eq!(
        err,
        Err(KernelError::PageOutOfRange {
            page: 4,
            num_pages: 4
        })
    );
    let mut short = Buf::new(room - 1, 0, 7);
    let err = emulate(true, &layout, 4, &mut pool, &whole(&[0, 1]), tm, &mut short);
    assert_eq!(
        err,
        Err(KernelError::StagingSize {
            expected: room,
            actual: room - 1
        })
    );
    assert!(
        pool.bytes().iter().all(|b| *b == POISON),
        "a refused scatter wrote"
    );
    // Empty selections launch nothing and succeed.
    let mut empty = Buf::new(0, 0, 7);
    let none = Selection {
        tokens: 3..3,
        ..whole(&[0])
    };
    emulate(false, &layout, 4, &mut pool, &none, tm, &mut empty).unwrap();
    assert!(pool.bytes().iter().all(|b| *b == POISON));
}
