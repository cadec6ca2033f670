//! The engine-facing HTTP plumbing both agents share: the error type (converted to a status in
//! exactly one place), the extractors that turn every rejection into it (body, query), the
//! 404/405 fallbacks, JSON body parsing with clear 400s and the listening line.
//!
//! The HTTP API is a layer over the engine API (`engine_api.rs`): its routes are registered
//! from the list of operations there ([`routes`]); a handler parses the path, the query and
//! the body into the operation's request struct, calls it, and serializes its result; a
//! refused operation's [`RoomError`] becomes a status here.
//!
//! Every error is `{"error": "..."}` with `Content-Type: application/json`: 400 (malformed body,
//! bad room, bad query parameter), 401 (the agent's token missing or wrong), 403 (a room names
//! a registry the decode does not trust), 404 (unknown room or route), 405 (known route, wrong
//! method), 409, 413 (body over [`BODY_LIMIT`]), 415 (a body not sent as JSON), 429, 503.
//!
//! With a token (`--token`), every route but `GET /healthz` and `GET /metrics` (which reveal
//! no room content) needs `Authorization: Bearer TOKEN` ([`finish`]).
//!
//! The handlers of the operations both roles have are here; each role's own are in its
//! `http.rs` (`prefill/http.rs`, `decode/http.rs`).

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use axum::{Json, Router};
use serde::de::DeserializeOwned;

use super::engine_api::{self, EngineApi, Operation, PoolCounts, RoomError};
use super::faults::{Arm, Armed, Tested};

/// An HTTP error for the engine: a refused room operation, or a request the HTTP layer
/// itself refuses before any operation runs.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A room operation refused the request.
    #[error(transparent)]
    Room(#[from] RoomError),
    /// The path, query or body cannot be read as the operation's request (400).
    #[error("{0}")]
    Malformed(String),
    /// No such route (404).
    #[error("no route for {method} {path}")]
    NoRoute {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
    },
    /// The route exists, not with this method (405).
    #[error("method {method} not allowed on {path}")]
    WrongMethod {
        /// The request's method.
        method: Method,
        /// The request's path.
        path: String,
    },
    /// The body is over [`BODY_LIMIT`] (413).
    #[error("request body larger than the {BODY_LIMIT} byte limit")]
    TooLarge,
    /// A body not sent as JSON (415).
    #[error("a request body must be JSON, sent with `Content-Type: application/json`")]
    NotJson,
    /// The agent has a token and the request does not carry it (401).
    #[error("{0}")]
    Unauthorized(kvferry_wire::http::BearerError),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::Room(RoomError::BadRequest(_)) | ApiError::Malformed(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::Room(RoomError::UnknownRoom(_)) | ApiError::NoRoute { .. } => {
                StatusCode::NOT_FOUND
            }
            ApiError::Room(RoomError::Conflict(_)) => StatusCode::CONFLICT,
            ApiError::Room(RoomError::Exhausted(_)) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Room(RoomError::Unavailable(_)) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Room(RoomError::Forbidden(_)) => StatusCode::FORBIDDEN,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::WrongMethod { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotJson => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        };
        let body = axum::Json(serde_json::json!({ "error": self.to_string() }));
        (status, body).into_response()
    }
}

/// A handler's answer: the operation's result as JSON, or the error.
pub type Answer<T> = Result<axum::Json<T>, ApiError>;

/// The largest request body the engine API reads (a room's page list of a million pages fits).
pub const BODY_LIMIT: usize = 16 << 20;

/// The fallback for unknown routes (404).
pub async fn no_route(method: Method, uri: Uri) -> ApiError {
    let path = uri.path().to_owned();
    ApiError::NoRoute { method, path }
}

/// The fallback for a known route asked with another method (405).
pub async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    let path = uri.path().to_owned();
    ApiError::WrongMethod { method, path }
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
                ApiError::TooLarge
            } else {
                ApiError::Malformed(format!("request body unreadable: {}", e.body_text()))
            }
        })?;
        if !bytes.is_empty() && !json {
            return Err(ApiError::NotJson);
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

/// The router's finishing layers shared by both agents: JSON 404 and 405 fallbacks, the body
/// limit, and with `token` the bearer check on every route but `GET /healthz` and
/// `GET /metrics`.
pub fn finish<S: Clone + Send + Sync + 'static>(
    router: axum::Router<S>,
    token: Option<String>,
) -> axum::Router<S> {
    let router = router
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT));
    match token {
        None => router,
        Some(token) => {
            let token: Arc<str> = token.into();
            router.layer(axum::middleware::from_fn(move |req, next| {
                authorize(token.clone(), req, next)
            }))
        }
    }
}

/// Lets `GET /healthz`, `GET /metrics` and requests carrying `Authorization: Bearer TOKEN`
/// through (each proves its connection, [`kvferry_wire::http::prove`]); 401 otherwise.
async fn authorize(token: Arc<str>, req: Request, next: axum::middleware::Next) -> Response {
    let open = req.method() == Method::GET && matches!(req.uri().path(), "/healthz" | "/metrics");
    let checked = match open {
        true => Ok(()),
        false => kvferry_wire::http::check_bearer(req.headers().get(header::AUTHORIZATION), &token),
    };
    match checked {
        Ok(()) => {
            kvferry_wire::http::prove(&req);
            next.run(req).await
        }
        Err(e) => ApiError::Unauthorized(e).into_response(),
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
        return Err(ApiError::Malformed(
            "invalid JSON body: expected a JSON object".into(),
        ));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::Malformed(format!("invalid JSON body: {e}")))
}

/// Parses a room id from the path.
pub fn parse_room(s: &str) -> Result<u64, ApiError> {
    s.parse()
        .map_err(|_| ApiError::Malformed(format!("room {s:?} is not a u64")))
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
                ApiError::Malformed(format!("query string {query:?}: {}", e.body_text()))
            })?;
        let mut out = WaitQuery::default();
        for (key, value) in pairs {
            match key.as_str() {
                "wait_ms" if out.wait_ms.is_some() => {
                    return Err(ApiError::Malformed(
                        "query parameter wait_ms is given twice".into(),
                    ));
                }
                "wait_ms" => {
                    let ms = value.parse::<u64>().map_err(|_| {
                        ApiError::Malformed(format!(
                            "query parameter wait_ms={value:?} must be a whole number of milliseconds, 0 to {}",
                            u64::MAX
                        ))
                    })?;
                    out.wait_ms = Some(ms);
                }
                other => {
                    return Err(ApiError::Malformed(format!(
                        "unknown query parameter {other:?}: the only one is wait_ms"
                    )));
                }
            }
        }
        Ok(out)
    }
}

/// Serves `app` on `listener` (HTTPS with `tls`) as one of `tasks` until `shutdown`; `token`:
/// whether `app` checks one ([`finish`]), so that only a request past the check proves its
/// connection.
pub fn spawn_api(
    tasks: &mut tokio::task::JoinSet<()>,
    (listener, app, tls): (
        tokio::net::TcpListener,
        axum::Router,
        Option<kvferry_wire::tls::ServerTls>,
    ),
    shutdown: tokio_util::sync::CancellationToken,
    (role, token): (&'static str, bool),
) {
    let proof = match token {
        true => kvferry_wire::http::Proof::Authorized,
        false => kvferry_wire::http::Proof::Request,
    };
    tasks.spawn(async move {
        let serve = kvferry_wire::http::serve(listener, app, shutdown, "engine API", proof, tls);
        if let Err(e) = serve.await {
            tracing::error!(role, error = %e, "engine API stopped");
        }
    });
}

/// Prints the one "listening" JSON line on stdout (docs/operations.md).
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
            kvferry_wire::http::OPENMETRICS_CONTENT_TYPE,
        )],
        text,
    )
        .into_response()
}

/// The routes of `T`'s role, registered from the engine API's list
/// ([`super::engine_api::OPERATIONS`]): each listed operation's method and path, served by
/// the shared handler of an operation both roles have or by `own`, the role's handler of its
/// own operation by name. `faults` only with `fault_injection`. Every listed operation has a
/// handler: the roles' tests build their routes, and a missing one panics there.
pub(crate) fn routes<T: Tested>(
    own: impl Fn(&str, MethodFilter) -> Option<MethodRouter<Arc<T>>>,
    fault_injection: bool,
) -> Router<Arc<T>> {
    let mut router = Router::new();
    for op in Operation::of(T::ROLE) {
        let Some((method, path)) = op.http else {
            continue;
        };
        // `wait` is `view` with `?wait_ms=`, on the same route.
        if op.name == "wait" || (op.name == "faults" && !fault_injection) {
            continue;
        }
        let filter = match method {
            engine_api::Method::Get => MethodFilter::GET,
            engine_api::Method::Post => MethodFilter::POST,
            engine_api::Method::Delete => MethodFilter::DELETE,
        };
        let handler = shared::<T>(op.name, filter)
            .or_else(|| own(op.name, filter))
            .unwrap_or_else(|| panic!("the {} agent has no handler for {}", T::ROLE, op.name));
        router = router.route(path, handler);
    }
    router
}

/// The handler of an operation both roles have, by name.
fn shared<T: Tested>(name: &str, filter: MethodFilter) -> Option<MethodRouter<Arc<T>>> {
    Some(match name {
        "view" => on(filter, view::<T>),
        "abort" => on(filter, abort::<T>),
        "hold" => on(filter, hold::<T>),
        "unhold" => on(filter, unhold::<T>),
        "pool" => on(filter, pool::<T>),
        "metrics" => on(filter, metrics::<T>),
        "health" => on(filter, health::<T>),
        "draining" => on(filter, draining::<T>),
        "faults" => on(filter, arm::<T>),
        _ => return None,
    })
}

async fn view<T: EngineApi>(
    State(inner): State<Arc<T>>,
    Path(room): Path<String>,
    q: WaitQuery,
) -> Answer<T::View> {
    let room = parse_room(&room)?;
    Ok(Json(match q.wait_ms {
        Some(ms) => inner.wait(room, Duration::from_millis(ms)).await?,
        None => inner.view(room)?,
    }))
}

async fn abort<T: EngineApi>(
    State(inner): State<Arc<T>>,
    Path(room): Path<String>,
) -> Answer<T::View> {
    let room = parse_room(&room)?;
    Ok(Json(inner.abort(room).await?))
}

async fn hold<T: EngineApi>(
    State(inner): State<Arc<T>>,
    Path(room): Path<String>,
    JsonBody(body): JsonBody,
) -> Result<StatusCode, ApiError> {
    let room = parse_room(&room)?;
    let req: T::Hold = parse_json(&body)?;
    inner.hold(room, req)?;
    Ok(StatusCode::ACCEPTED)
}

async fn unhold<T: EngineApi>(
    State(inner): State<Arc<T>>,
    Path(room): Path<String>,
) -> Result<StatusCode, ApiError> {
    inner.unhold(parse_room(&room)?);
    Ok(StatusCode::NO_CONTENT)
}

async fn pool<T: EngineApi>(State(inner): State<Arc<T>>) -> Json<PoolCounts> {
    Json(inner.pool())
}

async fn health<T: EngineApi>() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok", "role": T::ROLE}))
}

async fn draining<T: EngineApi>(State(inner): State<Arc<T>>) -> Json<serde_json::Value> {
    inner.draining().await;
    Json(serde_json::json!({"draining": true}))
}

async fn metrics<T: EngineApi>(State(inner): State<Arc<T>>) -> Response {
    metrics_response(inner.metrics())
}

/// `POST /v1/faults` (with `--fault-injection`): arms the test switches (`faults.rs`).
async fn arm<T: Tested>(State(inner): State<Arc<T>>, JsonBody(body): JsonBody) -> Answer<Armed> {
    let arm: Arm = parse_json(&body)?;
    let armed = inner
        .faults()
        .arm(arm, T::ROLE == "prefill")
        .map_err(ApiError::Malformed)?;
    if let Some(chunk) = armed.corrupt_chunk {
        tracing::warn!(chunk, "fault injection armed: corrupting a chunk");
    }
    if armed.timeouts != armed.timeouts_were {
        tracing::warn!(timeouts = ?armed.timeouts, "fault injection: timeouts changed");
    }
    Ok(Json(armed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(query: &str) -> Result<Option<u64>, String> {
        let uri: Uri = format!("/v1/rooms/1?{query}").parse().unwrap();
        WaitQuery::parse(&uri)
            .map(|q| q.wait_ms)
            .map_err(|e| e.to_string())
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
