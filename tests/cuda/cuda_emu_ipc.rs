//! CUDA IPC handles and VMM shareable handles on the CUDA driver emulator (emu/cuda), between
//! real processes: forked children that export, send the handle over a Unix socket, import,
//! and check that each sees the other's writes. Errors as the driver documents them: a handle
//! opened in its exporting process, from a dead exporter, of freed memory, a garbage handle,
//! memory used before access was granted or after it was unmapped.
#![allow(unsafe_code)]

use crate::driver;

use std::ffi::c_void;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use driver::*;

const INVALID_HANDLE: R = 400;
const LAZY_ENABLE_PEER_ACCESS: u32 = 1;
const MIB: usize = 1 << 20;

/// CUipcMemHandle.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle([u8; 64]);

type GetHandle = unsafe extern "C" fn(*mut IpcHandle, u64) -> R;
type OpenHandle = unsafe extern "C" fn(*mut u64, IpcHandle, u32) -> R;
type CloseHandle = unsafe extern "C" fn(u64) -> R;
type Memset = unsafe extern "C" fn(u64, u8, usize) -> R;
type Range = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> R;

/// A connected pair whose reads give up after a generous bound, so that a child whose peer
/// died fails instead of hanging.
fn pair() -> (UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().expect("socketpair");
    for s in [&a, &b] {
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .expect("read timeout");
    }
    (a, b)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect()
}

fn read_handle(s: &mut UnixStream) -> IpcHandle {
    let mut h = IpcHandle([0; 64]);
    s.read_exact(&mut h.0).expect("reading the handle");
    h
}

#[test]
fn an_ipc_handle_shares_an_allocation_between_processes() {
    let n = MIB;
    let (mut to_importer, mut from_exporter) = pair();
    let (mut done_tx, mut done_rx) = pair();
    let exporter = spawn_with_context(move |d| {
        let (alloc, htod, dtoh): (Alloc, HtoD, DtoH) = (
            d.f("cuMemAlloc_v2"),
            d.f("cuMemcpyHtoD_v2"),
            d.f("cuMemcpyDtoH_v2"),
        );
        let (get, open): (GetHandle, OpenHandle) =
            (d.f("cuIpcGetMemHandle"), d.f("cuIpcOpenMemHandle_v2"));
        let data = pattern(n, 1);
        let mut p = 0u64;
        let mut h = IpcHandle([0; 64]);
        let mut q = 0u64;
        // SAFETY: buffers of the stated lengths, valid out pointers.
        unsafe {
            assert_eq!(alloc(&mut p, n), SUCCESS);
            assert_eq!(htod(p, data.as_ptr().cast(), n), SUCCESS);
            // An address inside the allocation names the whole allocation, as its base does
            // (UCX's cuda_ipc asks with the address it sends from).
            let mut inside = IpcHandle([0; 64]);
            assert_eq!(get(&mut inside, p + 4096), SUCCESS);
            assert_eq!(get(&mut h, p), SUCCESS);
            assert!(
                inside.0 == h.0,
                "an inner address's handle is the allocation's"
            );
            assert_eq!(
                get(&mut inside, p + n as u64),
                INVALID_VALUE,
                "past the allocation"
            );
            assert_eq!(
                open(&mut q, h, LAZY_ENABLE_PEER_ACCESS),
                INVALID_CONTEXT,
                "opened in the exporting process"
            );
        }
        to_importer.write_all(&h.0).expect("sending the handle");
        let mut b = [0u8];
        done_rx.read_exact(&mut b).expect("the importer's word");
        let mut back = vec![0u8; n];
        // SAFETY: a buffer of n bytes.
        unsafe { assert_eq!(dtoh(back.as_mut_ptr().cast(), p, n), SUCCESS) };
        let mut want = data;
        want[..4096].fill(0xee);
        assert!(
            back == want,
            "the importer's write is not in the exporter's memory"
        );
    });
    let importer = spawn_with_context(move |d| {
        let (dtoh, memset, range): (DtoH, Memset, Range) = (
            d.f("cuMemcpyDtoH_v2"),
            d.f("cuMemsetD8_v2"),
            d.f("cuMemGetAddressRange_v2"),
        );
        let (open, close): (OpenHandle, CloseHandle) =
            (d.f("cuIpcOpenMemHandle_v2"), d.f("cuIpcCloseMemHandle"));
        let h = read_handle(&mut from_exporter);
        let (mut q, mut again, mut base, mut size) = (0u64, 0u64, 0u64, 0usize);
        let mut back = vec![0u8; n];
        // SAFETY: buffers of the stated lengths, valid out pointers.
        unsafe {
            assert_eq!(
                open(&mut q, h, 0),
                INVALID_VALUE,
                "flags must be LAZY_ENABLE_PEER_ACCESS"
            );
            assert_eq!(open(&mut q, h, LAZY_ENABLE_PEER_ACCESS), SUCCESS);
            assert_eq!(open(&mut again, h, LAZY_ENABLE_PEER_ACCESS), SUCCESS);
            assert_eq!(again, q, "a handle opened twice maps once");
            assert_eq!(dtoh(back.as_mut_ptr().cast(), q, n), SUCCESS);
            assert!(back == pattern(n, 1), "the exporter's bytes");
            assert_eq!(range(&mut base, &mut size, q + 100), SUCCESS);
            assert_eq!((base, size), (q, n));
            assert_eq!(memset(q, 0xee, 4096), SUCCESS);
            assert_eq!(close(q), SUCCESS);
            assert_eq!(
                dtoh(back.as_mut_ptr().cast(), q, 16),
                SUCCESS,
                "still opened once"
            );
            assert_eq!(close(q), SUCCESS);
            assert_eq!(close(q), INVALID_VALUE, "closed as often as opened");
            assert_eq!(
                dtoh(back.as_mut_ptr().cast(), q, 16),
                INVALID_VALUE,
                "used after close"
            );
        }
        done_tx.write_all(&[1]).expect("telling the exporter");
    });
    assert_eq!(importer.wait(), Ok(0), "importer");
    assert_eq!(exporter.wait(), Ok(0), "exporter");
}

#[test]
fn an_ipc_handle_is_refused_when_its_exporter_died_or_freed_it() {
    // An exporter that exits right after sending its handle.
    let (mut tx, mut rx) = pair();
    let dead = spawn_with_context(move |d| {
        let (alloc, get): (Alloc, GetHandle) = (d.f("cuMemAlloc_v2"), d.f("cuIpcGetMemHandle"));
        let (mut p, mut h) = (0u64, IpcHandle([0; 64]));
        // SAFETY: valid out pointers.
        unsafe {
            assert_eq!(alloc(&mut p, MIB), SUCCESS);
            assert_eq!(get(&mut h, p), SUCCESS);
        }
        tx.write_all(&h.0).expect("sending the handle");
    });
    let of_dead = read_handle(&mut rx);
    assert_eq!(dead.wait(), Ok(0));
    // An exporter that frees the allocation and stays alive.
    let (mut tx, mut rx) = pair();
    let (mut done_tx, mut done_rx) = pair();
    let alive = spawn_with_context(move |d| {
        let (alloc, free, get): (Alloc, Free, GetHandle) = (
            d.f("cuMemAlloc_v2"),
            d.f("cuMemFree_v2"),
            d.f("cuIpcGetMemHandle"),
        );
        let (mut p, mut h) = (0u64, IpcHandle([0; 64]));
        // SAFETY: valid out pointers.
        unsafe {
            assert_eq!(alloc(&mut p, MIB), SUCCESS);
            assert_eq!(get(&mut h, p), SUCCESS);
            assert_eq!(free(p), SUCCESS);
        }
        tx.write_all(&h.0).expect("sending the handle");
        let mut b = [0u8];
        done_rx.read_exact(&mut b).expect("the importer's word");
    });
    let of_freed = read_handle(&mut rx);
    let importer = spawn_with_context(move |d| {
        let open: OpenHandle = d.f("cuIpcOpenMemHandle_v2");
        let mut q = 0u64;
        // SAFETY: a valid out pointer.
        unsafe {
            assert_eq!(
                open(&mut q, of_dead, LAZY_ENABLE_PEER_ACCESS),
                INVALID_HANDLE,
                "the exporter is dead"
            );
            assert_eq!(
                open(&mut q, of_freed, LAZY_ENABLE_PEER_ACCESS),
                INVALID_HANDLE,
                "the exporter freed it"
            );
            assert_eq!(
                open(&mut q, IpcHandle([0x5a; 64]), LAZY_ENABLE_PEER_ACCESS),
                INVALID_HANDLE,
                "not a handle"
            );
        }
        done_tx.write_all(&[1]).expect("telling the exporter");
    });
    assert_eq!(importer.wait(), Ok(0), "importer");
    assert_eq!(alive.wait(), Ok(0), "exporter");
}

#[test]
fn vmm_memory_exported_as_a_posix_fd_maps_in_another_process() {
    let (tx, rx) = pair();
    let (mut done_tx, mut done_rx) = pair();
    let exporter = spawn_with_context(move |d| {
        let gran: Granularity = d.f("cuMemGetAllocationGranularity");
        let create: Create = d.f("cuMemCreate");
        let reserve: Reserve = d.f("cuMemAddressReserve");
        let address_free: AddressFree = d.f("cuMemAddressFree");
        let map: Map = d.f("cuMemMap");
        let unmap: Unmap = d.f("cuMemUnmap");
        let set_access: SetAccess = d.f("cuMemSetAccess");
        let export: Export = d.f("cuMemExportToShareableHandle");
        let (htod, dtoh): (HtoD, DtoH) = (d.f("cuMemcpyHtoD_v2"), d.f("cuMemcpyDtoH_v2"));
        let (mut g, mut h, mut plain, mut va, mut fd) = (0usize, 0u64, 0u64, 0u64, -1i32);
        let data = pattern(2 * MIB, 2);
        let mut back = vec![0u8; 2 * MIB];
        // SAFETY: buffers of the stated lengths, valid out pointers and descriptors.
        unsafe {
            assert_eq!(gran(&mut g, &prop(true), 0), SUCCESS);
            assert_eq!(g, 2 * MIB);
            assert_eq!(
                create(&mut h, MIB, &prop(true), 0),
                INVALID_VALUE,
                "not a multiple of the granularity"
            );
            assert_eq!(create(&mut h, 2 * MIB, &prop(true), 0), SUCCESS);
            assert_eq!(create(&mut plain, 2 * MIB, &prop(false), 0), SUCCESS);
            assert_eq!(
                export((&raw mut fd).cast(), plain, POSIX_FD, 0),
                INVALID_VALUE,
                "not created exportable"
            );
            assert_eq!(reserve(&mut va, 4 * MIB, 0, 0, 0), SUCCESS);
            assert_eq!(va % (2 * MIB as u64), 0, "aligned to the granularity");
            assert_eq!(map(va, 2 * MIB, 0, h, 0), SUCCESS);
            assert_eq!(
                htod(va, data.as_ptr().cast(), 16),
                INVALID_VALUE,
                "no access granted yet"
            );
            assert_eq!(set_access(va, 2 * MIB, &READ_WRITE, 1), SUCCESS);
            assert_eq!(htod(va, data.as_ptr().cast(), 2 * MIB), SUCCESS);
            assert_eq!(export((&raw mut fd).cast(), h, POSIX_FD, 0), SUCCESS);
        }
        kvferry::kernel::cuda::vmm::send_pieces(&tx, &[(0, 2 * MIB as u64, fd)])
            .expect("sending the fd");
        let mut b = [0u8];
        done_rx.read_exact(&mut b).expect("the importer's word");
        // SAFETY: as above.
        unsafe {
            assert_eq!(dtoh(back.as_mut_ptr().cast(), va, 2 * MIB), SUCCESS);
            let mut want = data;
            want[..4096].fill(0xee);
            assert!(
                back == want,
                "the importer's write is not in the exporter's memory"
            );
            assert_eq!(address_free(va, 4 * MIB), INVALID_VALUE, "still mapped");
            assert_eq!(unmap(va, 2 * MIB), SUCCESS);
            assert_eq!(
                dtoh(back.as_mut_ptr().cast(), va, 16),
                INVALID_VALUE,
                "unmapped"
            );
            assert_eq!(address_free(va, 4 * MIB), SUCCESS);
        }
    });
    let importer = spawn_with_context(move |d| {
        let create: Create = d.f("cuMemCreate");
        let release: Release = d.f("cuMemRelease");
        let reserve: Reserve = d.f("cuMemAddressReserve");
        let map: Map = d.f("cuMemMap");
        let unmap: Unmap = d.f("cuMemUnmap");
        let set_access: SetAccess = d.f("cuMemSetAccess");
        let import: Import = d.f("cuMemImportFromShareableHandle");
        let (dtoh, memset, range): (DtoH, Memset, Range) = (
            d.f("cuMemcpyDtoH_v2"),
            d.f("cuMemsetD8_v2"),
            d.f("cuMemGetAddressRange_v2"),
        );
        let pieces =
            kvferry::kernel::cuda::vmm::receive_pieces_from(&rx).expect("receiving the fd");
        assert_eq!(
            (pieces.len(), pieces[0].offset, pieces[0].len),
            (1, 0, 2 * MIB as u64)
        );
        let fd = std::os::fd::IntoRawFd::into_raw_fd(pieces.into_iter().next().unwrap().fd);
        let (mut theirs, mut mine, mut va, mut base, mut size) = (0u64, 0u64, 0u64, 0u64, 0usize);
        let mut back = vec![0u8; 32];
        let mut pipe = [0i32; 2];
        // SAFETY: buffers of the stated lengths, valid out pointers and descriptors.
        unsafe {
            assert_eq!(libc::pipe(pipe.as_mut_ptr()), 0);
            assert_eq!(
                import(&mut theirs, pipe[0] as isize as *mut c_void, POSIX_FD),
                INVALID_VALUE,
                "a pipe is not device memory"
            );
            assert_eq!(
                import(&mut theirs, fd as isize as *mut c_void, POSIX_FD),
                SUCCESS
            );
            libc::close(fd); // the handle holds the memory, not the fd
            assert_eq!(create(&mut mine, 2 * MIB, &prop(false), 0), SUCCESS);
            // Local memory, then the exporter's, back to back in one reservation.
            assert_eq!(reserve(&mut va, 4 * MIB, 0, 0, 0), SUCCESS);
            assert_eq!(map(va, 2 * MIB, 0, mine, 0), SUCCESS);
            assert_eq!(
                map(va, 2 * MIB, 0, theirs, 0),
                INVALID_VALUE,
                "already mapped there"
            );
            assert_eq!(map(va + 2 * MIB as u64, 2 * MIB, 0, theirs, 0), SUCCESS);
            assert_eq!(set_access(va, 4 * MIB, &READ_WRITE, 1), SUCCESS);
            assert_eq!(release(theirs), SUCCESS, "the mapping keeps the memory");
            assert_eq!(release(theirs), INVALID_VALUE, "released twice");
            assert_eq!(memset(va, 0x11, 2 * MIB), SUCCESS);
            let seam = va + 2 * MIB as u64 - 16;
            assert_eq!(
                dtoh(back.as_mut_ptr().cast(), seam, 32),
                SUCCESS,
                "one read across both pieces"
            );
            assert_eq!(&back[..16], &[0x11; 16]);
            assert_eq!(&back[16..], &pattern(2 * MIB, 2)[..16]);
            assert_eq!(
                range(&mut base, &mut size, va + 2 * MIB as u64 + 5),
                SUCCESS
            );
            assert_eq!((base, size), (va + 2 * MIB as u64, 2 * MIB));
            assert_eq!(memset(va + 2 * MIB as u64, 0xee, 4096), SUCCESS);
            assert_eq!(unmap(va, 4 * MIB), SUCCESS, "both pieces at once");
        }
        done_tx.write_all(&[1]).expect("telling the exporter");
    });
    assert_eq!(importer.wait(), Ok(0), "importer");
    assert_eq!(exporter.wait(), Ok(0), "exporter");
}

const DISABLE_TIMING: u32 = 2;
const INTERPROCESS: u32 = 4;
const NOT_READY: R = 600;

type EventCreate = unsafe extern "C" fn(*mut Ptr, u32) -> R;
type EventOp = unsafe extern "C" fn(Ptr) -> R;
type EventRecord = unsafe extern "C" fn(Ptr, Ptr) -> R;
type GetEventHandle = unsafe extern "C" fn(*mut [u8; 64], Ptr) -> R;
type OpenEventHandle = unsafe extern "C" fn(*mut Ptr, [u8; 64]) -> R;
type StreamCreate = unsafe extern "C" fn(*mut Ptr, u32) -> R;
type StreamWaitEvent = unsafe extern "C" fn(Ptr, Ptr, u32) -> R;
type WaitValue = unsafe extern "C" fn(Ptr, u64, u32, u32) -> R;
type HostAlloc = unsafe extern "C" fn(*mut Ptr, usize, u32) -> R;
type MemsetAsync = unsafe extern "C" fn(u64, u8, usize, Ptr) -> R;

fn word(s: &mut UnixStream) -> u8 {
    let mut b = [0u8];
    s.read_exact(&mut b).expect("the peer's word");
    b[0]
}

/// A stream held until `*flag` becomes 1 (`cuStreamWaitValue32` on pinned memory).
///
/// # Safety
/// `d` has a current context.
unsafe fn held_stream(d: &Driver) -> (Ptr, *mut u32) {
    let (create, host_alloc, wait_value): (StreamCreate, HostAlloc, WaitValue) = (
        d.f("cuStreamCreate"),
        d.f("cuMemHostAlloc"),
        d.f("cuStreamWaitValue32_v2"),
    );
    let (mut s, mut flag) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid out pointers; the flag is 4 bytes of pinned memory that is never freed.
    unsafe {
        assert_eq!(create(&mut s, 1), SUCCESS);
        assert_eq!(host_alloc(&mut flag, 4, 0), SUCCESS);
        let flag = flag.cast::<u32>();
        flag.write_volatile(0);
        assert_eq!(wait_value(s, flag as u64, 1, 0), SUCCESS);
        (s, flag)
    }
}

#[test]
fn an_ipc_event_orders_work_across_processes_in_both_directions() {
    let (mut to_importer, mut from_exporter) = pair();
    let (mut to_exporter, mut from_importer) = pair();
    let exporter = spawn_with_context(move |d| {
        let create: EventCreate = d.f("cuEventCreate");
        let (record, get): (EventRecord, GetEventHandle) =
            (d.f("cuEventRecord"), d.f("cuIpcGetEventHandle"));
        let (query, sync): (EventOp, EventOp) = (d.f("cuEventQuery"), d.f("cuEventSynchronize"));
        let mut e = std::ptr::null_mut();
        let mut h = [0u8; 64];
        // SAFETY: valid out pointers; the held stream's flag is live pinned memory.
        unsafe {
            let (s, flag) = held_stream(d);
            assert_eq!(create(&mut e, INTERPROCESS | DISABLE_TIMING), SUCCESS);
            assert_eq!(record(e, s), SUCCESS);
            assert_eq!(get(&mut h, e), SUCCESS);
            to_importer.write_all(&h).expect("sending the handle");
            // The importer saw the record pending and its stream held behind it.
            assert_eq!(word(&mut from_importer), 1);
            assert_eq!(query(e), NOT_READY);
            flag.write_volatile(1);
            assert_eq!(sync(e), SUCCESS);
            to_importer.write_all(&[2]).expect("released");
            // The importer recorded the event on a held stream of its own: the latest record
            // is the importer's, not complete here either.
            assert_eq!(word(&mut from_importer), 3);
            assert_eq!(query(e), NOT_READY, "the importer's record is pending");
            to_importer.write_all(&[4]).expect("seen");
            assert_eq!(sync(e), SUCCESS, "the importer released its stream");
            assert_eq!(query(e), SUCCESS);
            assert_eq!(word(&mut from_importer), 5);
        }
    });
    let importer = spawn_with_context(move |d| {
        let (open, get): (OpenEventHandle, GetEventHandle) =
            (d.f("cuIpcOpenEventHandle"), d.f("cuIpcGetEventHandle"));
        let (query, sync, destroy): (EventOp, EventOp, EventOp) = (
            d.f("cuEventQuery"),
            d.f("cuEventSynchronize"),
            d.f("cuEventDestroy_v2"),
        );
        let (record, wait): (EventRecord, StreamWaitEvent) =
            (d.f("cuEventRecord"), d.f("cuStreamWaitEvent"));
        let (create_stream, stream_sync, host_alloc, memset): (
            StreamCreate,
            EventOp,
            HostAlloc,
            MemsetAsync,
        ) = (
            d.f("cuStreamCreate"),
            d.f("cuStreamSynchronize"),
            d.f("cuMemHostAlloc"),
            d.f("cuMemsetD8Async"),
        );
        let mut h = [0u8; 64];
        from_exporter.read_exact(&mut h).expect("the handle");
        let (mut e, mut s, mut out) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        let mut again = [0u8; 64];
        // SAFETY: valid out pointers; `out` is 64 bytes of pinned memory, never freed.
        unsafe {
            assert_eq!(open(std::ptr::null_mut(), h), INVALID_VALUE);
            assert_eq!(open(&mut e, h), SUCCESS);
            assert_eq!(get(&mut again, e), SUCCESS);
            assert_eq!(again, h, "an opened event exports its handle");
            assert_eq!(query(e), NOT_READY, "the exporter's stream is held");
            assert_eq!(create_stream(&mut s, 1), SUCCESS);
            assert_eq!(host_alloc(&mut out, 64, 0), SUCCESS);
            std::ptr::write_bytes(out.cast::<u8>(), 0, 64);
            assert_eq!(wait(s, e, 0), SUCCESS);
            assert_eq!(memset(out as u64, 0xab, 64, s), SUCCESS);
            // Nothing releases the exporter's stream until this process says so: the memset
            // behind the wait cannot have run, however long this takes.
            std::thread::sleep(Duration::from_millis(100));
            let seen = std::slice::from_raw_parts(out.cast::<u8>(), 64).to_vec();
            assert!(seen == [0u8; 64], "ran before the exporter's record");
            to_exporter.write_all(&[1]).expect("telling the exporter");
            assert_eq!(word(&mut from_exporter), 2);
            assert_eq!(stream_sync(s), SUCCESS);
            let seen = std::slice::from_raw_parts(out.cast::<u8>(), 64).to_vec();
            assert!(seen == [0xab; 64], "the wait let the memset run");
            assert_eq!(query(e), SUCCESS);
            assert_eq!(sync(e), SUCCESS);
            // A record here is what the exporter's queries and waits concern now.
            let (held, flag) = held_stream(d);
            assert_eq!(record(e, held), SUCCESS);
            to_exporter.write_all(&[3]).expect("recorded");
            assert_eq!(word(&mut from_exporter), 4);
            flag.write_volatile(1);
            assert_eq!(sync(e), SUCCESS);
            to_exporter.write_all(&[5]).expect("done");
            assert_eq!(destroy(e), SUCCESS);
            assert_eq!(query(e), INVALID_HANDLE, "destroyed");
        }
    });
    assert_eq!(importer.wait(), Ok(0), "importer");
    assert_eq!(exporter.wait(), Ok(0), "exporter");
}

#[test]
fn an_ipc_event_handle_is_refused_when_its_exporter_died_or_destroyed_it() {
    // An exporter that exits right after sending its handle.
    let (mut tx, mut rx) = pair();
    let dead = spawn_with_context(move |d| {
        let (create, get): (EventCreate, GetEventHandle) =
            (d.f("cuEventCreate"), d.f("cuIpcGetEventHandle"));
        let (mut e, mut h) = (std::ptr::null_mut(), [0u8; 64]);
        // SAFETY: valid out pointers.
        unsafe {
            assert_eq!(create(&mut e, INTERPROCESS | DISABLE_TIMING), SUCCESS);
            assert_eq!(get(&mut h, e), SUCCESS);
        }
        tx.write_all(&h).expect("sending the handle");
    });
    let mut of_dead = [0u8; 64];
    rx.read_exact(&mut of_dead).expect("the handle");
    assert_eq!(dead.wait(), Ok(0));
    // An exporter that destroys the event and stays alive; and a memory handle of it.
    let (mut tx, mut rx) = pair();
    let (mut done_tx, mut done_rx) = pair();
    let alive = spawn_with_context(move |d| {
        let (create, get): (EventCreate, GetEventHandle) =
            (d.f("cuEventCreate"), d.f("cuIpcGetEventHandle"));
        let destroy: EventOp = d.f("cuEventDestroy_v2");
        let (alloc, get_mem): (Alloc, GetHandle) = (d.f("cuMemAlloc_v2"), d.f("cuIpcGetMemHandle"));
        let (mut e, mut h, mut p, mut m) =
            (std::ptr::null_mut(), [0u8; 64], 0u64, IpcHandle([0; 64]));
        // SAFETY: valid out pointers.
        unsafe {
            assert_eq!(create(&mut e, INTERPROCESS | DISABLE_TIMING), SUCCESS);
            assert_eq!(get(&mut h, e), SUCCESS);
            assert_eq!(destroy(e), SUCCESS);
            assert_eq!(alloc(&mut p, MIB), SUCCESS);
            assert_eq!(get_mem(&mut m, p), SUCCESS);
        }
        tx.write_all(&h).expect("sending the handle");
        tx.write_all(&m.0).expect("sending the memory handle");
        word(&mut done_rx);
    });
    let mut of_destroyed = [0u8; 64];
    rx.read_exact(&mut of_destroyed).expect("the handle");
    let of_memory = read_handle(&mut rx);
    let importer = spawn_with_context(move |d| {
        let open: OpenEventHandle = d.f("cuIpcOpenEventHandle");
        let mut e = std::ptr::null_mut();
        // SAFETY: a valid out pointer.
        unsafe {
            assert_eq!(
                open(&mut e, of_dead),
                INVALID_HANDLE,
                "the exporter is dead"
            );
            assert_eq!(
                open(&mut e, of_destroyed),
                INVALID_HANDLE,
                "the exporter destroyed it"
            );
            assert_eq!(open(&mut e, of_memory.0), INVALID_HANDLE, "a memory handle");
            assert_eq!(open(&mut e, [0x5a; 64]), INVALID_HANDLE, "not a handle");
        }
        done_tx.write_all(&[1]).expect("telling the exporter");
    });
    assert_eq!(importer.wait(), Ok(0), "importer");
    assert_eq!(alive.wait(), Ok(0), "exporter");
}
