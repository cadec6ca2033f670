//! Staging slots: the buffers a sender gathers chunks into, reused from chunk to chunk.
//!
//! A slot leaves the pool as a `Bytes` handed to the transport and comes back when the
//! transport drops it (the bytes are on the wire), so a steady transfer allocates nothing and
//! touches no fresh memory. How many slots exist at once is bounded by the credits of the peer
//! pair (see `prefill.rs`), not by this pool.
//!
//! A device pool's slots are pinned (page-locked and known to the driver, [`Pinner`]): the
//! copy of a gathered chunk from device staging into its slot then runs at the bus's speed,
//! with no bounce through the driver's own buffers. A slot is pinned once, when allocated, and
//! unpinned before its memory is freed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// Pins host memory for a device's copies, and unpins it.
pub(crate) trait Pinner: Send + Sync + std::fmt::Debug {
    /// Pins `len` bytes at `addr`; an error leaves them pageable (copies still work, slower).
    fn pin(&self, addr: usize, len: usize) -> Result<(), String>;
    /// Unpins memory [`Pinner::pin`] pinned at `addr`.
    fn unpin(&self, addr: usize);
}

/// Free staging buffers of one agent.
#[derive(Debug, Default)]
pub(crate) struct SlotPool {
    free: Mutex<Vec<Vec<u8>>>,
    /// Pins every buffer this pool allocates, when its chunks are copied from a device.
    pinner: Option<Arc<dyn Pinner>>,
    /// Addresses of the buffers pinned (a refused pin leaves a buffer out).
    pinned: Mutex<HashSet<usize>>,
}

impl SlotPool {
    /// A pool whose buffers `pinner` pins.
    pub(crate) fn pinned(pinner: Arc<dyn Pinner>) -> Self {
        SlotPool {
            free: Mutex::default(),
            pinner: Some(pinner),
            pinned: Mutex::default(),
        }
    }

    /// A buffer of exactly `len` bytes (contents unspecified: the gather overwrites them all).
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut buf = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        if let Some(pinner) = &self.pinner {
            // A pinned buffer never grows in place: it is replaced, unpinned first.
            if buf.capacity() < len {
                self.unpin(pinner.as_ref(), &buf);
                buf = Vec::with_capacity(len);
                match pinner.pin(buf.as_ptr() as usize, buf.capacity()) {
                    Ok(()) => {
                        self.pinned_set().insert(buf.as_ptr() as usize);
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        bytes = len,
                        "a staging slot stays pageable: pinning it failed"
                    ),
                }
            }
        }
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

    fn pinned_set(&self) -> std::sync::MutexGuard<'_, HashSet<usize>> {
        self.pinned.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unpin(&self, pinner: &dyn Pinner, buf: &[u8]) {
        if buf.as_ptr() as usize != 0 && self.pinned_set().remove(&(buf.as_ptr() as usize)) {
            pinner.unpin(buf.as_ptr() as usize);
        }
    }

    /// Buffers waiting for reuse.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for SlotPool {
    fn drop(&mut self) {
        // Every slot is back (each holds the pool): unpin them all before they are freed.
        if let Some(pinner) = self.pinner.clone() {
            let free = std::mem::take(&mut *self.free.lock().unwrap_or_else(|e| e.into_inner()));
            for buf in &free {
                self.unpin(pinner.as_ref(), buf);
            }
        }
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

    /// Records what is pinned.
    #[derive(Debug, Default)]
    struct Pins(Mutex<Vec<(usize, usize)>>);

    impl Pinner for Pins {
        fn pin(&self, addr: usize, len: usize) -> Result<(), String> {
            self.0.lock().unwrap().push((addr, len));
            Ok(())
        }
        fn unpin(&self, addr: usize) {
            let mut pins = self.0.lock().unwrap();
            let at = pins
                .iter()
                .position(|p| p.0 == addr)
                .expect("unpinned what was never pinned");
            pins.remove(at);
        }
    }

    #[test]
    fn pinned_slots_are_pinned_once_replaced_unpinned_and_unpinned_with_the_pool() {
        let pins = Arc::new(Pins::default());
        let pool = Arc::new(SlotPool::pinned(pins.clone()));
        let a = pool.take(1000);
        let a_addr = a.as_ptr() as usize;
        assert_eq!(*pins.0.lock().unwrap(), vec![(a_addr, a.capacity())]);
        drop(pool.bytes(a));
        // Reused as is for a smaller chunk: no new pin.
        let b = pool.take(600);
        assert_eq!(
            (b.as_ptr() as usize, pins.0.lock().unwrap().len()),
            (a_addr, 1)
        );
        drop(pool.bytes(b));
        // A larger chunk replaces the buffer: the old one is unpinned first.
        let c = pool.take(5000);
        let c_addr = c.as_ptr() as usize;
        assert_eq!(*pins.0.lock().unwrap(), vec![(c_addr, c.capacity())]);
        let held = pool.bytes(c);
        drop(pool);
        assert_eq!(
            pins.0.lock().unwrap().len(),
            1,
            "a slot the transport holds stays pinned"
        );
        drop(held);
        assert!(
            pins.0.lock().unwrap().is_empty(),
            "the last slot back unpins everything"
        );
    }

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
