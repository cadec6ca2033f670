//! The decode agent's engine-facing HTTP API: request a room, read it (long poll), take it,
//! abort it; the pool, health and metrics.

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RoomRequest {
    pub(super) tokens: usize,
    /// Tokens the decode already holds (its prefix cache): only the rest moves.
    #[serde(default)]
    pub(super) start_token: usize,
    #[serde(default)]
    pub(super) pages: Option<Vec<u32>>,
    #[serde(default)]
    pub(super) bootstrap: Option<String>,
    #[serde(default)]
    pub(super) dp_rank: Option<u32>,
    /// The room's key from the router (32 hex digits), when the prefill engine was given one.
    #[serde(default)]
    pub(super) room_key: Option<String>,
}

type Shared = State<Arc<Inner>>;

pub(super) fn routes(inner: Arc<Inner>) -> Router {
    let router = Router::new()
        .route(
            "/v1/rooms/{room}",
            post(create_room).get(get_room).delete(abort_room),
        )
        .route("/v1/rooms/{room}/take", post(take_room))
        .route("/v1/pool", get(pool))
        .route(
            "/healthz",
            get(|| async { axum::Json(serde_json::json!({"status": "ok", "role": "decode"})) }),
        )
        .route("/metrics", get(metrics));
    api::finish(router).with_state(inner)
}

pub(super) async fn create_room(
    State(inner): Shared,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    let req: RoomRequest = api::parse_json(&body)?;
    if inner.shutdown.is_cancelled() || inner.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(ApiError::unavailable(
            "the agent is draining for shutdown: send the room to another decode rank",
        ));
    }
    let in_flight = inner
        .rooms()
        .values()
        .filter(|r| !r.status.state().is_final())
        .count();
    if in_flight >= inner.cfg.max_rooms {
        inner
            .metrics
            .rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::exhausted(format!(
            "{in_flight} rooms in flight; this agent admits at most {} (--max-rooms)",
            inner.cfg.max_rooms
        )));
    }
    let l = &inner.cfg.layout;
    if req.tokens == 0 {
        return Err(ApiError::bad_request("tokens must be > 0"));
    }
    let room_key = api::parse_room_key(req.room_key.as_deref())?;
    if req.start_token >= req.tokens {
        return Err(ApiError::bad_request(format!(
            "start_token {} must be < tokens {}: there must be something to transfer",
            req.start_token, req.tokens
        )));
    }
    if u32::try_from(req.tokens).is_err() {
        return Err(ApiError::bad_request(format!(
            "tokens {} is beyond the protocol's u32",
            req.tokens
        )));
    }
    let needed = l.pages_for(req.tokens);
    api::fits_pool(req.tokens, needed, inner.pool.num_pages())?;
    let expected = l
        .room_bytes(req.tokens - req.start_token)
        .map_err(|e| ApiError::bad_request(format!("tokens {}: {e}", req.tokens)))?;
    let (pages, lease): (Arc<[u32]>, _) = match req.pages {
        Some(pages) => {
            api::validate_pages(&pages, needed, inner.pool.num_pages())?;
            (pages.into(), None)
        }
        None => {
            let lease = inner.alloc.allocate(needed).map_err(|e| {
                inner
                    .metrics
                    .rejected
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                ApiError::exhausted(e.to_string())
            })?;
            (lease.pages().into(), Some(lease))
        }
    };
    let view = {
        let mut rooms = inner.rooms();
        if rooms.contains_key(&room_id) {
            return Err(ApiError::conflict(format!("room {room_id} already exists")));
        }
        let room = Room {
            status: RoomStatus::default(),
            tokens: req.tokens,
            start_token: req.start_token,
            pages,
            lease,
            returned: false,
            expected,
            landed: 0,
            chunks: 0,
            coverage: Coverage::new(l.num_layers(), req.tokens, l.num_heads()),
            sources: Vec::new(),
            acks_pending: 0,
            scattering: 0,
            stop_told: false,
            final_at: None,
            progress_at: Instant::now(),
        };
        let view = room.view(room_id);
        rooms.insert(room_id, room);
        view
    };
    let task_inner = inner.clone();
    let span = tracing::info_span!("room", room = room_id, role = "decode");
    tokio::spawn(
        async move {
            if let Err(reason) = task_inner
                .clone()
                .request(room_id, req.bootstrap, req.dp_rank, room_key)
                .await
            {
                task_inner.fail(room_id, reason);
            }
        }
        .instrument(span),
    );
    Ok((axum::http::StatusCode::CREATED, axum::Json(view)).into_response())
}

pub(super) async fn get_room(
    State(inner): Shared,
    Path(room): Path<String>,
    q: api::WaitQuery,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    inner.return_aborted_pages();
    api::room_answer(q.wait_ms, || {
        let rooms = inner.rooms();
        let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
        let changing = !room.safe_to_reuse();
        Ok((
            room.view(room_id),
            changing.then(|| room.status.subscribe()),
        ))
    })
    .await
}

pub(super) async fn pool(State(inner): Shared) -> Response {
    inner.return_aborted_pages();
    api::pool_answer(&inner.alloc)
}

impl Inner {
    /// Returns the agent-owned pages of every aborted room that is safe to reuse to the pool,
    /// without waiting for the room to be taken or to expire (the room itself stays readable
    /// and takeable until then). Called on every housekeeping tick and before answering
    /// `GET /v1/pool` and `GET /v1/rooms/{room}`, so the pool is whole as soon as it can be.
    pub(super) fn return_aborted_pages(&self) {
        for (id, room) in self.rooms().iter_mut() {
            if room.lease.is_some()
                && room.status.state() == RoomState::Aborted
                && room.safe_to_reuse()
            {
                let pages = room.pages.len();
                room.lease = None;
                room.returned = true;
                tracing::debug!(
                    room = id,
                    pages,
                    "aborted room's pages returned to the pool"
                );
            }
        }
    }
}

pub(super) async fn take_room(
    State(inner): Shared,
    Path(room): Path<String>,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    let (pages, tokens) = {
        let rooms = inner.rooms();
        let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
        if !room.safe_to_reuse() {
            let state = room.status.state();
            let why = if state.is_final() {
                format!(
                    "room {room_id} is {} but a write into its pages is still finishing; take it once safe_to_reuse is true",
                    state.name()
                )
            } else {
                format!(
                    "room {room_id} is {}; take it once it is success, failed or aborted",
                    state.name()
                )
            };
            return Err(ApiError::conflict(why));
        }
        (room.pages.clone(), room.start_token..room.tokens)
    };
    let mut verified = None;
    let succeeded = inner
        .rooms()
        .get(&room_id)
        .is_some_and(|r| r.status.state() == RoomState::Success);
    if inner.cfg.synthetic && succeeded {
        let (pool, kernel) = (inner.pool.clone(), inner.kernel);
        let check = tokio::task::spawn_blocking(move || {
            crate::agent::synthetic::verify(&kernel, &pool, room_id, &pages, tokens)
        })
        .await;
        let result = check
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        verified = Some(result.is_ok());
        if let Err(e) = result {
            let mut rooms = inner.rooms();
            if let Some(room) = rooms.get_mut(&room_id) {
                if room
                    .status
                    .fail_verification(Reason::new(FailureCode::VerifyFailed, e.clone()))
                {
                    inner
                        .metrics
                        .verify_failures
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            tracing::error!(room = room_id, error = %e, "landed bytes differ from the synthetic pattern");
        }
    }
    let room = inner
        .rooms()
        .remove(&room_id)
        .ok_or(ApiError::unknown_room(room_id))?;
    let mut view = room.view(room_id);
    view["verified"] = serde_json::json!(verified);
    let aux = room
        .sources
        .iter()
        .filter_map(|s| s.done.as_ref())
        .map(|d| &d.aux)
        .find(|a| !a.is_empty());
    view["aux"] = serde_json::json!(aux.map(|a| api::base64(a)));
    Ok(axum::Json(view).into_response())
}

pub(super) async fn abort_room(
    State(inner): Shared,
    Path(room): Path<String>,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    if !inner.rooms().contains_key(&room_id) {
        return Err(ApiError::unknown_room(room_id));
    }
    inner
        .abort(
            room_id,
            Reason::new(FailureCode::Aborted, "aborted by the decode engine"),
        )
        .await;
    let rooms = inner.rooms();
    let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
    Ok(axum::Json(room.view(room_id)).into_response())
}

pub(super) async fn metrics(State(inner): Shared) -> Response {
    let mut g = Gauges {
        pool_total: inner.alloc.total_pages(),
        pool_free: inner.alloc.free_pages(),
        ..Gauges::default()
    };
    for room in inner.rooms().values() {
        g.room(room.status.state());
        g.slots_in_use += room.scattering;
    }
    api::metrics_response(inner.metrics.render(&g))
}
