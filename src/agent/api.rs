//! The engine-facing HTTP plumbing both agents share: the error type (converted to a status in
//! exactly one place), the extractors that turn every rejection into it (body, query), the
//! 404/405 fallbacks, JSON body parsing with clear 400s, the long-poll wait and the listening
//! line.
//!
//! Every error is `{"error": "..."}` with `Content-Type: application/json`: 400 (malformed body,
//! bad room, bad query parameter), 404 (unknown room or route), 405 (known route, wrong
//! method), 409, 413 (body over [`BODY_LIMIT`]), 415 (a body not sent as JSON), 429, 503.
//!
//! The routes themselves live with their agent (`prefill/http.rs`, `decode/http.rs`).

use std::io::Write as _;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
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
    /// 404: no such route.
    pub fn no_route(method: &Method, uri: &Uri) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("no route for {method} {}", uri.path()),
        )
    }
    /// 405: the route exists, not with this method.
    pub fn wrong_method(method: &Method, uri: &Uri) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("method {method} not allowed on {}", uri.path()),
        )
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

/// The largest request body the engine API reads (a room's page list of a million pages fits).
pub const BODY_LIMIT: usize = 16 << 20;

/// The fallback for unknown routes (404).
pub async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::no_route(&method, &uri)
}

/// The fallback for a known route asked with another method (405).
pub async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::wrong_method(&method, &uri)
}

/// A request body of at most [`BODY_LIMIT`] bytes that, unless empty, was sent as JSON
/// (`Content-Type: application/json` or `...+json`); parse it with [`parse_json`]. Refusals
/// are [`ApiError`]s: 413 over the limit, 415 for another content type, 400 when unreadable.
pub struct JsonBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let json = is_json(req.headers());
        // The limit itself is the router's `DefaultBodyLimit` layer ([`finish`]).
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("request body larger than the {BODY_LIMIT} byte limit"),
                )
            } else {
                ApiError::bad_request(format!("request body unreadable: {}", e.body_text()))
            }
        })?;
        if !bytes.is_empty() && !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "a request body must be JSON, sent with `Content-Type: application/json`",
            ));
        }
        Ok(JsonBody(bytes))
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// The router's finishing layers shared by both agents: JSON 404 and 405 fallbacks and the
/// body limit.
pub fn finish<S: Clone + Send + Sync + 'static>(router: axum::Router<S>) -> axum::Router<S> {
    router
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
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

/// The `?wait_ms=N` query of `GET /v1/rooms/{room}`: a whole number of milliseconds. Any
/// other parameter, a repeated one or a value that is not a u64 is a 400 naming it.
#[derive(Debug, Default)]
pub struct WaitQuery {
    /// Long-poll: wait up to this many ms (at most a minute) for the room to change.
    pub wait_ms: Option<u64>,
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for WaitQuery {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        WaitQuery::parse(&parts.uri)
    }
}

impl WaitQuery {
    /// Parses the query string of `uri`.
    pub fn parse(uri: &Uri) -> Result<Self, ApiError> {
        let query = uri.query().unwrap_or_default();
        let axum::extract::Query(pairs) =
            axum::extract::Query::<Vec<(String, String)>>::try_from_uri(uri).map_err(|e| {
                ApiError::bad_request(format!("query string {query:?}: {}", e.body_text()))
            })?;
        let mut out = WaitQuery::default();
        for (key, value) in pairs {
            match key.as_str() {
                "wait_ms" if out.wait_ms.is_some() => {
                    return Err(ApiError::bad_request(
                        "query parameter wait_ms is given twice",
                    ));
                }
                "wait_ms" => {
                    let ms = value.parse::<u64>().map_err(|_| {
                        ApiError::bad_request(format!(
                            "query parameter wait_ms={value:?} must be a whole number of milliseconds, 0 to {}",
                            u64::MAX
                        ))
                    })?;
                    out.wait_ms = Some(ms);
                }
                other => {
                    return Err(ApiError::bad_request(format!(
                        "unknown query parameter {other:?}: the only one is wait_ms"
                    )));
                }
            }
        }
        Ok(out)
    }
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

/// Refuses with a 400 naming the limit a room that can never fit: its `tokens` need more
/// pages than the whole pool has (a 429 would invite a retry that cannot succeed).
pub fn fits_pool(tokens: usize, needed: usize, pool_pages: usize) -> Result<(), ApiError> {
    if needed > pool_pages {
        return Err(ApiError::bad_request(format!(
            "tokens {tokens} need {needed} pages but the whole pool has {pool_pages} (--pool-pages): this room can never fit"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(query: &str) -> Result<Option<u64>, String> {
        let uri: Uri = format!("/v1/rooms/1?{query}").parse().unwrap();
        WaitQuery::parse(&uri)
            .map(|q| q.wait_ms)
            .map_err(|e| e.message)
    }

    #[test]
    fn wait_query_names_the_parameter() {
        assert_eq!(wait(""), Ok(None));
        assert_eq!(wait("wait_ms=250"), Ok(Some(250)));
        assert_eq!(wait("wait_ms=18446744073709551615"), Ok(Some(u64::MAX)));
        for bad in [
            "wait_ms=-1",
            "wait_ms=abc",
            "wait_ms=18446744073709551616",
            "wait_ms=",
        ] {
            let e = wait(bad).unwrap_err();
            assert!(e.starts_with("query parameter wait_ms="), "{bad}: {e}");
        }
        assert!(wait("wait_ms=1&wait_ms=2").unwrap_err().contains("twice"));
        assert!(
            wait("wait=1")
                .unwrap_err()
                .contains("unknown query parameter \"wait\"")
        );
    }

    #[test]
    fn json_content_types() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, v.parse().unwrap());
            is_json(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/vnd.api+json"));
        assert!(!with("text/plain"));
        assert!(!with("application/x-www-form-urlencoded"));
        assert!(!is_json(&HeaderMap::new()));
    }
}
