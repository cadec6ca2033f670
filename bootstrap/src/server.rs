//! The HTTP server: routes, handlers, the extractors that turn axum's rejections into
//! [`ApiError`], bearer-token checking, the lease sweeper and graceful shutdown.
//!
//! Routes (all bodies JSON unless noted; every error is `{"error": "..."}`):
//!
//! | method | path | success | errors |
//! | --- | --- | --- | --- |
//! | POST | `/v1/ranks` | 201 `Lease` (200 when the same instance re-registers) | 400, 401, 409, 413, 415 |
//! | GET | `/v1/ranks` | 200 `RankList` | 401 |
//! | POST | `/v1/ranks/{instance_id}/heartbeat` | 200 `Lease` | 400, 401, 404 (register again) |
//! | DELETE | `/v1/ranks/{instance_id}` | 204 | 400, 401, 404 |
//! | GET | `/v1/groups/{dp_rank}` | 200 `PrefillGroup` | 400, 401, 503 while incomplete (`Retry-After: 1`) |
//! | GET | `/healthz` | 200 `Health` | |
//! | GET | `/metrics` | 200 Prometheus text | 401 |
//!
//! Any other path is 404, any other method on a known path 405. When a token is configured,
//! every request but `GET /healthz` needs `Authorization: Bearer TOKEN` (reads too: the rank
//! list names every endpoint of the cluster, and metrics count its traffic); the check runs
//! before routing, so an unauthenticated client gets 401 whatever the path. `/healthz` stays
//! open for liveness probes and says nothing beyond counts.
//!
//! A registration whose slot is held by another live instance is 409 with the holder named
//! (`holder`, `holder_lease_remaining_ms`, `lease_ttl_ms` beside `error`): the registry never
//! silently replaces a live rank.
//!
//! The registry state sits behind one `std::sync::Mutex`, locked only for the synchronous
//! registry call of a handler and never across an `.await`.

use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::{ApiError, RejectReason, Rejection};
use crate::metrics::Metrics;
use crate::registry::{Registered, Registry, RegistryError, millis};
use crate::types::{Health, Lease, PrefillGroup, RankList, Registration};

/// The registry's default port.
pub const DEFAULT_PORT: u16 = 8998;
/// The default lease length.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
/// The default request body limit (a registration is well under 1 KiB).
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;
/// How long in-flight connections may take to finish once shutdown is asked.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How the server behaves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Lease length granted to every registration; must be > 0.
    pub lease_ttl: Duration,
    /// When set, every route but `GET /healthz` needs `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Largest accepted request body in bytes (413 above).
    pub body_limit: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            lease_ttl: DEFAULT_LEASE_TTL,
            token: None,
            body_limit: DEFAULT_BODY_LIMIT,
        }
    }
}

impl ServerConfig {
    /// The defaults with leases of `lease_ttl`.
    pub fn with_lease_ttl(lease_ttl: Duration) -> Self {
        Self {
            lease_ttl,
            ..Self::default()
        }
    }
}

#[derive(Clone)]
struct AppState {
    registry: Arc<Mutex<Registry>>,
    metrics: Arc<Metrics>,
    token: Option<Arc<str>>,
    body_limit: usize,
}

impl AppState {
    /// The registry, locked. A panic elsewhere cannot leave the registry half-updated in a way
    /// worse than refusing service, so a poisoned lock is taken over.
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lease(&self) -> Lease {
        Lease {
            lease_ttl_ms: millis(self.registry().ttl()),
        }
    }
}

/// Serves the registry on `listener` until `shutdown` is cancelled, then lets in-flight
/// requests finish (for at most a few seconds) and returns.
pub async fn serve(
    listener: TcpListener,
    config: ServerConfig,
    shutdown: CancellationToken,
) -> io::Result<()> {
    if config.lease_ttl.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "lease ttl must be > 0",
        ));
    }
    let state = AppState {
        registry: Arc::new(Mutex::new(Registry::new(config.lease_ttl))),
        metrics: Arc::new(Metrics::default()),
        token: config.token.as_deref().map(Arc::from),
        body_limit: config.body_limit,
    };
    let stop_sweeper = shutdown.child_token();
    let sweeper = tokio::spawn(sweep(
        state.registry.clone(),
        sweep_period(config.lease_ttl),
        stop_sweeper.clone(),
    ));
    let app = router(state, config.body_limit);
    let server =
        axum::serve(listener, app).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    let result = tokio::select! {
        result = server => result,
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            tracing::warn!(grace_ms = millis(SHUTDOWN_GRACE), "connections still open after the shutdown grace; closing them");
            Ok(())
        }
    };
    stop_sweeper.cancel();
    if let Err(e) = sweeper.await {
        tracing::warn!(error = %e, "lease sweeper task failed");
    }
    result
}

fn router(state: AppState, body_limit: usize) -> Router {
    Router::new()
        .route("/v1/ranks", post(register).get(list_ranks))
        .route("/v1/ranks/{instance_id}/heartbeat", post(heartbeat))
        .route("/v1/ranks/{instance_id}", delete(deregister))
        .route("/v1/groups/{dp_rank}", get(lookup_prefill))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(middleware::from_fn_with_state(
            state.metrics.clone(),
            count_rejections,
        ))
        .with_state(state)
}

fn sweep_period(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Expires leases periodically, so gauges and groups are right even without traffic (every
/// registry operation also expires first, so reads never see a stale lease).
async fn sweep(registry: Arc<Mutex<Registry>>, period: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                registry
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .expire(Instant::now());
            }
        }
    }
}

async fn register(
    State(state): State<AppState>,
    ApiJson(registration): ApiJson<Registration>,
) -> Result<(StatusCode, Json<Lease>), ApiError> {
    let (id, role, dp, tp, pp) = (
        registration.instance_id,
        registration.role,
        registration.dp_rank,
        registration.tp_rank,
        registration.pp_rank,
    );
    let result = state.registry().register(registration, Instant::now());
    let outcome = result.map_err(|e| {
        if let RegistryError::SlotHeld {
            holder,
            remaining_ms,
            ..
        } = &e
        {
            tracing::warn!(instance_id = %id, %holder, holder_lease_remaining_ms = remaining_ms, %role, dp_rank = dp, tp_rank = tp, pp_rank = pp, "registration refused: the slot is held by another live instance");
        }
        ApiError::from_registry(e, state.registry().ttl())
    })?;
    let status = match outcome {
        Registered::New => {
            tracing::info!(instance_id = %id, %role, dp_rank = dp, tp_rank = tp, pp_rank = pp, "registered");
            StatusCode::CREATED
        }
        Registered::Refreshed => {
            tracing::debug!(instance_id = %id, "re-registered");
            StatusCode::OK
        }
    };
    Ok((status, Json(state.lease())))
}

async fn heartbeat(
    State(state): State<AppState>,
    ApiPath(instance_id): ApiPath<Uuid>,
) -> Result<Json<Lease>, ApiError> {
    state.registry().heartbeat(instance_id, Instant::now())?;
    Ok(Json(state.lease()))
}

async fn deregister(
    State(state): State<AppState>,
    ApiPath(instance_id): ApiPath<Uuid>,
) -> Result<StatusCode, ApiError> {
    let r = state.registry().deregister(instance_id, Instant::now())?;
    tracing::info!(instance_id = %instance_id, role = %r.role, dp_rank = r.dp_rank, tp_rank = r.tp_rank, pp_rank = r.pp_rank, "deregistered");
    Ok(StatusCode::NO_CONTENT)
}

async fn list_ranks(State(state): State<AppState>) -> Json<RankList> {
    let ranks = state.registry().list(Instant::now());
    Json(RankList { ranks })
}

async fn lookup_prefill(
    State(state): State<AppState>,
    ApiPath(dp_rank): ApiPath<u32>,
) -> Result<Json<PrefillGroup>, ApiError> {
    let result = state.registry().lookup_prefill(dp_rank, Instant::now());
    state.metrics.lookup(result.is_ok());
    Ok(Json(result?))
}

async fn healthz(State(state): State<AppState>) -> Json<Health> {
    let stats = state.registry().stats(Instant::now());
    Json(Health {
        status: "ok".to_owned(),
        prefill_ranks: stats.prefill_ranks,
        decode_ranks: stats.decode_ranks,
        groups: stats.groups,
    })
}

async fn metrics(State(state): State<AppState>) -> Response {
    let stats = state.registry().stats(Instant::now());
    let body = state.metrics.render(&stats);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        body,
    )
        .into_response()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::rejected(
        RejectReason::NotFound,
        format!("no route for {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::rejected(
        RejectReason::MethodNotAllowed,
        format!("method {method} not allowed on {}", uri.path()),
    )
}

/// Counts every response that carries a [`Rejection`] and logs it.
async fn count_rejections(
    State(metrics): State<Arc<Metrics>>,
    req: Request,
    next: Next,
) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let response = next.run(req).await;
    if let Some(r) = response.extensions().get::<Rejection>() {
        metrics.reject(r.reason);
        tracing::info!(
            %method,
            path,
            status = response.status().as_u16(),
            reason = r.reason.as_str(),
            error = %r.message,
            "request rejected"
        );
    }
    response
}

/// `Json<T>` whose rejections are [`ApiError`]s (JSON bodies, counted in metrics).
struct ApiJson<T>(T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(ApiJson(value)),
            Err(rejection) => Err(json_rejection(&rejection, state.body_limit)),
        }
    }
}

fn json_rejection(rejection: &JsonRejection, body_limit: usize) -> ApiError {
    match rejection.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::rejected(
            RejectReason::TooLarge,
            format!("request body larger than the {body_limit} byte limit"),
        ),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => {
            ApiError::rejected(RejectReason::UnsupportedMediaType, rejection.body_text())
        }
        _ => ApiError::bad_request(rejection.body_text()),
    }
}

/// `Path<T>` whose rejections are [`ApiError`]s: a bad uuid or dp rank is a 400.
struct ApiPath<T>(T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(ApiPath(value)),
            Err(rejection) => Err(path_rejection(&rejection)),
        }
    }
}

fn path_rejection(rejection: &PathRejection) -> ApiError {
    ApiError::bad_request(rejection.body_text())
}

/// Lets a request through when no token is configured, when it is `GET /healthz`, or when it
/// carries `Authorization: Bearer TOKEN`; answers 401 otherwise.
async fn authorize(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(token) = state.token.as_deref() else {
        return next.run(req).await;
    };
    if req.uri().path() == "/healthz" && req.method() == Method::GET {
        return next.run(req).await;
    }
    match check_bearer(req.headers().get(header::AUTHORIZATION), token) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

fn check_bearer(value: Option<&HeaderValue>, token: &str) -> Result<(), ApiError> {
    let unauthorized = |m: &str| ApiError::rejected(RejectReason::Unauthorized, m);
    let Some(value) = value else {
        return Err(unauthorized(
            "missing Authorization header: this registry needs `Authorization: Bearer <token>` on every route but /healthz",
        ));
    };
    let presented = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(p) if constant_time_eq(p.as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err(unauthorized("wrong bearer token")),
        None => Err(unauthorized(
            "Authorization header is not of the form `Bearer <token>`",
        )),
    }
}

/// Compares without stopping at the first differing byte (the length is not secret).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn sweep_period_is_bounded() {
        assert_eq!(
            sweep_period(Duration::from_millis(1)),
            Duration::from_millis(10)
        );
        assert_eq!(
            sweep_period(Duration::from_millis(400)),
            Duration::from_millis(100)
        );
        assert_eq!(
            sweep_period(Duration::from_secs(3600)),
            Duration::from_secs(1)
        );
    }
}
