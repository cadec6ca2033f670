//! `kvferry proxy` as a process in front of stand-in vLLM servers (real HTTP servers in this
//! test that answer like vLLM with `KvferryConnector` and record what they were sent): both
//! pairings, streamed answers passed through, least-outstanding balancing, servers routed around
//! while unhealthy and used again once healthy, OpenAI error objects for every failure, a
//! prefill's refusal ending its decode request, and the metrics. The real-vLLM tests
//! (python/tests/test_vllm_pd.py) run the proxy in front of real engines.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::{BOUND, Process, call, call_raw, http, owned, poll_until, release_binary, runtime};
use reqwest::Method;
use serde_json::{Value, json};

/// What a stand-in server does with a completion request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Answer,
    /// 400 with vLLM's error object.
    Refuse,
    /// 500 "Internal server error", like vLLM's `fail` policy for a failed KV load.
    Fail,
    /// Waits until released (or dropped by its client), then answers as the mode is then.
    Hold,
    /// A streamed answer whose connection breaks after its first chunk (a server killed
    /// mid-answer).
    Break,
    /// A streamed answer that ends, after its first chunk, with vLLM's error event for a
    /// failed KV load ("Internal server error").
    FailMidStream,
    /// vLLM's answer to a new request while it drains for its shutdown (`--shutdown-timeout`):
    /// at once, aborted, no token (a stream: `[DONE]` alone).
    Drains,
    /// A server lost after it took the request: its status line goes, then its connection
    /// breaks before any byte of the answer (killed, streamed or not).
    Lost,
    /// vLLM's answer to a request its API server took as its engine stopped: an error before
    /// any token ("EngineCore encountered an issue"; a stream: its first event), and its health
    /// fails from then on.
    Dies,
}

/// A request's `Authorization` and `X-Request-Id` headers.
type Headers = (Option<String>, Option<String>);

/// A stand-in vLLM server with `KvferryConnector`: a prefill (group `group`) or a decode. It
/// answers `kvferry_identify` and `kvferry_reason_of` like the connector.
struct Stub {
    name: String,
    group: u64,
    /// vLLM data-parallel ranks: rank `r` (`X-data-parallel-rank`) is group `group + r`.
    dp_size: AtomicUsize,
    healthy: AtomicBool,
    mode: Mutex<Mode>,
    release: tokio::sync::Notify,
    seen: Mutex<Vec<Value>>,
    /// Every request's kind ("health", "models", "identify", "reason_of", "completion") with
    /// its `Authorization` and `X-Request-Id` headers.
    headers: Mutex<Vec<(&'static str, Headers)>>,
    /// How long `/health` takes to answer, in ms.
    health_ms: std::sync::atomic::AtomicU64,
    /// Held requests whose client went away before they were released.
    dropped: AtomicUsize,
    /// Notified to close the server's port and its connections (a dead server).
    gone: tokio::sync::Notify,
    /// Its answer to `kvferry_reason_of` (`code: message`).
    reason: Mutex<String>,
    /// The message of its 400 in mode `Refuse`.
    refusal: Mutex<String>,
    /// The rooms it was asked to release (`kvferry_abort`), in order.
    released: Mutex<Vec<Value>>,
}

struct Held<'a>(&'a Stub, bool);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Stub {
    async fn start(name: &str, group: u64) -> (Arc<Stub>, String) {
        let stub = Arc::new(Stub {
            name: name.to_owned(),
            group,
            dp_size: AtomicUsize::new(1),
            healthy: AtomicBool::new(true),
            mode: Mutex::new(Mode::Answer),
            release: tokio::sync::Notify::new(),
            seen: Mutex::new(Vec::new()),
            headers: Mutex::new(Vec::new()),
            health_ms: std::sync::atomic::AtomicU64::new(0),
            dropped: AtomicUsize::new(0),
            gone: tokio::sync::Notify::new(),
            reason: Mutex::new("peer_dead: the prefill went away".to_owned()),
            refusal: Mutex::new("prompt too long".to_owned()),
            released: Mutex::new(Vec::new()),
        });
        let app = Router::new()
            .route("/health", get(health))
            .route("/v1/models", get(models))
            .route("/v1/completions", post(answer))
            .route("/v1/chat/completions", post(answer))
            .with_state(stub.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let gone = stub.clone();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { gone.gone.notified().await })
                .await
        });
        (stub, url)
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// Requests seen, `kvferry_identify` ones left out.
    fn seen(&self) -> Vec<Value> {
        self.seen.lock().unwrap().clone()
    }

    fn record(&self, kind: &'static str, headers: &HeaderMap) {
        let get = |name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap_or("?").to_owned())
        };
        let seen = (get("authorization"), get("x-request-id"));
        self.headers.lock().unwrap().push((kind, seen));
    }

    /// The `Authorization` and `X-Request-Id` of every request of `kind` so far.
    fn headers_of(&self, kind: &str) -> Vec<Headers> {
        let all = self.headers.lock().unwrap();
        all.iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, h)| h.clone())
            .collect()
    }
}

async fn models(State(s): State<Arc<Stub>>, headers: HeaderMap) -> Response {
    s.record("models", &headers);
    axum::Json(json!({"data": [{"id": "tiny"}], "server": s.name})).into_response()
}

async fn health(State(s): State<Arc<Stub>>, headers: HeaderMap) -> StatusCode {
    s.record("health", &headers);
    let delay = s.health_ms.load(Ordering::SeqCst);
    tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
    if s.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn answer(
    State(s): State<Arc<Stub>>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> Response {
    let params = body["kv_transfer_params"].clone();
    let dp_rank = headers
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let dp_size = s.dp_size.load(Ordering::SeqCst) as u64;
    if let Some(rank) = dp_rank.filter(|r| *r >= dp_size) {
        let message = format!("data_parallel_rank {rank} is out of range [0, {dp_size}).");
        let e = json!({"error": {"message": message, "type": "BadRequestError", "param": null, "code": 400}});
        return (StatusCode::BAD_REQUEST, axum::Json(e)).into_response();
    }
    if params["kvferry_identify"] == json!(true) {
        s.record("identify", &headers);
        let rank = dp_rank.unwrap_or(0);
        let said = json!({"kvferry_dp_rank": s.group + rank, "kvferry_engine_dp_rank": rank});
        return axum::Json(json!({ "kv_transfer_params": said })).into_response();
    }
    if let Some(room) = params.get("kvferry_reason_of") {
        s.record("reason_of", &headers);
        let said = s.reason.lock().unwrap().clone();
        let reason = json!({"kvferry_room": room, "kvferry_reason": said});
        return axum::Json(json!({"kv_transfer_params": reason})).into_response();
    }
    if let Some(room) = params.get("kvferry_abort") {
        s.record("abort", &headers);
        s.released.lock().unwrap().push(room.clone());
        let said = json!({"kvferry_room": room, "kvferry_aborted": true});
        return axum::Json(json!({"kv_transfer_params": said})).into_response();
    }
    s.record("completion", &headers);
    let mut seen = body.clone();
    seen["_dp_rank"] = json!(dp_rank);
    s.seen.lock().unwrap().push(seen);
    let mut mode = *s.mode.lock().unwrap();
    if mode == Mode::Hold {
        // Released, it answers as its mode says then.
        let mut held = Held(&s, false);
        s.release.notified().await;
        held.1 = true;
        mode = *s.mode.lock().unwrap();
    }
    match mode {
        Mode::Refuse => {
            let message = s.refusal.lock().unwrap().clone();
            let e = json!({"error": {"message": message, "type": "BadRequestError", "param": null, "code": 400}});
            return (StatusCode::BAD_REQUEST, axum::Json(e)).into_response();
        }
        Mode::Fail => {
            let e = json!({"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}});
            return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(e)).into_response();
        }
        Mode::Drains if body["stream"] == json!(true) => {
            let mut r = Response::new(Body::from("data: [DONE]\n\n"));
            r.headers_mut()
                .insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
            return r;
        }
        Mode::Drains => {
            let aborted = json!({"choices": [{"index": 0, "text": "", "finish_reason": "abort", "token_ids": null}],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
                                 "kv_transfer_params": null, "server": s.name});
            return axum::Json(aborted).into_response();
        }
        Mode::Lost => {
            let broken = futures_util::stream::once(async {
                Err::<String, _>(std::io::Error::other("killed"))
            });
            let mut r = Response::new(Body::from_stream(broken));
            let kind = match body["stream"] == json!(true) {
                true => "text/event-stream",
                false => "application/json",
            };
            r.headers_mut()
                .insert(header::CONTENT_TYPE, kind.parse().unwrap());
            return r;
        }
        Mode::Dies => {
            s.healthy.store(false, Ordering::SeqCst);
            let e = json!({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                                     "type": "InternalServerError", "param": null, "code": 500}});
            if body["stream"] == json!(true) {
                let events = format!("data: {e}\n\ndata: [DONE]\n\n");
                let mut r = Response::new(Body::from(events));
                r.headers_mut()
                    .insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
                return r;
            }
            return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(e)).into_response();
        }
        Mode::Hold | Mode::Answer | Mode::Break | Mode::FailMidStream => {}
    }
    let params = if params["do_remote_decode"] == json!(true) {
        // A prefill: its answer names the room (the one it was given, or its own).
        let room = params["kvferry_room"].as_str().unwrap_or("77").to_owned();
        json!({"do_remote_prefill": true, "kvferry_room": room, "kvferry_dp_rank": s.group, "kvferry_tokens": 3})
    } else {
        json!({"kvferry_room": params["kvferry_room"], "kvferry_start_token": 0})
    };
    if body["stream"] == json!(true) {
        let mut chunks: Vec<Result<String, std::io::Error>> = ["one", "two", "three"]
            .iter()
            .map(|t| {
                Ok(format!(
                    "data: {}\n\n",
                    json!({"choices": [{"text": t}], "server": s.name})
                ))
            })
            .chain([Ok("data: [DONE]\n\n".to_owned())])
            .collect();
        if mode == Mode::FailMidStream {
            let e = json!({"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}});
            chunks.splice(
                1..,
                [
                    Ok(format!("data: {e}\n\n")),
                    Ok("data: [DONE]\n\n".to_owned()),
                ],
            );
        }
        if mode == Mode::Break {
            // The first chunk, then a broken connection once the test released it.
            chunks.truncate(1);
            let stub = s.clone();
            let broken = futures_util::stream::once(async move {
                stub.release.notified().await;
                Err(std::io::Error::other("killed"))
            });
            let stream = futures_util::StreamExt::chain(futures_util::stream::iter(chunks), broken);
            let mut r = Response::new(Body::from_stream(stream));
            r.headers_mut()
                .insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
            return r;
        }
        let mut r = Response::new(Body::from_stream(futures_util::stream::iter(chunks)));
        r.headers_mut()
            .insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
        return r;
    }
    let mut choice = json!({"text": "answer"});
    if body["return_token_ids"] == json!(true) {
        // vLLM's token ids: the prompt's (token ids given), and the answer's one token.
        choice["token_ids"] = json!([99]);
        choice["prompt_token_ids"] = body["prompt"].clone();
        choice["finish_reason"] = json!("length");
    }
    axum::Json(
        json!({"id": format!("cmpl-{}", s.name), "choices": [choice], "server": s.name,
                      "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                      "kv_transfer_params": params}),
    )
    .into_response()
}

/// A proxy process in front of `prefills` and `decodes`.
fn proxy(prefills: &[&str], decodes: &[&str], pairing: &str) -> (Process, String) {
    proxy_with(prefills, decodes, pairing, &[])
}

/// A proxy process in front of `prefills` and `decodes`, with `extra` arguments.
fn proxy_with(
    prefills: &[&str],
    decodes: &[&str],
    pairing: &str,
    extra: &[&str],
) -> (Process, String) {
    let mut args = owned(&[
        "proxy",
        "--prefill",
        &prefills.join(","),
        "--decode",
        &decodes.join(","),
        "--port",
        "0",
        "--pairing",
        pairing,
    ]);
    if !extra.contains(&"--health-ms") {
        args.extend(owned(&["--health-ms", "50"]));
    }
    // Every prompt disaggregated, short or not, unless a test says otherwise.
    if !extra.contains(&"--short-below-tokens") {
        args.extend(owned(&["--short-below-tokens", "0"]));
    }
    args.extend(owned(extra));
    spawn_proxy(args)
}

/// A proxy process with `args` (after `proxy`'s own) and a log of its own.
fn spawn_proxy(args: Vec<String>) -> (Process, String) {
    let logs = kvferry::cluster::log_dir("proxy").expect("log dir");
    // A log of its own: the proxies of one test process share a log folder.
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    let name = format!("proxy-{}", STARTED.fetch_add(1, Ordering::SeqCst));
    let p = common::spawn(
        &release_binary(),
        &[],
        &name,
        &args,
        &[("RUST_LOG", "info")],
        &logs,
    );
    assert_eq!(p.listening["role"], "proxy");
    let url = p.field("url").unwrap();
    (p, url)
}

/// A proxy process that finds its servers in the registry at `registry` (no list).
fn proxy_found(registry: &str, pairing: &str) -> (Process, String) {
    let logs = kvferry::cluster::log_dir("proxy").expect("log dir");
    let args = owned(&[
        "proxy",
        "--bootstrap",
        registry,
        "--port",
        "0",
        "--pairing",
        pairing,
        "--health-ms",
        "50",
        "--short-below-tokens",
        "0",
    ]);
    let p = common::spawn(
        &release_binary(),
        &[],
        &format!("proxy-found-{pairing}"),
        &args,
        &[("RUST_LOG", "info")],
        &logs,
    );
    let url = p.field("url").unwrap();
    (p, url)
}

async fn wait_health(url: &str, want: reqwest::StatusCode) {
    let http = http();
    poll_until(&format!("proxy /health {want}"), BOUND, || {
        let http = http.clone();
        async move {
            let s = http
                .get(format!("{url}/health"))
                .send()
                .await
                .ok()?
                .status();
            (s == want).then_some(())
        }
    })
    .await;
}

fn completion(stream: bool) -> Value {
    json!({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0, "stream": stream,
           "stream_options": {"include_usage": true}})
}

/// A non-streamed completion through the proxy at `url`.
async fn complete(url: &str) -> (reqwest::StatusCode, Value) {
    call(
        &http(),
        Method::POST,
        &format!("{url}/v1/completions"),
        Some(&completion(false)),
    )
    .await
}

async fn metrics_text(url: &str) -> String {
    let r = http().get(format!("{url}/metrics")).send().await.unwrap();
    r.text().await.unwrap()
}

/// The proxy's counter `name{labels}` (0 when absent).
async fn counter(url: &str, series: &str) -> f64 {
    metrics_text(url)
        .await
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// One completion through the proxy at `url` while both servers hold it; once both have it,
/// `refuser` answers 400, which the client must get, and `other`'s request must be dropped.
async fn one_side_refuses(url: &str, refuser: &Stub, other: &Stub) -> Value {
    refuser.set(Mode::Hold);
    other.set(Mode::Hold);
    let seen = (refuser.seen().len(), other.seen().len());
    let dropped = other.dropped.load(Ordering::SeqCst);
    let answer = tokio::spawn({
        let url = url.to_owned();
        async move { complete(&url).await }
    });
    poll_until("both requests arrive", BOUND, || async {
        (refuser.seen().len() > seen.0 && other.seen().len() > seen.1).then_some(())
    })
    .await;
    refuser.set(Mode::Refuse);
    refuser.release.notify_waiters();
    let (status, got) = answer.await.unwrap();
    assert_eq!(
        (status.as_u16(), got["error"]["code"].as_u64()),
        (400, Some(400)),
        "{got}"
    );
    poll_until(
        &format!("the {} request is dropped", other.name),
        BOUND,
        || async { (other.dropped.load(Ordering::SeqCst) > dropped).then_some(()) },
    )
    .await;
    got
}

#[test]
fn sequential_pairing_copies_the_prefill_params_into_the_decode_request() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 4).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "sequential");
        wait_health(&url, reqwest::StatusCode::OK).await;
        let (status, got) = complete(&url).await;
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["server"], "d");
        let first = &prefill.seen()[0];
        assert_eq!(first["max_tokens"], 1);
        assert_eq!(first["stream"], false);
        assert!(first.get("stream_options").is_none());
        // The proxy names the room (it can then have the prefill release it).
        let room = first["kv_transfer_params"]["kvferry_room"].clone();
        room.as_str().expect("a room").parse::<u64>().expect("a u64 in decimal");
        assert_eq!(first["kv_transfer_params"], json!({"do_remote_decode": true, "kvferry_room": room}));
        let second = &decode.seen()[0];
        assert_eq!(second["max_tokens"], 16);
        assert_eq!(
            second["kv_transfer_params"],
            json!({"do_remote_prefill": true, "kvferry_room": room, "kvferry_dp_rank": 4, "kvferry_tokens": 3})
        );
        // The decode's parameters come back to the client.
        assert_eq!(got["kv_transfer_params"]["kvferry_room"], room);
    });
}

#[test]
fn concurrent_pairing_names_a_fresh_room_and_the_prefill_group_in_both_requests() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 3).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "concurrent");
        wait_health(&url, reqwest::StatusCode::OK).await;
        for _ in 0..4 {
            let (status, got) = complete(&url).await;
            assert_eq!(status, 200, "{got}");
        }
        let mut rooms = std::collections::HashSet::new();
        for (p, d) in prefill.seen().iter().zip(decode.seen()) {
            let room = p["kv_transfer_params"]["kvferry_room"]
                .as_str()
                .expect("a room")
                .to_owned();
            room.parse::<u64>().expect("a u64 in decimal");
            assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
            assert_eq!(
                d["kv_transfer_params"],
                json!({"do_remote_prefill": true, "kvferry_room": room, "kvferry_dp_rank": 3})
            );
            rooms.insert(room);
        }
        assert_eq!(rooms.len(), 4, "every request has its own room");
    });
}

/// A prefill server of two vLLM data-parallel ranks is two kvferry groups: the proxy learns
/// both (`X-data-parallel-rank` on its identify requests), and requests take turns: each
/// prefill request names its rank in that header, and its decode request names that rank's
/// group.
#[test]
fn concurrent_pairing_takes_turns_over_a_prefill_servers_data_parallel_ranks() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 10).await;
        prefill.dp_size.store(2, Ordering::SeqCst);
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "concurrent");
        wait_health(&url, reqwest::StatusCode::OK).await;
        for _ in 0..4 {
            let (status, got) = complete(&url).await;
            assert_eq!(status, 200, "{got}");
        }
        let mut ranks = Vec::new();
        for (p, d) in prefill.seen().iter().zip(decode.seen()) {
            let rank = p["_dp_rank"]
                .as_u64()
                .expect("the prefill request names a rank");
            assert_eq!(
                p["kv_transfer_params"]["kvferry_room"],
                d["kv_transfer_params"]["kvferry_room"]
            );
            assert_eq!(d["kv_transfer_params"]["kvferry_dp_rank"], 10 + rank, "{d}");
            assert_eq!(
                d["_dp_rank"],
                Value::Null,
                "the decode request names no rank"
            );
            ranks.push(rank);
        }
        ranks.sort();
        assert_eq!(ranks, [0, 0, 1, 1], "the ranks take turns");
    });
}

#[test]
fn streamed_answers_pass_through_chunk_by_chunk_on_both_apis() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 0).await;
        let (_decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "concurrent");
        wait_health(&url, reqwest::StatusCode::OK).await;
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let r = http()
                .post(format!("{url}{path}"))
                .json(&completion(true))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert!(
                r.headers()[header::CONTENT_TYPE.as_str()]
                    .to_str()
                    .unwrap()
                    .starts_with("text/event-stream")
            );
            let text = r.text().await.unwrap();
            let texts: Vec<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|l| *l != "[DONE]")
                .map(|l| {
                    serde_json::from_str::<Value>(l).unwrap()["choices"][0]["text"]
                        .as_str()
                        .unwrap()
                        .to_owned()
                })
                .collect();
            assert_eq!(texts, ["one", "two", "three"], "{path}");
            assert!(text.ends_with("data: [DONE]\n\n"));
        }
        // The chat prefill is limited to one token under both names; never streamed.
        let chat = &prefill.seen()[1];
        assert_eq!(
            (
                chat["max_tokens"].clone(),
                chat["max_completion_tokens"].clone()
            ),
            (json!(1), json!(1))
        );
        assert_eq!(chat["stream"], false);
        assert_eq!(
            counter(
                &url,
                r#"kvferry_proxy_requests_total{endpoint="chat_completions",outcome="answered"}"#
            )
            .await,
            1.0
        );
        assert_eq!(
            counter(&url, "kvferry_proxy_time_to_first_token_seconds_count").await,
            2.0
        );
        // OpenMetrics text (prometheus-client): counters' HELP names the family, not `_total`.
        let text = metrics_text(&url).await;
        assert!(
            text.contains("# TYPE kvferry_proxy_requests counter") && text.ends_with("# EOF\n"),
            "{text}"
        );
    });
}

#[test]
fn a_stream_the_decode_breaks_ends_with_an_error_event() {
    runtime().block_on(async {
        let (_prefill, p_url) = Stub::start("p", 0).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "concurrent");
        wait_health(&url, reqwest::StatusCode::OK).await;
        decode.set(Mode::Break);
        let mut r = http()
            .post(format!("{url}/v1/completions"))
            .json(&completion(true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let mut text = String::from_utf8(r.chunk().await.unwrap().unwrap().to_vec()).unwrap();
        // The decode's connection breaks after the first chunk reached the client; the rest
        // arrives whole: the proxy ends the stream itself after an error event.
        decode.release.notify_one();
        while let Some(chunk) = r.chunk().await.expect("a stream that ends cleanly") {
            text += std::str::from_utf8(&chunk).unwrap();
        }
        let events: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(events.len(), 2, "{text}");
        assert_eq!(events[0]["choices"][0]["text"], "one");
        let message = events[1]["error"]["message"].as_str().unwrap();
        // The decode server by its place in --decode, not its address (the log has that).
        assert!(
            message.starts_with("decode server 1 of 1 failed mid-answer: "),
            "{message}"
        );
        assert_eq!(leak(&text, &[&p_url, &d_url]), None, "{text}");
        assert_eq!(events[1]["error"]["code"], 502);
    });
}

/// vLLM ends a stream whose KV load failed with a bare "Internal server error" event: the
/// proxy extends its message with the decode server (its place in --decode), the room and
/// kvferry's reason there.
#[test]
fn an_error_event_in_a_stream_is_explained() {
    runtime().block_on(async {
        let (_prefill, p_url) = Stub::start("p", 0).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        decode.set(Mode::FailMidStream);
        for pairing in ["sequential", "concurrent"] {
            let (_proxy, url) = proxy(&[&p_url], &[&d_url], pairing);
            wait_health(&url, reqwest::StatusCode::OK).await;
            let text = http()
                .post(format!("{url}/v1/completions"))
                .json(&completion(true))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            assert_eq!(events.len(), 3, "{pairing}: {text}");
            assert_eq!(events[2], "[DONE]", "{pairing}: {text}");
            let error: Value = serde_json::from_str(events[1]).unwrap();
            let message = error["error"]["message"].as_str().unwrap();
            let room = decode.seen().last().unwrap()["kv_transfer_params"]["kvferry_room"].clone();
            let room = room.as_str().unwrap().to_owned();
            assert_eq!(
                message,
                format!("Internal server error (decode server 1 of 1, kvferry room {room} failed: peer_dead: the prefill went away)"),
                "{pairing}"
            );
            assert_eq!(error["error"]["code"], 500, "{pairing}");
        }
    });
}

/// `--pairing first-token`: the prefill's token is the client's first, at once, and the decode
/// continues from the prompt plus that token (`kvferry_continues`, the prefill's room, one
/// token fewer to generate); its events follow as one answer's, streamed or joined. A decode
/// error after the first token ends the stream with the explained error event; a one-token
/// answer is the prefill's alone, its room released; a request with stop strings goes the
/// sequential way.
#[test]
fn the_first_token_comes_from_the_prefill_and_the_decode_continues_from_it() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 0).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "first-token");
        wait_health(&url, reqwest::StatusCode::OK).await;
        let send = |body: Value| {
            let url = url.clone();
            async move {
                let r = http()
                    .post(format!("{url}/v1/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                (r.status(), r.text().await.unwrap())
            }
        };
        let events = |text: &str| -> Vec<Value> {
            (text.lines().filter_map(|l| l.strip_prefix("data: ")))
                .map(|e| serde_json::from_str(e).unwrap_or(json!(e)))
                .collect()
        };
        let (status, text) = send(completion(true)).await;
        assert_eq!(status, 200, "{text}");
        let got = events(&text);
        let texts: Vec<&str> = got[..4]
            .iter()
            .map(|e| e["choices"][0]["text"].as_str().unwrap())
            .collect();
        assert_eq!(texts, ["answer", "one", "two", "three"], "{text}");
        assert_eq!(got[0]["id"], "cmpl-p", "the prefill's answer's id: {text}");
        assert_eq!(got[4], json!("[DONE]"), "{text}");
        let asked = prefill.seen().last().unwrap().clone();
        assert_eq!(
            (
                asked["return_token_ids"].clone(),
                asked["max_tokens"].clone(),
                asked["stream"].clone()
            ),
            (json!(true), json!(1), json!(false))
        );
        let continued = decode.seen().last().unwrap().clone();
        assert_eq!(continued["prompt"], json!([5, 6, 7, 99]));
        assert_eq!(continued["max_tokens"], 15);
        let params = &continued["kv_transfer_params"];
        assert_eq!(params["kvferry_continues"], true, "{continued}");
        assert_eq!(
            params["kvferry_room"],
            asked["kv_transfer_params"]["kvferry_room"]
        );
        // Joined, not streamed.
        let (status, text) = send(completion(false)).await;
        assert_eq!(status, 200, "{text}");
        let whole: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(whole["choices"][0]["text"], "answeranswer", "{text}");
        // The decode fails after the first token went: an explained error event ends it.
        decode.set(Mode::Fail);
        let (status, text) = send(completion(true)).await;
        assert_eq!(status, 200, "{text}");
        let got = events(&text);
        assert_eq!(got.len(), 3, "{text}");
        assert_eq!(got[0]["choices"][0]["text"], "answer");
        let message = got[1]["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with("Internal server error (decode server 1 of 1, kvferry room "),
            "{message}"
        );
        assert_eq!(got[2], json!("[DONE]"));
        decode.set(Mode::Answer);
        let room_asked =
            || prefill.seen().last().unwrap()["kv_transfer_params"]["kvferry_room"].clone();
        // Its decode failed before its answer began: released (asynchronously, so awaited below
        // with the others).
        let mut rooms = vec![room_asked()];
        // One token: the prefill's answer alone; the decode hears nothing, the room goes.
        let heard = decode.seen().len();
        let mut one = completion(false);
        one["max_tokens"] = json!(1);
        let (status, text) = send(one.clone()).await;
        assert_eq!(status, 200, "{text}");
        rooms.push(room_asked());
        let whole: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (
                whole["choices"][0]["text"].clone(),
                whole["usage"]["completion_tokens"].clone()
            ),
            (json!("answer"), json!(1))
        );
        assert_eq!(
            whole["choices"][0]["token_ids"],
            Value::Null,
            "not asked for: {text}"
        );
        one["stream"] = json!(true);
        let (_, text) = send(one).await;
        rooms.push(room_asked());
        let got = events(&text);
        assert_eq!(got[0]["choices"][0]["finish_reason"], "length", "{text}");
        assert_eq!(got[1]["usage"]["completion_tokens"], 1, "{text}");
        assert_eq!(
            decode.seen().len(),
            heard,
            "a decode computed a one-token answer"
        );
        poll_until("the three rooms released", BOUND, || async {
            let released = prefill.released.lock().unwrap().clone();
            rooms.iter().all(|r| released.contains(r)).then_some(())
        })
        .await;
        // Stop strings: the decode samples the first token, from the client's own prompt.
        let mut stop = completion(false);
        stop["stop"] = json!(["x"]);
        let (status, _) = send(stop).await;
        assert_eq!(status, 200);
        let sequential = decode.seen().last().unwrap().clone();
        assert_eq!(sequential["prompt"], json!([5, 6, 7]));
        assert_eq!(
            sequential["kv_transfer_params"]["kvferry_continues"],
            Value::Null
        );
    });
}

/// `--short-below-tokens`, at its default (384): a prompt surely shorter goes to one decode
/// server, as it came (no room, no prefill), streamed or not; one of 384 tokens is
/// disaggregated; each is counted by the server that samples its first token.
#[test]
fn a_short_prompt_goes_to_one_decode_server_alone() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 0).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = spawn_proxy(owned(&[
            "proxy",
            "--prefill",
            &p_url,
            "--decode",
            &d_url,
            "--port",
            "0",
            "--health-ms",
            "50",
        ]));
        wait_health(&url, reqwest::StatusCode::OK).await;
        let send = |tokens: usize, stream: bool| {
            let mut request = completion(stream);
            request["prompt"] = json!((0..tokens).map(|t| t % 500 + 5).collect::<Vec<_>>());
            let url = url.clone();
            async move {
                let r = http()
                    .post(format!("{url}/v1/completions"))
                    .json(&request)
                    .send()
                    .await
                    .unwrap();
                (r.status(), r.text().await.unwrap())
            }
        };
        for stream in [false, true] {
            let (status, text) = send(383, stream).await;
            assert_eq!(status, 200, "{text}");
            assert!(text.contains("\"d\""), "{text}");
        }
        assert!(
            prefill.seen().is_empty(),
            "the prefill computed a short prompt"
        );
        let alone = decode.seen();
        assert_eq!(alone.len(), 2);
        assert!(
            alone
                .iter()
                .all(|r| r["prompt"].as_array().map(Vec::len) == Some(383)
                    && r["kv_transfer_params"].is_null()),
            "{alone:?}"
        );
        let (status, text) = send(384, false).await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(
            prefill.seen().len(),
            1,
            "a prompt of 384 tokens is disaggregated"
        );
        let by = |s: &str| format!("kvferry_proxy_first_tokens_total{{sampled_by=\"{s}\"}}");
        assert_eq!(counter(&url, &by("one_server")).await, 2.0);
        assert_eq!(counter(&url, &by("prefill")).await, 1.0);
    });
}

/// A decode server lost after it took the request, before its answer began (its connection
/// breaks, or it answers an error before any token and fails its health check from then on):
/// the proxy sends the request to the other decode with the same room, nothing of the lost
/// one reached the client, the prefill got the request once (no second prefill), and the lost
/// one is routed around; in both pairings, streamed or not. The prefill is not asked
/// to release the room: a decode's answer began. A second lost decode ends the request.
#[test]
fn a_decode_lost_before_it_answered_is_replaced_and_the_room_kept() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 0).await;
        let (lost, l_url) = Stub::start("lost", 0).await;
        let (other, o_url) = Stub::start("other", 0).await;
        for (mode, pairing_kind, stream) in [
            (Mode::Lost, "sequential", false),
            (Mode::Lost, "sequential", true),
            (Mode::Lost, "concurrent", false),
            (Mode::Lost, "concurrent", true),
            (Mode::Dies, "sequential", false),
            (Mode::Dies, "concurrent", true),
        ] {
            let pairing = format!("{pairing_kind} {mode:?}");
            lost.set(mode);
            let (_proxy, url) = proxy(&[&p_url], &[&l_url, &o_url], pairing_kind);
            wait_health(&url, reqwest::StatusCode::OK).await;
            // `other` holds a request (sent while `lost` was unhealthy), so the next one goes
            // to `lost`, which has none.
            let usable = |healthy: bool| {
                let url = url.clone();
                let l_url = l_url.clone();
                async move {
                    poll_until("the proxy sees the lost decode's health", BOUND, || async {
                        (listed(&url, "decode", &l_url).await?["healthy"] == healthy).then_some(())
                    })
                    .await
                }
            };
            lost.healthy.store(false, Ordering::SeqCst);
            usable(false).await;
            other.set(Mode::Hold);
            let seen = other.seen().len();
            let held = tokio::spawn({
                let url = url.clone();
                async move { complete(&url).await }
            });
            poll_until("a request held at the other decode", BOUND, || async {
                (other.seen().len() > seen).then_some(())
            })
            .await;
            lost.healthy.store(true, Ordering::SeqCst);
            usable(true).await;
            other.set(Mode::Answer);
            let before = (prefill.seen().len(), lost.seen().len(), other.seen().len());
            let r = http()
                .post(format!("{url}/v1/completions"))
                .json(&completion(stream))
                .send()
                .await
                .unwrap();
            let status = r.status();
            let text = r.text().await.unwrap();
            assert_eq!(status, 200, "{pairing} stream {stream}: {text}");
            assert!(
                text.contains("\"other\""),
                "{pairing} stream {stream}: {text}"
            );
            assert_eq!(
                (prefill.seen().len(), lost.seen().len(), other.seen().len()),
                (before.0 + 1, before.1 + 1, before.2 + 1),
                "{pairing} stream {stream}: one prefill, the lost decode, then the other"
            );
            let room =
                |s: &Stub| s.seen().last().unwrap()["kv_transfer_params"]["kvferry_room"].clone();
            assert!(
                room(&lost).is_string(),
                "{pairing}: {:?}",
                lost.seen().last()
            );
            assert_eq!(room(&lost), room(&other), "{pairing}: the same room");
            assert_eq!(
                room(&prefill),
                room(&other),
                "{pairing}: the prefill's room"
            );
            assert_eq!(
                counter(&url, r#"kvferry_proxy_rerouted_total{role="decode"}"#).await,
                1.0,
                "{pairing}"
            );
            other.release.notify_waiters();
            let (status, _) = held.await.unwrap();
            assert_eq!(status, 200);
            assert!(
                prefill.released.lock().unwrap().is_empty(),
                "nothing released"
            );
        }
        // A request that two decode servers were lost with goes to no third: it may be what
        // kills them. The client gets the second one's error, and the room is released.
        let (third, t_url) = Stub::start("third", 0).await;
        for stub in [&lost, &other, &third] {
            stub.set(Mode::Lost);
        }
        let (_proxy, url) = proxy(&[&p_url], &[&l_url, &o_url, &t_url], "sequential");
        wait_health(&url, reqwest::StatusCode::OK).await;
        let seen = || lost.seen().len() + other.seen().len() + third.seen().len();
        let before = seen();
        let (status, got) = complete(&url).await;
        assert_eq!(status, 502, "{got}");
        assert_eq!(seen() - before, 2, "two decode servers tried, not three");
        let message = got["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("decode server "), "{message}");
        poll_until("the room released", BOUND, || async {
            (prefill.released.lock().unwrap().len() == 1).then_some(())
        })
        .await;
    });
}

/// A request that ends before a decode's answer began has its prefill server release the
/// room (`kvferry_abort`, the room the prefill computed): the client leaves while the prefill
/// computes, or while the decode holds the request; the decode answers an error. A request
/// answered keeps its room, and one the prefill refused has nothing to release. Both
/// pairings.
#[test]
fn a_room_no_decode_answered_for_is_released_at_the_prefill() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 0).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        for pairing in ["sequential", "concurrent"] {
            let (_proxy, url) = proxy(&[&p_url], &[&d_url], pairing);
            wait_health(&url, reqwest::StatusCode::OK).await;
            let released = || prefill.released.lock().unwrap().clone();
            let base = released().len();
            let room_at = |s: &Stub| s.seen().last().unwrap()["kv_transfer_params"]["kvferry_room"].clone();
            // Answered: kept.
            let (status, _) = complete(&url).await;
            assert_eq!(status, 200);
            // The prefill refuses: it computed nothing, nothing to release.
            prefill.set(Mode::Refuse);
            let (status, _) = complete(&url).await;
            assert_eq!(status, 400);
            prefill.set(Mode::Answer);
            // The decode fails it.
            decode.set(Mode::Fail);
            let (status, _) = complete(&url).await;
            assert_eq!(status, 500);
            decode.set(Mode::Answer);
            let failed = room_at(&prefill);
            poll_until("the failed request's room released", BOUND, || async {
                (released().len() == base + 1).then_some(())
            })
            .await;
            assert_eq!(released()[base], failed, "{pairing}");
            // The client leaves while the prefill, then the decode, holds the request.
            for holder in [&prefill, &decode] {
                holder.set(Mode::Hold);
                let seen = holder.seen().len();
                // In concurrent pairing the decode may hold the request before the prefill
                // has seen it: the room is read off the prefill's copy once both have.
                let at_prefill = prefill.seen().len();
                let client = tokio::spawn({
                    let url = url.clone();
                    async move { complete(&url).await }
                });
                poll_until("the request held", BOUND, || async {
                    (holder.seen().len() > seen && prefill.seen().len() > at_prefill)
                        .then_some(())
                })
                .await;
                let room = room_at(&prefill);
                let n = released().len();
                client.abort();
                let left = Instant::now();
                poll_until("the room released", BOUND, || async {
                    (released().len() > n).then_some(())
                })
                .await;
                assert_eq!(released()[n], room, "{pairing}, held at {}", holder.name);
                println!(
                    "[proxy] {pairing}: a client gone while {} held its request: the room released {:.0} ms later",
                    holder.name,
                    common::ms(left.elapsed())
                );
                holder.set(Mode::Answer);
                holder.release.notify_waiters();
            }
            assert_eq!(
                counter(&url, "kvferry_proxy_rooms_released_total").await,
                3.0,
                "{pairing}"
            );
        }
    });
}

#[test]
fn the_server_with_fewest_outstanding_requests_is_chosen() {
    runtime().block_on(async {
        let (_prefill, p_url) = Stub::start("p", 0).await;
        let (a, a_url) = Stub::start("a", 0).await;
        let (b, b_url) = Stub::start("b", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&a_url, &b_url], "sequential");
        wait_health(&url, reqwest::StatusCode::OK).await;
        a.set(Mode::Hold);
        let held = tokio::spawn({
            let url = url.clone();
            async move { complete(&url).await }
        });
        poll_until("the first request reaches a", BOUND, || async {
            (!a.seen().is_empty()).then_some(())
        })
        .await;
        // a has one outstanding: the next three go to b, one after another.
        for _ in 0..3 {
            let (_, got) = complete(&url).await;
            assert_eq!(got["server"], "b");
        }
        a.release.notify_waiters();
        let (status, got) = held.await.unwrap();
        assert_eq!((status.as_u16(), got["server"].as_str()), (200, Some("a")));
        assert_eq!((a.seen().len(), b.seen().len()), (1, 3));
    });
}

#[test]
fn an_unhealthy_server_is_routed_around_and_used_again_once_healthy() {
    runtime().block_on(async {
        let (_prefill, p_url) = Stub::start("p", 0).await;
        let (a, a_url) = Stub::start("a", 0).await;
        let (b, b_url) = Stub::start("b", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&a_url, &b_url], "concurrent");
        wait_health(&url, reqwest::StatusCode::OK).await;
        let send = || async {
            let (status, got) = complete(&url).await;
            assert_eq!(status, 200, "{got}");
            got["server"].as_str().unwrap().to_owned()
        };
        // Until the proxy's checks see a fail, requests may still go to it: once they saw it,
        // every request goes to b.
        a.healthy.store(false, Ordering::SeqCst);
        let t = Instant::now();
        poll_until("the proxy sees a fail", BOUND, || async {
            (listed(&url, "decode", &a_url).await?["healthy"] == false).then_some(())
        })
        .await;
        for _ in 0..4 {
            assert_eq!(send().await, "b");
        }
        println!("unhealthy server routed around after {:?}", t.elapsed());
        b.healthy.store(false, Ordering::SeqCst);
        wait_health(&url, reqwest::StatusCode::SERVICE_UNAVAILABLE).await;
        let (status, got) = complete(&url).await;
        assert_eq!(status, 503);
        assert_eq!(got["error"]["message"], "no healthy decode server");
        a.healthy.store(true, Ordering::SeqCst);
        wait_health(&url, reqwest::StatusCode::OK).await;
        assert_eq!(send().await, "a");
        assert_eq!(
            counter(&url, r#"kvferry_proxy_errors_total{cause="no_server"}"#).await,
            1.0
        );
    });
}

#[test]
fn a_request_a_dead_decode_refuses_goes_to_another_decode_which_the_answer_names() {
    runtime().block_on(async {
        let (_prefill, p_url) = Stub::start("p", 0).await;
        let (a, a_url) = Stub::start("a", 0).await;
        let (b, b_url) = Stub::start("b", 0).await;
        for pairing in ["sequential", "concurrent"] {
            // No health round after the first: only the refused connection can route around a.
            let (_proxy, url) = proxy_with(
                &[&p_url],
                &[&a_url, &b_url],
                pairing,
                &["--health-ms", "600000"],
            );
            wait_health(&url, reqwest::StatusCode::OK).await;
            if pairing == "sequential" {
                a.gone.notify_one();
                let addr = a_url.trim_start_matches("http://").to_owned();
                poll_until("a's port is closed", BOUND, || async {
                    tokio::net::TcpStream::connect(&addr)
                        .await
                        .is_err()
                        .then_some(())
                })
                .await;
            }
            // Ties go to the first decode, a: the first request is refused there and sent to b,
            // and later ones go to b at once.
            for _ in 0..3 {
                let (status, got) = complete(&url).await;
                assert_eq!(
                    (status.as_u16(), got["server"].as_str()),
                    (200, Some("b")),
                    "{pairing}: {got}"
                );
            }
            // The answer names the decode server that gave it: its place in --decode, not its
            // address.
            let r = http()
                .post(format!("{url}/v1/completions"))
                .json(&completion(false))
                .send()
                .await
                .expect("an answer");
            let named = r.headers().get("x-kvferry-decode");
            assert_eq!(named.and_then(|v| v.to_str().ok()), Some("2"), "{pairing}");
            assert!(a.seen().is_empty(), "{:?}", a.seen());
        }
        assert_eq!(b.seen().len(), 8);
    });
}

#[test]
fn a_request_a_server_refuses_for_its_shutdown_goes_to_another_of_its_role() {
    runtime().block_on(async {
        let (p1, p1_url) = Stub::start("p1", 1).await;
        let (p2, p2_url) = Stub::start("p2", 2).await;
        let (d1, d1_url) = Stub::start("d1", 0).await;
        let (d2, d2_url) = Stub::start("d2", 0).await;
        for pairing in ["sequential", "concurrent"] {
            // No health round after the first: only the refusals can steer requests away.
            let (_proxy, url) = proxy_with(
                &[&p1_url, &p2_url],
                &[&d1_url, &d2_url],
                pairing,
                &["--health-ms", "600000"],
            );
            wait_health(&url, reqwest::StatusCode::OK).await;
            for stub in [&p1, &p2, &d1, &d2] {
                stub.seen.lock().unwrap().clear();
            }
            let answered_by_d2 = |text: &str| text.contains("\"server\":\"d2\"");
            // A fresh proxy's first pick of each role is its first server. p1 drains: the first
            // request is refused there and paired again with p2, later ones go to p2 at once.
            p1.set(Mode::Drains);
            for stream in [false, true] {
                let (status, text) = send_text(&url, stream).await;
                assert_eq!(status, 200, "{pairing}: {text}");
                assert!(
                    !text.contains("abort") && !text.contains("error"),
                    "{pairing}: {text}"
                );
            }
            assert_eq!(p1.seen().len(), 1, "{pairing}: one request, refused");
            assert_eq!(p2.seen().len(), 2, "{pairing}");
            // d1 drains: of two requests (the decodes take turns), the one sent to d1 goes on to
            // d2 as it was, with the same room, which waits on the prefill.
            d1.set(Mode::Drains);
            let (d1_before, d2_before) = (d1.seen().len(), d2.seen().len());
            for stream in [true, false] {
                let (status, text) = send_text(&url, stream).await;
                assert_eq!(status, 200, "{pairing}: {text}");
                assert!(answered_by_d2(&text), "{pairing}: {text}");
            }
            assert_eq!(
                d1.seen().len(),
                d1_before + 1,
                "{pairing}: one request, refused"
            );
            assert_eq!(d2.seen().len(), d2_before + 2, "{pairing}");
            let room = |v: &Value| v["kv_transfer_params"]["kvferry_room"].clone();
            let refused = room(&d1.seen()[d1_before]);
            assert!(
                d2.seen()[d2_before..].iter().any(|v| room(v) == refused),
                "{pairing}"
            );
            let rerouted = |role| format!("kvferry_proxy_rerouted_total{{role=\"{role}\"}}");
            assert_eq!(counter(&url, &rerouted("prefill")).await, 1.0, "{pairing}");
            assert_eq!(counter(&url, &rerouted("decode")).await, 1.0, "{pairing}");
            p1.set(Mode::Answer);
            d1.set(Mode::Answer);
        }
    });
}

/// A completion through the proxy at `url`: its status and its body as text (streamed or not).
async fn send_text(url: &str, stream: bool) -> (reqwest::StatusCode, String) {
    let r = http()
        .post(format!("{url}/v1/completions"))
        .json(&completion(stream))
        .send()
        .await
        .expect("an answer");
    (r.status(), r.text().await.unwrap())
}

/// A registration of a stand-in server of `role` at `server` on the registry `registry`, of
/// the tiny model with head size `head_dim`, draining or not; the instance id.
async fn register(
    registry: &str,
    role: &str,
    group: u64,
    server: &str,
    head_dim: u32,
    draining: bool,
    instance: Option<&str>,
) -> String {
    let id = instance.map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
    let body = json!({
        "instance_id": id, "role": role, "dp_rank": group, "dp_size": 100, "tp_rank": 0,
        "tp_size": 1, "pp_rank": 0, "pp_size": 1,
        "layout": {"kind": "mha", "num_layers": 2, "num_kv_heads": 2, "head_dim": head_dim,
                   "dtype": "fp32", "page_size": 16},
        "slice": {"heads": {"start": 0, "end": 2}, "layers": {"start": 0, "end": 2}},
        "control_endpoint": "tcp://127.0.0.1:1", "protocol": {"min": 4, "max": 10},
        "engine": "stand-in", "model": "tiny", "server": server, "draining": draining,
    });
    let r = http()
        .post(format!("{registry}/v1/ranks"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    id
}

/// The proxy's `GET /v1/servers` entry of the server of `url` in `role`.
async fn listed(proxy: &str, role: &str, url: &str) -> Option<Value> {
    let r = http()
        .get(format!("{proxy}/v1/servers"))
        .send()
        .await
        .ok()?;
    let all: Value = r.json().await.ok()?;
    all[role]
        .as_array()?
        .iter()
        .find(|s| s["url"] == url)
        .cloned()
}

#[test]
fn servers_found_in_the_registry_are_used_while_they_pair_and_do_not_drain() {
    runtime().block_on(async {
        let logs = kvferry::cluster::log_dir("proxy").expect("log dir");
        let args = owned(&["bootstrap", "--port", "0", "--lease-ttl-ms", "600000"]);
        let registry = common::spawn(&release_binary(), &[], "registry", &args, &[], &logs);
        let registry = registry.field("url").unwrap();
        let (_p, p_url) = Stub::start("p", 5).await;
        let (d, d_url) = Stub::start("d", 0).await;
        let (odd, odd_url) = Stub::start("odd", 0).await;
        let (_late, late_url) = Stub::start("late", 0).await;
        register(&registry, "prefill", 5, &p_url, 64, false, None).await;
        let d_id = register(&registry, "decode", 0, &d_url, 64, false, None).await;
        // A decode whose KV cannot pair with the prefill's: told so at registration.
        let id = uuid::Uuid::new_v4().to_string();
        let admitted = http()
            .post(format!("{registry}/v1/ranks"))
            .json(&json!({
                "instance_id": id, "role": "decode", "dp_rank": 0, "dp_size": 1, "tp_rank": 0,
                "tp_size": 1, "pp_rank": 0, "pp_size": 1,
                "layout": {"kind": "mha", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
                           "dtype": "fp32", "page_size": 16},
                "slice": {"heads": {"start": 0, "end": 2}, "layers": {"start": 0, "end": 2}},
                "control_endpoint": "tcp://127.0.0.1:1", "model": "tiny", "server": odd_url,
            }))
            .send()
            .await
            .unwrap();
        let admitted: Value = admitted.json().await.unwrap();
        assert_eq!(
            admitted["unmatched"],
            "this decode can exchange KV with none of the 1 prefill ranks registered: KV \
             head_dim differs: prefill 64, decode 32"
        );
        for pairing in ["sequential", "concurrent"] {
            let (_proxy, url) = proxy_found(&registry, pairing);
            wait_health(&url, reqwest::StatusCode::OK).await;
            let found = listed(&url, "prefill", &p_url)
                .await
                .expect("the prefill is found");
            assert_eq!(
                (found["discovered"].as_bool(), found["engine"].as_str()),
                (Some(true), Some("stand-in"))
            );
            for _ in 0..4 {
                let (status, got) = complete(&url).await;
                assert_eq!(
                    (status.as_u16(), got["server"].as_str()),
                    (200, Some("d")),
                    "{pairing}: {got}"
                );
            }
            assert!(
                odd.seen().is_empty(),
                "{pairing}: the odd decode got a request"
            );
            // A server started now is found at the next round and gets requests.
            let late_id = register(&registry, "decode", 0, &late_url, 64, false, None).await;
            poll_until("the late decode is usable", BOUND, || async {
                listed(&url, "decode", &late_url).await?["usable"]
                    .as_bool()?
                    .then_some(())
            })
            .await;
            // d drains: from the next round on, every request goes to the late decode.
            register(&registry, "decode", 0, &d_url, 64, true, Some(&d_id)).await;
            poll_until("d drains", BOUND, || async {
                listed(&url, "decode", &d_url).await?["draining"]
                    .as_bool()?
                    .then_some(())
            })
            .await;
            let before = d.seen().len();
            for _ in 0..3 {
                let (status, got) = complete(&url).await;
                assert_eq!(
                    (status.as_u16(), got["server"].as_str()),
                    (200, Some("late")),
                    "{pairing}"
                );
            }
            assert_eq!(
                d.seen().len(),
                before,
                "{pairing}: a request went to the draining decode"
            );
            // Gone from the registry, a found server leaves the proxy.
            let gone = http()
                .delete(format!("{registry}/v1/ranks/{late_id}"))
                .send()
                .await
                .unwrap();
            assert!(gone.status().is_success());
            poll_until("the late decode leaves", BOUND, || async {
                listed(&url, "decode", &late_url)
                    .await
                    .is_none()
                    .then_some(())
            })
            .await;
            // Only d is left, draining: no decode can take a request.
            let (status, got) = complete(&url).await;
            assert_eq!(status, 503, "{pairing}: {got}");
            register(&registry, "decode", 0, &d_url, 64, false, Some(&d_id)).await;
            poll_until("d is back", BOUND, || async {
                listed(&url, "decode", &d_url).await?["usable"]
                    .as_bool()?
                    .then_some(())
            })
            .await;
        }
    });
}

#[test]
fn every_failure_is_an_openai_error_object() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 0).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "concurrent");
        wait_health(&url, reqwest::StatusCode::OK).await;
        let endpoint = format!("{url}/v1/completions");
        for (body, what) in [
            ("{not json", "is not JSON"),
            ("[1, 2]", "must be a JSON object"),
        ] {
            let (status, got) = call_raw(&http(), Method::POST, &endpoint, body).await;
            assert_eq!(status, 400, "{got}");
            assert_eq!(got["error"]["type"], "invalid_request_error");
            assert!(
                got["error"]["message"].as_str().unwrap().contains(what),
                "{got}"
            );
        }
        // A prefill that refuses: its answer goes to the client as it is, and the decode's
        // request, waiting for a room that will never come, is dropped.
        let got = one_side_refuses(&url, &prefill, &decode).await;
        assert_eq!(got["error"]["message"], "prompt too long");
        // A decode that refuses while the prefill computes: its answer goes to the client
        // without waiting for the prefill, whose request is dropped (vLLM aborts it and its
        // room).
        one_side_refuses(&url, &decode, &prefill).await;
        // A decode that fails the request: vLLM's message, with the room and why it failed
        // (the proxy asks the decode server with `kvferry_reason_of`).
        prefill.set(Mode::Answer);
        decode.set(Mode::Fail);
        let (status, got) = complete(&url).await;
        assert_eq!(status, 500);
        let room = decode.seen().last().unwrap()["kv_transfer_params"]["kvferry_room"]
            .as_str()
            .unwrap()
            .to_owned();
        let message = got["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("Internal server error (decode server 1 of 1, "),
            "{message}"
        );
        assert!(
            message.contains(&format!(
                "kvferry room {room} failed: peer_dead: the prefill went away"
            )),
            "{message}"
        );
        // A decode that cannot be reached at all.
        let (_p2, url2) = proxy(
            &[&p_url],
            &[&format!("http://127.0.0.1:{}", common::closed_port())],
            "sequential",
        );
        let (status, got) = complete(&url2).await;
        assert_eq!(status, 503, "never healthy, so never used: {got}");
        for (series, want) in [
            (r#"kvferry_proxy_errors_total{cause="bad_request"}"#, 2.0),
            (r#"kvferry_proxy_errors_total{cause="prefill"}"#, 1.0),
            (r#"kvferry_proxy_errors_total{cause="decode"}"#, 2.0),
            (
                r#"kvferry_proxy_requests_total{endpoint="completions",outcome="error"}"#,
                5.0,
            ),
        ] {
            assert_eq!(counter(&url, series).await, want, "{series}");
        }
    });
}

#[test]
fn a_request_right_after_the_listening_line_is_served() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 2).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        // Health checks that take a while: the proxy's listening line comes after its first
        // round (and the prefill's kvferry_identify), so the request that follows it at once is
        // routed.
        for s in [&prefill, &decode] {
            s.health_ms.store(300, Ordering::SeqCst);
        }
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "concurrent");
        let (status, got) = complete(&url).await;
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["server"], "d");
    });
}

/// A request to `path` of the proxy at `url` (a POST of `body`, or a GET without one) with these
/// `Authorization` and `X-Request-Id` headers.
async fn send_as(
    url: &str,
    path: &str,
    body: Option<Value>,
    auth: Option<&str>,
    id: Option<&str>,
) -> reqwest::Response {
    let mut request = match body {
        Some(b) => http().post(format!("{url}{path}")).json(&b),
        None => http().get(format!("{url}{path}")),
    };
    if let Some(auth) = auth {
        request = request.header("authorization", auth);
    }
    if let Some(id) = id {
        request = request.header("x-request-id", id);
    }
    request.send().await.expect("an answer")
}

/// A client sending `auth` and `X-Request-Id: req-42` through the proxy at `url`: its headers
/// go on to both servers with its completion; when the decode fails, the proxy asks it why
/// (`kvferry_reason_of`) with the client's Authorization (not its X-Request-Id: vLLM would take
/// it for the question's id); `/v1/models` is the decode's, asked with the client's headers.
/// The decode answers before and after.
async fn client_headers_go_on(url: &str, prefill: &Stub, decode: &Stub, auth: &str) {
    let client = (Some(auth.to_owned()), Some("req-42".to_owned()));
    let send = |path: &'static str, body: Option<Value>| {
        send_as(url, path, body, Some(auth), Some("req-42"))
    };
    decode.set(Mode::Answer);
    let r = send("/v1/completions", Some(completion(false))).await;
    assert_eq!(r.status(), 200);
    for s in [prefill, decode] {
        assert_eq!(
            s.headers_of("completion"),
            vec![client.clone()],
            "{}",
            s.name
        );
    }
    decode.set(Mode::Fail);
    let r = send("/v1/chat/completions", Some(completion(false))).await;
    assert_eq!(r.status(), 500);
    assert_eq!(decode.headers_of("completion")[1], client);
    assert_eq!(
        decode.headers_of("reason_of"),
        vec![(client.0.clone(), None)]
    );
    decode.set(Mode::Answer);
    let r = send("/v1/models", None).await;
    assert_eq!(r.status(), 200);
    let models: Value = r.json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "tiny", "{models}");
    assert_eq!(models["server"], "d", "{models}");
    assert_eq!(decode.headers_of("models"), vec![client]);
}

/// Without `--api-key` the proxy checks no key: a client's `Authorization` and `X-Request-Id` go
/// on as they are with its request, and with the question the proxy asks a decode server about
/// the request's failure (`kvferry_reason_of`); the proxy's own calls (health checks,
/// `kvferry_identify`) carry none.
#[test]
fn without_an_api_key_client_headers_go_on_as_they_are() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 2).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "concurrent");
        client_headers_go_on(&url, &prefill, &decode, "Bearer sk-client").await;
        for s in [&prefill, &decode] {
            let health = s.headers_of("health");
            assert!(
                !health.is_empty() && health.iter().all(|h| *h == (None, None)),
                "{health:?}"
            );
        }
        assert_eq!(prefill.headers_of("identify"), vec![(None, None)]);
    });
}

/// With `--api-key`, a client must present the key (`Authorization: Bearer KEY`) on every API
/// route. Without it, with another key or in another form, the proxy answers 401 (an OpenAI error
/// object) and no server hears of the request: not the request itself, nor any call of the
/// proxy's with its key that the request could cause (its health checks and `kvferry_identify`
/// come of its own rounds only). `/health` and `/metrics` stay open. A client with the key is
/// served, its headers going on with its request and with the proxy's question about its failure.
#[test]
fn with_an_api_key_only_clients_that_present_it_reach_the_servers() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 2).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        // A failing decode: a request that reached it would make the proxy ask it why.
        decode.set(Mode::Fail);
        // One round of health checks, before the listening line: any later call to a server is
        // a client's request's doing.
        let (_proxy, url) = proxy_with(
            &[&p_url],
            &[&d_url],
            "concurrent",
            &["--api-key", "sk-proxy", "--health-ms", "600000"],
        );
        let own = (Some("Bearer sk-proxy".to_owned()), None);
        for s in [&prefill, &decode] {
            assert_eq!(s.headers_of("health"), vec![own.clone()], "{}", s.name);
        }
        assert_eq!(prefill.headers_of("identify"), vec![own.clone()]);
        let heard = |s: &Stub| s.headers.lock().unwrap().clone();
        let before = (heard(&prefill), heard(&decode));
        let calls = [
            ("/v1/completions", Some(completion(false))),
            ("/v1/chat/completions", Some(completion(false))),
            ("/v1/models", None),
        ];
        for auth in [
            None,
            Some("Bearer sk-wrong"),
            Some("Bearer sk-prox"),
            Some("Bearer sk-proxyy"),
            Some("Bearer"),
            Some("sk-proxy"),
            Some("Basic c2stcHJveHk6"),
        ] {
            for (path, body) in &calls {
                let r = send_as(&url, path, body.clone(), auth, Some("req-7")).await;
                assert_eq!(r.status(), 401, "{path} {auth:?}");
                let challenge = r.headers().get("www-authenticate");
                assert_eq!(
                    challenge.and_then(|v| v.to_str().ok()),
                    Some("Bearer"),
                    "{path} {auth:?}"
                );
                let got: Value = r.json().await.unwrap();
                assert_eq!(got["error"]["type"], "authentication_error", "{got}");
                assert_eq!(got["error"]["code"], 401, "{got}");
                assert_eq!(got["error"]["param"], Value::Null, "{got}");
                assert!(got["error"]["message"].is_string(), "{got}");
            }
        }
        // The key is checked before the body is read.
        let endpoint = format!("{url}/v1/completions");
        let (status, got) = call_raw(&http(), Method::POST, &endpoint, "{not json").await;
        assert_eq!(status, 401, "{got}");
        for path in ["/health", "/metrics"] {
            let r = http().get(format!("{url}{path}")).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path}");
        }
        assert_eq!(
            (heard(&prefill), heard(&decode)),
            before,
            "a server heard of a request that did not present the key"
        );
        // With the key: the request goes on with the client's headers (its X-Request-Id tells
        // them from the proxy's own), and the question about its failure with its
        // Authorization.
        client_headers_go_on(&url, &prefill, &decode, "Bearer sk-proxy").await;
        // No request made the proxy check the prefill's health or ask for its groups; the
        // decode's errors before any token had it check the decode's health (was it lost?),
        // with its own key.
        assert_eq!(prefill.headers_of("health"), vec![own.clone()]);
        assert_eq!(prefill.headers_of("identify"), vec![own.clone()]);
        let checks = decode.headers_of("health");
        assert!(
            checks.len() > 1 && checks.iter().all(|h| *h == own),
            "{checks:?}"
        );
    });
}

/// Where `text` names an internal server: `127.0.0.1`, or the port of one of `urls` as a number
/// of its own (a room's digits may hold the same digits).
fn leak(text: &str, urls: &[&str]) -> Option<String> {
    if text.contains("127.0.0.1") {
        return Some("127.0.0.1".to_owned());
    }
    let digit = |b: Option<&u8>| b.is_some_and(u8::is_ascii_digit);
    for url in urls {
        let port = url.rsplit(':').next().expect("a port");
        for (at, _) in text.match_indices(port) {
            let bytes = text.as_bytes();
            let before = at.checked_sub(1).and_then(|i| bytes.get(i));
            if !digit(before) && !digit(bytes.get(at + port.len())) {
                return Some(format!("port {port}"));
            }
        }
    }
    None
}

/// Waits until the server at `url` no longer accepts connections.
async fn closed(url: &str) {
    let addr = url.trim_start_matches("http://").to_owned();
    poll_until(&format!("{url} is closed"), BOUND, || async {
        tokio::net::TcpStream::connect(&addr)
            .await
            .is_err()
            .then_some(())
    })
    .await;
}

/// Waits until the log at `path` holds `what`.
async fn logged(path: &std::path::Path, what: &str) {
    poll_until(
        &format!("{} logs {what:?}", path.display()),
        BOUND,
        || async {
            let log = std::fs::read_to_string(path).unwrap_or_default();
            log.contains(what).then_some(())
        },
    )
    .await;
}

/// What a client reads of a failure names the server's role and place (`decode server 1 of
/// 1`), the kvferry room and kvferry's reason code and message, but no internal address, not
/// even one in a server's own message; the proxy's log keeps the addresses. Every kind of
/// failure: a decode that fails a request, the same as an error event in a stream, a stream that
/// breaks, a prefill that refuses, a prefill that cannot be reached (in both pairings), a decode
/// that cannot be reached.
#[test]
fn answers_to_clients_name_no_internal_address_yet_keep_kvferrys_reason() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 0).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let urls = [p_url.as_str(), d_url.as_str()];
        let p_addr = p_url.trim_start_matches("http://").to_owned();
        // kvferry's reason names the prefill's agent by its address, as a real one may.
        let said = format!("peer_dead: prefill tcp://{p_addr} reported the room lost");
        *decode.reason.lock().unwrap() = said.clone();
        let reason = "peer_dead: prefill <address> reported the room lost";
        *prefill.refusal.lock().unwrap() = format!("prompt too long for the pool at {p_addr}");
        // No health round after the first: a dead server is still used.
        let long = ["--health-ms", "600000"];
        let (concurrent, c_url) = proxy_with(&[&p_url], &[&d_url], "concurrent", &long);
        let (_sequential, s_url) = proxy_with(&[&p_url], &[&d_url], "sequential", &long);
        let post = |url: &str, stream: bool| {
            let url = url.to_owned();
            async move {
                send_as(
                    &url,
                    "/v1/completions",
                    Some(completion(stream)),
                    None,
                    None,
                )
                .await
            }
        };
        let last_room = || {
            let seen = decode.seen();
            let room =
                &seen.last().expect("a decode request")["kv_transfer_params"]["kvferry_room"];
            room.as_str().expect("a room").to_owned()
        };
        let error_of = |text: &str| -> String {
            let got: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
            got["error"]["message"]
                .as_str()
                .unwrap_or_else(|| panic!("{text}"))
                .to_owned()
        };

        // A decode that fails the request.
        decode.set(Mode::Fail);
        let r = post(&c_url, false).await;
        assert_eq!(r.status(), 500);
        let text = r.text().await.unwrap();
        assert_eq!(leak(&text, &urls), None, "{text}");
        assert_eq!(
            error_of(&text),
            format!(
                "Internal server error (decode server 1 of 1, kvferry room {} failed: {reason})",
                last_room()
            )
        );
        // The log keeps what the answer leaves out.
        logged(&concurrent.log, &said).await;
        logged(&concurrent.log, &d_url).await;

        // The same failure as an error event in a stream; no header names an address either.
        decode.set(Mode::FailMidStream);
        let r = post(&c_url, true).await;
        assert_eq!(r.status(), 200);
        let named = r.headers().get("x-kvferry-decode");
        assert_eq!(named.and_then(|v| v.to_str().ok()), Some("1"));
        for (name, value) in r.headers() {
            let value = String::from_utf8_lossy(value.as_bytes());
            assert_eq!(leak(&value, &urls), None, "{name}: {value}");
        }
        let text = r.text().await.unwrap();
        assert_eq!(leak(&text, &urls), None, "{text}");
        let room = last_room();
        assert!(
            text.contains(&format!(
                "(decode server 1 of 1, kvferry room {room} failed: {reason})"
            )),
            "{text}"
        );

        // A stream that breaks.
        decode.set(Mode::Break);
        let answer = tokio::spawn(post(&c_url, true));
        let seen = decode.seen().len();
        poll_until("the streamed request reaches the decode", BOUND, || async {
            (decode.seen().len() > seen).then_some(())
        })
        .await;
        // Its first chunk is on its way; then the connection breaks.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        decode.release.notify_one();
        let text = answer.await.unwrap().text().await.unwrap();
        assert_eq!(leak(&text, &urls), None, "{text}");
        assert!(
            text.contains("\"decode server 1 of 1 failed mid-answer: "),
            "{text}"
        );

        // A prefill that refuses, its message naming its address.
        decode.set(Mode::Answer);
        prefill.set(Mode::Refuse);
        let r = post(&s_url, false).await;
        assert_eq!(r.status(), 400);
        let text = r.text().await.unwrap();
        assert_eq!(leak(&text, &urls), None, "{text}");
        assert_eq!(error_of(&text), "prompt too long for the pool at <address>");

        // A prefill that cannot be reached: in sequential pairing the client gets 502 naming it.
        prefill.set(Mode::Answer);
        prefill.gone.notify_one();
        closed(&p_url).await;
        let r = post(&s_url, false).await;
        assert_eq!(r.status(), 502);
        let text = r.text().await.unwrap();
        assert_eq!(leak(&text, &urls), None, "{text}");
        assert!(
            error_of(&text).starts_with("prefill server 1 of 1: "),
            "{text}"
        );
        // In concurrent pairing too: the request never reached the prefill, no other prefill can
        // take it, and the client gets the refusal, naming the prefill by its place.
        let r = post(&c_url, false).await;
        assert_eq!(r.status(), 502);
        let text = r.text().await.unwrap();
        assert_eq!(leak(&text, &urls), None, "{text}");
        assert!(
            error_of(&text).starts_with("prefill server 1 of 1: "),
            "{text}"
        );

        // A decode that cannot be reached (/v1/models: no other server answers it).
        decode.gone.notify_one();
        closed(&d_url).await;
        let r = send_as(&c_url, "/v1/models", None, None, None).await;
        assert_eq!(r.status(), 502);
        let text = r.text().await.unwrap();
        assert_eq!(leak(&text, &urls), None, "{text}");
        assert!(
            error_of(&text).starts_with("decode server 1 of 1: "),
            "{text}"
        );
    });
}

#[test]
fn n_above_one_is_refused_and_min_tokens_stays_off_the_prefill() {
    runtime().block_on(async {
        let (prefill, p_url) = Stub::start("p", 2).await;
        let (decode, d_url) = Stub::start("d", 0).await;
        let (_proxy, url) = proxy(&[&p_url], &[&d_url], "sequential");
        let post = |body: Value| {
            let url = format!("{url}/v1/completions");
            async move { call(&http(), Method::POST, &url, Some(&body)).await }
        };
        let mut body = completion(false);
        body["n"] = json!(2);
        let (status, got) = post(body).await;
        assert_eq!(status, 400, "{got}");
        let message = got["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("n = 2"), "{got}");
        assert!(prefill.seen().is_empty() && decode.seen().is_empty());
        let mut body = completion(false);
        body["n"] = json!(1);
        body["min_tokens"] = json!(4);
        let (status, got) = post(body).await;
        assert_eq!(status, 200, "{got}");
        let first = &prefill.seen()[0];
        assert!(first.get("min_tokens").is_none(), "{first}");
        assert_eq!(first["max_tokens"], 1);
        assert_eq!(decode.seen()[0]["min_tokens"], 4);
    });
}
