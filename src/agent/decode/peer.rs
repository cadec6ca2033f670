//! The decode agent's control connections: one per prefill instance, opened with Hello,
//! kept alive by heartbeats, and the handling of what prefills send on it (Done, AbortAck,
//! Abort, Error). A peer that dies or goes silent fails every room it serves.

use crate::agent::decode::{Decode, Writes};
use crate::agent::room::RoomState;
use crate::protocol::{self, Hello, Message};
use crate::reason::{FailureCode, Reason};
use crate::transport;
use crate::transport::zmq::{ControlClient, ControlClientRecv, ControlClientSend};
use kvferry_bootstrap::Registration;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub(super) struct Peer {
    pub(super) instance: Uuid,
    /// The protocol version negotiated at Hello: every frame to the peer is stamped with it.
    pub(super) version: u16,
    /// The prefill said (HelloAck) it writes into this decode's pool directly.
    pub(super) direct: bool,
    pub(super) endpoint: String,
    pub(super) send: tokio::sync::Mutex<ControlClientSend>,
    pub(super) last_seen: Mutex<Instant>,
    /// Cancelled when the peer is declared dead: its tasks stop.
    pub(super) gone: CancellationToken,
    /// The key this decode gave the prefill in Hello: its chunks carry it, and it proves the
    /// prefill's data connections while the peer lives.
    pub(super) chunk_key: protocol::Secret,
    _proof: super::proofs::Admitted,
    /// The receives posted for the slots granted in Hello, released with the peer.
    _granted: Option<Granted>,
}

/// Receives a transport posted for the slots granted to one prefill (`transport::Receives`):
/// released when the prefill's last use ends.
struct Granted {
    receives: Arc<dyn transport::Receives>,
    slots: usize,
}

impl Granted {
    /// Grants `slots`; resolves once their receives are posted.
    async fn new(
        receives: Arc<dyn transport::Receives>,
        slots: usize,
    ) -> Result<Granted, transport::TransportError> {
        let posted = receives.grant(slots);
        let granted = Granted { receives, slots };
        posted.await?;
        Ok(granted)
    }
}

impl Drop for Granted {
    fn drop(&mut self) {
        self.receives.release(self.slots);
    }
}

impl Peer {
    pub(super) async fn send(&self, msg: &Message, timeout: Duration) -> Result<(), Reason> {
        let frame = msg.encode_as(self.version).into();
        let sent =
            tokio::time::timeout(timeout, async { self.send.lock().await.send(frame).await }).await;
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Reason::new(
                FailureCode::PeerDead,
                format!("prefill {}: {e}", self.endpoint),
            )),
            Err(_) => Err(Reason::new(
                FailureCode::PeerDead,
                format!(
                    "prefill {} took no {} within {timeout:?}",
                    self.endpoint,
                    msg.name()
                ),
            )),
        }
    }
}

async fn control_loop(inner: Arc<Decode>, peer: Arc<Peer>, mut recv: ControlClientRecv) {
    loop {
        let frame = tokio::select! {
            () = peer.gone.cancelled() => return,
            f = recv.recv() => f,
        };
        *peer.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        match frame {
            Ok(frame) => match Message::decode(&frame) {
                Ok(msg) => inner.on_control(&peer, msg),
                Err(e) => inner.bad_message(
                    e.kind(),
                    format!("control frame from {}: {e}", peer.endpoint),
                ),
            },
            Err(e) => return inner.peer_lost(&peer, e.to_string()),
        }
    }
}

/// Sends heartbeats to a prefill and declares it dead when it has been silent too long.
async fn heartbeat_loop(inner: Arc<Decode>, peer: Arc<Peer>) {
    let mut seq = 0u64;
    loop {
        tokio::select! {
            () = peer.gone.cancelled() => return,
            () = tokio::time::sleep(inner.timeouts().heartbeat) => {}
        }
        let t = inner.timeouts();
        let silent = peer
            .last_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed();
        if silent >= 2 * t.heartbeat {
            inner.metrics.heartbeat_misses.inc();
        }
        if silent >= t.dead_after {
            return inner.peer_lost(&peer, format!("silent for {} ms", silent.as_millis()));
        }
        seq += 1;
        let rooms = inner.held_at(peer.instance);
        let beat = Message::Heartbeat(protocol::Heartbeat {
            instance: inner.instance,
            seq,
            rooms,
        });
        if let Err(reason) = peer
            .send(&beat, t.heartbeat.max(Duration::from_millis(100)))
            .await
        {
            tracing::debug!(%reason, "heartbeat not sent");
        }
    }
}

impl Decode {
    /// The control connection to a prefill instance, connecting and saying Hello if needed
    /// (one connection attempt at a time per instance).
    pub(super) async fn peer(self: &Arc<Self>, rank: &Registration) -> Result<Arc<Peer>, Reason> {
        let lock = self
            .connecting()
            .entry(rank.instance_id)
            .or_default()
            .clone();
        let peer = {
            let _connecting = lock.lock().await;
            self.connect(rank).await
        };
        let mut locks = self.connecting();
        // The map's reference and this one: nobody else waits on the instance's lock.
        if Arc::strong_count(&lock) == 2 {
            locks.remove(&rank.instance_id);
        }
        peer
    }

    fn connecting(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<tokio::sync::Mutex<()>>>> {
        self.connecting.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn connect(self: &Arc<Self>, rank: &Registration) -> Result<Arc<Peer>, Reason> {
        if let Some(p) = self.peers().get(&rank.instance_id) {
            return Ok(p.clone());
        }
        let endpoint = rank.control_endpoint.clone();
        let timeout = self.timeouts().connect;
        let started = Instant::now();
        tracing::debug!(prefill = %endpoint, "saying Hello to a prefill");
        let unreachable = |what: String| {
            Reason::new(
                FailureCode::Unreachable,
                format!("prefill control endpoint {endpoint}: {what}"),
            )
        };
        // Sent again each time the connection is re-established, so the prefill sees this
        // decode back within the grace.
        let beat = Message::Heartbeat(protocol::Heartbeat {
            instance: self.instance,
            seq: 0,
            rooms: Vec::new(),
        });
        // A prefill older than token proofs (the registry says which) takes the token itself,
        // on its ZeroMQ handshake and in Hello: only on loopback, or with --insecure.
        let versions = rank.about.protocol.as_ref();
        let token = self.cfg.token.clone().filter(|t| !t.is_empty());
        let older = versions.is_none_or(|v| v.max < protocol::TOKEN_PROOFS);
        let mut options = crate::agent::control_options(&self.cfg);
        if older && token.is_some() {
            let version = versions.map_or("unknown".to_owned(), |v| v.max.to_string());
            let refused = crate::exposure::token_in_clear_refused(
                "prefill",
                version,
                &endpoint,
                self.cfg.insecure,
            );
            if let Some(why) = refused {
                return Err(Reason::new(FailureCode::Unauthorized, why));
            }
            options.auth = options.auth.in_clear();
        }
        let connected =
            ControlClient::connect(&endpoint, timeout, &options, beat.encode().into()).await;
        let ControlClient { mut send, mut recv } = connected.map_err(|e| match e.kind {
            transport::TransportErrorKind::Unauthorized => Reason::new(
                FailureCode::Unauthorized,
                format!("prefill control endpoint {endpoint}: {}", e.message),
            ),
            _ => unreachable(e.message),
        })?;
        let chunk_key = protocol::Secret::random()
            .map_err(|e| unreachable(format!("no random bytes for the connection's key: {e}")))?;
        // The prefill connects to the data port while it answers the Hello: its proof is
        // accepted from now on. One older than DATA_PROOFS (the registry says which) proves
        // with an empty frame.
        let proof = (self.proofs).admit(
            &chunk_key,
            versions.is_none_or(|v| v.max < protocol::DATA_PROOFS),
        );
        let nonce =
            match (&token, older) {
                (Some(_), false) => Some(protocol::Secret::random().map_err(|e| {
                    unreachable(format!("no random bytes for the token's proof: {e}"))
                })?),
                _ => None,
            };
        let hello = Message::Hello(Hello {
            min_version: protocol::MIN_VERSION,
            max_version: protocol::VERSION,
            instance: self.instance,
            role: protocol::Role::Decode,
            ranks: self.cfg.ranks,
            layout: crate::agent::wire_layout(&self.cfg.layout),
            data_endpoint: self.data_endpoint.clone(),
            token: match older {
                true => token.clone().unwrap_or_default(),
                false => String::new(),
            },
            slots: self.cfg.staging_slots as u32,
            slot_bytes: u32::try_from(self.cfg.chunk_bytes).unwrap_or(u32::MAX),
            pool: self.pool_key.clone(),
            revocable_runs: self.placer.as_ref().is_some_and(|p| p.revocable()),
            chunk_key,
            shared_pool: self.shared_pool.clone(),
            nonce,
        });
        let hello = bytes::Bytes::from(hello.encode());
        // The Hello grants the slots: a receive is posted for each before it goes.
        let granted = match &self.receives {
            Some(receives) => Some(
                Granted::new(receives.clone(), self.cfg.staging_slots)
                    .await
                    .map_err(|e| unreachable(e.to_string()))?,
            ),
            None => None,
        };
        send.send(hello.clone())
            .await
            .map_err(|e| unreachable(e.message))?;
        // The prefill files this connection's peer before it answers, so its heartbeat may
        // come first: skip heartbeats until the answer, within the same bound. With a nonce,
        // the prefill proves the token first and this decode answers its challenge.
        let deadline = tokio::time::Instant::now() + timeout;
        let mut challenged = false;
        let reply = loop {
            let reply = tokio::time::timeout_at(deadline, recv.recv())
                .await
                .map_err(|_| unreachable(format!("no answer to Hello within {timeout:?}")))?
                .map_err(|e| unreachable(e.message))?;
            match (Message::decode(&reply), &token, &nonce) {
                (Ok(Message::Heartbeat(_)), _, _) => continue,
                (Ok(Message::Challenge(c)), Some(token), Some(decode_nonce)) if !challenged => {
                    let handshake = protocol::Handshake {
                        hello: &hello,
                        decode_nonce,
                        prefill_nonce: &c.nonce,
                    };
                    if !handshake.verify(token, protocol::Prover::Prefill, &c.proof) {
                        return Err(Reason::new(
                            FailureCode::Unauthorized,
                            format!("prefill {endpoint} does not prove the cluster token"),
                        ));
                    }
                    challenged = true;
                    let reply = Message::ChallengeReply(protocol::ChallengeReply {
                        proof: handshake.prove(token, protocol::Prover::Decode),
                    });
                    send.send(reply.encode().into())
                        .await
                        .map_err(|e| unreachable(e.message))?;
                }
                (Ok(Message::HelloAck(_)), _, Some(_)) if !challenged => {
                    return Err(Reason::new(
                        FailureCode::Unauthorized,
                        format!(
                            "prefill {endpoint} accepted Hello without proving the cluster token"
                        ),
                    ));
                }
                (decoded, _, _) => break decoded,
            }
        };
        let ack = match reply {
            Ok(Message::HelloAck(ack)) => ack,
            Ok(Message::Error(e)) => {
                return Err(Reason::new(
                    e.code,
                    format!("prefill {endpoint} refused Hello: {}", e.message),
                ));
            }
            Ok(other) => {
                return Err(Reason::new(
                    FailureCode::BadMessage,
                    format!("prefill {endpoint} answered Hello with {}", other.name()),
                ));
            }
            Err(e) => {
                return Err(Reason::new(
                    FailureCode::BadMessage,
                    format!("prefill {endpoint} answered Hello with garbage: {e}"),
                ));
            }
        };
        if ack.instance != rank.instance_id {
            return Err(Reason::new(
                FailureCode::PeerDead,
                format!(
                    "prefill {endpoint} is instance {} but the registry lists {}: it restarted",
                    ack.instance, rank.instance_id
                ),
            ));
        }
        let peer = Arc::new(Peer {
            instance: ack.instance,
            version: ack.version,
            direct: ack.direct && (self.pool_key.is_some() || self.shared_pool.is_some()),
            endpoint,
            send: tokio::sync::Mutex::new(send),
            last_seen: Mutex::new(Instant::now()),
            gone: self.shutdown.child_token(),
            chunk_key,
            _proof: proof,
            _granted: granted,
        });
        tracing::debug!(prefill = %peer.endpoint, ms = started.elapsed().as_millis() as u64, "prefill answered Hello");
        tokio::spawn(control_loop(self.clone(), peer.clone(), recv));
        tokio::spawn(heartbeat_loop(self.clone(), peer.clone()));
        self.peers().insert(ack.instance, peer.clone());
        Ok(peer)
    }

    pub(super) fn on_control(&self, peer: &Peer, msg: Message) {
        let mut rooms = self.rooms();
        match msg {
            Message::Done(d) => {
                let Some(room) = rooms.get_mut(&d.room) else {
                    return;
                };
                let source = room.sources.iter_mut().find(|s| {
                    s.peer.instance == d.prefill_instance && s.peer.instance == peer.instance
                });
                let Some(source) = source else {
                    drop(rooms);
                    return self.bad_message(
                        "inconsistent",
                        format!(
                            "Done for room {} from instance {}, which serves no part of it",
                            d.room, d.prefill_instance
                        ),
                    );
                };
                source.done = Some(d.clone());
                room.end_writes(peer.instance, Writes::Closed);
                room.progress_at = Instant::now();
                self.check_complete(d.room, room);
            }
            Message::AbortAck(a) => {
                let Some(room) = rooms.get_mut(&a.room) else {
                    return;
                };
                room.end_writes(peer.instance, Writes::Closed);
                if room.status.state() == RoomState::Aborting {
                    room.acks_pending = room.acks_pending.saturating_sub(1);
                    if room.acks_pending == 0 && room.status.advance(RoomState::Aborted) {
                        self.finished(room);
                    }
                }
            }
            // An error that names no room is about the connection: `peer_dead` there says
            // the prefill found this decode dead and forgot it (it was cut off or starved, not
            // dead). The connection is dropped at once, with what the prefill still held for
            // it, and the next room greets again.
            Message::Error(e) if e.room.is_none() && e.code == FailureCode::PeerDead => {
                drop(rooms);
                self.peer_lost(peer, e.message);
            }
            Message::Error(e) => {
                if e.code == FailureCode::PeerDead {
                    // The prefill says this decode asked an instance it no longer is (it
                    // restarted): the group must be looked up again.
                    self.groups.forget();
                }
                let reason =
                    Reason::new(e.code, format!("prefill {}: {}", peer.endpoint, e.message));
                match e.room.and_then(|r| rooms.get_mut(&r)) {
                    // An error is that source's last word on a room being aborted, as an
                    // AbortAck would be: nothing more comes from it.
                    Some(room) if room.status.state() == RoomState::Aborting => {
                        room.end_writes(peer.instance, Writes::Closed);
                        room.acks_pending = room.acks_pending.saturating_sub(1);
                        if room.acks_pending == 0 && room.status.advance(RoomState::Aborted) {
                            self.finished(room);
                        }
                    }
                    Some(room) => {
                        room.end_writes(peer.instance, Writes::Closed);
                        if room.status.fail(reason.clone()) {
                            tracing::warn!(room = e.room, %reason, "room failed");
                            self.finished(room);
                        }
                    }
                    None => {
                        drop(rooms);
                        tracing::warn!(%reason, "prefill reported an error");
                    }
                }
            }
            Message::Abort(a) => {
                // The prefill engine aborted: nothing more of the room is scattered (chunks
                // still on the way are dropped), so it is aborted and acknowledged at once.
                if let Some(room) = rooms.get_mut(&a.room) {
                    room.end_writes(peer.instance, Writes::Closed);
                    if room
                        .sources
                        .iter()
                        .any(|s| s.peer.instance == a.instance && s.peer.instance == peer.instance)
                    {
                        let reason = Reason::new(
                            a.code,
                            format!("prefill {}: {}", peer.endpoint, a.message),
                        );
                        if room.status.abort(reason, true) {
                            self.finished(room);
                        }
                    }
                }
                drop(rooms);
                let ack = Message::AbortAck(protocol::AbortAck {
                    room: a.room,
                    instance: self.instance,
                });
                let (peer, timeout) = (
                    self.peers().get(&peer.instance).cloned(),
                    self.timeouts().send,
                );
                if let Some(peer) = peer {
                    tokio::spawn(async move {
                        if let Err(reason) = peer.send(&ack, timeout).await {
                            tracing::warn!(%reason, "AbortAck not sent");
                        }
                    });
                }
            }
            Message::Heartbeat(beat) => {
                // Rooms this prefill's engine holds queued: their ready timeout starts again.
                for id in beat.rooms {
                    if let Some(room) = rooms.get_mut(&id)
                        && room.status.state() == RoomState::WaitingForInput
                        && room
                            .sources
                            .iter()
                            .any(|s| s.peer.instance == peer.instance)
                    {
                        room.progress_at = Instant::now();
                    }
                }
            }
            other => {
                drop(rooms);
                self.bad_message(
                    "unexpected",
                    format!("prefill sent {} on the control plane", other.name()),
                );
            }
        }
    }

    pub(super) async fn tell_abort(
        &self,
        peer: &Peer,
        room: u64,
        reason: &Reason,
    ) -> Result<(), Reason> {
        let msg = Message::Abort(protocol::Abort {
            room,
            instance: self.instance,
            code: reason.code,
            message: reason.message.clone(),
        });
        peer.send(&msg, self.timeouts().send).await
    }

    /// Fails every room served by a prefill whose connection died or went silent, and forgets
    /// the peer (the next room connects afresh).
    pub(super) fn peer_lost(&self, peer: &Peer, why: String) {
        // Once per connection: a frame it still delivers after it was lost must not end the
        // connection that replaced it.
        if peer.gone.is_cancelled() {
            return;
        }
        peer.gone.cancel();
        self.peers()
            .retain(|_, p| !std::ptr::eq(Arc::as_ptr(p), peer));
        self.groups.forget();
        self.recv_reset.notify_one();
        self.metrics.peers_dead.inc();
        tracing::warn!(prefill = %peer.endpoint, instance = %peer.instance, %why, "prefill peer dead");
        let mut rooms = self.rooms();
        for room in rooms.values_mut() {
            if room
                .sources
                .iter()
                .any(|s| std::ptr::eq(Arc::as_ptr(&s.peer), peer))
            {
                let reason = Reason::new(
                    FailureCode::PeerDead,
                    format!("prefill {}: {why}", peer.endpoint),
                );
                // A prefill declared dead may be alive but cut off: its writes count as
                // possible until its own heartbeat has given up on this decode.
                let until = Instant::now() + self.timeouts().dead_after;
                room.end_writes(peer.instance, Writes::Until(until));
                if room.status.state() == RoomState::Aborting {
                    room.acks_pending = 0;
                    room.status.advance(RoomState::Aborted);
                } else {
                    room.status.fail(reason);
                }
                self.finished(room);
            }
        }
    }
}

impl Decode {
    /// The held rooms to name in a heartbeat to `prefill` (those `room_max` old are dropped).
    pub(super) fn held_at(&self, prefill: Uuid) -> Vec<u64> {
        self.holds
            .live(self.timeouts().room_max)
            .into_iter()
            .filter(|(_, prefills)| prefills.contains(&prefill))
            .map(|(room, _)| room)
            .collect()
    }
}
