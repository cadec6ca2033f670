//! The prefill agent's engine-facing HTTP API, a layer over its room operations
//! (`rooms.rs`): announce a room's KV as ready, and the routes both roles serve
//! ([`api::room_routes`]: read a room, abort it, hold it, the pool, health and metrics, and
//! with `--fault-injection` the test switches).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};

use super::rooms::{ReadyRequest, RoomView};
use super::*;
use crate::agent::api::{self, ApiError};

pub(super) fn routes(inner: Arc<Inner>) -> Router {
    let router = api::room_routes::<Inner>(inner.cfg.fault_injection)
        .route("/v1/rooms/{room}/ready", post(ready));
    let token = inner.cfg.token.clone();
    api::finish(router, token).with_state(inner)
}

async fn ready(
    State(inner): State<Arc<Inner>>,
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
