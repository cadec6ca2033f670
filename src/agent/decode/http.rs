//! The decode agent's engine-facing HTTP API, a layer over its engine API (`rooms.rs`): the
//! handlers of its own operations (request a room, take it, look up a prefill group), beside
//! those of the operations both roles have, registered from the engine API's list
//! ([`api::routes`]).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{MethodFilter, MethodRouter, on};
use serde::Deserialize;

use super::Decode;
use super::rooms::{RoomRequest, RoomView, TakenRoom};
use crate::agent::api::{self, ApiError};

/// The engine API's routes (the test switches with `fault_injection`), with the check of
/// `token` (`--token`).
pub(super) fn routes(fault_injection: bool, token: Option<String>) -> axum::Router<Arc<Decode>> {
    api::finish(api::routes(own, fault_injection), token)
}

/// The handler of a decode's own operation, by name.
fn own(name: &str, filter: MethodFilter) -> Option<MethodRouter<Arc<Decode>>> {
    match name {
        "request" => Some(on(filter, request)),
        "take" => Some(on(filter, take)),
        "prefill_group" => Some(on(filter, prefill_group)),
        _ => None,
    }
}

async fn request(
    State(inner): State<Arc<Decode>>,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<(StatusCode, Json<RoomView>), ApiError> {
    let room = api::parse_room(&room)?;
    let req: RoomRequest = api::parse_json(&body)?;
    Ok((StatusCode::CREATED, Json(inner.request(room, req).await?)))
}

async fn take(
    State(inner): State<Arc<Decode>>,
    Path(room): Path<String>,
) -> api::Answer<TakenRoom> {
    let room = api::parse_room(&room)?;
    Ok(Json(inner.take(room).await?))
}

/// `?bootstrap=URL` of `GET /v1/prefill-groups/{dp_rank}`: the registry to ask, when not
/// `--bootstrap`'s.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupQuery {
    bootstrap: Option<String>,
}

async fn prefill_group(
    State(inner): State<Arc<Decode>>,
    Path(dp_rank): Path<String>,
    query: Result<Query<GroupQuery>, axum::extract::rejection::QueryRejection>,
) -> api::Answer<kvferry_bootstrap::PrefillGroup> {
    let dp_rank: u32 = dp_rank
        .parse()
        .map_err(|_| ApiError::Malformed(format!("dp_rank {dp_rank:?} is not a u32")))?;
    let Query(query) = query.map_err(|e| ApiError::Malformed(e.body_text()))?;
    Ok(Json(
        inner
            .prefill_group(query.bootstrap.as_deref(), dp_rank)
            .await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_of_the_role_has_a_route() {
        let _ = routes(true, None);
    }
}
