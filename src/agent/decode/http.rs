//! The decode agent's engine-facing HTTP API, a layer over its room operations (`rooms.rs`):
//! request a room, read it (long poll), take it, abort it; the pool, health and metrics.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};

use super::rooms::{HoldRequest, RoomRequest, RoomView, TakenRoom};
use super::*;
use crate::agent::api::{self, ApiError};
use crate::agent::ops::PoolCounts;

type Shared = State<Arc<Inner>>;

pub(super) fn routes(inner: Arc<Inner>) -> Router {
    let router = Router::new()
        .route(
            "/v1/rooms/{room}",
            post(create_room).get(get_room).delete(abort_room),
        )
        .route("/v1/rooms/{room}/take", post(take_room))
        .route("/v1/rooms/{room}/hold", post(hold_room).delete(unhold_room))
        .route("/v1/pool", get(pool))
        .route(
            "/healthz",
            get(|| async { axum::Json(serde_json::json!({"status": "ok", "role": "decode"})) }),
        )
        .route("/metrics", get(metrics));
    api::finish(router).with_state(inner)
}

async fn create_room(
    State(inner): Shared,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<(StatusCode, Json<RoomView>), ApiError> {
    let room = api::parse_room(&room)?;
    let req: RoomRequest = api::parse_json(&body)?;
    Ok((StatusCode::CREATED, Json(inner.request_room(room, req)?)))
}

async fn hold_room(
    State(inner): Shared,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<StatusCode, ApiError> {
    let room = api::parse_room(&room)?;
    let req: HoldRequest = api::parse_json(&body)?;
    inner.hold_room(room, req)?;
    Ok(StatusCode::ACCEPTED)
}

async fn unhold_room(
    State(inner): Shared,
    Path(room): Path<String>,
) -> Result<StatusCode, ApiError> {
    inner.unhold(api::parse_room(&room)?);
    Ok(StatusCode::NO_CONTENT)
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

async fn take_room(State(inner): Shared, Path(room): Path<String>) -> api::Answer<TakenRoom> {
    let room = api::parse_room(&room)?;
    Ok(Json(inner.take_room(room).await?))
}

async fn abort_room(State(inner): Shared, Path(room): Path<String>) -> api::Answer<RoomView> {
    let room = api::parse_room(&room)?;
    Ok(Json(inner.abort_room(room).await?))
}

async fn pool(State(inner): Shared) -> Json<PoolCounts> {
    Json(inner.pool_counts())
}

async fn metrics(State(inner): Shared) -> Response {
    let mut g = Gauges {
        pool_total: inner.alloc.total_pages(),
        pool_free: inner.alloc.free_pages(),
        pool: inner.pool.labels(),
        pinned_bytes: inner.recv_slots.as_ref().map_or(0, |s| s.pinned_bytes()),
        ..Gauges::default()
    };
    for room in inner.rooms().values() {
        g.room(room.status.state());
        g.slots_in_use += room.scattering;
    }
    api::metrics_response(inner.metrics.render(&g))
}
