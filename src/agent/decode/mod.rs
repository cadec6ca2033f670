//! The decode agent: takes room requests from the decode engine, resolves the prefill group
//! through the registry, says Hello once per prefill instance, asks for each room with a
//! TransferRequest, scatters arriving chunks into the decode pool, and keeps each landed room
//! until the engine takes it (remove-after-retrieve) or it expires.
//!
//! A room is `success` only when Done has arrived *and* every expected byte has landed: the
//! agent counts completions instead of trusting one notification. Chunks
//! are checked before a byte moves: known room, the epoch (prefill instance) the room was
//! requested from, ranges within the request, no (layer, token) landed twice, payload length.
//!
//! Page safety: with staged chunks this agent is the only writer of its pool, so a room's pages
//! are safe to reuse once the room is final and no scatter of it is still running. With the
//! direct path (the pool exposed for one-sided writes, `--direct-writes`), a prefill writes
//! pages itself (it says so in HelloAck); each such source stays *open* until it has said its
//! last word on the room (Done, Error, Abort or AbortAck, all sent only after its writes were
//! flushed), or until `--peer-dead-ms` after it was declared dead, and a room that fails with
//! open sources tells them to stop. `safe_to_reuse` waits for both.
//!
//! A room may come from several prefill ranks (heterogeneous TP, PP stages): `pairing.rs`
//! plans one bulk segment per source, each asked with its own TransferRequest and finished by
//! its own Done. Files: this one (rooms, requests, timeouts, drain), `peer.rs` (control
//! connections, heartbeats, what prefills send), `groups.rs` (prefill groups looked up in
//! the registry, remembered for a second), `landing.rs` (chunks into the pool),
//! `rooms.rs` (the engine's room operations on [`DecodeAgent`]), `http.rs` (the engine's HTTP
//! API, a layer over them), `drain.rs` (landed rooms kept takeable while draining).

mod drain;
mod groups;
mod http;
mod landing;
mod peer;
mod rooms;

pub use rooms::{HoldRequest, PageOwner, RoomRequest, RoomView, SourceView, TakenRoom};

use http::routes;
use landing::{land_where_staged, receive_chunks};
use peer::Peer;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvferry_bootstrap::{Registration, RegistryClient, Role};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use uuid::Uuid;

use super::agent_pool::AgentPool;
use super::faults::Faults;
use super::holds::Holds;
use super::metrics::{Gauges, Metrics};
use super::pairing::{self, RankSlice};
use super::room::{RoomState, RoomStatus};
use super::room_table::{RoomTable, TableRoom as _};
use super::{AgentConfig, Coverage};
use crate::kernel::Selection;
use crate::layout::{KvLayout, PageOrder};
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
    serving: super::Serving,
    inner: Arc<Decode>,
}

/// The running agent's engine API.
impl std::ops::Deref for DecodeAgent {
    type Target = Arc<Decode>;

    fn deref(&self) -> &Arc<Decode> {
        &self.inner
    }
}

impl DecodeAgent {
    /// Starts the agent on the pool its configuration names (`--pool`); it serves until
    /// `shutdown` is cancelled.
    pub async fn start(
        cfg: AgentConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, super::AgentError> {
        // Over a same-host transport the agent's own pool is a memory file, so that prefills
        // of this host can write into it directly (`transport/mapped.rs`).
        let pool = super::open_pool(&cfg, super::maps_pools(&cfg))?;
        Self::start_with_pool(cfg, pool, shutdown).await
    }

    /// Starts the agent on a pool the caller built, e.g. over the engine's own KV memory
    /// ([`crate::pool::HostPool::engine`], [`crate::kernel::cuda::DevicePool::engine`]): the
    /// engine process embeds the agent and kvferry reads and writes the engine's tensors in
    /// place. The pool must have the configuration's layout and page count.
    pub async fn start_with_pool(
        cfg: AgentConfig,
        pool: impl Into<super::EnginePool>,
        shutdown: CancellationToken,
    ) -> Result<Self, super::AgentError> {
        let auth = super::zmq_auth(&cfg);
        let data = transport::for_kind(cfg.transport, cfg.chunk_bytes, &auth, &cfg.host, false);
        let pool = super::agent_pool(&cfg, pool.into(), data.as_ref()).await?;
        let instance = Uuid::new_v4();
        let alloc = PageAllocator::new(cfg.pool_pages as u32);
        let registry = RegistryClient::new(cfg.bootstrap.clone(), cfg.token.clone())?;
        let (bound, mut receiver) = data.listen(&cfg.host, cfg.data_port).await?;
        let recv_slots = land_where_staged(&pool, receiver.as_mut())?;
        let data_endpoint = transport::advertised(&bound, &cfg.advertise_host);
        // Writes into the pool are described by the wire layout, which has no placement: only
        // a pool of planes (every agent's from the command line) is exposed.
        // Engine regions apart from each other, or pages that move only whole, stay staged.
        let exposable = cfg.direct_writes != super::DirectWrites::Never
            && cfg.layout.placement == crate::layout::KvPlacement::Planes
            && cfg.layout.order.granularity() == crate::layout::Granularity::Token
            && pool.contiguous();
        let (pool_key, shared) = match (exposable, pool.host()) {
            (true, Some(host)) => {
                let shared = match super::maps_pools(&cfg) {
                    true => transport::mapped::serve(host).await?,
                    false => None,
                };
                (receiver.expose(host.clone()).await?, shared)
            }
            _ => (None, None),
        };
        let (shared_pool, serving) = shared.unzip();
        let listener = tokio::net::TcpListener::bind((cfg.api_host.as_str(), cfg.api_port)).await?;
        let api_url = crate::exposure::url_of(listener.local_addr()?, &cfg.advertise_host);
        let inner = Arc::new(Decode {
            instance,
            pool,
            recv_slots,
            alloc,
            registry: registry.clone(),
            groups: Default::default(),
            data_endpoint: data_endpoint.clone(),
            pool_key,
            shared_pool,
            _serving: serving,
            placer: receiver.placer(),
            receives: receiver.receives(),
            table: RoomTable::new(cfg.max_rooms),
            peers: Mutex::new(HashMap::new()),
            holds: Holds::new(),
            connecting: Mutex::default(),
            metrics: Metrics::new("decode", data.remote_memory_access()),
            stuck_warned: Mutex::new(None),
            recv_reset: tokio::sync::Notify::new(),
            faults: Faults::new(None, cfg.timeouts),
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
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(receive_chunks(inner.clone(), receiver));
        tasks.spawn(expire_rooms(inner.clone()));
        let app = routes(inner.cfg.fault_injection, inner.cfg.token.clone());
        let api = (listener, app.with_state(inner.clone()));
        let token = inner.cfg.token.is_some();
        let serving =
            super::Serving::start(&registry, reg, tasks, api, shutdown, ("decode", token)).await?;
        tracing::info!(%instance, api = %api_url, data = %data_endpoint, "decode agent listening");
        Ok(DecodeAgent {
            api_url,
            instance,
            data_endpoint,
            serving,
            inner,
        })
    }

    /// Stops accepting rooms (503), lets in-flight rooms finish for up to the drain timeout,
    /// then aborts the rest. Landed rooms stay takeable until taken or `drain_untaken` passed
    /// since the last one landed (`drain.rs`).
    pub async fn drain(&self) {
        let inner = &self.inner;
        inner.table.drain();
        let draining_since = Instant::now();
        let deadline = draining_since + inner.timeouts().drain;
        let in_flight = || {
            inner
                .rooms()
                .values()
                .filter(|r| !r.status.state().is_final())
                .count()
        };
        super::wait_until(deadline, || in_flight() == 0).await;
        let aborted = inner
            .table
            .abort_unfinished("decode", |room, reason| inner.abort_room(room, reason))
            .await;
        // Let the aborts be acknowledged (a dead prefill counts after `dead_after`) and the
        // engine see the final states before the API goes away.
        let settle = Instant::now() + inner.timeouts().dead_after;
        super::wait_until(settle, || in_flight() == 0).await;
        if aborted > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        inner.keep_untaken(draining_since).await;
    }

    /// Resolves with the reason once this instance's registry slot was taken by another
    /// instance (its lease lapsed): the process must stop, it no longer serves the rank.
    pub async fn lease_lost(&self) -> String {
        self.serving.lease_lost().await
    }

    /// Waits for the agent's tasks to end after shutdown was cancelled, and deregisters.
    pub async fn join(self) {
        self.serving.join().await;
    }
}

/// The decode agent's engine API ([`EngineApi`](super::EngineApi), and [`Decode::request`], [`Decode::take`],
/// [`Decode::prefill_group`]) and everything its tasks share: its rooms, peers, pool and
/// transport. [`DecodeAgent`] derefs to it.
pub struct Decode {
    cfg: AgentConfig,
    instance: Uuid,
    pool: AgentPool,
    /// The pinned buffers the transport lands a device pool's chunks in, when it takes the
    /// agent's buffers (`land_where_staged`).
    recv_slots: Option<Arc<super::staging::SlotPool>>,
    alloc: PageAllocator,
    registry: RegistryClient,
    /// Prefill groups looked up lately.
    groups: groups::Groups,
    data_endpoint: String,
    /// The pool as exposed for the transport's one-sided writes (sent in Hello), when it has
    /// them.
    pool_key: Option<crate::memory::RemoteMemory>,
    /// The pool's memory file as served to prefills of this host (Hello's `shared_pool`).
    shared_pool: Option<crate::memory::RemoteMemory>,
    /// Serves it while the agent lives.
    _serving: Option<tokio_util::task::AbortOnDropHandle<()>>,
    /// Receives placed runs into the pool, when the transport can.
    placer: Option<Arc<dyn transport::Placer>>,
    /// Keeps a receive posted for each slot granted to a prefill, when the transport needs it.
    receives: Option<Arc<dyn transport::Receives>>,
    table: RoomTable<Room>,
    /// Control connections by prefill instance.
    peers: Mutex<HashMap<Uuid, Arc<Peer>>>,
    /// Rooms the engine holds queued requests for ([`EngineApi::hold`](super::EngineApi::hold)), with the prefill
    /// instances each will come from once resolved.
    holds: Holds<Vec<Uuid>>,
    /// One lock per prefill instance, held while connecting to it, so that two rooms do not
    /// both say Hello to one prefill while rooms of other prefills connect meanwhile (an
    /// unreachable prefill holds only its own rooms up for `--timeout-connect-ms`).
    connecting: Mutex<HashMap<Uuid, Arc<tokio::sync::Mutex<()>>>>,
    metrics: Metrics,
    /// Restarts the data receiver's posted receive: a dead peer may have left it matched to a
    /// message that never completes (UCX over shared memory cannot notice the death itself).
    recv_reset: tokio::sync::Notify,
    /// When stuck rooms were last warned about.
    stuck_warned: Mutex<Option<Instant>>,
    /// The timeouts in force (a test may change them: `--fault-injection`).
    faults: Faults,
    shutdown: CancellationToken,
}

struct Room {
    status: RoomStatus,
    tokens: usize,
    /// The first token requested; earlier ones are the decode engine's own prefix.
    start_token: usize,
    pages: Arc<[u32]>,
    /// Present when the agent allocated the pages; dropping it returns them.
    lease: Option<PageLease>,
    /// The agent-owned pages went back to the pool early: the room was aborted and became safe
    /// to reuse before it was taken.
    returned: bool,
    expected: usize,
    landed: usize,
    chunks: u32,
    coverage: Coverage,
    /// The prefill ranks the room comes from, one bulk segment each (see `pairing.rs`).
    sources: Vec<Source>,
    /// AbortAcks still awaited while aborting.
    acks_pending: usize,
    scattering: usize,
    /// The sources with open writes were told to stop (the room failed or was aborted).
    stop_told: bool,
    final_at: Option<Instant>,
    /// The last sign of life of the room's transfer (request sent, chunk landed, Done): the
    /// ready and stall timeouts count from it.
    progress_at: Instant,
}

/// Where a room comes from: the prefill group's ranks, their slices, and this decode rank's
/// segments ([`pairing::plan`]).
struct Planned {
    ranks: Vec<Registration>,
    slices: Vec<RankSlice>,
    segments: Vec<pairing::Segment>,
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
    /// Whether the source may still write into the room's pages directly (module doc).
    writes: Writes,
    /// The secret of this source's request: its chunks must carry it.
    secret: protocol::Secret,
    /// The order its chunks' bytes come in (the request's `wire_order`).
    wire: crate::layout::PageOrder,
}

/// Whether a source may still write into a room's pages directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writes {
    /// It never could (staged transport), or it has said its last word on the room.
    Closed,
    /// It may, until its last word.
    Open,
    /// It was declared dead: a prefill that is alive but cut off from this decode stops
    /// writing once its own heartbeat gives up on us, about `--peer-dead-ms` later; its writes
    /// are counted possible until then.
    Until(Instant),
}

impl Writes {
    fn possible(self) -> bool {
        match self {
            Writes::Closed => false,
            Writes::Open => true,
            Writes::Until(t) => Instant::now() < t,
        }
    }
}

impl Room {
    /// The peers whose direct writes into the room may still arrive and who can be told.
    fn open_writers(&self) -> Vec<Arc<Peer>> {
        let open = self.sources.iter().filter(|s| s.writes == Writes::Open);
        open.map(|s| s.peer.clone()).collect()
    }

    /// `peer` has said its last word on the room (`Closed`), or was declared dead
    /// (`Until`): its writes end.
    fn end_writes(&mut self, peer: Uuid, end: Writes) {
        for s in self.sources.iter_mut().filter(|s| s.peer.instance == peer) {
            if s.writes != Writes::Closed {
                s.writes = end;
            }
        }
        self.touch_if_safe();
    }

    /// Wakes engines long-polling for `safe_to_reuse` once it holds.
    fn touch_if_safe(&self) {
        if self.safe_to_reuse() {
            self.status.touch();
        }
    }
}

impl Decode {
    /// The timeouts in force.
    fn timeouts(&self) -> super::Timeouts {
        self.faults.timeouts()
    }

    fn rooms(&self) -> MutexGuard<'_, HashMap<u64, Room>> {
        self.table.lock()
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
        if let Some(room) = rooms.get_mut(&room_id)
            && room.status.fail(reason.clone())
        {
            tracing::warn!(room = room_id, %reason, "room failed");
            self.finished(room);
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

    /// The client of the registry a room names (a trusted one), or of `--bootstrap`'s.
    fn registry_of(&self, bootstrap: Option<&str>) -> Result<RegistryClient, Reason> {
        match bootstrap {
            Some(url) => self
                .groups
                .client(url, &self.cfg.registries, self.cfg.token.as_deref()),
            None => Ok(self.registry.clone()),
        }
    }

    /// The prefill group serving `room_id` (the engine's DP rank, or the room modulo the
    /// prefill DP size), its ranks' slices, and the segments this decode rank receives.
    async fn plan_room(
        &self,
        room_id: u64,
        bootstrap: Option<&str>,
        dp_rank: Option<u32>,
    ) -> Result<Planned, Reason> {
        let client = self.registry_of(bootstrap)?;
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
        let slices: Vec<RankSlice> = group
            .ranks
            .iter()
            .map(|r| RankSlice {
                heads: r.slice.heads.start as usize..r.slice.heads.end as usize,
                layers: r.slice.layers.start as usize..r.slice.layers.end as usize,
            })
            .collect();
        let r = self.cfg.ranks;
        let me = (r.pp_rank * r.tp_size + r.tp_rank) as usize;
        let segments = pairing::plan(&slices, &self.decode_group()?, me).map_err(|e| {
            Reason::new(
                FailureCode::IncompatibleLayout,
                format!("prefill group dp_rank={dp_rank}: {e}"),
            )
        })?;
        Ok(Planned {
            ranks: group.ranks,
            slices,
            segments,
        })
    }

    /// Resolves the prefill ranks `room_id` will come from and says Hello where needed; from
    /// then on, while the hold lasts, the room is named in every heartbeat to them.
    async fn hold_at_prefill(
        self: Arc<Self>,
        room_id: u64,
        asked: HoldRequest,
    ) -> Result<(), Reason> {
        let planned = self
            .plan_room(room_id, asked.bootstrap.as_deref(), asked.dp_rank)
            .await?;
        let mut prefills = Vec::with_capacity(planned.segments.len());
        for seg in &planned.segments {
            prefills.push(self.peer(&planned.ranks[seg.prefill]).await?.instance);
        }
        self.holds.update(room_id, |held| *held = prefills);
        Ok(())
    }

    /// The held rooms to name in a heartbeat to `prefill` (those `room_max` old are dropped).
    pub(super) fn held_at(&self, prefill: Uuid) -> Vec<u64> {
        self.holds
            .live(self.timeouts().room_max)
            .into_iter()
            .filter(|(_, prefills)| prefills.contains(&prefill))
            .map(|(room, _)| room)
            .collect()
    }

    /// Resolves the prefill, says Hello if needed, and asks for the room.
    async fn send_request(self: Arc<Self>, room_id: u64, asked: RoomRequest) -> Result<(), Reason> {
        let Planned {
            ranks,
            slices,
            segments,
        } = self
            .plan_room(room_id, asked.bootstrap.as_deref(), asked.dp_rank)
            .await?;
        let l = &self.cfg.layout;
        let decodes = self.decode_group()?;
        let mut sources = Vec::with_capacity(segments.len());
        for seg in segments {
            let peer = self.peer(&ranks[seg.prefill]).await?;
            let requesters = pairing::requesters(&slices, &decodes, seg.prefill);
            let secret = protocol::Secret::random().map_err(|e| {
                Reason::new(
                    FailureCode::BadMessage,
                    format!("no random bytes for the room's secret: {e}"),
                )
            })?;
            // The decode's own order makes its scatter long runs (the prefill's gather
            // converts), unless the page sizes differ: then token rows (layout::wire_order;
            // Hello refused the pairs that cannot meet).
            let source = KvLayout {
                page_size: ranks[seg.prefill].layout.page_size as usize,
                ..l.clone()
            };
            let wire = crate::layout::wire_order(&source, l).unwrap_or(l.order);
            sources.push((peer, seg, requesters, secret, wire));
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
                .map(|(peer, seg, _, secret, wire)| Source {
                    peer: peer.clone(),
                    layers: seg.layers.clone(),
                    heads: seg.heads.clone(),
                    expected: l
                        .selection_bytes(
                            l.staged_tokens(&tokens),
                            seg.layers.len(),
                            seg.heads.len(),
                        )
                        .unwrap_or(usize::MAX),
                    landed: 0,
                    chunks: 0,
                    done: None,
                    writes: match peer.direct {
                        true => Writes::Open,
                        false => Writes::Closed,
                    },
                    secret: *secret,
                    wire: *wire,
                })
                .collect();
            (tokens, room.pages.to_vec())
        };
        for (peer, seg, requesters, secret, wire_order) in sources {
            let req = Message::TransferRequest(TransferRequest {
                room: room_id,
                prefill_instance: peer.instance,
                tokens: tokens.start as u32..tokens.end as u32,
                layers: seg.layers.start as u32..seg.layers.end as u32,
                heads: seg.heads.start as u32..seg.heads.end as u32,
                wire_order,
                dst_pages: pages.clone(),
                requesters: requesters as u32,
                secret,
                room_key: asked.room_key,
                prompt_digest: asked.prompt_digest,
            });
            peer.send(&req, self.timeouts().send).await?;
        }
        Ok(())
    }

    /// The slices of every decode rank of this agent's group (PP stages in order, TP ranks in
    /// order within each), for [`pairing::plan`].
    fn decode_group(&self) -> Result<Vec<RankSlice>, Reason> {
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
                out.push(RankSlice {
                    heads: s.heads,
                    layers: s.layers,
                });
            }
        }
        Ok(out)
    }

    /// Aborts a room that is not final: `aborting` until every prefill serving it acknowledged
    /// (at once when none was asked yet), `aborted` after.
    async fn abort_room(&self, room_id: u64, reason: Reason) {
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
            room.stop_told = true;
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

    /// Fails rooms whose transfer shows no sign of life: waiting for the prefill engine longer
    /// than the ready timeout, or transferring without progress longer than the stall timeout.
    /// Their prefills are told to stop.
    async fn fail_stuck_rooms(&self) {
        let t = self.timeouts();
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
                    room.stop_told = true;
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
        self.stop_open_writers().await;
    }

    /// Tells the sources that may still write into a failed room's pages to stop; their
    /// answer (AbortAck) closes them. Rooms fail in many places; this sweep covers them all.
    async fn stop_open_writers(&self) {
        let told: Vec<(u64, Reason, Vec<Arc<Peer>>)> = self
            .rooms()
            .iter_mut()
            .filter(|(_, r)| r.status.state().is_final() && !r.stop_told)
            .filter_map(|(id, r)| {
                r.stop_told = true;
                let peers = r.open_writers();
                let reason = r.status.reason().cloned().unwrap_or_else(|| {
                    Reason::new(FailureCode::Aborted, "the room ended on the decode")
                });
                (!peers.is_empty()).then_some((*id, reason, peers))
            })
            .collect();
        for (room, reason, peers) in told {
            for peer in peers {
                if let Err(e) = self.tell_abort(&peer, room, &reason).await {
                    tracing::warn!(room, reason = %e, "could not tell a writer to stop");
                }
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
}

async fn expire_rooms(inner: Arc<Decode>) {
    let mut tick = tokio::time::interval(Duration::from_millis(200).min(inner.timeouts().room_ttl));
    loop {
        tokio::select! {
            () = inner.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let ttl = inner.timeouts().room_ttl;
        inner.fail_stuck_rooms().await;
        let mut rooms = inner.rooms();
        for room in rooms.values_mut() {
            let mut ended = false;
            for s in room.sources.iter_mut() {
                if matches!(s.writes, Writes::Until(_)) && !s.writes.possible() {
                    s.writes = Writes::Closed;
                    ended = true;
                }
            }
            if ended {
                room.touch_if_safe();
            }
        }
        drop(rooms);
        inner.return_aborted_pages();
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
        inner.metrics.expired.inc_by(expired);
    }
}
