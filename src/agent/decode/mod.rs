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
//! its own Done. Files: this one (the handle, [`DecodeAgent`], and what the agent's tasks
//! share, [`Decode`]), `peer.rs` (a prefill peer: control connection, heartbeats, what prefills
//! send), `rooms.rs` (rooms and their requests' bookkeeping, and the engine API on [`Decode`]),
//! `groups.rs` (prefill groups looked up in the registry, remembered for a second),
//! `landing.rs` (chunks into the pool), `housekeeping.rs` (timeouts, stuck rooms), `drain.rs`
//! (shutdown; landed rooms kept takeable while draining), `http.rs` (the engine's HTTP API, a
//! layer over the engine API).

mod drain;
mod groups;
mod housekeeping;
mod http;
mod landing;
mod peer;
mod proofs;
mod rooms;

pub use rooms::{HoldRequest, PageOwner, RoomRequest, RoomView, SourceView, TakenRoom};

use housekeeping::expire_rooms;
use http::routes;
use landing::{land_where_staged, receive_chunks};
use peer::Peer;
use rooms::{Room, Writes};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvferry_bootstrap::{RegistryClient, Role};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::AgentConfig;
use super::agent_pool::AgentPool;
use super::faults::Faults;
use super::holds::Holds;
use super::metrics::Metrics;
use super::room_table::RoomTable;
use super::synthetic::SyntheticEngine;
use crate::pool::allocator::PageAllocator;
use crate::reason::Reason;
use crate::transport::{self, PoolMemory};

/// A running decode agent.
pub struct DecodeAgent {
    /// The engine-facing HTTP API, e.g. `http://127.0.0.1:40111`.
    pub api_url: String,
    /// The metrics port (`--metrics-port`), when it serves one.
    pub metrics_url: Option<String>,
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
        let proofs = Arc::new(proofs::DataProofs::default());
        let (bound, mut receiver) = data
            .listen(&cfg.host, cfg.data_port, proofs.check())
            .await?;
        let recv_slots = land_where_staged(&pool, receiver.as_mut())?;
        let data_endpoint = transport::advertised(&bound, &cfg.advertise_host);
        // Writes into the pool are described by the wire layout, which has no placement: only
        // a pool of planes (every agent's from the command line) is exposed.
        // Engine regions apart from each other, or pages that move only whole, stay staged.
        let exposable = cfg.direct_writes != super::DirectWrites::Never
            && cfg.layout.placement == crate::layout::KvPlacement::Planes
            && cfg.layout.order.granularity() == crate::layout::Granularity::Token;
        let placer = receiver.placer();
        let (pool_key, shared) = match pool.direct().filter(|_| exposable) {
            Some(PoolMemory::Host(host)) => {
                let shared = match super::maps_pools(&cfg) {
                    true => transport::mapped::serve(&host).await?,
                    false => None,
                };
                (receiver.expose(PoolMemory::Host(host)).await?, shared)
            }
            // A device pool takes placed runs only, where the transport lands them itself (a
            // revocable placer copies eager runs into place with the CPU).
            Some(device @ PoolMemory::Device(_))
                if placer.as_ref().is_some_and(|p| !p.revocable()) =>
            {
                (receiver.expose(device).await?, None)
            }
            _ => (None, None),
        };
        let (shared_pool, serving) = shared.unzip();
        let listener = tokio::net::TcpListener::bind((cfg.api_host.as_str(), cfg.api_port)).await?;
        let api_url = crate::exposure::url_of(
            listener.local_addr()?,
            &cfg.advertise_host,
            cfg.api_tls.is_some(),
        );
        let endpoints = [(cfg.transport.name().to_owned(), data_endpoint.clone())].into();
        let reg = super::registration(Role::Decode, instance, &cfg, api_url.clone(), endpoints);
        let inner = Arc::new(Decode {
            draining: super::Draining::new(registry.clone(), reg.clone()),
            instance,
            pool,
            recv_slots,
            proofs,
            alloc,
            registry: registry.clone(),
            groups: Default::default(),
            data_endpoint: data_endpoint.clone(),
            pool_key,
            shared_pool,
            _serving: serving,
            placer,
            receives: receiver.receives(),
            table: RoomTable::new(cfg.max_rooms),
            peers: Mutex::new(HashMap::new()),
            holds: Holds::new(),
            connecting: Mutex::default(),
            metrics: Metrics::new("decode", data.remote_memory_access()),
            stuck_warned: Mutex::new(None),
            recv_reset: tokio::sync::Notify::new(),
            faults: Faults::new(None, cfg.timeouts),
            synthetic: SyntheticEngine::configured(&cfg, cfg.pool_pages),
            shutdown: shutdown.clone(),
            cfg,
        });
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(receive_chunks(inner.clone(), receiver));
        tasks.spawn(expire_rooms(inner.clone()));
        let app = routes(inner.cfg.fault_injection, inner.cfg.token.clone());
        let api = (
            listener,
            app.with_state(inner.clone()),
            inner.cfg.api_tls.clone(),
        );
        let (cfg, draining) = (&inner.cfg, &inner.draining);
        let serving = super::Serving::start(&inner, cfg, draining, tasks, api, shutdown).await?;
        tracing::info!(%instance, api = %api_url, data = %data_endpoint, "decode agent listening");
        Ok(DecodeAgent {
            api_url,
            metrics_url: serving.metrics_url(),
            instance,
            data_endpoint,
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
    /// What proves a prefill's connection to the data port: the keys given out in Hello.
    proofs: Arc<proofs::DataProofs>,
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
    /// The synthetic engine, when configured (`--synthetic`): it checks a landed room's bytes
    /// on take.
    synthetic: Option<Arc<SyntheticEngine>>,
    shutdown: CancellationToken,
    /// Tells the registry that this rank drains (`POST /v1/draining`, SIGTERM).
    draining: super::Draining,
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

    /// The client of the registry a room names (a trusted one), or of `--bootstrap`'s.
    fn registry_of(&self, bootstrap: Option<&str>) -> Result<RegistryClient, Reason> {
        match bootstrap {
            Some(url) => self
                .groups
                .client(url, &self.cfg.registries, self.cfg.token.as_deref()),
            None => Ok(self.registry.clone()),
        }
    }
}
