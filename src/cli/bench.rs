//! `kvferry bench`: the end-to-end transfer benchmark. For each transport it starts a fresh
//! local cluster (registry, prefill and decode agents as real processes on loopback, synthetic
//! engine), or targets two running agents, and sweeps room sizes. Each (transport, tokens)
//! configuration runs its warm-up rooms, then its measured rooms, and yields one bench JSON
//! object (built by [`cluster::summary`], whose doc gives the units).
//!
//! stdout carries the results only: a table, or with `--json` JSON Lines and nothing else.
//! A progress line goes to stderr when stderr is a terminal. `--out DIR` writes `bench.jsonl`,
//! `throughput.svg` and `latency.svg`.
//!
//! The synthetic fill (prefill) and verification (decode, on take) run outside the timed
//! window: the agents time a room from the engine's ready to the decode's success. They still
//! take CPU from the rooms in flight, so the bench keeps them cheap: a pool page's pattern body
//! is written once and each room only rewrites its stamps, and by default (`--verify stamp`)
//! the prefill stamps one token in 16 and the decode reads those stamps and a sample of the
//! body (src/agent/synthetic.rs).

mod plot;

use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use crate::agent::synthetic::Verify;
use crate::agent::{DirectWrites, MappedWrites};
use crate::cluster::{self, LocalCluster, Shape};
use crate::layout::{KvLayout, ModelSpec};
use crate::transport::TransportKind;

/// Measure end-to-end KV transfer throughput and latency over real processes on loopback.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Data-plane transports, comma separated (zmq-tcp, zmq-ipc, and with UCX: ucx, ucx-tcp,
    /// ucx-shm, the last two setting UCX_TLS for the run); each gets a fresh cluster.
    #[arg(
        long,
        env = "KVFERRY_BENCH_TRANSPORT",
        value_delimiter = ',',
        default_value = "zmq-tcp"
    )]
    transport: Vec<BenchTransport>,
    /// Model preset: tiny, tiny-mla, llama3-8b, llama3-70b, qwen2.5-7b, deepseek-v3.
    #[arg(long, env = "KVFERRY_BENCH_MODEL", default_value = "llama3-8b")]
    model: String,
    /// Room lengths in tokens, comma separated; one configuration each.
    #[arg(
        long,
        env = "KVFERRY_BENCH_TOKENS",
        value_delimiter = ',',
        default_value = "16,64,256,1024,4096"
    )]
    tokens: Vec<usize>,
    /// Tokens per page.
    #[arg(long, env = "KVFERRY_BENCH_PAGE_SIZE", default_value_t = 16)]
    page_size: usize,
    /// Measured rooms per configuration.
    #[arg(long, env = "KVFERRY_BENCH_ROOMS", default_value_t = 8)]
    rooms: usize,
    /// Rooms in flight at once.
    #[arg(long, env = "KVFERRY_BENCH_CONCURRENCY", default_value_t = 1)]
    concurrency: usize,
    /// Warm-up rooms run before each configuration's measured rooms, not reported; at least
    /// --concurrency unless 0, so that the measured rooms find the prefill pages they use
    /// filled once (a page's first synthetic fill writes its whole pattern, later ones only
    /// the room's stamps).
    #[arg(long, env = "KVFERRY_BENCH_WARMUP", default_value_t = 1)]
    warmup: usize,
    /// Largest chunk of staging bytes moved at once, passed to the agents (with
    /// --prefill-api/--decode-api it only labels the results: set it on the agents).
    #[arg(long, env = "KVFERRY_BENCH_CHUNK_BYTES", default_value_t = 1 << 20)]
    chunk_bytes: usize,
    /// HTTP API of a running prefill agent: bench it (with --decode-api) instead of starting
    /// a cluster. The agents must run with --synthetic and a pool big enough for
    /// --concurrency rooms of the largest --tokens; --transport then names theirs.
    #[arg(long, env = "KVFERRY_BENCH_PREFILL_API", requires = "decode_api")]
    prefill_api: Option<String>,
    /// HTTP API of a running decode agent (with --prefill-api).
    #[arg(long, env = "KVFERRY_BENCH_DECODE_API", requires = "prefill_api")]
    decode_api: Option<String>,
    /// The running agents' token (with --prefill-api/--decode-api): their engine API needs it
    /// as a bearer token.
    #[arg(long, env = "KVFERRY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The CA of agents whose engine API serves HTTPS (running ones, or those this bench starts
    /// with KVFERRY_TLS_CERT in its environment).
    #[command(flatten)]
    tls: crate::tls::TlsTrust,
    /// Prefill TP size: one agent per rank (heterogeneous TP pairs prefill and decode ranks by
    /// head ranges).
    #[arg(long, env = "KVFERRY_BENCH_PREFILL_TP", default_value_t = 1)]
    prefill_tp: u32,
    /// Decode TP size.
    #[arg(long, env = "KVFERRY_BENCH_DECODE_TP", default_value_t = 1)]
    decode_tp: u32,
    /// Prefill PP size (each stage sends its layers to the decode).
    #[arg(long, env = "KVFERRY_BENCH_PREFILL_PP", default_value_t = 1)]
    prefill_pp: u32,
    /// Direct path (`ucx` and `zmq-ipc`), passed to the agents: `auto`, `always` or `never`.
    #[arg(long, env = "KVFERRY_BENCH_DIRECT_WRITES", value_enum, default_value_t = DirectWrites::Auto)]
    direct_writes: DirectWrites,
    /// Mapped writes on this host (`zmq-ipc`, `ucx-shm`), passed to the agents: `auto` or
    /// `never` (`ucx-shm`: placed runs instead).
    #[arg(long, env = "KVFERRY_BENCH_MAPPED_WRITES", value_enum, default_value_t = MappedWrites::Auto)]
    mapped_writes: MappedWrites,
    /// Which tokens the prefill stamps and how the decode checks each room on take, passed to
    /// the agents as --synthetic-verify (with --prefill-api/--decode-api it only labels the
    /// results: set it on both agents).
    #[arg(long, env = "KVFERRY_BENCH_VERIFY", value_enum, default_value_t = Verify::Stamp)]
    verify: Verify,
    /// Print JSON Lines (one object per configuration) instead of a table.
    #[arg(long, env = "KVFERRY_BENCH_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    json: bool,
    /// Also write bench.jsonl, throughput.svg and latency.svg into this folder.
    #[arg(long, env = "KVFERRY_BENCH_OUT")]
    out: Option<PathBuf>,
}

impl BenchArgs {
    /// Checks the flags against each other and the model.
    fn validate(&self) -> anyhow::Result<KvLayout> {
        let layout = KvLayout::new(ModelSpec::preset(&self.model)?, self.page_size)?;
        if self.transport.is_empty() {
            bail!("--transport is empty");
        }
        if self.tokens.is_empty() || self.tokens.contains(&0) {
            bail!("--tokens must list room lengths > 0");
        }
        for t in &self.tokens {
            layout
                .room_bytes(*t)
                .with_context(|| format!("--tokens {t} with --model {}", self.model))?;
        }
        if self.rooms == 0 {
            bail!("--rooms must be > 0");
        }
        if self.concurrency == 0 {
            bail!("--concurrency must be > 0");
        }
        if self.chunk_bytes == 0 {
            bail!("--chunk-bytes must be > 0");
        }
        for (flag, n) in [
            ("--prefill-tp", self.prefill_tp),
            ("--decode-tp", self.decode_tp),
            ("--prefill-pp", self.prefill_pp),
        ] {
            if n == 0 {
                bail!("{flag} must be > 0");
            }
        }
        if self.prefill_api.is_some()
            && (self.prefill_tp, self.decode_tp, self.prefill_pp) != (1, 1, 1)
        {
            bail!(
                "--prefill-api/--decode-api bench one running pair; TP/PP shapes need a local cluster"
            );
        }
        if self.prefill_api.is_some() && self.transport.len() != 1 {
            bail!(
                "--transport lists {} transports, but running agents serve exactly one: name theirs",
                self.transport.len()
            );
        }
        Ok(layout)
    }

    /// Warm-up rooms per configuration: --warmup, at least --concurrency unless 0.
    fn warmup_rooms(&self) -> usize {
        match self.warmup {
            0 => 0,
            n => n.max(self.concurrency),
        }
    }

    /// The agent flags of a local cluster over `transport`.
    fn agent_args(&self, layout: &KvLayout, transport: BenchTransport) -> Vec<String> {
        let largest = self.tokens.iter().copied().max().unwrap_or(1);
        let pool_pages = cluster::pool_pages(layout, largest, self.concurrency);
        [
            "--model",
            &self.model,
            "--page-size",
            &self.page_size.to_string(),
            "--pool-pages",
            &pool_pages.to_string(),
            "--transport",
            transport.kind.name(),
            "--chunk-bytes",
            &self.chunk_bytes.to_string(),
            "--direct-writes",
            self.direct_writes.name(),
            "--mapped-writes",
            self.mapped_writes.name(),
            "--synthetic",
            "--synthetic-verify",
            self.verify.name(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    }
}

/// A `--transport` of the bench: a data-plane transport, or a UCX shorthand that also sets
/// `UCX_TLS` for the run (`ucx-tcp` pins UCX's tcp to loopback with `UCX_NET_DEVICES=lo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BenchTransport {
    kind: TransportKind,
    label: &'static str,
    tls: Option<&'static str>,
}

impl std::fmt::Display for BenchTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label)
    }
}

impl std::str::FromStr for BenchTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let shorthand = match s {
            "ucx-tcp" => Some("tcp"),
            "ucx-shm" => Some("posix,cma,self"),
            _ => None,
        };
        let (kind, label) = match shorthand {
            Some(_) => (
                "ucx".parse::<TransportKind>()?,
                if s == "ucx-tcp" { "ucx-tcp" } else { "ucx-shm" },
            ),
            None => {
                let kind: TransportKind = s.parse()?;
                (kind, kind.name())
            }
        };
        Ok(BenchTransport {
            kind,
            label,
            tls: shorthand,
        })
    }
}

impl BenchTransport {
    /// The environment the agents run with.
    fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if let Some(tls) = self.tls {
            env.push(("UCX_TLS".to_owned(), tls.to_owned()));
            if tls == "tcp" {
                env.push(("UCX_NET_DEVICES".to_owned(), "lo".to_owned()));
            }
        }
        env
    }

    /// The `UCX_TLS` of a UCX run (the shorthand's, or the environment's for `ucx`).
    fn ucx_tls(&self) -> Option<String> {
        let ucx = self.kind.name() == "ucx";
        match self.tls {
            Some(t) => Some(t.to_owned()),
            None if ucx => {
                Some(std::env::var("UCX_TLS").unwrap_or_else(|_| "(UCX default)".to_owned()))
            }
            None => None,
        }
    }
}

/// Where a configuration runs: the agents' APIs and, for a local cluster, its log folder.
struct Target {
    apis: cluster::Apis,
    logs: Option<PathBuf>,
}

/// Runs the benchmark.
pub(crate) fn run(args: BenchArgs) -> anyhow::Result<()> {
    let layout = args.validate()?;
    args.tls.load()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let progress = std::io::stderr().is_terminal();
    let exe = crate::cluster::kvferry_exe()?;
    // Room ids unique across configurations and across runs against the same agents.
    let mut next_room = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
        << 8;
    let mut lines: Vec<Value> = Vec::new();
    for &transport in &args.transport {
        // A fresh cluster per transport (agents serve one); dropped (stopped) after its sweep.
        let (cluster, target) = match (&args.prefill_api, &args.decode_api) {
            (Some(p), Some(d)) => (
                None,
                Target {
                    apis: cluster::Apis::pair(p.trim_end_matches('/'), d.trim_end_matches('/'))
                        .with_token(args.token.clone()),
                    logs: None,
                },
            ),
            _ => {
                let tag = format!("bench-{transport}");
                let prefill = Shape {
                    tp: args.prefill_tp,
                    pp: args.prefill_pp,
                    ..Shape::ONE
                };
                let decode = Shape::tp(args.decode_tp);
                let agent_args = args.agent_args(&layout, transport);
                let env = transport.env();
                let cluster =
                    LocalCluster::start_shaped_env(&exe, &tag, &agent_args, prefill, decode, &env)
                        .with_context(|| format!("starting a {transport} cluster"))?;
                let target = Target {
                    apis: cluster.apis()?,
                    logs: Some(cluster.logs.clone()),
                };
                (Some(cluster), target)
            }
        };
        for &tokens in &args.tokens {
            let mut ids = |n: usize| {
                let v: Vec<(u64, usize)> = (0..n as u64).map(|i| (next_room + i, tokens)).collect();
                next_room += n as u64;
                v
            };
            let (warm, measured) = (ids(args.warmup_rooms()), ids(args.rooms));
            let label = format!("{transport} {tokens} tokens");
            let (results, paths) = runtime
                .block_on(async {
                    drive(&target, warm, args.concurrency, progress, &label).await?;
                    let before = chunk_paths(&target.apis).await?;
                    let results =
                        drive(&target, measured, args.concurrency, progress, &label).await?;
                    let after = chunk_paths(&target.apis).await?;
                    let paths: serde_json::Map<String, Value> = after
                        .iter()
                        .map(|(p, n)| (p.clone(), json!(n - before.get(p).copied().unwrap_or(0.0))))
                        .collect();
                    anyhow::Ok((results, paths))
                })
                .with_context(|| match &target.logs {
                    Some(dir) => format!("{label}: agent logs in {}", dir.display()),
                    None => label.clone(),
                })?;
            let mut line = cluster::summary(
                &results,
                transport.label,
                &args.model,
                json!(tokens),
                args.page_size,
                args.concurrency,
                (args.prefill_tp, args.decode_tp),
            );
            line["prefill_pp"] = json!(args.prefill_pp);
            if let Some(tls) = transport.ucx_tls() {
                line["ucx_tls"] = json!(tls);
            }
            line["chunk_bytes"] = json!(args.chunk_bytes);
            line["verify"] = json!(args.verify.name());
            // Which data path carried the measured rooms (decode chunks by path, and the
            // prefills' staged chunks sent without a gather).
            line["chunks_by_path"] = Value::Object(paths);
            line["warmup_rooms"] = json!(args.warmup_rooms());
            if args.json {
                // One line per configuration as soon as it is measured.
                let mut out = std::io::stdout().lock();
                writeln!(out, "{line}")?;
                out.flush()?;
            }
            lines.push(line);
        }
        drop(cluster);
    }
    if !args.json {
        print_table(&lines);
    }
    if let Some(dir) = &args.out {
        write_out(dir, &lines)?;
    }
    let failed: u64 = lines
        .iter()
        .map(|l| l["failed_rooms"].as_u64().unwrap_or(0))
        .sum();
    if failed > 0 {
        bail!("{failed} rooms did not land intact");
    }
    Ok(())
}

/// Drives `rooms` through the agents, with a progress line on stderr if asked.
async fn drive(
    target: &Target,
    rooms: Vec<(u64, usize)>,
    concurrency: usize,
    progress: bool,
    label: &str,
) -> anyhow::Result<Vec<cluster::RoomResult>> {
    if rooms.is_empty() {
        return Ok(Vec::new());
    }
    let total = rooms.len();
    let done = Arc::new(AtomicUsize::new(0));
    let ticker = progress.then(|| {
        let (done, label) = (done.clone(), label.to_owned());
        tokio::spawn(async move {
            let start = Instant::now();
            loop {
                let n = done.load(Ordering::Relaxed);
                // The progress line is for a person at a terminal; stdout stays clean.
                #[allow(clippy::print_stderr)]
                {
                    eprint!(
                        "\r\x1b[2K{label}: {n}/{total} rooms, {:.1} s",
                        start.elapsed().as_secs_f64()
                    );
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    });
    let results =
        cluster::drive_rooms_counted(&target.apis, rooms, concurrency, done.clone()).await;
    if let Some(t) = ticker {
        t.abort();
        #[allow(clippy::print_stderr)]
        {
            eprint!("\r\x1b[2K");
        }
    }
    results
}

/// Chunks landed so far by data path (`kvferry_chunks_total{path}`), summed over the decode
/// agents, and the staged ones the prefill agents sent without a gather (`from_pool`, a
/// prefill's path: the decode lands them as `staged`).
async fn chunk_paths(
    apis: &cluster::Apis,
) -> anyhow::Result<std::collections::BTreeMap<String, f64>> {
    let http = kvferry_wire::http::client().build()?;
    let mut out = std::collections::BTreeMap::new();
    let decodes = apis.decode.iter().flatten().map(|a| (a, false));
    let prefills = apis.prefill.iter().flatten().map(|a| (a, true));
    for (api, prefill) in decodes.chain(prefills) {
        let text = http
            .get(format!("{api}/metrics"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("GET {api}/metrics"))?
            .text()
            .await?;
        for line in text
            .lines()
            .filter(|l| l.starts_with("kvferry_chunks_total{"))
        {
            let path = line
                .split("path=\"")
                .nth(1)
                .and_then(|r| r.split('"').next());
            let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let (Some(path), Some(value)) = (path, value)
                && (path == "from_pool") == prefill
            {
                *out.entry(path.to_owned()).or_insert(0.0) += value;
            }
        }
    }
    Ok(out)
}

/// A number field of a bench line (0 when absent).
fn num(line: &Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(line, |v, k| &v[*k])
        .as_f64()
        .unwrap_or(0.0)
}

/// The fixed per-room overhead of each line, in ms: its p50 latency minus its bytes over the
/// per-room rate of its transport's largest room (the streaming rate, overhead amortised).
fn overheads(lines: &[Value]) -> Vec<f64> {
    lines
        .iter()
        .map(|l| {
            let largest = lines
                .iter()
                .filter(|o| o["transport"] == l["transport"])
                .max_by(|a, b| num(a, &["bytes_per_room"]).total_cmp(&num(b, &["bytes_per_room"])));
            let rate = largest.map_or(0.0, |o| num(o, &["room_gbps_p50"]));
            if rate > 0.0 {
                num(l, &["latency_ms", "p50"]) - num(l, &["bytes_per_room"]) / (rate * 1e9) * 1e3
            } else {
                0.0
            }
        })
        .collect()
}

fn print_table(lines: &[Value]) {
    println!(
        "{:>9} {:>7} {:>10} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "transport",
        "tokens",
        "MiB/room",
        "rooms",
        "verified",
        "GB/s",
        "room GB/s",
        "p50 ms",
        "p99 ms",
        "take p50",
        "ovh ms",
        "memcpy"
    );
    for (l, ovh) in lines.iter().zip(overheads(lines)) {
        println!(
            "{:>9} {:>7} {:>10.3} {:>6} {:>9} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8.1}",
            l["transport"].as_str().unwrap_or("?"),
            l["tokens"].to_string(),
            num(l, &["bytes_per_room"]) / (1u64 << 20) as f64,
            l["rooms"].to_string(),
            l["verified_rooms"].to_string(),
            num(l, &["throughput_gbps"]),
            num(l, &["room_gbps_p50"]),
            num(l, &["latency_ms", "p50"]),
            num(l, &["latency_ms", "p99"]),
            num(l, &["take_latency_ms", "p50"]),
            ovh,
            num(l, &["memcpy_gbps"]),
        );
    }
    println!(
        "GB/s: bytes landed / (first ready -> last success); room GB/s: bytes / p50 latency; \
         ovh: p50 latency - bytes / largest room's rate; memcpy: single thread, GB/s"
    );
    for l in lines {
        let Some(failures) = l["failures"].as_object().filter(|f| !f.is_empty()) else {
            continue;
        };
        let why: Vec<String> = failures
            .iter()
            .map(|(code, n)| format!("{code} {n}"))
            .collect();
        println!(
            "{} {} tokens: rooms not verified: {}",
            l["transport"].as_str().unwrap_or("?"),
            l["tokens"],
            why.join(", ")
        );
    }
    print_stages(lines);
}

/// Where each configuration's rooms spent their time: the p50 of every stage, in ms.
fn print_stages(lines: &[Value]) {
    println!("\nwhere a room's time goes (p50 ms per stage):");
    print!("{:>9} {:>7}", "transport", "tokens");
    for (name, _) in cluster::STAGES {
        print!(" {name:>14}");
    }
    println!();
    for l in lines {
        print!(
            "{:>9} {:>7}",
            l["transport"].as_str().unwrap_or("?"),
            l["tokens"].to_string()
        );
        for (name, _) in cluster::STAGES {
            match l["stages_ms"][name].as_f64() {
                Some(ms) => print!(" {ms:>14.3}"),
                None => print!(" {:>14}", "-"),
            }
        }
        println!();
    }
    for (name, what) in cluster::STAGES {
        println!("  {name}: {what}");
    }
}

/// Writes `bench.jsonl` and the two plots into `dir`.
fn write_out(dir: &Path, lines: &[Value]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    let jsonl: String = lines.iter().map(|l| format!("{l}\n")).collect();
    write("bench.jsonl", &jsonl)?;
    let model = lines
        .first()
        .and_then(|l| l["model"].as_str())
        .unwrap_or("?");
    let series = |y: &dyn Fn(&Value) -> f64| {
        let mut out: Vec<plot::Series> = Vec::new();
        for l in lines {
            let name = l["transport"].as_str().unwrap_or("?").to_owned();
            let point = (num(l, &["bytes_per_room"]) / (1u64 << 20) as f64, y(l));
            match out.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push(point),
                None => out.push(plot::Series {
                    name,
                    points: vec![point],
                }),
            }
        }
        for s in &mut out {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        out
    };
    let throughput = plot::Chart {
        title: format!("kvferry end-to-end throughput ({model})"),
        x_label: "room size (MiB, log scale)".to_owned(),
        y_label: "throughput (GB/s)".to_owned(),
        log_y: false,
        series: series(&|l| num(l, &["throughput_gbps"])),
    };
    write("throughput.svg", &throughput.svg()?)?;
    let latency = plot::Chart {
        title: format!("kvferry p50 room latency, ready -> success ({model})"),
        x_label: "room size (MiB, log scale)".to_owned(),
        y_label: "p50 latency (ms, log scale)".to_owned(),
        log_y: true,
        series: series(&|l| num(l, &["latency_ms", "p50"])),
    };
    write("latency.svg", &latency.svg()?)?;
    Ok(())
}
