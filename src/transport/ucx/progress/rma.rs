//! The progress thread's one-sided side: registrations of local memory, peers' regions
//! (unpacked remote keys with their bounds), and puts into them, bounds-checked on both sides
//! before anything starts.

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;

use super::Engine;
use super::op::{Op, Pending, PutSource};
use crate::memory::{Span, WriteRun};
use crate::transport::ucx::command::{EndpointId, MemId, Registered, RemoteRegionId, Reply};
use crate::transport::ucx::memory_type::MemoryType;
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::result::UcxError;
use crate::transport::ucx::safe::{MemHandle, MemoryRange, RemoteKey, Source, Started};

/// A peer's registered memory: its endpoint's id and the key unpacked for that endpoint with
/// the region's bounds (the key holds the endpoint). Each put into it holds the key too (its
/// request does), so the key is destroyed only once the region is gone and no put that uses
/// it is queued: a disconnect, a dead peer or shutdown drops the region while an unsupervised
/// endpoint closes by flushing, and puts still queued on it keep reading the key until they
/// complete.
pub(super) struct RemoteRegion {
    pub(super) ep: EndpointId,
    pub(super) key: Rc<RemoteKey>,
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
        // A key is unpacked only for a kind of memory this context writes: a device key maps
        // the peer's memory into this process as it unpacks.
        let kind = crate::transport::ucx::packed::rkey_memory_type(rkey)?;
        self.worker.moves("add_remote_region", kind)?;
        let endpoint = self.endpoint("add_remote_region", ep)?;
        let key = Rc::new(RemoteKey::unpack(&endpoint, rkey, base, size)?);
        let id = self.id();
        self.remote.insert(id, RemoteRegion { ep, key });
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
        let (ep, key) = (r.ep, r.key.clone());
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
            for (offset, size) in [(run.src, local), (run.dst, key.size())] {
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
        for (i, run) in runs.iter().enumerate() {
            let from = match source {
                // Within the bytes: checked above.
                PutSource::Bytes(b) => {
                    Source::Bytes(b.slice(run.src as usize..(run.src + run.len) as usize))
                }
                PutSource::Memory(m) => Source::Memory(MemoryRange::new(
                    m.clone(),
                    Span {
                        offset: run.src,
                        len: run.len,
                    },
                )?),
            };
            let started = key
                .put(from, run.dst)
                .map_err(|(e, _)| self.failure_of("put", ep, e))?;
            let reply = match i + 1 == runs.len() {
                true => reply.take(),
                false => None,
            };
            match started {
                Started::Pending(request) => {
                    self.insert(Pending::new(Some(ep), Op::Put { request, reply }))
                }
                Started::Done(_) => {
                    if let Some(reply) = reply {
                        let _ = reply.send(Ok(()));
                    }
                }
            }
        }
        Ok(ep)
    }
}
