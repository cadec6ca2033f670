//! One decode rank's transfer of a room: a task that sends each announced piece's requested
//! part chunk by chunk (a credit per chunk, the gather of the next chunk overlapping the send
//! of this one), then Done, or AbortAck / Abort / Error when it stops early.

use super::*;

/// What a transfer's task does next.
enum Step {
    Send(Piece),
    Done(Vec<u8>),
    Wait(Arc<Notify>),
    Fail(Reason),
    Stop,
}

struct Job {
    pub(super) room: u64,
    pub(super) decode: Uuid,
    pub(super) peer: Arc<Peer>,
    pub(super) req: TransferRequest,
    pub(super) pages: Arc<[u32]>,
    pub(super) cancel: CancellationToken,
}

impl Inner {
    /// The next thing a transfer's task does.
    fn next_step(&self, room_id: u64, decode: Uuid) -> Step {
        let mut rooms = self.rooms();
        let Some(room) = rooms.get_mut(&room_id) else {
            return Step::Stop;
        };
        let Some(ready) = room.ready.as_ref() else {
            return Step::Stop;
        };
        let (last, aux) = (ready.last, ready.aux.clone());
        let Some(t) = room.transfers.get_mut(&decode) else {
            return Step::Stop;
        };
        let Some(req) = &t.req else { return Step::Stop };
        if t.cancel.is_cancelled() {
            return Step::Stop;
        }
        if let Some(piece) = room.pieces.get(t.next_piece) {
            t.next_piece += 1;
            return Step::Send(piece.clone());
        }
        let expected = self.request_bytes(req);
        if t.sent >= expected {
            return Step::Done(aux);
        }
        if last {
            return Step::Fail(Reason::new(
                FailureCode::TimeoutReady,
                format!(
                    "the engine marked its last piece but only {} of the {expected} requested bytes were ever ready",
                    t.sent
                ),
            ));
        }
        Step::Wait(t.wake.clone())
    }

    pub(super) fn request_bytes(&self, req: &TransferRequest) -> usize {
        let l = &self.cfg.layout;
        l.selection_bytes(req.tokens.len(), req.layers.len(), req.heads.len())
            .unwrap_or(usize::MAX)
    }

    /// Sends one decode rank its part of a room, piece by piece as the engine announces them,
    /// then Done (or AbortAck, or Error).
    pub(super) async fn serve_transfer(self: Arc<Self>, room_id: u64, decode: Uuid) {
        let Some(job) = self.rooms().get(&room_id).and_then(|r| {
            let t = r.transfers.get(&decode)?;
            Some(Job {
                room: room_id,
                decode,
                peer: t.peer.clone(),
                req: t.req.clone()?,
                pages: r.ready.as_ref()?.pages.clone(),
                cancel: t.cancel.clone(),
            })
        }) else {
            return;
        };
        let mut chunks = 0u32;
        let started = Instant::now();
        let outcome = loop {
            match self.next_step(room_id, decode) {
                Step::Send(piece) => {
                    if let Err(reason) = self.send_piece(&job, &piece, &mut chunks).await {
                        break Err(reason);
                    }
                }
                Step::Wait(wake) => {
                    let ready = self.cfg.timeouts.ready;
                    tokio::select! {
                        () = wake.notified() => {}
                        () = job.cancel.cancelled() => {}
                        () = tokio::time::sleep(ready) => break Err(Reason::new(
                            FailureCode::TimeoutReady,
                            format!("the engine announced no further piece within {} ms", ready.as_millis()),
                        )),
                    }
                }
                Step::Done(aux) => break Ok(Some((chunks, aux))),
                Step::Stop => break Ok(None),
                Step::Fail(reason) => break Err(reason),
            }
        };
        let reply = {
            let mut rooms = self.rooms();
            let Some(room) = rooms.get_mut(&room_id) else {
                return;
            };
            let Some(t) = room.transfers.get_mut(&decode) else {
                return;
            };
            t.running = false;
            let reply = match outcome {
                Ok(Some((chunks, aux))) => {
                    self.metrics.transfer.observe(started.elapsed());
                    t.end(RoomState::Success, None);
                    Message::Done(protocol::Done {
                        room: room_id,
                        prefill_instance: self.instance,
                        chunks,
                        bytes: t.sent as u64,
                        aux,
                    })
                }
                Ok(None) if t.engine_abort => {
                    let reason = room.engine_abort.clone().unwrap_or_else(|| {
                        Reason::new(FailureCode::Aborted, "aborted by the prefill engine")
                    });
                    t.end(RoomState::Aborted, Some(reason.clone()));
                    Message::Abort(protocol::Abort {
                        room: room_id,
                        instance: self.instance,
                        code: reason.code,
                        message: reason.message,
                    })
                }
                Ok(None) => {
                    let reason = t.abort_reason.take().unwrap_or_else(|| {
                        Reason::new(FailureCode::Aborted, "aborted by the decode")
                    });
                    t.end(RoomState::Aborted, Some(reason));
                    Message::AbortAck(protocol::AbortAck {
                        room: room_id,
                        instance: self.instance,
                    })
                }
                Err(reason) => {
                    t.end(RoomState::Failed, Some(reason.clone()));
                    Message::Error(ErrorMsg {
                        room: Some(room_id),
                        code: reason.code,
                        message: reason.message,
                    })
                }
            };
            self.settle(room);
            reply
        };
        self.reply(&job.peer.identity, reply).await;
    }

    /// Takes a credit (a free slot at the decode); fails if the peer is dead.
    async fn credit(&self, peer: &Peer) -> Result<(), Reason> {
        match peer.credits.acquire().await {
            Ok(permit) => {
                permit.forget();
                Ok(())
            }
            Err(_) => Err(Reason::new(
                FailureCode::PeerDead,
                format!("decode {} is gone", peer.instance),
            )),
        }
    }

    /// Sends the requested part of one ready piece, chunk by chunk; the gather of chunk i+1
    /// overlaps the send of chunk i when a credit for it is at hand.
    async fn send_piece(&self, job: &Job, piece: &Piece, chunks: &mut u32) -> Result<(), Reason> {
        let l = &self.cfg.layout;
        let req = &job.req;
        let tokens = piece.tokens.start.max(req.tokens.start as usize)
            ..piece.tokens.end.min(req.tokens.end as usize);
        let layers = piece.layers.start.max(req.layers.start as usize)
            ..piece.layers.end.min(req.layers.end as usize);
        if tokens.is_empty() || layers.is_empty() {
            return Ok(());
        }
        let heads =
            req.heads.start as usize - l.heads.start..req.heads.end as usize - l.heads.start;
        let per_token_layer = l.selection_bytes(1, 1, heads.len()).unwrap_or(usize::MAX);
        let slot = self.cfg.chunk_bytes.min(job.peer.slot_bytes);
        let plan = plan_chunks(tokens, layers, per_token_layer, l.page_size, slot);
        let gather = |c: &ChunkPlan| {
            let local = c.layers.start - l.layers.start..c.layers.end - l.layers.start;
            let (pool, kernel, pages, wire) = (
                self.pool.clone(),
                self.kernel,
                job.pages.clone(),
                req.wire_order,
            );
            let (tokens, heads, slots) = (c.tokens.clone(), heads.clone(), self.slots.clone());
            let checksum = self.cfg.checksum;
            let nth = self
                .chunks_sent
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            let corrupt = self.cfg.fault_corrupt_chunk == Some(nth);
            let metrics = self.metrics.clone();
            tokio::task::spawn_blocking(move || {
                let started = Instant::now();
                let sel = Selection {
                    pages: &pages,
                    tokens,
                    layers: local,
                    heads,
                };
                let mut buf = slots.take(sel.bytes(&pool)?);
                kernel.gather(&pool, &sel, wire, &mut buf)?;
                metrics.gather.observe(started.elapsed());
                let sum = if checksum {
                    crate::agent::checksum(&buf)
                } else {
                    0
                };
                if let (true, Some(b)) = (corrupt, buf.first_mut()) {
                    tracing::warn!(
                        chunk = nth,
                        "fault injection: corrupting a chunk after its checksum"
                    );
                    *b = !*b;
                }
                Ok::<_, crate::kernel::KernelError>((buf, sum))
            })
        };
        let mut next = match plan.first() {
            Some(c) => {
                self.credit(&job.peer).await?;
                Some(gather(c))
            }
            None => None,
        };
        for (i, c) in plan.iter().enumerate() {
            let Some(pending) = next.take() else { break };
            let (bytes, sum) = match pending.await {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => {
                    return Err(Reason::new(FailureCode::BadMessage, format!("gather: {e}")));
                }
                Err(e) => {
                    return Err(Reason::new(
                        FailureCode::BadMessage,
                        format!("gather stopped: {e}"),
                    ));
                }
            };
            if job.cancel.is_cancelled() {
                job.peer.credits.add_permits(1);
                return Ok(());
            }
            // Gather ahead only with a credit at hand: waiting for one here, before sending
            // this chunk, could wait forever.
            let ahead = plan
                .get(i + 1)
                .filter(|_| job.peer.credits.try_acquire().map(|p| p.forget()).is_ok());
            next = ahead.map(gather);
            self.send_chunk(job, c, *chunks, bytes, sum).await?;
            *chunks += 1;
            if next.is_none() && i + 1 < plan.len() {
                self.credit(&job.peer).await?;
                next = Some(gather(&plan[i + 1]));
            }
        }
        Ok(())
    }

    async fn send_chunk(
        &self,
        job: &Job,
        c: &ChunkPlan,
        seq: u32,
        bytes: Vec<u8>,
        checksum: u64,
    ) -> Result<(), Reason> {
        let len = bytes.len();
        let header = Message::Chunk(Chunk {
            room: job.room,
            prefill_instance: self.instance,
            seq,
            tokens: c.tokens.start as u32..c.tokens.end as u32,
            layers: c.layers.start as u32..c.layers.end as u32,
            heads: job.req.heads.clone(),
            len: len as u64,
            checksum,
        });
        let timeout = self.cfg.timeouts.send;
        let sent = tokio::time::timeout(timeout, async {
            job.peer
                .data
                .lock()
                .await
                .send(header.encode().into(), self.slots.bytes(bytes))
                .await
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Reason::new(FailureCode::PeerDead, e.to_string())),
            Err(_) => {
                let m = format!(
                    "decode data endpoint {} took no chunk within {timeout:?}",
                    job.peer.data_endpoint
                );
                return Err(Reason::new(FailureCode::TimeoutStall, m));
            }
        }
        self.metrics
            .bytes
            .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        self.metrics
            .chunks_staged
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self
            .rooms()
            .get_mut(&job.room)
            .and_then(|r| r.transfers.get_mut(&job.decode))
        {
            t.sent += len;
        }
        Ok(())
    }
}
