//! Landing chunks: every chunk is checked against its room before a byte moves (known room,
//! the epoch it was requested from, ranges within the request, nothing landed twice, the
//! payload length and, with checksums, its xxh3), scattered into the pool on a blocking
//! thread, and its staging slot returned to the prefill as a credit.
//!
//! A direct chunk (`Chunk.direct`) carries no payload: the prefill wrote its bytes into the
//! pool and flushed them before sending the header. It is checked the same way, its checksum
//! computed over the pool in place, and it is counted without a scatter.

use super::*;

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

pub(super) async fn receive_chunks(inner: Arc<Inner>, mut receiver: Box<dyn DataReceiver>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(SCATTERS_IN_FLIGHT));
    loop {
        let received = tokio::select! {
            () = inner.shutdown.cancelled() => return,
            () = inner.recv_reset.notified() => {
                tracing::debug!("data receives restarted after a peer died");
                receiver.reset();
                continue;
            }
            r = receiver.recv() => r,
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

impl Inner {
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
            .selection_bytes(tokens.len(), local.len(), heads.len())
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
            wire: l.order,
            source,
        })
    }

    /// Lands one chunk (or drops it, for a room no longer accepting), then returns the
    /// staging slot it used to the prefill that sent it as a credit.
    pub(super) async fn on_chunk(self: &Arc<Self>, header: Bytes, payload: Bytes) {
        let chunk = match Message::decode(&header) {
            Ok(Message::Chunk(c)) => c,
            Ok(other) => {
                return self
                    .bad_message("unexpected", format!("data plane carried {}", other.name()));
            }
            Err(e) => return self.bad_message(e.kind(), format!("data plane header: {e}")),
        };
        self.land(&chunk, payload).await;
        let peer = self.peers().get(&chunk.prefill_instance).cloned();
        if let Some(peer) = peer {
            *peer.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
            let credit = Message::Credit(protocol::Credit {
                instance: self.instance,
                slots: 1,
            });
            if let Err(reason) = peer.send(&credit, self.cfg.timeouts.send).await {
                tracing::warn!(%reason, "credit not returned");
            }
        }
    }

    pub(super) async fn land(self: &Arc<Self>, chunk: &Chunk, payload: Bytes) {
        let Admitted {
            pages,
            sel,
            wire,
            source,
        } = match self
            .admit_direct(chunk, &payload)
            .and_then(|len| self.admit_chunk(chunk, len))
        {
            Ok(v) => v,
            Err(None) => return,
            Err(Some(reason)) => {
                self.metrics.protocol_error("inconsistent");
                return self.fail(chunk.room, reason);
            }
        };
        let (pool, kernel) = (self.pool.clone(), self.kernel);
        let (verify, sent_sum, direct) = (self.cfg.checksum, chunk.checksum, chunk.direct);
        let started = Instant::now();
        let scattered = tokio::task::spawn_blocking(move || {
            let sel = Selection {
                pages: &pages,
                ..sel
            };
            if verify {
                let sum = match direct {
                    true => crate::agent::checksum_digest(kernel.checksum(&pool, &sel, wire)?),
                    false => crate::agent::checksum(&payload),
                };
                if sent_sum != sum {
                    return Ok(Err(format!("checksum {sum:#018x} of the landed bytes differs from the sender's {sent_sum:#018x}")));
                }
            }
            match direct {
                true => Ok(Ok(())),
                false => kernel.scatter(&payload, wire, &pool, &sel).map(Ok),
            }
        })
        .await;
        let mut rooms = self.rooms();
        let Some(room) = rooms.get_mut(&chunk.room) else {
            return;
        };
        room.scattering -= 1;
        if room.scattering == 0 && room.status.state().is_final() {
            // Now safe to reuse: wake engines long-polling for that.
            room.status.touch();
        }
        match scattered {
            Ok(Ok(Err(mismatch))) => {
                let reason = Reason::new(
                    FailureCode::Checksum,
                    format!(
                        "chunk {} from {}: {mismatch}",
                        chunk.seq, chunk.prefill_instance
                    ),
                );
                if room.status.fail(reason) {
                    self.finished(room);
                }
            }
            Ok(Ok(Ok(()))) => {
                let path = match direct {
                    true => &self.metrics.chunks_direct,
                    false => {
                        self.metrics.scatter.observe(started.elapsed());
                        &self.metrics.chunks_staged
                    }
                };
                path.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                room.landed += chunk.len as usize;
                room.chunks += 1;
                room.progress_at = Instant::now();
                if let Some(s) = room.sources.get_mut(source) {
                    s.landed += chunk.len as usize;
                    s.chunks += 1;
                }
                self.metrics
                    .bytes
                    .fetch_add(chunk.len, std::sync::atomic::Ordering::Relaxed);
                self.check_complete(chunk.room, room);
            }
            Ok(Err(e)) => {
                if room.status.fail(Reason::new(
                    FailureCode::BadMessage,
                    format!("chunk {}: {e}", chunk.seq),
                )) {
                    self.finished(room);
                }
            }
            Err(e) => {
                if room.status.fail(Reason::new(
                    FailureCode::BadMessage,
                    format!("scatter of chunk {} stopped: {e}", chunk.seq),
                )) {
                    self.finished(room);
                }
            }
        }
    }

    /// The bytes a chunk brings: its payload, or for a direct chunk the bytes the header says
    /// were written (then no payload may follow, and this agent must have exposed its pool).
    fn admit_direct(&self, c: &Chunk, payload: &Bytes) -> Result<usize, Option<Reason>> {
        if !c.direct {
            return Ok(payload.len());
        }
        let bad = |m: String| Some(Reason::new(FailureCode::BadMessage, m));
        // Only a prefill that announced direct writes (HelloAck) is tracked as a writer of
        // its rooms' pages (`Writes`); one that did not may not claim any.
        let announced = self
            .peers()
            .get(&c.prefill_instance)
            .is_some_and(|p| p.direct);
        if !announced {
            return Err(bad(format!(
                "chunk {} from {} claims a direct write, but that prefill did not announce direct writes to this decode",
                c.seq, c.prefill_instance
            )));
        }
        if !payload.is_empty() {
            return Err(bad(format!(
                "direct chunk {} carries a {}-byte payload",
                c.seq,
                payload.len()
            )));
        }
        usize::try_from(c.len).map_err(|_| bad(format!("chunk {} length {}", c.seq, c.len)))
    }

    pub(super) fn bad_message(&self, kind: &'static str, what: String) {
        self.metrics.protocol_error(kind);
        tracing::warn!(kind, %what, "refused a message");
    }
}
