//! The decode agent: takes room requests from the decode engine, resolves the prefill group
//! through the registry, says Hello once per prefill instance, asks for each room with a
//! TransferRequest, scatters arriving chunks into the decode pool, and keeps each landed room
//! until the engine takes it (remove-after-retrieve) or it expires.
//!
//! A room is `success` only when Done has arrived *and* every expected byte has landed: the
//! agent counts completions instead of trusting one notification (design.md part 9). Chunks
//! are checked before a byte moves: known room, the epoch (prefill instance) the room was
//! requested from, ranges within the request, no (layer, token) landed twice, payload length.
//!
//! Page safety: with staged transports this agent is the only writer of its pool, so a room's
//! pages are safe to reuse once the room is final and no scatter of it is still running.
//!
//! Current limits (later issues): one prefill rank per DP group (no TP/PP pairing yet), no
//! heartbeats (a dead prefill is noticed when its control connection fails).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvferry_bootstrap::{ClientError, PrefillGroup, Registration, RegistryClient, Role};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use uuid::Uuid;

use super::api::{self, ApiError};
use super::metrics::{Gauges, Metrics};
use super::pairing::{self, RankSlice};
use super::room::{RoomState, RoomStatus};
use super::{AgentConfig, Coverage, synthetic};
use crate::kernel::Selection;
use crate::kernel::cpu::CpuKernel;
use crate::layout::{KvLayout, PageOrder};
use crate::pool::HostPool;
use crate::pool::allocator::{PageAllocator, PageLease};
use crate::protocol::{self, Chunk, Hello, Message, TransferRequest};
use crate::reason::{FailureCode, Reason};
use crate::transport::zmq::{ControlClient, ControlClientRecv, ControlClientSend};
use crate::transport::{self, DataReceiver};

/// A running decode agent.
pub struct DecodeAgent {
    /// The engine-facing HTTP API, e.g. `http://127.0.0.1:40111`.
    pub api_url: String,
    /// This process's instance id.
    pub instance: Uuid,
    /// Where prefill agents send data.
    pub data_endpoint: String,
    tasks: tokio::task::JoinSet<()>,
    keep_alive: kvferry_bootstrap::KeepAlive,
    inner: Arc<Inner>,
}

impl DecodeAgent {
    /// Starts the agent; it serves until `shutdown` is cancelled.
    pub async fn start(
        cfg: AgentConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, super::AgentError> {
        let instance = Uuid::new_v4();
        let pool = Arc::new(super::open_pool(&cfg)?);
        let alloc = PageAllocator::new(cfg.pool_pages as u32);
        let registry = RegistryClient::new(cfg.bootstrap.clone(), cfg.token.clone())?;
        let (data_endpoint, receiver) =
            transport::for_kind(cfg.transport).listen(&cfg.host).await?;
        let listener = tokio::net::TcpListener::bind((cfg.api_host.as_str(), cfg.api_port)).await?;
        let api_url = format!("http://{}", listener.local_addr()?);
        let inner = Arc::new(Inner {
            instance,
            pool,
            alloc,
            kernel: CpuKernel::new(cfg.copy_threads),
            registry: registry.clone(),
            data_endpoint: data_endpoint.clone(),
            rooms: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            connecting: tokio::sync::Mutex::new(()),
            metrics: Metrics::new("decode"),
            draining: std::sync::atomic::AtomicBool::new(false),
            stuck_warned: Mutex::new(None),
            shutdown: shutdown.clone(),
            cfg,
        });
        let endpoints = [(inner.cfg.transport.name().to_owned(), data_endpoint.clone())].into();
        let reg = super::registration(
            Role::Decode,
            instance,
            &inner.cfg,
            api_url.clone(),
            endpoints,
        );
        let keep_alive = registry.keep_alive(reg, shutdown.clone()).await?;

        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(receive_chunks(inner.clone(), receiver));
        tasks.spawn(expire_rooms(inner.clone()));
        let app = routes(inner.clone());
        let stop = shutdown.clone();
        tasks.spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "decode API stopped");
            }
        });
        tracing::info!(%instance, api = %api_url, data = %data_endpoint, "decode agent listening");
        Ok(DecodeAgent {
            api_url,
            instance,
            data_endpoint,
            tasks,
            keep_alive,
            inner,
        })
    }

    /// Stops accepting rooms (503), lets in-flight rooms finish for up to the drain timeout,
    /// then aborts the rest. Landed rooms stay takeable until shutdown.
    pub async fn drain(&self) {
        let inner = &self.inner;
        inner
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let deadline = Instant::now() + inner.cfg.timeouts.drain;
        let in_flight = || {
            inner
                .rooms()
                .values()
                .filter(|r| !r.status.state().is_final())
                .count()
        };
        while in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left: Vec<u64> = inner
            .rooms()
            .iter()
            .filter(|(_, r)| !r.status.state().is_final())
            .map(|(id, _)| *id)
            .collect();
        tracing::info!(aborted = left.len(), "drained");
        for room in left {
            inner
                .abort(
                    room,
                    Reason::new(FailureCode::Shutdown, "the decode agent is shutting down"),
                )
                .await;
        }
    }

    /// Waits for the agent's tasks to end after shutdown was cancelled, and deregisters.
    pub async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
        self.keep_alive.stopped().await;
    }
}

struct Inner {
    cfg: AgentConfig,
    instance: Uuid,
    pool: Arc<HostPool>,
    alloc: PageAllocator,
    kernel: CpuKernel,
    registry: RegistryClient,
    data_endpoint: String,
    rooms: Mutex<HashMap<u64, Room>>,
    /// Control connections by prefill instance.
    peers: Mutex<HashMap<Uuid, Arc<Peer>>>,
    /// Held while connecting, so two rooms do not both say Hello to one prefill.
    connecting: tokio::sync::Mutex<()>,
    metrics: Metrics,
    /// Set by SIGTERM: new rooms are refused.
    draining: std::sync::atomic::AtomicBool,
    /// When stuck rooms were last warned about.
    stuck_warned: Mutex<Option<Instant>>,
    shutdown: CancellationToken,
}

struct Peer {
    instance: Uuid,
    endpoint: String,
    send: tokio::sync::Mutex<ControlClientSend>,
    last_seen: Mutex<Instant>,
    /// Cancelled when the peer is declared dead: its tasks stop.
    gone: CancellationToken,
}

impl Peer {
    async fn send(&self, msg: &Message, timeout: Duration) -> Result<(), Reason> {
        let frame = msg.encode().into();
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

/// A chunk admitted for scattering: the room's pages, the destination selection (its page
/// list filled in on the blocking thread) and the wire order.
struct Admitted {
    pages: Arc<[u32]>,
    sel: Selection<'static>,
    wire: PageOrder,
    /// Index of the room's source the chunk belongs to.
    source: usize,
}

struct Room {
    status: RoomStatus,
    tokens: usize,
    /// The first token requested; earlier ones are the decode engine's own prefix.
    start_token: usize,
    pages: Arc<[u32]>,
    /// Present when the agent allocated the pages; dropping it returns them.
    lease: Option<PageLease>,
    expected: usize,
    landed: usize,
    chunks: u32,
    coverage: Coverage,
    /// The prefill ranks the room comes from, one bulk segment each (see `pairing.rs`).
    sources: Vec<Source>,
    /// AbortAcks still awaited while aborting.
    acks_pending: usize,
    scattering: usize,
    final_at: Option<Instant>,
    /// The last sign of life of the room's transfer (request sent, chunk landed, Done): the
    /// ready and stall timeouts count from it.
    progress_at: Instant,
}

/// One segment of a room: what one prefill rank sends.
struct Source {
    peer: Arc<Peer>,
    /// Global layers.
    layers: std::ops::Range<usize>,
    /// Global heads.
    heads: std::ops::Range<usize>,
    expected: usize,
    landed: usize,
    chunks: u32,
    done: Option<protocol::Done>,
}

impl Room {
    /// No write into the room's pages can still arrive (see the module doc).
    fn safe_to_reuse(&self) -> bool {
        self.status.state().is_final() && self.scattering == 0
    }

    fn view(&self, room: u64) -> serde_json::Value {
        serde_json::json!({
            "room": room.to_string(),
            "state": self.status.state(),
            "reason": self.status.reason(),
            "bytes": self.landed,
            "expected_bytes": self.expected,
            "tokens": self.tokens,
            "start_token": self.start_token,
            "chunks": self.chunks,
            "pages": &*self.pages,
            "page_owner": if self.lease.is_some() { "agent" } else { "engine" },
            "sources": self.sources.iter().map(|s| serde_json::json!({
                "prefill_instance": s.peer.instance.to_string(),
                "layers": [s.layers.start, s.layers.end],
                "heads": [s.heads.start, s.heads.end],
                "bytes": s.landed,
                "done": s.done.is_some(),
            })).collect::<Vec<_>>(),
            "timings": self.status.timings_json(),
            "safe_to_reuse": self.safe_to_reuse(),
        })
    }
}

impl Inner {
    fn rooms(&self) -> MutexGuard<'_, HashMap<u64, Room>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn peers(&self) -> MutexGuard<'_, HashMap<Uuid, Arc<Peer>>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a move to a final state: timestamp for expiry, metrics.
    fn finished(&self, room: &mut Room) {
        if room.status.state().is_final() && room.final_at.is_none() {
            room.final_at = Some(Instant::now());
            let code = room.status.reason().map(|r| r.code);
            self.metrics.room_final(room.status.state(), code);
        }
    }

    fn fail(&self, room_id: u64, reason: Reason) {
        let mut rooms = self.rooms();
        if let Some(room) = rooms.get_mut(&room_id) {
            if room.status.fail(reason.clone()) {
                tracing::warn!(room = room_id, %reason, "room failed");
                self.finished(room);
            }
        }
    }

    /// A room is complete when every source said Done and every expected byte landed; a
    /// source whose Done disagrees with what landed fails it.
    fn check_complete(&self, room_id: u64, room: &mut Room) {
        if room.sources.is_empty() || room.sources.iter().any(|s| s.done.is_none()) {
            return;
        }
        if room.landed < room.expected || room.scattering > 0 {
            return;
        }
        let wrong = room.sources.iter().find_map(|s| {
            let d = s.done.as_ref()?;
            (d.bytes as usize != s.expected || d.chunks != s.chunks || s.landed != s.expected).then(|| {
                format!(
                    "prefill {} reported {} bytes in {} chunks; {} bytes expected, {} in {} chunks landed",
                    s.peer.endpoint, d.bytes, d.chunks, s.expected, s.landed, s.chunks
                )
            })
        });
        if let Some(message) = wrong {
            room.status
                .fail(Reason::new(FailureCode::BadMessage, message));
        } else {
            room.status.advance(RoomState::Success);
            if let (Some(a), Some(b)) = (
                room.status.entered(RoomState::WaitingForInput),
                room.status.entered(RoomState::Success),
            ) {
                self.metrics
                    .transfer
                    .observe(Duration::from_secs_f64(((b - a) / 1e3).max(0.0)));
            }
            tracing::debug!(room = room_id, bytes = room.landed, "room landed");
        }
        self.finished(room);
    }

    /// Asks the registry for the prefill group until it is complete or the timeout passes.
    async fn lookup(&self, client: &RegistryClient, dp_rank: u32) -> Result<PrefillGroup, Reason> {
        let deadline = Instant::now() + self.cfg.timeouts.bootstrap;
        loop {
            match client.lookup_prefill(dp_rank).await {
                Ok(group) => return Ok(group),
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tracing::debug!(error = %e, "prefill group not ready; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    let code = match e {
                        ClientError::Incomplete { .. } | ClientError::Unreachable { .. } => {
                            FailureCode::TimeoutBootstrap
                        }
                        _ => FailureCode::Unreachable,
                    };
                    return Err(Reason::new(
                        code,
                        format!(
                            "prefill group dp_rank={dp_rank} at {}: {e}",
                            client.base_url()
                        ),
                    ));
                }
            }
        }
    }

    /// The control connection to a prefill instance, connecting and saying Hello if needed.
    async fn peer(self: &Arc<Self>, rank: &Registration) -> Result<Arc<Peer>, Reason> {
        let _connecting = self.connecting.lock().await;
        if let Some(p) = self.peers().get(&rank.instance_id) {
            return Ok(p.clone());
        }
        let endpoint = rank.control_endpoint.clone();
        let timeout = self.cfg.timeouts.connect;
        let unreachable = |what: String| {
            Reason::new(
                FailureCode::Unreachable,
                format!("prefill control endpoint {endpoint}: {what}"),
            )
        };
        let ControlClient { mut send, mut recv } = ControlClient::connect(&endpoint, timeout)
            .await
            .map_err(|e| unreachable(e.message))?;
        let hello = Message::Hello(Hello {
            min_version: protocol::MIN_VERSION,
            max_version: protocol::VERSION,
            instance: self.instance,
            role: protocol::Role::Decode,
            ranks: self.cfg.ranks,
            layout: super::wire_layout(&self.cfg.layout),
            data_endpoint: self.data_endpoint.clone(),
            token: self.cfg.token.clone().unwrap_or_default(),
            slots: self.cfg.staging_slots as u32,
            slot_bytes: u32::try_from(self.cfg.chunk_bytes).unwrap_or(u32::MAX),
        });
        send.send(hello.encode().into())
            .await
            .map_err(|e| unreachable(e.message))?;
        let reply = tokio::time::timeout(timeout, recv.recv())
            .await
            .map_err(|_| unreachable(format!("no answer to Hello within {timeout:?}")))?
            .map_err(|e| unreachable(e.message))?;
        let ack = match Message::decode(&reply) {
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
            endpoint,
            send: tokio::sync::Mutex::new(send),
            last_seen: Mutex::new(Instant::now()),
            gone: self.shutdown.child_token(),
        });
        tokio::spawn(control_loop(self.clone(), peer.clone(), recv));
        tokio::spawn(heartbeat_loop(self.clone(), peer.clone()));
        self.peers().insert(ack.instance, peer.clone());
        Ok(peer)
    }

    /// Resolves the prefill, says Hello if needed, and asks for the room.
    async fn request(
        self: Arc<Self>,
        room_id: u64,
        bootstrap: Option<String>,
        dp_rank: Option<u32>,
    ) -> Result<(), Reason> {
        let client = match bootstrap {
            Some(url) => RegistryClient::new(url, self.cfg.token.clone())
                .map_err(|e| Reason::new(FailureCode::Unreachable, e.to_string()))?,
            None => self.registry.clone(),
        };
        // The prefill DP group: the engine's choice, or the room modulo the prefill DP size.
        let group = match dp_rank {
            Some(d) => self.lookup(&client, d).await?,
            None => {
                let first = self.lookup(&client, 0).await?;
                match (room_id % u64::from(first.dp_size.max(1))) as u32 {
                    0 => first,
                    d => self.lookup(&client, d).await?,
                }
            }
        };
        let dp_rank = group.dp_rank;
        let ranks = group.ranks;
        let l = &self.cfg.layout;
        let slices: Vec<RankSlice> = ranks
            .iter()
            .map(|r| RankSlice {
                heads: r.slice.heads.start as usize..r.slice.heads.end as usize,
                layers: r.slice.layers.start as usize..r.slice.layers.end as usize,
            })
            .collect();
        let ours = RankSlice {
            heads: l.heads.clone(),
            layers: l.layers.clone(),
        };
        let tp_rank = self.cfg.ranks.tp_rank as usize;
        let segments = pairing::plan(&slices, &ours, tp_rank).map_err(|e| {
            Reason::new(
                FailureCode::IncompatibleLayout,
                format!("prefill group dp_rank={dp_rank}: {e}"),
            )
        })?;
        let decodes = self.decode_group()?;
        let mut sources = Vec::with_capacity(segments.len());
        for seg in segments {
            let peer = self.peer(&ranks[seg.prefill]).await?;
            let requesters = pairing::requesters(&slices, &decodes, seg.prefill);
            sources.push((peer, seg, requesters));
        }
        let (tokens, pages) = {
            let mut rooms = self.rooms();
            let Some(room) = rooms.get_mut(&room_id) else {
                return Ok(());
            };
            if !room.status.advance(RoomState::WaitingForInput) {
                return Ok(()); // aborted meanwhile
            }
            let tokens = room.start_token..room.tokens;
            self.metrics.bootstrap.observe(room.progress_at.elapsed());
            room.progress_at = Instant::now();
            room.sources = sources
                .iter()
                .map(|(peer, seg, _)| Source {
                    peer: peer.clone(),
                    layers: seg.layers.clone(),
                    heads: seg.heads.clone(),
                    expected: l
                        .selection_bytes(tokens.len(), seg.layers.len(), seg.heads.len())
                        .unwrap_or(usize::MAX),
                    landed: 0,
                    chunks: 0,
                    done: None,
                })
                .collect();
            (tokens, room.pages.to_vec())
        };
        for (peer, seg, requesters) in sources {
            let req = Message::TransferRequest(TransferRequest {
                room: room_id,
                prefill_instance: peer.instance,
                tokens: tokens.start as u32..tokens.end as u32,
                layers: seg.layers.start as u32..seg.layers.end as u32,
                heads: seg.heads.start as u32..seg.heads.end as u32,
                // The decode's own order makes its scatter long runs; the prefill's gather
                // converts.
                wire_order: l.order,
                dst_pages: pages.clone(),
                requesters: requesters as u32,
            });
            peer.send(&req, self.cfg.timeouts.send).await?;
        }
        Ok(())
    }

    /// The slices (and TP ranks) of every decode rank of this agent's group, for
    /// [`pairing::requesters`].
    fn decode_group(&self) -> Result<Vec<(RankSlice, usize)>, Reason> {
        let l = &self.cfg.layout;
        let r = self.cfg.ranks;
        let whole = KvLayout::new(l.model, l.page_size)
            .map_err(|e| Reason::new(FailureCode::IncompatibleLayout, e.to_string()))?;
        let mut out = Vec::new();
        for pp in 0..r.pp_size as usize {
            for tp in 0..r.tp_size as usize {
                let s = whole
                    .clone()
                    .for_rank(tp, r.tp_size as usize, pp, r.pp_size as usize)
                    .map_err(|e| Reason::new(FailureCode::IncompatibleLayout, e.to_string()))?;
                out.push((
                    RankSlice {
                        heads: s.heads,
                        layers: s.layers,
                    },
                    tp,
                ));
            }
        }
        Ok(out)
    }

    /// Validates a chunk against its room and reserves it; returns what the scatter needs.
    fn admit_chunk(&self, c: &Chunk, payload_len: usize) -> Result<Admitted, Option<Reason>> {
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
    async fn on_chunk(self: &Arc<Self>, header: Bytes, payload: Bytes) {
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

    async fn land(self: &Arc<Self>, chunk: &Chunk, payload: Bytes) {
        let Admitted {
            pages,
            sel,
            wire,
            source,
        } = match self.admit_chunk(chunk, payload.len()) {
            Ok(v) => v,
            Err(None) => return,
            Err(Some(reason)) => {
                self.metrics.protocol_error("inconsistent");
                return self.fail(chunk.room, reason);
            }
        };
        let (pool, kernel) = (self.pool.clone(), self.kernel);
        let (verify, sent_sum) = (self.cfg.checksum, chunk.checksum);
        let started = Instant::now();
        let scattered = tokio::task::spawn_blocking(move || {
            if verify {
                let sum = super::checksum(&payload);
                if sent_sum != sum {
                    return Ok(Err(format!("checksum {sum:#018x} of the landed bytes differs from the sender's {sent_sum:#018x}")));
                }
            }
            let sel = Selection {
                pages: &pages,
                ..sel
            };
            kernel.scatter(&payload, wire, &pool, &sel).map(Ok)
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
                self.metrics.scatter.observe(started.elapsed());
                self.metrics
                    .chunks_staged
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

    fn bad_message(&self, kind: &'static str, what: String) {
        self.metrics.protocol_error(kind);
        tracing::warn!(kind, %what, "refused a message");
    }

    fn on_control(&self, peer: &Peer, msg: Message) {
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
                room.progress_at = Instant::now();
                self.check_complete(d.room, room);
            }
            Message::AbortAck(a) => {
                let Some(room) = rooms.get_mut(&a.room) else {
                    return;
                };
                if room.status.state() == RoomState::Aborting {
                    room.acks_pending = room.acks_pending.saturating_sub(1);
                    if room.acks_pending == 0 && room.status.advance(RoomState::Aborted) {
                        self.finished(room);
                    }
                }
            }
            Message::Error(e) => {
                let reason =
                    Reason::new(e.code, format!("prefill {}: {}", peer.endpoint, e.message));
                match e.room.and_then(|r| rooms.get_mut(&r)) {
                    Some(room) => {
                        if room.status.fail(reason) {
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
                    self.cfg.timeouts.send,
                );
                if let Some(peer) = peer {
                    tokio::spawn(async move {
                        if let Err(reason) = peer.send(&ack, timeout).await {
                            tracing::warn!(%reason, "AbortAck not sent");
                        }
                    });
                }
            }
            Message::Heartbeat(_) => {}
            other => {
                drop(rooms);
                self.bad_message(
                    "unexpected",
                    format!("prefill sent {} on the control plane", other.name()),
                );
            }
        }
    }

    /// Aborts a room that is not final: `aborting` until every prefill serving it acknowledged
    /// (at once when none was asked yet), `aborted` after.
    async fn abort(&self, room_id: u64, reason: Reason) {
        let peers = {
            let mut rooms = self.rooms();
            let Some(room) = rooms.get_mut(&room_id) else {
                return;
            };
            let state = room.status.state();
            if state.is_final() || state == RoomState::Aborting {
                return;
            }
            // Before any request went out nothing can arrive: aborted at once.
            let peers: Vec<Arc<Peer>> = room.sources.iter().map(|s| s.peer.clone()).collect();
            room.status.abort(reason.clone(), peers.is_empty());
            room.acks_pending = peers.len();
            self.finished(room);
            peers
        };
        for peer in peers {
            if let Err(e) = self.tell_abort(&peer, room_id, &reason).await {
                // The prefill cannot be told: with staged transports nothing more lands once
                // the room no longer accepts chunks, so its acknowledgement is not needed.
                tracing::warn!(room = room_id, reason = %e, "abort not delivered");
                let mut rooms = self.rooms();
                if let Some(room) = rooms.get_mut(&room_id) {
                    room.acks_pending = room.acks_pending.saturating_sub(1);
                    if room.acks_pending == 0 && room.status.advance(RoomState::Aborted) {
                        self.finished(room);
                    }
                }
            }
        }
    }

    async fn tell_abort(&self, peer: &Peer, room: u64, reason: &Reason) -> Result<(), Reason> {
        let msg = Message::Abort(protocol::Abort {
            room,
            instance: self.instance,
            code: reason.code,
            message: reason.message.clone(),
        });
        peer.send(&msg, self.cfg.timeouts.send).await
    }

    /// Fails rooms whose transfer shows no sign of life: waiting for the prefill engine longer
    /// than the ready timeout, or transferring without progress longer than the stall timeout.
    /// Their prefills are told to stop.
    async fn fail_stuck_rooms(&self) {
        let t = self.cfg.timeouts;
        self.warn_stuck();
        let stuck: Vec<(u64, Reason, Vec<Arc<Peer>>)> = {
            let mut rooms = self.rooms();
            let mut out = Vec::new();
            for (id, room) in rooms.iter_mut() {
                let idle = room.progress_at.elapsed();
                let reason = match room.status.state() {
                    RoomState::WaitingForInput if idle >= t.ready => Reason::new(
                        FailureCode::TimeoutReady,
                        format!(
                            "no data from the prefill {} ms after the request",
                            idle.as_millis()
                        ),
                    ),
                    RoomState::Transferring if idle >= t.stall => Reason::new(
                        FailureCode::TimeoutStall,
                        format!(
                            "no progress for {} ms ({} of {} bytes landed)",
                            idle.as_millis(),
                            room.landed,
                            room.expected
                        ),
                    ),
                    _ => continue,
                };
                if room.status.fail(reason.clone()) {
                    self.finished(room);
                    out.push((
                        *id,
                        reason,
                        room.sources.iter().map(|s| s.peer.clone()).collect(),
                    ));
                }
            }
            out
        };
        for (room, reason, peers) in stuck {
            tracing::warn!(room, %reason, "room failed");
            for peer in peers {
                let _ = self.tell_abort(&peer, room, &reason).await;
            }
        }
    }

    /// Warns (at most every 10 s) about rooms in flight for more than 10 s.
    fn warn_stuck(&self) {
        const EVERY: Duration = Duration::from_secs(10);
        let mut last = self.stuck_warned.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < EVERY) {
            return;
        }
        let now = super::room::now_ms();
        let rooms = self.rooms();
        let stuck: Vec<(u64, &'static str)> = rooms
            .iter()
            .filter(|(_, r)| !r.status.state().is_final())
            .filter(|(_, r)| {
                r.status
                    .at("created")
                    .is_some_and(|t| now - t > EVERY.as_secs_f64() * 1e3)
            })
            .map(|(id, r)| (*id, r.status.state().name()))
            .take(8)
            .collect();
        if !stuck.is_empty() {
            tracing::warn!(rooms = ?stuck, "rooms in flight for more than 10 s");
            *last = Some(Instant::now());
        }
    }

    /// Fails every room served by a prefill whose connection died or went silent, and forgets
    /// the peer (the next room connects afresh).
    fn peer_lost(&self, peer: &Peer, why: String) {
        peer.gone.cancel();
        self.peers().remove(&peer.instance);
        self.metrics
            .peers_dead
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(prefill = %peer.endpoint, instance = %peer.instance, %why, "prefill peer dead");
        let mut rooms = self.rooms();
        for room in rooms.values_mut() {
            if room
                .sources
                .iter()
                .any(|s| s.peer.instance == peer.instance)
            {
                let reason = Reason::new(
                    FailureCode::PeerDead,
                    format!("prefill {}: {why}", peer.endpoint),
                );
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

async fn control_loop(inner: Arc<Inner>, peer: Arc<Peer>, mut recv: ControlClientRecv) {
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
async fn heartbeat_loop(inner: Arc<Inner>, peer: Arc<Peer>) {
    let t = inner.cfg.timeouts;
    let mut seq = 0u64;
    loop {
        tokio::select! {
            () = peer.gone.cancelled() => return,
            () = tokio::time::sleep(t.heartbeat) => {}
        }
        let silent = peer
            .last_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed();
        if silent >= 2 * t.heartbeat {
            inner
                .metrics
                .heartbeat_misses
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if silent >= t.dead_after {
            return inner.peer_lost(&peer, format!("silent for {} ms", silent.as_millis()));
        }
        seq += 1;
        let beat = Message::Heartbeat(protocol::Heartbeat {
            instance: inner.instance,
            seq,
        });
        if let Err(reason) = peer
            .send(&beat, t.heartbeat.max(Duration::from_millis(100)))
            .await
        {
            tracing::debug!(%reason, "heartbeat not sent");
        }
    }
}

/// Scatters running at once: receiving chunk i+1 overlaps the scatter of chunk i, and a slow
/// pool stops the receive loop (and so the sender) instead of queueing without bound.
const SCATTERS_IN_FLIGHT: usize = 2;

async fn receive_chunks(inner: Arc<Inner>, mut receiver: Box<dyn DataReceiver>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(SCATTERS_IN_FLIGHT));
    loop {
        let received = tokio::select! {
            () = inner.shutdown.cancelled() => return,
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

async fn expire_rooms(inner: Arc<Inner>) {
    let ttl = inner.cfg.timeouts.room_ttl;
    let mut tick = tokio::time::interval(Duration::from_millis(200).min(ttl));
    loop {
        tokio::select! {
            () = inner.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        inner.fail_stuck_rooms().await;
        let mut rooms = inner.rooms();
        let before = rooms.len();
        rooms.retain(|id, room| {
            let keep = !(room.safe_to_reuse() && room.final_at.is_some_and(|t| t.elapsed() >= ttl));
            if !keep {
                tracing::info!(
                    room = id,
                    state = room.status.state().name(),
                    "room expired untaken"
                );
            }
            keep
        });
        let expired = (before - rooms.len()) as u64;
        inner
            .metrics
            .expired
            .fetch_add(expired, std::sync::atomic::Ordering::Relaxed);
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RoomRequest {
    tokens: usize,
    /// Tokens the decode already holds (its prefix cache): only the rest moves.
    #[serde(default)]
    start_token: usize,
    #[serde(default)]
    pages: Option<Vec<u32>>,
    #[serde(default)]
    bootstrap: Option<String>,
    #[serde(default)]
    dp_rank: Option<u32>,
}

#[derive(Deserialize)]
struct WaitQuery {
    wait_ms: Option<u64>,
}

type Shared = State<Arc<Inner>>;

fn routes(inner: Arc<Inner>) -> Router {
    Router::new()
        .route(
            "/v1/rooms/{room}",
            post(create_room).get(get_room).delete(abort_room),
        )
        .route("/v1/rooms/{room}/take", post(take_room))
        .route("/v1/pool", get(pool))
        .route(
            "/healthz",
            get(|| async { axum::Json(serde_json::json!({"status": "ok", "role": "decode"})) }),
        )
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::bad_request("no such route").into_response() })
        .with_state(inner)
}

async fn create_room(
    State(inner): Shared,
    Path(room): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    let req: RoomRequest = api::parse_json(&body)?;
    if inner.shutdown.is_cancelled() || inner.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(ApiError::unavailable(
            "the agent is draining for shutdown: send the room to another decode rank",
        ));
    }
    let in_flight = inner
        .rooms()
        .values()
        .filter(|r| !r.status.state().is_final())
        .count();
    if in_flight >= inner.cfg.max_rooms {
        inner
            .metrics
            .rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::exhausted(format!(
            "{in_flight} rooms in flight; this agent admits at most {} (--max-rooms)",
            inner.cfg.max_rooms
        )));
    }
    let l = &inner.cfg.layout;
    if req.tokens == 0 {
        return Err(ApiError::bad_request("tokens must be > 0"));
    }
    if req.start_token >= req.tokens {
        return Err(ApiError::bad_request(format!(
            "start_token {} must be < tokens {}: there must be something to transfer",
            req.start_token, req.tokens
        )));
    }
    if u32::try_from(req.tokens).is_err() {
        return Err(ApiError::bad_request(format!(
            "tokens {} is beyond the protocol's u32",
            req.tokens
        )));
    }
    let needed = l.pages_for(req.tokens);
    let expected = l
        .room_bytes(req.tokens - req.start_token)
        .map_err(|e| ApiError::bad_request(format!("tokens {}: {e}", req.tokens)))?;
    let (pages, lease): (Arc<[u32]>, _) = match req.pages {
        Some(pages) => {
            api::validate_pages(&pages, needed, inner.pool.num_pages())?;
            (pages.into(), None)
        }
        None => {
            let lease = inner.alloc.allocate(needed).map_err(|e| {
                inner
                    .metrics
                    .rejected
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                ApiError::exhausted(e.to_string())
            })?;
            (lease.pages().into(), Some(lease))
        }
    };
    let view = {
        let mut rooms = inner.rooms();
        if rooms.contains_key(&room_id) {
            return Err(ApiError::conflict(format!("room {room_id} already exists")));
        }
        let room = Room {
            status: RoomStatus::default(),
            tokens: req.tokens,
            start_token: req.start_token,
            pages,
            lease,
            expected,
            landed: 0,
            chunks: 0,
            coverage: Coverage::new(l.num_layers(), req.tokens, l.num_heads()),
            sources: Vec::new(),
            acks_pending: 0,
            scattering: 0,
            final_at: None,
            progress_at: Instant::now(),
        };
        let view = room.view(room_id);
        rooms.insert(room_id, room);
        view
    };
    let task_inner = inner.clone();
    let span = tracing::info_span!("room", room = room_id, role = "decode");
    tokio::spawn(
        async move {
            if let Err(reason) = task_inner
                .clone()
                .request(room_id, req.bootstrap, req.dp_rank)
                .await
            {
                task_inner.fail(room_id, reason);
            }
        }
        .instrument(span),
    );
    Ok((axum::http::StatusCode::CREATED, axum::Json(view)).into_response())
}

async fn get_room(
    State(inner): Shared,
    Path(room): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    if let Some(wait) = q.wait_ms {
        let rx = {
            let rooms = inner.rooms();
            let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
            (!room.status.state().is_final()).then(|| room.status.subscribe())
        };
        if let Some(rx) = rx {
            api::wait_for_change(rx, Duration::from_millis(wait.min(60_000))).await;
        }
    }
    let rooms = inner.rooms();
    let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
    Ok(axum::Json(room.view(room_id)).into_response())
}

async fn take_room(State(inner): Shared, Path(room): Path<String>) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    let (pages, tokens) = {
        let rooms = inner.rooms();
        let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
        if !room.safe_to_reuse() {
            let state = room.status.state();
            let why = if state.is_final() {
                format!(
                    "room {room_id} is {} but a write into its pages is still finishing; take it once safe_to_reuse is true",
                    state.name()
                )
            } else {
                format!(
                    "room {room_id} is {}; take it once it is success, failed or aborted",
                    state.name()
                )
            };
            return Err(ApiError::conflict(why));
        }
        (room.pages.clone(), room.start_token..room.tokens)
    };
    let mut verified = None;
    let succeeded = inner
        .rooms()
        .get(&room_id)
        .is_some_and(|r| r.status.state() == RoomState::Success);
    if inner.cfg.synthetic && succeeded {
        let (pool, kernel) = (inner.pool.clone(), inner.kernel);
        let check = tokio::task::spawn_blocking(move || {
            synthetic::verify(&kernel, &pool, room_id, &pages, tokens)
        })
        .await;
        let result = check
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        verified = Some(result.is_ok());
        if let Err(e) = result {
            let mut rooms = inner.rooms();
            if let Some(room) = rooms.get_mut(&room_id) {
                // A landed room that fails verification: count it as failed.
                room.status = RoomStatus::new(RoomState::Failed);
                room.status
                    .fail(Reason::new(FailureCode::VerifyFailed, e.clone()));
                inner
                    .metrics
                    .room_final(RoomState::Failed, Some(FailureCode::VerifyFailed));
            }
            tracing::error!(room = room_id, error = %e, "landed bytes differ from the synthetic pattern");
        }
    }
    let room = inner
        .rooms()
        .remove(&room_id)
        .ok_or(ApiError::unknown_room(room_id))?;
    let mut view = room.view(room_id);
    view["verified"] = serde_json::json!(verified);
    let aux = room
        .sources
        .iter()
        .filter_map(|s| s.done.as_ref())
        .map(|d| &d.aux)
        .find(|a| !a.is_empty());
    view["aux"] = serde_json::json!(aux.map(|a| api::base64(a)));
    Ok(axum::Json(view).into_response())
}

async fn abort_room(State(inner): Shared, Path(room): Path<String>) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    if !inner.rooms().contains_key(&room_id) {
        return Err(ApiError::unknown_room(room_id));
    }
    inner
        .abort(
            room_id,
            Reason::new(FailureCode::Aborted, "aborted by the decode engine"),
        )
        .await;
    let rooms = inner.rooms();
    let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
    Ok(axum::Json(room.view(room_id)).into_response())
}

async fn pool(State(inner): Shared) -> Response {
    axum::Json(serde_json::json!({
        "total_pages": inner.alloc.total_pages(),
        "free_pages": inner.alloc.free_pages(),
    }))
    .into_response()
}

async fn metrics(State(inner): Shared) -> Response {
    let mut g = Gauges {
        pool_total: inner.alloc.total_pages(),
        pool_free: inner.alloc.free_pages(),
        ..Gauges::default()
    };
    for room in inner.rooms().values() {
        g.room(room.status.state());
        g.slots_in_use += room.scattering;
    }
    api::metrics_response(inner.metrics.render(&g))
}
