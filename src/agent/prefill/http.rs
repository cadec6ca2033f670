//! The prefill agent's engine-facing HTTP API, a layer over its room operations
//! (`rooms.rs`): announce a room's KV as ready, read a room (long poll), abort it; the pool,
//! health and metrics.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};

use super::rooms::{ReadyRequest, RoomView};
use super::*;
use crate::agent::api::{self, ApiError};
use crate::agent::ops::PoolCounts;

type Shared = State<Arc<Inner>>;

pub(super) fn routes(inner: Arc<Inner>) -> Router {
    let router = Router::new()
        .route("/v1/rooms/{room}/ready", post(ready))
        .route("/v1/rooms/{room}", get(get_room).delete(abort_room))
        .route("/v1/rooms/{room}/hold", post(hold_room).delete(unhold_room))
        .route("/v1/pool", get(pool))
        .route(
            "/healthz",
            get(|| async { axum::Json(serde_json::json!({"status": "ok", "role": "prefill"})) }),
        )
        .route("/metrics", get(metrics));
    api::finish(router).with_state(inner)
}

/// The body of `POST /v1/rooms/{room}/hold` at a prefill: `{}`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Hold {}

async fn hold_room(
    State(inner): Shared,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<StatusCode, ApiError> {
    let room = api::parse_room(&room)?;
    let Hold {} = api::parse_json(&body)?;
    inner.hold_room(room)?;
    Ok(StatusCode::ACCEPTED)
}

async fn unhold_room(
    State(inner): Shared,
    Path(room): Path<String>,
) -> Result<StatusCode, ApiError> {
    inner.holds.release(api::parse_room(&room)?);
    Ok(StatusCode::NO_CONTENT)
}

async fn ready(
    State(inner): Shared,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<(StatusCode, Json<RoomView>), ApiError> {
    let room = api::parse_room(&room)?;
    let req: ReadyRequest = api::parse_json(&body)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(inner.ready(room, req, None).await?),
    ))
}

async fn abort_room(State(inner): Shared, Path(room): Path<String>) -> api::Answer<RoomView> {
    let room = api::parse_room(&room)?;
    Ok(Json(inner.abort_room(room).await?))
}

async fn get_room(
    State(inner): Shared,
    Path(room): Path<String>,
    q: api::WaitQuery,
) -> api::Answer<RoomView> {
    let room = api::parse_room(&room)?;
    Ok(Json(match q.wait_ms {
        Some(ms) => inner.wait_room(room, Duration::from_millis(ms)).await?,
        None => inner.room_view(room)?,
    }))
}

async fn pool(State(inner): Shared) -> Json<PoolCounts> {
    Json(PoolCounts::of(&inner.alloc))
}

async fn metrics(State(inner): Shared) -> Response {
    let mut g = Gauges {
        pool_total: inner.alloc.total_pages(),
        pool_free: inner.alloc.free_pages(),
        pool: inner.pool.labels(),
        pinned_bytes: inner.slots.pinned_bytes(),
        ..Gauges::default()
    };
    for room in inner.rooms().values() {
        g.room(room.status.state());
    }
    for peer in inner.peers().values() {
        g.slots_in_use += peer.slots.saturating_sub(peer.credits.available_permits());
    }
    api::metrics_response(inner.metrics.render(&g))
}
