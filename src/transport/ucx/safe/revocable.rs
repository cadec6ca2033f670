//! Receives whose writes can be taken back: [`Revocable`], a destination that UCX reaches only
//! through a UCP generic datatype of this crate, and [`Worker::tag_recv_revocable`].
//!
//! Invariant: a receive into a [`Revocable`] writes only through its unpack callback, on the
//! worker's thread, and never once it is revoked.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::OnceLock;

use super::worker::{Started, Worker};
use crate::transport::ucx::memory_type::MemoryType;
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
    /// Where the message's bytes go, in order: (address, length).
    pieces: Box<[(*mut u8, usize)]>,
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
    /// A destination made of `pieces` (address, length), filled in order.
    ///
    /// # Safety
    /// Each piece is valid for writes of its length until the destination is revoked or its
    /// receive has completed, no two overlap, and nothing else accesses them meanwhile.
    pub unsafe fn new(pieces: Vec<(*mut u8, usize)>) -> RevocableBox {
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
            pieces: pieces.into_boxed_slice(),
            starts,
            len,
            revoked: Cell::new(false),
            touched: Cell::new(false),
        });
        RevocableBox(NonNull::from(Box::leak(boxed)))
    }

    /// The pointer UCX's callbacks get.
    fn as_ptr(&self) -> *mut Revocable {
        self.0.as_ptr()
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
        // SAFETY: from Box::leak in `RevocableBox::new`, freed once; its owner (a run's Pending
        // entry) drops it only after the receive completed, or never (leaked with it).
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

/// `start_unpack`: the state is the [`Revocable`] itself, given as the receive's buffer.
unsafe extern "C" fn revocable_start(_: *mut c_void, buffer: *mut c_void, _: usize) -> *mut c_void {
    buffer
}

/// `packed_size`: the destination's length (a longer message is truncated by UCX).
unsafe extern "C" fn revocable_size(state: *mut c_void) -> usize {
    // SAFETY: `state` is a live Revocable (`Worker::tag_recv_revocable`'s contract).
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
        // SAFETY: each piece is writable while not revoked (`RevocableBox::new`), this part
        // lies within it (the message is no longer than the pieces together, checked above),
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

impl Worker {
    /// Posts a tagged receive of a message of at most `target`'s length into it (a
    /// [`Revocable`]); as [`Worker::tag_recv`] otherwise.
    ///
    /// # Safety
    /// `target` stays allocated and unmoved until the returned request completes (or forever,
    /// if the worker is leaked).
    pub unsafe fn tag_recv_revocable(
        self: &Rc<Self>,
        target: &RevocableBox,
        tag: u64,
        mask: u64,
    ) -> Result<Started<()>, UcxError> {
        let buffer = target.as_ptr().cast();
        // SAFETY: UCX hands the buffer pointer (the target) only to the datatype's callbacks,
        // which the caller's contract keeps valid.
        unsafe { self.recv_as(buffer, 1, revocable_type()?, tag, mask, MemoryType::Host) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pointer UCX's callbacks hold stays the destination's after its owner moves (into a
    /// Vec, as into a Pending entry): pieces land through it, and a revoke through the owner
    /// stops them. Derived from a `Box` that then moved, this pointer would be invalid under
    /// Rust's aliasing rules (what `cargo miri test` checks; this test has no FFI).
    #[test]
    fn callback_pointer_survives_a_move_of_its_owner() {
        let mut dst = vec![0u8; 8];
        // SAFETY: `dst` outlives the target and is touched only through it until the end.
        let target = unsafe { RevocableBox::new(vec![(dst.as_mut_ptr(), dst.len())]) };
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
        assert_eq!(dst, [0, 0, 7, 8, 9, 0, 0, 0]);
    }

    /// A destination of several pieces takes a message's parts, whatever their cuts, each byte
    /// in its piece: the pieces one after the other make the message, and the bytes between
    /// them stay untouched. A part past the pieces' end is refused.
    #[test]
    fn parts_of_a_message_land_in_their_pieces() {
        let message: Vec<u8> = (1..=600u16).map(|i| (i % 251) as u8).collect();
        // Pieces of 100, 1, 299 and 200 bytes, 7 bytes apart, in a buffer of 0xEE.
        let mut dst = vec![0xEEu8; 700];
        let base = dst.as_mut_ptr();
        let lens = [100usize, 1, 299, 200];
        let mut pieces = Vec::new();
        let mut at = 0;
        for len in lens {
            // SAFETY: within `dst`: 4 gaps of 7 and 600 bytes of pieces fit in 700.
            pieces.push((unsafe { base.add(at) }, len));
            at += len + 7;
        }
        // SAFETY: the pieces lie apart within `dst`, which outlives the target and is read
        // only after it is dropped.
        let target = unsafe { RevocableBox::new(pieces) };
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
        for len in lens {
            want[at..at + len].copy_from_slice(&message[from..from + len]);
            (at, from) = (at + len + 7, from + len);
        }
        assert_eq!(dst, want);
    }
}
