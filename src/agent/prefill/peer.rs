//! A decode peer of the prefill: what Hello negotiated with it (version, key, staging slots
//! and their credits, the ways into its pool when this prefill writes there directly), the
//! replies queued to it, and what happens when it goes silent (its rooms fail with
//! `peer_dead`).

use super::Prefill;
use crate::agent::room::RoomState;
use crate::protocol::Secret;
use crate::protocol::{self, ErrorMsg, Hello, Message};
use crate::reason::{FailureCode, Reason};
use crate::transport::zmq::PeerId;
use crate::transport::{self, DataSender};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use uuid::Uuid;

pub(super) struct Peer {
    pub(super) instance: Uuid,
    /// The protocol version negotiated at Hello: every frame to the peer is stamped with it.
    pub(super) version: u16,
    pub(super) identity: PeerId,
    pub(super) data_endpoint: String,
    pub(super) data: tokio::sync::Mutex<Box<dyn DataSender>>,
    /// Chunks the decode will still accept; closed when the peer is dead.
    pub(super) credits: Semaphore,
    /// The slots the decode granted: credits never exceed it.
    pub(super) slots: usize,
    /// Bytes of the decode's slots.
    pub(super) slot_bytes: usize,
    pub(super) last_seen: Mutex<Instant>,
    /// The decode's pool, when this prefill may write into it directly.
    pub(super) direct: Option<DirectTarget>,
    /// Staged chunks may go straight from the pool, without a gather
    /// ([`transport::DataSender::sends_from_pool`]).
    pub(super) from_pool: bool,
    /// Placed chunks sent, by key, waiting for the decode's `Posted`.
    pub(super) posted: Mutex<HashMap<u64, tokio::sync::oneshot::Sender<bool>>>,
    /// The decode's key for this connection (Hello): every chunk to it carries it.
    pub(super) chunk_key: Secret,
    /// Tokens per page of the decode's pool (Hello).
    pub(super) page_size: usize,
}

/// A decode pool this prefill writes into directly (the direct path): its layout and size,
/// from Hello, and the ways into it.
pub(super) struct DirectTarget {
    pub(super) layout: crate::layout::KvLayout,
    pub(super) num_pages: usize,
    /// Best first: each piece goes the first way whose runs pay there (`transfer.rs`).
    pub(super) ways: Vec<Way>,
}

/// One way a direct piece's runs reach the decode's pages.
pub(super) enum Way {
    /// The transport's own: one-sided writes ([`transport::DataSender::write`]) or placed runs.
    Transport {
        path: transport::WritePath,
        method: crate::agent::DirectMethod,
        /// The decode lands a placed run in as many pieces of its pool as its bytes belong
        /// to: placed runs are the source's contiguous ranges, whatever its own layout.
        scatter: bool,
    },
    /// This process's copies into the decode's pool file, mapped here
    /// ([`transport::mapped`]): one-sided writes whose runs pay at any length.
    Mapped(Arc<transport::mapped::MappedPool>),
}

impl Way {
    pub(super) fn method(&self) -> crate::agent::DirectMethod {
        match self {
            Way::Transport { method, .. } => *method,
            Way::Mapped(_) => crate::agent::DirectMethod::Write,
        }
    }

    /// Whether the decode lands a placed run in several pieces of its pool (`scatter`).
    pub(super) fn scatters(&self) -> bool {
        matches!(
            self,
            Way::Transport {
                method: crate::agent::DirectMethod::Place,
                scatter: true,
                ..
            }
        )
    }

    /// What the writes travel by, for the logs.
    pub(super) fn via(&self) -> &str {
        match self {
            Way::Transport { path, .. } => &path.via,
            Way::Mapped(_) => "mapped",
        }
    }
}

impl DirectTarget {
    /// The decode's pool as its Hello describes it, reached `ways`, each with the size of the
    /// memory it was given; or why direct writes into it are off.
    pub(super) fn new(hello: &Hello, ways: Vec<(Way, u64)>) -> Result<Self, String> {
        let layout = crate::agent::layout_of(&hello.layout).map_err(|e| e.to_string())?;
        let span = layout.page_span().map_err(|e| e.to_string())? as u64;
        let size = ways.first().map_or(0, |(_, size)| *size);
        if let Some((_, other)) = ways.iter().find(|(_, s)| *s != size) {
            return Err(format!(
                "the pool is exposed as {size} bytes and as {other}"
            ));
        }
        if span == 0 || !size.is_multiple_of(span) {
            return Err(format!(
                "exposed {size} bytes, not a whole number of {span}-byte pages"
            ));
        }
        // The decode's size feeds every offset computed into its pool: checked here.
        let num_pages = usize::try_from(size / span)
            .ok()
            .filter(|&n| layout.pool_bytes(n).is_ok_and(|b| b as u64 == size))
            .ok_or_else(|| format!("exposed {size} bytes: too many pages"))?;
        Ok(DirectTarget {
            layout,
            num_pages,
            ways: ways.into_iter().map(|(way, _)| way).collect(),
        })
    }
}

/// Hellos waiting for the answer to this prefill's challenge, one per control identity (a
/// later Hello on the same connection takes the earlier one's place), each numbered so that
/// the wait of one that timed out removes only itself.
#[derive(Default)]
pub(super) struct Challenges(Mutex<Waits>);

type ChallengeWait = tokio::sync::oneshot::Sender<crate::protocol::ChallengeReply>;

/// The waits numbered so far, and the one of each identity.
type Waits = (u64, HashMap<PeerId, (u64, ChallengeWait)>);

impl Challenges {
    /// Waits for `identity`'s answer on `tx`; returns the wait's number.
    pub(super) fn next(&self, identity: &PeerId, tx: ChallengeWait) -> u64 {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.0 += 1;
        let n = all.0;
        all.1.insert(identity.clone(), (n, tx));
        n
    }

    /// Where `identity`'s answer goes, if a challenge waits for it.
    pub(super) fn take(&self, identity: &PeerId) -> Option<ChallengeWait> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.1.remove(identity).map(|(_, tx)| tx)
    }

    /// The wait numbered `n` for `identity` ended without an answer.
    pub(super) fn forget(&self, identity: &PeerId, n: u64) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if all.1.get(identity).is_some_and(|(m, _)| *m == n) {
            all.1.remove(identity);
        }
    }
}

/// The connections of decodes this prefill found dead (silent, or their connection lost), by
/// identity, with why: a decode that was only cut off or starved, and speaks again on the same
/// connection, is told that this prefill forgot it, so that it greets again at once rather than
/// have its rooms refused as sent before a Hello. The oldest are dropped past [`Self::CAP`].
#[derive(Default)]
pub(super) struct Forgotten(Mutex<HashMap<PeerId, (Instant, String)>>);

impl Forgotten {
    /// Connections remembered at most.
    const CAP: usize = 1024;

    fn note(&self, identity: &PeerId, why: String) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if all.len() >= Self::CAP
            && let Some(oldest) = all
                .iter()
                .min_by_key(|(_, (at, _))| *at)
                .map(|(k, _)| k.clone())
        {
            all.remove(&oldest);
        }
        all.insert(identity.clone(), (Instant::now(), why));
    }

    /// Why the decode on `identity` was forgotten, if it was.
    pub(super) fn why(&self, identity: &PeerId) -> Option<String> {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.get(identity).map(|(_, why)| why.clone())
    }

    /// Whether a forgotten connection had this routing id.
    pub(super) fn knows_routing(&self, routing: &[u8]) -> bool {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.keys()
            .any(|k| crate::transport::zmq::control::routing_id(k) == routing)
    }

    /// The connection greeted again.
    pub(super) fn greeted(&self, identity: &PeerId) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(identity);
    }
}

impl Peer {
    pub(super) fn seen(&self) {
        *self.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    pub(super) fn silent_for(&self) -> Duration {
        self.last_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }
}

impl Prefill {
    /// Queues `msg` to a decode without waiting for it to read: one decode that stopped
    /// reading never holds up the others (it is found dead by its silence).
    pub(super) fn reply(&self, peer: &PeerId, msg: Message) {
        let version = self
            .peers()
            .get(peer)
            .map_or(protocol::VERSION, |p| p.version);
        self.replier
            .post(peer, msg.encode_as(version).into(), self.timeouts().send);
    }

    /// Tells the decode on `identity`, which this prefill found dead and forgot (`why`), that
    /// it must greet again: an error that names no room (about the connection), and the
    /// refusal of `room` when it asked for one.
    pub(super) fn forgot(&self, identity: &PeerId, room: Option<u64>, why: &str) {
        let message =
            format!("this prefill found the decode dead ({why}) and forgot it: say Hello again");
        self.reply(
            identity,
            Message::Error(ErrorMsg {
                room: None,
                code: FailureCode::PeerDead,
                message: message.clone(),
            }),
        );
        if room.is_some() {
            self.refuse(identity, room, FailureCode::PeerDead, message);
        }
    }

    pub(super) fn refuse(
        &self,
        peer: &PeerId,
        room: Option<u64>,
        code: FailureCode,
        message: String,
    ) {
        tracing::warn!(?room, %code, %message, "refused a decode request");
        self.reply(
            peer,
            Message::Error(ErrorMsg {
                room,
                code,
                message,
            }),
        );
    }

    /// Forgets a dead decode peer. What it asked for and was not delivered yet waits for
    /// another decode (`--requeue-ms`; at once failed `peer_dead` when that is 0): a router
    /// that sends the request again with its room gets the KV without a second prefill.
    pub(super) fn peer_dead(&self, peer: &Arc<Peer>, why: &str) {
        self.metrics.peers_dead.inc();
        peer.credits.close();
        // Sends still in flight to it end now (a transport may not notice the death itself:
        // UCX over shared memory), so that its transfers end and their pages become reusable.
        let gone = peer.clone();
        tokio::spawn(async move { gone.data.lock().await.close() });
        self.peers().remove(&peer.identity);
        self.forgotten
            .note(&peer.identity, format!("decode {}: {why}", peer.instance));
        tracing::warn!(decode = %peer.instance, why, "decode peer dead");
        let reason = Reason::new(
            FailureCode::PeerDead,
            format!("decode {}: {why}", peer.instance),
        );
        let mut rooms = self.rooms();
        for (id, room) in rooms.iter_mut() {
            let Some(t) = room.transfers.get_mut(&peer.instance) else {
                continue;
            };
            t.cancel.cancel();
            if !self.requeue_lost(*id, room, peer.instance, &reason)
                && let Some(t) = room.transfers.get_mut(&peer.instance)
            {
                t.end(RoomState::Failed, Some(reason.clone()));
            }
            self.settle(room);
        }
    }

    /// The room's transfer to `decode`, which is gone (`reason`), is lost: the room waits for
    /// another decode (`--requeue-ms`) if it was not delivered yet and requeueing is on.
    /// Returns whether it was requeued (counted and logged).
    pub(super) fn requeue_lost(
        &self,
        room_id: u64,
        room: &mut super::Room,
        decode: uuid::Uuid,
        reason: &Reason,
    ) -> bool {
        let requeue = self.timeouts().requeue;
        if requeue.is_zero() || !room.requeue(decode, reason) {
            return false;
        }
        self.metrics.requeued.inc();
        tracing::warn!(room = room_id, %decode, %reason, requeue_ms = requeue.as_millis() as u64, "a room whose decode is gone waits for another decode");
        true
    }
}
