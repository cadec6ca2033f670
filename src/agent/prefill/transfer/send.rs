//! Sending one chunk of a transfer: its header and frame, the task that carries its bytes (in
//! the transfer's `Job::sends`, so that a waiter giving up never drops a send that still
//! reads the pool), and what the end of a send means for the transfer (taken, a dead peer, a
//! stall).

use super::{CHUNK_STALL, Job, PLACED_STALL};
use crate::agent::ChunkPlan;
use crate::agent::prefill::Prefill;
use crate::memory::Span;
use crate::pool::HostPool;
use crate::protocol::Placed;
use crate::protocol::{Chunk, Message};
use crate::reason::{FailureCode, Reason};
use crate::transport::FRAME_ROOM;
use crate::transport::{self, DataSender};
use crate::transport::{DeviceBytes, Frame, PoolMemory, TransportError, TransportErrorKind};
use std::sync::Arc;
use uuid::Uuid;

/// What goes with a chunk's header: its staging buffer (`FRAME_ROOM` bytes for the frame
/// prefix, then the gathered payload); the ranges of this pool that make the same payload,
/// sent without a gather (`DataSender::send_from`); nothing (the bytes were written into
/// the decode pool directly, this many); or, after it, its runs as placed messages.
/// The variants the transport reads this pool for carry it.
pub(super) enum ChunkBody {
    Staged(Vec<u8>),
    /// Gathered into device staging, sent from there ([`crate::agent::StagingMode::Device`]).
    Device(Arc<dyn DeviceBytes>),
    FromPool(Arc<HostPool>, Vec<Span>),
    Direct(usize),
    /// The ranges of this pool (host or device memory) sent as the chunk's runs, one message
    /// each.
    Placed(PoolMemory, Vec<Span>),
}

/// A chunk's bytes on their way: a staged chunk's frame, resolved once the transport is done
/// with it; a placed chunk's runs, resolved once the decode has posted their receives and
/// taken them (an error of kind [`TransportErrorKind::Refused`]: it refused them;
/// [`TransportErrorKind::Unanswered`]: it did not answer within the send timeout). The task
/// belongs to the transfer's [`Job::sends`]: a waiter that gives up (timeout, abort) drops
/// only the handle, never the send, which may still read this pool's pages.
pub(super) type Taken = tokio::task::JoinHandle<Result<(), TransportError>>;

/// The op (context) of the error of a placed chunk whose runs the decode refused (its room
/// ended there).
const REFUSED: &str = "posted";
/// The op (context) of the error of a placed chunk whose receives the decode never said were
/// posted.
const NOT_POSTED: &str = "posted_wait";

/// A staged chunk's payload: gathered into a staging slot or into device staging, or ranges
/// of this pool.
enum Staged {
    Gathered(Vec<u8>),
    Device(Arc<dyn DeviceBytes>),
    FromPool(Arc<HostPool>, Vec<Span>),
}

/// How a staged chunk goes to the transport.
enum Outgoing {
    Frame(Frame),
    FromPool(Frame, Arc<HostPool>, Vec<Span>),
    Device(Frame, Arc<dyn DeviceBytes>),
}

impl Prefill {
    /// Waits, within the send timeout, until a chunk's bytes are taken: a staged chunk's by
    /// the transport, a placed chunk's runs by the decode, direct writes flushed (`stalled`
    /// says which, for the timeout's message). Stops waiting when the transfer is cancelled
    /// (an abort): the decode cancels its receives for the room, so runs still queued are
    /// never taken. Giving up drops the handle only: the send itself runs on, and the transfer
    /// waits for it before it ends ([`Job::sends`]).
    pub(super) async fn taken(&self, job: &Job, taken: Taken, stalled: &str) -> Result<(), Reason> {
        let done = tokio::select! {
            biased;
            () = job.cancel.cancelled() => return Ok(()),
            done = tokio::time::timeout(self.timeouts().send, taken) => done,
        };
        if job.cancel.is_cancelled() {
            // The decode refuses the runs of a room it aborted: that is the abort, not an error.
            return Ok(());
        }
        // `None`: the send timeout passed.
        let done = match done {
            Ok(joined) => Some(joined.map_err(|e| {
                Reason::new(
                    FailureCode::BadMessage,
                    format!("a chunk's sending task stopped: {e}"),
                )
            })?),
            Err(_) => None,
        };
        match done {
            Some(Err(TransportError {
                kind: TransportErrorKind::Refused,
                ..
            })) => Err(Reason::new(
                FailureCode::Aborted,
                format!(
                    "decode {} refused a placed chunk (its room ended there)",
                    job.decode
                ),
            )),
            // The decode never answered for the receives: the stall it is, not a dead peer.
            Some(Err(TransportError {
                kind: TransportErrorKind::Unanswered,
                ..
            })) => self.data_plane_outcome::<()>(job, PLACED_STALL, None),
            done => self.data_plane_outcome(job, stalled, done),
        }
    }

    /// Runs one operation on the decode's data sender within the send timeout: a transport
    /// error means the peer is dead, a timeout that it stalled (`stalled` says doing what).
    pub(super) async fn on_data_plane<T>(
        &self,
        job: &Job,
        stalled: &str,
        op: impl for<'s> FnOnce(
            &'s mut Box<dyn DataSender>,
        )
            -> transport::BoxFuture<'s, Result<T, transport::TransportError>>,
    ) -> Result<T, Reason> {
        let done = tokio::time::timeout(self.timeouts().send, async {
            let mut data = job.peer.data.lock().await;
            op(&mut data).await
        })
        .await;
        self.data_plane_outcome(job, stalled, done.ok())
    }

    /// What an operation on the data plane means for the transfer: its value, a dead peer (a
    /// transport error), or a stall (`None`: the send timeout passed; `stalled` says doing
    /// what).
    fn data_plane_outcome<T>(
        &self,
        job: &Job,
        stalled: &str,
        done: Option<Result<T, transport::TransportError>>,
    ) -> Result<T, Reason> {
        let timeout = self.timeouts().send;
        match done {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => Err(Reason::new(FailureCode::PeerDead, e.to_string())),
            None => Err(Reason::new(
                FailureCode::TimeoutStall,
                format!(
                    "decode data endpoint {}: {stalled} within {timeout:?}",
                    job.peer.data_endpoint
                ),
            )),
        }
    }

    pub(super) async fn send_chunk(
        &self,
        job: &Job,
        c: &ChunkPlan,
        seq: u32,
        body: ChunkBody,
        checksum: u64,
    ) -> Result<Option<Taken>, Reason> {
        let (len, direct, path, staged, placed) = match body {
            ChunkBody::Staged(buf) => {
                let len = buf.len().saturating_sub(FRAME_ROOM);
                let path = &self.metrics.chunks_staged;
                (len, false, path, Some(Staged::Gathered(buf)), None)
            }
            ChunkBody::Device(chunk) => {
                let (len, path) = (chunk.len(), &self.metrics.chunks_staged);
                (len, false, path, Some(Staged::Device(chunk)), None)
            }
            ChunkBody::FromPool(pool, spans) => {
                let len = spans.iter().map(|s| s.len).sum::<u64>() as usize;
                let path = &self.metrics.chunks_from_pool;
                (len, false, path, Some(Staged::FromPool(pool, spans)), None)
            }
            ChunkBody::Direct(len) => (len, true, &self.metrics.chunks_direct, None, None),
            ChunkBody::Placed(pool, spans) => {
                let len = spans.iter().map(|s| s.len).sum::<u64>() as usize;
                let placed = Placed {
                    key: Uuid::new_v4().as_u64_pair().0,
                    runs: spans.iter().map(|s| s.len).collect(),
                };
                let path = &self.metrics.chunks_placed;
                (len, false, path, None, Some((placed, (pool, spans))))
            }
        };
        let (placed, spans) = placed.unzip();
        // Runs go once the decode has posted their receives (`Posted`), never before.
        let posted = placed.as_ref().map(|p| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let mut waiting = job.peer.posted.lock().unwrap_or_else(|e| e.into_inner());
            waiting.insert(p.key, tx);
            (p.key, rx)
        });
        let header = Message::Chunk(Chunk {
            room: job.room,
            prefill_instance: self.instance,
            seq,
            tokens: c.tokens.start as u32..c.tokens.end as u32,
            layers: c.layers.start as u32..c.layers.end as u32,
            heads: job.req.heads.clone(),
            len: len as u64,
            checksum,
            direct,
            placed,
            secret: job.req.secret,
            sender_key: job.peer.chunk_key,
        });
        let header = header.encode_as(job.peer.version);
        // A placed chunk's header is waited for: its runs are what stays in flight.
        let in_flight = staged.is_some() || direct;
        let outgoing = match staged {
            None => Outgoing::Frame(Frame::header_only(&header)),
            Some(Staged::FromPool(pool, spans)) => {
                Outgoing::FromPool(Frame::header_only(&header), pool, spans)
            }
            Some(Staged::Device(chunk)) => Outgoing::Device(Frame::header_only(&header), chunk),
            Some(Staged::Gathered(buf)) => {
                let frame = Frame::in_place(&header, buf, |buf| self.slots.bytes(buf));
                let frame = frame.ok_or_else(|| {
                    Reason::new(
                        FailureCode::BadMessage,
                        format!(
                            "a {}-byte chunk header outgrows its frame room",
                            header.len()
                        ),
                    )
                })?;
                Outgoing::Frame(frame)
            }
        };
        if seq == 0 {
            // Before the transport has it: the decode may see the chunk before this returns.
            self.mark_first(job.room, "first_posted");
        }
        // Queued in order; a staged chunk's bytes, or a direct chunk's header, are left in
        // flight with the transport (the credits bound how many).
        let sent = self
            .on_data_plane(job, CHUNK_STALL, |data| {
                let sent = match outgoing {
                    Outgoing::FromPool(frame, pool, spans) => data.send_from(frame, pool, spans),
                    Outgoing::Device(frame, chunk) => data.send_device(frame, chunk),
                    Outgoing::Frame(frame) => data.send(frame),
                };
                Box::pin(async move { Ok(sent) })
            })
            .await?;
        let sent = job.sends.spawn(sent);
        let sent = match in_flight {
            true => Some(sent),
            false => {
                self.taken(job, sent, CHUNK_STALL).await?;
                None
            }
        };
        let taken = spans.zip(posted).map(|((pool, spans), (key, posted))| {
            let (peer, timeout) = (job.peer.clone(), self.timeouts().send);
            // A task of its own: the decode may post the receives of later chunks first (it
            // lands a bounded number of chunks at once, in whatever order their headers come
            // out of the transport), and their runs must not wait behind this chunk's. The
            // wait for `Posted` is bounded (nothing was sent yet); the runs, once sent, are
            // not: they read this pool until the transport resolves them.
            job.sends.spawn(async move {
                let endpoint = peer.data_endpoint.clone();
                match tokio::time::timeout(timeout, posted).await {
                    Ok(Ok(true)) => {}
                    Ok(_) => {
                        let refused = TransportError::new(REFUSED, &endpoint, "refused");
                        return Err(refused.with_kind(TransportErrorKind::Refused));
                    }
                    Err(_) => {
                        let mut waiting = peer.posted.lock().unwrap_or_else(|e| e.into_inner());
                        waiting.remove(&key);
                        let silent = TransportError::new(NOT_POSTED, &endpoint, "no Posted");
                        return Err(silent.with_kind(TransportErrorKind::Unanswered));
                    }
                }
                let taken = peer.data.lock().await.send_runs(pool, key, spans);
                taken.await
            })
        });
        self.metrics.bytes.inc_by(len as u64);
        path.inc();
        if let Some(t) = self
            .rooms()
            .get_mut(&job.room)
            .and_then(|r| r.transfers.get_mut(&job.decode))
        {
            t.sent += len;
        }
        Ok(sent.or(taken))
    }
}
