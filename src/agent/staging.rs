//! Staging slots: the buffers a sender gathers chunks into, reused from chunk to chunk.
//!
//! A slot leaves the pool as a `Bytes` handed to the transport and comes back when the
//! transport drops it (the bytes are on the wire), so a steady transfer allocates nothing and
//! touches no fresh memory. How many slots exist at once is bounded by the credits of the peer
//! pair (see `prefill.rs`), not by this pool.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// Free staging buffers of one agent.
#[derive(Debug, Default)]
pub(crate) struct SlotPool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl SlotPool {
    /// A buffer of exactly `len` bytes (contents unspecified: the gather overwrites them all).
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut buf = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        buf.resize(len, 0);
        buf
    }

    /// Hands `buf` to the transport; it returns to this pool when the transport drops it.
    pub(crate) fn bytes(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Slot {
            buf,
            pool: self.clone(),
        })
    }

    /// Buffers waiting for reuse.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

struct Slot {
    buf: Vec<u8>,
    pool: Arc<SlotPool>,
}

impl AsRef<[u8]> for Slot {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        self.pool
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_when_the_transport_drops_them() {
        let pool = Arc::new(SlotPool::default());
        let mut buf = pool.take(1024);
        buf[..3].copy_from_slice(b"abc");
        let addr = buf.as_ptr();
        let bytes = pool.bytes(buf);
        let clone = bytes.clone();
        assert_eq!(&bytes[..3], b"abc");
        drop(bytes);
        assert_eq!(pool.idle(), 0, "a clone still holds the slot");
        drop(clone);
        assert_eq!(pool.idle(), 1);
        let again = pool.take(512);
        assert_eq!(
            (again.len(), again.as_ptr()),
            (512, addr),
            "the same memory is reused"
        );
    }
}
