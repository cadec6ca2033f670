//! Receives whose writes can be taken back: [`Revocable`], a destination in registered host
//! memory that UCX reaches only through a UCP generic datatype of this crate, received into
//! as an [`Incoming`] ([`RevocableBox`]) by [`Worker::tag_recv`](super::Worker::tag_recv).
//!
//! Invariant: a receive into a [`Revocable`] writes only through its unpack callback, on the
//! worker's thread, within its pieces (checked against the memory it holds), and never once
//! it is revoked.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

use super::lent::{Incoming, Lent, RawBuffer, within};
use super::worker::Request;
use crate::memory::Span;
use crate::transport::ucx::memory_type::MemoryType;
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::result::{self, UcxError};
use crate::transport::ucx::sys::{self, ucs_status_t};

/// The destination of a receive that UCX reaches only through this code: the receive uses a
/// UCP generic datatype whose unpack callback copies each piece that arrives into place, or
/// drops it once the destination is revoked ([`Revocable::revoke`]). The destination may be
/// several pieces of memory, filled one after the other (a message of head slices landing in
/// the token rows of a pool's pages).
///
/// Why: UCX 1.13 neither completes nor cancels an eager receive whose sender died after its
/// first fragment arrived. Into a plain buffer, such a receive keeps the right to write there
/// forever, so pool pages behind it could never be reused. Revoked, it writes nothing more;
/// the request may linger, the memory is the owner's again at once.
pub struct Revocable {
    /// Where the message's bytes go, in order: (address, length), within `_memory`.
    pieces: Box<[(*mut u8, usize)]>,
    /// Keeps the pieces allocated and writable for as long as the destination lives.
    _memory: Arc<dyn RegisterableMemory>,
    /// Offset in the message of each piece's first byte.
    starts: Box<[usize]>,
    len: usize,
    revoked: Cell<bool>,
    /// Whether a piece arrived: a matched receive, which UCX can no longer cancel.
    touched: Cell<bool>,
}

impl Revocable {
    /// Stops every later write: pieces that arrive from now on are dropped.
    pub fn revoke(&self) {
        self.revoked.set(true);
    }

    /// Whether [`Revocable::revoke`] was called.
    pub fn revoked(&self) -> bool {
        self.revoked.get()
    }

    /// Whether any piece of a message arrived (the receive is matched).
    pub fn touched(&self) -> bool {
        self.touched.get()
    }
}

/// An owned [`Revocable`] at an address that stays valid for UCX while its owner moves: made
/// with `Box::leak` (as `Box::into_raw`), so no move of a `Box` (which asserts unique access to
/// its contents) invalidates the pointer UCX's callbacks hold; freed when this drops.
pub struct RevocableBox(NonNull<Revocable>);

impl RevocableBox {
    /// A destination made of the `pieces` of `memory`, filled in order; refused unless the
    /// memory is host memory (the unpack callback copies on the host) and holds every piece.
    /// Pieces that overlap take the later bytes.
    pub fn new(
        memory: Arc<dyn RegisterableMemory>,
        pieces: &[Span],
    ) -> Result<RevocableBox, UcxError> {
        let kind = memory.memory_type();
        if kind != MemoryType::Host {
            return Err(UcxError::MemoryType {
                op: "revocable receive",
                memory: kind,
                why: "its pieces are written by host copies",
            });
        }
        let (base, size) = (memory.base(), memory.size());
        for &piece in pieces {
            within(size, piece)?;
        }
        // Within the memory (checked above), so both fit a usize.
        let pieces: Box<[_]> = pieces
            .iter()
            .map(|p| (base.wrapping_add(p.offset as usize), p.len as usize))
            .collect();
        let starts = pieces
            .iter()
            .scan(0usize, |at, &(_, n)| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect();
        let len = pieces.iter().map(|&(_, n)| n).sum();
        let boxed = Box::new(Revocable {
            pieces,
            _memory: memory,
            starts,
            len,
            revoked: Cell::new(false),
            touched: Cell::new(false),
        });
        Ok(RevocableBox(NonNull::from(Box::leak(boxed))))
    }

    /// The pointer UCX's callbacks get.
    fn as_ptr(&self) -> *mut Revocable {
        self.0.as_ptr()
    }
}

impl Lent for RevocableBox {}

// SAFETY: UCX hands the buffer (the Revocable, at a leaked Box's address that no move of the
// RevocableBox changes, live until it drops) only to the datatype's callbacks, which write
// only into its pieces: host memory within `_memory` (checked in `new`), which it keeps
// allocated and which is never referenced (`RegisterableMemory`).
unsafe impl Incoming for RevocableBox {
    fn incoming(&mut self) -> Result<RawBuffer, UcxError> {
        Ok(RawBuffer {
            buffer: self.as_ptr().cast(),
            count: 1,
            datatype: revocable_type()?,
            memory: MemoryType::Host,
        })
    }
}

impl Request<RevocableBox> {
    /// The receive's destination, to revoke it or see whether a message matched it.
    pub fn target(&self) -> &Revocable {
        self.lent()
    }
}

impl std::ops::Deref for RevocableBox {
    type Target = Revocable;
    fn deref(&self) -> &Revocable {
        // SAFETY: live from `RevocableBox::new` until Drop; only shared references are made (the
        // callbacks' included), and its mutable state is in Cells used on one thread.
        unsafe { self.0.as_ref() }
    }
}

impl Drop for RevocableBox {
    fn drop(&mut self) {
        // SAFETY: from Box::leak in `RevocableBox::new`, freed once; lent to a receive, it is
        // owned by the request, which hands it back only after the receive ended, or leaks it.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

/// `start_unpack`: the state is the [`Revocable`] itself, given as the receive's buffer.
unsafe extern "C" fn revocable_start(_: *mut c_void, buffer: *mut c_void, _: usize) -> *mut c_void {
    buffer
}

/// `packed_size`: the destination's length (a longer message is truncated by UCX).
unsafe extern "C" fn revocable_size(state: *mut c_void) -> usize {
    // SAFETY: `state` is a live Revocable (the receive's request owns its RevocableBox).
    unsafe { &*state.cast::<Revocable>() }.len
}

/// `unpack`: copies a piece into place unless revoked; a piece beyond the destination is an
/// error (UCX checks the total length first, so it never happens).
unsafe extern "C" fn revocable_unpack(
    state: *mut c_void,
    offset: usize,
    src: *const c_void,
    length: usize,
) -> ucs_status_t {
    // SAFETY: as in `revocable_size`; UCX calls on the worker's thread, as does `revoke`.
    let target = unsafe { &*state.cast::<Revocable>() };
    target.touched.set(true);
    if target.revoked.get() {
        return sys::UCS_OK;
    }
    if offset
        .checked_add(length)
        .is_none_or(|end| end > target.len)
    {
        return sys::UCS_ERR_MESSAGE_TRUNCATED;
    }
    // The destination pieces this part of the message covers, from the one it starts in.
    let first = target
        .starts
        .partition_point(|&s| s <= offset)
        .saturating_sub(1);
    let (mut at, mut left) = (offset, length);
    for (&(dst, len), &start) in target.pieces[first..].iter().zip(&target.starts[first..]) {
        if left == 0 {
            break;
        }
        let within = at - start;
        let n = (len - within).min(left);
        // SAFETY: each piece is writable host memory within the memory the target holds
        // (`RevocableBox::new`), this part lies within it (the message is no longer than the pieces together, checked above),
        // and UCX's `src` holds `length` readable bytes, of which this is the next `n`.
        unsafe {
            crate::kernel::cpu::copy_streaming(
                src.cast::<u8>().add(at - offset),
                dst.add(within),
                n,
            )
        };
        (at, left) = (at + n, left - n);
    }
    crate::kernel::cpu::fence_streams();
    sys::UCS_OK
}

/// `start_pack`, `pack`, `finish`: never used to send; nothing to release.
unsafe extern "C" fn revocable_no_pack(_: *mut c_void, _: *const c_void, _: usize) -> *mut c_void {
    ptr::null_mut()
}
unsafe extern "C" fn revocable_no_data(
    _: *mut c_void,
    _: usize,
    _: *mut c_void,
    _: usize,
) -> usize {
    0
}
unsafe extern "C" fn revocable_finish(_: *mut c_void) {}

static REVOCABLE_OPS: sys::ucp_generic_dt_ops_t = sys::ucp_generic_dt_ops_t {
    start_pack: Some(revocable_no_pack),
    start_unpack: Some(revocable_start),
    packed_size: Some(revocable_size),
    pack: Some(revocable_no_data),
    unpack: Some(revocable_unpack),
    finish: Some(revocable_finish),
};

/// The process's one generic datatype for [`Revocable`] receives (it holds no state of its
/// own, so it is made once and kept).
fn revocable_type() -> Result<sys::ucp_datatype_t, UcxError> {
    static TYPE: OnceLock<Result<sys::ucp_datatype_t, UcxError>> = OnceLock::new();
    TYPE.get_or_init(|| result::dt_create_generic(&REVOCABLE_OPS))
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ucx::region::Region;

    fn region(size: usize) -> Arc<Region> {
        Arc::new(Region::new(size).unwrap())
    }

    fn span(offset: u64, len: u64) -> Span {
        Span { offset, len }
    }

    /// The pointer UCX's callbacks hold stays the destination's after its owner moves (into a
    /// Vec, as into a request): pieces land through it, and a revoke through the owner stops
    /// them. Derived from a `Box` that then moved, this pointer would be invalid under Rust's
    /// aliasing rules (what `cargo miri test` checks; this test has no FFI).
    #[test]
    fn callback_pointer_survives_a_move_of_its_owner() {
        let dst = region(8);
        let target = RevocableBox::new(dst.clone(), &[span(0, 8)]).unwrap();
        let state = target.as_ptr().cast::<c_void>();
        let owners = vec![target];
        let piece = [7u8, 8, 9];
        // SAFETY: `state` is the live Revocable (owned by `owners`); `piece` is readable.
        let ok = unsafe { revocable_unpack(state, 2, piece.as_ptr().cast(), piece.len()) };
        assert_eq!(ok, sys::UCS_OK);
        // SAFETY: as above.
        assert_eq!(unsafe { revocable_size(state) }, 8);
        owners[0].revoke();
        // SAFETY: as above; revoked, the piece is dropped.
        let ok = unsafe { revocable_unpack(state, 0, piece.as_ptr().cast(), piece.len()) };
        assert_eq!(ok, sys::UCS_OK);
        assert!(owners[0].touched() && owners[0].revoked());
        drop(owners);
        assert_eq!(dst.read(0, 8).unwrap(), [0, 0, 7, 8, 9, 0, 0, 0]);
    }

    /// A destination of several pieces takes a message's parts, whatever their cuts, each byte
    /// in its piece: the pieces one after the other make the message, and the bytes between
    /// them stay untouched. A part past the pieces' end is refused.
    #[test]
    fn parts_of_a_message_land_in_their_pieces() {
        let message: Vec<u8> = (1..=600u16).map(|i| (i % 251) as u8).collect();
        // Pieces of 100, 1, 299 and 200 bytes, 7 bytes apart, in a region of 0xEE.
        let dst = region(700);
        dst.fill(0xEE);
        let lens = [100u64, 1, 299, 200];
        let mut pieces = Vec::new();
        let mut at = 0;
        for len in lens {
            pieces.push(span(at, len));
            at += len + 7;
        }
        let target = RevocableBox::new(dst.clone(), &pieces).unwrap();
        let state = target.as_ptr().cast::<c_void>();
        for part in [0..50, 50..101, 101..102, 102..450, 450..600] {
            let bytes = &message[part.clone()];
            // SAFETY: `state` is the live target; `bytes` is readable.
            let ok =
                unsafe { revocable_unpack(state, part.start, bytes.as_ptr().cast(), bytes.len()) };
            assert_eq!(ok, sys::UCS_OK, "{part:?}");
        }
        // SAFETY: as above; one byte past the end.
        let past = unsafe { revocable_unpack(state, 600, message.as_ptr().cast(), 1) };
        assert_eq!(past, sys::UCS_ERR_MESSAGE_TRUNCATED);
        drop(target);
        let mut want = vec![0xEEu8; 700];
        let (mut at, mut from) = (0, 0);
        for len in lens.map(|n| n as usize) {
            want[at..at + len].copy_from_slice(&message[from..from + len]);
            (at, from) = (at + len + 7, from + len);
        }
        assert_eq!(dst.read(0, 700).unwrap(), want);
    }

    /// A destination is refused unless every piece lies within its memory.
    #[test]
    fn pieces_outside_the_memory_are_refused() {
        let dst = region(100);
        assert!(RevocableBox::new(dst.clone(), &[span(0, 60), span(60, 40)]).is_ok());
        for bad in [span(60, 41), span(100, 1), span(u64::MAX, 2)] {
            let refused = RevocableBox::new(dst.clone(), &[span(0, 10), bad]);
            assert!(
                matches!(refused, Err(UcxError::OutOfBounds { .. })),
                "{bad:?}"
            );
        }
    }
}
