//! What operations lend UCX: the [`Lent`] values a [`Request`] owns until UCX reports its end,
//! memory UCX reads ([`Outgoing`]: a [`Message`] of parts, [`Bytes`], a [`MemoryRange`], a
//! put's [`Source`]) or writes ([`Incoming`]: a [`RecvBuffer`], a [`MemoryRange`], a
//! [`RevocableBox`](super::RevocableBox)), and the [`RawBuffer`] each becomes for the call.
//!
//! Invariants: every range is checked against its memory when it is made, before UCX sees it;
//! what UCX reads or writes stays allocated, at the same address, for as long as the value
//! that owns it lives, whichever way the value moves; a receive buffer counts as initialised
//! only the bytes UCX reported it received.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;

use crate::memory::Span;
use crate::transport::ucx::memory_type::MemoryType;
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::result::UcxError;
use crate::transport::ucx::sys::{self, ucs_status_t};

#[cfg(doc)]
use super::Request;

/// Memory as a UCP call takes it: the buffer argument, the count of `datatype` elements there,
/// and the memory's kind.
pub struct RawBuffer {
    pub(super) buffer: *mut c_void,
    pub(super) count: usize,
    pub(super) datatype: sys::ucp_datatype_t,
    pub(super) memory: MemoryType,
}

impl RawBuffer {
    /// `len` contiguous bytes at `buffer`.
    fn bytes(buffer: *const u8, len: usize, memory: MemoryType) -> RawBuffer {
        RawBuffer {
            buffer: buffer.cast_mut().cast(),
            count: len,
            datatype: sys::UCP_DATATYPE_BYTES,
            memory,
        }
    }
}

/// What a request lends UCX: its [`Request`] owns it until UCX reports the end, then hands it
/// back ([`Request::end`]).
pub trait Lent {
    /// Takes note of how the request ended (a receive buffer counts the bytes that arrived).
    ///
    /// # Safety
    /// Called once, by [`Request::end`], with UCX's report of the end of the request this
    /// value was lent to.
    unsafe fn ended(&mut self, status: ucs_status_t, info: &sys::ucp_tag_recv_info_t) {
        let _ = (status, info);
    }
}

/// Memory UCX reads: the source of a send or a put.
///
/// # Safety
/// What [`Outgoing::outgoing`] describes is readable as its memory type says, is written by
/// nothing while the value lives, and stays allocated at the same address for as long as the
/// value lives, however the value moves.
pub unsafe trait Outgoing: Lent {
    /// The memory, as the call takes it.
    fn outgoing(&self) -> RawBuffer;
}

/// Memory UCX writes: the destination of a receive.
///
/// # Safety
/// What [`Incoming::incoming`] describes is writable as its memory type says, is never
/// reached through a Rust reference while the value lives, and stays allocated at the same
/// address for as long as the value lives, however the value moves.
pub unsafe trait Incoming: Lent {
    /// The memory, as the call takes it.
    fn incoming(&mut self) -> Result<RawBuffer, UcxError>;
}

impl Lent for () {}

/// A range of registerable memory, checked to lie within it, holding the memory (an `Arc`).
#[derive(Clone)]
pub struct MemoryRange {
    memory: Arc<dyn RegisterableMemory>,
    offset: usize,
    len: usize,
}

impl MemoryRange {
    /// `span` of `memory`; [`UcxError::OutOfBounds`] unless it lies within it.
    pub fn new(memory: Arc<dyn RegisterableMemory>, span: Span) -> Result<MemoryRange, UcxError> {
        let (offset, len) = within(memory.size(), span)?;
        Ok(MemoryRange {
            memory,
            offset,
            len,
        })
    }

    /// Where the memory is.
    pub fn memory_type(&self) -> MemoryType {
        self.memory.memory_type()
    }

    /// The range's first byte. Wrapping: device memory is no allocation of this process (the
    /// offset lies within the memory, checked in `new`).
    fn start(&self) -> *mut u8 {
        self.memory.base().wrapping_add(self.offset)
    }

    fn raw(&self) -> RawBuffer {
        RawBuffer::bytes(self.start(), self.len, self.memory_type())
    }
}

/// `span` as (offset, length) in memory of `size` bytes; [`UcxError::OutOfBounds`] unless it
/// lies within it.
pub(super) fn within(size: usize, span: Span) -> Result<(usize, usize), UcxError> {
    match span.offset.checked_add(span.len) {
        // Both fit a usize: the span ends within `size`.
        Some(end) if end <= size as u64 => Ok((span.offset as usize, span.len as usize)),
        _ => Err(UcxError::OutOfBounds {
            offset: span.offset,
            len: span.len as usize,
            size: size as u64,
        }),
    }
}

impl Lent for MemoryRange {}

// SAFETY: `RegisterableMemory` keeps `base()..base() + size()` allocated, at the same address,
// readable as its memory type says and never referenced for as long as the value lives, and
// the range holds the value (Arc) and lies within it (checked in `new`).
unsafe impl Outgoing for MemoryRange {
    fn outgoing(&self) -> RawBuffer {
        self.raw()
    }
}

// SAFETY: as for `Outgoing`: registerable memory is writable as its type says, and never
// handed out as a reference.
unsafe impl Incoming for MemoryRange {
    fn incoming(&mut self) -> Result<RawBuffer, UcxError> {
        Ok(self.raw())
    }
}

impl Lent for Bytes {}

// SAFETY: a `Bytes` reads immutable memory that stays at its address while any handle to it
// lives; moving the handle does not move the bytes.
unsafe impl Outgoing for Bytes {
    fn outgoing(&self) -> RawBuffer {
        RawBuffer::bytes(self.as_ptr(), self.len(), MemoryType::Host)
    }
}

/// One tagged message of host memory: `parts`, then ranges of registered memory, sent
/// together (their concatenation) from where they are, without a copy.
pub struct Message {
    _parts: Vec<Bytes>,
    _from: Option<Arc<dyn RegisterableMemory>>,
    /// The pieces (none empty; one empty piece when the message is), pointing into `_parts`
    /// and `_from`. UCX keeps a pointer to this array while the send runs: a move of the Vec
    /// leaves it in place.
    iov: Vec<sys::ucp_dt_iov_t>,
}

impl Message {
    /// The message of `parts` followed by the `spans` of `from`, which must be host memory
    /// (a request has one memory type, and the parts are host memory) and contain them.
    pub fn new(
        parts: Vec<Bytes>,
        from: Option<(Arc<dyn RegisterableMemory>, &[Span])>,
    ) -> Result<Message, UcxError> {
        let spans = from.as_ref().map_or(0, |(_, spans)| spans.len());
        let mut iov = Vec::with_capacity(parts.len() + spans);
        iov.extend(parts.iter().map(|p| sys::ucp_dt_iov_t {
            buffer: p.as_ptr().cast_mut().cast(),
            length: p.len(),
        }));
        if let Some((source, spans)) = &from {
            if source.memory_type() != MemoryType::Host {
                return Err(UcxError::MemoryType {
                    op: "send_tag",
                    memory: source.memory_type(),
                    why: "a message of parts is host memory only",
                });
            }
            let (base, size) = (source.base(), source.size());
            for &span in spans.iter() {
                let (offset, length) = within(size, span)?;
                iov.push(sys::ucp_dt_iov_t {
                    buffer: base.wrapping_add(offset).cast(),
                    length,
                });
            }
        }
        iov.retain(|v| v.length > 0);
        if iov.is_empty() {
            iov.push(sys::ucp_dt_iov_t {
                buffer: NonNull::<u8>::dangling().as_ptr().cast(),
                length: 0,
            });
        }
        Ok(Message {
            _parts: parts,
            _from: from.map(|(source, _)| source),
            iov,
        })
    }
}

impl Lent for Message {}

// SAFETY: every piece points into a `Bytes` of `_parts` (immutable memory that stays in place
// while the handle lives) or into `_from`'s memory (registerable: allocated, at the same
// address and never written through a reference while the Arc lives; host memory, checked in
// `new`), and the iov array is the Vec's heap allocation, which neither moves nor changes
// while the message lives.
unsafe impl Outgoing for Message {
    fn outgoing(&self) -> RawBuffer {
        match &self.iov[..] {
            [one] => RawBuffer::bytes(one.buffer.cast(), one.length, MemoryType::Host),
            many => RawBuffer {
                buffer: many.as_ptr().cast_mut().cast(),
                count: many.len(),
                datatype: sys::UCP_DATATYPE_IOV,
                memory: MemoryType::Host,
            },
        }
    }
}

/// A host buffer a tagged receive fills: the first `capacity` bytes of a `Vec`'s allocation.
/// After a receive of `n` bytes its length is at least `n` (a longer length is kept: those
/// bytes were initialised before).
pub struct RecvBuffer {
    buffer: Vec<u8>,
    capacity: usize,
}

impl RecvBuffer {
    /// The first `capacity` bytes of `buffer`'s allocation; the buffer back when it has fewer.
    pub fn new(buffer: Vec<u8>, capacity: usize) -> Result<RecvBuffer, Vec<u8>> {
        match capacity <= buffer.capacity() {
            true => Ok(RecvBuffer { buffer, capacity }),
            false => Err(buffer),
        }
    }

    /// The buffer.
    pub fn into_vec(self) -> Vec<u8> {
        self.buffer
    }
}

impl Lent for RecvBuffer {
    unsafe fn ended(&mut self, status: ucs_status_t, info: &sys::ucp_tag_recv_info_t) {
        if status == sys::UCS_OK && info.length <= self.capacity && info.length > self.buffer.len()
        {
            // SAFETY: the receive completed (the caller's contract) and UCX wrote the
            // `info.length` bytes it reports at the start of the allocation, which holds
            // `capacity >= info.length` bytes (`new`).
            unsafe { self.buffer.set_len(info.length) };
        }
    }
}

// SAFETY: the Vec's heap allocation holds `capacity` bytes (checked in `new`), does not move
// when the Vec moves, and nothing reads or writes the Vec's contents while it is lent (the
// buffer is private until `into_vec`, which needs the value back).
unsafe impl Incoming for RecvBuffer {
    fn incoming(&mut self) -> Result<RawBuffer, UcxError> {
        Ok(RawBuffer::bytes(
            self.buffer.as_mut_ptr(),
            self.capacity,
            MemoryType::Host,
        ))
    }
}

/// What a put reads: bytes, or a range of registered memory.
pub enum Source {
    /// Bytes of the caller's.
    Bytes(Bytes),
    /// A range of registered memory.
    Memory(MemoryRange),
}

impl Lent for Source {}

// SAFETY: each variant is `Outgoing` (see there).
unsafe impl Outgoing for Source {
    fn outgoing(&self) -> RawBuffer {
        match self {
            Source::Bytes(b) => b.outgoing(),
            Source::Memory(m) => m.outgoing(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ucx::region::Region;

    fn span(offset: u64, len: u64) -> Span {
        Span { offset, len }
    }

    fn region(size: usize) -> Arc<dyn RegisterableMemory> {
        Arc::new(Region::new(size).unwrap())
    }

    /// A range, or a message's span, that does not lie within its memory never becomes one.
    #[test]
    fn ranges_outside_their_memory_are_refused() {
        let memory = region(100);
        assert!(MemoryRange::new(memory.clone(), span(60, 40)).is_ok());
        assert!(MemoryRange::new(memory.clone(), span(100, 0)).is_ok());
        for bad in [span(60, 41), span(101, 0), span(u64::MAX, 2)] {
            let range = MemoryRange::new(memory.clone(), bad);
            assert!(
                matches!(range, Err(UcxError::OutOfBounds { .. })),
                "{bad:?}"
            );
            let spans = [span(0, 1), bad];
            let message = Message::new(vec![], Some((memory.clone(), &spans)));
            assert!(
                matches!(message, Err(UcxError::OutOfBounds { .. })),
                "{bad:?}"
            );
        }
    }

    /// A message of one piece goes as bytes, one of several as an iov of its non-empty pieces
    /// in order, an empty one as no bytes.
    #[test]
    fn a_message_is_its_non_empty_pieces_in_order() {
        let memory = region(100);
        let part = Bytes::from_static(b"header");
        let one = Message::new(vec![part.clone(), Bytes::new()], None).unwrap();
        let raw = one.outgoing();
        assert_eq!(raw.datatype, sys::UCP_DATATYPE_BYTES);
        assert_eq!(
            (raw.buffer.cast_const(), raw.count),
            (part.as_ptr().cast(), 6)
        );
        let spans = [span(10, 20), span(0, 0), span(50, 5)];
        let many = Message::new(vec![part.clone()], Some((memory.clone(), &spans))).unwrap();
        let raw = many.outgoing();
        assert_eq!((raw.datatype, raw.count), (sys::UCP_DATATYPE_IOV, 3));
        let pieces: Vec<(usize, usize)> = many
            .iov
            .iter()
            .map(|v| (v.buffer as usize, v.length))
            .collect();
        let at = |offset: usize| memory.base() as usize + offset;
        assert_eq!(
            pieces,
            [(part.as_ptr() as usize, 6), (at(10), 20), (at(50), 5)]
        );
        let empty = Message::new(vec![], None).unwrap().outgoing();
        assert_eq!((empty.datatype, empty.count), (sys::UCP_DATATYPE_BYTES, 0));
    }

    /// A receive buffer counts as received only what UCX reported arriving within its
    /// capacity, and never shortens a buffer whose bytes were initialised already.
    #[test]
    fn a_receive_buffer_counts_only_what_arrived() {
        let info = |length| sys::ucp_tag_recv_info_t {
            sender_tag: 0,
            length,
        };
        // Spare capacity whose bytes are initialised: the reports below are made up, and no
        // UCX wrote them.
        let spare = || {
            let mut v = vec![7u8; 16];
            v.clear();
            v
        };
        let ended = |buffer: Vec<u8>, capacity, status, length| {
            let mut b = RecvBuffer::new(buffer, capacity).unwrap();
            // SAFETY: once, as UCX would report; the bytes it counts are initialised.
            unsafe { b.ended(status, &info(length)) };
            b.into_vec().len()
        };
        assert_eq!(ended(spare(), 8, sys::UCS_OK, 5), 5);
        assert_eq!(ended(spare(), 8, sys::UCS_OK, 9), 0, "past the capacity");
        let truncated = sys::UCS_ERR_MESSAGE_TRUNCATED;
        assert_eq!(ended(spare(), 8, truncated, 4), 0, "failed");
        assert_eq!(
            ended(vec![1; 8], 8, sys::UCS_OK, 3),
            8,
            "already initialised"
        );
        assert!(RecvBuffer::new(Vec::with_capacity(4), 8).is_err());
    }
}
