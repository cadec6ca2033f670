//! The agent's options ([`AgentOptions`]): the flags of `kvferry prefill|decode`, their
//! `KVFERRY_*` variables and defaults, checked and turned into an [`AgentConfig`]. The command
//! line takes them as its agent subcommands' arguments; the Python package passes an engine's
//! keyword options through the same parser ([`AgentOptions::from_flags`]), so embedded agents
//! read the same variables, below the options given in code.

use std::time::Duration;

use super::synthetic::Verify;
use super::{AgentConfig, DirectWrites, MappedWrites, StagingChoice, Timeouts};
use crate::layout::{AttentionKind, Dtype, KvFormat, KvLayout, KvPlacement, ModelSpec, PageOrder};
use crate::protocol::Ranks;
use crate::transport::TransportKind;

/// Flags shared by `kvferry prefill` and `kvferry decode`.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentOptions {
    /// URL of the bootstrap registry, or a comma-separated list of registry replicas
    /// (`http://a:8998,http://b:8998`): tried in order, the next on a connection error, a
    /// timeout or a 5xx.
    #[arg(
        long,
        env = "KVFERRY_BOOTSTRAP",
        default_value = "http://127.0.0.1:8998"
    )]
    pub bootstrap: String,
    /// Decode: registries besides --bootstrap's that a room or hold may name (its `bootstrap`
    /// field; SGLang's router names each prefill server's own), comma-separated: HOST:PORT,
    /// HOST:* (any port), an IP network (10.0.0.0/8:*, [fd00::/8]:*) or a URL. Only these get
    /// the token; a room naming another registry is refused (403) and nothing is sent to it.
    #[arg(
        long,
        env = "KVFERRY_ALLOWED_REGISTRIES",
        value_delimiter = ',',
        value_name = "HOST:PORT"
    )]
    pub allowed_registries: Vec<String>,
    /// Data-parallel rank of this engine.
    #[arg(long, env = "KVFERRY_DP_RANK", default_value_t = 0)]
    pub dp_rank: u32,
    /// Data-parallel size.
    #[arg(long, env = "KVFERRY_DP_SIZE", default_value_t = 1)]
    pub dp_size: u32,
    /// Tensor-parallel rank.
    #[arg(long, env = "KVFERRY_TP_RANK", default_value_t = 0)]
    pub tp_rank: u32,
    /// Tensor-parallel size.
    #[arg(long, env = "KVFERRY_TP_SIZE", default_value_t = 1)]
    pub tp_size: u32,
    /// Pipeline-parallel rank (stage).
    #[arg(long, env = "KVFERRY_PP_RANK", default_value_t = 0)]
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    #[arg(long, env = "KVFERRY_PP_SIZE", default_value_t = 1)]
    pub pp_size: u32,
    /// Model preset: tiny, tiny-mla, llama3-8b, llama3-70b, qwen2.5-7b, deepseek-v3.
    #[arg(long, env = "KVFERRY_MODEL", default_value = "llama3-8b")]
    pub model: String,
    /// Override the preset's layer count.
    #[arg(long, env = "KVFERRY_LAYERS")]
    pub layers: Option<usize>,
    /// Override the preset's total KV head count.
    #[arg(long, env = "KVFERRY_KV_HEADS")]
    pub kv_heads: Option<usize>,
    /// Override the preset's head dimension (latent width for MLA).
    #[arg(long, env = "KVFERRY_HEAD_DIM")]
    pub head_dim: Option<usize>,
    /// Override the preset's dtype: bf16, fp16, fp8_e4m3, fp8_e5m2, fp32.
    #[arg(long, env = "KVFERRY_DTYPE")]
    pub dtype: Option<Dtype>,
    /// Override the preset's attention kind: mha, mla.
    #[arg(long, env = "KVFERRY_ATTENTION")]
    pub attention: Option<AttentionKind>,
    /// How the engine lays its KV out in the pool's memory: kvferry, kvferry-head-major,
    /// vllm-cpu-vec, vllm-cpu-amx, vllm-nhd, vllm-hnd, vllm-flash-nhd, vllm-flash-hnd,
    /// flashinfer, sglang-mha, sglang-mla, vllm-mla (docs/architecture.md). A pool file (--pool shm:) holds the format's regions back to back.
    #[arg(long, env = "KVFERRY_KV_FORMAT", default_value = "kvferry")]
    pub kv_format: String,
    /// Order inside a page of the kvferry format: token_major (SGLang, vLLM NHD) or head_major
    /// (vLLM HND).
    #[arg(long, env = "KVFERRY_PAGE_ORDER", default_value = "token_major")]
    pub page_order: PageOrder,
    /// Tokens per page.
    #[arg(long, env = "KVFERRY_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,
    /// Pages in this agent's pool.
    #[arg(long, env = "KVFERRY_POOL_PAGES", default_value_t = 1024)]
    pub pool_pages: usize,
    /// Data-plane transport (its --help names this build's transports).
    #[arg(long, env = "KVFERRY_TRANSPORT", default_value = "zmq-tcp", help = crate::transport::TRANSPORT_HELP)]
    pub transport: TransportKind,
    /// Address the control and data sockets bind and advertise. Any address but a loopback
    /// one (0.0.0.0 and :: included) needs --token, or --insecure.
    #[arg(long, env = "KVFERRY_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Address peers reach the control and data sockets at, as registered and sent in Hello
    /// (default: --host; a wildcard such as 0.0.0.0 or :: is refused: name this host's
    /// address). A UCX data endpoint carries UCX's own interface addresses instead.
    #[arg(long, env = "KVFERRY_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Port of the control socket decode agents connect to (0 picks one; the listening line
    /// tells which).
    #[arg(long, env = "KVFERRY_CONTROL_PORT", default_value_t = 0)]
    pub control_port: u16,
    /// Port of the data socket prefill agents connect to, for zmq-tcp (0 picks one; UCX picks
    /// its own ports, zmq-ipc uses a socket file).
    #[arg(long, env = "KVFERRY_DATA_PORT", default_value_t = 0)]
    pub data_port: u16,
    /// Address of the engine-facing HTTP API (keep it local). Any address but a loopback one
    /// needs --token (--insecure does not lift this): with a token, every route but /healthz
    /// and /metrics needs `Authorization: Bearer TOKEN`.
    #[arg(long, env = "KVFERRY_API_HOST", default_value = "127.0.0.1")]
    pub api_host: String,
    /// Port of the engine-facing HTTP API (0 picks one; the listening line tells which).
    #[arg(long, env = "KVFERRY_API_PORT", default_value_t = 0)]
    pub api_port: u16,
    /// Port of the metrics port on --metrics-host: /metrics, /livez and /readyz (ready once
    /// registered, until the agent drains), read-only, plain HTTP, no token; keep it reachable
    /// by the scraper and the kubelet only (0 picks a free one; the listening line tells
    /// which). Without it, none.
    #[arg(long, env = "KVFERRY_METRICS_PORT")]
    pub metrics_port: Option<u16>,
    /// Address of the metrics port (default: --api-host). It serves no room operation, so
    /// any address is allowed without a token: a scraper on another host reaches it while the
    /// engine API stays on loopback.
    #[arg(long, env = "KVFERRY_METRICS_HOST")]
    pub metrics_host: Option<String>,
    /// Run the built-in synthetic engine: the prefill fills pages with a pattern, the decode
    /// checks the landed bytes on take (--synthetic-verify).
    #[arg(long, env = "KVFERRY_SYNTHETIC", value_parser = clap::builder::BoolishValueParser::new())]
    pub synthetic: bool,
    /// Which tokens a synthetic prefill stamps and how a synthetic decode checks a landed room
    /// on take (set both agents alike): `full` stamps every token and checks every byte;
    /// `stamp` stamps one token in 16 and the room's last, and checks those stamps and a sample
    /// of the rest. A stamp is the first 8 bytes of a head slice, naming its room, token,
    /// layer, plane and head.
    #[arg(long, env = "KVFERRY_SYNTHETIC_VERIFY", value_enum, default_value_t = Verify::Full)]
    pub synthetic_verify: Verify,
    /// Shared secret: sent to the trusted registries (--bootstrap, --allowed-registries), and
    /// proven, never sent, to the prefills they list (ZeroMQ challenge); the engine API asks
    /// for it as a bearer token.
    #[arg(long, env = "KVFERRY_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Serve a non-loopback --host without --token, or send and check the token over plain
    /// HTTP beyond loopback (--bootstrap, --api-host; warns at start), or send it in clear to
    /// agents older than protocol 12 beyond loopback. Only for networks where
    /// every host that can reach the agent is trusted. The engine API (--api-host) beyond
    /// loopback always needs --token.
    #[arg(long, env = "KVFERRY_INSECURE", value_parser = clap::builder::BoolishValueParser::new())]
    pub insecure: bool,
    /// HTTPS for the engine API (--tls-cert, --tls-key) and the registries' certificates
    /// (--tls-ca).
    #[command(flatten)]
    pub tls: crate::tls::TlsOptions,
    /// Largest chunk of staging bytes moved at once: the size of one staging slot. Lower it
    /// only to save staging memory, as smaller chunks make rooms slower (docs/tuning.md,
    /// "Chunks and staging").
    #[arg(long, env = "KVFERRY_CHUNK_BYTES", default_value_t = 1 << 20)]
    pub chunk_bytes: usize,
    /// Staging slots per prefill peer: chunks in flight from one prefill at once (the decode
    /// grants them; the staging budget of a pair is slots x chunk bytes on each side).
    #[arg(long, env = "KVFERRY_STAGING_SLOTS", default_value_t = 8)]
    pub staging_slots: usize,
    /// The KV pool: `anon` (the agent's own memory), `shm:<path>` (a pool an engine created
    /// in shared memory), or the engine's CUDA device memory: `cuda-ipc:<device>:<handle>`
    /// (a CUDA IPC handle, 128 hex digits) or `cuda-vmm:<device>:<socket>` (VMM shareable
    /// handles the engine sends over its Unix socket).
    #[arg(long, env = "KVFERRY_POOL", default_value = "anon")]
    pub pool: crate::pool::PoolDescriptor,
    /// Synthetic engine pacing: announce each room one layer at a time, this many ms apart
    /// (layer-wise prefill); 0 announces whole rooms.
    #[arg(long, env = "KVFERRY_SYNTHETIC_LAYER_MS", default_value_t = 0.0)]
    pub synthetic_layer_ms: f64,
    /// Threads of the CPU copy kernel.
    #[arg(long, env = "KVFERRY_COPY_THREADS", default_value_t = 2)]
    pub copy_threads: usize,
    /// Waiting for the prefill group to register, in ms.
    #[arg(long, env = "KVFERRY_TIMEOUT_BOOTSTRAP_MS", default_value_t = 30_000)]
    pub timeout_bootstrap_ms: u64,
    /// Connecting to a peer and its answer to Hello, in ms.
    #[arg(long, env = "KVFERRY_TIMEOUT_CONNECT_MS", default_value_t = 5_000)]
    pub timeout_connect_ms: u64,
    /// A finished room not taken within this many ms expires and its agent-owned pages return.
    #[arg(long, env = "KVFERRY_ROOM_TTL_MS", default_value_t = 60_000)]
    pub room_ttl_ms: u64,
    /// Prefill: a ready room a decode holds for a request queued in its engine is kept past
    /// --room-ttl-ms, renewed by that decode's heartbeats, until at most this many ms after
    /// it was announced.
    #[arg(long, env = "KVFERRY_ROOM_MAX_MS", default_value_t = 600_000)]
    pub room_max_ms: u64,
    /// Prefill: the pages of ready rooms that one decode may hold for its engine's queued
    /// requests (each decode its own budget); a room past it is not held and expires at its
    /// TTL. Default: half of --pool-pages.
    #[arg(long, env = "KVFERRY_MAX_HELD_PAGES")]
    pub max_held_pages: Option<usize>,
    /// One send of a chunk or a control message, in ms.
    #[arg(long, env = "KVFERRY_TIMEOUT_SEND_MS", default_value_t = 30_000)]
    pub timeout_send_ms: u64,
    /// Waiting for the engine's ready pieces of a requested room (and, on a device pool, for
    /// each piece's CUDA event), in ms; then the room fails with `timeout_ready`.
    #[arg(long, env = "KVFERRY_TIMEOUT_READY_MS", default_value_t = 60_000)]
    pub timeout_ready_ms: u64,
    /// A transferring room without progress this many ms fails with `timeout_stall`.
    #[arg(long, env = "KVFERRY_TIMEOUT_STALL_MS", default_value_t = 30_000)]
    pub timeout_stall_ms: u64,
    /// On SIGTERM, in-flight rooms get this many ms to finish; the rest are aborted.
    #[arg(long, env = "KVFERRY_DRAIN_TIMEOUT_MS", default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
    /// On SIGTERM, rooms that landed but were not taken stay takeable until taken or
    /// this many ms after the last one landed (counted from SIGTERM at the earliest); then
    /// the process exits and they are discarded.
    #[arg(long, env = "KVFERRY_DRAIN_UNTAKEN_MS", default_value_t = 10_000)]
    pub drain_untaken_ms: u64,
    /// Checksum every chunk (xxh3-64) and verify it on landing; enable on both sides.
    #[arg(long, env = "KVFERRY_CHECKSUM", value_parser = clap::builder::BoolishValueParser::new())]
    pub checksum: bool,
    /// Rooms in flight at most; more are refused with 429 at once. A prefill that serves reads
    /// admits every read: each decode bounds its own.
    #[arg(long, env = "KVFERRY_MAX_ROOMS", default_value_t = 1024)]
    pub max_rooms: usize,
    /// Prefill: serve reads, requests that name the pages of this pool themselves for a room
    /// no engine announced (a byte arena any decode with the token may read, such as LMCache's
    /// transfer channel's); without it such requests are refused.
    #[arg(long, env = "KVFERRY_SERVE_READS", value_parser = clap::builder::BoolishValueParser::new())]
    pub serve_reads: bool,
    /// Fault injection for tests: invert every byte of the N-th chunk this prefill sends (after
    /// its checksum; a direct chunk gets a wrong checksum instead).
    #[arg(long, env = "KVFERRY_FAULT_CORRUPT_CHUNK", hide = true)]
    pub fault_corrupt_chunk: Option<u64>,
    /// Fault injection for tests: the engine API serves `POST /v1/faults`, which arms the same
    /// corruption while a prefill runs (`{"corrupt_chunk": N}`: the N-th chunk sent from now)
    /// and changes either role's timeouts (`{"timeouts": {"room_ttl_ms": N, ...}}`), so that
    /// servers shared by many tests need no restart for one that injects a fault.
    #[arg(long, env = "KVFERRY_FAULT_INJECTION", hide = true,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub fault_injection: bool,
    /// Direct path (pool pages straight into the decode pool; `ucx`, and `zmq-ipc` by mapping
    /// the decode's pool): `auto` where the transport's writes are fast and safe and the runs
    /// pay, `always`, or `never`.
    #[arg(long, env = "KVFERRY_DIRECT_WRITES", value_enum, default_value_t = DirectWrites::Auto)]
    pub direct_writes: DirectWrites,
    /// Mapped writes between agents of one host (`zmq-ipc`, `ucx` with shared memory in
    /// UCX_TLS): `auto` (the decode serves its pool's memory file, the prefill maps it and
    /// copies into it; first choice where both allow it) or `never` (over UCX: placed runs the
    /// decode posted, or staged).
    #[arg(long, env = "KVFERRY_MAPPED_WRITES", value_enum, default_value_t = MappedWrites::Auto)]
    pub mapped_writes: MappedWrites,
    /// Where a device pool's chunks wait for the transport: `auto` stages in device memory
    /// when the transport sends it (UCX built with CUDA, found at start) and in pinned host
    /// memory otherwise; `pinned-host`; or `device`, which refuses to start where the transport
    /// cannot send device memory (or with --checksum). Host pools stage on the host.
    #[arg(long, env = "KVFERRY_STAGING", value_enum, default_value_t = StagingChoice::Auto)]
    pub staging: StagingChoice,
    /// Shortest average run, in bytes, that a piece sends as placed runs rather than staged:
    /// each run is one message. Default: 131072 where runs go by rendezvous (a handshake and a
    /// read: shared memory), 16384 where they go as eager messages (tcp). Lower it on a fabric
    /// whose messages are cheap (RDMA); docs/tuning.md, "Placed runs".
    #[arg(long, env = "KVFERRY_PLACED_MIN_RUN_BYTES")]
    pub placed_min_run_bytes: Option<u64>,
    /// The engine that embeds this agent and its version (`vllm 0.32.0`), as registered: the
    /// registry lists it, and routers and operators read it (the connectors set it).
    #[arg(long, env = "KVFERRY_ENGINE")]
    pub engine: Option<String>,
    /// The model the engine serves, by the name clients give it, as registered: a prefill and
    /// a decode that name different models are never paired (the connectors set it).
    #[arg(long, env = "KVFERRY_SERVED_MODEL")]
    pub served_model: Option<String>,
    /// The base URL of the engine's OpenAI-compatible server this rank belongs to
    /// (`http://10.0.0.5:8000`), as registered: `kvferry proxy --bootstrap` finds engine
    /// servers by it. The vLLM connector derives it from the server's `--host`/`--port`.
    #[arg(long, env = "KVFERRY_SERVER_URL")]
    pub server_url: Option<String>,
    /// Period of heartbeats on every control connection, in ms.
    #[arg(long, env = "KVFERRY_HEARTBEAT_MS", default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// A peer silent this many ms is declared dead and its rooms fail with `peer_dead`.
    #[arg(long, env = "KVFERRY_PEER_DEAD_MS", default_value_t = 5_000)]
    pub peer_dead_ms: u64,
    /// Prefill: a room whose decode died before the room was delivered goes back to waiting
    /// for another decode (a router that sends the request again with its room, as `kvferry
    /// proxy` does, gets it without a second prefill) for this many ms, renewed by the
    /// heartbeats of a decode that holds it for a queued request; then it fails `peer_dead`.
    /// 0: such rooms fail at once.
    #[arg(long, env = "KVFERRY_REQUEUE_MS", default_value_t = 5_000)]
    pub requeue_ms: u64,
}

impl AgentOptions {
    /// Checks the flags and builds the agent configuration.
    pub fn config(&self) -> anyhow::Result<AgentConfig> {
        let ranks = Ranks {
            dp_rank: self.dp_rank,
            dp_size: self.dp_size,
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
            pp_rank: self.pp_rank,
            pp_size: self.pp_size,
        };
        for (name, rank, size) in [
            ("dp", self.dp_rank, self.dp_size),
            ("tp", self.tp_rank, self.tp_size),
            ("pp", self.pp_rank, self.pp_size),
        ] {
            if size == 0 || rank >= size {
                anyhow::bail!("--{name}-rank {rank} must be < --{name}-size {size}");
            }
        }
        crate::exposure::check_api(&self.api_host, self.token.is_some())?;
        crate::exposure::check(&self.binds(), self.token.is_some(), self.insecure)?;
        let token = self.token.is_some();
        let api = ("--api-host", self.api_host.as_str());
        crate::exposure::check_clear(api, token, self.tls.serves(), self.insecure)?;
        for url in self.bootstrap.split(',') {
            crate::exposure::check_clear_url(("--bootstrap", url.trim()), token, self.insecure)?;
        }
        let api_tls = self.tls.load()?;
        let registries = super::TrustedRegistries::new(&self.bootstrap, &self.allowed_registries)?
            .in_clear_refused(token && !self.insecure);
        #[cfg(feature = "ucx")]
        if self.transport == crate::transport::TransportKind::Ucx
            && self.token.is_none()
            && !self.insecure
            && let Ok(devices) = std::env::var("UCX_NET_DEVICES")
            && devices.split(',').any(|d| d.trim() != "lo")
        {
            anyhow::bail!(
                "UCX_NET_DEVICES={devices} lets UCX listen beyond loopback: give --token or --insecure"
            );
        }
        let advertise_host =
            crate::exposure::advertised(&self.host, self.advertise_host.as_deref())?;
        let preset = ModelSpec::preset(&self.model)?;
        let model = ModelSpec {
            kind: self.attention.unwrap_or(preset.kind),
            num_layers: self.layers.unwrap_or(preset.num_layers),
            num_kv_heads: self.kv_heads.unwrap_or(preset.num_kv_heads),
            head_dim: self.head_dim.unwrap_or(preset.head_dim),
            dtype: self.dtype.unwrap_or(preset.dtype),
        };
        let format = KvFormat::named(&self.kv_format)?;
        let mut layout = KvLayout::new(model, self.page_size)?.with_format(&format)?;
        if self.page_order != PageOrder::TokenMajor {
            if format.name != "kvferry" {
                anyhow::bail!(
                    "--page-order applies to the kvferry format; --kv-format {} fixes its own",
                    format.name
                );
            }
            layout = layout.with_order(self.page_order, KvPlacement::Planes)?;
        }
        let layout = layout.for_rank(
            self.tp_rank as usize,
            self.tp_size as usize,
            self.pp_rank as usize,
            self.pp_size as usize,
        )?;
        if self.pool_pages == 0 {
            anyhow::bail!("--pool-pages must be > 0");
        }
        if self.chunk_bytes == 0 || u32::try_from(self.chunk_bytes).is_err() {
            anyhow::bail!("--chunk-bytes must be > 0 and < 4 GiB");
        }
        if self.max_rooms == 0 {
            anyhow::bail!("--max-rooms must be > 0");
        }
        if self.staging_slots == 0 {
            anyhow::bail!("--staging-slots must be > 0");
        }
        if self.serve_reads && self.synthetic {
            anyhow::bail!(
                "--serve-reads with --synthetic: the synthetic engine would write its pattern into the pages reads name"
            );
        }
        if !(self.synthetic_layer_ms >= 0.0 && self.synthetic_layer_ms.is_finite()) {
            anyhow::bail!("--synthetic-layer-ms must be >= 0");
        }
        let ms = Duration::from_millis;
        let timeouts = Timeouts {
            bootstrap: ms(self.timeout_bootstrap_ms),
            connect: ms(self.timeout_connect_ms),
            room_ttl: ms(self.room_ttl_ms),
            room_max: ms(self.room_max_ms),
            send: ms(self.timeout_send_ms),
            ready: ms(self.timeout_ready_ms),
            stall: ms(self.timeout_stall_ms),
            drain: ms(self.drain_timeout_ms),
            drain_untaken: ms(self.drain_untaken_ms),
            heartbeat: ms(self.heartbeat_ms),
            dead_after: ms(self.peer_dead_ms),
            requeue: ms(self.requeue_ms),
        };
        timeouts.check().map_err(anyhow::Error::msg)?;
        Ok(AgentConfig {
            about: kvferry_bootstrap::About {
                engine: self.engine.clone(),
                model: self.served_model.clone(),
                server: self
                    .server_url
                    .as_deref()
                    .map(|u| u.trim_end_matches('/').to_owned()),
                ..kvferry_bootstrap::About::default()
            },
            bootstrap: self.bootstrap.clone(),
            registries,
            ranks,
            layout,
            pool_pages: self.pool_pages,
            transport: self.transport,
            host: self.host.clone(),
            advertise_host,
            control_port: self.control_port,
            data_port: self.data_port,
            api_host: self.api_host.clone(),
            api_port: self.api_port,
            metrics_port: self.metrics_port,
            metrics_host: self
                .metrics_host
                .clone()
                .unwrap_or_else(|| self.api_host.clone()),
            api_tls,
            synthetic: self.synthetic,
            synthetic_verify: self.synthetic_verify,
            token: self.token.clone(),
            insecure: self.insecure,
            chunk_bytes: self.chunk_bytes,
            staging_slots: self.staging_slots,
            pool: self.pool.clone(),
            synthetic_layer_delay: Duration::from_secs_f64(self.synthetic_layer_ms / 1e3),
            checksum: self.checksum,
            max_rooms: self.max_rooms,
            serve_reads: self.serve_reads,
            max_held_pages: self.max_held_pages.unwrap_or(self.pool_pages / 2),
            fault_corrupt_chunk: self.fault_corrupt_chunk,
            fault_injection: self.fault_injection,
            copy_threads: self.copy_threads,
            direct_writes: self.direct_writes,
            mapped_writes: self.mapped_writes,
            staging: self.staging,
            placed_min_run_bytes: self.placed_min_run_bytes,
            timeouts,
        })
    }
}

/// The agent flags alone, as `kvferry prefill` and `kvferry decode` take them.
#[derive(clap::Parser)]
#[command(name = "kvferry", no_binary_name = true)]
struct AgentFlags {
    #[command(flatten)]
    agent: AgentOptions,
}

impl AgentOptions {
    /// Parses agent flags (`["--model", "tiny", "--page-size", "16"]`) with the command line's
    /// parser: the same defaults, `KVFERRY_*` variables and errors, for agents started in
    /// process.
    pub fn from_flags<I, T>(flags: I) -> Result<AgentOptions, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        <AgentFlags as clap::Parser>::try_parse_from(flags).map(|f| f.agent)
    }

    pub(crate) fn binds(&self) -> [(&'static str, &str); 2] {
        [
            ("--host", self.host.as_str()),
            ("--api-host", self.api_host.as_str()),
        ]
    }
}
