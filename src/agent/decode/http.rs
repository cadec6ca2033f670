//! The decode agent's engine-facing HTTP API, a layer over its room operations (`rooms.rs`):
//! request a room, take it, and the routes both roles serve ([`api::room_routes`]: read a room,
//! abort it, hold it, the pool, health and metrics, and with `--fault-injection` the test
//! switches).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};

use super::rooms::{RoomRequest, RoomView, TakenRoom};
use super::*;
use crate::agent::api::{self, ApiError};

pub(super) fn routes(inner: Arc<Inner>) -> Router {
    let router = api::room_routes::<Inner>(inner.cfg.fault_injection)
        .route("/v1/rooms/{room}", post(create_room))
        .route("/v1/rooms/{room}/take", post(take_room));
    let token = inner.cfg.token.clone();
    api::finish(router, token).with_state(inner)
}

async fn create_room(
    State(inner): State<Arc<Inner>>,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<(StatusCode, Json<RoomView>), ApiError> {
    let room = api::parse_room(&room)?;
    let req: RoomRequest = api::parse_json(&body)?;
    Ok((StatusCode::CREATED, Json(inner.request_room(room, req)?)))
}

async fn take_room(
    State(inner): State<Arc<Inner>>,
    Path(room): Path<String>,
) -> api::Answer<TakenRoom> {
    let room = api::parse_room(&room)?;
    Ok(Json(inner.take_room(room).await?))
}
