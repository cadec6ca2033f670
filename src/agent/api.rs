//! The engine-facing HTTP plumbing both agents share: the error type (converted to a status in
//! exactly one place), JSON body parsing with clear 400s, the long-poll wait, the listening
//! line, and the agent's Prometheus counters.
//!
//! The routes themselves live with their agent (`prefill.rs`, `decode.rs`).

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::room::RoomState;
use crate::reason::FailureCode;

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

/// Waits until the room's state changes or `wait` passes.
pub async fn wait_for_change(mut rx: watch::Receiver<RoomState>, wait: Duration) {
    let _ = tokio::time::timeout(wait, rx.changed()).await;
}

/// Prints the one "listening" JSON line on stdout (design.md part 8).
pub fn print_listening(line: &serde_json::Value) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

/// Counters of one agent, rendered as Prometheus text.
#[derive(Debug, Default)]
pub struct Metrics {
    rooms_final: [AtomicU64; 3],
    failures: Vec<AtomicU64>,
    /// KV bytes sent (prefill) or landed (decode).
    pub bytes: AtomicU64,
    /// Rooms that expired untaken.
    pub expired: AtomicU64,
    /// Messages refused as malformed or inconsistent.
    pub bad_messages: AtomicU64,
    /// Rooms refused at admission (429).
    pub rejected: AtomicU64,
}

impl Metrics {
    /// Zeroed counters.
    pub fn new() -> Self {
        Metrics {
            failures: FailureCode::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            ..Default::default()
        }
    }

    /// Counts a room reaching a final state (and its failure code).
    pub fn room_final(&self, state: RoomState, code: Option<FailureCode>) {
        let i = match state {
            RoomState::Success => 0,
            RoomState::Failed => 1,
            RoomState::Aborted => 2,
            _ => return,
        };
        self.rooms_final[i].fetch_add(1, Ordering::Relaxed);
        if let Some(code) = code {
            if let Some(pos) = FailureCode::ALL.iter().position(|c| *c == code) {
                self.failures[pos].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Prometheus text for a `role` agent, with extra gauge lines appended.
    pub fn render(&self, role: &str, pool_total: usize, pool_free: usize) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP kvferry_rooms_total Rooms that reached a final state."
        );
        let _ = writeln!(s, "# TYPE kvferry_rooms_total counter");
        for (i, state) in ["success", "failed", "aborted"].iter().enumerate() {
            let v = self.rooms_final[i].load(Ordering::Relaxed);
            let _ = writeln!(
                s,
                "kvferry_rooms_total{{role=\"{role}\",state=\"{state}\"}} {v}"
            );
        }
        let _ = writeln!(
            s,
            "# HELP kvferry_room_failures_total Failed or aborted rooms by code."
        );
        let _ = writeln!(s, "# TYPE kvferry_room_failures_total counter");
        for (i, code) in FailureCode::ALL.iter().enumerate() {
            let v = self.failures[i].load(Ordering::Relaxed);
            let _ = writeln!(
                s,
                "kvferry_room_failures_total{{role=\"{role}\",code=\"{code}\"}} {v}"
            );
        }
        let counters = [
            (
                "kvferry_kv_bytes_total",
                "KV bytes sent (prefill) or landed (decode).",
                &self.bytes,
            ),
            (
                "kvferry_rooms_expired_total",
                "Rooms that expired without being taken.",
                &self.expired,
            ),
            (
                "kvferry_bad_messages_total",
                "Messages refused as malformed or inconsistent.",
                &self.bad_messages,
            ),
            (
                "kvferry_admission_rejections_total",
                "Rooms refused at admission (429).",
                &self.rejected,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(s, "{name}{{role=\"{role}\"}} {}", v.load(Ordering::Relaxed));
        }
        let _ = writeln!(
            s,
            "# HELP kvferry_pool_pages Agent-owned pool pages.\n# TYPE kvferry_pool_pages gauge"
        );
        let _ = writeln!(
            s,
            "kvferry_pool_pages{{role=\"{role}\",state=\"free\"}} {pool_free}"
        );
        let _ = writeln!(
            s,
            "kvferry_pool_pages{{role=\"{role}\",state=\"used\"}} {}",
            pool_total - pool_free
        );
        s
    }
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
