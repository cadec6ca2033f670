//! The prefill agent: registers its rank, answers Hello from decode agents (version, token,
//! layout, reachability of the decode's data endpoint), and streams each room's KV to the
//! decode that asked for it.
//!
//! The engine announces a room's KV as ready in pieces (a token range for chunked prefill, a
//! layer range for layer-wise prefill, any mix, the last piece marked) or in one call. Pieces
//! may not overlap. The decode's request and the pieces may arrive in any order; once both are
//! there a task per room sends each piece's part of the request as soon as it is ready, and
//! Done once every requested byte was sent.
//!
//! Flow control: the decode grants a number of staging slots in Hello and returns a credit per
//! chunk it has scattered; a chunk is gathered only once a credit is held, so staging memory
//! per peer pair stays within `slots x slot bytes` however many rooms are in flight. The gather
//! of the next chunk overlaps the send of the current one when a credit is at hand.
//!
//! Liveness: heartbeats go to every decode peer; a peer silent for `dead_after` is dead and its
//! rooms fail with `peer_dead`. Pages the agent allocated (`--synthetic`) return to its pool
//! when a room is final and no gather reads them; engine pages are then `safe_to_reuse`.
//!
//! Several decode ranks may ask for parts of one room (heterogeneous TP): each is a transfer of
//! its own, and the room is final once every rank the requests announce has been served.
//! Files: this one (rooms, transfers' bookkeeping, aborts, timeouts, drain), `control.rs` (what
//! decodes send), `transfer.rs` (one transfer's task; `transfer/send.rs`, one chunk's send),
//! `rooms.rs` (the engine's room operations on [`PrefillAgent`]), `http.rs` (the engine's HTTP
//! API, a layer over them).

mod control;
mod fanout;
mod http;
mod rooms;
mod transfer;

pub use rooms::{HoldRequest, ReadyRequest, RoomView, TransferView};

use control::control_loop;

use http::routes;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvferry_bootstrap::{RegistryClient, Role};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use uuid::Uuid;

use super::agent_pool::AgentPool;
use super::faults::Faults;
use super::holds::Holds;
use super::metrics::{Gauges, Metrics};
use super::room::{RoomState, RoomStatus};
use super::room_table::RoomTable;
use super::staging::SlotPool;
use super::{AgentConfig, ChunkPlan, Coverage, plan_chunks, synthetic};
use crate::kernel::Selection;
use crate::pool::HostPool;
use crate::pool::allocator::{PageAllocator, PageLease};
use crate::protocol::{self, Chunk, ErrorMsg, Hello, HelloAck, Message, TransferRequest};
use crate::reason::{FailureCode, Reason};
use crate::transport::zmq::{ControlEvent, ControlReplier, ControlServer, PeerId};
use crate::transport::{self, DataSender, Transport};
use protocol::{PromptDigest, Secret};

/// A running prefill agent.
pub struct PrefillAgent {
    /// The engine-facing HTTP API.
    pub api_url: String,
    /// This process's instance id.
    pub instance: Uuid,
    /// The control endpoint decode agents connect to.
    pub control_endpoint: String,
    serving: super::Serving,
    inner: Arc<Prefill>,
}

/// The running agent's engine API.
impl std::ops::Deref for PrefillAgent {
    type Target = Arc<Prefill>;

    fn deref(&self) -> &Arc<Prefill> {
        &self.inner
    }
}

impl PrefillAgent {
    /// Starts the agent on the pool its configuration names (`--pool`); it serves until
    /// `shutdown` is cancelled.
    pub async fn start(
        cfg: AgentConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, super::AgentError> {
        let pool = super::open_pool(&cfg, false)?;
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
        let transport = transport::for_kind(
            cfg.transport,
            cfg.chunk_bytes,
            &super::zmq_auth(&cfg),
            &cfg.host,
            true,
        );
        let rma = transport.remote_memory_access();
        #[cfg(feature = "ucx")]
        if cfg.direct_writes == super::DirectWrites::Always
            && cfg.transport == transport::TransportKind::Ucx
            && !rma
        {
            return Err(super::AgentError::NoOneSidedWrites);
        }
        let pool = super::agent_pool(&cfg, pool.into(), transport.as_ref()).await?;
        let instance = Uuid::new_v4();
        let registry = RegistryClient::new(cfg.bootstrap.clone(), cfg.token.clone())?;
        let options = super::control_options(&cfg);
        let (bound, server, replier) =
            ControlServer::bind(&cfg.host, cfg.control_port, &options).await?;
        let control_endpoint = transport::advertised(&bound, &cfg.advertise_host);
        let listener = tokio::net::TcpListener::bind((cfg.api_host.as_str(), cfg.api_port)).await?;
        let api_url = crate::exposure::url_of(listener.local_addr()?, &cfg.advertise_host);
        let slots = Arc::new(pool.slots());
        let filler = cfg.synthetic.then(|| {
            Arc::new(synthetic::Filler::new(
                pool.num_pages(),
                cfg.synthetic_verify,
            ))
        });
        let inner = Arc::new(Prefill {
            instance,
            alloc: PageAllocator::new(cfg.pool_pages as u32),
            pool,
            filler,
            transport,
            replier,
            slots,
            table: RoomTable::new(cfg.max_rooms),
            holds: Holds::new(),
            expired: Mutex::default(),
            peers: Mutex::new(HashMap::new()),
            metrics: Arc::new(Metrics::new("prefill", rma)),
            faults: Faults::new(cfg.fault_corrupt_chunk, cfg.timeouts),
            fanout: Default::default(),
            shutdown: shutdown.clone(),
            cfg,
        });
        let reg = super::registration(
            Role::Prefill,
            instance,
            &inner.cfg,
            control_endpoint.clone(),
            Default::default(),
        );
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(control_loop(inner.clone(), server));
        tasks.spawn(housekeeping(inner.clone()));
        let app = routes(inner.cfg.fault_injection, inner.cfg.token.clone());
        let api = (listener, app.with_state(inner.clone()));
        let token = inner.cfg.token.is_some();
        let serving =
            super::Serving::start(&registry, reg, tasks, api, shutdown, ("prefill", token)).await?;
        tracing::info!(%instance, api = %api_url, control = %control_endpoint, "prefill agent listening");
        Ok(PrefillAgent {
            api_url,
            instance,
            control_endpoint,
            serving,
            inner,
        })
    }

    /// Stops accepting new rooms (503), lets rooms in flight finish for up to the drain
    /// timeout, then aborts the rest (their decodes are told).
    pub async fn drain(&self) {
        let inner = &self.inner;
        inner.table.drain();
        let deadline = Instant::now() + inner.timeouts().drain;
        let busy = || {
            inner
                .rooms()
                .values()
                .filter(|r| {
                    r.transfers
                        .values()
                        .any(|t| t.req.is_some() && !t.state.is_final())
                })
                .count()
        };
        super::wait_until(deadline, || busy() == 0).await;
        inner
            .table
            .abort_unfinished("prefill", |room, reason| {
                inner.clone().abort_room(room, reason)
            })
            .await;
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

/// The prefill agent's engine API ([`EngineApi`](super::EngineApi), and [`Prefill::ready`]) and everything its
/// tasks share: its rooms, peers, pool and transport. [`PrefillAgent`] derefs to it.
pub struct Prefill {
    cfg: AgentConfig,
    instance: Uuid,
    pool: AgentPool,
    /// The synthetic engine's fill (`--synthetic`): which pool pages hold its body already.
    filler: Option<Arc<synthetic::Filler>>,
    alloc: PageAllocator,
    transport: Arc<dyn Transport>,
    replier: ControlReplier,
    slots: Arc<SlotPool>,
    table: RoomTable<Room>,
    /// Rooms whose requests wait in the engine's queue ([`PrefillAgent::hold`]).
    holds: Holds<()>,
    /// Rooms whose ready KV no decode asked for within the TTL, for a request that comes
    /// later (refused at once rather than waiting for a room that will never be announced).
    expired: Mutex<Expired>,
    /// Decode peers by their control identity.
    peers: Mutex<HashMap<PeerId, Arc<Peer>>>,
    metrics: Arc<Metrics>,
    /// Chunks gathered so far, the one fault injection corrupts, and the timeouts in force.
    faults: Faults,
    /// Mapped writes of one room's chunks to several decode ranks, paired into one pass.
    fanout: Arc<fanout::Fanout>,
    shutdown: CancellationToken,
}

struct Peer {
    instance: Uuid,
    /// The protocol version negotiated at Hello: every frame to the peer is stamped with it.
    version: u16,
    identity: PeerId,
    data_endpoint: String,
    data: tokio::sync::Mutex<Box<dyn DataSender>>,
    /// Chunks the decode will still accept; closed when the peer is dead.
    credits: Semaphore,
    /// The slots the decode granted: credits never exceed it.
    slots: usize,
    /// Bytes of the decode's slots.
    slot_bytes: usize,
    last_seen: Mutex<Instant>,
    /// The decode's pool, when this prefill may write into it directly.
    direct: Option<DirectTarget>,
    /// Staged chunks may go straight from the pool, without a gather
    /// ([`transport::DataSender::sends_from_pool`]).
    from_pool: bool,
    /// Placed chunks sent, by key, waiting for the decode's `Posted`.
    posted: Mutex<HashMap<u64, tokio::sync::oneshot::Sender<bool>>>,
    /// The decode's key for this connection (Hello): every chunk to it carries it.
    chunk_key: Secret,
    /// Tokens per page of the decode's pool (Hello).
    page_size: usize,
}

/// A decode pool this prefill writes into directly (the direct path): its layout and size,
/// from Hello, and the ways into it.
struct DirectTarget {
    layout: crate::layout::KvLayout,
    num_pages: usize,
    /// Best first: each piece goes the first way whose runs pay there (`transfer.rs`).
    ways: Vec<Way>,
}

/// One way a direct piece's runs reach the decode's pages.
enum Way {
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
    fn method(&self) -> crate::agent::DirectMethod {
        match self {
            Way::Transport { method, .. } => *method,
            Way::Mapped(_) => crate::agent::DirectMethod::Write,
        }
    }

    /// Whether the decode lands a placed run in several pieces of its pool (`scatter`).
    fn scatters(&self) -> bool {
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
    fn via(&self) -> &str {
        match self {
            Way::Transport { path, .. } => &path.via,
            Way::Mapped(_) => "mapped",
        }
    }
}

impl DirectTarget {
    /// The decode's pool as its Hello describes it, reached `ways`, each with the size of the
    /// memory it was given; or why direct writes into it are off.
    fn new(hello: &Hello, ways: Vec<(Way, u64)>) -> Result<Self, String> {
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

impl Peer {
    fn seen(&self) {
        *self.last_seen.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    fn silent_for(&self) -> Duration {
        self.last_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }
}

/// A part of a room the engine announced as ready: tokens x global layers, and for a device
/// pool the event after which its KV is written on the device.
#[derive(Clone, Debug)]
struct Piece {
    tokens: Range<usize>,
    layers: Range<usize>,
    ready_on: Option<Arc<crate::kernel::cuda::ReadyEvent>>,
}

struct Ready {
    tokens: usize,
    pages: Arc<[u32]>,
    /// Present when the agent allocated (and filled) the pages.
    /// Shared with running synthetic fills, so pages never return to the pool while a fill
    /// still writes them.
    lease: Option<Arc<PageLease>>,
    aux: Vec<u8>,
    /// Cells announced so far (local layer x token); pieces may not overlap.
    announced: Coverage,
    /// The engine marked its last piece.
    last: bool,
}

/// What one decode rank asked of a room (heterogeneous TP: several decode ranks may ask one
/// prefill rank for parts of the same room).
struct Transfer {
    peer: Arc<Peer>,
    /// `None` for the tombstone of an abort that overtook its request.
    req: Option<TransferRequest>,
    /// Index of the next announced piece this transfer sends.
    next_piece: usize,
    sent: usize,
    wake: Arc<Notify>,
    cancel: CancellationToken,
    started: bool,
    running: bool,
    requested_at: Instant,
    /// The prefill engine aborted the room: the decode is told with Abort, not AbortAck.
    engine_abort: bool,
    /// Why the decode aborted it.
    abort_reason: Option<Reason>,
    /// Sends and writes from the room's pages still in flight (`transfer.rs`, `Job::sends`).
    sends: tokio_util::task::TaskTracker,
    /// `transferring` until the transfer ends: `success`, `failed` or `aborted`.
    state: RoomState,
    reason: Option<Reason>,
}

impl Transfer {
    fn new(peer: Arc<Peer>, req: Option<TransferRequest>) -> Self {
        Transfer {
            peer,
            req,
            next_piece: 0,
            sent: 0,
            wake: Arc::new(Notify::new()),
            cancel: CancellationToken::new(),
            started: false,
            running: false,
            requested_at: Instant::now(),
            engine_abort: false,
            abort_reason: None,
            sends: tokio_util::task::TaskTracker::new(),
            state: RoomState::Transferring,
            reason: None,
        }
    }

    fn end(&mut self, state: RoomState, reason: Option<Reason>) {
        if !self.state.is_final() {
            self.state = state;
            self.reason = reason;
        }
    }
}

struct Room {
    status: RoomStatus,
    ready: Option<Ready>,
    /// Every piece announced so far, in order; each transfer keeps its own cursor.
    pieces: Vec<Piece>,
    /// By decode instance.
    transfers: HashMap<Uuid, Transfer>,
    /// How many decode ranks will ask (from their requests).
    requesters: usize,
    /// The prefill engine aborted the room.
    engine_abort: Option<Reason>,
    final_at: Option<Instant>,
    /// The room's key, when the engine announced one: only requests that carry it are served.
    key: Option<Secret>,
    /// The digest of the engine's prompt, when it announced one: requests with another are
    /// refused.
    digest: Option<PromptDigest>,
    /// When a decode's heartbeat last named the room (its engine holds the request queued):
    /// a ready room no decode asked for yet lives a TTL from then, up to `room_max`.
    renewed: Option<Instant>,
}

impl Room {
    fn new() -> Self {
        Room {
            status: RoomStatus::default(),
            ready: None,
            pieces: Vec::new(),
            transfers: HashMap::new(),
            requesters: 0,
            engine_abort: None,
            final_at: None,
            key: None,
            digest: None,
            renewed: None,
        }
    }

    /// Ready, asked by no decode yet, and held by one for a queued request.
    fn held(&self) -> bool {
        self.renewed.is_some() && self.ready.is_some() && !self.asked()
    }

    /// A decode asked for the room.
    fn asked(&self) -> bool {
        self.transfers.values().any(|t| t.req.is_some())
    }

    fn running(&self) -> bool {
        self.transfers.values().any(|t| t.running)
    }
}

impl Prefill {
    /// The timeouts in force.
    fn timeouts(&self) -> super::Timeouts {
        self.faults.timeouts()
    }

    fn rooms(&self) -> MutexGuard<'_, HashMap<u64, Room>> {
        self.table.lock()
    }

    fn expired(&self) -> MutexGuard<'_, Expired> {
        self.expired.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn peers(&self) -> MutexGuard<'_, HashMap<PeerId, Arc<Peer>>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the first time the room reached a stage of its transfer (its timings).
    fn mark_first(&self, room_id: u64, stage: &'static str) {
        if let Some(room) = self.rooms().get_mut(&room_id) {
            room.status.mark_first(stage);
        }
    }

    /// Moves the room to a final state once every decode rank that will ask has been served,
    /// and returns the agent's own pages once no gather reads them.
    fn settle(&self, room: &mut Room) {
        if let Some(reason) = room.engine_abort.clone()
            && !room.running()
        {
            room.status.abort(reason, true);
        }
        let asked = room.transfers.values().filter(|t| t.req.is_some()).count();
        let all_final = room.transfers.values().all(|t| t.state.is_final());
        if !room.status.state().is_final() && asked > 0 && asked >= room.requesters && all_final {
            let first_failure = room
                .transfers
                .values()
                .find(|t| t.state == RoomState::Failed);
            if let Some(t) = first_failure {
                let reason = t
                    .reason
                    .clone()
                    .unwrap_or_else(|| Reason::new(FailureCode::BadMessage, "transfer failed"));
                room.status.fail(reason);
            } else if room
                .transfers
                .values()
                .any(|t| t.state == RoomState::Aborted)
            {
                room.status.abort(
                    Reason::new(FailureCode::Aborted, "aborted by the decode"),
                    true,
                );
            } else {
                room.status.advance(RoomState::Success);
            }
        }
        if room.status.state().is_final() && room.final_at.is_none() {
            room.final_at = Some(Instant::now());
            self.metrics
                .room_final(room.status.state(), room.status.reason().map(|r| r.code));
        }
        if room.status.state().is_final() && !room.running() {
            if let Some(ready) = &mut room.ready {
                ready.lease = None;
            }
            room.status.touch();
        }
    }

    /// Queues `msg` to a decode without waiting for it to read: one decode that stopped
    /// reading never holds up the others (it is found dead by its silence).
    fn reply(&self, peer: &PeerId, msg: Message) {
        let version = self
            .peers()
            .get(peer)
            .map_or(protocol::VERSION, |p| p.version);
        self.replier
            .post(peer, msg.encode_as(version).into(), self.timeouts().send);
    }

    fn refuse(&self, peer: &PeerId, room: Option<u64>, code: FailureCode, message: String) {
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

    /// Starts the task of every requested transfer once the engine announced a first piece.
    fn start_ready(self: &Arc<Self>, room_id: u64, room: &mut Room) {
        if room.ready.is_none() || room.status.state().is_final() {
            return;
        }
        // Requests that came before the key and digest were known, and do not match them, are
        // refused.
        let mut refused = Vec::new();
        for (decode, t) in room.transfers.iter_mut() {
            let Some(req) = t.req.as_ref().filter(|_| !t.state.is_final()) else {
                continue;
            };
            if let Some(reason) = self.misfit(room_id, room.key, room.digest, req, *decode) {
                t.end(RoomState::Failed, Some(reason.clone()));
                refused.push((*decode, t.peer.identity.clone(), reason));
            }
        }
        if !refused.is_empty() {
            room.transfers
                .retain(|decode, _| refused.iter().all(|(d, _, _)| d != decode));
            let inner = self.clone();
            tokio::spawn(async move {
                for (_, identity, reason) in refused {
                    inner.refuse(&identity, Some(room_id), reason.code, reason.message);
                }
            });
        }
        for (decode, t) in room.transfers.iter_mut() {
            if t.req.is_some() && !t.started && !t.state.is_final() {
                self.metrics.ready_wait.observe(t.requested_at.elapsed());
                t.started = true;
                t.running = true;
                let span =
                    tracing::info_span!("room", room = room_id, role = "prefill", decode = %decode);
                tokio::spawn(
                    self.clone()
                        .serve_transfer(room_id, *decode)
                        .instrument(span),
                );
            }
        }
        if room.running() {
            room.status.advance(RoomState::Transferring);
        }
    }

    /// The prefill engine aborts a room: every transfer stops (a running one when its current
    /// chunk is out) and its decode is told with Abort; later requests are refused.
    async fn abort_room(self: Arc<Self>, room_id: u64, reason: Reason) {
        let tell: Vec<Arc<Peer>> = {
            let mut rooms = self.rooms();
            let room = rooms.entry(room_id).or_insert_with(Room::new);
            if room.status.state().is_final() {
                return;
            }
            room.engine_abort = Some(reason.clone());
            let mut tell = Vec::new();
            for t in room.transfers.values_mut() {
                t.cancel.cancel();
                if t.running {
                    t.engine_abort = true; // its task tells the decode when it stops
                } else if !t.state.is_final() {
                    t.end(RoomState::Aborted, Some(reason.clone()));
                    tell.push(t.peer.clone());
                }
            }
            self.settle(room);
            tell
        };
        let msg = Message::Abort(protocol::Abort {
            room: room_id,
            instance: self.instance,
            code: reason.code,
            message: reason.message,
        });
        for peer in tell {
            self.reply(&peer.identity, msg.clone());
        }
    }

    /// The held rooms each decode asked for, to name in its heartbeat (holds `room_max` old
    /// are dropped): its ready timeout waits for them as the engine's queue does.
    fn held_by_peer(&self) -> HashMap<Uuid, Vec<u64>> {
        let held = self.holds.live(self.timeouts().room_max);
        let rooms = self.rooms();
        let mut out: HashMap<Uuid, Vec<u64>> = HashMap::new();
        for (id, ()) in held {
            for decode in rooms
                .get(&id)
                .map(|r| r.transfers.keys())
                .into_iter()
                .flatten()
            {
                out.entry(*decode).or_default().push(id);
            }
        }
        out
    }

    /// Fails transfers requested long ago whose room the engine never announced (unless the
    /// engine holds the room's request in its queue).
    async fn fail_unready(&self) {
        let ready = self.timeouts().ready;
        let held: std::collections::HashSet<u64> = self
            .holds
            .live(self.timeouts().room_max)
            .into_iter()
            .map(|(room, ())| room)
            .collect();
        let late: Vec<(u64, Arc<Peer>, Reason)> = {
            let mut rooms = self.rooms();
            let mut out = Vec::new();
            for (id, room) in rooms.iter_mut().filter(|(id, _)| !held.contains(id)) {
                let mut changed = false;
                for t in room.transfers.values_mut() {
                    if t.req.is_some()
                        && !t.started
                        && !t.state.is_final()
                        && t.requested_at.elapsed() >= ready
                    {
                        let reason = Reason::new(
                            FailureCode::TimeoutReady,
                            format!(
                                "the prefill engine announced nothing within {} ms of the request",
                                ready.as_millis()
                            ),
                        );
                        t.end(RoomState::Failed, Some(reason.clone()));
                        out.push((*id, t.peer.clone(), reason));
                        changed = true;
                    }
                }
                if changed {
                    self.settle(room);
                }
            }
            out
        };
        for (room, peer, reason) in late {
            self.refuse(&peer.identity, Some(room), reason.code, reason.message);
        }
    }

    /// Why a decode's request does not fit the room the engine announced, if it does not:
    /// without the room's key (`unauthorized`), or for another prompt (`prompt_mismatch`).
    /// Counted and logged.
    fn misfit(
        &self,
        room: u64,
        key: Option<Secret>,
        digest: Option<PromptDigest>,
        req: &TransferRequest,
        decode: Uuid,
    ) -> Option<Reason> {
        if key.is_some_and(|key| req.room_key != Some(key)) {
            self.metrics.protocol_error("unauthorized");
            tracing::warn!(room, %decode, "request without the room's key refused");
            return Some(Reason::new(
                FailureCode::Unauthorized,
                format!("room {room}: the request does not carry the room's key"),
            ));
        }
        match (digest, req.prompt_digest) {
            (Some(ours), Some(theirs)) if ours != theirs => {
                tracing::warn!(room, %decode, %ours, %theirs, "request for another prompt refused");
                Some(Reason::new(
                    FailureCode::PromptMismatch,
                    format!(
                        "room {room}: the decode's prompt (digest {theirs}) is not the one this prefill computed the room's KV for (digest {ours})"
                    ),
                ))
            }
            _ => None,
        }
    }

    /// Forgets a dead decode peer and fails what it asked for.
    fn peer_dead(&self, peer: &Arc<Peer>, why: &str) {
        self.metrics.peers_dead.inc();
        peer.credits.close();
        // Sends still in flight to it end now (a transport may not notice the death itself:
        // UCX over shared memory), so that its transfers end and their pages become reusable.
        let gone = peer.clone();
        tokio::spawn(async move { gone.data.lock().await.close() });
        self.peers().remove(&peer.identity);
        tracing::warn!(decode = %peer.instance, why, "decode peer dead");
        let mut rooms = self.rooms();
        for room in rooms.values_mut() {
            if let Some(t) = room.transfers.get_mut(&peer.instance) {
                t.cancel.cancel();
                t.end(
                    RoomState::Failed,
                    Some(Reason::new(
                        FailureCode::PeerDead,
                        format!("decode {}: {why}", peer.instance),
                    )),
                );
                self.settle(room);
            }
        }
    }
}

/// Heartbeats to every peer, dead-peer detection and room expiry, on one timer.
async fn housekeeping(inner: Arc<Prefill>) {
    let mut tick =
        tokio::time::interval(inner.timeouts().heartbeat.min(Duration::from_millis(200)));
    let mut last_beat = Instant::now();
    let mut seq = 0u64;
    loop {
        tokio::select! {
            () = inner.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let t = inner.timeouts();
        let peers: Vec<Arc<Peer>> = inner.peers().values().cloned().collect();
        for peer in &peers {
            let silent = peer.silent_for();
            if silent >= 2 * t.heartbeat {
                inner.metrics.heartbeat_misses.inc();
            }
            if silent >= t.dead_after {
                inner.peer_dead(peer, &format!("silent for {} ms", silent.as_millis()));
            }
        }
        if last_beat.elapsed() >= t.heartbeat {
            last_beat = Instant::now();
            seq += 1;
            let mut held = inner.held_by_peer();
            let peers: Vec<Arc<Peer>> = inner.peers().values().cloned().collect();
            for peer in peers {
                let beat = Message::Heartbeat(protocol::Heartbeat {
                    instance: inner.instance,
                    seq,
                    rooms: held.remove(&peer.instance).unwrap_or_default(),
                });
                inner.reply(&peer.identity, beat);
            }
        }
        inner.fail_unready().await;
        let ttl = t.room_ttl;
        let mut orphans = Vec::new();
        inner.rooms().retain(|id, room| {
            let old = room.final_at.is_some_and(|t| t.elapsed() >= ttl);
            // Ready pages no decode asked for are released a TTL after they were announced or
            // last held by a decode for a queued request, and at most `room_max` after.
            let age = super::room::now_ms() - room.status.at("created").unwrap_or(0.0);
            let idle = room
                .renewed
                .map_or(age, |r| r.elapsed().as_secs_f64() * 1e3);
            let orphan = !room.asked()
                && (idle >= ttl.as_secs_f64() * 1e3 || age >= t.room_max.as_secs_f64() * 1e3);
            let keep = !(old || orphan) || room.running();
            if !keep && orphan {
                orphans.push((*id, room.renewed.is_some()));
            }
            keep
        });
        if !orphans.is_empty() {
            tracing::warn!(rooms = ?orphans, ttl_ms = ttl.as_millis() as u64, "ready rooms no decode asked for expired (true: held for a queued decode until --room-max-ms)");
            inner.metrics.expired.inc_by(orphans.len() as u64);
        }
        inner.expired().note(orphans, ttl);
    }
}

/// Rooms that expired unasked, remembered for [`Expired::REMEMBERED`] TTLs (at most
/// [`Expired::MAX`] of them, the oldest forgotten first).
#[derive(Default)]
struct Expired {
    /// Oldest first.
    order: std::collections::VecDeque<u64>,
    /// When each expired, and whether a decode held it for a queued request until then.
    rooms: HashMap<u64, (Instant, bool)>,
}

impl Expired {
    const REMEMBERED: u32 = 10;
    const MAX: usize = 1 << 16;

    /// Adds the rooms that expired now (each with whether it was held) and forgets those
    /// remembered long enough.
    fn note(&mut self, rooms: Vec<(u64, bool)>, ttl: Duration) {
        let now = Instant::now();
        for (room, held) in rooms {
            if let std::collections::hash_map::Entry::Vacant(e) = self.rooms.entry(room) {
                e.insert((now, held));
                self.order.push_back(room);
            }
        }
        let long = ttl * Self::REMEMBERED;
        while let Some(&room) = self.order.front() {
            let at = self.rooms.get(&room).map_or(now, |(at, _)| *at);
            if self.order.len() <= Self::MAX && now.duration_since(at) < long {
                break;
            }
            self.order.pop_front();
            self.rooms.remove(&room);
        }
    }

    /// How long ago `room` expired, and whether it was held, if it is remembered.
    fn ago(&self, room: u64) -> Option<(Duration, bool)> {
        self.rooms
            .get(&room)
            .map(|(at, held)| (at.elapsed(), *held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expired_rooms_are_remembered_for_ten_ttls_and_at_most_max_of_them() {
        let mut expired = Expired::default();
        let hour = Duration::from_secs(3600);
        expired.note(vec![(1, false), (2, true)], hour);
        expired.note(vec![(2, false), (3, false)], hour);
        assert!(
            expired
                .ago(1)
                .is_some_and(|(ago, held)| ago < hour && !held)
        );
        assert!(
            expired.ago(2).is_some_and(|(_, held)| held),
            "the first note stands"
        );
        assert!(expired.ago(3).is_some());
        assert_eq!(expired.ago(4), None);
        assert_eq!(
            expired.order.len(),
            3,
            "a room noted twice is remembered once"
        );
        // Past the memory (a zero TTL: at once), every room is forgotten.
        expired.note(vec![], Duration::ZERO);
        assert_eq!((expired.ago(1), expired.order.len()), (None, 0));
        // Beyond the bound, the oldest go first.
        let many: Vec<(u64, bool)> = (0..Expired::MAX as u64 + 2).map(|r| (r, false)).collect();
        expired.note(many, hour);
        assert_eq!(expired.order.len(), Expired::MAX);
        assert_eq!(expired.rooms.len(), Expired::MAX);
        assert_eq!((expired.ago(0), expired.ago(1)), (None, None));
        assert!(expired.ago(Expired::MAX as u64 + 1).is_some());
    }
}
