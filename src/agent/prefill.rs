//! The prefill agent: registers its rank, answers Hello from decode agents (version, token,
//! layout, and reachability of the decode's data endpoint), and for each room pushes the
//! pages the engine announced as ready once the decode has asked for them, then sends Done.
//!
//! The engine's ready and the decode's request may arrive in either order; the transfer starts
//! when both are there. Each transfer runs on its own task: gather a chunk on a blocking
//! thread, hand it to the data plane, next chunk; an Abort stops it between chunks and is
//! acknowledged once nothing more will be sent. Pages the agent allocated (`--synthetic`)
//! return to its pool when the transfer ends; pages an engine named are safe to reuse once the
//! room is final (every gather has finished).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvferry_bootstrap::{RegistryClient, Role};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::api::{self, ApiError, Metrics};
use super::room::{RoomState, RoomStatus};
use super::{AgentConfig, plan_chunks, synthetic};
use crate::kernel::Selection;
use crate::kernel::cpu::CpuKernel;
use crate::pool::HostPool;
use crate::pool::allocator::{PageAllocator, PageLease};
use crate::protocol::{self, Chunk, ErrorMsg, Hello, HelloAck, Message, TransferRequest};
use crate::reason::{FailureCode, Reason};
use crate::transport::zmq::{ControlReplier, ControlServer, PeerId};
use crate::transport::{self, DataSender, Transport};

/// A running prefill agent.
#[derive(Debug)]
pub struct PrefillAgent {
    /// The engine-facing HTTP API.
    pub api_url: String,
    /// This process's instance id.
    pub instance: Uuid,
    /// The control endpoint decode agents connect to.
    pub control_endpoint: String,
    tasks: tokio::task::JoinSet<()>,
    keep_alive: kvferry_bootstrap::KeepAlive,
}

impl PrefillAgent {
    /// Starts the agent; it serves until `shutdown` is cancelled.
    pub async fn start(
        cfg: AgentConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, super::AgentError> {
        let instance = Uuid::new_v4();
        let pool = Arc::new(HostPool::anonymous(cfg.layout.clone(), cfg.pool_pages)?);
        let registry = RegistryClient::new(cfg.bootstrap.clone(), cfg.token.clone())?;
        let (control_endpoint, server, replier) = ControlServer::bind(&cfg.host).await?;
        let listener = tokio::net::TcpListener::bind((cfg.api_host.as_str(), cfg.api_port)).await?;
        let api_url = format!("http://{}", listener.local_addr()?);
        let inner = Arc::new(Inner {
            instance,
            alloc: PageAllocator::new(cfg.pool_pages as u32),
            pool,
            kernel: CpuKernel::new(cfg.copy_threads),
            transport: transport::for_kind(cfg.transport),
            replier,
            rooms: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            metrics: Metrics::new(),
            shutdown: shutdown.clone(),
            cfg,
        });
        let reg = super::registration(
            Role::Prefill,
            instance,
            &inner.cfg,
            control_endpoint.clone(),
            Default::default(),
        );
        let keep_alive = registry.keep_alive(reg, shutdown.clone()).await?;
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(control_loop(inner.clone(), server));
        tasks.spawn(expire_rooms(inner.clone()));
        let app = routes(inner.clone());
        let stop = shutdown.clone();
        tasks.spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "prefill API stopped");
            }
        });
        tracing::info!(%instance, api = %api_url, control = %control_endpoint, "prefill agent listening");
        Ok(PrefillAgent {
            api_url,
            instance,
            control_endpoint,
            tasks,
            keep_alive,
        })
    }

    /// Waits for the agent's tasks to end after shutdown was cancelled, and deregisters.
    pub async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
        self.keep_alive.stopped().await;
    }
}

struct Inner {
    cfg: AgentConfig,
    instance: Uuid,
    pool: Arc<HostPool>,
    alloc: PageAllocator,
    kernel: CpuKernel,
    transport: Arc<dyn Transport>,
    replier: ControlReplier,
    rooms: Mutex<HashMap<u64, Room>>,
    /// Decode peers by their control identity.
    peers: Mutex<HashMap<PeerId, Arc<Peer>>>,
    metrics: Metrics,
    shutdown: CancellationToken,
}

struct Peer {
    instance: Uuid,
    identity: PeerId,
    data_endpoint: String,
    data: tokio::sync::Mutex<Box<dyn DataSender>>,
}

struct Ready {
    tokens: usize,
    pages: Arc<[u32]>,
    /// Present when the agent allocated (and filled) the pages.
    lease: Option<PageLease>,
    aux: Vec<u8>,
}

struct Room {
    status: RoomStatus,
    request: Option<(Arc<Peer>, TransferRequest)>,
    ready: Option<Ready>,
    sent: usize,
    cancel: CancellationToken,
    running: bool,
    final_at: Option<Instant>,
}

impl Room {
    fn new() -> Self {
        Room {
            status: RoomStatus::default(),
            request: None,
            ready: None,
            sent: 0,
            cancel: CancellationToken::new(),
            running: false,
            final_at: None,
        }
    }

    fn view(&self, room: u64) -> serde_json::Value {
        serde_json::json!({
            "room": room.to_string(),
            "state": self.status.state(),
            "reason": self.status.reason(),
            "bytes": self.sent,
            "tokens": self.ready.as_ref().map(|r| r.tokens),
            "decode_instance": self.request.as_ref().map(|(p, _)| p.instance.to_string()),
            "timings": self.status.timings_json(),
            "safe_to_reuse": self.status.state().is_final() && !self.running,
        })
    }
}

impl Inner {
    fn rooms(&self) -> MutexGuard<'_, HashMap<u64, Room>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finished(&self, room: &mut Room) {
        if room.status.state().is_final() && room.final_at.is_none() {
            room.final_at = Some(Instant::now());
            self.metrics
                .room_final(room.status.state(), room.status.reason().map(|r| r.code));
            // The agent's own pages go back to the pool once no gather reads them.
            if !room.running {
                if let Some(ready) = &mut room.ready {
                    ready.lease = None;
                }
            }
        }
    }

    async fn reply(&self, peer: &PeerId, msg: Message) {
        let mut replier = self.replier.clone();
        let sent = tokio::time::timeout(
            self.cfg.timeouts.send,
            replier.send(peer, msg.encode().into()),
        )
        .await;
        if !matches!(sent, Ok(Ok(()))) {
            tracing::warn!(msg = msg.name(), "could not answer a decode peer");
        }
    }

    async fn refuse(&self, peer: &PeerId, room: Option<u64>, code: FailureCode, message: String) {
        tracing::warn!(?room, %code, %message, "refused a decode request");
        self.reply(
            peer,
            Message::Error(ErrorMsg {
                room,
                code,
                message,
            }),
        )
        .await;
    }

    async fn on_hello(self: Arc<Self>, identity: PeerId, hello: Hello) {
        let refuse = |code, message| self.refuse(&identity, None, code, message);
        let Some(version) = protocol::negotiate(hello.min_version, hello.max_version) else {
            return refuse(
                FailureCode::IncompatibleVersion,
                format!(
                    "decode speaks protocol versions {}..={}, this prefill {}..={}",
                    hello.min_version,
                    hello.max_version,
                    protocol::MIN_VERSION,
                    protocol::VERSION
                ),
            )
            .await;
        };
        if self.cfg.token.as_deref().unwrap_or("") != hello.token {
            return refuse(
                FailureCode::Unauthorized,
                "wrong or missing token in Hello".to_owned(),
            )
            .await;
        }
        if hello.role != protocol::Role::Decode {
            return refuse(
                FailureCode::BadMessage,
                "Hello to a prefill must come from a decode".to_owned(),
            )
            .await;
        }
        if let Err(reason) =
            super::check_compatible(&super::wire_layout(&self.cfg.layout), &hello.layout)
        {
            return refuse(reason.code, reason.message).await;
        }
        let data = match self
            .transport
            .connect(&hello.data_endpoint, self.cfg.timeouts.connect)
            .await
        {
            Ok(d) => d,
            Err(e) => {
                let msg = format!(
                    "decode data endpoint {} unreachable from this prefill: {}",
                    hello.data_endpoint, e.message
                );
                return refuse(FailureCode::Unreachable, msg).await;
            }
        };
        let peer = Arc::new(Peer {
            instance: hello.instance,
            identity: identity.clone(),
            data_endpoint: hello.data_endpoint,
            data: tokio::sync::Mutex::new(data),
        });
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(identity.clone(), peer);
        tracing::info!(decode = %hello.instance, version, "decode peer connected");
        self.reply(
            &identity,
            Message::HelloAck(HelloAck {
                version,
                instance: self.instance,
            }),
        )
        .await;
    }

    async fn on_request(self: Arc<Self>, identity: PeerId, req: TransferRequest) {
        let room_id = req.room;
        let peer = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&identity)
            .cloned();
        let Some(peer) = peer else {
            let m = "TransferRequest before Hello".to_owned();
            return self
                .refuse(&identity, Some(room_id), FailureCode::BadMessage, m)
                .await;
        };
        if req.prefill_instance != self.instance {
            let m = format!(
                "request addressed instance {}, this prefill is {}: it restarted",
                req.prefill_instance, self.instance
            );
            return self
                .refuse(&identity, Some(room_id), FailureCode::PeerDead, m)
                .await;
        }
        let l = &self.cfg.layout;
        let within = |r: &std::ops::Range<u32>, held: &std::ops::Range<usize>| {
            r.start as usize >= held.start && r.end as usize <= held.end && !r.is_empty()
        };
        if !within(&req.layers, &l.layers) || !within(&req.heads, &l.heads) || req.tokens.is_empty()
        {
            let m = format!(
                "request for layers {:?} heads {:?} tokens {:?}; this rank holds layers {:?} heads {:?}",
                req.layers, req.heads, req.tokens, l.layers, l.heads
            );
            return self
                .refuse(&identity, Some(room_id), FailureCode::BadMessage, m)
                .await;
        }
        let refusal = {
            let mut rooms = self.rooms();
            let room = rooms.entry(room_id).or_insert_with(Room::new);
            if room.request.is_some() || room.status.state().is_final() {
                Some(Reason::new(
                    FailureCode::BadMessage,
                    format!("room {room_id} was already requested"),
                ))
            } else {
                room.request = Some((peer, req));
                room.status.advance(RoomState::WaitingForInput);
                self.start_if_ready(room_id, room)
            }
        };
        if let Some(reason) = refusal {
            self.refuse(&identity, Some(room_id), reason.code, reason.message)
                .await;
        }
    }

    /// Starts the transfer when both the request and the ready pages are there. Returns the
    /// reason when they cannot be served together.
    fn start_if_ready(self: &Arc<Self>, room_id: u64, room: &mut Room) -> Option<Reason> {
        let (Some((peer, req)), Some(ready)) = (&room.request, &room.ready) else {
            return None;
        };
        if room.running || room.status.state().is_final() {
            return None;
        }
        if req.tokens.end as usize > ready.tokens {
            let reason = Reason::new(
                FailureCode::BadMessage,
                format!(
                    "decode asks for tokens {:?}; the engine announced {}",
                    req.tokens, ready.tokens
                ),
            );
            room.status.fail(reason.clone());
            self.finished(room);
            return Some(reason);
        }
        room.running = true;
        room.status.advance(RoomState::Transferring);
        let job = Job {
            room: room_id,
            peer: peer.clone(),
            req: req.clone(),
            pages: ready.pages.clone(),
            aux: ready.aux.clone(),
            cancel: room.cancel.clone(),
        };
        tokio::spawn(self.clone().transfer(job));
        None
    }

    async fn transfer(self: Arc<Self>, job: Job) {
        let outcome = self.push_chunks(&job).await;
        let ack = match outcome {
            Ok(chunks) if !job.cancel.is_cancelled() => Message::Done(protocol::Done {
                room: job.room,
                prefill_instance: self.instance,
                chunks,
                bytes: self.rooms().get(&job.room).map_or(0, |r| r.sent as u64),
                aux: job.aux.clone(),
            }),
            Ok(_) => Message::AbortAck(protocol::AbortAck {
                room: job.room,
                instance: self.instance,
            }),
            Err(ref reason) => Message::Error(ErrorMsg {
                room: Some(job.room),
                code: reason.code,
                message: reason.message.clone(),
            }),
        };
        {
            let mut rooms = self.rooms();
            if let Some(room) = rooms.get_mut(&job.room) {
                room.running = false;
                match (&outcome, &ack) {
                    (Err(reason), _) => {
                        room.status.fail(reason.clone());
                    }
                    (_, Message::AbortAck(_)) => {
                        room.status.advance(RoomState::Aborted);
                    }
                    _ => {
                        room.status.advance(RoomState::Success);
                    }
                }
                self.finished(room);
            }
        }
        self.reply(&job.peer.identity, ack).await;
    }

    /// Gathers and sends every chunk of a room; returns the chunk count. The gather of chunk
    /// i+1 runs on a blocking thread while chunk i is being sent.
    async fn push_chunks(&self, job: &Job) -> Result<u32, Reason> {
        let l = &self.cfg.layout;
        let heads = job.req.heads.start as usize - l.heads.start
            ..job.req.heads.end as usize - l.heads.start;
        let per_token_layer = l.selection_bytes(1, 1, heads.len()).unwrap_or(usize::MAX);
        let tokens = job.req.tokens.start as usize..job.req.tokens.end as usize;
        let layers = job.req.layers.start as usize..job.req.layers.end as usize;
        let plan = plan_chunks(
            tokens,
            layers,
            per_token_layer,
            l.page_size,
            self.cfg.chunk_bytes,
        );
        let gather = |c: &super::ChunkPlan| {
            let local = c.layers.start - l.layers.start..c.layers.end - l.layers.start;
            let (pool, kernel, pages, wire) = (
                self.pool.clone(),
                self.kernel,
                job.pages.clone(),
                job.req.wire_order,
            );
            let (tokens, heads) = (c.tokens.clone(), heads.clone());
            tokio::task::spawn_blocking(move || {
                let sel = Selection {
                    pages: &pages,
                    tokens,
                    layers: local,
                    heads,
                };
                let mut buf = vec![0u8; sel.bytes(&pool)?];
                kernel.gather(&pool, &sel, wire, &mut buf).map(|()| buf)
            })
        };
        let mut next = plan.first().map(gather);
        for (seq, c) in plan.iter().enumerate() {
            let Some(pending) = next.take() else { break };
            let bytes = match pending.await {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => {
                    return Err(Reason::new(FailureCode::BadMessage, format!("gather: {e}")));
                }
                Err(e) => {
                    return Err(Reason::new(
                        FailureCode::BadMessage,
                        format!("gather stopped: {e}"),
                    ));
                }
            };
            if job.cancel.is_cancelled() {
                return Ok(seq as u32);
            }
            next = plan.get(seq + 1).map(gather);
            let len = bytes.len();
            let header = Message::Chunk(Chunk {
                room: job.room,
                prefill_instance: self.instance,
                seq: seq as u32,
                tokens: c.tokens.start as u32..c.tokens.end as u32,
                layers: c.layers.start as u32..c.layers.end as u32,
                heads: job.req.heads.clone(),
                len: len as u64,
                checksum: 0,
            });
            let timeout = self.cfg.timeouts.send;
            let sent = tokio::time::timeout(timeout, async {
                job.peer
                    .data
                    .lock()
                    .await
                    .send(header.encode().into(), bytes.into())
                    .await
            })
            .await;
            match sent {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(Reason::new(FailureCode::PeerDead, e.to_string())),
                Err(_) => {
                    let m = format!(
                        "decode data endpoint {} took no chunk within {timeout:?}",
                        job.peer.data_endpoint
                    );
                    return Err(Reason::new(FailureCode::TimeoutStall, m));
                }
            }
            self.metrics
                .bytes
                .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
            if let Some(room) = self.rooms().get_mut(&job.room) {
                room.sent += len;
            }
        }
        Ok(plan.len() as u32)
    }

    async fn on_abort(self: Arc<Self>, identity: PeerId, abort: protocol::Abort) {
        let running = {
            let mut rooms = self.rooms();
            match rooms.get_mut(&abort.room) {
                Some(room) if room.running => {
                    room.cancel.cancel();
                    true
                }
                Some(room) => {
                    room.status
                        .abort(Reason::new(abort.code, abort.message), true);
                    self.finished(room);
                    false
                }
                None => false,
            }
        };
        // A running transfer acknowledges when it stops; otherwise nothing is in flight.
        if !running {
            let ack = Message::AbortAck(protocol::AbortAck {
                room: abort.room,
                instance: self.instance,
            });
            self.reply(&identity, ack).await;
        }
    }
}

struct Job {
    room: u64,
    peer: Arc<Peer>,
    req: TransferRequest,
    pages: Arc<[u32]>,
    aux: Vec<u8>,
    cancel: CancellationToken,
}

async fn control_loop(inner: Arc<Inner>, mut server: ControlServer) {
    loop {
        let received = tokio::select! {
            () = inner.shutdown.cancelled() => return,
            r = server.recv() => r,
        };
        let (identity, frame) = match received {
            Ok(v) => v,
            Err(e) => {
                inner
                    .metrics
                    .bad_messages
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(error = %e, "control socket");
                continue;
            }
        };
        let inner = inner.clone();
        match Message::decode(&frame) {
            Ok(Message::Hello(h)) => {
                tokio::spawn(inner.on_hello(identity, h));
            }
            Ok(Message::TransferRequest(r)) => inner.on_request(identity, r).await,
            Ok(Message::Abort(a)) => inner.on_abort(identity, a).await,
            Ok(Message::Heartbeat(_)) => {}
            Ok(other) => {
                inner
                    .metrics
                    .bad_messages
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let m = format!("a prefill does not accept {}", other.name());
                inner
                    .refuse(&identity, None, FailureCode::BadMessage, m)
                    .await;
            }
            Err(e) => {
                inner
                    .metrics
                    .bad_messages
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                inner
                    .refuse(
                        &identity,
                        None,
                        FailureCode::BadMessage,
                        format!("undecodable frame: {e}"),
                    )
                    .await;
            }
        }
    }
}

async fn expire_rooms(inner: Arc<Inner>) {
    let ttl = inner.cfg.timeouts.room_ttl;
    let mut tick = tokio::time::interval(Duration::from_millis(200).min(ttl));
    loop {
        tokio::select! {
            () = inner.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        inner.rooms().retain(|_, room| {
            let old = room.final_at.is_some_and(|t| t.elapsed() >= ttl);
            // Ready pages no decode ever asked for are released after the same TTL.
            let orphan = room.request.is_none()
                && room
                    .status
                    .entered(RoomState::Bootstrapping)
                    .is_some_and(|t| super::room::now_ms() - t >= ttl.as_secs_f64() * 1e3);
            !(old || orphan) || room.running
        });
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadyRequest {
    tokens: usize,
    #[serde(default)]
    pages: Option<Vec<u32>>,
    #[serde(default)]
    aux: Option<String>,
}

#[derive(Deserialize)]
struct WaitQuery {
    wait_ms: Option<u64>,
}

type Shared = State<Arc<Inner>>;

fn routes(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/v1/rooms/{room}/ready", post(ready))
        .route("/v1/rooms/{room}", get(get_room))
        .route("/v1/pool", get(pool))
        .route(
            "/healthz",
            get(|| async { axum::Json(serde_json::json!({"status": "ok", "role": "prefill"})) }),
        )
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::bad_request("no such route").into_response() })
        .with_state(inner)
}

async fn ready(
    State(inner): Shared,
    Path(room): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    let req: ReadyRequest = api::parse_json(&body)?;
    if req.tokens == 0 {
        return Err(ApiError::bad_request("tokens must be > 0"));
    }
    let aux = match &req.aux {
        Some(text) => api::unbase64(text)?,
        None => Vec::new(),
    };
    if aux.len() > protocol::MAX_AUX {
        return Err(ApiError::bad_request(format!(
            "aux is {} bytes; at most {} are carried",
            aux.len(),
            protocol::MAX_AUX
        )));
    }
    if inner
        .rooms()
        .get(&room_id)
        .is_some_and(|r| r.ready.is_some())
    {
        return Err(ApiError::conflict(format!(
            "room {room_id} is already ready"
        )));
    }
    let l = &inner.cfg.layout;
    let needed = l.pages_for(req.tokens);
    let (pages, lease): (Arc<[u32]>, _) = match (req.pages, inner.cfg.synthetic) {
        (Some(pages), _) => {
            api::validate_pages(&pages, needed, inner.pool.num_pages())?;
            (pages.into(), None)
        }
        (None, true) => {
            let lease = inner
                .alloc
                .allocate(needed)
                .map_err(|e| ApiError::exhausted(e.to_string()))?;
            let pages: Arc<[u32]> = lease.pages().into();
            let (pool, kernel, fill_pages, tokens) =
                (inner.pool.clone(), inner.kernel, pages.clone(), req.tokens);
            tokio::task::spawn_blocking(move || {
                synthetic::fill(&kernel, &pool, room_id, &fill_pages, 0..tokens)
            })
            .await
            .map_err(|e| ApiError::unavailable(e.to_string()))?
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
            (pages, Some(lease))
        }
        (None, false) => {
            return Err(ApiError::bad_request(
                "pages are required (the agent fills pages itself only with --synthetic)",
            ));
        }
    };
    let (view, refusal) = {
        let mut rooms = inner.rooms();
        let room = rooms.entry(room_id).or_insert_with(Room::new);
        if room.ready.is_some() {
            return Err(ApiError::conflict(format!(
                "room {room_id} is already ready"
            )));
        }
        if room.status.state().is_final() {
            return Err(ApiError::conflict(format!(
                "room {room_id} is {}",
                room.status.state().name()
            )));
        }
        room.ready = Some(Ready {
            tokens: req.tokens,
            pages,
            lease,
            aux,
        });
        room.status.mark("ready");
        let refusal = inner
            .start_if_ready(room_id, room)
            .map(|r| (room.request.as_ref().map(|(p, _)| p.identity.clone()), r));
        (room.view(room_id), refusal)
    };
    if let Some((Some(identity), reason)) = refusal {
        inner
            .refuse(&identity, Some(room_id), reason.code, reason.message)
            .await;
    }
    Ok((axum::http::StatusCode::ACCEPTED, axum::Json(view)).into_response())
}

async fn get_room(
    State(inner): Shared,
    Path(room): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Result<Response, ApiError> {
    let room_id = api::parse_room(&room)?;
    if let Some(wait) = q.wait_ms {
        let rx = {
            let rooms = inner.rooms();
            let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
            (!room.status.state().is_final()).then(|| room.status.subscribe())
        };
        if let Some(rx) = rx {
            api::wait_for_change(rx, Duration::from_millis(wait.min(60_000))).await;
        }
    }
    let rooms = inner.rooms();
    let room = rooms.get(&room_id).ok_or(ApiError::unknown_room(room_id))?;
    Ok(axum::Json(room.view(room_id)).into_response())
}

async fn pool(State(inner): Shared) -> Response {
    axum::Json(serde_json::json!({
        "total_pages": inner.alloc.total_pages(),
        "free_pages": inner.alloc.free_pages(),
    }))
    .into_response()
}

async fn metrics(State(inner): Shared) -> Response {
    let text = inner.metrics.render(
        "prefill",
        inner.alloc.total_pages(),
        inner.alloc.free_pages(),
    );
    api::metrics_response(text)
}
