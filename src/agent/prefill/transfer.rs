//! One decode rank's transfer of a room: a task that sends each announced piece's requested
//! part chunk by chunk (a credit per chunk, the gather of the next chunk overlapping the send
//! of this one), then Done, or AbortAck / Abort / Error when it stops early.
//!
//! Two data paths, chosen per piece of a segment:
//! - *staged*: gather into a staging slot, send it, the decode scatters it;
//! - *direct*: when the pair has a way into the decode's pool (`DirectTarget::ways`: its pool
//!   file mapped here, the transport's one-sided writes, placed runs) whose runs pay for the
//!   piece (`shortest_run`: mapped writes any length; one-sided writes at least one page
//!   block of the decode, the head layouts line up; placed runs `--placed-min-run-bytes`,
//!   each being one message), each chunk's runs go from this pool straight into the decode's
//!   pages. No gather, no scatter, no staging memory. Either written (mapped or one-sided)
//!   and flushed, then the header (`direct`, no payload) follows; or placed: the header
//!   (`placed`: a random key and the runs' lengths) goes first, then one message per run,
//!   which the decode receives straight into the places it computes itself. Mapped writes of
//!   one chunk for several decode ranks go in one pass (`fanout.rs`).

use crate::agent::prefill::{Peer, Piece, Prefill, Way};
use crate::agent::room::RoomState;
use crate::agent::{ChunkPlan, plan_chunks};
use crate::kernel::Selection;
use crate::protocol::{self, ErrorMsg, Message, TransferRequest};
use crate::reason::{FailureCode, Reason};
use crate::transport;
use crate::transport::{FRAME_ROOM, MAX_PIECES};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

mod direct;
mod send;
use send::{ChunkBody, Taken};

/// Largest chunk whose plan (no copy) a transfer's task makes itself when the chunk is sent
/// from the pool: its few runs cost less than a hand-off to a blocking thread.
const INLINE_PLAN_BYTES: usize = 256 << 10;

/// A chunk's payload being made ready to send: planned on the task, or gathered on the
/// blocking pool.
type Gathering = transport::BoxFuture<'static, Result<(ChunkBody, u64), Reason>>;

/// A chunk as the ranges of a host pool it is sent from without a gather (at most
/// [`MAX_PIECES`]); `None` when it takes more, or the pool is device memory.
fn from_pool(
    pool: &crate::agent::AgentPool,
    sel: &Selection<'_>,
    wire: crate::layout::PageOrder,
) -> Result<Option<ChunkBody>, crate::kernel::KernelError> {
    let Some(host) = pool.host() else {
        return Ok(None);
    };
    let spans = crate::kernel::cpu::source_spans(host, sel, wire)?;
    Ok((spans.len() <= MAX_PIECES).then(|| ChunkBody::FromPool(host.clone(), spans)))
}

fn gather_failed(e: crate::kernel::KernelError) -> Reason {
    Reason::new(FailureCode::BadMessage, format!("gather: {e}"))
}

/// What a transfer waited for when its chunks or placed runs time out.
const CHUNK_STALL: &str = "no chunk taken";
const PLACED_STALL: &str = "placed runs not taken";

/// The smallest budget of a direct chunk: over shared memory, rooms of placed chunks this large
/// run faster than rooms of smaller ones (docs/benchmarks.md, "Figures behind design choices").
const DIRECT_CHUNK_BYTES: usize = 32 << 20;

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
    /// The request's destination pages, shared with every direct chunk's planning.
    pub(super) dst_pages: Arc<[u32]>,
    pub(super) cancel: CancellationToken,
    /// Every send or write that reads this pool's pages (a transport cannot take back a send
    /// it started: UCX reads the pages by cma, RDMA or its tcp copy until the send resolves).
    /// The transfer stays running, so the room is not `safe_to_reuse`, until all have ended.
    pub(super) sends: tokio_util::task::TaskTracker,
    /// Sends that had not resolved when their piece was out (staged chunks, direct chunks'
    /// headers, placed chunks' runs), with what a stall of each means: awaited after Done,
    /// which goes once every chunk is handed to the transport.
    pub(super) unfinished: std::sync::Mutex<Vec<(Taken, &'static str)>>,
}

impl Prefill {
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
        let tokens = req.tokens.start as usize..req.tokens.end as usize;
        l.selection_bytes(
            l.staged_tokens(&tokens, req.wire_order),
            req.layers.len(),
            req.heads.len(),
        )
        .unwrap_or(usize::MAX)
    }

    /// Sends one decode rank its part of a room, piece by piece as the engine announces them,
    /// then Done (or AbortAck, or Error; after Done, an Error if a last send failed, an
    /// AbortAck if an abort came meanwhile).
    pub(super) async fn serve_transfer(self: Arc<Self>, room_id: u64, decode: Uuid) {
        let Some(job) = self.rooms().get(&room_id).and_then(|r| {
            let t = r.transfers.get(&decode)?;
            let req = t.req.clone()?;
            Some(Job {
                room: room_id,
                decode,
                peer: t.peer.clone(),
                dst_pages: req.dst_pages.as_slice().into(),
                req,
                pages: r.ready.as_ref()?.pages.clone(),
                cancel: t.cancel.clone(),
                sends: t.sends.clone(),
                unfinished: Default::default(),
            })
        }) else {
            return;
        };
        // Other decode ranks take other heads of the same chunks: those written mapped go in
        // one pass with theirs (`fanout.rs`), counted from the start so that their first
        // chunks meet.
        let mapped = job
            .peer
            .direct
            .as_ref()
            .is_some_and(|t| t.ways.iter().any(|w| matches!(w, Way::Mapped(_))));
        let _writer = (mapped && job.req.requesters > 1).then(|| self.fanout.join(room_id));
        let mut chunks = 0u32;
        let started = Instant::now();
        let outcome = loop {
            match self.next_step(room_id, decode) {
                Step::Send(piece) => {
                    self.mark_first(room_id, "transfer_start");
                    if let Err(reason) = self.send_piece(&job, &piece, &mut chunks).await {
                        break Err(reason);
                    }
                }
                Step::Wait(wake) => {
                    let ready = self.timeouts().ready;
                    tokio::select! {
                        () = wake.notified() => {}
                        () = job.cancel.cancelled() => {}
                        () = tokio::time::sleep(ready) => break Err(Reason::new(
                            FailureCode::TimeoutReady,
                            format!("the engine announced no further piece within {} ms", ready.as_millis()),
                        )),
                    }
                }
                Step::Done(aux) => {
                    // Done as soon as every chunk is with the transport: the decode counts the
                    // bytes that land before it calls the room a success. The last sends are
                    // awaited after it; one that fails then fails the transfer with an Error.
                    self.reply(&job.peer.identity, self.done(room_id, decode, chunks, aux));
                    let unfinished = std::mem::take(
                        &mut *job.unfinished.lock().unwrap_or_else(|e| e.into_inner()),
                    );
                    let mut outcome = Ok(Some(chunks));
                    for (sent, stalled) in unfinished {
                        if let Err(reason) = self.taken(&job, sent, stalled).await {
                            outcome = Err(reason);
                            break;
                        }
                    }
                    break outcome;
                }
                Step::Stop => break Ok(None),
                Step::Fail(reason) => break Err(reason),
            }
        };
        // The pages are still read until every send from them has resolved: the transfer
        // (and so the room) stays running until then, however it ended. A send to a dead
        // peer resolves when the transport gives up on its connection. A failure shows in the
        // transfer's view meanwhile.
        job.sends.close();
        if !job.sends.is_empty() {
            if let Err(reason) = &outcome {
                let mut rooms = self.rooms();
                if let Some(room) = rooms.get_mut(&room_id)
                    && !self.requeue_lost(room_id, room, decode, reason)
                    && let Some(t) = room.transfers.get_mut(&decode)
                {
                    t.end(RoomState::Failed, Some(reason.clone()));
                }
            }
            let waiting = Instant::now();
            job.sends.wait().await;
            tracing::debug!(
                waited_ms = waiting.elapsed().as_millis() as u64,
                "sends from the room's pages resolved"
            );
        }
        let reply = {
            let mut rooms = self.rooms();
            let Some(room) = rooms.get_mut(&room_id) else {
                return;
            };
            let Some(t) = room.transfers.get_mut(&decode) else {
                return;
            };
            t.running = false;
            // An abort that came after the last step was decided (it found the transfer still
            // running, so it left the acknowledgement to this task) wins over Done: the decode
            // is waiting for this source's last word on an aborted room.
            let outcome = match outcome {
                Ok(Some(_)) if t.cancel.is_cancelled() => Ok(None),
                outcome => outcome,
            };
            let reply = match outcome {
                // Done went before the last sends resolved.
                Ok(Some(_)) => {
                    self.metrics.transfer.observe(started.elapsed());
                    t.end(RoomState::Success, None);
                    None
                }
                Ok(None) if t.engine_abort => {
                    let reason = room.engine_abort.clone().unwrap_or_else(|| {
                        Reason::new(FailureCode::Aborted, "aborted by the prefill engine")
                    });
                    t.end(RoomState::Aborted, Some(reason.clone()));
                    Some(Message::Abort(protocol::Abort {
                        room: room_id,
                        instance: self.instance,
                        code: reason.code,
                        message: reason.message,
                    }))
                }
                Ok(None) => {
                    let reason = t.abort_reason.take().unwrap_or_else(|| {
                        Reason::new(FailureCode::Aborted, "aborted by the decode")
                    });
                    t.end(RoomState::Aborted, Some(reason));
                    Some(Message::AbortAck(protocol::AbortAck {
                        room: room_id,
                        instance: self.instance,
                    }))
                }
                Err(reason) => {
                    tracing::warn!(room = room_id, %decode, %reason, "transfer failed");
                    if reason.code != FailureCode::PeerDead {
                        t.end(RoomState::Failed, Some(reason.clone()));
                    }
                    Some(Message::Error(ErrorMsg {
                        room: Some(room_id),
                        code: reason.code,
                        message: reason.message,
                    }))
                }
            };
            // Its decode is gone (a send or a credit failed on its connection): the room waits
            // for another decode, as when the decode is found dead.
            if let Some(Message::Error(e)) = &reply
                && e.code == FailureCode::PeerDead
            {
                let reason = Reason::new(e.code, e.message.clone());
                if !self.requeue_lost(room_id, room, decode, &reason)
                    && let Some(t) = room.transfers.get_mut(&decode)
                {
                    t.end(RoomState::Failed, Some(reason));
                }
            }
            self.settle(room);
            reply
        };
        if let Some(reply) = reply {
            self.reply(&job.peer.identity, reply);
        }
    }

    /// The Done of a transfer whose every chunk is with the transport.
    fn done(&self, room_id: u64, decode: Uuid, chunks: u32, aux: Vec<u8>) -> Message {
        let sent = self
            .rooms()
            .get(&room_id)
            .and_then(|r| r.transfers.get(&decode))
            .map_or(0, |t| t.sent);
        Message::Done(protocol::Done {
            room: room_id,
            prefill_instance: self.instance,
            chunks,
            bytes: sent as u64,
            aux,
        })
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

    /// Waits until the engine's writes behind `piece` ran (its CUDA event, polled from here;
    /// true at once without one), or the transfer is cancelled (false). Nothing of the kernel
    /// waits on the device for an engine: an event that never completes fails this transfer
    /// alone with `timeout_ready` after `--timeout-ready-ms`.
    async fn written(&self, job: &Job, piece: &Piece) -> Result<bool, Reason> {
        let Some(ready) = &piece.ready_on else {
            return Ok(true);
        };
        let limit = self.timeouts().ready;
        let started = Instant::now();
        // Short pauses first: an engine usually announces a piece just before its writes end.
        let mut pause = Duration::from_micros(20);
        loop {
            match ready.is_complete() {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(e) => return Err(gather_failed(e.into())),
            }
            if started.elapsed() >= limit {
                return Err(Reason::new(
                    FailureCode::TimeoutReady,
                    format!(
                        "the engine's CUDA event behind tokens {:?} of layers {:?} did not complete within {} ms",
                        piece.tokens,
                        piece.layers,
                        limit.as_millis()
                    ),
                ));
            }
            tokio::select! {
                () = job.cancel.cancelled() => return Ok(false),
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_millis(1));
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
        if tokens.is_empty() || layers.is_empty() || !self.written(job, piece).await? {
            return Ok(());
        }
        let heads =
            req.heads.start as usize - l.heads.start..req.heads.end as usize - l.heads.start;
        let per_token_layer = l.selection_bytes(1, 1, heads.len()).unwrap_or(usize::MAX);
        if let Some(target) = &job.peer.direct {
            // A direct chunk uses no staging: it may be as large as the pair's whole budget,
            // and at least DIRECT_CHUNK_BYTES, so that its fixed costs (header, plan, posted
            // receives, completion) stay small beside its bytes.
            let budget = self
                .cfg
                .chunk_bytes
                .saturating_mul(job.peer.slots)
                .max(DIRECT_CHUNK_BYTES);
            let plan = plan_chunks(
                tokens.clone(),
                layers.clone(),
                per_token_layer,
                l.page_size,
                budget,
                false,
            );
            if let Some(first) = plan.first()
                && let Some(planned) = self.direct_runs(job, target, first, &heads, None).await?
            {
                return self
                    .send_direct(job, target, &plan, &heads, planned, chunks)
                    .await;
            }
        }
        let slot = self.cfg.chunk_bytes.min(job.peer.slot_bytes);
        // Pages that move whole (not re-blocked between page sizes) are cut on page bounds.
        let whole_pages = req.wire_order.granularity() == crate::layout::Granularity::Head;
        let plan = plan_chunks(
            tokens,
            layers,
            per_token_layer,
            l.page_size,
            slot,
            whole_pages,
        );
        let gather = |c: &ChunkPlan| -> Gathering {
            let local = c.layers.start - l.layers.start..c.layers.end - l.layers.start;
            let (pool, pages, wire) = (self.pool.clone(), job.pages.clone(), req.wire_order);
            let (tokens, heads, slots) = (c.tokens.clone(), heads.clone(), self.slots.clone());
            let checksum = self.cfg.checksum;
            let (nth, corrupt) = self.faults.next_chunk();
            let sends_from_pool = job.peer.from_pool && !corrupt;
            let metrics = self.metrics.clone();
            // A small chunk sent from the pool needs only its plan, no copy: made here, which
            // costs less than handing it to a blocking thread and back.
            let small = per_token_layer
                .saturating_mul(c.tokens.len() * c.layers.len())
                .le(&INLINE_PLAN_BYTES);
            if sends_from_pool && small && !checksum {
                let sel = Selection {
                    pages: &pages,
                    tokens: tokens.clone(),
                    layers: local.clone(),
                    heads: heads.clone(),
                };
                match from_pool(&pool, &sel, wire) {
                    Ok(Some(body)) => return Box::pin(std::future::ready(Ok((body, 0)))),
                    Ok(None) => {}
                    Err(e) => return Box::pin(std::future::ready(Err(gather_failed(e)))),
                }
            }
            let gathering = tokio::task::spawn_blocking(move || {
                let started = Instant::now();
                let sel = Selection {
                    pages: &pages,
                    tokens,
                    layers: local,
                    heads,
                };
                let unstaged = match sends_from_pool {
                    true => from_pool(&pool, &sel, wire)?,
                    false => None,
                };
                if let Some(body) = unstaged {
                    let sum = match checksum {
                        true => crate::agent::checksum_digest(pool.checksum(&sel, wire)?),
                        false => 0,
                    };
                    return Ok((body, sum));
                }
                // Device staging is sent as it is (no checksum: `staging::choose`; a chunk to
                // corrupt goes through the host).
                if pool.staging() == crate::agent::StagingMode::Device && !corrupt && !checksum {
                    let chunk = pool.gather_device(&sel, wire)?;
                    metrics.gather.observe(started.elapsed());
                    return Ok((ChunkBody::Device(Arc::new(chunk)), 0));
                }
                // The payload goes behind room for the frame prefix (`Frame::in_place`).
                let mut buf = slots.take(FRAME_ROOM + sel.bytes_in(pool.layout(), wire)?);
                let payload = &mut buf[FRAME_ROOM..];
                pool.gather(&sel, wire, payload)?;
                metrics.gather.observe(started.elapsed());
                let sum = if checksum {
                    crate::agent::checksum(payload)
                } else {
                    0
                };
                if corrupt {
                    // Every byte: whole pages arrive wrong, as a broken link or a bad NIC
                    // would deliver them.
                    tracing::warn!(
                        chunk = nth,
                        "fault injection: corrupting a chunk after its checksum"
                    );
                    payload.iter_mut().for_each(|b| *b = !*b);
                }
                Ok::<_, crate::kernel::KernelError>((ChunkBody::Staged(buf), sum))
            });
            Box::pin(async move {
                match gathering.await {
                    Ok(gathered) => gathered.map_err(gather_failed),
                    Err(e) => Err(Reason::new(
                        FailureCode::BadMessage,
                        format!("gather stopped: {e}"),
                    )),
                }
            })
        };
        let mut next = None;
        let sent = async {
            next = match plan.first() {
                Some(c) => {
                    self.credit(&job.peer).await?;
                    Some(gather(c))
                }
                None => None,
            };
            // Chunks the transport is still moving (as many as the credits allow): the next ones
            // are gathered and queued meanwhile.
            let mut sending: std::collections::VecDeque<Taken> = Default::default();
            for (i, c) in plan.iter().enumerate() {
                let Some(pending) = next.take() else { break };
                let (body, sum) = pending.await?;
                self.faults.pass(&job.cancel, job.peer.instance).await;
                if job.cancel.is_cancelled() {
                    job.peer.credits.add_permits(1);
                    return Ok(());
                }
                if *chunks == 0 {
                    self.mark_first(job.room, "first_gathered");
                }
                // Gather ahead only with a credit at hand: waiting for one here, before sending
                // this chunk, could wait forever.
                let ahead = plan
                    .get(i + 1)
                    .filter(|_| job.peer.credits.try_acquire().map(|p| p.forget()).is_ok());
                next = ahead.map(gather);
                if let Some(sent) = self.send_chunk(job, c, *chunks, body, sum).await? {
                    sending.push_back(sent);
                }
                *chunks += 1;
                while sending.front().is_some_and(|s| s.is_finished()) {
                    if let Some(sent) = sending.pop_front() {
                        self.taken(job, sent, CHUNK_STALL).await?;
                    }
                }
                if next.is_none() && i + 1 < plan.len() {
                    self.credit(&job.peer).await?;
                    next = Some(gather(&plan[i + 1]));
                }
            }
            let mut unfinished = job.unfinished.lock().unwrap_or_else(|e| e.into_inner());
            unfinished.extend(sending.into_iter().map(|sent| (sent, CHUNK_STALL)));
            Ok(())
        }
        .await;
        // A gather still running reads the pool: the piece does not end (nor can an in-process
        // engine release its memory after `close`) before it does.
        if let Some(pending) = next.take() {
            let _ = pending.await;
        }
        sent
    }
}

#[cfg(test)]
mod tests;
