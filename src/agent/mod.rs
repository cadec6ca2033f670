//! The agents: one beside every prefill rank ([`prefill`]) and every decode rank ([`decode`]).
//!
//! This file holds what both roles share: their configuration, how a rank describes itself to
//! the registry and in Hello, the layout compatibility check, and how a room's transfer is cut
//! into chunks. Room state lives in [`room`]; what the engine's room operations on
//! [`prefill::PrefillAgent`] and [`decode::DecodeAgent`] share (their error, pool counts, the
//! wait) in [`ops`], the engine-facing HTTP plumbing over them in [`api`]; the synthetic engine
//! in [`synthetic`].

pub mod api;
pub mod decode;
mod holds;
pub mod metrics;
pub mod ops;
pub mod pairing;
pub mod pool;
pub mod prefill;
pub mod room;
mod staging;
pub mod synthetic;

pub use ops::{PoolCounts, RoomError};

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Duration;

use kvferry_bootstrap as registry;
use uuid::Uuid;

use crate::layout::{AttentionKind, Dtype, KvLayout, PageOrder};
use crate::protocol::{Ranks, WireLayout};
use crate::reason::{FailureCode, Reason};
use crate::transport::TransportKind;
use pool::AgentPool;

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

pub use pool::EnginePool;
pub use staging::{Staging, StagingChoice, StagingError};

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

/// The agent's pool with its kernel, staged for `transport` ([`Staging`]: a device pool's
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
        (crate::memory::MemoryKind::Device { ordinal }, Staging::Device) => tracing::info!(
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

/// Timeouts of an agent; every wait is bounded by one of these.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Waiting for the prefill group to register (decode).
    pub bootstrap: Duration,
    /// Connecting to a peer and its Hello answer.
    pub connect: Duration,
    /// A landed (decode) or finished (prefill) room not taken within this expires.
    pub room_ttl: Duration,
    /// Prefill: the longest a ready room is kept by the heartbeats of a decode that holds it
    /// for a queued request, from its announcement. Decode: the longest it holds one.
    pub room_max: Duration,
    /// One send of a chunk or control message.
    pub send: Duration,
    /// Waiting for the engine's ready pieces of a requested room (`timeout_ready`).
    pub ready: Duration,
    /// A transferring room with no progress (`timeout_stall`).
    pub stall: Duration,
    /// SIGTERM: how long in-flight rooms may take to finish before they are aborted.
    pub drain: Duration,
    /// SIGTERM (decode): how long landed rooms stay takeable after the last one landed (and
    /// after SIGTERM) when the engine has not taken them.
    pub drain_untaken: Duration,
    /// Period of heartbeats on every control connection.
    pub heartbeat: Duration,
    /// A peer silent (no message of any kind) this long is dead.
    pub dead_after: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            bootstrap: Duration::from_secs(30),
            connect: Duration::from_secs(5),
            room_ttl: Duration::from_secs(60),
            room_max: Duration::from_secs(600),
            send: Duration::from_secs(30),
            ready: Duration::from_secs(60),
            stall: Duration::from_secs(30),
            drain: Duration::from_secs(30),
            drain_untaken: Duration::from_secs(10),
            heartbeat: Duration::from_millis(500),
            dead_after: Duration::from_secs(5),
        }
    }
}

/// What an agent needs to run.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The registry's URL.
    pub bootstrap: String,
    /// This rank's parallel ranks.
    pub ranks: Ranks,
    /// This rank's pool layout (its slice of the model).
    pub layout: KvLayout,
    /// Pages in the pool.
    pub pool_pages: usize,
    /// Data-plane transport.
    pub transport: TransportKind,
    /// Address the control and data sockets bind.
    pub host: String,
    /// Address peers reach them at, in the registry and in Hello (`--advertise-host`; the bound
    /// address by default, never a wildcard).
    pub advertise_host: String,
    /// Port of the prefill's control socket (0 = any).
    pub control_port: u16,
    /// Port of the decode's data socket (`zmq-tcp`; 0 = any).
    pub data_port: u16,
    /// Address of the engine-facing HTTP API.
    pub api_host: String,
    /// Port of the engine-facing HTTP API (0 = any).
    pub api_port: u16,
    /// Run the built-in synthetic engine.
    pub synthetic: bool,
    /// How the synthetic decode checks a landed room on take.
    pub synthetic_verify: synthetic::Verify,
    /// Shared secret for the registry and Hello.
    pub token: Option<String>,
    /// Serve non-loopback addresses without a token (the CLI refuses them otherwise; the agent
    /// itself only records the choice).
    pub insecure: bool,
    /// Largest chunk of staging bytes moved at once: the size of a staging slot.
    pub chunk_bytes: usize,
    /// Staging slots per peer pair: chunks in flight between two agents at once. The staging
    /// memory of a pair is bounded by `staging_slots x chunk_bytes` on each side, whatever the
    /// number of rooms in flight.
    pub staging_slots: usize,
    /// The pool: anonymous memory of the agent, or an engine's shared-memory pool.
    pub pool: crate::pool::PoolDescriptor,
    /// Synthetic engine pacing: announce a room one layer at a time, this long apart.
    pub synthetic_layer_delay: Duration,
    /// Checksum every chunk (xxh3-64) and verify it on landing.
    pub checksum: bool,
    /// Rooms in flight at most (not yet final); more are refused with 429.
    pub max_rooms: usize,
    /// Prefill: while ready rooms held for queued decodes keep this many pages or more, new
    /// rooms are refused.
    pub max_held_pages: usize,
    /// Fault injection for tests: invert every byte of the N-th chunk sent (after checksumming).
    pub fault_corrupt_chunk: Option<u64>,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Copy threads of the CPU kernel.
    pub copy_threads: usize,
    /// When the direct path (one-sided writes into the decode pool) is used.
    pub direct_writes: DirectWrites,
    /// Whether a decode's pool goes to the prefills of its host for mapped writes
    /// ([`MappedWrites`]).
    pub mapped_writes: MappedWrites,
    /// Shortest average run a piece sends placed ([`DirectMethod::Place`]); shorter ones are
    /// staged. None: [`placed_min_run`] of the path.
    pub placed_min_run_bytes: Option<u64>,
    /// Where a device pool's chunks are staged for the transport ([`StagingChoice`]).
    pub staging: StagingChoice,
}

/// When a segment goes by the direct path, with no gather and no scatter: the prefill's pool
/// runs go straight into the decode's pages, by one-sided writes or by placed sends
/// ([`DirectMethod`]), instead of through staging: on one host by mapped writes (the
/// prefill's copies into the decode's pool file, [`MappedWrites`]), else by the transport's
/// (`ucx`). The decode exposes its pool unless `never`, the prefill decides per piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DirectWrites {
    /// Mapped writes on one host; else the transport's one-sided writes where it reports them
    /// fast and safe (native RDMA writes on a supervised endpoint; not UCX 1.13's tcp or
    /// shared-memory emulations), else placed sends where the transport has them; each only
    /// when the piece's runs are long enough for it.
    #[default]
    Auto,
    /// The transport's one-sided writes whenever it has them (before mapped writes), however
    /// slow: for measurement and tests. UCX has them only over RDMA (its context asks for RMA
    /// nowhere else, see `transport/ucx/data.rs`); a prefill told `always` where they cannot go
    /// refuses to start.
    Always,
    /// Never: every chunk is staged.
    Never,
}

/// Whether mapped writes are used between agents of one host: the decode serves its pool's
/// memory file, the prefill maps it and copies into it (`transport/mapped.rs`). Only over a
/// same-host transport ([`crate::transport::maps_pools`]) and unless `--direct-writes never`;
/// both sides must allow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MappedWrites {
    /// The way a prefill takes first when its decode is on its host (with `--direct-writes
    /// auto`): one copy of each byte whatever the runs' lengths.
    #[default]
    Auto,
    /// Never: the decode keeps its memory to itself. Over UCX it then lands only placed runs it
    /// posted itself (pages safe at once when a prefill dies, where a mapped writer counts
    /// until `--peer-dead-ms` after its death) or staged chunks.
    Never,
}

impl MappedWrites {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            MappedWrites::Auto => "auto",
            MappedWrites::Never => "never",
        }
    }
}

/// How a direct segment's runs reach the decode's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectMethod {
    /// One-sided writes into the pool the decode exposed, flushed before the chunk's header
    /// (`Chunk.direct`); the decode counts the prefill a writer of its rooms until it is done.
    Write,
    /// The header first (`Chunk.placed`), then one message per run, which
    /// the decode receives straight into the places it computes itself: no write into its
    /// pages that it did not post and cannot cancel.
    Place,
}

/// The shortest average run placed rather than staged by default on `path`
/// (`--placed-min-run-bytes`). Each run is one message: by rendezvous (a handshake, then the
/// receiver reads: shared memory) placing won over staging from 128 KiB runs; as an eager
/// message (tcp) from 16 KiB, where 2 and 4 MiB rooms of 32 KiB runs took 15–40 % less time
/// placed (docs/benchmarks.md).
pub fn placed_min_run(path: &crate::transport::WritePath) -> u64 {
    match path.eager {
        true => 16 << 10,
        false => 128 << 10,
    }
}

impl DirectWrites {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            DirectWrites::Auto => "auto",
            DirectWrites::Always => "always",
            DirectWrites::Never => "never",
        }
    }

    /// How direct segments go to a decode reached by `path`, if at all; `revocable_runs` is
    /// the decode's word (Hello) that it lands eager runs through receives it can revoke.
    pub fn method(
        self,
        path: &crate::transport::WritePath,
        revocable_runs: bool,
    ) -> Option<DirectMethod> {
        let placeable = path.placed && (!path.eager || revocable_runs);
        match self {
            DirectWrites::Auto if path.fast => Some(DirectMethod::Write),
            DirectWrites::Auto if placeable => Some(DirectMethod::Place),
            DirectWrites::Always if path.writes => Some(DirectMethod::Write),
            DirectWrites::Auto | DirectWrites::Always | DirectWrites::Never => None,
        }
    }
}

/// Whether this agent takes part in mapped writes ([`MappedWrites`]): its transport carries
/// same-host traffic and neither flag turned them off.
pub(crate) fn maps_pools(cfg: &AgentConfig) -> bool {
    crate::transport::maps_pools(cfg.transport)
        && cfg.direct_writes != DirectWrites::Never
        && cfg.mapped_writes == MappedWrites::Auto
}

/// How this agent's ZeroMQ sockets authenticate: with its token, when it has one.
pub(crate) fn zmq_auth(cfg: &AgentConfig) -> crate::transport::zmq::Auth {
    crate::transport::zmq::Auth::new(cfg.token.as_deref())
}

/// The bounds and credentials of this agent's control sockets.
pub(crate) fn control_options(cfg: &AgentConfig) -> crate::transport::zmq::control::ControlOptions {
    crate::transport::zmq::control::ControlOptions {
        max_frame: crate::protocol::MAX_FRAME,
        auth: zmq_auth(cfg),
    }
}

/// This rank as announced in Hello.
pub(crate) fn wire_layout(layout: &KvLayout) -> WireLayout {
    WireLayout {
        kind: layout.model.kind,
        dtype: layout.model.dtype,
        order: layout.order,
        num_layers: layout.model.num_layers as u32,
        num_kv_heads: layout.model.num_kv_heads as u32,
        head_dim: layout.model.head_dim as u32,
        page_size: layout.page_size as u32,
        heads: layout.heads.start as u32..layout.heads.end as u32,
        layers: layout.layers.start as u32..layout.layers.end as u32,
    }
}

/// The pool layout a peer's Hello describes: the inverse of [`wire_layout`], for a pool of
/// planes (the wire layout has no placement; the decode exposes only such pools).
pub(crate) fn layout_of(w: &WireLayout) -> Result<KvLayout, crate::layout::LayoutError> {
    let model = crate::layout::ModelSpec {
        kind: w.kind,
        num_layers: w.num_layers as usize,
        num_kv_heads: w.num_kv_heads as usize,
        head_dim: w.head_dim as usize,
        dtype: w.dtype,
    };
    let range = |r: &Range<u32>| r.start as usize..r.end as usize;
    // The wire names no placement: a pool announced to peers has its planes apart, except
    // vLLM CPU pages, which hold a head's K and V side by side.
    let placement = match w.order {
        PageOrder::VllmCpuVec | PageOrder::VllmCpuAmx => crate::layout::KvPlacement::Interleaved,
        _ => crate::layout::KvPlacement::Planes,
    };
    KvLayout::new(model, w.page_size as usize)?
        .with_order(w.order, placement)?
        .with_slice(range(&w.heads), range(&w.layers))
}

fn registry_dtype(d: Dtype) -> registry::Dtype {
    match d {
        Dtype::Bf16 => registry::Dtype::Bf16,
        Dtype::Fp16 => registry::Dtype::Fp16,
        Dtype::Fp8E4m3 => registry::Dtype::Fp8E4m3,
        Dtype::Fp8E5m2 => registry::Dtype::Fp8E5m2,
        Dtype::Fp32 => registry::Dtype::Fp32,
    }
}

fn range(r: &Range<usize>) -> registry::IndexRange {
    registry::IndexRange {
        start: r.start as u32,
        end: r.end as u32,
    }
}

/// This rank's registration.
pub(crate) fn registration(
    role: registry::Role,
    instance: Uuid,
    cfg: &AgentConfig,
    control_endpoint: String,
    data_endpoints: BTreeMap<String, String>,
) -> registry::Registration {
    let l = &cfg.layout;
    let r = cfg.ranks;
    registry::Registration {
        instance_id: instance,
        role,
        dp_rank: r.dp_rank,
        dp_size: r.dp_size,
        tp_rank: r.tp_rank,
        tp_size: r.tp_size,
        pp_rank: r.pp_rank,
        pp_size: r.pp_size,
        layout: registry::KvLayout {
            kind: match l.model.kind {
                AttentionKind::Mha => registry::LayoutKind::Mha,
                AttentionKind::Mla => registry::LayoutKind::Mla,
            },
            num_layers: l.model.num_layers as u32,
            num_kv_heads: l.model.num_kv_heads as u32,
            head_dim: l.model.head_dim as u32,
            dtype: registry_dtype(l.model.dtype),
            page_size: l.page_size as u32,
        },
        slice: registry::Slice {
            heads: range(&l.heads),
            layers: range(&l.layers),
        },
        control_endpoint,
        data_endpoints,
    }
}

/// Refuses a peer whose layout cannot be paired with ours, naming the field and both values.
pub(crate) fn check_compatible(ours: &WireLayout, theirs: &WireLayout) -> Result<(), Reason> {
    let fields: [(&str, String, String); 5] = [
        ("kind", ours.kind.to_string(), theirs.kind.to_string()),
        ("dtype", ours.dtype.to_string(), theirs.dtype.to_string()),
        (
            "head_dim",
            ours.head_dim.to_string(),
            theirs.head_dim.to_string(),
        ),
        (
            "num_layers",
            ours.num_layers.to_string(),
            theirs.num_layers.to_string(),
        ),
        (
            "num_kv_heads",
            ours.num_kv_heads.to_string(),
            theirs.num_kv_heads.to_string(),
        ),
    ];
    for (field, a, b) in fields {
        if a != b {
            return Err(Reason::new(
                FailureCode::IncompatibleLayout,
                format!("{field} differs: ours {a}, peer's {b}"),
            ));
        }
    }
    let incompatible = |m: String| Reason::new(FailureCode::IncompatibleLayout, m);
    let (a, b) = (
        layout_of(ours).map_err(|e| incompatible(e.to_string()))?,
        layout_of(theirs).map_err(|e| incompatible(e.to_string()))?,
    );
    crate::layout::wire_order(&a, &b)
        .map(|_| ())
        .map_err(|why| {
            incompatible(format!(
                "ours {} against the peer's {}: {why}",
                a.order, b.order
            ))
        })
}

/// Which (local layer, token, local head) cells of a room are marked: landed (decode) or
/// announced ready (prefill, one head column).
pub(crate) struct Coverage {
    tokens: usize,
    heads: usize,
    bits: Vec<u64>,
}

impl Coverage {
    pub(crate) fn new(layers: usize, tokens: usize, heads: usize) -> Self {
        Coverage {
            tokens,
            heads,
            bits: vec![0; (layers * tokens * heads).div_ceil(64)],
        }
    }

    fn cells(
        &self,
        layers: Range<usize>,
        tokens: Range<usize>,
        heads: Range<usize>,
    ) -> impl Iterator<Item = usize> + use<> {
        let (t, h) = (self.tokens, self.heads);
        layers.flat_map(move |l| {
            let heads = heads.clone();
            tokens
                .clone()
                .flat_map(move |tok| heads.clone().map(move |hd| (l * t + tok) * h + hd))
        })
    }

    /// Marks the cells; refuses (and marks nothing) if any was marked before.
    pub(crate) fn claim(
        &mut self,
        layers: Range<usize>,
        tokens: Range<usize>,
        heads: Range<usize>,
    ) -> bool {
        let set = |bits: &[u64], i: usize| bits[i / 64] >> (i % 64) & 1 == 1;
        if self
            .cells(layers.clone(), tokens.clone(), heads.clone())
            .any(|i| set(&self.bits, i))
        {
            return false;
        }
        for i in self.cells(layers, tokens, heads) {
            self.bits[i / 64] |= 1 << (i % 64);
        }
        true
    }
}

/// One chunk of a room's transfer: a token range of a layer range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    /// Tokens of the room.
    pub tokens: Range<usize>,
    /// Global layers.
    pub layers: Range<usize>,
}

/// Cuts `tokens x layers` into chunks of at most `chunk_bytes` (at least one page of one
/// layer each, so a chunk is never empty), whole layers together when they fit.
pub(crate) fn plan_chunks(
    tokens: Range<usize>,
    layers: Range<usize>,
    bytes_per_token_layer: usize,
    page_size: usize,
    chunk_bytes: usize,
    whole_pages: bool,
) -> Vec<ChunkPlan> {
    let mut out = Vec::new();
    if tokens.is_empty() || layers.is_empty() {
        return out;
    }
    // Pages that move only whole stage every token slot of the pages the tokens touch.
    let staged = match whole_pages {
        true => tokens.end.div_ceil(page_size) * page_size - tokens.start / page_size * page_size,
        false => tokens.len(),
    };
    let layer_bytes = staged * bytes_per_token_layer;
    if layer_bytes <= chunk_bytes {
        let per = (chunk_bytes / layer_bytes.max(1)).max(1);
        let mut l = layers.start;
        while l < layers.end {
            let end = (l + per).min(layers.end);
            out.push(ChunkPlan {
                tokens: tokens.clone(),
                layers: l..end,
            });
            l = end;
        }
        return out;
    }
    let per_tokens =
        (chunk_bytes / bytes_per_token_layer.max(1) / page_size * page_size).max(page_size);
    for layer in layers {
        let mut t = tokens.start;
        while t < tokens.end {
            // Cut on page boundaries of the room so each chunk covers whole page blocks.
            let end = ((t / page_size * page_size) + per_tokens).min(tokens.end);
            out.push(ChunkPlan {
                tokens: t..end,
                layers: layer..layer + 1,
            });
            t = end;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_direct_method_follows_the_flag_the_write_path_and_the_decodes_receives() {
        use crate::transport::WritePath;
        let path = |writes, fast, placed, eager| WritePath {
            via: "x".to_owned(),
            placed,
            writes,
            fast,
            eager,
        };
        let (w, p) = (Some(DirectMethod::Write), Some(DirectMethod::Place));
        // (flag, one-sided writes, native writes, placeable, eager runs, decode revokes) -> method
        for (flag, writes, fast, placed, eager, revocable, want) in [
            (DirectWrites::Auto, true, true, true, false, false, w),
            (DirectWrites::Auto, false, false, true, false, false, p), // rendezvous: the decode pulls
            (DirectWrites::Auto, false, false, true, true, true, p),
            // Eager runs into receives the decode cannot revoke: a dead prefill would leave
            // them open for ever.
            (DirectWrites::Auto, false, false, true, true, false, None),
            (DirectWrites::Auto, false, false, false, false, true, None),
            (DirectWrites::Always, true, false, false, false, false, w),
            // No RMA in the transport's context: no one-sided writes, whatever the flag.
            (DirectWrites::Always, false, false, true, false, false, None),
            (DirectWrites::Never, true, true, true, false, true, None),
        ] {
            let got = flag.method(&path(writes, fast, placed, eager), revocable);
            assert_eq!(
                got, want,
                "{flag:?} fast={fast} placed={placed} eager={eager} revocable={revocable}"
            );
        }
    }

    #[test]
    fn a_hello_layout_reads_back_as_the_pool_layout_it_describes() {
        use crate::layout::{KvPlacement, ModelSpec, PageOrder};
        for (model, order, tp_rank, tp, pp_rank, pp) in [
            ("llama3-8b", PageOrder::TokenMajor, 1, 2, 0, 1),
            ("qwen2.5-7b", PageOrder::HeadMajor, 0, 4, 1, 2),
            ("deepseek-v3", PageOrder::TokenMajor, 3, 4, 0, 1),
        ] {
            let l = KvLayout::new(ModelSpec::preset(model).unwrap(), 16)
                .unwrap()
                .with_order(order, KvPlacement::Planes)
                .unwrap()
                .for_rank(tp_rank, tp, pp_rank, pp)
                .unwrap();
            assert_eq!(layout_of(&wire_layout(&l)).unwrap(), l, "{model}");
        }
    }

    #[test]
    fn chunks_tile_the_room_within_the_budget() {
        for (tokens, layers, per, page, budget) in [
            (0..4096, 0..32, 8192, 16, 4 << 20),
            (5..4000, 3..30, 8192, 16, 4 << 20),
            (0..16, 0..32, 8192, 16, 4 << 20),
            (0..1000, 0..4, 1024, 64, 1 << 10),
            (7..9, 0..2, 100, 4, 1),
        ] {
            let chunks = plan_chunks(tokens.clone(), layers.clone(), per, page, budget, false);
            let mut covered = vec![0u32; layers.end * tokens.end];
            for c in &chunks {
                let bytes = c.tokens.len() * c.layers.len() * per;
                assert!(bytes <= budget.max(page * per), "{c:?} is {bytes} bytes");
                for l in c.layers.clone() {
                    for t in c.tokens.clone() {
                        covered[l * tokens.end + t] += 1;
                    }
                }
            }
            for l in 0..layers.end {
                for t in 0..tokens.end {
                    let want = u32::from(layers.contains(&l) && tokens.contains(&t));
                    assert_eq!(covered[l * tokens.end + t], want, "layer {l} token {t}");
                }
            }
        }
        assert!(plan_chunks(0..0, 0..4, 8, 16, 1024, false).is_empty());
    }

    #[test]
    fn incompatible_layouts_name_the_field_and_both_values() {
        let l = crate::layout::KvLayout::new(crate::layout::ModelSpec::preset("tiny").unwrap(), 16)
            .unwrap();
        let ours = wire_layout(&l);
        let theirs = WireLayout {
            head_dim: 64,
            ..ours.clone()
        };
        let r = check_compatible(&ours, &theirs).unwrap_err();
        assert_eq!(r.code, FailureCode::IncompatibleLayout);
        assert_eq!(r.message, "head_dim differs: ours 32, peer's 64");
        assert!(check_compatible(&ours, &ours).is_ok());
        // Token-granular pools of other page sizes pair; pages that move whole do not.
        let p32 = WireLayout {
            page_size: 32,
            ..ours.clone()
        };
        assert!(check_compatible(&ours, &p32).is_ok());
        let cpu = |page_size| WireLayout {
            order: PageOrder::VllmCpuVec,
            page_size,
            ..ours.clone()
        };
        let r = check_compatible(&cpu(16), &cpu(32)).unwrap_err();
        assert!(
            r.message
                .contains("page_size must match (source 16, destination 32)"),
            "{}",
            r.message
        );
        let r = check_compatible(&cpu(16), &ours).unwrap_err();
        assert!(
            r.message.contains("vllm_cpu_vec") && r.message.contains("token_major"),
            "{}",
            r.message
        );
    }
}
