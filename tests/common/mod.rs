//! Helpers shared by the multi-process tests (`tests/e2e_*.rs`): where the release binary is,
//! how the agents are started (every timeout flag explicit), an HTTP client that never goes
//! through a proxy, and JSON / polling helpers with generous bounds.
//!
//! The tests spawn `target/release/kvferry` (built with `cargo build --release --bin kvferry`),
//! never the debug build: the synthetic fill and verification are too slow unoptimised.

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use reqwest::{Client, Method, StatusCode};
use serde_json::Value;

/// The generous bound on everything a test waits for.
pub const BOUND: Duration = Duration::from_secs(30);

/// Final room states.
pub const FINAL: [&str; 3] = ["success", "failed", "aborted"];

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
    Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(90))
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
