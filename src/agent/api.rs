//! The engine-facing HTTP plumbing both agents share: the error type (converted to a status in
//! exactly one place), JSON body parsing with clear 400s, the long-poll wait and the listening
//! line.
//!
//! The routes themselves live with their agent (`prefill.rs`, `decode.rs`).

use std::io::Write as _;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::room::RoomState;
use crate::pool::allocator::PageAllocator;

/// An HTTP error for the engine: a status and a message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    /// 404: no such room.
    pub fn unknown_room(room: u64) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("unknown room {room}"))
    }
    /// 409: the request conflicts with the room's state.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }
    /// 429: no capacity now; retry later.
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, message)
    }
    /// 503: the agent cannot serve this now (shutting down).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = axum::Json(serde_json::json!({ "error": self.message }));
        (self.status, body).into_response()
    }
}

/// Parses a JSON body, refusing malformed ones with a 400 that says what was wrong.
///
/// Only a JSON object is a body: serde would also read a struct from an array of its fields
/// in order (`[16]` as `{"tokens": 16}`), which bypasses field names and `deny_unknown_fields`.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let body = if body.is_empty() {
        b"{}".as_slice()
    } else {
        body
    };
    if !body.trim_ascii_start().starts_with(b"{") {
        return Err(ApiError::bad_request(
            "invalid JSON body: expected a JSON object",
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// Parses a room id from the path.
pub fn parse_room(s: &str) -> Result<u64, ApiError> {
    s.parse()
        .map_err(|_| ApiError::bad_request(format!("room {s:?} is not a u64")))
}

/// A room key from a JSON body (32 hex digits), if one was given.
pub fn parse_room_key(s: Option<&str>) -> Result<Option<crate::protocol::Secret>, ApiError> {
    s.map(|k| {
        k.parse()
            .map_err(|e: String| ApiError::bad_request(format!("room_key: {e}")))
    })
    .transpose()
}

/// The `?wait_ms=N` query of `GET /v1/rooms/{room}`.
#[derive(Debug, serde::Deserialize)]
pub struct WaitQuery {
    /// Long-poll: wait up to this many ms (at most a minute) for the room to change.
    pub wait_ms: Option<u64>,
}

/// `GET /v1/rooms/{room}` for either agent. `look` returns the room's JSON and, while it may
/// still change (not final, or not yet safe to reuse), a receiver that wakes on its next
/// change; with `wait_ms` the answer waits for that change.
pub async fn room_answer<F>(wait_ms: Option<u64>, look: F) -> Result<Response, ApiError>
where
    F: Fn() -> Result<(serde_json::Value, Option<watch::Receiver<RoomState>>), ApiError>,
{
    let (view, rx) = look()?;
    let (Some(wait), Some(mut rx)) = (wait_ms, rx) else {
        return Ok(axum::Json(view).into_response());
    };
    let wait = Duration::from_millis(wait.min(60_000));
    let _ = tokio::time::timeout(wait, rx.changed()).await;
    Ok(axum::Json(look()?.0).into_response())
}

/// `GET /v1/pool`: the agent-owned pages.
pub fn pool_answer(alloc: &PageAllocator) -> Response {
    axum::Json(serde_json::json!({
        "total_pages": alloc.total_pages(),
        "free_pages": alloc.free_pages(),
    }))
    .into_response()
}

/// Serves `app` on `listener` as one of `tasks` until `shutdown`.
pub fn spawn_api(
    tasks: &mut tokio::task::JoinSet<()>,
    listener: tokio::net::TcpListener,
    app: axum::Router,
    shutdown: tokio_util::sync::CancellationToken,
    role: &'static str,
) {
    tasks.spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned());
        if let Err(e) = serve.await {
            tracing::error!(role, error = %e, "engine API stopped");
        }
    });
}

/// Prints the one "listening" JSON line on stdout (design.md part 8).
pub fn print_listening(line: &serde_json::Value) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

/// The `/metrics` response.
pub fn metrics_response(text: String) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}

/// Standard base64 (with padding) of `bytes`, for aux payloads in JSON.
pub fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Decodes standard base64, refusing bad input with a 400.
pub fn unbase64(text: &str) -> Result<Vec<u8>, ApiError> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| ApiError::bad_request(format!("aux is not valid base64: {e}")))
}

/// Checks an engine's page list: enough pages for the tokens, each in the pool, none twice.
pub fn validate_pages(pages: &[u32], needed: usize, num_pages: usize) -> Result<(), ApiError> {
    if pages.len() < needed {
        return Err(ApiError::bad_request(format!(
            "{} pages given, the tokens need {needed}",
            pages.len()
        )));
    }
    if let Some(p) = pages.iter().find(|&&p| p as usize >= num_pages) {
        return Err(ApiError::bad_request(format!(
            "page {p} is out of range: the pool has {num_pages} pages"
        )));
    }
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(ApiError::bad_request(format!(
            "page {} is listed twice",
            w[0]
        )));
    }
    Ok(())
}
