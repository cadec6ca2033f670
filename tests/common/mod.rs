//! Helpers shared by the test binaries (chiefly the multi-process tests, `tests/processes/`): where the release binary is,
//! how the agents are started (every timeout flag explicit), an HTTP client that never goes
//! through a proxy, and JSON / polling helpers with generous bounds.
//!
//! The tests spawn `target/release/kvferry` (built with `cargo build --release --bin kvferry`),
//! never the debug build: the synthetic fill and verification are too slow unoptimised.

#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod docs;
pub mod netns;
pub mod reference;
pub mod rogue;
pub mod shm_engine;
pub mod tls;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use reqwest::{Client, Method, StatusCode};
use serde_json::{Value, json};

pub use kvferry::cluster::Process;

/// The generous bound on everything a test waits for.
pub const BOUND: Duration = Duration::from_secs(30);

/// Final room states.
pub const FINAL: [&str; 3] = ["success", "failed", "aborted"];

/// `kvferry ARGS --help` of the release binary (no config file from the environment).
pub fn help(args: &[&str]) -> String {
    let out = std::process::Command::new(release_binary())
        .args(args)
        .arg("--help")
        .env_remove("KVFERRY_CONFIG")
        .output()
        .expect("running kvferry --help");
    assert!(out.status.success(), "{args:?} --help: {}", out.status);
    String::from_utf8(out.stdout).expect("utf-8 help")
}

/// `target/release/kvferry`, found from this test executable's path (`target/<profile>/deps/
/// <test>-<hash>`) or from `CARGO_TARGET_DIR`. Panics with what to run when it is missing.
pub fn release_binary() -> PathBuf {
    let name = format!("kvferry{}", std::env::consts::EXE_SUFFIX);
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            if dir.is_relative() {
                Path::new(env!("CARGO_MANIFEST_DIR")).join(dir)
            } else {
                dir
            }
        }
        None => {
            let me = std::env::current_exe().expect("the test executable's path");
            // deps -> <profile> -> target
            me.parent()
                .and_then(Path::parent)
                .and_then(Path::parent)
                .unwrap_or_else(|| panic!("{} is not under target/<profile>/deps", me.display()))
                .to_path_buf()
        }
    };
    let exe = target.join("release").join(name);
    assert!(
        exe.is_file(),
        "{} is missing: run `cargo build --release --bin kvferry` first",
        exe.display()
    );
    exe
}

/// How the agents are started. Every timeout flag is always passed.
#[derive(Clone, Debug)]
pub struct AgentOpts {
    pub model: &'static str,
    pub pool_pages: usize,
    pub transport: &'static str,
    pub synthetic: bool,
    pub timeout_connect_ms: u64,
    pub room_ttl_ms: u64,
    pub timeout_bootstrap_ms: u64,
    pub timeout_send_ms: u64,
    pub heartbeat_ms: u64,
    pub peer_dead_ms: u64,
    pub timeout_ready_ms: u64,
    pub timeout_stall_ms: u64,
    pub drain_timeout_ms: u64,
}

impl Default for AgentOpts {
    fn default() -> Self {
        AgentOpts {
            model: "tiny",
            pool_pages: 512,
            transport: "zmq-tcp",
            synthetic: true,
            timeout_connect_ms: 5_000,
            room_ttl_ms: 60_000,
            timeout_bootstrap_ms: 10_000,
            timeout_send_ms: 10_000,
            heartbeat_ms: 500,
            peer_dead_ms: 5_000,
            timeout_ready_ms: 20_000,
            timeout_stall_ms: 20_000,
            drain_timeout_ms: 2_000,
        }
    }
}

impl AgentOpts {
    /// The agent flags (without the role and `--bootstrap`).
    pub fn args(&self) -> Vec<String> {
        let mut v: Vec<String> = [
            "--model",
            self.model,
            "--page-size",
            "16",
            "--pool-pages",
            &self.pool_pages.to_string(),
            "--transport",
            self.transport,
            "--host",
            "127.0.0.1",
            "--api-host",
            "127.0.0.1",
            "--api-port",
            "0",
            "--timeout-connect-ms",
            &self.timeout_connect_ms.to_string(),
            "--room-ttl-ms",
            &self.room_ttl_ms.to_string(),
            "--timeout-bootstrap-ms",
            &self.timeout_bootstrap_ms.to_string(),
            "--timeout-send-ms",
            &self.timeout_send_ms.to_string(),
            "--heartbeat-ms",
            &self.heartbeat_ms.to_string(),
            "--peer-dead-ms",
            &self.peer_dead_ms.to_string(),
            "--timeout-ready-ms",
            &self.timeout_ready_ms.to_string(),
            "--timeout-stall-ms",
            &self.timeout_stall_ms.to_string(),
            "--drain-timeout-ms",
            &self.drain_timeout_ms.to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if self.synthetic {
            v.push("--synthetic".to_owned());
        }
        v
    }
}

/// A runtime for one test (the agents run in other processes; 2 workers are plenty).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// An HTTP client that talks to loopback directly, whatever the proxy variables say.
pub fn http() -> Client {
    kvferry_wire::http::client()
        .timeout(Duration::from_secs(90))
        .build()
        .expect("reqwest client")
}

/// [`http`], with `Authorization: Bearer TOKEN` on every request that sets none itself: the
/// client of agents started with `--token`, whose engine API needs it.
pub fn http_with_token(token: &str) -> Client {
    let mut headers = reqwest::header::HeaderMap::new();
    let value = format!("Bearer {token}").parse().expect("a header value");
    headers.insert(reqwest::header::AUTHORIZATION, value);
    kvferry_wire::http::client()
        .timeout(Duration::from_secs(90))
        .default_headers(headers)
        .build()
        .expect("reqwest client")
}

/// Parses a response body as JSON, or keeps it as a JSON string if it is not JSON.
async fn answer(resp: reqwest::Response) -> (StatusCode, Value) {
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body)
}

/// `method url` with an optional JSON body; returns the status and the body.
pub async fn call(
    http: &Client,
    method: Method,
    url: &str,
    body: Option<&Value>,
) -> (StatusCode, Value) {
    let mut req = http.request(method.clone(), url);
    if let Some(body) = body {
        req = req.json(body);
    }
    let resp = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    answer(resp).await
}

/// `method url` with a raw body sent as `application/json`.
pub async fn call_raw(http: &Client, method: Method, url: &str, body: &str) -> (StatusCode, Value) {
    let resp = http
        .request(method.clone(), url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    answer(resp).await
}

/// Like [`call`], but panics unless the status is `want`.
pub async fn expect(
    http: &Client,
    method: Method,
    url: &str,
    body: Option<&Value>,
    want: StatusCode,
) -> Value {
    let (status, v) = call(http, method.clone(), url, body).await;
    assert_eq!(
        status, want,
        "{method} {url} {body:?} answered {status}: {v}"
    );
    v
}

/// `(total_pages, free_pages)` of an agent's `/v1/pool`.
pub async fn pool(http: &Client, api: &str) -> (u64, u64) {
    let v = expect(
        http,
        Method::GET,
        &format!("{api}/v1/pool"),
        None,
        StatusCode::OK,
    )
    .await;
    let total = v["total_pages"]
        .as_u64()
        .unwrap_or_else(|| panic!("pool without total_pages: {v}"));
    let free = v["free_pages"]
        .as_u64()
        .unwrap_or_else(|| panic!("pool without free_pages: {v}"));
    (total, free)
}

/// Panics unless the agent answers `/healthz` with 200.
pub async fn healthy(http: &Client, api: &str) {
    expect(
        http,
        Method::GET,
        &format!("{api}/healthz"),
        None,
        StatusCode::OK,
    )
    .await;
}

/// Repeats `probe` (every 20 ms) until it returns `Some`, or panics after `bound` naming `what`.
pub async fn poll_until<T, F, Fut>(what: &str, bound: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(start.elapsed() < bound, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The decode's (or prefill's) view of `room`, long-polling until its state is in `states`.
pub async fn wait_state(
    http: &Client,
    api: &str,
    room: u64,
    states: &[&str],
    bound: Duration,
) -> Value {
    let start = Instant::now();
    loop {
        let url = format!("{api}/v1/rooms/{room}?wait_ms=1000");
        let v = expect(http, Method::GET, &url, None, StatusCode::OK).await;
        let state = v["state"]
            .as_str()
            .unwrap_or_else(|| panic!("room without state: {v}"));
        if states.contains(&state) {
            return v;
        }
        assert!(
            start.elapsed() < bound,
            "room {room} at {api} is still {state} after {bound:?} (waiting for {states:?}): {v}"
        );
    }
}

/// Waits until `room` is final at `api` *and* `safe_to_reuse` (a room can be final while a
/// scatter into its pages still runs; no state change marks the end of that, so this polls).
/// Returns the view and how long it stayed final but not yet safe.
pub async fn wait_safe(http: &Client, api: &str, room: u64) -> (Value, Duration) {
    let v = wait_final(http, api, room).await;
    let start = Instant::now();
    let mut v = v;
    while v["safe_to_reuse"] != true {
        assert!(
            start.elapsed() < BOUND,
            "room {room} at {api} final but not safe to reuse after {BOUND:?}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        v = expect(
            http,
            Method::GET,
            &format!("{api}/v1/rooms/{room}"),
            None,
            StatusCode::OK,
        )
        .await;
    }
    (v, start.elapsed())
}

/// Waits (bounded) until a decode agent's room in this process is final; its view.
pub async fn final_view(
    decode: &kvferry::agent::decode::DecodeAgent,
    room: u64,
) -> kvferry::agent::decode::RoomView {
    use kvferry::agent::EngineApi as _;
    let t = std::time::Instant::now();
    loop {
        let view = decode
            .wait(room, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("room {room}: {e}"));
        if view.state.is_final() {
            return view;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "room {room} not final: {view:?}"
        );
    }
}

/// Waits until `room` is final at `api`.
pub async fn wait_final(http: &Client, api: &str, room: u64) -> Value {
    wait_state(http, api, room, &FINAL, BOUND).await
}

/// The value of the Prometheus sample named exactly `series` (name and labels) in `/metrics`.
pub async fn metric(http: &Client, api: &str, series: &str) -> Option<f64> {
    let resp = http
        .get(format!("{api}/metrics"))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.text().await.expect("metrics text");
    text.lines()
        .filter_map(|l| l.strip_prefix(series))
        .find_map(|rest| rest.strip_prefix(' ').and_then(|n| n.trim().parse().ok()))
}

/// A decode's `kvferry_chunks_total` of `path` (staged, from_pool, placed, direct) at `api`.
pub fn decode_chunks(tag: &str, api: &str, path: &str) -> f64 {
    let series = format!("kvferry_chunks_total{{role=\"decode\",path=\"{path}\"}}");
    runtime()
        .block_on(metric(&http(), api, &series))
        .unwrap_or_else(|| panic!("{tag}: no {series} in /metrics at {api}"))
}

/// Drives `rooms` (id, tokens) through the cluster, `in_flight` at once, and asserts every one
/// landed and verified; how long they took.
pub fn drive_verified(
    tag: &str,
    c: &kvferry::cluster::LocalCluster,
    rooms: Vec<(u64, usize)>,
    in_flight: usize,
) -> Duration {
    let (count, started) = (rooms.len(), Instant::now());
    let results = runtime()
        .block_on(kvferry::cluster::drive_rooms(
            &c.apis().unwrap(),
            rooms,
            in_flight,
        ))
        .unwrap_or_else(|e| panic!("{tag}: {e:#}; logs in {}", c.logs.display()));
    assert_eq!(results.len(), count, "{tag}");
    for r in &results {
        assert!(
            r.verified,
            "{tag}: room {} {} {:?}; logs in {}",
            r.room,
            r.state,
            r.code,
            c.logs.display()
        );
    }
    started.elapsed()
}

/// Asserts an error answer: status `want` and a JSON body with a string `error`.
pub fn assert_error(what: &str, got: (StatusCode, Value), want: StatusCode) {
    let (status, body) = got;
    assert_eq!(status, want, "{what}: answered {status}: {body}");
    assert!(
        body["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{what}: the {status} body has no `error` message: {body}"
    );
    println!("  {what}: {status} {}", body["error"]);
}

/// A loopback TCP port nothing listens on (bound, then closed).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a port");
    let port = l.local_addr().expect("local addr").port();
    drop(l);
    port
}

/// Milliseconds since the Unix epoch (the agents' `timings` use the same clock).
pub fn now_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// Milliseconds, for messages.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------------------------
// Fault-injection helpers (tests/processes/e2e_faults.rs, tests/processes/e2e_garbage.rs): processes started with an
// extra environment or behind a command prefix (`ip netns exec NS`), flag detection, and HTTP
// calls that tolerate a process that is gone.
// ---------------------------------------------------------------------------------------------

/// `&str`s to owned `String`s.
pub fn owned(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

/// The flags of `flags` that `kvferry <role> --help` does not list (empty when all are there).
pub fn missing_flags(role: &str, flags: &[&str]) -> Vec<String> {
    let out = std::process::Command::new(release_binary())
        .args([role, "--help"])
        .output()
        .unwrap_or_else(|e| panic!("kvferry {role} --help: {e}"));
    let help = String::from_utf8_lossy(&out.stdout);
    flags
        .iter()
        .filter(|f| {
            !help
                .split(|c: char| c.is_whitespace() || c == ',' || c == '=')
                .any(|w| w == **f)
        })
        .map(|f| (*f).to_owned())
        .collect()
}

/// Panics (naming what to do) unless `kvferry <role> --help` lists every flag of `flags`.
pub fn require_flags(role: &str, flags: &[&str]) {
    let missing = missing_flags(role, flags);
    assert!(
        missing.is_empty(),
        "`kvferry {role}` has no {missing:?} yet: this test needs them (rebuild with \
         `cargo build --release --bin kvferry` once they exist)"
    );
}

/// Starts `[prefix..] exe args` with `env` added to this process's environment (see
/// [`Process::spawn_with`]); waits up to [`BOUND`] for the listening line. Panics with the
/// log on failure.
pub fn spawn(
    exe: &Path,
    prefix: &[String],
    name: &str,
    args: &[String],
    env: &[(&str, &str)],
    logs: &Path,
) -> Process {
    Process::spawn_with(prefix, exe, name, args, env, logs, BOUND)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// A registry, one prefill and one decode agent on loopback, each started with [`spawn`]
/// (so the prefill can get extra environment, e.g. a fault hook). Fields drop in order: the
/// agents stop before the registry.
#[derive(Debug)]
pub struct FaultCluster {
    pub decode: Process,
    pub prefill: Process,
    pub registry: Process,
    pub logs: PathBuf,
    /// `http://...` of each.
    pub prefill_api: String,
    pub decode_api: String,
    pub registry_url: String,
}

impl FaultCluster {
    /// `agent_args` go to both agents, then `prefill_extra` / `decode_extra` to one each;
    /// `prefill_env` is added to the prefill's environment.
    pub fn start(
        tag: &str,
        agent_args: &[String],
        prefill_extra: &[&str],
        decode_extra: &[&str],
        prefill_env: &[(&str, &str)],
    ) -> FaultCluster {
        Self::start_env(
            tag,
            agent_args,
            prefill_extra,
            decode_extra,
            prefill_env,
            &[],
        )
    }

    /// [`FaultCluster::start`], with `agents_env` added to both agents' environment (e.g.
    /// `UCX_TLS`).
    pub fn start_env(
        tag: &str,
        agent_args: &[String],
        prefill_extra: &[&str],
        decode_extra: &[&str],
        prefill_env: &[(&str, &str)],
        agents_env: &[(&str, &str)],
    ) -> FaultCluster {
        let t = Instant::now();
        let exe = release_binary();
        let logs = kvferry::cluster::log_dir(tag).expect("log dir");
        let registry = spawn(
            &exe,
            &[],
            "registry",
            &owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]),
            &[],
            &logs,
        );
        let registry_url = registry.field("url").unwrap();
        let agent = |role: &str, extra: &[&str], env: &[(&str, &str)]| {
            let mut args = owned(&[role, "--bootstrap", &registry_url]);
            args.extend_from_slice(agent_args);
            args.extend(owned(extra));
            spawn(&exe, &[], role, &args, env, &logs)
        };
        let prefill_env: Vec<(&str, &str)> =
            agents_env.iter().chain(prefill_env).copied().collect();
        let prefill = agent("prefill", prefill_extra, &prefill_env);
        let decode = agent("decode", decode_extra, agents_env);
        let c = FaultCluster::of(registry, prefill, decode, logs);
        println!(
            "[{tag}] cluster up in {:.0} ms: prefill {}, decode {}; logs in {}",
            ms(t.elapsed()),
            c.prefill_api,
            c.decode_api,
            c.logs.display()
        );
        c
    }

    /// The cluster of processes already started (their logs in `logs`).
    pub fn of(registry: Process, prefill: Process, decode: Process, logs: PathBuf) -> FaultCluster {
        let (prefill_api, decode_api) =
            (prefill.field("api").unwrap(), decode.field("api").unwrap());
        let registry_url = registry.field("url").unwrap();
        FaultCluster {
            decode,
            prefill,
            registry,
            logs,
            prefill_api,
            decode_api,
            registry_url,
        }
    }
}

/// Like [`call`], but `None` when the request could not be sent or answered (process gone,
/// connection refused or reset) instead of a panic.
pub async fn try_call(
    http: &Client,
    method: Method,
    url: &str,
    body: Option<&Value>,
) -> Option<(StatusCode, Value)> {
    let mut req = http.request(method, url).timeout(Duration::from_secs(10));
    if let Some(body) = body {
        req = req.json(body);
    }
    match req.send().await {
        Ok(resp) => Some(answer(resp).await),
        Err(_) => None,
    }
}

/// Instance ids the registry lists (`GET /v1/ranks`).
pub async fn registered(http: &Client, registry: &str) -> Vec<String> {
    let v = expect(
        http,
        Method::GET,
        &format!("{registry}/v1/ranks"),
        None,
        StatusCode::OK,
    )
    .await;
    v["ranks"]
        .as_array()
        .unwrap_or_else(|| panic!("GET /v1/ranks without ranks: {v}"))
        .iter()
        .filter_map(|r| r["instance_id"].as_str().map(str::to_owned))
        .collect()
}

/// A seed for a randomised test: `KVFERRY_TEST_SEED` if set, else the clock. Print it.
pub fn test_seed() -> u64 {
    std::env::var("KVFERRY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// `opts.args()` plus the timeout flags it does not pass yet (`--timeout-ready-ms`,
/// `--timeout-stall-ms`), so that every timeout of the agents is explicit.
pub fn all_timeouts(opts: &AgentOpts, ready_ms: u64, stall_ms: u64) -> Vec<String> {
    let mut v = opts.args();
    for (flag, value) in [
        ("--timeout-ready-ms", ready_ms),
        ("--timeout-stall-ms", stall_ms),
    ] {
        if !v.iter().any(|a| a == flag) {
            v.extend([flag.to_owned(), value.to_string()]);
        }
    }
    v
}

/// The sum of every sample of the metric family `name` whose labels include `role="<role>"`
/// (e.g. all `kind`s of `kvferry_protocol_errors_total`); `None` when there is none.
pub async fn metric_sum(http: &Client, api: &str, name: &str, role: &str) -> Option<f64> {
    let text = http
        .get(format!("{api}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    let role = format!("role=\"{role}\"");
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = rest.strip_prefix('{')?.split_once("} ")?;
            labels
                .split(',')
                .any(|kv| kv == role)
                .then(|| value.trim().parse().ok())?
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Sets `flag` to `value` in `args`: replaces the value after an existing `flag` (clap refuses a
/// flag given twice), or appends both.
pub fn set_flag(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.to_owned(),
        _ => args.extend([flag.to_owned(), value.to_owned()]),
    }
}

/// A registry and a decode agent, with a fake prefill registered whose control endpoint is
/// `endpoint` (nothing of kvferry listens there): the registry, the decode, its API URL.
pub fn decode_with_fake_prefill(
    tag: &str,
    endpoint: &str,
) -> (kvferry::cluster::Process, kvferry::cluster::Process, String) {
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir(tag).expect("log dir");
    let wait = Duration::from_secs(30);
    let s = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<String>>();
    let registry = kvferry::cluster::Process::spawn(
        &exe,
        "registry",
        &s(&[
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--lease-ttl-ms",
            "60000",
        ]),
        &logs,
        wait,
    )
    .unwrap_or_else(|e| panic!("registry: {e:#}"));
    let url = registry.field("url").expect("registry url");
    let opts = AgentOpts {
        timeout_connect_ms: 1000,
        ..AgentOpts::default()
    };
    let mut args = s(&["decode", "--bootstrap", &url]);
    args.extend(opts.args());
    let decode = kvferry::cluster::Process::spawn(&exe, "decode", &args, &logs, wait)
        .unwrap_or_else(|e| panic!("decode: {e:#}"));
    let api = decode.field("api").expect("decode api");
    println!(
        "[{tag}] registry {url}, decode {api}; logs in {}",
        logs.display()
    );
    runtime().block_on(async {
        let fake = serde_json::json!({
            "instance_id": "6f0b7c1e-3d2a-4e5f-8a9b-0c1d2e3f4a5b",
            "role": "prefill",
            "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
            "layout": { "kind": "mha", "num_layers": 4, "num_kv_heads": 4, "head_dim": 32, "dtype": "fp16", "page_size": 16 },
            "slice": { "heads": { "start": 0, "end": 4 }, "layers": { "start": 0, "end": 4 } },
            "control_endpoint": endpoint,
            "data_endpoints": {},
        });
        let (status, v) = call(&http(), Method::POST, &format!("{url}/v1/ranks"), Some(&fake)).await;
        assert!(status.is_success(), "registering the fake prefill: {status} {v}");
    });
    (registry, decode, api)
}

/// Waits for `room` at the decode `api` to end, asserts it succeeded, takes it and asserts
/// every byte verified; the take's answer.
pub async fn take_verified(http: &Client, api: &str, room: u64) -> Value {
    let v = wait_final(http, api, room).await;
    assert_eq!(v["state"], "success", "room {room}: {v}");
    let url = format!("{api}/v1/rooms/{room}/take");
    let taken = expect(http, Method::POST, &url, None, StatusCode::OK).await;
    assert_eq!(taken["verified"], true, "room {room}: {taken}");
    taken
}

/// Asks the decode at `decode` for `room` and announces it ready at the prefill at `prefill`,
/// both with `body` (e.g. `{"tokens": 64}`).
pub async fn request_and_ready(
    http: &Client,
    decode: &str,
    prefill: &str,
    room: u64,
    body: &Value,
) {
    let url = format!("{decode}/v1/rooms/{room}");
    expect(http, Method::POST, &url, Some(body), StatusCode::CREATED).await;
    let ready = format!("{prefill}/v1/rooms/{room}/ready");
    expect(http, Method::POST, &ready, Some(body), StatusCode::ACCEPTED).await;
}

/// A registry served in this process on a port the OS picks until `shutdown` is cancelled: its
/// URL, and its task (it ends once shut down).
pub async fn registry_in_process(
    shutdown: &tokio_util::sync::CancellationToken,
) -> (String, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the registry");
    let url = format!("http://{}", listener.local_addr().expect("local address"));
    let config = kvferry_bootstrap::ServerConfig::default();
    let served = tokio::spawn(kvferry_bootstrap::serve(listener, config, shutdown.clone()));
    (url, served)
}

/// The config of an agent run in this process against `registry`: tiny, 64 pages, the
/// synthetic engine, everything on loopback; `extra` flags after those.
pub fn in_process_config(registry: &str, extra: &[&str]) -> kvferry::agent::AgentConfig {
    let mut flags = vec![
        "--bootstrap",
        registry,
        "--model",
        "tiny",
        "--pool-pages",
        "64",
        "--synthetic",
        "--host",
        "127.0.0.1",
        "--api-host",
        "127.0.0.1",
    ];
    flags.extend_from_slice(extra);
    let args = kvferry::agent::AgentOptions::from_flags(flags).expect("agent flags");
    args.config().expect("agent config")
}

/// Asks the decode at `decode` for `room` (201).
pub async fn request(http: &Client, decode: &str, room: u64, body: Value) -> Value {
    let url = format!("{decode}/v1/rooms/{room}");
    expect(http, Method::POST, &url, Some(&body), StatusCode::CREATED).await
}

/// Announces `room` ready at the prefill at `prefill`, the whole of its `tokens` (202).
pub async fn ready(http: &Client, prefill: &str, room: u64, tokens: usize) -> Value {
    let url = format!("{prefill}/v1/rooms/{room}/ready");
    expect(
        http,
        Method::POST,
        &url,
        Some(&json!({ "tokens": tokens })),
        StatusCode::ACCEPTED,
    )
    .await
}

/// Announces tokens `range` of `room` (of `tokens` in all) ready at the synthetic prefill at
/// `prefill` as one piece (202); `last` says whether it is the engine's last piece.
///
/// A test that must act mid-transfer announces a first piece that is not the last: the decode's
/// room is `transferring` from the piece's first chunk until the rest is announced, however
/// fast or slow the machine, so waiting for that state cannot miss it.
pub async fn ready_piece(
    http: &Client,
    prefill: &str,
    room: u64,
    tokens: usize,
    range: std::ops::Range<usize>,
    last: bool,
) -> Value {
    let url = format!("{prefill}/v1/rooms/{room}/ready");
    let body = json!({ "tokens": tokens, "token_range": [range.start, range.end], "last": last });
    expect(http, Method::POST, &url, Some(&body), StatusCode::ACCEPTED).await
}

/// Takes `room` at the decode at `decode` (200).
pub async fn take(http: &Client, decode: &str, room: u64) -> Value {
    let url = format!("{decode}/v1/rooms/{room}/take");
    expect(http, Method::POST, &url, None, StatusCode::OK).await
}

/// A final view with a reason: code and a non-empty message.
pub fn assert_reason(v: &Value, code: &str) {
    assert_eq!(v["reason"]["code"], code, "{v}");
    assert!(
        v["reason"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "a reason without a message: {v}"
    );
}

/// The agent's own timestamp of `state` (ms since the epoch), if it has one.
pub fn at(v: &Value, state: &str) -> Option<f64> {
    v["timings"][state].as_f64()
}

/// A ZMTP 3.0 greeting for `mechanism` ("NULL", "PLAIN"), as a client: what a raw peer of a
/// ZeroMQ port sends first.
pub fn zmtp_greeting(mechanism: &str) -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 0];
    g.extend_from_slice(mechanism.as_bytes());
    g.resize(64, 0);
    g
}

/// A ZMTP READY command with a Socket-Type property: the end of a NULL handshake.
pub fn zmtp_ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut f = vec![0x04, body.len() as u8];
    f.extend(body);
    f
}
