//! The progress thread's one-sided side: registrations of local memory, peers' regions
//! (unpacked remote keys with their bounds), and puts into them, bounds-checked on both sides
//! before anything starts.

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;

use super::Engine;
use super::op::{Op, PutSource};
use crate::memory::WriteRun;
use crate::transport::ucx::command::{EndpointId, MemId, Registered, RemoteRegionId, Reply};
use crate::transport::ucx::memory_type::MemoryType;
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::result::UcxError;
use crate::transport::ucx::safe::{MemHandle, RemoteKey};

/// A peer's registered memory: its endpoint's id, the key unpacked for that endpoint (which
/// holds the endpoint) and the bounds. Each put
/// into it holds the key too (`Op::Put`), so the key is destroyed only once the region is gone
/// and no put that uses it is queued: a disconnect, a dead peer or shutdown drops the region
/// while an unsupervised endpoint closes by flushing, and puts still queued on it keep reading
/// the key until they complete.
pub(super) struct RemoteRegion {
    pub(super) ep: EndpointId,
    pub(super) key: Rc<RemoteKey>,
    pub(super) base: u64,
    pub(super) size: u64,
}

impl Engine {
    pub(super) fn register(
        &mut self,
        memory: Arc<dyn RegisterableMemory>,
    ) -> Result<Registered, UcxError> {
        let (base, size) = (memory.base(), memory.size());
        self.movable("register", memory.as_ref())?;
        let handle = MemHandle::map(&self.context, memory)?;
        let rkey = handle.rkey()?;
        let id = self.id();
        self.registered.insert(id, handle);
        Ok(Registered {
            id: MemId(id),
            base: base as u64,
            size: size as u64,
            rkey: Bytes::from(rkey),
        })
    }

    pub(super) fn unregister(&mut self, id: MemId) -> Result<(), UcxError> {
        // Dropping the handle unmaps the memory before it lets the memory go.
        self.registered.remove(&id.0).ok_or(UcxError::Unknown {
            what: "memory",
            id: id.0,
        })?;
        Ok(())
    }

    pub(super) fn add_remote(
        &mut self,
        ep: EndpointId,
        base: u64,
        size: u64,
        rkey: &[u8],
    ) -> Result<RemoteRegionId, UcxError> {
        if !self.context.rma() {
            return Err(UcxError::NoRma);
        }
        let endpoint = self.endpoint("add_remote_region", ep)?;
        if base.checked_add(size).is_none() {
            return Err(UcxError::OutOfBounds {
                offset: base,
                len: 0,
                size,
            });
        }
        let key = Rc::new(RemoteKey::unpack(&endpoint, rkey)?);
        let id = self.id();
        let region = RemoteRegion {
            ep,
            key,
            base,
            size,
        };
        self.remote.insert(id, region);
        Ok(RemoteRegionId(id))
    }

    /// Starts a put of every run from `source` into `region`, after checking every run
    /// against both; returns the region's endpoint (to flush). `reply`, if given, is answered
    /// by the last put's completion, or at once with the error.
    pub(super) fn start_puts(
        &mut self,
        region: RemoteRegionId,
        source: PutSource,
        runs: &[WriteRun],
        mut reply: Option<Reply<()>>,
    ) -> Result<EndpointId, UcxError> {
        let started = self.try_start_puts(region, &source, runs, &mut reply);
        if let (Err(e), Some(reply)) = (&started, reply) {
            let _ = reply.send(Err(e.clone()));
        }
        started
    }

    // Lends UCX buffers that stay in the operation's `Pending` entry until its request ends.
    #[allow(unsafe_code)]
    fn try_start_puts(
        &mut self,
        region: RemoteRegionId,
        source: &PutSource,
        runs: &[WriteRun],
        reply: &mut Option<Reply<()>>,
    ) -> Result<EndpointId, UcxError> {
        let r = self.remote.get(&region.0).ok_or(UcxError::Unknown {
            what: "remote region",
            id: region.0,
        })?;
        let (ep, remote_size) = (r.ep, r.size);
        if let PutSource::Memory(m) = source
            && m.memory_type() != MemoryType::Host
        {
            return Err(UcxError::MemoryType {
                op: "put",
                memory: m.memory_type(),
                why: "puts go from host memory only",
            });
        }
        let local = source.size() as u64;
        for run in runs {
            for (offset, size) in [(run.src, local), (run.dst, remote_size)] {
                if offset.checked_add(run.len).is_none_or(|end| end > size) {
                    return Err(UcxError::OutOfBounds {
                        offset,
                        len: run.len as usize,
                        size,
                    });
                }
            }
        }
        self.endpoint("put", ep)?;
        let (key, remote_base) = (r.key.clone(), r.base);
        for (i, run) in runs.iter().enumerate() {
            // SAFETY: `source` stays readable for its whole size for as long as it, or a share
            // of it (kept in each put's Pending entry until completion), lives; both ranges
            // were checked above (remote base+size does not overflow: checked when the region
            // was added); the key lives in the put's Pending entry until it completes.
            let started = unsafe {
                key.put(
                    source.base().add(run.src as usize),
                    run.len as usize,
                    remote_base + run.dst,
                )
            }
            .map_err(|e| self.failure_of("put", ep, e))?;
            let op = Op::Put {
                _key: key.clone(),
                _data: source.share(),
                reply: if i + 1 == runs.len() {
                    reply.take()
                } else {
                    None
                },
            };
            self.track(started, Some(ep), op);
        }
        Ok(ep)
    }
}
