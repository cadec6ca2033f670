//! The HTTP server: routes, handlers, the extractors that turn axum's rejections into
//! [`ApiError`], bearer-token checking, the lease sweeper and graceful shutdown.
//!
//! Routes (all bodies JSON unless noted; every error is `{"error": "..."}`):
//!
//! | method | path | success | errors |
//! | --- | --- | --- | --- |
//! | POST | `/v1/ranks` | 201 `Admitted` (200 when the same instance re-registers) | 400, 401, 409, 413, 415 |
//! | GET | `/v1/ranks` | 200 `RankList` | 401 |
//! | POST | `/v1/ranks/{instance_id}/heartbeat` | 200 `Lease` | 400, 401, 404 (register again) |
//! | DELETE | `/v1/ranks/{instance_id}` | 204 | 400, 401, 404 |
//! | GET | `/v1/groups/{dp_rank}` | 200 `PrefillGroup` | 400, 401, 503 while incomplete (`Retry-After: 1`) |
//! | GET | `/healthz` | 200 `Health` | |
//! | GET | `/metrics` | 200 OpenMetrics text | 401 |
//!
//! Given a second listener ([`Listeners::metrics`]), the registry also serves the metrics port
//! ([`kvferry_wire::metrics_port`]: `/metrics`, `/livez`, `/readyz`, no token): it is ready
//! while its store answers, and live whatever the store does, so that a liveness probe never
//! restarts a replica because etcd is down.
//!
//! With the etcd store, every route but an unknown one may also answer 503 when etcd cannot
//! be reached in time (see below).
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
//! A registration's answer, and each rank of the list, says why the instance can exchange KV with
//! none of the other role's live instances when that is so (`unmatched`, [`crate::pairing`]);
//! it is registered all the same (an instance that pairs with nobody yet may once a partner
//! registers). A re-registration of the same instance replaces what it said (`draining`).
//!
//! The handlers are the same whatever the store ([`Store`]: in memory, or etcd for replicas):
//! status codes, messages and metrics do not depend on it. A store that cannot reach its
//! backend in time (etcd down) answers 503 `{"error": "registry store unavailable: ..."}` on
//! any route but the unknown ones, and a client with several registry URLs tries the next.

use std::io;
use std::sync::Arc;
use std::time::Duration;

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
use crate::pairing;
use crate::registry::{Registered, RegistryError, millis};
#[cfg(feature = "etcd")]
use crate::store::EtcdStore;
use crate::store::{MemoryStore, Store, StoreConfig, StoreError};
use crate::types::{Admitted, Health, Lease, PrefillGroup, RankList, Registration};

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
    /// Where the registry's state lives.
    pub store: StoreConfig,
    /// HTTPS: the registry's certificate and key (`None`: plain HTTP).
    pub tls: Option<kvferry_wire::tls::ServerTls>,
    /// The build `kvferry_build_info` names on `/metrics` (`None`: no such gauge); the
    /// command line that runs the registry knows it.
    pub build: Option<kvferry_wire::BuildInfo>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            lease_ttl: DEFAULT_LEASE_TTL,
            token: None,
            body_limit: DEFAULT_BODY_LIMIT,
            store: StoreConfig::Memory,
            tls: None,
            build: None,
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

struct AppState<S> {
    store: Arc<S>,
    metrics: Arc<Metrics>,
    token: Option<Arc<str>>,
    body_limit: usize,
}

impl<S> Clone for AppState<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            token: self.token.clone(),
            body_limit: self.body_limit,
        }
    }
}

impl<S: Store> AppState<S> {
    fn lease(&self) -> Lease {
        Lease {
            lease_ttl_ms: millis(self.store.ttl()),
        }
    }
}

/// Where the registry listens: its API, and its metrics port when it has one.
#[derive(Debug)]
pub struct Listeners {
    /// The registry's API (every route of the module doc).
    pub api: TcpListener,
    /// The metrics port ([`kvferry_wire::metrics_port`]), when asked for.
    pub metrics: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    /// The API alone, without a metrics port.
    fn from(api: TcpListener) -> Self {
        Listeners { api, metrics: None }
    }
}

/// Serves the registry on `listener` (its API, and its metrics port when given one), its state
/// in the store `config.store` names, until `shutdown` is cancelled, then lets in-flight
/// requests finish (for at most a few seconds) and returns.
pub async fn serve(
    listener: impl Into<Listeners>,
    config: ServerConfig,
    shutdown: CancellationToken,
) -> io::Result<()> {
    check_ttl(config.lease_ttl)?;
    match &config.store {
        StoreConfig::Memory => {
            let store = MemoryStore::new(config.lease_ttl);
            serve_store(listener, config, store, shutdown).await
        }
        #[cfg(feature = "etcd")]
        StoreConfig::Etcd { endpoints } => {
            let store = EtcdStore::connect(endpoints, config.lease_ttl)
                .await
                .map_err(io::Error::other)?;
            serve_store(listener, config, store, shutdown).await
        }
        #[cfg(not(feature = "etcd"))]
        StoreConfig::Etcd { .. } => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            crate::store::StoreConfigError::EtcdNotBuilt(config.store.to_string()),
        )),
    }
}

fn check_ttl(ttl: Duration) -> io::Result<()> {
    if ttl.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "lease ttl must be > 0",
        ));
    }
    Ok(())
}

/// [`serve`] over `store` (whose lease length wins over `config.lease_ttl`; `config.store` is
/// not looked at).
pub async fn serve_store<S: Store>(
    listener: impl Into<Listeners>,
    config: ServerConfig,
    store: S,
    shutdown: CancellationToken,
) -> io::Result<()> {
    check_ttl(store.ttl())?;
    let Listeners {
        api: listener,
        metrics: metrics_port,
    } = listener.into();
    let period = sweep_period(store.ttl());
    let state = AppState {
        store: Arc::new(store),
        metrics: Arc::new(Metrics::new(config.build)),
        token: config.token.as_deref().map(Arc::from),
        body_limit: config.body_limit,
    };
    let stop_sweeper = shutdown.child_token();
    let sweeper = tokio::spawn(sweep(state.store.clone(), period, stop_sweeper.clone()));
    let watched = Arc::new(Watch {
        store: state.store.clone(),
        metrics: state.metrics.clone(),
    });
    let metrics_port = metrics_port.map(|listener| {
        let serve = kvferry_wire::metrics_port::serve(listener, watched, shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "metrics port stopped");
            }
        })
    });
    let proof = match state.token {
        Some(_) => kvferry_wire::http::Proof::Authorized,
        None => kvferry_wire::http::Proof::Request,
    };
    let app = router(state, config.body_limit);
    let tls = config.tls;
    let server = kvferry_wire::http::serve(listener, app, shutdown.clone(), "registry", proof, tls);
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
    if let Some(port) = metrics_port {
        // It began stopping with the API; what is left of it (a connection still open) is
        // stopped now rather than waited for.
        port.abort();
    }
    result
}

/// What the registry's metrics port reads: its metrics, and whether its store answers.
struct Watch<S> {
    store: Arc<S>,
    metrics: Arc<Metrics>,
}

impl<S: Store> kvferry_wire::metrics_port::Watched for Watch<S> {
    async fn metrics(&self) -> Result<String, String> {
        Ok(self.metrics.render(self.store.stats().await.ok().as_ref()))
    }

    async fn ready(&self) -> Result<(), String> {
        self.store
            .stats()
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

fn router<S: Store>(state: AppState<S>, body_limit: usize) -> Router {
    Router::new()
        .route("/v1/ranks", post(register::<S>).get(list_ranks::<S>))
        .route("/v1/ranks/{instance_id}/heartbeat", post(heartbeat::<S>))
        .route("/v1/ranks/{instance_id}", delete(deregister::<S>))
        .route("/v1/groups/{dp_rank}", get(lookup_prefill::<S>))
        .route("/healthz", get(healthz::<S>))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            authorize::<S>,
        ))
        .layer(middleware::from_fn_with_state(
            state.metrics.clone(),
            count_rejections,
        ))
        .with_state(state)
}

fn sweep_period(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Runs the store's upkeep periodically: the memory store expires leases, so gauges and groups
/// are right even without traffic (every registry operation also expires first, so reads
/// never see a stale lease).
async fn sweep<S: Store>(store: Arc<S>, period: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => store.sweep().await,
        }
    }
}

async fn register<S: Store>(
    State(state): State<AppState<S>>,
    ApiJson(registration): ApiJson<Registration>,
) -> Result<(StatusCode, Json<Admitted>), ApiError> {
    let (id, role, dp, tp, pp) = (
        registration.instance_id,
        registration.role,
        registration.dp_rank,
        registration.tp_rank,
        registration.pp_rank,
    );
    let result = state.store.register(registration.clone()).await;
    let outcome = result.map_err(|e| {
        if let StoreError::Registry(RegistryError::SlotHeld {
            holder,
            remaining_ms,
            ..
        }) = &e
        {
            tracing::warn!(instance_id = %id, %holder, holder_lease_remaining_ms = remaining_ms, %role, dp_rank = dp, tp_rank = tp, pp_rank = pp, "registration refused: the slot is held by another live instance");
        }
        ApiError::from_store(e, state.store.ttl())
    })?;
    let status = match outcome {
        Registered::New => {
            tracing::info!(instance_id = %id, %role, dp_rank = dp, tp_rank = tp, pp_rank = pp, "registered");
            StatusCode::CREATED
        }
        Registered::Refreshed => {
            tracing::debug!(instance_id = %id, draining = registration.about.draining, "re-registered");
            StatusCode::OK
        }
    };
    // Told once, at registration: a failed listing leaves it untold, never the rank unregistered.
    let unmatched = match state.store.list().await {
        Ok(ranks) => pairing::unmatched(&registration, ranks.iter().map(|r| &r.registration)),
        Err(_) => None,
    };
    if let Some(why) = &unmatched {
        tracing::warn!(instance_id = %id, %role, %why, "registered an instance that pairs with nobody");
    }
    let lease = state.lease();
    Ok((status, Json(Admitted { lease, unmatched })))
}

async fn heartbeat<S: Store>(
    State(state): State<AppState<S>>,
    ApiPath(instance_id): ApiPath<Uuid>,
) -> Result<Json<Lease>, ApiError> {
    state.store.heartbeat(instance_id).await?;
    Ok(Json(state.lease()))
}

async fn deregister<S: Store>(
    State(state): State<AppState<S>>,
    ApiPath(instance_id): ApiPath<Uuid>,
) -> Result<StatusCode, ApiError> {
    let r = state.store.deregister(instance_id).await?;
    tracing::info!(instance_id = %instance_id, role = %r.role, dp_rank = r.dp_rank, tp_rank = r.tp_rank, pp_rank = r.pp_rank, "deregistered");
    Ok(StatusCode::NO_CONTENT)
}

async fn list_ranks<S: Store>(
    State(state): State<AppState<S>>,
) -> Result<Json<RankList>, ApiError> {
    let mut ranks = state.store.list().await?;
    let all: Vec<Registration> = ranks.iter().map(|r| r.registration.clone()).collect();
    for rank in &mut ranks {
        rank.unmatched = pairing::unmatched(&rank.registration, &all);
    }
    Ok(Json(RankList { ranks }))
}

async fn lookup_prefill<S: Store>(
    State(state): State<AppState<S>>,
    ApiPath(dp_rank): ApiPath<u32>,
) -> Result<Json<PrefillGroup>, ApiError> {
    let result = state.store.lookup_prefill(dp_rank).await;
    match &result {
        Ok(_) => state.metrics.lookup(true),
        Err(StoreError::Registry(RegistryError::Incomplete { .. })) => state.metrics.lookup(false),
        Err(_) => {}
    }
    Ok(Json(result?))
}

async fn healthz<S: Store>(State(state): State<AppState<S>>) -> Result<Json<Health>, ApiError> {
    let stats = state.store.stats().await?;
    Ok(Json(Health {
        status: "ok".to_owned(),
        prefill_ranks: stats.prefill_ranks,
        decode_ranks: stats.decode_ranks,
        groups: stats.groups,
    }))
}

async fn metrics<S: Store>(State(state): State<AppState<S>>) -> Result<Response, ApiError> {
    let body = state
        .metrics
        .render(state.store.stats().await.ok().as_ref());
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(kvferry_wire::http::OPENMETRICS_CONTENT_TYPE),
        )],
        body,
    )
        .into_response())
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

impl<S: Store, T: DeserializeOwned> FromRequest<AppState<S>> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState<S>) -> Result<Self, Self::Rejection> {
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
/// carries `Authorization: Bearer TOKEN`; answers 401 otherwise. A request let through proves
/// its connection ([`kvferry_wire::http::prove`]).
async fn authorize<S: Store>(
    State(state): State<AppState<S>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(token) = state.token.as_deref() else {
        return next.run(req).await;
    };
    if req.uri().path() == "/healthz" && req.method() == Method::GET {
        kvferry_wire::http::prove(&req);
        return next.run(req).await;
    }
    match check_bearer(req.headers().get(header::AUTHORIZATION), token) {
        Ok(()) => {
            kvferry_wire::http::prove(&req);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

fn check_bearer(value: Option<&HeaderValue>, token: &str) -> Result<(), ApiError> {
    kvferry_wire::http::check_bearer(value, token).map_err(|e| {
        let message = match e {
            kvferry_wire::http::BearerError::Missing => format!("{e} on every route but /healthz"),
            _ => e.to_string(),
        };
        ApiError::rejected(RejectReason::Unauthorized, message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
