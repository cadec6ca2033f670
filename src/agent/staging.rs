//! Staging: where a pool's chunks wait for the transport ([`StagingMode`], chosen once at start),
//! and the slots, the host buffers chunks are gathered into and received in, reused from chunk
//! to chunk.
//!
//! A device pool's chunks are staged in device memory when the transport sends device memory
//! (UCX built with CUDA, found at run time: [`crate::transport::Transport::device_memory`]),
//! and in pinned host memory otherwise: gathered on the device, one D2H, sent, received into
//! a pinned buffer, one H2D, scattered. The choice is logged with its reason and labels
//! `kvferry_pool_info{staging}`.
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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::memory::MemoryKind;
use crate::transport::DeviceMemory;

/// Where an agent's chunks are staged for the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagingMode {
    /// A host pool: chunks are gathered into host buffers (or sent from the pool).
    Host,
    /// A device pool over a transport that sends host memory: gathered on the device, one D2H
    /// into a pinned host buffer; received into a pinned buffer, one H2D, scattered.
    PinnedHost,
    /// A device pool over a transport that sends device memory: gathered into device staging
    /// and sent from there; received into device staging and scattered from there.
    Device,
}

impl StagingMode {
    /// The `staging` label of `kvferry_pool_info` and the log.
    pub fn label(self) -> &'static str {
        match self {
            StagingMode::Host => "host",
            StagingMode::PinnedHost => "pinned_host",
            StagingMode::Device => "device",
        }
    }
}

/// `--staging`: what the operator asks for a device pool's staging.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum StagingChoice {
    /// Device staging where the transport sends device memory, pinned host staging otherwise.
    #[default]
    Auto,
    /// Pinned host staging, whatever the transport can.
    PinnedHost,
    /// Device staging; the agent refuses to start when the transport cannot send device
    /// memory.
    Device,
}

impl StagingChoice {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            StagingChoice::Auto => "auto",
            StagingChoice::PinnedHost => "pinned-host",
            StagingChoice::Device => "device",
        }
    }
}

/// A staging the agent cannot serve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StagingError {
    /// `--staging device` over a transport that sends host memory only.
    #[error("--staging device: the {transport} transport cannot send device memory: {reason}")]
    DeviceUnsupported {
        /// The transport's name.
        transport: String,
        /// Why (the transport's own words).
        reason: String,
    },
    /// `--staging device` with a pool in host memory.
    #[error("--staging device needs a device pool; this pool is host memory")]
    HostPool,
    /// `--staging device` with per-chunk checksums: refused rather than hashing device staging
    /// through host copies behind the operator's back.
    #[error(
        "--staging device with --checksum: device staging is hashed through a copy to host \
         memory; refused so that the choice is explicit (use --staging auto)"
    )]
    Checksum,
}

/// The staging of a pool in `memory` over a transport that says `device` of itself, as
/// `choice` asks, with the reason for the log.
pub(crate) fn choose(
    memory: MemoryKind,
    choice: StagingChoice,
    transport: &str,
    device: &DeviceMemory,
    checksum: bool,
) -> Result<(StagingMode, String), StagingError> {
    match (memory, choice, device) {
        (MemoryKind::Host, StagingChoice::Device, _) => Err(StagingError::HostPool),
        (MemoryKind::Host, _, _) => Ok((StagingMode::Host, "the pool is host memory".to_owned())),
        (_, StagingChoice::PinnedHost, _) => {
            Ok((StagingMode::PinnedHost, "--staging pinned-host".to_owned()))
        }
        (_, StagingChoice::Device, DeviceMemory::HostOnly(reason)) => {
            Err(StagingError::DeviceUnsupported {
                transport: transport.to_owned(),
                reason: reason.clone(),
            })
        }
        (_, StagingChoice::Device, DeviceMemory::Sends) if checksum => Err(StagingError::Checksum),
        (_, StagingChoice::Auto, DeviceMemory::HostOnly(reason)) => {
            Ok((StagingMode::PinnedHost, reason.clone()))
        }
        // Per-chunk checksums hash host bytes: with them, staging stays on the host, where the
        // bytes are hashed anyway, rather than copying every chunk out of the device to hash it.
        (_, StagingChoice::Auto, DeviceMemory::Sends) if checksum => Ok((
            StagingMode::PinnedHost,
            format!("{transport} sends device memory, but --checksum hashes host bytes"),
        )),
        (_, _, DeviceMemory::Sends) => Ok((
            StagingMode::Device,
            format!("{transport} sends device memory"),
        )),
    }
}

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
    /// Addresses of the buffers pinned, with their bytes (a refused pin leaves a buffer out).
    pinned: Mutex<HashMap<usize, usize>>,
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
                        self.pinned_set()
                            .insert(buf.as_ptr() as usize, buf.capacity());
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

    fn pinned_set(&self) -> std::sync::MutexGuard<'_, HashMap<usize, usize>> {
        self.pinned.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unpin(&self, pinner: &dyn Pinner, buf: &[u8]) {
        let addr = buf.as_ptr() as usize;
        if addr != 0 && self.pinned_set().remove(&addr).is_some() {
            pinner.unpin(addr);
        }
    }

    /// Bytes of the buffers pinned now (`kvferry_staging_pinned_bytes`).
    pub(crate) fn pinned_bytes(&self) -> usize {
        self.pinned_set().values().sum()
    }

    /// Buffers waiting for reuse.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// A decode lands received chunks in the same pinned buffers ([`crate::transport::RecvBuffers`]).
impl crate::transport::RecvBuffers for SlotPool {
    fn take(&self, len: usize) -> Vec<u8> {
        SlotPool::take(self, len)
    }

    fn freeze(self: Arc<Self>, buf: Vec<u8>) -> Bytes {
        self.bytes(buf)
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
        assert_eq!(pool.pinned_bytes(), a.capacity());
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
    fn a_device_pool_stages_on_the_device_only_where_the_transport_sends_device_memory() {
        let device = MemoryKind::Device { ordinal: 0 };
        let no_cuda = DeviceMemory::HostOnly("UCX has no CUDA memory support".into());
        let (auto, pinned, forced) = (
            StagingChoice::Auto,
            StagingChoice::PinnedHost,
            StagingChoice::Device,
        );
        // Without device memory in the transport: pinned host staging, for its reason.
        assert_eq!(
            choose(device, auto, "ucx", &no_cuda, false),
            Ok((
                StagingMode::PinnedHost,
                "UCX has no CUDA memory support".into()
            ))
        );
        // Forced device staging there is refused, typed, with the transport's words.
        assert_eq!(
            choose(device, forced, "ucx", &no_cuda, false),
            Err(StagingError::DeviceUnsupported {
                transport: "ucx".into(),
                reason: "UCX has no CUDA memory support".into()
            })
        );
        // With it: device staging, unless asked otherwise or checksummed.
        let sends = DeviceMemory::Sends;
        let chosen = |choice, checksum| choose(device, choice, "ucx", &sends, checksum);
        assert_eq!(chosen(auto, false).map(|c| c.0), Ok(StagingMode::Device));
        assert_eq!(chosen(forced, false).map(|c| c.0), Ok(StagingMode::Device));
        assert_eq!(
            chosen(pinned, false).map(|c| c.0),
            Ok(StagingMode::PinnedHost)
        );
        assert_eq!(chosen(auto, true).map(|c| c.0), Ok(StagingMode::PinnedHost));
        assert_eq!(chosen(forced, true), Err(StagingError::Checksum));
        // Host pools stage on the host; device staging of one is refused.
        for d in [&sends, &no_cuda] {
            assert_eq!(
                choose(MemoryKind::Host, auto, "ucx", d, false).map(|c| c.0),
                Ok(StagingMode::Host)
            );
            assert_eq!(
                choose(MemoryKind::Host, forced, "ucx", d, false),
                Err(StagingError::HostPool)
            );
        }
        assert_eq!(
            (StagingMode::PinnedHost.label(), StagingMode::Device.label()),
            ("pinned_host", "device")
        );
        let refused = choose(device, forced, "zmq-tcp", &no_cuda, false).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("zmq-tcp transport cannot send device memory"),
            "{refused}"
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
