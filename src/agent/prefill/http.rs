//! The prefill agent's engine-facing HTTP API: announce a room's KV as ready (whole, or in
//! token and layer pieces), read a room, abort it; the pool, health and metrics. The
//! synthetic engine's fill and its layer-wise pacing live here too.

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReadyRequest {
    /// Tokens of the whole room.
    pub(super) tokens: usize,
    /// The room's key from the router (32 hex digits): only decode requests that carry it
    /// are served.
    #[serde(default)]
    pub(super) room_key: Option<String>,
    #[serde(default)]
    pub(super) pages: Option<Vec<u32>>,
    #[serde(default)]
    pub(super) aux: Option<String>,
    /// The piece's tokens (default: all).
    #[serde(default)]
    pub(super) token_range: Option<[usize; 2]>,
    /// The piece's global layers (default: all this rank holds).
    #[serde(default)]
    pub(super) layer_range: Option<[usize; 2]>,
    /// The engine's last piece for this room (default: true when no range is given).
    #[serde(default)]
    pub(super) last: Option<bool>,
}

type Shared = State<Arc<Inner>>;

pub(super) fn routes(inner: Arc<Inner>) -> Router {
    let router = Router::new()
        .route("/v1/rooms/{room}/ready", post(ready))
        .route("/v1/rooms/{room}", get(get_room).delete(abort_room))
        .route("/v1/pool", get(pool))
        .route(
            "/healthz",
            get(|| async { axum::Json(serde_json::json!({"status": "ok", "role": "prefill"})) }),
        )
        .route("/metrics", get(metrics));
    api::finish(router).with_state(inner)
}

/// A room's pages and, when the agent allocated them, their lease.
type RoomPages = (Arc<[u32]>, Option<Arc<PageLease>>);

/// Pages for a room's first piece: the engine's (validated) or the agent's own.
pub(super) fn room_pages(inner: &Inner, req: &ReadyRequest) -> Result<RoomPages, ApiError> {
    let needed = inner.cfg.layout.pages_for(req.tokens);
    api::fits_pool(req.tokens, needed, inner.pool.num_pages())?;
    match (&req.pages, inner.cfg.synthetic) {
        (Some(pages), _) => {
            api::validate_pages(pages, needed, inner.pool.num_pages())?;
            Ok((pages.as_slice().into(), None))
        }
        (None, true) => {
            let lease = inner
                .alloc
                .allocate(needed)
                .map_err(|e| ApiError::exhausted(e.to_string()))?;
            Ok((lease.pages().into(), Some(Arc::new(lease))))
        }
        (None, false) => Err(ApiError::bad_request(
            "pages are required (the agent fills pages itself only with --synthetic)",
        )),
    }
}

pub(super) async fn ready(
    State(inner): Shared,
    Path(room): Path<String>,
    api::JsonBody(body): api::JsonBody,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    let req: ReadyRequest = api::parse_json(&body)?;
    let l = &inner.cfg.layout;
    if req.tokens == 0 {
        return Err(ApiError::bad_request("tokens must be > 0"));
    }
    let aux = req.aux.as_deref().map(api::unbase64).transpose()?;
    if aux.as_ref().is_some_and(|a| a.len() > protocol::MAX_AUX) {
        return Err(ApiError::bad_request(format!(
            "aux is larger than {} bytes",
            protocol::MAX_AUX
        )));
    }
    let tokens = req.token_range.map_or(0..req.tokens, |[a, b]| a..b);
    let layers = req.layer_range.map_or(l.layers.clone(), |[a, b]| a..b);
    if tokens.is_empty() || tokens.end > req.tokens {
        return Err(ApiError::bad_request(format!(
            "token_range {tokens:?} must be a non-empty range within 0..{}",
            req.tokens
        )));
    }
    if layers.is_empty() || layers.start < l.layers.start || layers.end > l.layers.end {
        return Err(ApiError::bad_request(format!(
            "layer_range {layers:?} must be a non-empty range within this rank's layers {:?}",
            l.layers
        )));
    }
    let known = inner.rooms().contains_key(&room_id);
    if !known && inner.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(ApiError::unavailable(
            "the agent is draining for shutdown: send the room to another prefill rank",
        ));
    }
    let in_flight = inner
        .rooms()
        .values()
        .filter(|r| !r.status.state().is_final())
        .count();
    if !known && in_flight >= inner.cfg.max_rooms {
        inner
            .metrics
            .rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::exhausted(format!(
            "{in_flight} rooms in flight; this agent admits at most {} (--max-rooms)",
            inner.cfg.max_rooms
        )));
    }
    let room_key = api::parse_room_key(req.room_key.as_deref())?;
    let whole = req.token_range.is_none() && req.layer_range.is_none();
    let last = req.last.unwrap_or(whole);
    let piece = Piece { tokens, layers };
    // First piece: pages (outside the lock: allocation may be refused, synthetic fill is slow).
    let first = inner
        .rooms()
        .get(&room_id)
        .is_none_or(|r| r.ready.is_none());
    let fresh = if first {
        Some(room_pages(&inner, &req)?)
    } else {
        None
    };
    let paced = inner.cfg.synthetic && whole && !inner.cfg.synthetic_layer_delay.is_zero();
    let view = {
        let mut rooms = inner.rooms();
        let room = rooms.entry(room_id).or_insert_with(Room::new);
        if room.status.state().is_final() {
            return Err(ApiError::conflict(format!(
                "room {room_id} is {}",
                room.status.state().name()
            )));
        }
        if let Some((pages, lease)) = fresh {
            if room.ready.is_some() {
                return Err(ApiError::conflict(format!(
                    "room {room_id} is already ready"
                )));
            }
            room.ready = Some(Ready {
                tokens: req.tokens,
                pages,
                lease,
                aux: Vec::new(),
                announced: Coverage::new(l.num_layers(), req.tokens, 1),
                last: false,
            });
        }
        if room_key.is_some() && room.key.is_some() && room.key != room_key {
            return Err(ApiError::conflict(format!(
                "room {room_id} was announced with another room_key"
            )));
        }
        room.key = room.key.or(room_key);
        let Some(ready) = room.ready.as_mut() else {
            return Err(ApiError::conflict(format!("room {room_id} lost its pages")));
        };
        if ready.tokens != req.tokens {
            return Err(ApiError::bad_request(format!(
                "room {room_id} has {} tokens, this piece says {}",
                ready.tokens, req.tokens
            )));
        }
        if ready.last {
            return Err(ApiError::conflict(format!(
                "room {room_id}: the last piece was already announced"
            )));
        }
        let local = piece.layers.start - l.layers.start..piece.layers.end - l.layers.start;
        if !ready.announced.claim(local, piece.tokens.clone(), 0..1) {
            return Err(ApiError::conflict(format!(
                "room {room_id}: tokens {:?} x layers {:?} overlap a piece announced before",
                piece.tokens, piece.layers
            )));
        }
        if let Some(aux) = aux {
            ready.aux = aux;
        }
        // Taken under the same lock as the claim: an abort releasing the lease after this
        // point cannot free the pages under the fill.
        let keep = (ready.pages.clone(), ready.lease.clone());
        (room.view(room_id), keep)
    };
    let (view, (pages, lease)) = view;
    if paced {
        tokio::spawn(announce_paced(inner.clone(), room_id, pages, lease, piece));
    } else {
        if inner.cfg.synthetic {
            fill(&inner, room_id, &pages, lease, &piece).await?;
        }
        announce(&inner, room_id, piece, last);
    }
    Ok((axum::http::StatusCode::ACCEPTED, axum::Json(view)).into_response())
}

/// Fills a piece with the synthetic pattern.
pub(super) async fn fill(
    inner: &Arc<Inner>,
    room_id: u64,
    pages: &Arc<[u32]>,
    lease: Option<Arc<PageLease>>,
    piece: &Piece,
) -> Result<(), ApiError> {
    let l0 = inner.cfg.layout.layers.start;
    let (pool, kernel, pages) = (inner.pool.clone(), inner.kernel, pages.clone());
    let (tokens, layers) = (
        piece.tokens.clone(),
        piece.layers.start - l0..piece.layers.end - l0,
    );
    tokio::task::spawn_blocking(move || {
        // The lease travels with the fill: an abort meanwhile cannot hand the pages out.
        let _keep = lease;
        synthetic::fill(&kernel, &pool, room_id, &pages, tokens, layers)
    })
    .await
    .map_err(|e| ApiError::unavailable(e.to_string()))?
    .map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Hands a filled piece to the room's task (starting it if the request is there).
pub(super) fn announce(inner: &Arc<Inner>, room_id: u64, piece: Piece, last: bool) {
    let mut rooms = inner.rooms();
    let Some(room) = rooms.get_mut(&room_id) else {
        return;
    };
    if room.status.state().is_final() {
        return;
    }
    room.pieces.push(piece);
    if last {
        if let Some(ready) = room.ready.as_mut() {
            ready.last = true;
        }
        room.status.mark("ready");
    }
    for t in room.transfers.values() {
        t.wake.notify_one();
    }
    inner.start_ready(room_id, room);
}

/// The synthetic engine's layer-wise prefill: one layer every `synthetic_layer_delay`.
pub(super) async fn announce_paced(
    inner: Arc<Inner>,
    room_id: u64,
    pages: Arc<[u32]>,
    lease: Option<Arc<PageLease>>,
    whole: Piece,
) {
    let delay = inner.cfg.synthetic_layer_delay;
    for layer in whole.layers.clone() {
        tokio::time::sleep(delay).await;
        let piece = Piece {
            tokens: whole.tokens.clone(),
            layers: layer..layer + 1,
        };
        if let Err(e) = fill(&inner, room_id, &pages, lease.clone(), &piece).await {
            tracing::warn!(room = room_id, error = ?e, "synthetic fill failed");
            return;
        }
        announce(&inner, room_id, piece, layer + 1 == whole.layers.end);
    }
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
        .clone()
        .engine_abort(
            room_id,
            Reason::new(FailureCode::Aborted, "aborted by the prefill engine"),
        )
        .await;
    let rooms = inner.rooms();
    let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
    Ok(axum::Json(room.view(room_id)).into_response())
}

pub(super) async fn get_room(
    State(inner): Shared,
    Path(room): Path<String>,
    q: api::WaitQuery,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
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
    api::pool_answer(&inner.alloc)
}

pub(super) async fn metrics(State(inner): Shared) -> Response {
    let mut g = Gauges {
        pool_total: inner.alloc.total_pages(),
        pool_free: inner.alloc.free_pages(),
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
