//! Routing one request: the prefill and decode servers picked, the prefill's request, the
//! decode's answer passed through.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
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
    pub prefills: Arc<Backends>,
    pub decodes: Arc<Backends>,
    pub pairing: Pairing,
    pub http: reqwest::Client,
    pub metrics: ProxyMetrics,
}

/// The proxy's routes.
pub fn router(proxy: Arc<Proxy>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .with_state(proxy)
}

async fn completions(State(p): State<Arc<Proxy>>, body: Bytes) -> Response {
    p.route(Endpoint::Completions, "/v1/completions", body).await
}

async fn chat_completions(State(p): State<Arc<Proxy>>, body: Bytes) -> Response {
    p.route(Endpoint::ChatCompletions, "/v1/chat/completions", body)
        .await
}

async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    let mut r = p.metrics.encode().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    r
}

/// An OpenAI error object.
fn error(status: StatusCode, kind: &str, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

impl Proxy {
    async fn route(&self, endpoint: Endpoint, path: &str, body: Bytes) -> Response {
        let started = Instant::now();
        let answer = self.pair_and_decode(endpoint, path, &body, started).await;
        let outcome = match &answer {
            Ok(_) => Outcome::Ok,
            Err((cause, _)) => {
                self.metrics.error(*cause);
                Outcome::Error
            }
        };
        self.metrics.request(endpoint, outcome);
        answer.unwrap_or_else(|(_, r)| r)
    }

    async fn pair_and_decode(
        &self,
        endpoint: Endpoint,
        path: &str,
        body: &[u8],
        started: Instant,
    ) -> Result<Response, (Cause, Response)> {
        let mut request: Map<String, Value> = match serde_json::from_slice(body) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(bad("the request body must be a JSON object".into())),
            Err(e) => return Err(bad(format!("the request body is not JSON: {e}"))),
        };
        let concurrent = self.pairing == Pairing::Concurrent;
        let prefill = self
            .prefills
            .pick(|b| !concurrent || b.group().is_some())
            .ok_or_else(|| unavailable("prefill"))?;
        let decode = self
            .decodes
            .pick(|_| true)
            .ok_or_else(|| unavailable("decode"))?;
        let mut first = request.clone();
        first.insert("max_tokens".into(), json!(1));
        if endpoint == Endpoint::ChatCompletions {
            first.insert("max_completion_tokens".into(), json!(1));
        }
        first.insert("stream".into(), json!(false));
        first.remove("stream_options");
        let url = format!("{}{path}", prefill.backend().url);
        if concurrent {
            let room = fresh_room()
                .map_err(|e| upstream(Cause::NoServer, "the proxy", format!("no randomness: {e}")))?
                .to_string();
            let group = prefill.backend().group().unwrap_or(0);
            first.insert(
                "kv_transfer_params".into(),
                json!({"do_remote_decode": true, "kvferry_room": room}),
            );
            request.insert(
                "kv_transfer_params".into(),
                json!({"do_remote_prefill": true, "kvferry_room": room, "kvferry_dp_rank": group}),
            );
            let http = self.http.clone();
            tokio::spawn(async move {
                // The lease counts the prefill's request until its answer.
                let _lease = prefill;
                match post_json(&http, &url, &first).await {
                    Ok(_) => {}
                    Err(e) => tracing::warn!(%url, room, error = %e, "prefill request failed"),
                }
            });
        } else {
            first.insert(
                "kv_transfer_params".into(),
                json!({"do_remote_decode": true}),
            );
            let answer = post_json(&self.http, &url, &first)
                .await
                .map_err(|e| upstream(Cause::Prefill, &url, e))?;
            drop(prefill);
            let params = answer
                .get("kv_transfer_params")
                .cloned()
                .filter(Value::is_object)
                .ok_or_else(|| {
                    upstream(
                        Cause::Prefill,
                        &url,
                        "its answer has no kv_transfer_params: is it running KvferryConnector as kv_producer?".into(),
                    )
                })?;
            request.insert("kv_transfer_params".into(), params);
        }
        self.decode(path, &request, decode, started).await
    }

    /// Sends the request to the decode and passes its answer through as it streams.
    async fn decode(
        &self,
        path: &str,
        request: &Map<String, Value>,
        decode: Lease,
        started: Instant,
    ) -> Result<Response, (Cause, Response)> {
        let url = format!("{}{path}", decode.backend().url);
        let answer = self
            .http
            .post(&url)
            .json(request)
            .send()
            .await
            .map_err(|e| upstream(Cause::Decode, &url, e.to_string()))?;
        let status = StatusCode::from_u16(answer.status().as_u16())
            .unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = answer.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        let metrics_first = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let first_byte = self.metrics.first_byte_observer();
        let stream = answer.bytes_stream().map(move |chunk| {
            // The decode's lease lives as long as its answer streams.
            let _held = &decode;
            if !metrics_first.swap(true, std::sync::atomic::Ordering::Relaxed) {
                first_byte(started.elapsed().as_secs_f64());
            }
            chunk
        });
        let mut response = Response::new(Body::from_stream(stream));
        *response.status_mut() = status;
        if let Some(ct) = content_type.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        Ok(response)
    }
}

async fn post_json(
    http: &reqwest::Client,
    url: &str,
    body: &Map<String, Value>,
) -> Result<Value, String> {
    let r = http.post(url).json(body).send().await.map_err(|e| e.to_string())?;
    let status = r.status();
    let value: Value = r.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {value}"));
    }
    Ok(value)
}

fn bad(message: String) -> (Cause, Response) {
    (
        Cause::BadRequest,
        error(StatusCode::BAD_REQUEST, "invalid_request_error", message),
    )
}

fn unavailable(role: &str) -> (Cause, Response) {
    (
        Cause::NoServer,
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("no healthy {role} server"),
        ),
    )
}

fn upstream(cause: Cause, url: &str, message: String) -> (Cause, Response) {
    (
        cause,
        error(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("{url}: {message}"),
        ),
    )
}

/// A random u64 room: rooms of independent proxies collide with probability 2^-64 per pair.
fn fresh_room() -> Result<u64, getrandom::Error> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
