//! The prefill agent's control socket: what decode agents send (Hello, TransferRequest, Abort,
//! Credit, Heartbeat, garbage) and the answers; every refusal is an Error with a code.

use crate::agent::prefill::{Peer, Prefill, Room, Transfer};
use crate::agent::room::RoomState;
use crate::layout::PageOrder;
use crate::protocol::{self, Hello, HelloAck, Message, TransferRequest};
use crate::reason::{FailureCode, Reason};
use crate::transport::TransportErrorKind;
use crate::transport::zmq::{ControlEvent, ControlServer, PeerId};
use crate::transport::{self, DataSender, PoolMemory};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{Semaphore, oneshot};

pub(super) async fn control_loop(inner: Arc<Prefill>, mut server: ControlServer) {
    loop {
        let received = tokio::select! {
            () = inner.shutdown.cancelled() => return,
            r = server.recv() => r,
        };
        let (identity, frame) = match received {
            Some(ControlEvent::Frame(identity, frame)) => (identity, frame),
            Some(ControlEvent::Malformed(why)) => {
                inner.metrics.protocol_error("bad_frames");
                tracing::warn!(error = %why, "control socket");
                continue;
            }
            Some(ControlEvent::Refused(identity, why)) => {
                // Told before the connection goes, so that the decode's room says which limit.
                inner.refuse(&identity, None, FailureCode::Unreachable, why);
                continue;
            }
            Some(ControlEvent::Lost(identity, why)) => {
                let peer = inner.peers().get(&identity).cloned();
                if let Some(peer) = peer {
                    inner.peer_dead(&peer, &why);
                }
                continue;
            }
            None => return,
        };
        let peer = inner.peers().get(&identity).cloned();
        if let Some(peer) = &peer {
            peer.seen();
        }
        let inner = inner.clone();
        let decoded = Message::decode(&frame);
        if peer.is_none()
            && let Ok(msg) = &decoded
            && !matches!(msg, Message::Hello(_) | Message::ChallengeReply(_))
            && let Some(why) = inner.reconnected(&identity)
        {
            let room = match msg {
                Message::TransferRequest(r) => Some(r.room),
                _ => None,
            };
            inner.forgot(&identity, room, &why);
            continue;
        }
        match decoded {
            Ok(Message::Hello(h)) => {
                tokio::spawn(inner.on_hello(identity, h, frame));
            }
            Ok(Message::ChallengeReply(reply)) => {
                let waiting = inner.challenges.take(&identity);
                match waiting {
                    Some(tx) => {
                        let _ = tx.send(reply);
                    }
                    None => {
                        inner.metrics.protocol_error("unexpected");
                        let m = "a challenge reply to no challenge".to_owned();
                        inner.refuse(&identity, None, FailureCode::BadMessage, m);
                    }
                }
            }
            Ok(Message::TransferRequest(r)) => inner.on_request(identity, r).await,
            Ok(Message::Abort(a)) => inner.on_abort(identity, a).await,
            Ok(Message::Credit(c)) if peer.as_ref().is_some_and(|p| p.instance == c.instance) => {
                if let Some(peer) = &peer {
                    inner.on_credit(peer, c.slots);
                }
            }
            Ok(Message::Posted(p)) if peer.as_ref().is_some_and(|x| x.instance == p.instance) => {
                let waiting = peer.as_ref().and_then(|peer| {
                    let mut posted = peer.posted.lock().unwrap_or_else(|e| e.into_inner());
                    posted.remove(&p.key)
                });
                match waiting {
                    Some(tx) => {
                        let _ = tx.send(p.accepted);
                    }
                    // The chunk's transfer gave up waiting, or the key is not ours.
                    None => tracing::debug!(key = p.key, "Posted for no placed chunk waiting"),
                }
            }
            Ok(Message::Heartbeat(beat)) => match (&peer, inner.forgotten.why(&identity)) {
                (None, Some(why)) => inner.forgot(&identity, None, &why),
                _ => inner.renew(&identity, &beat.rooms),
            },
            // A decode acknowledges an Abort of this prefill's engine: nothing follows from it.
            Ok(Message::AbortAck(a)) if peer.as_ref().is_some_and(|p| p.instance == a.instance) => {
            }
            Ok(other) => {
                inner.metrics.protocol_error("unexpected");
                let m = format!("a prefill does not accept {} here", other.name());
                inner.refuse(&identity, None, FailureCode::BadMessage, m);
            }
            Err(e) => {
                inner.metrics.protocol_error(e.kind());
                inner.refuse(
                    &identity,
                    None,
                    FailureCode::BadMessage,
                    format!("undecodable frame: {e}"),
                );
            }
        }
    }
}

impl Prefill {
    /// Why a message from `identity`, which is no peer, comes from a decode this prefill knew
    /// on another connection: its routing id is a peer's (or a forgotten one's), so libzmq
    /// re-established its connection (or someone presents its routing id, which travels in
    /// clear). Nothing the first connection proved holds for this one: it must say Hello.
    fn reconnected(&self, identity: &PeerId) -> Option<String> {
        use crate::transport::zmq::control::routing_id;
        let routing = routing_id(identity);
        let known = self.peers().keys().any(|p| routing_id(p) == routing)
            || self.forgotten.knows_routing(routing);
        known.then(|| "its control connection was re-established".to_owned())
    }

    /// Whether the decode on `identity` holds this prefill's token (none: it has none either),
    /// or why not. From [`protocol::TOKEN_PROOFS`] on with a token, the prefill challenges the
    /// decode and waits for its reply (`protocol/challenge.rs`); with an older decode it compares
    /// the token the Hello carries, refused beyond loopback without `--insecure` (this prefill
    /// would send it in clear to the decode's data port too).
    async fn check_token(
        &self,
        identity: &PeerId,
        hello: &Hello,
        frame: &[u8],
        version: u16,
    ) -> Result<(), String> {
        const WRONG: &str = "wrong or missing token in Hello";
        let token = self.cfg.token.as_deref().filter(|t| !t.is_empty());
        // A nonce counts only from a decode of a version that proves the token.
        let nonce = hello.nonce.filter(|_| version >= protocol::TOKEN_PROOFS);
        let Some(decode_nonce) = nonce else {
            if version >= protocol::TOKEN_PROOFS && token.is_some() {
                return Err(format!(
                    "the decode proved no token: it has none, or it took this prefill for one \
                     older than protocol {} (by the registry's entry) and sent the token instead",
                    protocol::TOKEN_PROOFS
                ));
            }
            if !protocol::constant_time_eq(token.unwrap_or("").as_bytes(), hello.token.as_bytes()) {
                return Err(WRONG.to_owned());
            }
            let in_clear = token.and_then(|_| {
                crate::exposure::token_in_clear_refused(
                    "decode",
                    version,
                    &hello.data_endpoint,
                    self.cfg.insecure,
                )
            });
            return in_clear.map_or(Ok(()), Err);
        };
        let Some(token) = token else {
            return Err("the decode has a token, this prefill none".to_owned());
        };
        let prefill_nonce = protocol::Secret::random()
            .map_err(|e| format!("no random bytes for a challenge: {e}"))?;
        let handshake = protocol::Handshake {
            hello: frame,
            decode_nonce: &decode_nonce,
            prefill_nonce: &prefill_nonce,
        };
        let (tx, rx) = oneshot::channel();
        let asked = self.challenges.next(identity, tx);
        self.reply(
            identity,
            Message::Challenge(protocol::Challenge {
                nonce: prefill_nonce,
                proof: handshake.prove(token, protocol::Prover::Prefill),
            }),
        );
        let within = self.timeouts().connect;
        let reply = tokio::time::timeout(within, rx).await;
        let reply = match reply {
            Ok(Ok(reply)) => reply,
            // Another Hello on the same connection took the challenge's place.
            Ok(Err(_)) => return Err("a later Hello superseded this one".to_owned()),
            Err(_) => {
                self.challenges.forget(identity, asked);
                return Err(format!("no answer to the challenge within {within:?}"));
            }
        };
        match handshake.verify(token, protocol::Prover::Decode, &reply.proof) {
            true => Ok(()),
            false => Err("wrong token: the challenge's answer does not prove it".to_owned()),
        }
    }

    async fn on_hello(self: Arc<Self>, identity: PeerId, hello: Hello, frame: bytes::Bytes) {
        tracing::debug!(decode = %hello.instance, data = %hello.data_endpoint, "Hello");
        let refuse = |code, message| self.refuse(&identity, None, code, message);
        let Some(version) = protocol::negotiate(hello.min_version, hello.max_version) else {
            return refuse(
                FailureCode::IncompatibleVersion,
                format!(
                    "decode speaks protocol versions {}..={}, this prefill {}..={}",
                    hello.min_version,
                    hello.max_version,
                    protocol::MIN_VERSION,
                    protocol::VERSION
                ),
            );
        };
        if let Err(why) = self.check_token(&identity, &hello, &frame, version).await {
            tracing::warn!(decode = %hello.instance, %why, "Hello refused: the token");
            return refuse(FailureCode::Unauthorized, why);
        }
        if hello.role != protocol::Role::Decode {
            self.metrics.protocol_error("inconsistent");
            return refuse(
                FailureCode::BadMessage,
                "Hello to a prefill must come from a decode".to_owned(),
            );
        }
        if hello.slots == 0 || hello.slot_bytes == 0 {
            self.metrics.protocol_error("inconsistent");
            return refuse(
                FailureCode::BadMessage,
                "Hello grants no staging slots".to_owned(),
            );
        }
        if let Err(reason) = crate::agent::check_compatible(
            &crate::agent::wire_layout(&self.cfg.layout),
            &hello.layout,
            version,
        ) {
            return refuse(reason.code, reason.message);
        }
        let checked = hello
            .pool
            .as_ref()
            .map_or(Ok(()), |pool| self.transport.check_memory(pool))
            .and_then(|()| {
                let file = hello.shared_pool.as_ref();
                file.map_or(Ok(()), transport::mapped::check_key)
            });
        let connected = match checked {
            Ok(()) => {
                let timeout = self.timeouts().connect;
                let credentials = transport::Credentials {
                    proof: protocol::data_proof(version, &hello.chunk_key),
                    token_in_clear: version < protocol::TOKEN_PROOFS,
                };
                self.transport
                    .connect(&hello.data_endpoint, timeout, credentials)
                    .await
            }
            Err(e) => Err(e),
        };
        let mut data = match connected {
            Ok(d) => d,
            Err(e) if e.is_malformed() => {
                self.metrics.protocol_error("malformed");
                let msg = format!("decode data endpoint or pool key refused: {e}");
                return refuse(FailureCode::BadMessage, msg);
            }
            Err(e) if e.kind == TransportErrorKind::Incompatible => {
                let msg = format!("decode data endpoint refused: {}", e.message);
                return refuse(FailureCode::IncompatibleVersion, msg);
            }
            Err(e) if e.kind == TransportErrorKind::Unauthorized => {
                let msg = format!(
                    "decode data endpoint {} refused this prefill: {}",
                    hello.data_endpoint, e.message
                );
                return refuse(FailureCode::Unauthorized, msg);
            }
            Err(e) => {
                let msg = format!(
                    "decode data endpoint {} unreachable from this prefill: {}",
                    hello.data_endpoint, e.message
                );
                return refuse(FailureCode::Unreachable, msg);
            }
        };
        let direct_target = self.direct_target(&hello, version, &mut data).await;
        // A decode older than `PIECES` takes a chunk's payload in one frame only.
        let from_pool = data.sends_from_pool() && version >= protocol::PIECES;
        // Only one-sided writers are announced: placed runs land where the decode posts them.
        let direct = direct_target.as_ref().is_some_and(|t| {
            t.ways
                .iter()
                .any(|w| w.method() == crate::agent::DirectMethod::Write)
        });
        let slots = (hello.slots as usize).min(Semaphore::MAX_PERMITS);
        let peer = Arc::new(Peer {
            instance: hello.instance,
            version,
            identity: identity.clone(),
            data_endpoint: hello.data_endpoint,
            data: tokio::sync::Mutex::new(data),
            credits: Semaphore::new(slots),
            slots,
            slot_bytes: hello.slot_bytes as usize,
            last_seen: Mutex::new(Instant::now()),
            direct: direct_target,
            from_pool,
            posted: Mutex::new(HashMap::new()),
            chunk_key: hello.chunk_key,
            page_size: hello.layout.page_size as usize,
        });
        if let Some(old) = self.peers().insert(identity.clone(), peer) {
            old.credits.close();
        }
        self.forgotten.greeted(&identity);
        tracing::info!(decode = %hello.instance, version, slots, direct, "decode peer connected");
        self.reply(
            &identity,
            Message::HelloAck(HelloAck {
                version,
                instance: self.instance,
                direct,
            }),
        );
    }

    /// A decode's heartbeat names the rooms its engine holds queued requests for: each that is
    /// ready here and not asked for yet lives a TTL from now, up to `--room-max-ms` after its
    /// announcement, while the pages this decode holds stay within `--max-held-pages` (a
    /// room past that is not renewed: it expires at its TTL). Only from a decode that said
    /// Hello; one decode's holds never touch another's budget or rooms it did not name.
    fn renew(&self, identity: &PeerId, held: &[u64]) {
        let Some(decode) = self.peers().get(identity).map(|p| p.instance) else {
            return;
        };
        if held.is_empty() {
            return;
        }
        let max_ms = self.timeouts().room_max.as_secs_f64() * 1e3;
        let now = Instant::now();
        let mut rooms = self.rooms();
        let pages = |room: &super::Room| room.ready.as_ref().map_or(0, |r| r.pages.len());
        let mut holding: usize = (rooms.values())
            .filter(|r| r.holder() == Some(decode))
            .map(pages)
            .sum();
        let mut refused = 0;
        for id in held {
            let Some(room) = rooms.get_mut(id) else {
                continue;
            };
            let age = super::super::room::now_ms() - room.status.at("created").unwrap_or(0.0);
            if room.ready.is_none() || room.asked() || age >= max_ms {
                continue;
            }
            if room.holder() != Some(decode) {
                if holding + pages(room) > self.cfg.max_held_pages {
                    refused += 1;
                    continue;
                }
                holding += pages(room);
            }
            room.renewed = Some((now, decode));
        }
        drop(rooms);
        if refused > 0 {
            // Every heartbeat names them again: said at debug level, the rooms' expiry says it.
            tracing::debug!(%decode, holding, refused, limit = self.cfg.max_held_pages, "holds past this decode's --max-held-pages not renewed: those rooms expire at their TTL");
        }
    }

    async fn on_request(self: Arc<Self>, identity: PeerId, req: TransferRequest) {
        let room_id = req.room;
        let peer = self.peers().get(&identity).cloned();
        let Some(peer) = peer else {
            if let Some(why) = self.forgotten.why(&identity) {
                return self.forgot(&identity, Some(room_id), &why);
            }
            self.metrics.protocol_error("inconsistent");
            let m = "TransferRequest before Hello".to_owned();
            return self.refuse(&identity, Some(room_id), FailureCode::BadMessage, m);
        };
        if req.prefill_instance != self.instance {
            self.metrics.protocol_error("inconsistent");
            let m = format!(
                "request addressed instance {}, this prefill is {}: it restarted",
                req.prefill_instance, self.instance
            );
            return self.refuse(&identity, Some(room_id), FailureCode::PeerDead, m);
        }
        let l = &self.cfg.layout;
        let within = |r: &Range<u32>, held: &Range<usize>| {
            r.start as usize >= held.start && r.end as usize <= held.end && !r.is_empty()
        };
        // Page blocks of other sizes line up only as plain token rows, or vLLM CPU vec pages
        // re-blocked.
        let rows = peer.page_size == l.page_size
            || req.wire_order == PageOrder::TokenMajor
            || (req.wire_order == PageOrder::VllmCpuVecSpan && l.order == PageOrder::VllmCpuVec);
        if !within(&req.layers, &l.layers)
            || !within(&req.heads, &l.heads)
            || req.tokens.is_empty()
            || req.requesters == 0
            || !rows
        {
            self.metrics.protocol_error("inconsistent");
            let m = format!(
                "request for layers {:?} heads {:?} tokens {:?} ({} requesters) in {} order from a pool of {}-token pages; this rank holds layers {:?} heads {:?} in {}-token pages",
                req.layers,
                req.heads,
                req.tokens,
                req.requesters,
                req.wire_order,
                peer.page_size,
                l.layers,
                l.heads,
                l.page_size
            );
            return self.refuse(&identity, Some(room_id), FailureCode::BadMessage, m);
        }
        if let Err(why) = self.open_read(room_id, &req, peer.page_size).await {
            return self.refuse(&identity, Some(room_id), why.code, why.message);
        }
        enum Refusal {
            Abort(Reason),
            Error(Reason),
        }
        let refusal = {
            let mut rooms = self.rooms();
            let expired = match rooms.contains_key(&room_id) {
                true => None,
                false => self.expired().ago(room_id),
            };
            if let Some((ago, held)) = expired {
                drop(rooms);
                let t = self.timeouts();
                let m = match held {
                    false => format!(
                        "room {room_id} expired here {} ms ago: its KV was ready for {} ms and no decode asked for it (--room-ttl-ms)",
                        ago.as_millis(),
                        t.room_ttl.as_millis()
                    ),
                    true => format!(
                        "room {room_id} expired here {} ms ago: a decode held it for a queued request, but none asked for it within {} ms of its announcement (--room-max-ms) or {} ms of the last hold (--room-ttl-ms)",
                        ago.as_millis(),
                        t.room_max.as_millis(),
                        t.room_ttl.as_millis()
                    ),
                };
                return self.refuse(&identity, Some(room_id), FailureCode::UnknownRoom, m);
            }
            let room = rooms.entry(room_id).or_insert_with(Room::new);
            if let Some(reason) = self.misfit(room_id, room.key, room.digest, &req, peer.instance) {
                Some(Refusal::Error(reason))
            } else if let Some(reason) = room.engine_abort.clone() {
                // The prefill engine aborted the room before this request: say so.
                Some(Refusal::Abort(reason))
            } else if room.transfers.contains_key(&peer.instance) {
                self.metrics.protocol_error("inconsistent");
                Some(Refusal::Error(Reason::new(
                    FailureCode::BadMessage,
                    format!("room {room_id} was already requested or aborted by this decode"),
                )))
            } else if room.status.state().is_final() {
                // Another decode's request ended it: delivered (that decode died after it
                // landed), failed or aborted.
                let why = room.status.reason().map(|r| format!(": {r}"));
                Some(Refusal::Error(Reason::new(
                    FailureCode::UnknownRoom,
                    format!(
                        "room {room_id} is {} here, for another decode{}",
                        room.status.state().name(),
                        why.unwrap_or_default()
                    ),
                )))
            } else {
                room.status.mark_first("requested");
                room.requesters = room.requesters.max(req.requesters as usize);
                room.transfers
                    .insert(peer.instance, Transfer::new(peer, Some(req)));
                room.status.advance(RoomState::WaitingForInput);
                self.start_ready(room_id, room);
                None
            }
        };
        match refusal {
            Some(Refusal::Error(reason)) => {
                self.refuse(&identity, Some(room_id), reason.code, reason.message);
            }
            Some(Refusal::Abort(reason)) => {
                let msg = Message::Abort(protocol::Abort {
                    room: room_id,
                    instance: self.instance,
                    code: reason.code,
                    message: reason.message,
                });
                self.reply(&identity, msg);
            }
            None => {}
        }
    }

    async fn on_abort(self: Arc<Self>, identity: PeerId, abort: protocol::Abort) {
        let room = abort.room;
        let Some(peer) = self.peers().get(&identity).cloned() else {
            if let Some(why) = self.forgotten.why(&identity) {
                return self.forgot(&identity, Some(abort.room), &why);
            }
            self.metrics.protocol_error("inconsistent");
            let m = "Abort before Hello".to_owned();
            return self.refuse(&identity, Some(abort.room), FailureCode::BadMessage, m);
        };
        let running = {
            let mut rooms = self.rooms();
            if self.cfg.serve_reads && !rooms.contains_key(&abort.room) {
                // A read this prefill served and forgot (its room is gone at the next tick
                // once final): nothing is in flight, and no read names its room again.
                false
            } else {
                self.end_for_abort(&mut rooms, &peer, abort)
            }
        };
        // A running transfer acknowledges when its task stops; otherwise nothing is in flight.
        if !running {
            let ack = Message::AbortAck(protocol::AbortAck {
                room,
                instance: self.instance,
            });
            self.reply(&identity, ack);
        }
    }

    /// Ends `abort`'s room for `peer` (a tombstone if its request has not come yet); whether
    /// its transfer is still running (it then acknowledges when it stops).
    fn end_for_abort(
        &self,
        rooms: &mut HashMap<u64, Room>,
        peer: &Arc<Peer>,
        abort: protocol::Abort,
    ) -> bool {
        let room = rooms.entry(abort.room).or_insert_with(Room::new);
        let reason = Reason::new(abort.code, abort.message);
        let t = room
            .transfers
            .entry(peer.instance)
            // The abort overtook its request: a tombstone refuses the late request.
            .or_insert_with(|| Transfer::new(peer.clone(), None));
        t.cancel.cancel();
        t.abort_reason = Some(reason.clone());
        let running = t.running;
        if !running {
            t.end(RoomState::Aborted, Some(reason.clone()));
            self.settle(room);
        }
        // A decode let the room go without asking (its engine computed the prompt itself,
        // or dropped the request): with no other decode asking, the room waits
        // `--requeue-ms` for one, as a lost decode's does, not its whole TTL.
        if !room.asked() && !room.status.state().is_final() && room.requeued.is_none() {
            room.let_go = Some((Instant::now(), reason));
        }
        running
    }

    /// The ways into the decode's pool, best first: the pool's memory file, when the decode
    /// shares it, is on this host and `--mapped-writes` allows it; the transport's own, when
    /// the decode exposed its pool to it and `--direct-writes` allows the way the writes would
    /// travel (first with `always`, which is for measuring them). A device pool (where the
    /// transport moves device memory) goes by the transport's placed runs only. None: every
    /// chunk to this decode is staged.
    async fn direct_target(
        &self,
        hello: &Hello,
        version: u16,
        data: &mut Box<dyn DataSender>,
    ) -> Option<super::DirectTarget> {
        // Engine regions apart from each other, or pages that move only whole, stay staged.
        let head_granular = self.cfg.layout.order.granularity() == crate::layout::Granularity::Head;
        if self.cfg.direct_writes == crate::agent::DirectWrites::Never || head_granular {
            return None;
        }
        // A device pool goes only by placed runs: never mapped, never the source of puts.
        let from_host = match self.pool.direct()? {
            PoolMemory::Host(_) => true,
            PoolMemory::Device(_) => false,
        };
        let decode = hello.instance;
        let mut ways = Vec::new();
        let shared = hello
            .shared_pool
            .clone()
            .filter(|_| from_host && crate::agent::maps_pools(&self.cfg));
        if let Some(memory) = shared {
            let (size, endpoint) = (memory.size, hello.data_endpoint.clone());
            let attached =
                tokio::task::spawn_blocking(move || transport::mapped::attach(&memory, &endpoint))
                    .await;
            match attached {
                Ok(Ok(mapped)) => ways.push((super::Way::Mapped(Arc::new(mapped)), size)),
                // A decode on another host (or network namespace) shares its file in vain.
                Ok(Err(e)) => tracing::info!(%decode, error = %e, "decode pool file not mapped"),
                Err(e) => tracing::warn!(%decode, error = %e, "decode pool file not mapped"),
            }
        }
        if let Some(memory) = &hello.pool {
            match data.attach(memory.clone()).await {
                Ok(Some(path)) => {
                    let path = match from_host {
                        true => path,
                        false => transport::WritePath {
                            writes: false,
                            fast: false,
                            ..path
                        },
                    };
                    match self.cfg.direct_writes.method(&path, hello.revocable_runs) {
                        Some(method) => {
                            // Its unpack callback lands each part of a run in place.
                            let scatter = hello.revocable_runs && version >= protocol::SCATTERED;
                            let way = super::Way::Transport {
                                path,
                                method,
                                scatter,
                            };
                            let way = (way, memory.size);
                            match self.cfg.direct_writes {
                                crate::agent::DirectWrites::Always => ways.insert(0, way),
                                _ => ways.push(way),
                            }
                        }
                        None => {
                            tracing::info!(%decode, via = %path.via, "no fast, safe direct path of the transport here");
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(%decode, error = %e, "decode pool not attached"),
            }
        }
        if ways.is_empty() {
            return None;
        }
        match super::DirectTarget::new(hello, ways) {
            Ok(target) => {
                let via: Vec<&str> = target.ways.iter().map(super::Way::via).collect();
                tracing::info!(%decode, via = %via.join(" then "), pages = target.num_pages, "direct path into the decode pool");
                Some(target)
            }
            Err(why) => {
                tracing::warn!(%decode, %why, "decode pool unusable for direct writes; staging");
                None
            }
        }
    }

    fn on_credit(&self, peer: &Peer, slots: u32) {
        let room_for = peer.slots.saturating_sub(peer.credits.available_permits());
        let granted = (slots as usize).min(room_for);
        if granted < slots as usize {
            self.metrics.protocol_error("inconsistent");
            tracing::warn!(decode = %peer.instance, slots, "credit beyond the granted slots ignored");
        }
        peer.credits.add_permits(granted);
    }
}
