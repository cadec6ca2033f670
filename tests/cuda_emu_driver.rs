//! The CUDA driver emulator (emu/cuda) against the driver's documented behaviour, called through
//! its C ABI: built here by `emu/cuda/build` and loaded by path, so no GPU and no library path
//! are involved. Each case runs in a forked child, so that the library's process-wide state
//! (initialisation, the current context) starts fresh and a crash is an observable outcome
//! (nextest runs every test in a process of its own, so nothing else runs when it forks).
//! tests/kernel_gpu.rs runs kvferry's own cudarc calls on the same library (scripts/test).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

type R = i32;
type Ptr = *mut c_void;
const SUCCESS: R = 0;
const INVALID_VALUE: R = 1;
const NOT_INITIALIZED: R = 3;
const INVALID_DEVICE: R = 101;
const INVALID_CONTEXT: R = 201;
const NOT_FOUND: R = 500;

/// The emulator, built once per test process.
fn library() -> &'static PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("cuda-emu-{}", std::process::id()));
        let status = Command::new(root.join("emu/cuda/build"))
            .arg(&out)
            .status()
            .expect("running emu/cuda/build");
        assert!(status.success(), "emu/cuda/build failed");
        out.join("libcuda.so")
    })
}

struct Driver(libloading::Library);

impl Driver {
    fn open() -> Driver {
        // SAFETY: our own library; its initialisers only set up statics.
        Driver(unsafe { libloading::Library::new(library()) }.expect("loading the emulator"))
    }

    /// The driver function `name` of type `F`.
    fn f<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller names a function of the driver API with its C signature.
        unsafe {
            *self
                .0
                .get::<F>(name.as_bytes())
                .unwrap_or_else(|e| panic!("{name}: {e}"))
        }
    }

    /// cuInit, then device 0's primary context made current.
    fn ready(&self) {
        let init: unsafe extern "C" fn(u32) -> R = self.f("cuInit");
        let retain: unsafe extern "C" fn(*mut *mut c_void, i32) -> R =
            self.f("cuDevicePrimaryCtxRetain");
        let set: unsafe extern "C" fn(*mut c_void) -> R = self.f("cuCtxSetCurrent");
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out pointers.
        unsafe {
            assert_eq!(init(0), SUCCESS);
            assert_eq!(retain(&mut ctx, 0), SUCCESS);
            assert_eq!(set(ctx), SUCCESS);
        }
    }
}

/// Runs `case` in a forked child with the emulator loaded, initialised and device 0's context
/// current; returns how it ended: `Ok(exit code)` or `Err(signal)`.
fn with_context(case: impl FnOnce(&Driver)) -> Result<i32, i32> {
    in_child(|| {
        let d = Driver::open();
        d.ready();
        case(&d);
    })
}

/// Runs `case` in a forked child; returns how it ended: `Ok(exit code)` or `Err(signal)`.
fn in_child(case: impl FnOnce()) -> Result<i32, i32> {
    library();
    // SAFETY: the child runs only `case` and exits; the test harness's threads are not used in it.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(case)).is_ok();
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(if ok { 0 } else { 101 }) }
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFEXITED(status) {
        Ok(libc::WEXITSTATUS(status))
    } else {
        Err(libc::WTERMSIG(status))
    }
}

type Alloc = unsafe extern "C" fn(*mut u64, usize) -> R;
type Free = unsafe extern "C" fn(u64) -> R;
type HtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> R;
type DtoH = unsafe extern "C" fn(*mut c_void, u64, usize) -> R;

#[test]
fn calls_before_init_or_without_a_context_fail_as_documented() {
    assert_eq!(
        in_child(|| {
            let d = Driver::open();
            let count: unsafe extern "C" fn(*mut i32) -> R = d.f("cuDeviceGetCount");
            let alloc: Alloc = d.f("cuMemAlloc_v2");
            let init: unsafe extern "C" fn(u32) -> R = d.f("cuInit");
            let get: unsafe extern "C" fn(*mut i32, i32) -> R = d.f("cuDeviceGet");
            let mut n = 0;
            let mut p = 0u64;
            let mut dev = 0;
            // SAFETY: valid out pointers.
            unsafe {
                assert_eq!(count(&mut n), NOT_INITIALIZED);
                assert_eq!(init(1), INVALID_VALUE, "flags must be 0");
                assert_eq!(init(0), SUCCESS);
                assert_eq!(count(&mut n), SUCCESS);
                assert_eq!(n, 2);
                assert_eq!(get(&mut dev, 2), INVALID_DEVICE);
                assert_eq!(alloc(&mut p, 64), INVALID_CONTEXT, "no current context");
            }
        }),
        Ok(0)
    );
}

#[test]
fn device_memory_round_trips_and_bad_pointers_are_refused() {
    assert_eq!(
        with_context(|d| {
            let (alloc, free): (Alloc, Free) = (d.f("cuMemAlloc_v2"), d.f("cuMemFree_v2"));
            let (htod, dtoh): (HtoD, DtoH) = (d.f("cuMemcpyHtoD_v2"), d.f("cuMemcpyDtoH_v2"));
            let memset: unsafe extern "C" fn(u64, u8, usize) -> R = d.f("cuMemsetD8_v2");
            let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
            let mut back = vec![0u8; 4096];
            let mut p = 0u64;
            // SAFETY: buffers of the stated lengths.
            unsafe {
                assert_eq!(alloc(&mut p, 0), INVALID_VALUE);
                assert_eq!(alloc(&mut p, 4096), SUCCESS);
                assert_eq!(htod(p, data.as_ptr().cast(), 4096), SUCCESS);
                assert_eq!(memset(p + 100, 0xab, 10), SUCCESS);
                assert_eq!(dtoh(back.as_mut_ptr().cast(), p, 4096), SUCCESS);
                let mut want = data.clone();
                want[100..110].fill(0xab);
                assert_eq!(back, want);
                assert_eq!(
                    dtoh(back.as_mut_ptr().cast(), p + 4000, 200),
                    INVALID_VALUE,
                    "past the end"
                );
                assert_eq!(free(p), SUCCESS);
                assert_eq!(free(p), INVALID_VALUE, "double free");
                assert_eq!(
                    dtoh(back.as_mut_ptr().cast(), p, 16),
                    INVALID_VALUE,
                    "use after free"
                );
            }
        }),
        Ok(0)
    );
}

#[test]
fn the_host_cannot_dereference_device_memory() {
    let ended = with_context(|d| {
        let alloc: Alloc = d.f("cuMemAlloc_v2");
        let mut p = 0u64;
        // SAFETY: a valid out pointer; the read below is the crash under test.
        unsafe {
            assert_eq!(alloc(&mut p, 4096), SUCCESS);
            std::ptr::read_volatile(p as *const u8);
        }
    });
    assert_eq!(
        ended,
        Err(libc::SIGSEGV),
        "a host read of device memory must crash"
    );
}

#[test]
fn stream_work_is_ordered_by_events_across_streams() {
    assert_eq!(
        with_context(|d| {
            let create: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuStreamCreate");
            let event: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuEventCreate");
            let record: unsafe extern "C" fn(Ptr, Ptr) -> R = d.f("cuEventRecord");
            let wait: unsafe extern "C" fn(Ptr, Ptr, u32) -> R = d.f("cuStreamWaitEvent");
            let sync: unsafe extern "C" fn(Ptr) -> R = d.f("cuStreamSynchronize");
            let host_alloc: unsafe extern "C" fn(*mut Ptr, usize, u32) -> R = d.f("cuMemHostAlloc");
            let htod: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> R =
                d.f("cuMemcpyHtoDAsync_v2");
            let dtoh: unsafe extern "C" fn(Ptr, u64, usize, Ptr) -> R = d.f("cuMemcpyDtoHAsync_v2");
            let alloc: Alloc = d.f("cuMemAlloc_v2");
            let n = 64 << 20;
            let (mut a, mut b, mut e, mut src, mut dst) = (
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let mut dev = 0u64;
            // SAFETY: pinned buffers of n bytes; every pointer is valid until the process ends.
            unsafe {
                assert_eq!(create(&mut a, 0), SUCCESS);
                assert_eq!(create(&mut b, 0), SUCCESS);
                assert_eq!(event(&mut e, 0), SUCCESS);
                assert_eq!(host_alloc(&mut src, n, 0), SUCCESS);
                assert_eq!(host_alloc(&mut dst, n, 0), SUCCESS);
                assert_eq!(alloc(&mut dev, n), SUCCESS);
                std::ptr::write_bytes(src.cast::<u8>(), 0x5a, n);
                // Stream a uploads; stream b downloads after a's event: b sees the upload.
                assert_eq!(htod(dev, src, n, a), SUCCESS);
                assert_eq!(record(e, a), SUCCESS);
                assert_eq!(wait(b, e, 0), SUCCESS);
                assert_eq!(dtoh(dst, dev, n, b), SUCCESS);
                assert_eq!(sync(b), SUCCESS);
                let got = std::slice::from_raw_parts(dst.cast::<u8>(), n);
                assert!(
                    got.iter().all(|&x| x == 0x5a),
                    "the download ran before the upload"
                );
            }
        }),
        Ok(0)
    );
}

#[test]
fn modules_name_their_entries_and_unimplemented_functions_abort() {
    assert_eq!(
        with_context(|d| {
            let load: unsafe extern "C" fn(*mut Ptr, *const c_void) -> R = d.f("cuModuleLoadData");
            let get: unsafe extern "C" fn(*mut Ptr, Ptr, *const i8) -> R =
                d.f("cuModuleGetFunction");
            let ptx = c".version 8.0\n.target sm_80\n.visible .entry kv_gather(\n.param .align 8 .b8 p[96]\n)\n{ ret; }\n";
            let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: a NUL-terminated image and names.
            unsafe {
                assert_eq!(
                    load(&mut m, c"not ptx".as_ptr().cast()),
                    200,
                    "CUDA_ERROR_INVALID_IMAGE"
                );
                assert_eq!(load(&mut m, ptx.as_ptr().cast()), SUCCESS);
                assert_eq!(get(&mut f, m, c"kv_gather".as_ptr()), SUCCESS);
                assert_eq!(
                    get(&mut f, m, c"kv_scatter".as_ptr()),
                    NOT_FOUND,
                    "not in this module"
                );
            }
        }),
        Ok(0)
    );
    assert_eq!(
        in_child(|| {
            let d = Driver::open();
            let f: unsafe extern "C" fn() -> R = d.f("cuGraphCreate");
            // SAFETY: the stub takes no arguments it reads; it aborts.
            unsafe { f() };
        }),
        Err(libc::SIGABRT)
    );
}
