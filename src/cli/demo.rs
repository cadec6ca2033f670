//! `kvferry demo`: the main job on one machine. Starts a registry, one prefill and one decode
//! agent as real processes over real sockets, transfers rooms of mixed lengths with the
//! synthetic engine, verifies every byte, prints a table (or the bench JSON with `--json`)
//! and exits 0 only if every room landed intact.
//!
//! [`drive_rooms`] plays both engines over the agents' HTTP APIs; the bench and the
//! multi-process tests use it too.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use super::cluster::{Process, log_dir};
use crate::layout::{KvLayout, ModelSpec};
use crate::transport::TransportKind;

/// Run a full prefill -> decode transfer on this machine and verify every byte.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Model preset.
    #[arg(long, env = "KVFERRY_DEMO_MODEL", default_value = "llama3-8b")]
    model: String,
    /// Data-plane transport (its --help names this build's transports).
    #[arg(long, env = "KVFERRY_DEMO_TRANSPORT", default_value = "zmq-tcp", help = super::TRANSPORT_HELP)]
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
    /// Print the bench JSON (docs/benchmarks.md) instead of a table.
    #[arg(long, env = "KVFERRY_DEMO_JSON")]
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

/// One room as the engines saw it.
#[derive(Clone, Debug)]
pub struct RoomResult {
    /// Room id.
    pub room: u64,
    /// Tokens.
    pub tokens: usize,
    /// KV bytes landed.
    pub bytes: u64,
    /// Final state at the decode.
    pub state: String,
    /// Failure code, if any.
    pub code: Option<String>,
    /// Whether the synthetic check passed on take.
    pub verified: bool,
    /// Prefill ready -> decode success, ms (measured inside the agents).
    pub latency_ms: f64,
    /// Engine request -> take returned, ms.
    pub take_ms: f64,
    /// Prefill ready time, ms since the epoch.
    pub ready_at: f64,
    /// Decode success time, ms since the epoch.
    pub success_at: f64,
    /// Where the room's time went ([`STAGES`], ms each; a stage the room's path skips, e.g.
    /// the gather of a direct write, is absent).
    pub stages: Vec<(&'static str, f64)>,
}

/// The stages of one room's time, in order, as `kvferry bench` reports them (`stages_ms`):
/// the engines' calls as the engine sees them, then the first chunk's way from the prefill's
/// ready to the decode's pool (the first prefill and decode rank's own timings), then the
/// rest of the room and the engine's notice of it.
pub const STAGES: [(&str, &str); 9] = [
    ("request_call", "the decode engine's request call"),
    ("ready_call", "the prefill engine's ready call"),
    (
        "ready_to_start",
        "ready -> the first piece's send starts (negative when layer-wise pieces went first)",
    ),
    (
        "gather",
        "-> first chunk gathered (credit and gather; one-sided writes: the writes)",
    ),
    ("post", "-> first chunk framed and handed to the transport"),
    ("wire", "-> first chunk arrives at the decode"),
    ("land", "-> first chunk in the decode pool"),
    ("rest", "-> the whole room landed (success)"),
    ("notice", "-> the engine's take returns"),
];

/// Milliseconds since the Unix epoch (the agents' clock for room timings).
fn epoch_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// [`STAGES`] of one room from the engine-side call times and the first prefill and decode
/// ranks' room views.
fn stages(
    calls: [f64; 2],
    prefill: &Value,
    decode: &Value,
    taken_at: f64,
) -> Vec<(&'static str, f64)> {
    let p = |k: &str| prefill["timings"][k].as_f64();
    let d = |k: &str| decode["timings"][k].as_f64();
    let points = [
        p("ready"),
        p("transfer_start"),
        p("first_gathered"),
        p("first_posted"),
        d("transferring"),
        d("first_landed"),
        d("success"),
        Some(taken_at),
    ];
    let mut out = vec![(STAGES[0].0, calls[0]), (STAGES[1].0, calls[1])];
    // Each stage runs from the last point reached before it: a skipped point (no gather on a
    // direct write) folds its stage into the next.
    let mut from = points[0];
    for (i, to) in points.iter().enumerate().skip(1) {
        if let (Some(a), Some(b)) = (from, *to) {
            out.push((STAGES[i + 1].0, b - a));
            from = Some(b);
        }
    }
    out
}

/// The engine-facing APIs of a cluster: prefill and decode ranks grouped by DP group.
#[derive(Clone, Debug)]
pub struct Apis {
    /// Prefill API URLs, one list per DP group (every TP/PP rank of the group).
    pub prefill: Vec<Vec<String>>,
    /// Decode API URLs, one list per DP group.
    pub decode: Vec<Vec<String>>,
}

impl Apis {
    /// One prefill and one decode agent.
    pub fn pair(prefill: &str, decode: &str) -> Self {
        Apis {
            prefill: vec![vec![prefill.to_owned()]],
            decode: vec![vec![decode.to_owned()]],
        }
    }
}

/// Plays both engines: for each `(room, tokens)`, asks every decode rank of the room's decode
/// DP group for the room and tells every prefill rank of the room's prefill DP group (room
/// modulo the DP size, as the decode agents pick it) that it is ready, waits until every decode
/// rank is final, takes the room from each, and reads the timings.
pub async fn drive_rooms(
    apis: &Apis,
    rooms: Vec<(u64, usize)>,
    concurrency: usize,
) -> anyhow::Result<Vec<RoomResult>> {
    let done = Arc::new(AtomicUsize::new(0));
    drive_rooms_counted(apis, rooms, concurrency, done).await
}

/// [`drive_rooms`], counting finished rooms in `done` as they finish (for a progress display).
pub async fn drive_rooms_counted(
    apis: &Apis,
    rooms: Vec<(u64, usize)>,
    concurrency: usize,
    done: Arc<AtomicUsize>,
) -> anyhow::Result<Vec<RoomResult>> {
    if apis.prefill.is_empty() || apis.decode.is_empty() {
        bail!("no prefill or no decode agent to drive");
    }
    let http = reqwest::Client::builder().no_proxy().build()?;
    let gate = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    for (room, tokens) in rooms {
        let (http, gate) = (http.clone(), gate.clone());
        let p = apis.prefill[(room % apis.prefill.len() as u64) as usize].clone();
        let d = apis.decode[(room % apis.decode.len() as u64) as usize].clone();
        let done = done.clone();
        tasks.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            let r = one_room(&http, &p, &d, room, tokens).await;
            done.fetch_add(1, Ordering::Relaxed);
            r
        });
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.push(r??);
    }
    out.sort_by_key(|r| r.room);
    Ok(out)
}

async fn json_ok(resp: reqwest::Response, what: &str) -> anyhow::Result<Value> {
    let status = resp.status();
    let body: Value = resp.json().await.with_context(|| format!("{what}: body"))?;
    if !status.is_success() {
        bail!("{what}: {status}: {body}");
    }
    Ok(body)
}

async fn one_room(
    http: &reqwest::Client,
    prefills: &[String],
    decodes: &[String],
    room: u64,
    tokens: usize,
) -> anyhow::Result<RoomResult> {
    let started = Instant::now();
    let body = json!({ "tokens": tokens });
    for d in decodes {
        let resp = http
            .post(format!("{d}/v1/rooms/{room}"))
            .json(&body)
            .send()
            .await?;
        json_ok(resp, "decode request").await?;
    }
    let request_call = started.elapsed().as_secs_f64() * 1e3;
    let ready_started = Instant::now();
    // Every prefill rank at once, as TP ranks finish a prefill together: one after the
    // other, the latency (from the first ready) would include the later ranks' fills.
    let mut ready = tokio::task::JoinSet::new();
    for p in prefills {
        let (http, url, body) = (
            http.clone(),
            format!("{p}/v1/rooms/{room}/ready"),
            body.clone(),
        );
        ready.spawn(async move {
            let resp = http.post(url).json(&body).send().await?;
            json_ok(resp, "prefill ready").await
        });
    }
    while let Some(done) = ready.join_next().await {
        done??;
    }
    let ready_call = ready_started.elapsed().as_secs_f64() * 1e3;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut result = RoomResult {
        room,
        tokens,
        bytes: 0,
        state: "success".to_owned(),
        code: None,
        verified: true,
        latency_ms: 0.0,
        take_ms: 0.0,
        ready_at: f64::INFINITY,
        success_at: 0.0,
        stages: Vec::new(),
    };
    let mut first_decode = Value::Null;
    let mut taken_at = 0.0;
    for d in decodes {
        let view = loop {
            let resp = http
                .get(format!("{d}/v1/rooms/{room}?wait_ms=5000"))
                .send()
                .await?;
            let v = json_ok(resp, "decode room").await?;
            let state = v["state"].as_str().unwrap_or_default();
            if ["success", "failed", "aborted"].contains(&state) && v["safe_to_reuse"] == true {
                break v;
            }
            if Instant::now() > deadline {
                bail!("room {room} still {state} at {d} after 120 s: {v}");
            }
        };
        let taken = json_ok(
            http.post(format!("{d}/v1/rooms/{room}/take"))
                .send()
                .await?,
            "take",
        )
        .await?;
        result.bytes += taken["bytes"].as_u64().unwrap_or(0);
        if taken["state"] != "success" {
            result.state = taken["state"].as_str().unwrap_or_default().to_owned();
            result.code = taken["reason"]["code"].as_str().map(str::to_owned);
        }
        result.verified &= taken["verified"].as_bool() == Some(true) && taken["state"] == "success";
        if first_decode.is_null() {
            taken_at = epoch_ms();
            first_decode = view.clone();
        }
        result.success_at = result
            .success_at
            .max(view["timings"]["success"].as_f64().unwrap_or(0.0));
    }
    result.take_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut first_prefill = Value::Null;
    for p in prefills {
        let resp = http.get(format!("{p}/v1/rooms/{room}")).send().await?;
        if let Ok(v) = json_ok(resp, "prefill room").await {
            if let Some(t) = v["timings"]["ready"].as_f64() {
                result.ready_at = result.ready_at.min(t);
            }
            if first_prefill.is_null() {
                first_prefill = v;
            }
        }
    }
    result.stages = stages(
        [request_call, ready_call],
        &first_prefill,
        &first_decode,
        taken_at,
    );
    if !result.ready_at.is_finite() {
        result.ready_at = 0.0;
    }
    result.latency_ms = result.success_at - result.ready_at;
    Ok(result)
}

/// The p-th percentile (0..=100) of `v`, nearest rank.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[i.min(s.len() - 1)]
}

/// GB/s (1e9 B/s) of a single-thread memcpy of `bytes` bytes, best of a few runs.
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![0x5Au8; bytes.max(1)];
    let mut dst = vec![0u8; bytes.max(1)];
    let best = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    bytes as f64 / best / 1e9
}

/// The bench JSON object of one configuration (fields and units: docs/benchmarks.md).
pub fn summary(
    results: &[RoomResult],
    transport: &str,
    model: &str,
    tokens: Value,
    page_size: usize,
    concurrency: usize,
    tp: (u32, u32),
) -> Value {
    let ok: Vec<&RoomResult> = results.iter().filter(|r| r.verified).collect();
    let lat: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
    let take: Vec<f64> = results.iter().map(|r| r.take_ms).collect();
    let bytes: u64 = ok.iter().map(|r| r.bytes).sum();
    let first = ok.iter().map(|r| r.ready_at).fold(f64::INFINITY, f64::min);
    let last = ok.iter().map(|r| r.success_at).fold(0.0, f64::max);
    let wall_s = ((last - first) / 1e3).max(1e-9);
    let largest = results.iter().map(|r| r.bytes).max().unwrap_or(0) as usize;
    let bytes_per_room = if results.is_empty() {
        0
    } else {
        results.iter().map(|r| r.bytes).sum::<u64>() / results.len() as u64
    };
    let p50 = percentile(&lat, 50.0);
    json!({
        "transport": transport,
        "model": model,
        "tokens": tokens,
        "page_size": page_size,
        "rooms": results.len(),
        "concurrency": concurrency,
        "prefill_tp": tp.0,
        "decode_tp": tp.1,
        "bytes_per_room": bytes_per_room,
        "throughput_gbps": if ok.is_empty() { 0.0 } else { bytes as f64 / wall_s / 1e9 },
        // One room alone: its bytes over its p50 latency (no gaps between rooms counted).
        "room_gbps_p50": if p50 > 0.0 { bytes_per_room as f64 / (p50 / 1e3) / 1e9 } else { 0.0 },
        "latency_ms": { "p50": p50, "p99": percentile(&lat, 99.0) },
        "take_latency_ms": { "p50": percentile(&take, 50.0), "p99": percentile(&take, 99.0) },
        "verified_rooms": ok.len(),
        "failed_rooms": results.len() - ok.len(),
        "failures": failures(results),
        "memcpy_gbps": memcpy_gbps(largest),
        "stages_ms": stage_p50s(&ok),
    })
}

/// Pages of a pool for rooms of up to `tokens` tokens, `concurrency` at a time: every room in
/// flight and as many again, since a prefill holds a room's pages until its last sends
/// resolved, which may be after the decode's success (Done goes first), when the next room
/// already starts; and a few spare for the warm-up.
pub fn pool_pages(layout: &KvLayout, tokens: usize, concurrency: usize) -> usize {
    layout.pages_for(tokens) * 2 * concurrency.max(1) + 8
}

/// The rooms that did not verify, counted by why: the failure code of a room a decode ended
/// with (`verify_failed` when the landed bytes were wrong), `unverified` when none was given.
fn failures(results: &[RoomResult]) -> Value {
    let mut counts = serde_json::Map::new();
    for r in results.iter().filter(|r| !r.verified) {
        let code = r.code.clone().unwrap_or_else(|| "unverified".to_owned());
        let n = counts.get(&code).and_then(Value::as_u64).unwrap_or(0);
        counts.insert(code, json!(n + 1));
    }
    Value::Object(counts)
}

/// The p50 of each of [`STAGES`] over `rooms` (the stages they reached).
fn stage_p50s(rooms: &[&RoomResult]) -> Value {
    let mut out = serde_json::Map::new();
    for (name, _) in STAGES {
        let v: Vec<f64> = rooms
            .iter()
            .filter_map(|r| r.stages.iter().find(|(n, _)| *n == name).map(|(_, ms)| *ms))
            .collect();
        if !v.is_empty() {
            out.insert(name.to_owned(), json!(percentile(&v, 50.0)));
        }
    }
    Value::Object(out)
}

/// How many ranks of one role, by parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// DP size.
    pub dp: u32,
    /// TP size.
    pub tp: u32,
    /// PP size.
    pub pp: u32,
}

impl Shape {
    /// One rank.
    pub const ONE: Shape = Shape {
        dp: 1,
        tp: 1,
        pp: 1,
    };

    /// TP ranks only.
    pub fn tp(tp: u32) -> Self {
        Shape { tp, ..Shape::ONE }
    }
}

/// A registry and prefill and decode agents, running as processes of this binary.
#[derive(Debug)]
pub struct LocalCluster {
    /// Decode agents by DP group, then (PP, TP) (fields drop in order: agents stop before
    /// the registry).
    pub decodes: Vec<Vec<Process>>,
    /// Prefill agents by DP group, then (PP, TP).
    pub prefills: Vec<Vec<Process>>,
    /// The registry.
    pub registry: Process,
    /// Where the logs are.
    pub logs: PathBuf,
}

impl LocalCluster {
    /// A registry, one prefill and one decode agent; `agent_args` go to both agents.
    pub fn start(exe: &std::path::Path, tag: &str, agent_args: &[String]) -> anyhow::Result<Self> {
        Self::start_shaped(exe, tag, agent_args, Shape::ONE, Shape::ONE)
    }

    /// A registry and `prefill` x `decode` shaped agents, each given its rank flags.
    pub fn start_shaped(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        prefill: Shape,
        decode: Shape,
    ) -> anyhow::Result<Self> {
        Self::start_shaped_env(exe, tag, agent_args, prefill, decode, &[])
    }

    /// [`LocalCluster::start_shaped`], the agents with extra environment variables (e.g.
    /// `UCX_TLS` for `--transport ucx`).
    pub fn start_shaped_env(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        prefill: Shape,
        decode: Shape,
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        Self::spawn(exe, tag, agent_args, prefill, decode, env, &|_| Vec::new())
    }

    /// A registry, one prefill and one decode agent; `agent_args` go to both, then
    /// `role_args(role)` to each.
    pub fn start_per_role(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        role_args: &dyn Fn(&str) -> Vec<String>,
    ) -> anyhow::Result<Self> {
        Self::spawn(exe, tag, agent_args, Shape::ONE, Shape::ONE, &[], role_args)
    }

    fn spawn(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        prefill: Shape,
        decode: Shape,
        env: &[(String, String)],
        role_args: &dyn Fn(&str) -> Vec<String>,
    ) -> anyhow::Result<Self> {
        let logs = log_dir(tag)?;
        let wait = Duration::from_secs(30);
        let owned = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let bootstrap = owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]);
        let registry = Process::spawn(exe, "registry", &bootstrap, &logs, wait)?;
        let url = registry.field("url")?;
        let spawn = |role: &str, shape: Shape| -> anyhow::Result<Vec<Vec<Process>>> {
            let mut groups = Vec::new();
            for dp in 0..shape.dp {
                let mut ranks = Vec::new();
                for pp in 0..shape.pp {
                    for tp in 0..shape.tp {
                        let mut args = owned(&[role, "--bootstrap", &url]);
                        for (flag, v) in [
                            ("--dp-rank", dp),
                            ("--dp-size", shape.dp),
                            ("--tp-rank", tp),
                            ("--tp-size", shape.tp),
                            ("--pp-rank", pp),
                            ("--pp-size", shape.pp),
                        ] {
                            args.extend([flag.to_owned(), v.to_string()]);
                        }
                        args.extend_from_slice(agent_args);
                        args.extend(role_args(role));
                        let name = format!("{role}-dp{dp}-pp{pp}-tp{tp}");
                        ranks.push(Process::spawn_env(exe, &name, &args, env, &logs, wait)?);
                    }
                }
                groups.push(ranks);
            }
            Ok(groups)
        };
        let prefills = spawn("prefill", prefill)?;
        let decodes = spawn("decode", decode)?;
        Ok(LocalCluster {
            decodes,
            prefills,
            registry,
            logs,
        })
    }

    /// The first prefill agent.
    pub fn prefill(&self) -> &Process {
        &self.prefills[0][0]
    }

    /// The first decode agent.
    pub fn decode(&self) -> &Process {
        &self.decodes[0][0]
    }

    /// The first prefill agent, mutably (to signal or stop it).
    pub fn prefill_mut(&mut self) -> &mut Process {
        &mut self.prefills[0][0]
    }

    /// Every agent's API, grouped for [`drive_rooms`].
    pub fn apis(&self) -> anyhow::Result<Apis> {
        let api = |groups: &[Vec<Process>]| -> anyhow::Result<Vec<Vec<String>>> {
            groups
                .iter()
                .map(|g| g.iter().map(|p| p.field("api")).collect())
                .collect()
        };
        Ok(Apis {
            prefill: api(&self.prefills)?,
            decode: api(&self.decodes)?,
        })
    }
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
    let exe = std::env::current_exe().context("locating the kvferry binary")?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_that_did_not_verify_are_counted_by_why() {
        let room = |room, code: Option<&str>, verified| RoomResult {
            room,
            tokens: 16,
            bytes: 0,
            state: if verified { "success" } else { "failed" }.to_owned(),
            code: code.map(str::to_owned),
            verified,
            latency_ms: 1.0,
            take_ms: 1.0,
            ready_at: 0.0,
            success_at: 1.0,
            stages: Vec::new(),
        };
        let results = [
            room(1, None, true),
            room(2, Some("peer_dead"), false),
            room(3, Some("peer_dead"), false),
            room(4, Some("verify_failed"), false),
            room(5, None, false),
        ];
        let line = summary(&results, "zmq-tcp", "tiny", json!(16), 16, 1, (1, 1));
        assert_eq!(
            line["failures"],
            json!({"peer_dead": 2, "verify_failed": 1, "unverified": 1})
        );
        assert_eq!(
            (line["verified_rooms"].clone(), line["failed_rooms"].clone()),
            (json!(1), json!(4))
        );
        let none = summary(&results[..1], "zmq-tcp", "tiny", json!(16), 16, 1, (1, 1));
        assert_eq!(none["failures"], json!({}));
    }
}
