//! The CUDA driver emulator (emu/cuda) against the driver's documented behaviour, called through
//! its C ABI: devices, contexts, memory, copies, streams, events, modules. IPC and the virtual
//! memory management API: tests/cuda/cuda_emu_ipc.rs; the harness: tests/cuda/driver.rs.
//! tests/cuda/kernel_gpu.rs runs kvferry's own cudarc calls on the same library (scripts/test).
#![allow(unsafe_code)]

use crate::driver;

use std::ffi::c_void;

use driver::*;

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
                let unload: unsafe extern "C" fn(Ptr) -> R = d.f("cuModuleUnload");
                assert_eq!(unload(m), SUCCESS);
                assert_eq!(unload(m), 400, "CUDA_ERROR_INVALID_HANDLE: unloaded");
                assert_eq!(get(&mut f, m, c"kv_gather".as_ptr()), 400);
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

#[test]
fn devices_report_plausible_attributes_and_memory() {
    assert_eq!(
        with_context(|d| {
            let attr: unsafe extern "C" fn(*mut i32, i32, i32) -> R = d.f("cuDeviceGetAttribute");
            let name: unsafe extern "C" fn(*mut i8, i32, i32) -> R = d.f("cuDeviceGetName");
            let total: unsafe extern "C" fn(*mut usize, i32) -> R = d.f("cuDeviceTotalMem_v2");
            let version: unsafe extern "C" fn(*mut i32) -> R = d.f("cuDriverGetVersion");
            let info: unsafe extern "C" fn(*mut usize, *mut usize) -> R = d.f("cuMemGetInfo_v2");
            let (alloc, free): (Alloc, Free) = (d.f("cuMemAlloc_v2"), d.f("cuMemFree_v2"));
            let get = |a: i32| {
                let mut v = -1;
                // SAFETY: a valid out pointer.
                assert_eq!(unsafe { attr(&mut v, a, 0) }, SUCCESS, "attribute {a}");
                v
            };
            // Compute capability 8.0, warp 32, 1024 threads per block, unified addressing.
            assert_eq!(
                (get(75), get(76), get(10), get(1), get(41)),
                (8, 0, 32, 1024, 1)
            );
            let mut buf = [0i8; 64];
            let (mut v, mut bytes, mut free_bytes, mut p) = (0, 0usize, 0usize, 0u64);
            // SAFETY: buffers of the stated lengths, valid out pointers.
            unsafe {
                assert_eq!(attr(&mut v, 75, 2), INVALID_DEVICE);
                assert_eq!(attr(std::ptr::null_mut(), 75, 0), INVALID_VALUE);
                assert_eq!(name(buf.as_mut_ptr(), 64, 1), SUCCESS);
                let text = std::ffi::CStr::from_ptr(buf.as_ptr())
                    .to_str()
                    .unwrap()
                    .to_owned();
                assert!(text.contains("emulator") && text.ends_with('1'), "{text}");
                assert_eq!(total(&mut bytes, 0), SUCCESS);
                assert_eq!(bytes, 16 << 30);
                assert_eq!(version(&mut v), SUCCESS);
                assert!(v >= 12000, "CUDA 12 or later: {v}");
                assert_eq!(info(&mut free_bytes, &mut bytes), SUCCESS);
                assert_eq!(free_bytes, bytes, "nothing allocated yet");
                assert_eq!(alloc(&mut p, 100 << 20), SUCCESS);
                assert_eq!(info(&mut free_bytes, &mut bytes), SUCCESS);
                assert_eq!(bytes - free_bytes, 100 << 20);
                assert_eq!(alloc(&mut p, 16 << 30), 2, "CUDA_ERROR_OUT_OF_MEMORY");
                assert_eq!(free(p), SUCCESS);
                assert_eq!(info(&mut free_bytes, &mut bytes), SUCCESS);
                assert_eq!(free_bytes, bytes, "freed");
            }
        }),
        Ok(0)
    );
}

#[test]
fn contexts_are_current_per_thread_and_checked() {
    assert_eq!(
        with_context(|d| {
            let set: unsafe extern "C" fn(Ptr) -> R = d.f("cuCtxSetCurrent");
            let current: unsafe extern "C" fn(*mut Ptr) -> R = d.f("cuCtxGetCurrent");
            let device: unsafe extern "C" fn(*mut i32) -> R = d.f("cuCtxGetDevice");
            let retain: unsafe extern "C" fn(*mut Ptr, i32) -> R = d.f("cuDevicePrimaryCtxRetain");
            let release: unsafe extern "C" fn(i32) -> R = d.f("cuDevicePrimaryCtxRelease_v2");
            let alloc: Alloc = d.f("cuMemAlloc_v2");
            let (mut ctx1, mut got, mut dev, mut bogus) =
                (std::ptr::null_mut(), std::ptr::null_mut(), -1, 0u64);
            // SAFETY: valid out pointers; `bogus` is an address that is no context.
            unsafe {
                assert_eq!(
                    release(1),
                    INVALID_CONTEXT,
                    "device 1's context was never retained"
                );
                assert_eq!(retain(&mut ctx1, 1), SUCCESS);
                assert_eq!(set(ctx1), SUCCESS);
                assert_eq!(current(&mut got), SUCCESS);
                assert_eq!(got, ctx1);
                assert_eq!(device(&mut dev), SUCCESS);
                assert_eq!(dev, 1);
                assert_eq!(
                    set((&raw mut bogus).cast()),
                    INVALID_CONTEXT,
                    "not a context"
                );
                assert_eq!(current(&mut got), SUCCESS);
                assert_eq!(got, ctx1, "unchanged by the refused call");
                assert_eq!(release(1), SUCCESS);
            }
            // Another thread has no current context until it sets one.
            let a = alloc as usize;
            std::thread::spawn(move || {
                // SAFETY: the same function pointer, moved as an address.
                let alloc: Alloc = unsafe { std::mem::transmute::<usize, Alloc>(a) };
                let mut p = 0u64;
                // SAFETY: a valid out pointer.
                assert_eq!(unsafe { alloc(&mut p, 64) }, INVALID_CONTEXT);
            })
            .join()
            .expect("the thread's assertion");
        }),
        Ok(0)
    );
}

#[test]
fn registered_host_memory_is_its_own_device_address() {
    assert_eq!(
        with_context(|d| {
            let register: unsafe extern "C" fn(Ptr, usize, u32) -> R = d.f("cuMemHostRegister_v2");
            let unregister: unsafe extern "C" fn(Ptr) -> R = d.f("cuMemHostUnregister");
            let device_ptr: unsafe extern "C" fn(*mut u64, Ptr, u32) -> R =
                d.f("cuMemHostGetDevicePointer_v2");
            let free_host: unsafe extern "C" fn(Ptr) -> R = d.f("cuMemFreeHost");
            let (alloc, htod): (Alloc, HtoD) = (d.f("cuMemAlloc_v2"), d.f("cuMemcpyHtoD_v2"));
            let dtod: unsafe extern "C" fn(u64, u64, usize) -> R = d.f("cuMemcpyDtoD_v2");
            let mut host = vec![0u8; 8192];
            let base: Ptr = host.as_mut_ptr().cast();
            let (mut q, mut dev) = (0u64, 0u64);
            // SAFETY: `host` outlives every use; buffers of the stated lengths.
            unsafe {
                assert_eq!(
                    device_ptr(&mut q, base, 0),
                    INVALID_VALUE,
                    "not registered yet"
                );
                assert_eq!(register(base, 8192, 0), SUCCESS);
                assert_eq!(register(base.add(4096), 100, 0), 712, "ALREADY_REGISTERED");
                assert_eq!(device_ptr(&mut q, base, 0), SUCCESS);
                assert_eq!(q, base as u64, "unified addressing");
                // A device-to-device copy may name registered memory by its device address.
                assert_eq!(alloc(&mut dev, 4096), SUCCESS);
                assert_eq!(htod(dev, [7u8; 4096].as_ptr().cast(), 4096), SUCCESS);
                assert_eq!(dtod(q + 100, dev, 4096), SUCCESS);
                assert_eq!(
                    free_host(base),
                    INVALID_VALUE,
                    "registered, not allocated by the driver"
                );
                assert_eq!(unregister(base), SUCCESS);
                assert_eq!(unregister(base), 713, "NOT_REGISTERED");
                assert_eq!(
                    device_ptr(&mut q, dev as Ptr, 0),
                    INVALID_VALUE,
                    "device memory"
                );
            }
            assert!(host[100..4196].iter().all(|&b| b == 7) && host[..100].iter().all(|&b| b == 0));
        }),
        Ok(0)
    );
}

#[test]
fn the_null_stream_waits_for_blocking_streams_and_queries_settle() {
    assert_eq!(
        with_context(|d| {
            let create: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuStreamCreate");
            let destroy: unsafe extern "C" fn(Ptr) -> R = d.f("cuStreamDestroy_v2");
            let sync: unsafe extern "C" fn(Ptr) -> R = d.f("cuStreamSynchronize");
            let query: unsafe extern "C" fn(Ptr) -> R = d.f("cuStreamQuery");
            let event: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuEventCreate");
            let record: unsafe extern "C" fn(Ptr, Ptr) -> R = d.f("cuEventRecord");
            let event_query: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventQuery");
            let event_sync: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventSynchronize");
            let host_alloc: unsafe extern "C" fn(*mut Ptr, usize, u32) -> R = d.f("cuMemHostAlloc");
            let htod_async: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> R =
                d.f("cuMemcpyHtoDAsync_v2");
            let (alloc, dtoh): (Alloc, DtoH) = (d.f("cuMemAlloc_v2"), d.f("cuMemcpyDtoH_v2"));
            let n = 64 << 20;
            let (mut a, mut e, mut src) = (
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let mut dev = 0u64;
            let mut back = vec![0u8; n];
            let null = std::ptr::null_mut();
            // SAFETY: pinned and host buffers of n bytes, valid out pointers.
            unsafe {
                assert_eq!(create(&mut a, 2), INVALID_VALUE, "unknown flags");
                assert_eq!(create(&mut a, 0), SUCCESS);
                assert_eq!(event(&mut e, 0), SUCCESS);
                assert_eq!(event_query(e), SUCCESS, "never recorded");
                assert_eq!(host_alloc(&mut src, n, 0), SUCCESS);
                assert_eq!(alloc(&mut dev, n), SUCCESS);
                std::ptr::write_bytes(src.cast::<u8>(), 0x3c, n);
                // The upload runs on stream a; the synchronous download on the null stream
                // starts only after it (the legacy default stream's ordering), with no event.
                assert_eq!(htod_async(dev, src, n, a), SUCCESS);
                assert_eq!(record(e, a), SUCCESS);
                let state = event_query(e);
                assert!(
                    state == SUCCESS || state == 600,
                    "NOT_READY or done: {state}"
                );
                assert_eq!(dtoh(back.as_mut_ptr().cast(), dev, n), SUCCESS);
                assert!(
                    back.iter().all(|&b| b == 0x3c),
                    "the null stream ran before stream a"
                );
                assert_eq!(event_sync(e), SUCCESS);
                assert_eq!(event_query(e), SUCCESS);
                assert_eq!(sync(a), SUCCESS);
                assert_eq!(query(a), SUCCESS);
                assert_eq!(query(null), SUCCESS);
                assert_eq!(destroy(a), SUCCESS);
                assert_eq!(destroy(a), 400, "INVALID_HANDLE: destroyed");
                assert_eq!(event_query(null), 400);
            }
        }),
        Ok(0)
    );
}

/// KvXferParams (kernels/kv_transfer.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KvXferParams {
    planes: u64,
    pages: u64,
    staging: u64,
    page_stride: u64,
    page_size: u32,
    pool_heads: u32,
    head_bytes: u32,
    cell_bytes: u32,
    num_planes: u32,
    layer0: u32,
    head0: u32,
    heads: u32,
    page_blocks: u32,
    first_token: u32,
    end_token: u32,
    pool_order: u32,
    wire_order: u32,
}

/// Gathers page 1 (16 tokens of one 64-byte head) of a one-plane pool into `staging_bytes` of
/// staging with `kv_gather` on the null stream; returns cuStreamSynchronize's result and what
/// the page and the staging held. `free_pool`: the pool is freed before the launch.
fn gather_one_page(d: &Driver, staging_bytes: usize, free_pool: bool) -> (R, Vec<u8>, Vec<u8>) {
    let load: unsafe extern "C" fn(*mut Ptr, *const c_void) -> R = d.f("cuModuleLoadData");
    let get: unsafe extern "C" fn(*mut Ptr, Ptr, *const i8) -> R = d.f("cuModuleGetFunction");
    #[allow(clippy::type_complexity)]
    let launch: unsafe extern "C" fn(
        Ptr,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        Ptr,
        *mut Ptr,
        *mut Ptr,
    ) -> R = d.f("cuLaunchKernel");
    let sync: unsafe extern "C" fn(Ptr) -> R = d.f("cuStreamSynchronize");
    let (alloc, free, htod, dtoh): (Alloc, Free, HtoD, DtoH) = (
        d.f("cuMemAlloc_v2"),
        d.f("cuMemFree_v2"),
        d.f("cuMemcpyHtoD_v2"),
        d.f("cuMemcpyDtoH_v2"),
    );
    let ptx = c".version 8.0\n.target sm_80\n.visible .entry kv_gather(\n.param .align 8 .b8 p[80]\n)\n{ ret; }\n";
    let page = 16 * 64;
    let pool_bytes: Vec<u8> = (0..2 * page).map(|i| (i * 7 + 3) as u8).collect();
    let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    let (mut pool, mut table, mut pages, mut staging) = (0u64, 0u64, 0u64, 0u64);
    let mut staged = vec![0u8; staging_bytes];
    let null = std::ptr::null_mut();
    // SAFETY: a NUL-terminated image, valid out pointers, buffers of the stated lengths.
    unsafe {
        assert_eq!(load(&mut m, ptx.as_ptr().cast()), SUCCESS);
        assert_eq!(get(&mut f, m, c"kv_gather".as_ptr()), SUCCESS);
        assert_eq!(alloc(&mut pool, 2 * page), SUCCESS);
        assert_eq!(htod(pool, pool_bytes.as_ptr().cast(), 2 * page), SUCCESS);
        assert_eq!(alloc(&mut table, 8), SUCCESS);
        assert_eq!(htod(table, (&raw const pool).cast(), 8), SUCCESS);
        assert_eq!(alloc(&mut pages, 4), SUCCESS);
        assert_eq!(htod(pages, [1u32].as_ptr().cast(), 4), SUCCESS);
        assert_eq!(alloc(&mut staging, staging_bytes), SUCCESS);
        if free_pool {
            assert_eq!(free(pool), SUCCESS);
        }
        let mut params = KvXferParams {
            planes: table,
            pages,
            staging,
            page_stride: page as u64,
            page_size: 16,
            pool_heads: 1,
            head_bytes: 64,
            cell_bytes: 64,
            num_planes: 1,
            heads: 1,
            page_blocks: 1,
            end_token: 16,
            ..KvXferParams::default()
        };
        let mut args = [(&raw mut params).cast::<c_void>()];
        assert_eq!(
            launch(
                f,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                null,
                args.as_mut_ptr(),
                null.cast()
            ),
            SUCCESS
        );
        let ended = sync(null);
        if ended == SUCCESS {
            assert_eq!(
                dtoh(staged.as_mut_ptr().cast(), staging, staging_bytes),
                SUCCESS
            );
        }
        (ended, pool_bytes[page..].to_vec(), staged)
    }
}

#[test]
fn a_launch_moves_the_pages_it_names_and_nothing_else() {
    assert_eq!(
        with_context(|d| {
            let (ended, page, staged) = gather_one_page(d, 2048, false);
            assert_eq!(ended, SUCCESS);
            assert!(staged[..1024] == page[..], "page 1 in staging");
            assert!(
                staged[1024..].iter().all(|&b| b == 0),
                "staging past the page untouched"
            );
        }),
        Ok(0)
    );
}

#[test]
fn a_launch_outside_live_memory_is_a_sticky_error() {
    for (staging_bytes, free_pool, what) in [
        (1000, false, "staging 24 bytes short"),
        (1024, true, "pool freed"),
    ] {
        assert_eq!(
            with_context(|d| {
                let (ended, _, _) = gather_one_page(d, staging_bytes, free_pool);
                assert_eq!(ended, 700, "CUDA_ERROR_ILLEGAL_ADDRESS: {what}");
                let htod: HtoD = d.f("cuMemcpyHtoD_v2");
                let alloc: Alloc = d.f("cuMemAlloc_v2");
                let mut p = 0u64;
                // SAFETY: valid pointers; both calls must be refused.
                unsafe {
                    assert_eq!(alloc(&mut p, 64), 700, "sticky: later calls fail too");
                    assert_eq!(htod(p, [0u8; 8].as_ptr().cast(), 8), 700);
                }
            }),
            Ok(0),
            "{what}"
        );
    }
}

#[test]
fn async_work_on_streams_completes_by_context_synchronize() {
    assert_eq!(
        with_context(|d| {
            let create: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuStreamCreate");
            let ctx_sync: unsafe extern "C" fn() -> R = d.f("cuCtxSynchronize");
            let event: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuEventCreate");
            let record: unsafe extern "C" fn(Ptr, Ptr) -> R = d.f("cuEventRecord");
            let event_destroy: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventDestroy_v2");
            let host_alloc: unsafe extern "C" fn(*mut Ptr, usize, u32) -> R = d.f("cuMemHostAlloc");
            let memset: unsafe extern "C" fn(u64, u8, usize, Ptr) -> R = d.f("cuMemsetD8Async");
            let dtod: unsafe extern "C" fn(u64, u64, usize, Ptr) -> R = d.f("cuMemcpyDtoDAsync_v2");
            let dtoh: unsafe extern "C" fn(Ptr, u64, usize, Ptr) -> R = d.f("cuMemcpyDtoHAsync_v2");
            let alloc: Alloc = d.f("cuMemAlloc_v2");
            let n = 32 << 20;
            let (mut a, mut e, mut dst) = (
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let (mut x, mut y) = (0u64, 0u64);
            // SAFETY: a pinned buffer of n bytes, valid out pointers.
            unsafe {
                assert_eq!(create(&mut a, 1), SUCCESS, "CU_STREAM_NON_BLOCKING");
                assert_eq!(event(&mut e, 0), SUCCESS);
                assert_eq!(host_alloc(&mut dst, n, 0), SUCCESS);
                assert_eq!(alloc(&mut x, n), SUCCESS);
                assert_eq!(alloc(&mut y, n), SUCCESS);
                // One stream: fill x, copy it to y, download y into pinned memory.
                assert_eq!(memset(x, 0x42, n, a), SUCCESS);
                assert_eq!(dtod(y, x, n, a), SUCCESS);
                assert_eq!(dtoh(dst, y, n, a), SUCCESS);
                assert_eq!(record(e, a), SUCCESS);
                // The context synchronize waits for every stream; then the event goes.
                assert_eq!(ctx_sync(), SUCCESS);
                assert_eq!(event_destroy(e), SUCCESS);
                assert_eq!(event_destroy(e), 400, "destroyed");
                let got = std::slice::from_raw_parts(dst.cast::<u8>(), n);
                assert!(
                    got.iter().all(|&b| b == 0x42),
                    "the stream's work was not done"
                );
                assert_eq!(
                    memset(x + n as u64 - 8, 0, 16, a),
                    INVALID_VALUE,
                    "past the end"
                );
            }
        }),
        Ok(0)
    );
}

#[test]
fn work_waits_for_exactly_what_it_is_ordered_after() {
    assert_eq!(
        with_context(|d| {
            let create: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuStreamCreate");
            let query: unsafe extern "C" fn(Ptr) -> R = d.f("cuStreamQuery");
            let sync: unsafe extern "C" fn(Ptr) -> R = d.f("cuStreamSynchronize");
            let ctx_sync: unsafe extern "C" fn() -> R = d.f("cuCtxSynchronize");
            let hold: unsafe extern "C" fn(Ptr, u64, u32, u32) -> R = d.f("cuStreamWaitValue32_v2");
            let event: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuEventCreate");
            let record: unsafe extern "C" fn(Ptr, Ptr) -> R = d.f("cuEventRecord");
            let wait: unsafe extern "C" fn(Ptr, Ptr, u32) -> R = d.f("cuStreamWaitEvent");
            let event_query: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventQuery");
            let event_sync: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventSynchronize");
            let event_destroy: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventDestroy_v2");
            let host_alloc: unsafe extern "C" fn(*mut Ptr, usize, u32) -> R = d.f("cuMemHostAlloc");
            let htod: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> R =
                d.f("cuMemcpyHtoDAsync_v2");
            let memset: unsafe extern "C" fn(u64, u8, usize, Ptr) -> R = d.f("cuMemsetD8Async");
            let dtoh_async: unsafe extern "C" fn(Ptr, u64, usize, Ptr) -> R =
                d.f("cuMemcpyDtoHAsync_v2");
            let (alloc, dtoh): (Alloc, DtoH) = (d.f("cuMemAlloc_v2"), d.f("cuMemcpyDtoH_v2"));
            let null = std::ptr::null_mut();
            let [mut a, mut b, mut c, mut w, mut e, mut f, mut flags] = [null; 7];
            let (mut x, mut y, mut z) = (0u64, 0u64, 0u64);
            let n = 1 << 20;
            let mut src = vec![0x61u8; n];
            let mut back = vec![0u8; n];
            // SAFETY: pinned flags of 8 bytes written while streams poll them (volatile); buffers
            // of the stated lengths.
            unsafe {
                assert_eq!(create(&mut a, 0), SUCCESS);
                assert_eq!(create(&mut b, 0), SUCCESS);
                assert_eq!(create(&mut c, 1), SUCCESS, "non-blocking");
                assert_eq!(create(&mut w, 1), SUCCESS, "non-blocking");
                assert_eq!(event(&mut e, 0), SUCCESS);
                assert_eq!(event(&mut f, 0), SUCCESS);
                assert_eq!(host_alloc(&mut flags, 8, 0), SUCCESS);
                let (flag_a, flag_null) = (flags.cast::<u32>(), flags.cast::<u32>().add(1));
                flag_a.write_volatile(0);
                flag_null.write_volatile(0);
                for p in [&mut x, &mut y, &mut z] {
                    assert_eq!(alloc(p, n), SUCCESS);
                }
                // Stream a is held; its upload from pageable memory took the bytes at the call.
                assert_eq!(hold(a, flag_a as u64, 1, 0), SUCCESS);
                assert_eq!(htod(x, src.as_ptr().cast(), n, a), SUCCESS);
                src.fill(0xff);
                assert_eq!(query(a), 600, "NOT_READY: held");
                // An event recorded behind the hold; a wait on it, then the event destroyed at
                // once: the wait still holds stream w.
                assert_eq!(record(e, a), SUCCESS);
                assert_eq!(event_query(e), 600);
                assert_eq!(wait(w, e, 0), SUCCESS);
                assert_eq!(memset(z, 0x33, n, w), SUCCESS);
                assert_eq!(event_destroy(e), SUCCESS);
                assert_eq!(query(w), 600, "waits for the destroyed event's record");
                // Records finish out of order: f's latest record (on c) is what counts.
                assert_eq!(record(f, a), SUCCESS);
                assert_eq!(record(f, c), SUCCESS);
                assert_eq!(
                    event_sync(f),
                    SUCCESS,
                    "the latest record, not the held one"
                );
                assert_eq!(event_query(f), SUCCESS);
                // The null stream waits for a (blocking); stream b for the null stream; the
                // non-blocking c for neither.
                assert_eq!(hold(null, flag_null as u64, 1, 0), SUCCESS);
                assert_eq!(memset(y, 0x44, n, b), SUCCESS);
                assert_eq!(query(b), 600, "behind the held null stream");
                assert_eq!(memset(y, 0x55, 16, c), SUCCESS);
                let mut seen = null;
                assert_eq!(host_alloc(&mut seen, n, 0), SUCCESS);
                assert_eq!(dtoh_async(seen, y, n, c), SUCCESS);
                assert_eq!(
                    sync(c),
                    SUCCESS,
                    "a non-blocking stream is not ordered with them"
                );
                let seen = std::slice::from_raw_parts(seen.cast::<u8>(), n);
                assert!(
                    seen[..16] == [0x55; 16] && seen[16..].iter().all(|&v| v == 0),
                    "b's memset ran early"
                );
                flag_null.write_volatile(1);
                assert_eq!(query(b), 600, "the null stream's hold came after a's work");
                flag_a.write_volatile(1);
                assert_eq!(ctx_sync(), SUCCESS);
                assert_eq!(dtoh(back.as_mut_ptr().cast(), x, n), SUCCESS);
                assert!(
                    back.iter().all(|&v| v == 0x61),
                    "the upload took the bytes at the call"
                );
                assert_eq!(dtoh(back.as_mut_ptr().cast(), y, n), SUCCESS);
                assert!(back.iter().all(|&v| v == 0x44), "b's memset ran after c's");
                assert_eq!(dtoh(back.as_mut_ptr().cast(), z, n), SUCCESS);
                assert!(back.iter().all(|&v| v == 0x33));
            }
        }),
        Ok(0)
    );
}

#[test]
fn error_codes_have_the_drivers_names_and_texts() {
    assert_eq!(
        in_child(|| {
            // Before cuInit, as with the driver.
            let d = Driver::open();
            let name: unsafe extern "C" fn(R, *mut *const i8) -> R = d.f("cuGetErrorName");
            let text: unsafe extern "C" fn(R, *mut *const i8) -> R = d.f("cuGetErrorString");
            let mut p = std::ptr::null();
            // SAFETY: valid out-pointers; the strings are static.
            unsafe {
                assert_eq!(name(700, &mut p), SUCCESS);
                assert_eq!(
                    std::ffi::CStr::from_ptr(p).to_str(),
                    Ok("CUDA_ERROR_ILLEGAL_ADDRESS")
                );
                assert_eq!(text(INVALID_CONTEXT, &mut p), SUCCESS);
                assert_eq!(
                    std::ffi::CStr::from_ptr(p).to_str(),
                    Ok("invalid device context")
                );
                assert_eq!(text(123_456, &mut p), INVALID_VALUE, "not a CUDA error");
                assert!(p.is_null());
            }
        }),
        Ok(0)
    );
}

#[test]
fn proc_addresses_name_implemented_functions_only() {
    assert_eq!(
        in_child(|| {
            let d = Driver::open();
            #[allow(clippy::type_complexity)]
            let get: unsafe extern "C" fn(
                *const i8,
                *mut Ptr,
                i32,
                u64,
                *mut i32,
            ) -> R = d.f("cuGetProcAddress_v2");
            let alloc: Alloc = d.f("cuMemAlloc_v2");
            let (mut f, mut status) = (std::ptr::null_mut(), -1);
            // SAFETY: NUL-terminated names and valid out-pointers.
            unsafe {
                assert_eq!(
                    get(c"cuMemAlloc".as_ptr(), &mut f, 12080, 0, &mut status),
                    SUCCESS
                );
                assert_eq!(
                    (f as usize, status),
                    (alloc as usize, 0),
                    "the newest version, _v2"
                );
                let stubbed = get(c"cuGraphCreate".as_ptr(), &mut f, 12080, 0, &mut status);
                assert_eq!(
                    (stubbed, f.is_null(), status),
                    (NOT_FOUND, true, 1),
                    "not implemented: absent"
                );
                for name in [c"cuIpcGetEventHandle", c"cuIpcOpenEventHandle"] {
                    assert_eq!(get(name.as_ptr(), &mut f, 12080, 0, &mut status), SUCCESS);
                    assert!(!f.is_null() && status == 0, "{name:?} is implemented");
                }
                let unknown = get(c"cuNoSuchFunction".as_ptr(), &mut f, 12080, 0, &mut status);
                assert_eq!((unknown, status), (NOT_FOUND, 1));
            }
        }),
        Ok(0)
    );
}

#[test]
fn interprocess_events_need_disabled_timing_and_export_their_handle_only() {
    const DISABLE_TIMING: u32 = 2;
    const INTERPROCESS: u32 = 4;
    const INVALID_HANDLE: R = 400;
    assert_eq!(
        with_context(|d| {
            let create: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuEventCreate");
            let destroy: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventDestroy_v2");
            let get: unsafe extern "C" fn(*mut [u8; 64], Ptr) -> R = d.f("cuIpcGetEventHandle");
            let open: unsafe extern "C" fn(*mut Ptr, [u8; 64]) -> R = d.f("cuIpcOpenEventHandle");
            let record: unsafe extern "C" fn(Ptr, Ptr) -> R = d.f("cuEventRecord");
            let sync: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventSynchronize");
            let query: unsafe extern "C" fn(Ptr) -> R = d.f("cuEventQuery");
            let (mut plain, mut shared, mut opened) = (
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let mut h = [0u8; 64];
            // SAFETY: valid out pointers; events of this process.
            unsafe {
                assert_eq!(
                    create(&mut shared, INTERPROCESS),
                    INVALID_VALUE,
                    "interprocess without disabled timing"
                );
                assert_eq!(create(&mut shared, 0x100), INVALID_VALUE, "an unknown flag");
                assert_eq!(create(&mut plain, DISABLE_TIMING), SUCCESS);
                assert_eq!(
                    get(&mut h, plain),
                    INVALID_VALUE,
                    "not created interprocess"
                );
                assert_eq!(create(&mut shared, INTERPROCESS | DISABLE_TIMING), SUCCESS);
                assert_eq!(get(std::ptr::null_mut(), shared), INVALID_VALUE);
                assert_eq!(get(&mut h, 0x1234 as Ptr), INVALID_HANDLE, "not an event");
                assert_eq!(query(shared), SUCCESS, "never recorded");
                assert_eq!(get(&mut h, shared), SUCCESS);
                assert_ne!(h, [0u8; 64]);
                assert_eq!(
                    open(&mut opened, h),
                    INVALID_CONTEXT,
                    "opened in the exporting process"
                );
                // An interprocess event still orders work in its own process.
                assert_eq!(record(shared, std::ptr::null_mut()), SUCCESS);
                assert_eq!(sync(shared), SUCCESS);
                assert_eq!(query(shared), SUCCESS);
                assert_eq!(destroy(shared), SUCCESS);
                assert_eq!(get(&mut h, shared), INVALID_HANDLE, "destroyed");
                assert_eq!(destroy(plain), SUCCESS);
            }
        }),
        Ok(0)
    );
}

/// What UCX's CUDA transports (libuct_cuda of UCX 1.22) ask of the driver: pointer attributes,
/// the context stack, contexts' ids and devices' UUIDs, unified copies, stream callbacks, and
/// stream, event and pointer calls from a thread without a current context (UCX's progress
/// thread); and NVML, which they link, beside the driver.
#[test]
fn what_ucx_asks_of_the_driver_is_answered_as_documented() {
    type GetAttrs = unsafe extern "C" fn(u32, *const i32, *const *mut c_void, u64) -> R;
    type GetAttr = unsafe extern "C" fn(*mut c_void, i32, u64) -> R;
    type Callback = unsafe extern "C" fn(*mut c_void, R, *mut c_void);
    assert_eq!(
        with_context(|d| {
            let alloc: Alloc = d.f("cuMemAlloc_v2");
            let attrs: GetAttrs = d.f("cuPointerGetAttributes");
            let attr: GetAttr = d.f("cuPointerGetAttribute");
            let current: unsafe extern "C" fn(*mut *mut c_void) -> R = d.f("cuCtxGetCurrent");
            let push: unsafe extern "C" fn(*mut c_void) -> R = d.f("cuCtxPushCurrent_v2");
            let pop: unsafe extern "C" fn(*mut *mut c_void) -> R = d.f("cuCtxPopCurrent_v2");
            let set: unsafe extern "C" fn(*mut c_void) -> R = d.f("cuCtxSetCurrent");
            let ctx_id: unsafe extern "C" fn(*mut c_void, *mut u64) -> R = d.f("cuCtxGetId");
            let state: unsafe extern "C" fn(i32, *mut u32, *mut i32) -> R =
                d.f("cuDevicePrimaryCtxGetState");
            let uuid: unsafe extern "C" fn(*mut u8, i32) -> R = d.f("cuDeviceGetUuid");
            let copy: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> R =
                d.f("cuMemcpyAsync");
            let stream_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> R =
                d.f("cuStreamCreate");
            let add_callback: unsafe extern "C" fn(*mut c_void, Callback, *mut c_void, u32) -> R =
                d.f("cuStreamAddCallback");
            let sync: unsafe extern "C" fn(*mut c_void) -> R = d.f("cuStreamSynchronize");
            let retain_handle: unsafe extern "C" fn(*mut u64, *mut c_void) -> R =
                d.f("cuMemRetainAllocationHandle");
            // SAFETY: out pointers of the sizes the driver writes; buffers of the stated lengths.
            unsafe {
                let mut ctx = std::ptr::null_mut();
                assert_eq!(current(&mut ctx), SUCCESS);
                let mut p = 0u64;
                assert_eq!(alloc(&mut p, 1 << 20), SUCCESS);
                // Device memory, asked by an address inside it.
                let (mut kind, mut managed, mut ordinal) = (0u32, 7i32, -1i32);
                let mut owner: *mut c_void = std::ptr::null_mut();
                let (mut start, mut size, mut id, mut legacy) = (0u64, 0usize, 0u64, 0i32);
                let which = [2, 8, 9, 1, 11, 12, 7, 10];
                let data: [*mut c_void; 8] = [
                    (&raw mut kind).cast(),
                    (&raw mut managed).cast(),
                    (&raw mut ordinal).cast(),
                    (&raw mut owner).cast(),
                    (&raw mut start).cast(),
                    (&raw mut size).cast(),
                    (&raw mut id).cast(),
                    (&raw mut legacy).cast(),
                ];
                assert_eq!(attrs(8, which.as_ptr(), data.as_ptr(), p + 4096), SUCCESS);
                assert_eq!(
                    (kind, managed, ordinal),
                    (2, 0, 0),
                    "device memory of device 0"
                );
                assert_eq!(owner, ctx, "the primary context");
                assert_eq!(
                    (start, size, legacy),
                    (p, 1 << 20, 1),
                    "the whole allocation"
                );
                let mut id_at_base = 0u64;
                assert_eq!(attr((&raw mut id_at_base).cast(), 7, p), SUCCESS);
                assert_eq!(id, id_at_base, "one buffer id per allocation");
                // Host memory the driver does not know: no error from cuPointerGetAttributes,
                // zeros; cuPointerGetAttribute refuses it.
                let host = [0u8; 64];
                let (mut kind, mut owner) = (9u32, ctx);
                let data: [*mut c_void; 2] = [(&raw mut kind).cast(), (&raw mut owner).cast()];
                let at = host.as_ptr() as u64;
                assert_eq!(attrs(2, [2, 1].as_ptr(), data.as_ptr(), at), SUCCESS);
                assert_eq!((kind, owner), (0, std::ptr::null_mut()));
                assert_eq!(attr((&raw mut kind).cast(), 2, at), INVALID_VALUE);
                // cuMemAlloc's memory has no VMM allocation handle.
                let mut handle = 0u64;
                assert_eq!(retain_handle(&mut handle, p as *mut c_void), INVALID_VALUE);
                // The context stack, ids, the primary context's state, UUIDs.
                assert_eq!(push(ctx), SUCCESS);
                let mut top = std::ptr::null_mut();
                assert_eq!(pop(&mut top), SUCCESS);
                assert_eq!(top, ctx);
                assert_eq!(current(&mut top), SUCCESS);
                assert_eq!(top, ctx, "popping returns to the context below");
                let (mut a, mut b) = (0u64, 0u64);
                assert_eq!(ctx_id(ctx, &mut a), SUCCESS);
                assert_eq!(ctx_id(std::ptr::null_mut(), &mut b), SUCCESS);
                assert_eq!(a, b, "a null context is the current one");
                let (mut flags, mut active) = (9u32, 0i32);
                assert_eq!(state(0, &mut flags, &mut active), SUCCESS);
                assert_eq!((flags, active), (0, 1), "retained by ready()");
                assert_eq!(state(1, &mut flags, &mut active), SUCCESS);
                assert_eq!(active, 0, "device 1's was never retained");
                let (mut u0, mut u1) = ([0u8; 16], [0u8; 16]);
                assert_eq!(uuid(u0.as_mut_ptr(), 0), SUCCESS);
                assert_eq!(uuid(u1.as_mut_ptr(), 1), SUCCESS);
                assert_ne!(u0, u1, "each device its own UUID");
                // A unified copy there and back on a stream, then a callback after it.
                let mut s = std::ptr::null_mut();
                assert_eq!(stream_create(&mut s, 0), SUCCESS);
                let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
                let mut back = vec![0u8; 4096];
                assert_eq!(copy(p, bytes.as_ptr() as u64, 4096, s), SUCCESS);
                assert_eq!(copy(back.as_mut_ptr() as u64, p, 4096, s), SUCCESS);
                unsafe extern "C" fn seen(_: *mut c_void, status: R, flag: *mut c_void) {
                    // SAFETY: the test passes an AtomicI32 that outlives the stream's work.
                    let flag = unsafe { &*(flag as *const std::sync::atomic::AtomicI32) };
                    flag.store(100 + status, std::sync::atomic::Ordering::SeqCst);
                }
                let flag = std::sync::atomic::AtomicI32::new(0);
                assert_eq!(
                    add_callback(s, seen, (&raw const flag) as *mut c_void, 1),
                    INVALID_VALUE
                );
                // A thread without a current context (UCX's progress thread): calls that name a
                // stream, an event or a pointer work; others fail as without a context.
                let (s_addr, flag_addr) = (s as usize, &raw const flag as usize);
                std::thread::spawn(move || {
                    let s = s_addr as *mut c_void;
                    let mut none = std::ptr::null_mut();
                    assert_eq!(current(&mut none), SUCCESS);
                    assert!(none.is_null());
                    assert_eq!(add_callback(s, seen, flag_addr as *mut c_void, 0), SUCCESS);
                    assert_eq!(sync(s), SUCCESS);
                    let mut kind = 0u32;
                    let data: [*mut c_void; 1] = [(&raw mut kind).cast()];
                    assert_eq!(attrs(1, [2].as_ptr(), data.as_ptr(), p), SUCCESS);
                    assert_eq!(kind, 2);
                    let mut q = 0u64;
                    assert_eq!(alloc(&mut q, 64), INVALID_CONTEXT);
                    assert_eq!(
                        sync(std::ptr::null_mut()),
                        INVALID_CONTEXT,
                        "the null stream"
                    );
                })
                .join()
                .unwrap();
                assert_eq!(
                    flag.load(std::sync::atomic::Ordering::SeqCst),
                    100,
                    "called, no error"
                );
                assert_eq!(back, bytes);
                assert_eq!(set(ctx), SUCCESS);
            }
        }),
        Ok(0)
    );
    // NVML beside the driver: it loads (so UCX's CUDA module does) and says it cannot start.
    let nvml = driver::library().with_file_name("libnvidia-ml.so.1");
    // SAFETY: the emulator's own NVML stand-in; its functions take and return plain values.
    unsafe {
        let lib = libloading::Library::new(&nvml).expect("loading the NVML stand-in");
        let init = *lib
            .get::<unsafe extern "C" fn() -> i32>(b"nvmlInit_v2")
            .unwrap();
        assert_eq!(init(), 9, "NVML_ERROR_DRIVER_NOT_LOADED");
        lib.get::<unsafe extern "C" fn(i32) -> *const i8>(b"nvmlErrorString")
            .expect("what UCX links");
    }
}
