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
//! Files: this one (the handle, [`PrefillAgent`], and what the agent's tasks share,
//! [`Prefill`]), `peer.rs` (a decode peer), `control.rs` (what decodes send), `rooms.rs` (rooms
//! and transfers' bookkeeping, and the engine API on [`Prefill`]), `transfer.rs` (one
//! transfer's task; `transfer/send.rs`, one chunk's send; `transfer/direct.rs`, writes into the
//! decode's pool; `fanout.rs`, one write for several decode ranks), `housekeeping.rs`
//! (heartbeats, dead peers, timeouts), `drain.rs` (shutdown), `http.rs` (the engine's HTTP
//! API, a layer over the engine API).

mod control;
mod drain;
mod fanout;
mod housekeeping;
mod http;
mod peer;
mod reads;
mod rooms;
mod transfer;

pub use rooms::{HoldRequest, ReadyRequest, RoomView, TransferView};

use control::control_loop;

use housekeeping::Expired;
use housekeeping::housekeeping;
use http::routes;
use peer::{DirectTarget, Peer, Way};
use rooms::{Piece, Room, Transfer};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvferry_bootstrap::{RegistryClient, Role};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::AgentConfig;
use super::agent_pool::AgentPool;
use super::faults::Faults;
use super::holds::Holds;
use super::metrics::Metrics;
use super::room_table::RoomTable;
use super::staging::SlotPool;
use super::synthetic::SyntheticEngine;
use crate::pool::allocator::PageAllocator;
use crate::transport::zmq::{ControlReplier, ControlServer, PeerId};
use crate::transport::{self, Transport};

/// A running prefill agent.
pub struct PrefillAgent {
    /// The engine-facing HTTP API.
    pub api_url: String,
    /// The metrics port (`--metrics-port`), when it serves one.
    pub metrics_url: Option<String>,
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
        let api_url = crate::exposure::url_of(
            listener.local_addr()?,
            &cfg.advertise_host,
            cfg.api_tls.is_some(),
        );
        let slots = Arc::new(pool.slots());
        let synthetic = SyntheticEngine::configured(&cfg, pool.num_pages());
        let reg = super::registration(
            Role::Prefill,
            instance,
            &cfg,
            control_endpoint.clone(),
            Default::default(),
        );
        let inner = Arc::new(Prefill {
            draining: super::Draining::new(registry.clone(), reg.clone()),
            instance,
            alloc: PageAllocator::new(cfg.pool_pages as u32),
            pool,
            synthetic,
            transport,
            replier,
            slots,
            table: RoomTable::new(cfg.max_rooms),
            holds: Holds::new(),
            expired: Mutex::default(),
            peers: Mutex::new(HashMap::new()),
            forgotten: peer::Forgotten::default(),
            challenges: peer::Challenges::default(),
            metrics: Arc::new(Metrics::new("prefill", rma)),
            faults: Faults::new(cfg.fault_corrupt_chunk, cfg.timeouts),
            fanout: Default::default(),
            shutdown: shutdown.clone(),
            cfg,
        });
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(control_loop(inner.clone(), server));
        tasks.spawn(housekeeping(inner.clone()));
        let app = routes(inner.cfg.fault_injection, inner.cfg.token.clone());
        let api = (
            listener,
            app.with_state(inner.clone()),
            inner.cfg.api_tls.clone(),
        );
        let (cfg, draining) = (&inner.cfg, &inner.draining);
        let serving = super::Serving::start(&inner, cfg, draining, tasks, api, shutdown).await?;
        tracing::info!(%instance, api = %api_url, control = %control_endpoint, "prefill agent listening");
        Ok(PrefillAgent {
            api_url,
            metrics_url: serving.metrics_url(),
            instance,
            control_endpoint,
            serving,
            inner,
        })
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
    /// The synthetic engine, when configured (`--synthetic`): it fills the pages the agent
    /// allocates for a room.
    synthetic: Option<Arc<SyntheticEngine>>,
    alloc: PageAllocator,
    transport: Arc<dyn Transport>,
    replier: ControlReplier,
    slots: Arc<SlotPool>,
    table: RoomTable<Room>,
    /// Rooms whose requests wait in the engine's queue ([`EngineApi::hold`](super::EngineApi::hold)).
    holds: Holds<()>,
    /// Rooms whose ready KV no decode asked for within the TTL, for a request that comes
    /// later (refused at once rather than waiting for a room that will never be announced).
    expired: Mutex<Expired>,
    /// Decode peers by their control identity.
    peers: Mutex<HashMap<PeerId, Arc<Peer>>>,
    /// The connections of decodes found dead.
    forgotten: peer::Forgotten,
    /// Hellos waiting for the answer to this prefill's challenge (`control.rs`,
    /// `protocol/challenge.rs`).
    challenges: peer::Challenges,
    metrics: Arc<Metrics>,
    /// Chunks gathered so far, the one fault injection corrupts, and the timeouts in force.
    faults: Faults,
    /// Mapped writes of one room's chunks to several decode ranks, paired into one pass.
    fanout: Arc<fanout::Fanout>,
    shutdown: CancellationToken,
    /// Tells the registry that this rank drains (`POST /v1/draining`, SIGTERM).
    draining: super::Draining,
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
}
