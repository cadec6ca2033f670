//! The agents: one beside every prefill rank ([`prefill`]) and every decode rank ([`decode`]).
//!
//! This file holds how both roles open their pool and start; their configuration is in
//! `config.rs`, how a rank describes itself to the registry and in Hello (and the layout
//! compatibility check) in `registration.rs`, how a room's transfer is cut into chunks in
//! `chunks.rs`. Room state lives in [`room`], each role's rooms in its room table
//! (`room_table.rs`); the engine API, every operation an engine asks of an agent declared once,
//! in [`engine_api`], the engine-facing HTTP plumbing over it in [`api`], the JSON forms of its
//! request fields in `fields.rs`; the synthetic engine in [`synthetic`].

pub mod agent_pool;
pub mod api;
mod chunks;
mod config;
pub mod decode;
pub mod engine_api;
mod faults;
mod fields;
mod holds;
pub mod metrics;
mod options;
pub mod pairing;
pub mod prefill;
mod registration;
mod registries;
pub mod room;
mod room_table;
mod serving;
mod staging;
pub mod synthetic;

pub(crate) use chunks::{ChunkPlan, Coverage, plan_chunks};
pub use config::{AgentConfig, DirectMethod, DirectWrites, MappedWrites, Timeouts, placed_min_run};
pub(crate) use config::{control_options, maps_pools, zmq_auth};
pub use engine_api::{EngineApi, OPERATIONS, Operation, PoolCounts, RoomError, RoomLook};
pub use options::AgentOptions;
pub(crate) use registration::{check_compatible, layout_of, registration, wire_layout};
pub use registries::{BadEntry, TrustedRegistries, Untrusted};
pub(crate) use serving::{Draining, Serving};

use agent_pool::AgentPool;
use std::time::Duration;

/// Why an agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The pool could not be created.
    #[error("pool: {0}")]
    Pool(#[from] crate::pool::PoolError),
    /// A pool given to the agent does not match its configuration.
    #[error("pool: {0}")]
    PoolMismatch(String),
    /// A socket could not be bound.
    #[error("transport: {0}")]
    Transport(#[from] crate::transport::TransportError),
    /// The registry refused or could not be reached.
    #[error("registry: {0}")]
    Registry(#[from] kvferry_bootstrap::ClientError),
    /// The HTTP API could not be bound.
    #[error("api: {0}")]
    Io(#[from] std::io::Error),
    /// The staging asked for cannot be served (`--staging`).
    #[error("staging: {0}")]
    Staging(#[from] StagingError),
    /// `--direct-writes always` over a UCX context without RMA.
    #[error(
        "--direct-writes always: one-sided writes over UCX need RMA, which kvferry asks for only \
         when UCX_TLS names RDMA transports only (rc, dc and their variants): over tcp or shared \
         memory libucx would run any connected peer's reads and writes in this process. Use \
         --direct-writes auto (mapped writes on one host, placed runs elsewhere)"
    )]
    NoOneSidedWrites,
}

pub use agent_pool::EnginePool;
pub use staging::{StagingChoice, StagingError, StagingMode};

/// Opens the agent's pool: its own anonymous memory (a memory file when `shareable`:
/// [`HostPool::shareable`](crate::pool::HostPool::shareable)), the engine's shared-memory pool,
/// or another process's device memory by CUDA IPC handle or VMM shareable handles (which needs
/// the CUDA driver, the device and NVRTC; the error says which is missing).
pub(crate) fn open_pool(cfg: &AgentConfig, shareable: bool) -> Result<EnginePool, AgentError> {
    use crate::kernel::cuda::{CudaKernel, DevicePool};
    use crate::pool::{HostPool, PoolDescriptor, PoolError};
    let (layout, pages) = (cfg.layout.clone(), cfg.pool_pages);
    let opened = match &cfg.pool {
        PoolDescriptor::CudaIpc { device, handle } => CudaKernel::shared(*device as usize)
            .map_err(Into::into)
            .and_then(|k| DevicePool::open_ipc(&k, layout, pages, handle)),
        PoolDescriptor::CudaVmm { device, socket } => CudaKernel::shared(*device as usize)
            .map_err(Into::into)
            .and_then(|k| DevicePool::import_vmm(&k, layout, pages, socket, cfg.timeouts.connect)),
        PoolDescriptor::Anonymous if shareable => {
            return Ok(EnginePool::Host(HostPool::shareable(layout, pages)?));
        }
        _ => return Ok(EnginePool::Host(HostPool::open(&cfg.pool, layout, pages)?)),
    };
    opened.map(EnginePool::Device).map_err(|e| {
        PoolError::DeviceMemory {
            descriptor: cfg.pool.to_string(),
            reason: e.to_string(),
        }
        .into()
    })
}

/// The agent's pool with its kernel, staged for `transport` ([`StagingMode`]: a device pool's
/// chunks stay in device staging where the transport sends device memory, as found at run
/// time, and go through pinned host memory otherwise; `--staging` may insist on either).
/// Refuses a pool that is not the pool the configuration describes (layout and page count):
/// the agent's pairing and validation go by the config.
pub(crate) async fn agent_pool(
    cfg: &AgentConfig,
    pool: EnginePool,
    transport: &dyn crate::transport::Transport,
) -> Result<AgentPool, AgentError> {
    let (layout, pages, memory) = match &pool {
        EnginePool::Host(p) => (p.layout(), p.num_pages(), "host"),
        EnginePool::Device(p) => (p.layout(), p.num_pages(), "device"),
    };
    if layout != &cfg.layout || pages != cfg.pool_pages {
        return Err(AgentError::PoolMismatch(format!(
            "the pool holds {pages} pages of {layout:?}; the agent is configured for {} pages of {:?}",
            cfg.pool_pages, cfg.layout
        )));
    }
    let pool = AgentPool::new(pool, cfg.copy_threads).map_err(|e| {
        crate::pool::PoolError::DeviceMemory {
            descriptor: format!("{memory} pool {}", cfg.pool),
            reason: e.to_string(),
        }
    })?;
    // Only a device pool asks the transport (UCX starts its worker to answer).
    let device = match (pool.kind(), cfg.staging) {
        (crate::memory::MemoryKind::Host, _) | (_, StagingChoice::PinnedHost) => {
            crate::transport::DeviceMemory::HostOnly(String::new())
        }
        _ => transport.device_memory().await?,
    };
    let (staging, reason) = staging::choose(
        pool.kind(),
        cfg.staging,
        transport.kind().name(),
        &device,
        cfg.checksum,
    )?;
    let pool = pool.staged(staging);
    match (pool.kind(), staging) {
        (crate::memory::MemoryKind::Host, _) => tracing::info!(memory = "host", "agent pool"),
        (crate::memory::MemoryKind::Device { ordinal }, StagingMode::Device) => tracing::info!(
            memory = "device",
            ordinal,
            staging = staging.label(),
            %reason,
            "agent pool: chunks are gathered into device staging and sent from there; received \
             into device staging and scattered from there (no D2H, no H2D)"
        ),
        (crate::memory::MemoryKind::Device { ordinal }, _) => tracing::info!(
            memory = "device",
            ordinal,
            staging = staging.label(),
            %reason,
            "agent pool: chunks are gathered on the device and copied to pinned host staging (one \
             D2H, one H2D on landing)"
        ),
    }
    Ok(pool)
}

/// The checksum of a chunk's bytes as carried on the wire: xxh3-64, never 0 (0 means none).
pub(crate) fn checksum(bytes: &[u8]) -> u64 {
    checksum_digest(xxhash_rust::xxh3::xxh3_64(bytes))
}

/// The checksum of bytes whose xxh3-64 is `digest` (hashed in place by the kernel).
pub(crate) fn checksum_digest(digest: u64) -> u64 {
    digest.max(1)
}

/// Waits (polling every 20 ms) until `done` or `deadline`; the drains use it.
pub(crate) async fn wait_until(deadline: std::time::Instant, done: impl Fn() -> bool) {
    while !done() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
