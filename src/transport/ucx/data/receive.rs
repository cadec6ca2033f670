//! The receiving side of the UCX data plane: the receives a receiver keeps posted on its
//! workers (`Posting`), the chunks and device payloads they take (`UcxReceiver`), and placed
//! runs received at their place in the pool (`UcxPlacer`). The module above says how chunks
//! travel.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::{CHUNK_MASK, DEVICE_PAYLOAD_WAIT, Tags, placed_tag, shares};
use crate::transport::ucx::region::{OnDevice, of_pool};
use crate::transport::ucx::settings::eager;
use crate::transport::ucx::{RegisterableMemory, UcxWorker};
use crate::transport::{
    BoxFuture, DataReceiver, DeviceSink, Frame, Landing, Payload, Placer, PoolMemory, Receives,
    RecvBuffers, RemoteMemory, Span, TransportError,
};

pub(super) struct UcxReceiver {
    pub(super) posting: Arc<Posting>,
    /// What the posted receives got, with the generation they were posted in and their worker.
    pub(super) arrivals: tokio::sync::mpsc::UnboundedReceiver<Arrival>,
    /// Where device payloads land ([`DataReceiver::land_on_device`]); without it a chunk
    /// sent from device memory is refused.
    pub(super) device: Option<Arc<dyn DeviceSink>>,
    /// Largest payload accepted.
    pub(super) max_chunk: usize,
}

impl UcxReceiver {
    /// The payload of a chunk sent from device memory, whose header message came to worker
    /// `w` with `trailer`: received from the sender's device staging straight into a buffer
    /// of the sink; refused without one (this agent stages on the host).
    async fn device_payload(&self, w: usize, trailer: Bytes) -> Result<Payload, TransportError> {
        let fail = |m: String| TransportError::new("recv_device", "ucx", m);
        let (len, key) = match trailer.get(..16) {
            Some(t) if trailer.len() == 16 => {
                let word = |i: usize| t.get(i..i + 8).and_then(|b| b.try_into().ok());
                match (word(0), word(8)) {
                    (Some(len), Some(key)) => (u64::from_le_bytes(len), u64::from_le_bytes(key)),
                    _ => return Err(fail("a device chunk's trailer is malformed".into())),
                }
            }
            _ => return Err(fail("a device chunk's trailer is not 16 bytes".into())),
        };
        let key = match u32::try_from(key) {
            Ok(key) if key >= 4 => key,
            _ => {
                return Err(fail(format!(
                    "a device chunk's key {key:#x} is not one of 4..2^32"
                )));
            }
        };
        if len > self.max_chunk as u64 {
            return Err(fail(format!(
                "a device payload of {len} bytes exceeds the {}-byte chunk",
                self.max_chunk
            )));
        }
        let worker = self
            .posting
            .workers
            .get(w)
            .ok_or_else(|| fail("no such worker".into()))?;
        // Only a receiver that lands on the device takes device payloads. Waiting here for a
        // payload behind its header holds the receive loop (every peer's chunks) until it
        // comes: a receiver staging on the host (every receiver where UCX has no CUDA) must
        // not offer that to whoever reaches its port, so it refuses the header at once.
        let Some(sink) = &self.device else {
            return Err(fail(
                "a chunk sent from device memory, to a receiver that stages on the host (both \
                 sides need device staging)"
                    .into(),
            ));
        };
        let buf = sink.take(len as usize).map_err(fail)?;
        let cancel = tokio_util::sync::CancellationToken::new();
        let memory: Arc<dyn RegisterableMemory> = Arc::new(OnDevice(buf.clone()));
        let landing = worker
            .recv_runs(
                self.posting.tags.device_payload(key),
                memory,
                vec![vec![Span { offset: 0, len }]],
                cancel.clone(),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        tokio::pin!(landing);
        let landed = tokio::select! {
            r = &mut landing => r,
            () = tokio::time::sleep(DEVICE_PAYLOAD_WAIT) => {
                // Cancelled; the progress thread keeps the buffer until UCX lets go of it, so
                // the wait for that is bounded (a receive that matched a dead sender's message
                // may never end).
                cancel.cancel();
                let _ = tokio::time::timeout(DEVICE_PAYLOAD_WAIT, landing).await;
                return Err(fail(format!("no device payload within {DEVICE_PAYLOAD_WAIT:?}")));
            }
        };
        landed.map_err(|e| fail(e.to_string()))?;
        Ok(Payload::Device(buf))
    }
}

/// A posted receive's end: (generation, worker index, what it got).
type Arrival = (
    u64,
    usize,
    Result<crate::transport::ucx::Received, crate::transport::ucx::UcxError>,
);

/// Receives kept posted with no sender: more than the credits one sender holds (8 by default).
pub(super) const RECEIVES_AHEAD: usize = 16;

/// The chunk receives a [`UcxReceiver`] keeps posted on each of its workers: `RECEIVES_AHEAD`
/// plus every sender's granted slots, so that no chunk arrives before a receive for it is
/// posted, whichever worker its sender picks. A chunk sent as one contiguous message goes by
/// rendezvous; one that waited unexpected at UCX 1.13 while its sender died aborted the
/// receiving process once a receive matched it. A posted receive reserves its buffer's
/// address space; the pages are touched only by a chunk landing there.
pub(super) struct Posting {
    /// The receiver's tags: chunks come under [`Tags::chunk`].
    pub(super) tags: Tags,
    /// Every worker of the receiver: each takes chunks and pulls placed runs; the first one
    /// exposes the pool.
    pub(super) workers: Vec<UcxWorker>,
    pub(super) capacity: usize,
    pub(super) state: Mutex<Posted>,
    pub(super) landed: tokio::sync::mpsc::UnboundedSender<Arrival>,
    /// The agent's buffers chunks land in ([`DataReceiver::receive_into`]; UCX's own
    /// allocations when `None`).
    pub(super) buffers: Mutex<Option<Arc<dyn RecvBuffers>>>,
}

pub(super) struct Posted {
    /// Receives wanted posted on each worker.
    pub(super) wanted: usize,
    /// Per worker, receives posted in this generation and not landed yet.
    pub(super) open: Vec<usize>,
    /// Bumped by a reset, which drops every receive posted before.
    pub(super) generation: u64,
    /// The posted receives (dropping one cancels its receive).
    pub(super) tasks: tokio::task::JoinSet<()>,
}

impl Posting {
    fn state(&self) -> std::sync::MutexGuard<'_, Posted> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Posts receives up to the wanted number on every worker; each is queued at its worker
    /// before this returns.
    fn post(&self) {
        let buffers = self
            .buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut state = self.state();
        for (w, worker) in self.workers.iter().enumerate() {
            while state.open[w] < state.wanted {
                state.open[w] += 1;
                let receive = worker.post_recv_tag_into(
                    self.tags.chunk(),
                    CHUNK_MASK,
                    self.capacity,
                    buffers.clone(),
                );
                let (landed, generation) = (self.landed.clone(), state.generation);
                state.tasks.spawn(async move {
                    let _ = landed.send((generation, w, receive.await));
                });
            }
        }
    }

    /// One receive of `generation` on worker `w` landed.
    fn landed(&self, generation: u64, w: usize) {
        let mut state = self.state();
        if generation == state.generation
            && let Some(open) = state.open.get_mut(w)
        {
            *open = open.saturating_sub(1);
        }
        state.tasks.try_join_next();
    }

    /// Drops every posted receive (those a dead sender left half-matched never complete) and
    /// posts fresh ones at once: they are queued before the old ones are cancelled, so no
    /// chunk finds none posted meanwhile.
    fn reset(&self) {
        {
            let mut state = self.state();
            state.tasks.abort_all();
            state.tasks.detach_all();
            state.generation += 1;
            state.open.iter_mut().for_each(|open| *open = 0);
        }
        self.post();
    }
}

impl Receives for Posting {
    fn grant(&self, slots: usize) -> BoxFuture<'static, Result<(), TransportError>> {
        self.state().wanted += slots;
        self.post();
        let workers = self.workers.clone();
        Box::pin(async move {
            for worker in workers {
                worker
                    .ping()
                    .await
                    .map_err(|e| TransportError::new("post receives", "ucx", e))?;
            }
            Ok(())
        })
    }

    fn release(&self, slots: usize) {
        let mut state = self.state();
        state.wanted = state.wanted.saturating_sub(slots).max(RECEIVES_AHEAD);
    }
}

impl DataReceiver for UcxReceiver {
    fn recv(&mut self) -> BoxFuture<'_, Result<(Bytes, Bytes), TransportError>> {
        Box::pin(async move {
            match self.recv_payload().await? {
                (header, Payload::Host(payload)) => Ok((header, payload)),
                // UCX receives a host chunk into one buffer.
                (_, Payload::Pieces(_)) | (_, Payload::Device(_)) => Err(TransportError::new(
                    "recv",
                    "ucx",
                    "a chunk sent from device memory, to a caller that takes host memory",
                )),
            }
        })
    }

    fn recv_payload(&mut self) -> BoxFuture<'_, Result<(Bytes, Payload), TransportError>> {
        Box::pin(async move {
            self.posting.post();
            let Some((generation, w, got)) = self.arrivals.recv().await else {
                return Err(TransportError::new("recv", "ucx", "no receives posted"));
            };
            self.posting.landed(generation, w);
            let got = got.map_err(|e| TransportError::new("recv", "ucx", e))?;
            let (tag, split) = (got.tag, Frame::split(got.data));
            let (header, rest) = split.ok_or_else(|| {
                TransportError::new(
                    "recv",
                    "ucx",
                    "a chunk message must be a length-prefixed header and a payload",
                )
            })?;
            let tags = self.posting.tags;
            match tag {
                // The payload follows its header at once (queued together): the next chunk
                // waits for it. A sender dead in between holds this receive until the agent
                // resets the receiver for the dead peer (dropping this future; the progress
                // thread keeps the device buffer until UCX lets go of it), or 30 s.
                t if t == tags.device_chunk() => Ok((header, self.device_payload(w, rest).await?)),
                t if t == tags.chunk() => Ok((header, Payload::Host(rest))),
                other => Err(TransportError::new(
                    "recv",
                    "ucx",
                    format!("a message under tag {other:#x} is no chunk"),
                )),
            }
        })
    }

    fn land_on_device(&mut self, sink: Arc<dyn DeviceSink>) -> Result<(), TransportError> {
        let Some(worker) = self.posting.workers.first() else {
            return Err(TransportError::new("land_on_device", "ucx", "no worker"));
        };
        if !worker.sends_device_memory() {
            return Err(TransportError::new(
                "land_on_device",
                "ucx",
                "UCX has no CUDA memory support here",
            ));
        }
        self.device = Some(sink);
        Ok(())
    }

    fn receive_into(&mut self, buffers: Arc<dyn RecvBuffers>) -> bool {
        // Receives posted from now on land there (those already posted keep their own).
        *self
            .posting
            .buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(buffers);
        true
    }

    fn reset(&mut self) {
        // Dropping the tasks cancels their receives.
        self.posting.reset();
    }

    fn receives(&self) -> Option<Arc<dyn Receives>> {
        Some(self.posting.clone())
    }

    fn placer(&self) -> Option<Arc<dyn Placer>> {
        Some(Arc::new(UcxPlacer {
            workers: self.posting.workers.clone(),
        }))
    }

    fn expose(
        &mut self,
        pool: PoolMemory,
    ) -> BoxFuture<'_, Result<Option<RemoteMemory>, TransportError>> {
        Box::pin(async move {
            let Some(first) = self.posting.workers.first() else {
                return Ok(None);
            };
            let registered = first
                .register(of_pool(pool))
                .await
                .map_err(|e| TransportError::new("register", "decode pool", e))?;
            Ok(Some(RemoteMemory {
                base: registered.base,
                size: registered.size,
                key: registered.rkey.to_vec(),
            }))
        })
    }
}

/// Receives placed runs straight into a pool: UCX's rendezvous moves each one (by a cma read
/// over shared memory, an RDMA read elsewhere) into the receive posted at its place, the
/// chunk's runs shared out over the receiver's workers ([`shares`]) so that they are pulled in
/// parallel.
struct UcxPlacer {
    workers: Vec<UcxWorker>,
}

impl Placer for UcxPlacer {
    /// Eager workers land runs through the unpack callback a cancel revokes (`Revocable`).
    fn revocable(&self) -> bool {
        eager()
    }

    fn place(
        &self,
        pool: PoolMemory,
        key: u64,
        places: Vec<Vec<Span>>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> BoxFuture<'static, Result<Landing, TransportError>> {
        let workers = self.workers.clone();
        let pool = of_pool(pool);
        let fail = |e| TransportError::new("place", "ucx", e);
        Box::pin(async move {
            // One failed share cancels the others; a cancelled chunk cancels them all.
            let shared = cancel.child_token();
            let mut landings = tokio::task::JoinSet::new();
            for (share, worker) in shares(places.len(), workers.len())
                .into_iter()
                .zip(&workers)
            {
                let tag = placed_tag(key) + share.start as u64;
                let runs = places[share].to_vec();
                match worker
                    .recv_runs(tag, pool.clone(), runs, shared.clone())
                    .await
                {
                    Ok(landing) => {
                        landings.spawn(landing);
                    }
                    Err(e) => {
                        // Those posted already must still let go of the pool first.
                        shared.cancel();
                        while landings.join_next().await.is_some() {}
                        return Err(fail(e));
                    }
                }
            }
            let landing: Landing = Box::pin(async move {
                let mut result = Ok(());
                while let Some(done) = landings.join_next().await {
                    let done = done.map_err(|e| {
                        TransportError::new("place", "ucx", format!("landing stopped: {e}"))
                    });
                    if let Err(e) = done.and_then(|r| r.map_err(fail)) {
                        shared.cancel();
                        result = result.and(Err(e));
                    }
                }
                result
            });
            Ok(landing)
        })
    }
}
