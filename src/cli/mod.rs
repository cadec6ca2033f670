//! The command line: one subcommand per role. Each subcommand's arguments and its entry point
//! live in the file named after it; this file only dispatches.

mod agent;
mod bench;
mod bootstrap;
pub mod config;
pub mod demo;
mod proxy;
mod signal;

use clap::{Parser, Subcommand};

use crate::agent::AgentOptions;

/// kvferry moves KV cache from prefill ranks to decode ranks in disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(
    name = "kvferry",
    version = VERSION,
    long_version = long_version(),
    about,
    long_about = None,
    after_help = "Every flag can also be set by its KVFERRY_* environment variable (see each \
                  subcommand's --help) or in --config FILE (TOML; keys are the subcommand's long \
                  flag names). The command line beats the environment, which beats the file."
)]
pub struct Cli {
    /// TOML file of flag values, keyed by the subcommand's long flag names (`tp-size = 2`);
    /// the command line and KVFERRY_* variables override it.
    #[arg(long, global = true, env = crate::env::CONFIG_ENV, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Log format on stderr: text, or json (one object per line). RUST_LOG filters.
    #[arg(long, global = true, env = "KVFERRY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// The role this process plays.
    #[command(subcommand)]
    pub command: Command,
}

/// `-V`: the crate's version and the git revision it was built from (build.rs sets
/// `GIT_REVISION`: a short hash, `-dirty` when the tree differed, `unknown` outside git).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("GIT_REVISION"),
    ")"
);

/// What `kvferry_build_info` says on every role's `/metrics`: the parts of `--version`
/// ([`VERSION`], [`long_version`]).
pub const BUILD: kvferry_wire::BuildInfo = kvferry_wire::BuildInfo {
    version: env!("CARGO_PKG_VERSION"),
    revision: env!("GIT_REVISION"),
    protocol: crate::protocol::VERSION,
};

/// The cargo features this build has (`--features`): what it can do beyond ZeroMQ and the
/// in-memory registry. CUDA is no feature: it is loaded at run time by every build.
pub const FEATURES: &[(&str, bool)] = &[
    ("ucx", cfg!(feature = "ucx")),
    ("etcd", cfg!(feature = "etcd")),
];

/// `--version`: [`VERSION`], then the control protocol's version and the oldest one it still
/// speaks with a peer ([`crate::protocol::VERSION`], [`crate::protocol::MIN_VERSION`]), then
/// the features built in. `python -m kvferry --version` prints the same.
pub fn long_version() -> &'static str {
    static TEXT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let features: Vec<&str> = FEATURES
            .iter()
            .filter(|(_, on)| *on)
            .map(|(name, _)| *name)
            .collect();
        format!(
            "{VERSION}\nprotocol {} (speaks {} to {})\nfeatures: {}",
            crate::protocol::VERSION,
            crate::protocol::MIN_VERSION,
            crate::protocol::VERSION,
            if features.is_empty() {
                "none".to_owned()
            } else {
                features.join(", ")
            },
        )
    });
    &TEXT
}

/// How logs are written to stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (colored when stderr is a terminal).
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// `--pool`'s kinds, one phrase each, for both roles' help: every kind `PoolDescriptor` parses
/// and every build opens. No feature leaves the CUDA kinds out: the CUDA driver and NVRTC are
/// loaded at run time, and an agent given a device pool where they are missing refuses to
/// start, saying which. A kind that only some builds have would get its text per `cfg` here,
/// as `--transport`'s does. tests/processes/cli_help.rs holds this text to the parser.
macro_rules! pool_kinds {
    () => {
        "`anon` (the agent's own memory), `shm:<path>` (a shared-memory file the engine created), \
         `cuda-ipc:<device>:<handle>` (the engine's CUDA device memory, by its IPC handle in 128 \
         hex digits) or `cuda-vmm:<device>:<socket>` (the engine's CUDA device memory, by VMM \
         handles it serves on that Unix socket); docs/engines.md, \"Pools and page ownership\""
    };
}

/// The subcommands; each appears here once it works.
///
/// `prefill` and `decode` share [`AgentOptions`]; each hides the flags that only the other role
/// reads (they are still accepted, so one config file or flag list can serve both roles).
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the bootstrap registry that pairs prefill and decode ranks.
    Bootstrap(bootstrap::BootstrapArgs),
    /// Run the agent beside a prefill rank: push its KV pages to decode ranks.
    #[command(
        mut_arg("timeout_bootstrap_ms", |a| a.hide(true)),
        mut_arg("timeout_stall_ms", |a| a.hide(true)),
        mut_arg("staging_slots", |a| a.hide(true)),
        mut_arg("drain_untaken_ms", |a| a.hide(true)),
        mut_arg("data_port", |a| a.hide(true)),
        mut_arg("synthetic", |a| a.help("Run the built-in synthetic engine: fill each room's pages with a pattern the decode verifies (the prefill allocates them from its pool, writes a page's body once and each room's stamps, as --synthetic-verify says)")),
        mut_arg("pool", |a| a.help(concat!("The KV pool the engine's pages live in: ", pool_kinds!()))),
    )]
    Prefill(AgentOptions),
    /// Run the agent beside a decode rank: land KV pages from prefill ranks in its pool.
    #[command(
        mut_arg("synthetic_layer_ms", |a| a.hide(true)),
        mut_arg("placed_min_run_bytes", |a| a.hide(true)),
        mut_arg("control_port", |a| a.hide(true)),
        mut_arg("synthetic", |a| a.help("Run the built-in synthetic engine: allocate pages for rooms asked without `pages` and check the landed bytes on take (--synthetic-verify)")),
        mut_arg("pool", |a| a.help(concat!("The KV pool rooms land in: ", pool_kinds!()))),
    )]
    Decode(AgentOptions),
    /// Run a full prefill -> decode transfer on this machine and verify every byte.
    Demo(demo::DemoArgs),
    /// Measure end-to-end transfer throughput and latency over real processes on loopback.
    Bench(bench::BenchArgs),
    /// Route OpenAI requests to prefill and decode vLLM servers that move KV through kvferry.
    Proxy(proxy::ProxyArgs),
}

/// The metrics port of the registry or the proxy on `host`, bound when `--metrics-port` gave
/// one ([`kvferry_wire::metrics_port`]), and its URL for the listening line (a wildcard bind
/// named at loopback).
async fn metrics_port(
    host: &str,
    port: Option<u16>,
) -> anyhow::Result<Option<(tokio::net::TcpListener, String)>> {
    use anyhow::Context as _;
    let Some(port) = port else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .with_context(|| format!("binding the metrics port {host}:{port}"))?;
    let bound = listener.local_addr()?;
    let url = crate::exposure::url_of(bound, crate::exposure::loopback_of(bound), false);
    Ok(Some((listener, url)))
}

/// Logs to stderr in `format` (stdout carries the listening line and results only), filtered
/// by `RUST_LOG` (default `info`). A subscriber the process installed already wins.
pub fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        // One object per line; the event's fields at the top level, the span list kept so a
        // room can be followed.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_ansi(false)
            .try_init(),
    };
}

/// Runs the chosen subcommand to completion.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Bootstrap(args) => bootstrap::run(args),
        Command::Prefill(args) => agent::run(agent::AgentRole::Prefill, args),
        Command::Decode(args) => agent::run(agent::AgentRole::Decode, args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Proxy(args) => proxy::run(args),
    }
}
