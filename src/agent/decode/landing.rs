//! Landing chunks: every chunk is checked against its room before a byte moves (known room,
//! the epoch it was requested from, ranges within the request, nothing landed twice, the
//! payload length and, with checksums, its xxh3), scattered into the pool on a blocking
//! thread, and its staging slot returned to the prefill as a credit.
//!
//! A direct chunk (`Chunk.direct`) carries no payload: the prefill wrote its bytes into the
//! pool and flushed them before sending the header. A placed chunk (`Chunk.placed`) carries
//! none either: its runs follow as messages, which this agent receives straight into the
//! places it computes from its own layout (`kernel::cpu::placements`), and which it cancels if
//! the room ends first; the chunk holds the room's pages (`scattering`) until the transport
//! has let go of them. Both are checked like a staged chunk, their checksum computed over the
//! pool in place, and counted without a scatter.
//!
//! Which buffers a staged chunk is received into, by the pool's staging, is set once at start
//! ([`land_where_staged`]).

use crate::agent::StagingMode;
use crate::agent::agent_pool::AgentPool;
use crate::agent::decode::Decode;
use crate::agent::room::RoomState;
use crate::agent::staging::SlotPool;
use crate::kernel::Selection;
use crate::layout::PageOrder;
use crate::protocol::Placed;
use crate::protocol::{self, Chunk, Message};
use crate::reason::{FailureCode, Reason};
use crate::transport::Payload;
use crate::transport::{self, DataReceiver};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// A chunk admitted for scattering: the room's pages, the destination selection (its page
/// list filled in on the blocking thread) and the wire order.
pub(super) struct Admitted {
    pub(super) pages: Arc<[u32]>,
    pub(super) sel: Selection<'static>,
    pub(super) wire: PageOrder,
    /// Index of the room's source the chunk belongs to.
    pub(super) source: usize,
}

/// Scatters running at once: receiving chunk i+1 overlaps the scatter of chunk i, and a slow
/// pool stops the receive loop (and so the sender) instead of queueing without bound.
pub(super) const SCATTERS_IN_FLIGHT: usize = 2;

pub(super) async fn receive_chunks(inner: Arc<Decode>, mut receiver: Box<dyn DataReceiver>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(SCATTERS_IN_FLIGHT));
    loop {
        let received = tokio::select! {
            () = inner.shutdown.cancelled() => return,
            () = inner.recv_reset.notified() => {
                tracing::debug!("data receives restarted after a peer died");
                receiver.reset();
                continue;
            }
            r = receiver.recv_payload() => r,
        };
        match received {
            Ok((header, payload)) => {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let inner = inner.clone();
                tokio::spawn(async move {
                    inner.on_chunk(header, payload).await;
                    drop(slot);
                });
            }
            Err(e) => inner.bad_message("bad_frames", e.to_string()),
        }
    }
}

impl Decode {
    /// Validates a chunk against its room and reserves it; returns what the scatter needs.
    pub(super) fn admit_chunk(
        &self,
        c: &Chunk,
        payload_len: usize,
    ) -> Result<Admitted, Option<Reason>> {
        let mut rooms = self.rooms();
        let room = rooms.get_mut(&c.room).ok_or(None)?;
        let state = room.status.state();
        if !matches!(state, RoomState::WaitingForInput | RoomState::Transferring) {
            return Err(None); // aborting, failed or late: drop the bytes
        }
        let bad = |m: String| Some(Reason::new(FailureCode::BadMessage, m));
        let l = &self.cfg.layout;
        let (tokens, layers) = (
            c.tokens.start as usize..c.tokens.end as usize,
            c.layers.start as usize..c.layers.end as usize,
        );
        let heads = c.heads.start as usize..c.heads.end as usize;
        let source = room.sources.iter().position(|s| {
            s.peer.instance == c.prefill_instance
                && s.layers.start <= layers.start
                && layers.end <= s.layers.end
                && s.heads == heads
        });
        let Some(source) = source else {
            return Err(bad(format!(
                "chunk {} from instance {} (layers {layers:?}, heads {heads:?}) matches no segment this room asked for",
                c.seq, c.prefill_instance
            )));
        };
        if tokens.end > room.tokens
            || tokens.start < room.start_token
            || tokens.is_empty()
            || layers.is_empty()
        {
            return Err(bad(format!(
                "chunk {} covers tokens {tokens:?} layers {layers:?} heads {heads:?}, outside the request",
                c.seq
            )));
        }
        let local = layers.start - l.layers.start..layers.end - l.layers.start;
        let expected = l
            .selection_bytes(
                l.staged_tokens(&tokens, room.sources[source].wire),
                local.len(),
                heads.len(),
            )
            .unwrap_or(usize::MAX);
        if expected != payload_len || c.len as usize != payload_len {
            return Err(bad(format!(
                "chunk {} carries {payload_len} bytes (header says {}), its ranges need {expected}",
                c.seq, c.len
            )));
        }
        let local_heads = heads.start - l.heads.start..heads.end - l.heads.start;
        if !room
            .coverage
            .claim(local.clone(), tokens.clone(), local_heads.clone())
        {
            return Err(bad(format!(
                "chunk {} overlaps bytes that already landed",
                c.seq
            )));
        }
        if room.status.advance(RoomState::Transferring) {
            self.metrics.ready_wait.observe(room.progress_at.elapsed());
        }
        room.scattering += 1;
        let sel = Selection {
            pages: &[],
            tokens,
            layers: local,
            heads: local_heads,
        };
        Ok(Admitted {
            pages: room.pages.clone(),
            sel,
            wire: room.sources[source].wire,
            source,
        })
    }

    /// Lands one chunk (or drops it, for a room no longer accepting), then returns the
    /// staging slot it used to the prefill that sent it as a credit.
    pub(super) async fn on_chunk(self: &Arc<Self>, header: Bytes, payload: Payload) {
        let chunk = match Message::decode(&header) {
            Ok(Message::Chunk(c)) => c,
            Ok(other) => {
                return self
                    .bad_message("unexpected", format!("data plane carried {}", other.name()));
            }
            Err(e) => return self.bad_message(e.kind(), format!("data plane header: {e}")),
        };
        // A chunk counts only if it comes from a prefill this decode said Hello to (the key
        // given to it there), and lands only in a transfer whose secret it carries: anything
        // else on this port is forged, and touches neither pool, room, credits nor liveness.
        let peer = self.peers().get(&chunk.prefill_instance).cloned();
        let Some(peer) = peer.filter(|p| p.chunk_key == chunk.sender_key) else {
            return self.forged(&chunk, "names no prefill peer of this decode with its key");
        };
        if !self.genuine(&chunk) {
            return self.forged(&chunk, "does not carry its transfer's secret");
        }
        self.land(&chunk, payload).await;
        *peer.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        let credit = Message::Credit(protocol::Credit {
            instance: self.instance,
            slots: 1,
        });
        // Off the landing slot: the next chunk lands while the credit goes out (it crosses to
        // the control socket's thread and back).
        let timeout = self.timeouts().send;
        tokio::spawn(async move {
            if let Err(reason) = peer.send(&credit, timeout).await {
                tracing::warn!(%reason, "credit not returned");
            }
        });
    }

    /// Whether `chunk` carries the secret of the transfer it names; a chunk for a room no
    /// longer here (taken, expired) cannot be checked, and is dropped by [`Decode::land`].
    fn genuine(&self, chunk: &Chunk) -> bool {
        let rooms = self.rooms();
        let Some(room) = rooms.get(&chunk.room) else {
            return true;
        };
        room.sources
            .iter()
            .any(|s| s.peer.instance == chunk.prefill_instance && s.secret == chunk.secret)
    }

    /// Drops a forged chunk: counted (`kvferry_protocol_errors_total{kind="forged"}`), nothing
    /// else (a flood of them must not flood the log either).
    fn forged(&self, chunk: &Chunk, why: &str) {
        self.metrics.protocol_error("forged");
        tracing::debug!(room = chunk.room, seq = chunk.seq, claims = %chunk.prefill_instance, why, "forged chunk dropped");
    }

    pub(super) async fn land(self: &Arc<Self>, chunk: &Chunk, payload: Payload) {
        let admitted = self
            .admit_payload(chunk, &payload)
            .and_then(|len| self.admit_chunk(chunk, len));
        let Admitted {
            pages,
            sel,
            wire,
            source,
        } = match admitted {
            Ok(v) => v,
            Err(refused) => {
                if let Some(p) = &chunk.placed {
                    // The sender holds the runs until told.
                    self.posted(chunk, p.key, false).await;
                }
                if let Some(reason) = refused {
                    self.metrics.protocol_error("inconsistent");
                    self.fail(chunk.room, reason);
                }
                return;
            }
        };
        let started = Instant::now();
        let landed = match &chunk.placed {
            Some(placed) => self.place(chunk, placed, &pages, &sel, wire).await,
            None => Ok(()),
        };
        let in_place = chunk.direct || chunk.placed.is_some();
        let landed = match landed {
            Ok(()) => {
                self.verify_and_scatter(chunk, payload, pages, sel, wire)
                    .await
            }
            Err(reason) => Err(reason),
        };
        let mut rooms = self.rooms();
        let Some(room) = rooms.get_mut(&chunk.room) else {
            return;
        };
        room.scattering -= 1;
        if room.scattering == 0 && room.status.state().is_final() {
            // Now safe to reuse: wake engines long-polling for that.
            room.status.touch();
        }
        if let Err(reason) = landed {
            if room.status.fail(reason.clone()) {
                tracing::warn!(room = chunk.room, %reason, "room failed");
                self.finished(room);
            }
            return;
        }
        let path = match (chunk.direct, in_place) {
            (true, _) => &self.metrics.chunks_direct,
            (false, true) => &self.metrics.chunks_placed,
            (false, false) => {
                self.metrics.scatter.observe(started.elapsed());
                &self.metrics.chunks_staged
            }
        };
        path.inc();
        room.landed += chunk.len as usize;
        room.chunks += 1;
        room.status.mark_first("first_landed");
        room.progress_at = Instant::now();
        if let Some(s) = room.sources.get_mut(source) {
            s.landed += chunk.len as usize;
            s.chunks += 1;
        }
        self.metrics.bytes.inc_by(chunk.len);
        self.check_complete(chunk.room, room);
    }

    /// Receives a placed chunk's runs straight into the room's pages, at the places this agent
    /// computes from its own layout: posts the receives, tells the prefill (`Posted`), and
    /// resolves once the transport writes nothing more there: when every run landed, or, if
    /// the room ends first (failed, aborted, expired) or the agent stops, once the receives
    /// still open are cancelled.
    async fn place(
        &self,
        chunk: &Chunk,
        placed: &Placed,
        pages: &Arc<[u32]>,
        sel: &Selection<'static>,
        wire: PageOrder,
    ) -> Result<(), Reason> {
        let cancel = CancellationToken::new();
        let what = format!("chunk {} from {}", chunk.seq, chunk.prefill_instance);
        let posting = async {
            let sel = Selection {
                pages,
                ..sel.clone()
            };
            let Some(placer) = &self.placer else {
                // Admission refuses placed chunks without a placer.
                return Err(Reason::new(
                    FailureCode::BadMessage,
                    format!("{what}: no placer"),
                ));
            };
            // A revocable placer copies each part of a run into place: it takes runs that
            // cover several pieces of the pool.
            let places = crate::kernel::cpu::placements(
                self.pool.layout(),
                self.pool.num_pages(),
                &sel,
                wire,
                &placed.runs,
                placer.revocable(),
            )
            .map_err(|e| Reason::new(FailureCode::BadMessage, format!("{what}: {e}")))?;
            // Placed receives are offered only over a pool the transport reaches (`exposable`
            // at start).
            let Some(pool) = self.pool.direct() else {
                return Err(Reason::new(
                    FailureCode::BadMessage,
                    format!("{what}: placed runs land in pools the transport reaches only"),
                ));
            };
            placer
                .place(pool, placed.key, places, cancel.clone())
                .await
                .map_err(|e| Reason::new(FailureCode::PeerDead, format!("{what}: {e}")))
        };
        let landing = match posting.await {
            Ok(landing) => landing,
            Err(reason) => {
                self.posted(chunk, placed.key, false).await;
                return Err(reason);
            }
        };
        self.posted(chunk, placed.key, true).await;
        tracing::debug!(
            room = chunk.room,
            seq = chunk.seq,
            key = placed.key,
            runs = placed.runs.len(),
            "placed receives posted"
        );
        let room_state = self.rooms().get(&chunk.room).map(|r| r.status.subscribe());
        let room_ended = async move {
            if let Some(mut state) = room_state {
                // Also returns when the room is dropped (its sender goes).
                let _ = state.wait_for(|s| s.is_final()).await;
            }
        };
        tokio::pin!(landing);
        let result = tokio::select! {
            r = &mut landing => r,
            () = room_ended => {
                cancel.cancel();
                landing.await
            }
            () = self.shutdown.cancelled() => {
                cancel.cancel();
                landing.await
            }
        };
        result.map_err(|e| Reason::new(FailureCode::PeerDead, format!("{what}: placed runs: {e}")))
    }

    /// Tells the prefill of a placed chunk whether its runs' receives are posted.
    async fn posted(&self, chunk: &Chunk, key: u64, accepted: bool) {
        let peer = self.peers().get(&chunk.prefill_instance).cloned();
        let Some(peer) = peer else { return };
        let posted = Message::Posted(protocol::Posted {
            instance: self.instance,
            key,
            accepted,
        });
        if let Err(reason) = peer.send(&posted, self.timeouts().send).await {
            tracing::warn!(%reason, key, accepted, "Posted not delivered");
        }
    }

    /// Checks a chunk's checksum (of its payload, or of the bytes in place when it came
    /// direct or placed) and scatters its payload, on a blocking thread.
    async fn verify_and_scatter(
        &self,
        chunk: &Chunk,
        payload: Payload,
        pages: Arc<[u32]>,
        sel: Selection<'static>,
        wire: PageOrder,
    ) -> Result<(), Reason> {
        let pool = self.pool.clone();
        let (verify, sent_sum) = (self.cfg.checksum, chunk.checksum);
        let in_place = chunk.direct || chunk.placed.is_some();
        if in_place && !verify {
            // Nothing to copy or hash: no hand-off to the blocking pool.
            return Ok(());
        }
        let done = tokio::task::spawn_blocking(move || {
            let sel = Selection {
                pages: &pages,
                ..sel
            };
            if verify {
                let sum = match in_place {
                    true => crate::agent::checksum_digest(pool.checksum(&sel, wire)?),
                    false => pool.payload_checksum(&payload)?,
                };
                if sent_sum != sum {
                    return Ok(Err(format!("checksum {sum:#018x} of the landed bytes differs from the sender's {sent_sum:#018x}")));
                }
            }
            match in_place {
                true => Ok(Ok(())),
                false => pool.scatter_payload(&payload, wire, &sel).map(Ok),
            }
        })
        .await;
        let (seq, from) = (chunk.seq, chunk.prefill_instance);
        match done {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(mismatch))) => Err(Reason::new(
                FailureCode::Checksum,
                format!("chunk {seq} from {from}: {mismatch}"),
            )),
            Ok(Err(e)) => Err(Reason::new(
                FailureCode::BadMessage,
                format!("chunk {seq}: {e}"),
            )),
            Err(e) => Err(Reason::new(
                FailureCode::BadMessage,
                format!("scatter of chunk {seq} stopped: {e}"),
            )),
        }
    }

    /// The bytes a chunk brings: its payload, or for a direct or placed chunk the bytes the
    /// header says (then no payload may follow; a direct chunk must come from a prefill that
    /// announced direct writes, a placed one needs a transport that places).
    fn admit_payload(&self, c: &Chunk, payload: &Payload) -> Result<usize, Option<Reason>> {
        if !c.direct && c.placed.is_none() {
            return Ok(payload.len());
        }
        let bad = |m: String| Some(Reason::new(FailureCode::BadMessage, m));
        let (seq, from) = (c.seq, c.prefill_instance);
        if c.direct {
            // Only a prefill that announced direct writes (HelloAck) is tracked as a writer
            // of its rooms' pages (`Writes`); one that did not may not claim any.
            let announced = self.peers().get(&from).is_some_and(|p| p.direct);
            if !announced || c.placed.is_some() {
                return Err(bad(format!(
                    "chunk {seq} from {from} claims a direct write, but that prefill did not announce direct writes to this decode{}",
                    if announced {
                        " (or it claims placed runs too)"
                    } else {
                        ""
                    }
                )));
            }
        }
        if let Some(p) = &c.placed {
            if self.placer.is_none() {
                return Err(bad(format!(
                    "chunk {seq} from {from} has placed runs, but this decode's transport ({}) cannot place them",
                    self.cfg.transport
                )));
            }
            let sum = p.runs.iter().try_fold(0u64, |a, &l| a.checked_add(l));
            if sum != Some(c.len) {
                return Err(bad(format!(
                    "chunk {seq} from {from}: its {} placed runs do not add up to its {} bytes",
                    p.runs.len(),
                    c.len
                )));
            }
        }
        if !payload.is_empty() {
            return Err(bad(format!(
                "chunk {seq} from {from} comes {} but carries a {}-byte payload",
                if c.direct { "direct" } else { "placed" },
                payload.len()
            )));
        }
        usize::try_from(c.len).map_err(|_| bad(format!("chunk {seq} length {}", c.len)))
    }

    pub(super) fn bad_message(&self, kind: &'static str, what: String) {
        self.metrics.protocol_error(kind);
        tracing::warn!(kind, %what, "refused a message");
    }
}

/// Where the receiver lands chunks, by the pool's staging: a device pool's in device staging
/// ([`StagingMode::Device`]) or in pinned host buffers ([`StagingMode::PinnedHost`], pinned once each
/// like the prefill's chunk buffers, so that the H2D copy runs at the bus's speed), a host
/// pool's in host buffers reused from chunk to chunk, so that no receive writes into freshly
/// mapped memory (a UCX copy into new pages runs much slower), where the transport
/// receives into buffers of the agent's (UCX; libzmq allocates every message itself, and
/// those stay pageable). A device pool's choice is logged.
pub(super) fn land_where_staged(
    pool: &AgentPool,
    receiver: &mut dyn transport::DataReceiver,
) -> Result<Option<Arc<SlotPool>>, crate::agent::AgentError> {
    match pool.staging() {
        StagingMode::Host => {
            let slots = Arc::new(pool.slots());
            Ok(receiver.receive_into(slots.clone()).then_some(slots))
        }
        StagingMode::Device => {
            if let Some(sink) = pool.device_sink() {
                receiver.land_on_device(sink)?;
                tracing::info!(receive_buffers = "device", "chunks land in device staging");
            }
            Ok(None)
        }
        StagingMode::PinnedHost => {
            let slots = Arc::new(pool.slots());
            match receiver.receive_into(slots.clone()) {
                true => {
                    tracing::info!(
                        receive_buffers = "pinned_host",
                        "chunks land in pinned host buffers"
                    );
                    Ok(Some(slots))
                }
                false => {
                    tracing::info!(
                        receive_buffers = "transport",
                        "chunks land in the transport's own buffers (pageable): it allocates \
                         them itself"
                    );
                    Ok(None)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::EnginePool;
    use crate::layout::{KvLayout, ModelSpec};
    use crate::pool::HostPool;
    use futures_util::future::BoxFuture;

    /// A receiver that takes the agent's buffers, or not.
    struct Takes(bool);

    impl transport::DataReceiver for Takes {
        fn recv(&mut self) -> BoxFuture<'_, Result<(Bytes, Bytes), transport::TransportError>> {
            unreachable!("nothing is received here")
        }
        fn receive_into(&mut self, _: Arc<dyn transport::RecvBuffers>) -> bool {
            self.0
        }
    }

    #[test]
    fn a_host_pool_lands_chunks_in_reused_buffers_where_the_transport_takes_them() {
        let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
        let pool =
            AgentPool::new(EnginePool::Host(HostPool::anonymous(layout, 4).unwrap()), 1).unwrap();
        let slots = land_where_staged(&pool, &mut Takes(true)).unwrap();
        let slots = slots.expect("UCX lands a host pool's chunks in the agent's buffers");
        assert_eq!(slots.pinned_bytes(), 0, "host buffers are not pinned");
        assert!(
            land_where_staged(&pool, &mut Takes(false))
                .unwrap()
                .is_none()
        );
    }
}
