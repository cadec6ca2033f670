//! The prefill agent's engine-facing HTTP API, a layer over its engine API (`rooms.rs`): the
//! handler of its own operation (announce a room's KV as ready), beside those of the
//! operations both roles have, registered from the engine API's list ([`api::routes`]).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{MethodFilter, MethodRouter, on};

use super::Prefill;
use super::rooms::{ReadyRequest, RoomView};
use crate::agent::api::{self, ApiError};

/// The engine API's routes (the test switches with `fault_injection`), with the check of
/// `token` (`--token`).
pub(super) fn routes(fault_injection: bool, token: Option<String>) -> axum::Router<Arc<Prefill>> {
    api::finish(api::routes(own, fault_injection), token)
}

/// The handler of a prefill's own operation, by name.
fn own(name: &str, filter: MethodFilter) -> Option<MethodRouter<Arc<Prefill>>> {
    match name {
        "ready" => Some(on(filter, ready)),
        _ => None,
    }
}

async fn ready(
    State(inner): State<Arc<Prefill>>,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<(StatusCode, Json<RoomView>), ApiError> {
    let room = api::parse_room(&room)?;
    let req: ReadyRequest = api::parse_json(&body)?;
    Ok((StatusCode::ACCEPTED, Json(inner.ready(room, req).await?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_of_the_role_has_a_route() {
        let _ = routes(true, None);
    }
}
