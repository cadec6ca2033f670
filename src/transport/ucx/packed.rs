//! UCX's packed worker addresses and remote keys (1.13's and 1.22's: [`Family`]), walked in
//! Rust before any byte a peer sent reaches libucx.
//!
//! `ucp_ep_create` (a worker address) and `ucp_ep_rkey_unpack` (a packed rkey) take a pointer
//! and no length: libucx walks the buffer by the lengths and flags inside it, and a short or
//! crafted buffer makes it read past the end (seen under valgrind: a 2-byte rkey read 6-8 bytes
//! beyond its buffer and unpacked with `UCS_OK`; a 3-byte address 22 bytes beyond). So every
//! peer's address and rkey is checked here against the format UCX 1.13 packs, with explicit
//! bounds, and refused unless every byte UCX's unpacker would read lies inside it, with nothing
//! left over. A peer of the other release never gets this far (its endpoint names its
//! release: `data.rs`), so the format checked is the loaded release's. What passes is copied into a buffer this crate owns, followed by [`TAIL_PAD`]
//! zeroed bytes ([`owned_copy`]), and only that copy is handed to UCX.
//!
//! The formats (UCX 1.13.1, `ucp/wireup/address.c`, `ucp/core/ucp_rkey.c`; checked against the
//! addresses and rkeys this machine's libucx packs over tcp, posix, sysv, cma and self by the
//! tests in `packed/tests.rs`):
//!
//! Worker address (`UCX_ADDRESS_VERSION=v1`, not unified mode; [`super::safe::Context`] sets
//! both, so every kvferry worker packs and parses this one):
//! ```text
//! header u8        0x20 (version), | 0x10 when UCX_ADDRESS_DEBUG_INFO=y
//! uuid u64
//! [name_len u8, name]                         with the debug flag only
//! device*:
//!   md u8          index (5 bits, < 16 here) | 0x80 no transports | 0x40 alloc | 0x20 reg
//!                  (0xff, alone: an address without devices)
//!   dev_len u8     length (6 bits) | 0x80 last device | 0x40 a paths byte follows
//!   [paths u8]
//!   device address (dev_len bytes)
//!   transport* (unless the md byte says none):
//!     tl_name_csum u16, iface attributes (16 bytes),
//!     addr_len u8  length (6 bits) | 0x80 last transport of the device | 0x40 ep addresses
//!                  follow (never in a worker address: refused)
//!     iface address (addr_len bytes)
//! ```
//! UCX 1.22 (`ucp/wireup/address.c` of 1.22.0) packs the same with three differences: the md
//! byte is `0x80` no transports | index (7 bits, < 16 here), without the alloc and reg bits;
//! the device length byte has 5 bits of length and `0x20` announces a system-device byte
//! (after the paths byte, before the device address); and the last real device is followed by
//! a release trailer, `0x80 | (minor % 16)` then `0x80`, which reads as an empty last device
//! (the real one before it then has no last flag).
//!
//! Remote key (`ucp_rkey_pack`):
//! ```text
//! md_map u64 (little-endian; bits >= 16 refused), mem_type u8 (< UCS_MEMORY_TYPE_LAST: 5 in
//! 1.13, 10 in 1.22), per bit of md_map, in order: size u8, the transport's packed key (size
//! bytes); 1.22 only, when md_map is not 0: sys_dev u8 (0xff: host memory), and unless 0xff
//! distances {sys_dev u8, latency u8, bandwidth u8}* ended by 0xff (`ucp/core/ucp_rkey.c`)
//! ```
//! The transports' own readers of a device address, an iface address or a transport key read
//! a fixed structure of their own, without the length UCX framed it with; those reads stay
//! inside the owned copy: every framed length is below 256 and [`TAIL_PAD`] zeroes follow.

use super::version::{self, Family};

/// Largest worker address accepted from a peer. Those packed here are 38 to 186 bytes; one per
/// transport of a few RDMA devices stays well within.
pub const MAX_ADDRESS_BYTES: usize = 4096;

/// Largest packed remote key accepted from a peer (9 to 12 bytes here; a few dozen per RDMA
/// device elsewhere).
pub const MAX_RKEY_BYTES: usize = 4096;

/// Zeroed bytes after the copy of a validated address or rkey handed to UCX: more than any
/// length one of their framing bytes can announce (u8), so a transport reading its own fixed
/// structure where UCX framed a shorter one never leaves memory this crate owns.
pub const TAIL_PAD: usize = 256;

/// Devices and transports a worker address may list (UCX 1.13 keeps resource indices below
/// 128 and memory domains below 16).
const MAX_ENTRIES: usize = 64;
const MAX_MD_INDEX: u8 = 16;

const HEADER_V1: u8 = 0x20;
const HEADER_DEBUG_INFO: u8 = 0x10;
const NULL_RESOURCE: u8 = 0xff;
const MD_EMPTY_DEV: u8 = 0x80;
const MD_INDEX_MASK: u8 = 0x1f;
const FLAG_LAST: u8 = 0x80;
const FLAG_HAVE_PATHS: u8 = 0x40;
const FLAG_HAS_EP_ADDR: u8 = 0x40;
const LEN_MASK: u8 = 0x3f;
/// `ucp_address_packed_iface_attr_t`: overhead, bandwidth, latency (f32 each), flags (u32).
const IFACE_ATTR_BYTES: usize = 16;
/// `UCS_MEMORY_TYPE_LAST` of each release (`ucs/memory/memory_type.h`).
fn memory_type_last(family: Family) -> u8 {
    match family {
        Family::V1_13 => 5,
        Family::V1_22 => 10,
    }
}
/// UCX 1.22's md byte: the index without 1.13's alloc and reg bits.
const MD_INDEX_MASK_1_22: u8 = 0x7f;
/// UCX 1.22's device length byte: 5 bits of length, and a system-device byte announced.
const DEV_LEN_MASK_1_22: u8 = 0x1f;
const FLAG_SYS_DEVICE: u8 = 0x20;
/// A remote key's system device that is no device (host memory), and the end of its
/// distances (UCX 1.22).
const SYS_DEVICE_UNKNOWN: u8 = 0xff;
/// Distances a remote key may list (one per system device UCX knows of).
const MAX_DISTANCES: usize = 128;

/// A peer's address or rkey that does not have the shape this process's UCX packs: it never
/// reaches UCX.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed UCX {what}: {reason}")]
pub struct Malformed {
    /// `worker address` or `rkey`.
    pub what: &'static str,
    /// What is wrong, with the offset.
    pub reason: String,
}

/// A bounds-checked cursor over a peer's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Reader { bytes, at: 0, what }
    }

    fn fail(&self, reason: impl std::fmt::Display) -> Malformed {
        Malformed {
            what: self.what,
            reason: format!("{reason} (at byte {} of {})", self.at, self.bytes.len()),
        }
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], Malformed> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| self.fail(format_args!("{field}: {n} bytes past the end")))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self, field: &str) -> Result<u8, Malformed> {
        Ok(self.take(1, field)?[0])
    }

    fn u64_le(&mut self, field: &str) -> Result<u64, Malformed> {
        let mut word = [0u8; 8];
        word.copy_from_slice(self.take(8, field)?);
        Ok(u64::from_le_bytes(word))
    }

    fn finish(&self) -> Result<(), Malformed> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            n => Err(self.fail(format_args!(
                "{n} bytes after the end of the packed structure"
            ))),
        }
    }
}

fn capped(bytes: &[u8], what: &'static str, max: usize) -> Result<(), Malformed> {
    if bytes.is_empty() || bytes.len() > max {
        return Err(Malformed {
            what,
            reason: format!("{} bytes (1..={max} accepted)", bytes.len()),
        });
    }
    Ok(())
}

/// Checks a peer's worker address (see the module's format) for the loaded release: `Ok`
/// only when UCX's unpacker reads nothing outside `bytes` and `bytes` holds nothing else.
pub fn check_worker_address(bytes: &[u8]) -> Result<(), Malformed> {
    check_worker_address_of(bytes, version::family())
}

/// [`check_worker_address`] for UCX of `family`.
pub fn check_worker_address_of(bytes: &[u8], family: Family) -> Result<(), Malformed> {
    const WHAT: &str = "worker address";
    let (md_mask, len_mask) = match family {
        Family::V1_13 => (MD_INDEX_MASK, LEN_MASK),
        Family::V1_22 => (MD_INDEX_MASK_1_22, DEV_LEN_MASK_1_22),
    };
    capped(bytes, WHAT, MAX_ADDRESS_BYTES)?;
    let mut r = Reader::new(bytes, WHAT);
    let header = r.u8("header")?;
    if header & !HEADER_DEBUG_INFO != HEADER_V1 {
        return Err(r.fail(format_args!("header {header:#04x}: not a UCX v1 address")));
    }
    r.take(8, "uuid")?;
    if header & HEADER_DEBUG_INFO != 0 {
        let len = r.u8("worker name length")?;
        r.take(len as usize, "worker name")?;
    }
    let mut entries = 0usize;
    for device in 0.. {
        if device >= MAX_ENTRIES {
            return Err(r.fail(format_args!("more than {MAX_ENTRIES} devices")));
        }
        let md = r.u8("md index")?;
        if md == NULL_RESOURCE {
            if device > 0 {
                return Err(r.fail("an empty-address marker after a device"));
            }
            break;
        }
        if md & md_mask >= MAX_MD_INDEX {
            return Err(r.fail(format_args!("md index {}", md & md_mask)));
        }
        let dev = r.u8("device address length")?;
        if dev & FLAG_HAVE_PATHS != 0 {
            r.u8("number of paths")?;
        }
        if family == Family::V1_22 && dev & FLAG_SYS_DEVICE != 0 {
            r.u8("system device")?;
        }
        r.take((dev & len_mask) as usize, "device address")?;
        if md & MD_EMPTY_DEV == 0 {
            loop {
                entries += 1;
                if entries > MAX_ENTRIES {
                    return Err(r.fail(format_args!("more than {MAX_ENTRIES} transports")));
                }
                r.take(2, "transport name checksum")?;
                r.take(IFACE_ATTR_BYTES, "interface attributes")?;
                let len = r.u8("interface address length")?;
                if len & FLAG_HAS_EP_ADDR != 0 {
                    return Err(r.fail("endpoint addresses in a worker address"));
                }
                r.take((len & LEN_MASK) as usize, "interface address")?;
                if len & FLAG_LAST != 0 {
                    break;
                }
            }
        }
        if dev & FLAG_LAST != 0 {
            break;
        }
    }
    r.finish()
}

/// Checks a peer's packed remote key (see the module's format) for the loaded release: `Ok`
/// only when UCX's unpacker reads nothing outside `bytes` and `bytes` holds nothing else.
pub fn check_rkey(bytes: &[u8]) -> Result<(), Malformed> {
    check_rkey_of(bytes, version::family())
}

/// [`check_rkey`] for UCX of `family`.
pub fn check_rkey_of(bytes: &[u8], family: Family) -> Result<(), Malformed> {
    const WHAT: &str = "rkey";
    capped(bytes, WHAT, MAX_RKEY_BYTES)?;
    let mut r = Reader::new(bytes, WHAT);
    let md_map = r.u64_le("md map")?;
    if md_map >> MAX_MD_INDEX != 0 {
        return Err(r.fail(format_args!(
            "md map {md_map:#x} names md {MAX_MD_INDEX} or above"
        )));
    }
    let mem_type = r.u8("memory type")?;
    if mem_type >= memory_type_last(family) {
        return Err(r.fail(format_args!("memory type {mem_type}")));
    }
    for _ in 0..md_map.count_ones() {
        let len = r.u8("transport key length")?;
        r.take(len as usize, "transport key")?;
    }
    if family == Family::V1_22 && md_map != 0 && r.u8("system device")? != SYS_DEVICE_UNKNOWN {
        let mut listed = 0;
        while r.u8("distance's system device")? != SYS_DEVICE_UNKNOWN {
            listed += 1;
            if listed > MAX_DISTANCES {
                return Err(r.fail(format_args!("more than {MAX_DISTANCES} distances")));
            }
            r.take(2, "distance")?;
        }
    }
    r.finish()
}

/// The kind of memory a peer's packed remote key names, once [`check_rkey`] passed: host or
/// CUDA memory, the only kinds kvferry writes into; any other kind (managed, ROCm, ...) is
/// refused before UCX unpacks the key (unpacking a device key maps the peer's memory here).
pub fn rkey_memory_type(bytes: &[u8]) -> Result<super::memory_type::MemoryType, Malformed> {
    use super::memory_type::MemoryType;
    check_rkey(bytes)?;
    let kind = u32::from(bytes.get(8).copied().unwrap_or(u8::MAX));
    [MemoryType::Host, MemoryType::Cuda]
        .into_iter()
        .find(|m| m.raw() == kind)
        .ok_or_else(|| Malformed {
            what: "rkey",
            reason: format!("memory type {kind}: a pool is host or CUDA memory"),
        })
}

/// A validated address or rkey as UCX gets it: a copy in memory this crate owns, followed by
/// [`TAIL_PAD`] zeroes. The pointer UCX reads is `as_ptr()` of the result.
pub(crate) fn owned_copy(bytes: &[u8]) -> Vec<u8> {
    let mut owned = Vec::with_capacity(bytes.len() + TAIL_PAD);
    owned.extend_from_slice(bytes);
    owned.resize(bytes.len() + TAIL_PAD, 0);
    owned
}

// The tests hand UCX raw addresses and keys next to guard pages, below the safe layer.
#[cfg(test)]
#[allow(unsafe_code)]
mod tests;
