//! The CUDA kernel without a GPU: NVRTC compiles `kernels/kv_transfer.cu` to PTX for the
//! architectures kvferry targets, and every CUDA entry point answers a missing driver, device
//! or NVRTC with a typed error instead of a panic.
//!
//! NVRTC comes from the PyPI wheel `nvidia-cuda-nvrtc-cu12`: `eval "$(scripts/nvrtc-env)"`
//! installs it and puts it on `LD_LIBRARY_PATH`. Without it the NVRTC test prints why it skipped;
//! with `KVFERRY_REQUIRE_NVRTC=1` (CI) it fails instead.

use kvferry::kernel::cuda::{self, CudaError, CudaKernel};
use kvferry::kernel::{Kernel, KernelError, kernel_for};
use kvferry::memory::MemoryKind;

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// False (after saying why) when NVRTC is absent and not required; panics when it is required.
fn nvrtc_or_skip() -> bool {
    if cuda::nvrtc_present() {
        return true;
    }
    let why = CudaError::NvrtcMissing.to_string();
    assert!(
        !required("KVFERRY_REQUIRE_NVRTC"),
        "KVFERRY_REQUIRE_NVRTC=1 but {why}"
    );
    println!("skipped: {why}");
    false
}

#[test]
fn nvrtc_compiles_the_kernel_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    let nvrtc = cuda::nvrtc::get().expect("present");
    println!("NVRTC {:?} from {}", nvrtc.version, nvrtc.library);
    assert!(
        cuda::nvrtc::CANDIDATES.contains(&nvrtc.library) && nvrtc.version.0 >= 12,
        "{nvrtc:?}"
    );
    for (arch, target) in [
        ("compute_80", ".target sm_80"),
        ("compute_90", ".target sm_90"),
    ] {
        let ptx = cuda::compile_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(ptx.contains(target), "{arch}: no {target}");
        for entry in [cuda::GATHER_ENTRY, cuda::SCATTER_ENTRY] {
            assert!(
                ptx.contains(&format!(".visible .entry {entry}(")),
                "{arch}: no {entry}"
            );
        }
        // The 16-byte path is real vector accesses; nothing uses shared memory.
        assert!(
            ptx.contains("ld.global.v4.u32") || ptx.contains("ld.global.v2.u64"),
            "{arch}"
        );
        assert!(
            ptx.contains("st.global.v4.u32") || ptx.contains("st.global.v2.u64"),
            "{arch}"
        );
        assert!(!ptx.contains(".shared"), "{arch}");
        // Kept for `ptxas -v` (docs/kernels.md shows the command).
        // A binary carried to another machine (scripts/gpu-check) may find no such folder.
        let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("kv_transfer.{arch}.ptx"));
        match std::fs::write(&out, ptx.as_bytes()) {
            Ok(()) => println!("{arch}: {} bytes of PTX in {}", ptx.len(), out.display()),
            Err(e) => println!("{arch}: {} bytes of PTX (not kept: {e})", ptx.len()),
        }
        // Cached: the second request is the same text without recompiling.
        let again = cuda::compile_ptx(arch).unwrap();
        assert!(std::sync::Arc::ptr_eq(&ptx, &again));
    }
}

#[test]
fn nvrtc_errors_are_typed() {
    if !nvrtc_or_skip() {
        return;
    }
    match cuda::compile_ptx("compute_10") {
        Err(CudaError::Compile { arch, log }) => {
            assert_eq!(arch, "compute_10");
            assert!(!log.is_empty());
        }
        other => panic!("an unknown architecture must be a compile error: {other:?}"),
    }
}

#[test]
fn cuda_entry_points_return_typed_errors_without_a_gpu() {
    // Host memory always has a kernel.
    assert!(matches!(kernel_for(MemoryKind::Host), Ok(Kernel::Cpu(_))));
    let device = MemoryKind::Device { ordinal: 0 };
    if cuda::driver_present() {
        // A machine with a driver: the kernel opens, or says precisely what is missing.
        match CudaKernel::new(0) {
            Ok(k) => println!("device 0 present: {k:?}"),
            Err(e) => assert!(e.is_unavailable(), "{e}"),
        }
        return;
    }
    assert_eq!(CudaKernel::new(0).unwrap_err(), CudaError::DriverMissing);
    assert_eq!(CudaKernel::new(7).unwrap_err(), CudaError::DriverMissing);
    assert_eq!(CudaKernel::shared(0).unwrap_err(), CudaError::DriverMissing);
    // Not cached as a success, asked twice: the same answer.
    assert_eq!(CudaKernel::shared(0).unwrap_err(), CudaError::DriverMissing);
    match kernel_for(device) {
        Err(KernelError::Cuda(e)) => {
            assert_eq!(e, CudaError::DriverMissing);
            assert!(e.is_unavailable());
            println!("device kernel refused as expected: {e}");
        }
        other => panic!("expected a typed error, got {other:?}"),
    }
    // PTX compilation needs no driver: it answers by NVRTC's presence alone.
    match cuda::compile_ptx("compute_90") {
        Ok(ptx) => assert!(ptx.contains("kv_gather")),
        Err(e) => assert_eq!(e, CudaError::NvrtcMissing),
    }
}
