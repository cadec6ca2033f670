//! The validators against what this machine's libucx packs (tcp on loopback, posix, sysv,
//! cma, self and mixes), against malformed bytes, and at the edge of a guard page.

use std::rc::Rc;
use std::sync::Arc;

use super::*;
use crate::transport::ucx::memory_type::MemoryType;
use crate::transport::ucx::safe::{Context, Endpoint, MemHandle, RemoteKey, Worker};
use crate::transport::ucx::sys;
use crate::transport::ucx::{Region, UcxError};

/// The UCX transports to pack addresses and keys with; tcp pinned to loopback.
const TRANSPORTS: [&[(&str, &str)]; 9] = [
    &[("TLS", "tcp"), ("NET_DEVICES", "lo")],
    &[("TLS", "tcp,self"), ("NET_DEVICES", "lo")],
    &[("TLS", "self")],
    &[("TLS", "posix")],
    &[("TLS", "sysv")],
    &[("TLS", "cma")],
    &[("TLS", "posix,cma,self")],
    &[("TLS", "shm,self,tcp"), ("NET_DEVICES", "lo")],
    &[
        ("TLS", "tcp"),
        ("NET_DEVICES", "lo"),
        ("ADDRESS_DEBUG_INFO", "y"),
    ],
];

struct Packed {
    worker: Rc<Worker>,
    address: Vec<u8>,
    rkey: Vec<u8>,
    _memory: MemHandle,
}

fn pack(vars: &[(&str, &str)]) -> Packed {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
    let context = Context::new(&vars, true).unwrap_or_else(|e| panic!("{vars:?}: {e}"));
    let worker = Worker::new(&context).unwrap();
    let address = worker.address().unwrap();
    let memory = Arc::new(Region::new(1 << 16).unwrap());
    let handle = MemHandle::map(&context, memory).unwrap();
    let rkey = handle.rkey().unwrap();
    Packed {
        worker,
        address,
        rkey,
        _memory: handle,
    }
}

fn all_packed() -> Vec<(String, Packed)> {
    TRANSPORTS
        .iter()
        .map(|vars| (format!("{vars:?}"), pack(vars)))
        .collect()
}

#[test]
fn addresses_and_rkeys_packed_here_are_accepted() {
    for (name, p) in all_packed() {
        check_worker_address(&p.address)
            .unwrap_or_else(|e| panic!("{name}: {e}: {:02x?}", p.address));
        check_rkey(&p.rkey).unwrap_or_else(|e| panic!("{name}: {e}: {:02x?}", p.rkey));
    }
}

#[test]
fn every_truncation_and_extension_is_refused() {
    for (name, p) in all_packed() {
        for (bytes, check) in [
            (
                &p.address,
                check_worker_address as fn(&[u8]) -> Result<(), Malformed>,
            ),
            (&p.rkey, check_rkey),
        ] {
            for len in 0..bytes.len() {
                assert!(
                    check(&bytes[..len]).is_err(),
                    "{name}: {len} bytes accepted"
                );
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(check(&longer).is_err(), "{name}: a trailing byte accepted");
        }
    }
}

/// Offsets of the framing bytes of a v1 worker address without debug info: the md byte and
/// length byte of the first device (tcp on loopback: one device, one transport).
#[test]
fn crafted_lengths_and_counts_are_refused() {
    let p = pack(TRANSPORTS[0]);
    let family = version::family();
    let a = &without_trailer(&p.address, family);
    // header, uuid, md byte, device length byte (last device, 18 bytes), device address,
    // checksum, attributes, interface address length (last transport), interface address.
    assert_eq!(a[0], 0x20, "{a:02x?}");
    let dev = 10;
    assert_eq!(a[dev] & 0x80, 0x80, "one device: {a:02x?}");
    let len_mask = match family {
        Family::V1_13 => 0x3f,
        Family::V1_22 => 0x1f,
    };
    let dev_len = (a[dev] & len_mask) as usize;
    let tl_len_at = dev + 1 + dev_len + 2 + 16;
    let craft = |at: usize, value: u8| {
        let mut b = a.clone();
        b[at] = value;
        b
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "device address longer than the buffer",
            craft(dev, 0x80 | len_mask),
        ),
        (
            "device not the last, none follows",
            craft(dev, a[dev] & 0x7f),
        ),
        // (Announcing one in a whole address only shifts what follows by a byte, which the
        // random bytes of an address may happen to frame validly: not a case.)
        ("a paths byte announced, none there", {
            let mut b = craft(dev, a[dev] | 0x40);
            b.truncate(dev + 1);
            b
        }),
        (
            "interface address longer",
            craft(tl_len_at, a[tl_len_at] + 1),
        ),
        (
            "interface address shorter",
            craft(tl_len_at, a[tl_len_at] - 1),
        ),
        (
            "transport not the last",
            craft(tl_len_at, a[tl_len_at] & 0x7f),
        ),
        (
            "endpoint addresses follow",
            craft(tl_len_at, a[tl_len_at] | 0x40),
        ),
        ("another version", craft(0, 0x01)),
        ("unified or unknown header flags", craft(0, 0x21)),
        ("md index out of range", craft(9, 0x3f)),
        ("empty-address marker, then bytes", craft(9, 0xff)),
        ("a debug name longer than the rest", craft(0, 0x30)),
    ];
    for (what, bytes) in &cases {
        assert!(check_worker_address(bytes).is_err(), "{what}: {bytes:02x?}");
    }
    // Many devices, none marked last, within the cap: runs out of bytes, never past them.
    let mut devices = a[..9].to_vec();
    for _ in 0..40 {
        devices.extend_from_slice(&[0x80, 0x00]);
    }
    assert!(check_worker_address(&devices).is_err());
    // ... and past the cap on entries: refused by count.
    let mut many = a[..9].to_vec();
    for _ in 0..100 {
        many.extend_from_slice(&[0x80, 0x00]);
    }
    let last = many.len() - 1;
    many[last] = 0x80;
    let e = check_worker_address(&many).unwrap_err();
    assert!(e.reason.contains("devices"), "{e}");
    // Over the cap on length.
    let e = check_worker_address(&vec![0x20; MAX_ADDRESS_BYTES + 1]).unwrap_err();
    assert!(e.reason.contains("accepted"), "{e}");
    // The empty-address marker alone is well formed.
    let mut empty = a[..9].to_vec();
    empty.push(0xff);
    assert_eq!(check_worker_address(&empty), Ok(()));
}

/// `address` as its one device alone: UCX 1.22's release trailer (an empty last device)
/// dropped, and the device before it marked last.
fn without_trailer(address: &[u8], family: Family) -> Vec<u8> {
    let mut a = address.to_vec();
    if family == Family::V1_22 {
        assert_eq!(a[a.len() - 1], 0x80, "no release trailer: {a:02x?}");
        a.truncate(a.len() - 2);
        a[10] |= 0x80;
    }
    a
}

#[test]
fn each_release_is_checked_by_its_own_format() {
    // UCX 1.22: a device with a system-device byte, then the release trailer.
    let mut a = vec![0x20];
    a.extend_from_slice(&[7; 8]); // uuid
    a.extend_from_slice(&[0x01, 0x20 | 2, 0x05, 0xaa, 0xbb]); // md 1, sys_dev 5, 2-byte device
    a.extend_from_slice(&[0x19, 0xcf]); // transport name checksum
    a.extend_from_slice(&[0; 16]); // attributes
    a.extend_from_slice(&[0x80 | 2, 1, 2]); // last transport, 2-byte interface address
    a.extend_from_slice(&[0x86, 0x80]); // release trailer (minor 22)
    assert_eq!(check_worker_address_of(&a, Family::V1_22), Ok(()));
    assert!(
        check_worker_address_of(&a, Family::V1_13).is_err(),
        "1.13 reads the sys_dev flag as 32 bytes more device address"
    );
    let mut cut = a.clone();
    cut.truncate(12);
    assert!(check_worker_address_of(&cut, Family::V1_22).is_err());
    // 1.13's md byte with its reg bit is an index out of range for 1.22.
    let mut legacy = a.clone();
    legacy[9] = 0x21;
    legacy[10] = 2;
    legacy.remove(11);
    assert_eq!(check_worker_address_of(&legacy, Family::V1_13), Ok(()));
    assert!(check_worker_address_of(&legacy, Family::V1_22).is_err());

    let key = |md_map: u64, mem_type: u8, rest: &[u8]| {
        let mut k = md_map.to_le_bytes().to_vec();
        k.push(mem_type);
        k.extend_from_slice(rest);
        k
    };
    // Host memory: 1.22 ends a key with its system device, unknown (0xff); 1.13 does not.
    let host_1_22 = key(1, 0, &[0, 0xff]);
    let host_1_13 = key(0b10011, 0, &[0, 0, 0]);
    assert_eq!(check_rkey_of(&host_1_22, Family::V1_22), Ok(()));
    assert!(check_rkey_of(&host_1_22, Family::V1_13).is_err());
    assert_eq!(check_rkey_of(&host_1_13, Family::V1_13), Ok(()));
    assert!(check_rkey_of(&host_1_13, Family::V1_22).is_err());
    // No transports' keys: no system device either.
    assert_eq!(check_rkey_of(&key(0, 0, &[]), Family::V1_22), Ok(()));
    // Device memory (CUDA, type 1) on system device 3: its distances, then their end.
    let device = key(1, 1, &[2, 9, 9, 3, 0, 0x10, 0x20, 4, 0x11, 0x21, 0xff]);
    assert_eq!(check_rkey_of(&device, Family::V1_22), Ok(()));
    for len in 0..device.len() {
        assert!(
            check_rkey_of(&device[..len], Family::V1_22).is_err(),
            "{len}"
        );
    }
    let mut partial = device.clone();
    partial.remove(device.len() - 2);
    assert!(
        check_rkey_of(&partial, Family::V1_22).is_err(),
        "a distance cut short"
    );
    // Memory types: 9 (Gaudi) exists in 1.22 only.
    assert_eq!(check_rkey_of(&key(1, 9, &[0, 0xff]), Family::V1_22), Ok(()));
    assert!(check_rkey_of(&key(1, 10, &[0, 0xff]), Family::V1_22).is_err());
    assert!(check_rkey_of(&key(1, 9, &[0]), Family::V1_13).is_err());
}

#[test]
fn crafted_rkeys_are_refused() {
    let key = |md_map: u64, mem_type: u8, rest: &[u8]| {
        let mut k = md_map.to_le_bytes().to_vec();
        k.push(mem_type);
        k.extend_from_slice(rest);
        k
    };
    let check_rkey = |k: &[u8]| check_rkey_of(k, Family::V1_13);
    assert_eq!(check_rkey(&key(0b101, 0, &[0, 2, 1, 2])), Ok(()));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("two bytes", vec![1, 0]),
        ("no memory type", 1u64.to_le_bytes().to_vec()),
        ("md entries missing", key(0b111, 0, &[0, 0])),
        ("size past the end", key(1, 0, &[200, 1, 2])),
        ("size short of the end", key(1, 0, &[1, 1, 2])),
        ("unknown memory type", key(1, 9, &[0])),
        ("md index 16", key(1 << 16, 0, &[0])),
        ("over the cap", key(1, 0, &vec![0; MAX_RKEY_BYTES])),
    ];
    for (what, bytes) in &cases {
        assert!(check_rkey(bytes).is_err(), "{what}: {bytes:02x?}");
    }
}

#[test]
fn a_key_names_host_or_cuda_memory_or_is_refused() {
    let p = pack(TRANSPORTS[0]);
    assert_eq!(rkey_memory_type(&p.rkey), Ok(MemoryType::Host));
    let mut kind = p.rkey.to_vec();
    kind[8] = 1;
    assert_eq!(rkey_memory_type(&kind), Ok(MemoryType::Cuda));
    for other in [2u8, 3, 4] {
        kind[8] = other;
        let e = rkey_memory_type(&kind).expect_err("another kind");
        assert!(e.reason.contains(&format!("memory type {other}")), "{e:?}");
    }
    assert!(rkey_memory_type(&p.rkey[..2]).is_err(), "malformed first");
}

#[test]
fn malformed_bytes_never_reach_ucx() {
    let p = pack(TRANSPORTS[0]);
    for bad in [&p.address[..3], &p.address[..p.address.len() - 1], &[][..]] {
        match Endpoint::connect(&p.worker, bad, true) {
            Err(UcxError::Malformed(m)) => assert_eq!(m.what, "worker address"),
            Err(e) => panic!("{} bytes: not refused as malformed: {e}", bad.len()),
            Ok(_) => panic!("{} bytes: connected", bad.len()),
        }
    }
    let ep = Rc::new(Endpoint::connect(&p.worker, &p.address, true).unwrap());
    for bad in [&p.rkey[..2], &p.rkey[..p.rkey.len() - 1]] {
        match RemoteKey::unpack(&ep, bad, 0, 1 << 16) {
            Err(UcxError::Malformed(m)) => assert_eq!(m.what, "rkey"),
            Err(e) => panic!("{} bytes: not refused as malformed: {e}", bad.len()),
            Ok(_) => panic!("{} bytes: unpacked", bad.len()),
        }
    }
    assert!(RemoteKey::unpack(&ep, &p.rkey, 0, 1 << 16).is_ok());
}

/// Two pages, the second PROT_NONE: bytes placed at the very end of the first fault on any
/// read past them.
struct GuardPage {
    base: *mut u8,
    page: usize,
}

impl GuardPage {
    fn new() -> Self {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        // SAFETY: a fresh anonymous private mapping of two pages; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let base = base.cast::<u8>();
        // SAFETY: the second page of the mapping just made.
        let rc = unsafe { libc::mprotect(base.add(page).cast(), page, libc::PROT_NONE) };
        assert_eq!(rc, 0);
        GuardPage { base, page }
    }

    /// `bytes`, copied so that their last byte is the last readable one.
    fn tight(&self, bytes: &[u8]) -> &[u8] {
        assert!(bytes.len() <= self.page);
        // SAFETY: the destination lies in the first (writable) page; the slice returned
        // borrows `self`, which keeps the mapping.
        unsafe {
            let at = self.base.add(self.page - bytes.len());
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len());
            std::slice::from_raw_parts(at, bytes.len())
        }
    }
}

impl Drop for GuardPage {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no slice of it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), 2 * self.page) };
    }
}

/// Neither the validators nor UCX read past a valid buffer that ends at a guard page; the
/// validators stop at its end for every truncation too. A read past the end faults the test.
#[test]
fn nothing_reads_past_a_buffer_that_ends_at_a_guard_page() {
    let guard = GuardPage::new();
    for (name, p) in all_packed() {
        for len in 0..=p.address.len() {
            let tight = guard.tight(&p.address[..len]);
            assert_eq!(check_worker_address(tight).is_ok(), len == p.address.len());
        }
        for len in 0..=p.rkey.len() {
            let tight = guard.tight(&p.rkey[..len]);
            assert_eq!(check_rkey(tight).is_ok(), len == p.rkey.len());
        }
        // UCX itself, handed the tight valid address and key (no copy in between): it reads
        // exactly the structure the validators walked.
        let tight = guard.tight(&p.address);
        // SAFETY: ucp_ep_params_t is plain data for which zeroes are valid; only the remote
        // address field is set and read.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        params.address = tight.as_ptr().cast();
        let mut ep = std::ptr::null_mut();
        // SAFETY: the worker is live on this thread; the address is readable for the call.
        let status = unsafe { sys::ucp_ep_create(p.worker.as_ptr().as_ptr(), &params, &mut ep) };
        // Alone, posix, sysv and self have no lane to wire a connection up with: UCX parsed
        // the address and found it unreachable.
        if status == sys::UCS_ERR_UNREACHABLE {
            println!("{name}: unreachable alone");
            continue;
        }
        assert_eq!(status, sys::UCS_OK, "{name}");
        let endpoint = Rc::new(Endpoint::connect(&p.worker, &p.address, false).unwrap());
        let tight = guard.tight(&p.rkey);
        let mut rkey = std::ptr::null_mut();
        // SAFETY: endpoint live; the key is readable for the call; destroyed below.
        let status = unsafe {
            sys::ucp_ep_rkey_unpack(endpoint.as_ptr().as_ptr(), tight.as_ptr().cast(), &mut rkey)
        };
        assert_eq!(status, sys::UCS_OK, "{name}");
        // SAFETY: unpacked above, destroyed once; the raw endpoint was made above and is
        // closed once, by flushing (as an unsupervised Endpoint), its close request freed.
        unsafe {
            sys::ucp_rkey_destroy(rkey);
            let param = crate::transport::ucx::result::request_param();
            let req = sys::ucp_ep_close_nbx(ep, &param);
            if sys::ucs_ptr_is_ptr(req) && !req.is_null() {
                sys::ucp_request_free(req);
            }
        }
        // And the safe path, validating then copying, from the same tight buffers.
        let tight_address = guard.tight(&p.address);
        assert!(
            Endpoint::connect(&p.worker, tight_address, false).is_ok(),
            "{name}"
        );
        let tight_key = guard.tight(&p.rkey);
        assert!(
            RemoteKey::unpack(&endpoint, tight_key, 0, 1 << 16).is_ok(),
            "{name}"
        );
    }
}
