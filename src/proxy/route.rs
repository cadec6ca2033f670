//! Routing one request: the prefill and decode servers picked, the prefill's request, the
//! decode's answer passed through.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{Map, Value, json};

use super::backends::{Backends, Lease};
use super::metrics::{Cause, Endpoint, Outcome, ProxyMetrics};

/// How a request is paired with its room (docs/vllm.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Pairing {
    /// The proxy names the room and the prefill's group; both requests go at once.
    Concurrent,
    /// The prefill answers first; its `kv_transfer_params` go into the decode request.
    Sequential,
}

/// The proxy's state.
pub struct Proxy {
    /// The prefill servers (`--prefill`).
    pub prefills: Arc<Backends>,
    /// The decode servers (`--decode`).
    pub decodes: Arc<Backends>,
    /// How requests are paired with rooms.
    pub pairing: Pairing,
    /// The client every upstream request goes through.
    pub http: reqwest::Client,
    /// What `/metrics` exposes.
    pub metrics: ProxyMetrics,
}

/// The proxy's routes.
pub fn router(proxy: Arc<Proxy>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(proxy)
}

async fn completions(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: Bytes) -> Response {
    let forwarded = Forwarded::of(&headers);
    p.route(Endpoint::Completions, "/v1/completions", forwarded, body)
        .await
}

async fn chat_completions(
    State(p): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let forwarded = Forwarded::of(&headers);
    p.route(
        Endpoint::ChatCompletions,
        "/v1/chat/completions",
        forwarded,
        body,
    )
    .await
}

/// A decode server's `/v1/models`, asked with the client's headers.
async fn models(State(p): State<Arc<Proxy>>, headers: HeaderMap) -> Response {
    let Some(decode) = p.decodes.pick() else {
        return unavailable("decode").response;
    };
    let url = format!("{}/v1/models", decode.backend().url);
    let asked = Forwarded::of(&headers).onto(p.http.get(&url)).send().await;
    match asked {
        Ok(r) => {
            let status = r.status();
            match r.bytes().await {
                Ok(bytes) => copy_answer(status, bytes),
                Err(e) => unreachable(Cause::Decode, &url, causes(&e)).response,
            }
        }
        Err(e) => unreachable(Cause::Decode, &url, causes(&e)).response,
    }
}

/// The client's headers that go on to the servers with its request: `Authorization` (servers
/// started with `--api-key` check it) and `X-Request-Id`.
#[derive(Clone, Default)]
struct Forwarded(Vec<(header::HeaderName, HeaderValue)>);

impl Forwarded {
    const NAMES: [header::HeaderName; 2] = [
        header::AUTHORIZATION,
        header::HeaderName::from_static("x-request-id"),
    ];

    fn of(headers: &HeaderMap) -> Self {
        Forwarded(
            Self::NAMES
                .iter()
                .filter_map(|n| Some((n.clone(), headers.get(n)?.clone())))
                .collect(),
        )
    }

    fn onto(&self, mut request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        for (name, value) in &self.0 {
            request = request.header(name.as_str(), value.as_bytes());
        }
        request
    }

    /// These headers, and vLLM's `X-data-parallel-rank` naming `dp` if given.
    fn to_rank(&self, dp: Option<usize>) -> Forwarded {
        let mut headers = self.0.clone();
        if let Some(dp) = dp {
            let name = header::HeaderName::from_static(super::backends::DP_RANK_HEADER);
            headers.push((name, HeaderValue::from(dp)));
        }
        Forwarded(headers)
    }
}

/// Fields of a client's request that the prefill's one-token copy must not get: vLLM refuses
/// `min_tokens` above `max_tokens`.
const NOT_FOR_THE_PREFILL: [&str; 1] = ["min_tokens"];

/// 200 while at least one prefill and one decode server are usable.
async fn health(State(p): State<Arc<Proxy>>) -> Response {
    match (p.prefills.any_usable(), p.decodes.any_usable()) {
        (true, true) => StatusCode::OK.into_response(),
        (false, _) => unavailable("prefill").response,
        (_, false) => unavailable("decode").response,
    }
}

async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    let mut r = p.metrics.encode().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(kvferry_bootstrap::http::OPENMETRICS_CONTENT_TYPE),
    );
    r
}

/// A request that ends with an error: why, and what the client gets.
struct Failure {
    cause: Cause,
    response: Response,
}

/// An OpenAI error object.
fn error(status: StatusCode, kind: &str, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

fn bad(message: String) -> Failure {
    Failure {
        cause: Cause::BadRequest,
        response: error(StatusCode::BAD_REQUEST, "invalid_request_error", message),
    }
}

fn unavailable(role: &str) -> Failure {
    Failure {
        cause: Cause::NoServer,
        response: error(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("no healthy {role} server"),
        ),
    }
}

fn unreachable(cause: Cause, url: &str, message: impl std::fmt::Display) -> Failure {
    Failure {
        cause,
        response: error(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("{url}: {message}"),
        ),
    }
}

/// An error and its sources, `: `-separated (reqwest's own message leaves out why a request
/// failed: "connection closed before message completed" is a source).
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text += &format!(": {s}");
        source = s.source();
    }
    text
}

/// How a request to a server (a prefill's, or a question to a decode) ended.
enum Posted {
    /// Its answer (HTTP 2xx).
    Answered(Value),
    /// It answered an error: a prefill's is passed to the client as it is.
    Refused(Failure),
    /// It could not be reached, or its connection broke.
    Lost(String),
}

/// A spawned task aborted when this is dropped (the client went away).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Proxy {
    async fn route(
        self: Arc<Self>,
        endpoint: Endpoint,
        path: &'static str,
        forwarded: Forwarded,
        body: Bytes,
    ) -> Response {
        let started = Instant::now();
        match self
            .clone()
            .dispatch(endpoint, path, &forwarded, &body, started)
            .await
        {
            Ok((response, None)) => {
                self.metrics.request(endpoint, Outcome::Answered, None);
                response
            }
            Ok((response, Some(cause))) | Err(Failure { cause, response }) => {
                self.metrics.request(endpoint, Outcome::Error, Some(cause));
                self.metrics.duration(started.elapsed().as_secs_f64());
                response
            }
        }
    }

    /// The decode's answer, and the cause when it is an error.
    async fn dispatch(
        self: Arc<Self>,
        endpoint: Endpoint,
        path: &'static str,
        forwarded: &Forwarded,
        body: &[u8],
        started: Instant,
    ) -> Result<(Response, Option<Cause>), Failure> {
        let mut request: Map<String, Value> = match serde_json::from_slice(body) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(bad("the request body must be a JSON object".into())),
            Err(e) => return Err(bad(format!("the request body is not JSON: {e}"))),
        };
        if let Some(n) = request.get("n").filter(|n| **n != json!(1) && !n.is_null()) {
            return Err(bad(format!(
                "n = {n} is not supported: each choice would need a prefill of its own; send \
                 one request per choice"
            )));
        }
        let prefill = self.prefills.pick().ok_or_else(|| unavailable("prefill"))?;
        let mut decode = self.decodes.pick().ok_or_else(|| unavailable("decode"))?;
        let mut first = request.clone();
        first.insert("max_tokens".into(), json!(1));
        if endpoint == Endpoint::ChatCompletions {
            first.insert("max_completion_tokens".into(), json!(1));
        }
        first.insert("stream".into(), json!(false));
        first.remove("stream_options");
        for field in NOT_FOR_THE_PREFILL {
            first.remove(field);
        }
        let prefill_url = format!("{}{path}", prefill.backend().url);
        let model = request.get("model").cloned().unwrap_or(Value::Null);
        let (answer, room, note) = match self.pairing {
            Pairing::Sequential => {
                first.insert(
                    "kv_transfer_params".into(),
                    json!({"do_remote_decode": true}),
                );
                let answer = match self.post(&prefill_url, &first, forwarded).await {
                    Posted::Answered(answer) => answer,
                    Posted::Refused(f) => return Err(f),
                    Posted::Lost(e) => {
                        return Err(unreachable(Cause::Prefill, &prefill_url, e));
                    }
                };
                drop(prefill);
                let params = answer
                    .get("kv_transfer_params")
                    .cloned()
                    .filter(Value::is_object)
                    .ok_or_else(|| {
                        unreachable(
                            Cause::Prefill,
                            &prefill_url,
                            "its answer has no kv_transfer_params: is it running KvferryConnector as kv_producer?",
                        )
                    })?;
                let room = params.get("kvferry_room").cloned().unwrap_or(Value::Null);
                request.insert("kv_transfer_params".into(), params);
                let answer;
                (answer, decode) = self
                    .clone()
                    .send_decode(path, request, forwarded.clone(), decode)
                    .await;
                (answer, room, None)
            }
            Pairing::Concurrent => {
                let room = fresh_room()
                    .map_err(|e| {
                        unreachable(Cause::NoServer, "the proxy", format!("no randomness: {e}"))
                    })?
                    .to_string();
                // The prefill's engine: a data-parallel rank of the server, in turn.
                let rank = prefill
                    .backend()
                    .next_rank()
                    .ok_or_else(|| unavailable("prefill"))?;
                let group = rank.group;
                first.insert(
                    "kv_transfer_params".into(),
                    json!({"do_remote_decode": true, "kvferry_room": room}),
                );
                request.insert(
                    "kv_transfer_params".into(),
                    json!({"do_remote_prefill": true, "kvferry_room": room, "kvferry_dp_rank": group}),
                );
                // The decode allocates and waits for the room while the prefill computes it.
                let decode_url = format!("{}{path}", decode.backend().url);
                let send = self
                    .clone()
                    .send_decode(path, request, forwarded.clone(), decode);
                let mut decoding = AbortOnDrop(tokio::spawn(send));
                let to_prefill = forwarded.to_rank(rank.dp);
                let prefill_post = self.post(&prefill_url, &first, &to_prefill);
                tokio::pin!(prefill_post);
                let mut decoded = None;
                let note = loop {
                    tokio::select! {
                        posted = &mut prefill_post => break match posted {
                            Posted::Answered(_) => None,
                            // Its room will never come: the decode request is dropped (vLLM
                            // aborts it and its room) and the client gets the prefill's answer.
                            Posted::Refused(f) => return Err(f),
                            // Whether the room's KV still arrives is the decode's to find out;
                            // its kv_load_failure_policy decides the answer.
                            Posted::Lost(e) => {
                                tracing::warn!(url = %prefill_url, room, error = %e, "prefill request lost");
                                Some(format!("the prefill server {prefill_url} failed this request: {e}"))
                            }
                        },
                        joined = &mut decoding.0, if decoded.is_none() => {
                            let answer = joined.map_err(|e| unreachable(Cause::Decode, &decode_url, e))?;
                            let refused = answer.0.as_ref().map_or(true, |r| !r.status().is_success());
                            decoded = Some(answer);
                            if refused {
                                // The decode will not take the room: the prefill's request is
                                // dropped (vLLM aborts it and its room).
                                break None;
                            }
                        }
                    }
                };
                drop(prefill);
                let answer;
                (answer, decode) = match decoded {
                    Some(answer) => answer,
                    None => (&mut decoding.0)
                        .await
                        .map_err(|e| unreachable(Cause::Decode, &decode_url, e))?,
                };
                (answer, Value::String(room), note)
            }
        };
        let decode_url = format!("{}{path}", decode.backend().url);
        let answer = answer.map_err(|e| unreachable(Cause::Decode, &decode_url, causes(&e)))?;
        let failed = Failed { model, room, note };
        if !answer.status().is_success() {
            let base = decode.backend().url.clone();
            let response = self.decode_error(answer, &base, &failed).await;
            return Ok((response, Some(Cause::Decode)));
        }
        Ok((self.pass_through(answer, decode, started, failed), None))
    }

    /// The decode's request sent to `decode`, or to another decode server when `decode` refused
    /// the connection (the request never reached it: it is routed around until a health round
    /// finds it back); the answer and the server that gave it.
    async fn send_decode(
        self: Arc<Self>,
        path: &'static str,
        request: Map<String, Value>,
        forwarded: Forwarded,
        mut decode: Lease,
    ) -> (reqwest::Result<reqwest::Response>, Lease) {
        let mut tries = self.decodes.all().len();
        loop {
            let url = format!("{}{path}", decode.backend().url);
            let sent = forwarded
                .onto(self.http.post(&url))
                .json(&request)
                .send()
                .await;
            tries -= 1;
            match sent {
                Err(e) if e.is_connect() && tries > 0 => {
                    self.decodes.route_around(&decode, &e);
                    match self.decodes.pick() {
                        Some(other) => decode = other,
                        None => return (Err(e), decode),
                    }
                }
                sent => return (sent, decode),
            }
        }
    }

    /// A POST of `body` to `url` with the client's headers (or the proxy's own key, for a
    /// question of the proxy's).
    async fn post(&self, url: &str, body: &impl serde::Serialize, forwarded: &Forwarded) -> Posted {
        let r = match forwarded.onto(self.http.post(url)).json(body).send().await {
            Ok(r) => r,
            Err(e) => return Posted::Lost(causes(&e)),
        };
        let status = r.status();
        match r.bytes().await {
            Ok(bytes) if status.is_success() => match serde_json::from_slice(&bytes) {
                Ok(answer) => Posted::Answered(answer),
                Err(e) => Posted::Lost(format!("its answer is not JSON: {e}")),
            },
            Ok(bytes) => Posted::Refused(Failure {
                cause: Cause::Prefill,
                response: copy_answer(status, bytes),
            }),
            Err(e) => Posted::Lost(causes(&e)),
        }
    }

    /// The decode's error answer, its message extended with the decode server, the kvferry
    /// room, why the room failed (asked with `kvferry_reason_of`: vLLM's own message for a
    /// failed KV load is a bare "Internal server error") and what the proxy saw of the
    /// prefill's side.
    async fn decode_error(
        &self,
        answer: reqwest::Response,
        base: &str,
        failed: &Failed,
    ) -> Response {
        let status = answer.status();
        let bytes = answer.bytes().await.unwrap_or_default();
        let mut body: Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
            json!({"error": {"message": String::from_utf8_lossy(&bytes), "type": "upstream_error",
                             "param": null, "code": status.as_u16()}})
        });
        if let Some(Value::String(message)) = body.pointer_mut("/error/message") {
            *message = format!("{message} ({})", self.context(base, failed).await);
        }
        copy_answer(status, Bytes::from(body.to_string()))
    }

    /// What the proxy can say about a decode's failure: the decode server, the kvferry room
    /// and why it failed there (`kvferry_reason_of`), and the note on the prefill's side.
    async fn context(&self, base: &str, failed: &Failed) -> String {
        let mut context = format!("decode server {base}");
        if let Some(room) = failed.room.as_str() {
            context += &format!(", kvferry room {room}");
            let ask = json!({"model": failed.model, "prompt": [1], "max_tokens": 1,
                             "kv_transfer_params": {"kvferry_reason_of": room}});
            let url = format!("{base}/v1/completions");
            if let Posted::Answered(a) = self.post(&url, &ask, &self.own()).await
                && let Some(reason) = a
                    .pointer("/kv_transfer_params/kvferry_reason")
                    .and_then(Value::as_str)
            {
                context += &format!(" failed: {reason}");
            }
        }
        if let Some(note) = &failed.note {
            context += &format!("; {note}");
        }
        context
    }

    /// A chunk of a decode's event stream with each error event's message extended as
    /// [`Proxy::context`] says (vLLM ends a stream whose KV load failed with a bare "Internal
    /// server error" event); other chunks as they are.
    async fn explain_errors(&self, chunk: Bytes, base: &str, failed: &Failed) -> Bytes {
        if !chunk.windows(8).any(|w| w == b"\"error\":") {
            return chunk;
        }
        let text = String::from_utf8_lossy(&chunk).into_owned();
        let mut out = String::with_capacity(text.len());
        for line in text.split_inclusive('\n') {
            let event = line
                .strip_prefix("data: ")
                .and_then(|data| serde_json::from_str::<Value>(data.trim_end()).ok());
            match event {
                Some(mut event)
                    if event
                        .pointer("/error/message")
                        .is_some_and(Value::is_string) =>
                {
                    let context = self.context(base, failed).await;
                    if let Some(Value::String(message)) = event.pointer_mut("/error/message") {
                        *message = format!("{message} ({context})");
                    }
                    let end = &line[line.trim_end().len()..];
                    out += &format!("data: {event}{end}");
                }
                _ => out += line,
            }
        }
        Bytes::from(out)
    }

    /// The headers of the proxy's own calls (`kvferry_reason_of` questions): its `--api-key`,
    /// which a client's request never carries.
    fn own(&self) -> Forwarded {
        Forwarded(
            self.decodes
                .api_key()
                .iter()
                .filter_map(|k| {
                    let value = HeaderValue::from_str(&format!("Bearer {k}")).ok()?;
                    Some((header::AUTHORIZATION, value))
                })
                .collect(),
        )
    }

    /// The decode's answer as it streams, its lease held until the end; an error event in it
    /// is explained ([`Proxy::explain_errors`]), a broken stream ends with one.
    fn pass_through(
        self: Arc<Self>,
        answer: reqwest::Response,
        decode: Lease,
        started: Instant,
        failed: Failed,
    ) -> Response {
        let status =
            StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = answer.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        let streamed = content_type
            .as_ref()
            .is_some_and(|ct| ct.as_bytes().starts_with(b"text/event-stream"));
        let server = decode.backend().url.clone();
        let named = HeaderValue::from_str(&server).ok();
        let passing = Passing {
            body: answer.bytes_stream().boxed(),
            streamed,
            first: streamed,
            broken: false,
            server,
            failed,
            done: Done {
                proxy: self,
                started,
                _decode: decode,
            },
        };
        let stream = futures_util::stream::unfold(passing, |mut p| async move {
            if p.broken {
                return None;
            }
            let chunk = p.body.next().await?;
            if std::mem::take(&mut p.first) {
                let elapsed = p.done.started.elapsed().as_secs_f64();
                p.done.proxy.metrics.first_token(elapsed);
            }
            let chunk = match chunk {
                // A stream that breaks ends with an error event the client can read (an OpenAI
                // error object, as vLLM sends one mid-stream), not with a cut connection.
                Err(e) if p.streamed => {
                    p.broken = true;
                    let message = format!(
                        "decode server {} failed mid-answer: {}",
                        p.server,
                        causes(&e)
                    );
                    let event = json!({"error": {"message": message, "type": "upstream_error",
                                                 "param": null, "code": 502}});
                    Ok(Bytes::from(format!("data: {event}\n\n")))
                }
                Ok(bytes) if p.streamed => {
                    let proxy = &p.done.proxy;
                    Ok(proxy.explain_errors(bytes, &p.server, &p.failed).await)
                }
                chunk => chunk,
            };
            Some((chunk, p))
        });
        let mut response = Response::new(Body::from_stream(stream));
        *response.status_mut() = status;
        if let Some(ct) = content_type.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        if let Some(named) = named {
            response.headers_mut().insert(DECODE_HEADER, named);
        }
        response
    }
}

/// The header of an answer that names the decode server that gave it.
const DECODE_HEADER: &str = "x-kvferry-decode";

/// What explains a decode's failure of a request: its model (for the question to the decode),
/// its kvferry room and the note on its prefill's side.
struct Failed {
    model: Value,
    room: Value,
    note: Option<String>,
}

/// A decode's answer on its way to the client.
struct Passing {
    body: futures_util::stream::BoxStream<'static, reqwest::Result<Bytes>>,
    /// An event stream (`text/event-stream`).
    streamed: bool,
    /// No chunk went yet (the time to the first is observed for a stream).
    first: bool,
    /// The stream broke: its error event went, nothing follows.
    broken: bool,
    server: String,
    failed: Failed,
    done: Done,
}

/// Held by an answer's stream: when it ends (or the client leaves), the decode's request
/// stops counting and the request's duration is observed.
struct Done {
    proxy: Arc<Proxy>,
    started: Instant,
    _decode: Lease,
}

impl Drop for Done {
    fn drop(&mut self) {
        self.proxy
            .metrics
            .duration(self.started.elapsed().as_secs_f64());
    }
}

/// An upstream answer copied as it is (status, JSON body).
fn copy_answer(status: reqwest::StatusCode, body: Bytes) -> Response {
    let status = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut r = (status, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A random u64 room: rooms of independent proxies collide with probability 2^-64 per pair.
fn fresh_room() -> Result<u64, getrandom::Error> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
