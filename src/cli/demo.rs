//! `kvferry demo`: the main job on one machine. Starts a registry, one prefill and one decode
//! agent as real processes over real sockets, transfers rooms of mixed lengths with the
//! synthetic engine, verifies every byte, prints a table (or the bench JSON with `--json`)
//! and exits 0 only if every room landed intact.
//!
//! The cluster and the engine stand-in that drives its rooms are [`crate::cluster`]'s.

use anyhow::{Context as _, bail};
use serde_json::json;

use crate::cluster::{LocalCluster, drive_rooms, pool_pages, summary};
use crate::layout::{KvLayout, ModelSpec};
use crate::transport::TransportKind;

/// Run a full prefill -> decode transfer on this machine and verify every byte.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Model preset.
    #[arg(long, env = "KVFERRY_DEMO_MODEL", default_value = "llama3-8b")]
    model: String,
    /// Data-plane transport (its --help names this build's transports).
    #[arg(long, env = "KVFERRY_DEMO_TRANSPORT", default_value = "zmq-tcp", help = crate::transport::TRANSPORT_HELP)]
    transport: TransportKind,
    /// Room lengths in tokens, comma separated; one room each.
    #[arg(
        long,
        env = "KVFERRY_DEMO_TOKENS",
        value_delimiter = ',',
        default_value = "16,512,1000,4096,2500,128,3000,64"
    )]
    tokens: Vec<usize>,
    /// Rooms in flight at once.
    #[arg(long, env = "KVFERRY_DEMO_CONCURRENCY", default_value_t = 4)]
    concurrency: usize,
    /// Tokens per page.
    #[arg(long, env = "KVFERRY_DEMO_PAGE_SIZE", default_value_t = 16)]
    page_size: usize,
    /// Print the bench JSON (as `kvferry bench --json`) instead of a table.
    #[arg(long, env = "KVFERRY_DEMO_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    json: bool,
    /// Where the engines' KV pools live: host memory, or CUDA device 0 (the demo allocates
    /// both pools there and the agents map them by CUDA IPC handle; on a machine without a GPU,
    /// the CUDA driver emulator of docs/gpu.md).
    #[arg(long, env = "KVFERRY_DEMO_POOL", value_enum, default_value_t = DemoPool::Host)]
    pool: DemoPool,
}

/// Where `kvferry demo` puts the pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoPool {
    /// Host memory of each agent.
    Host,
    /// Device memory of this process, mapped by the agents.
    Device,
}

/// Runs the demo.
pub(crate) fn run(args: DemoArgs) -> anyhow::Result<()> {
    let model = ModelSpec::preset(&args.model)?;
    let layout = KvLayout::new(model, args.page_size)?;
    let max_tokens = args
        .tokens
        .iter()
        .copied()
        .max()
        .context("--tokens is empty")?;
    if args.tokens.contains(&0) {
        bail!("--tokens must all be > 0");
    }
    let pages = pool_pages(&layout, max_tokens, args.concurrency);
    let exe = crate::cluster::kvferry_exe()?;
    let agent_args: Vec<String> = [
        "--model",
        &args.model,
        "--page-size",
        &args.page_size.to_string(),
        "--pool-pages",
        &pages.to_string(),
        "--transport",
        args.transport.name(),
        "--synthetic",
        // The demo's promise: every byte checked.
        "--synthetic-verify",
        "full",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    // Device pools: this process is the engine; it allocates both pools and keeps them until
    // the agents are gone (`cluster` drops first).
    let (pools, on) = device_pools(args.pool, &layout, pages)?;
    let role_args = |role: &str| match &pools {
        Some([prefill, decode]) => {
            let (_, pool) = if role == "prefill" { prefill } else { decode };
            vec!["--pool".to_owned(), pool.clone()]
        }
        None => Vec::new(),
    };
    let cluster = LocalCluster::start_per_role(&exe, "demo", &agent_args, &role_args)?;
    let apis = cluster.apis()?;
    let rooms: Vec<(u64, usize)> = args
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (i as u64 + 1, *t))
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let results = runtime.block_on(drive_rooms(&apis, rooms, args.concurrency))?;
    let line = summary(
        &results,
        args.transport.name(),
        &args.model,
        json!(args.tokens),
        args.page_size,
        args.concurrency,
        (1, 1),
    );
    if args.json {
        println!("{line}");
    } else {
        println!(
            "{:>6} {:>7} {:>10} {:>10} {:>9} {:>9}",
            "room", "tokens", "MiB", "state", "verified", "lat ms"
        );
        for r in &results {
            let state = r
                .code
                .as_deref()
                .map_or(r.state.clone(), |c| format!("{} ({c})", r.state));
            println!(
                "{:>6} {:>7} {:>10.1} {:>10} {:>9} {:>9.2}",
                r.room,
                r.tokens,
                r.bytes as f64 / (1 << 20) as f64,
                state,
                r.verified,
                r.latency_ms
            );
        }
        println!(
            "{} rooms over {} between {on}: {} verified, {:.2} GB/s end to end, p50 {:.2} ms (memcpy {:.1} GB/s); logs in {}",
            results.len(),
            args.transport,
            line["verified_rooms"],
            line["throughput_gbps"].as_f64().unwrap_or(0.0),
            line["latency_ms"]["p50"].as_f64().unwrap_or(0.0),
            line["memcpy_gbps"].as_f64().unwrap_or(0.0),
            cluster.logs.display()
        );
    }
    let failed = line["failed_rooms"].as_u64().unwrap_or(1);
    drop(cluster);
    drop(pools);
    if failed > 0 {
        bail!("{failed} rooms did not land intact");
    }
    Ok(())
}

/// A device pool this process allocated, and the `--pool` that names it.
type ExportedPool = (crate::kernel::cuda::ExportedMemory, String);

/// For device pools, the prefill's and the decode's memory on device 0 with the `--pool` that
/// names it (the agents map it until they exit: keep it until then); and what the pools are,
/// for the summary line.
fn device_pools(
    pool: DemoPool,
    layout: &KvLayout,
    pages: usize,
) -> anyhow::Result<(Option<[ExportedPool; 2]>, String)> {
    use crate::kernel::cuda::{CudaKernel, ExportedMemory};
    if pool == DemoPool::Host {
        return Ok((None, "host-memory pools".to_owned()));
    }
    let kernel = CudaKernel::shared(0).context(
        "kvferry demo --pool device needs CUDA device 0 (a GPU, or the CUDA driver emulator: \
         LD_LIBRARY_PATH=$(emu/cuda/build):$LD_LIBRARY_PATH, docs/gpu.md)",
    )?;
    let name = kernel.device_name()?;
    let bytes = layout.pool_bytes(pages)?;
    let export = |fill: u8| -> anyhow::Result<(ExportedMemory, String)> {
        let memory = ExportedMemory::new(&kernel, bytes, fill)?;
        let descriptor = memory.descriptor()?.to_string();
        Ok((memory, descriptor))
    };
    let pools = [export(0)?, export(0xDE)?];
    Ok((Some(pools), format!("device pools on {name} (CUDA IPC)")))
}
