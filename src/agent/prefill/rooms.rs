//! The prefill's engine API, on [`Prefill`]: announce a room's KV as ready (whole, or in token
//! and layer pieces), and the operations both roles have ([`EngineApi`]: read a room, wait for
//! its next change, abort it, hold it, count the pool), over this role's room table. The HTTP
//! API (`http.rs`) and the Python package are layers over exactly these. Where the synthetic
//! engine is configured, a ready room's pages are filled by it (`synthetic.rs`) before the
//! piece is announced, layer by layer when it paces rooms.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::agent::Coverage;
use crate::agent::engine_api::{EngineApi, PoolCounts, RoomError, RoomLook};
use crate::agent::faults::{Faults, Tested};
use crate::agent::fields;
use crate::agent::metrics::Gauges;
use crate::agent::prefill::{Peer, Prefill};
use crate::agent::room::{RoomState, RoomStatus};
use crate::agent::room_table::TableRoom;
use crate::pool::allocator::PageLease;
use crate::protocol::{self, Message, TransferRequest};
use crate::protocol::{PromptDigest, Secret};
use crate::reason::{FailureCode, Reason};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use uuid::Uuid;

/// A ready piece of a room (`POST /v1/rooms/{room}/ready`): the engine says (part of) the
/// room's KV is in its pool. The same struct is the HTTP body; unknown fields are refused.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReadyRequest {
    /// Tokens of the whole room (the same in every piece).
    pub tokens: usize,
    /// The room's key from the router (32 hex digits in JSON): only decode requests that
    /// carry it are served. Given with the first piece; a later one may repeat it, not change
    /// it.
    #[serde(
        default,
        with = "fields::room_key",
        skip_serializing_if = "Option::is_none"
    )]
    pub room_key: Option<Secret>,
    /// The digest of the engine's prompt over the room's tokens (32 hex digits in JSON:
    /// `kvferry.prompt_digest`): decode requests with another digest are refused
    /// (`prompt_mismatch`). Given with the first piece, like the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_digest: Option<PromptDigest>,
    /// The room's pages in the prefill pool, enough for `tokens`; required on the first piece
    /// unless the agent is synthetic (it then allocates and fills them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages: Option<Vec<u32>>,
    /// Opaque bytes for the decode engine (base64 in JSON), at most
    /// [`protocol::MAX_AUX`] bytes; delivered with Done and returned by the decode's take.
    #[serde(default, with = "fields::aux", skip_serializing_if = "Option::is_none")]
    pub aux: Option<Vec<u8>>,
    /// The piece's tokens, `[start, end)` (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_range: Option<[usize; 2]>,
    /// The piece's global layers, `[start, end)` (default: all this rank holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_range: Option<[usize; 2]>,
    /// The engine's last piece for this room (default: true when no range is given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<bool>,
    /// For a device pool whose KV the engine writes asynchronously: the CUDA IPC handle of the
    /// interprocess event the engine recorded on its stream behind the piece's writes (128 hex
    /// digits in JSON). The agent opens it once per handle value and follows its latest record
    /// at the time of the call, as [`Prefill::ready_after`] follows an event of this
    /// process; the engine keeps the event alive while the agent runs.
    #[serde(
        default,
        with = "fields::ipc_event",
        skip_serializing_if = "Option::is_none"
    )]
    pub cuda_ipc_event: Option<crate::kernel::cuda::IpcEventHandle>,
}

/// A prefill room as the engine sees it (`GET /v1/rooms/{room}`); fields serialize in this
/// (alphabetical) order.
#[derive(Clone, Debug, Serialize)]
pub struct RoomView {
    /// KV bytes sent, over every transfer.
    pub bytes: usize,
    /// Why the room failed or was aborted.
    pub reason: Option<Reason>,
    /// The room (a string in JSON).
    #[serde(serialize_with = "fields::room_as_string")]
    pub room: u64,
    /// No gather reads the room's pages any more: the engine may reuse them.
    pub safe_to_reuse: bool,
    /// The room's state.
    pub state: RoomState,
    /// Milliseconds since the Unix epoch of each state entered, `created` and `ready`.
    pub timings: BTreeMap<&'static str, f64>,
    /// Tokens of the room, once a piece was announced.
    pub tokens: Option<usize>,
    /// One per decode rank that asked for the room.
    pub transfers: Vec<TransferView>,
}

/// What one decode rank asked of a prefill room.
#[derive(Clone, Debug, Serialize)]
pub struct TransferView {
    /// KV bytes sent to it.
    pub bytes: usize,
    /// The decode agent's instance.
    pub decode_instance: Uuid,
    /// Why the transfer failed or was aborted.
    pub reason: Option<Reason>,
    /// Sends and writes that still read the room's pages.
    pub sends_in_flight: usize,
    /// `transferring`, then `success`, `failed` or `aborted`.
    pub state: RoomState,
}

impl RoomLook for RoomView {
    fn state(&self) -> RoomState {
        self.state
    }
    fn reason(&self) -> Option<&Reason> {
        self.reason.as_ref()
    }
    fn safe_to_reuse(&self) -> bool {
        self.safe_to_reuse
    }
}

impl TableRoom for Room {
    type View = RoomView;

    /// No gather reads the room's pages any more: the engine may reuse them.
    fn safe_to_reuse(&self) -> bool {
        self.status.state().is_final() && !self.running()
    }

    fn status(&self) -> &RoomStatus {
        &self.status
    }

    fn view(&self, room: u64) -> RoomView {
        let transfers = self
            .transfers
            .iter()
            .map(|(decode, t)| TransferView {
                bytes: t.sent,
                decode_instance: *decode,
                reason: t.reason.clone(),
                sends_in_flight: t.sends.len(),
                state: t.state,
            })
            .collect();
        RoomView {
            bytes: self.transfers.values().map(|t| t.sent).sum(),
            reason: self.status.reason().cloned(),
            room,
            safe_to_reuse: self.safe_to_reuse(),
            state: self.status.state(),
            timings: self.status.timings(),
            tokens: self.ready.as_ref().map(|r| r.tokens),
            transfers,
        }
    }
}

impl Prefill {
    /// Announces a ready piece of `room` (`POST /v1/rooms/{room}/ready`): the whole room, or
    /// a token range, a layer range or both; pieces may not overlap. Each piece is sent as
    /// soon as both it and a decode's request are there. Returns the room's view.
    ///
    /// With a synthetic agent the pages are filled with the pattern first (on the blocking
    /// pool), and a whole room is announced layer by layer when `--synthetic-layer-delay-ms`
    /// is set.
    pub async fn ready(
        self: &Arc<Self>,
        room: u64,
        req: ReadyRequest,
    ) -> Result<RoomView, RoomError> {
        self.refuse_reads_only()?;
        self.ready_piece(room, req, None).await
    }

    /// [`Prefill::ready`] for a piece of a device pool whose KV the engine writes
    /// asynchronously: `ready` follows the engine's CUDA event, recorded on its stream after
    /// the piece's KV was written ([`crate::kernel::cuda::CudaKernel::follow`] on the pool's
    /// device, [`Self::device`]). The agent's gathers wait for it on the device; nothing
    /// synchronizes the engine's stream.
    pub async fn ready_after(
        self: &Arc<Self>,
        room: u64,
        req: ReadyRequest,
        ready: crate::kernel::cuda::ReadyEvent,
    ) -> Result<RoomView, RoomError> {
        self.refuse_reads_only()?;
        if self.pool.device() != Some(ready.ordinal()) {
            return Err(RoomError::BadRequest(format!(
                "a CUDA event of device {} marks a piece ready, but the pool is {}",
                ready.ordinal(),
                self.pool
                    .device()
                    .map_or("host memory".to_owned(), |d| format!("on device {d}"))
            )));
        }
        self.ready_piece(room, req, Some(Arc::new(ready))).await
    }

    /// The CUDA device of the agent's pool; `None` for host memory.
    pub fn device(&self) -> Option<usize> {
        self.pool.device()
    }
}

/// What `POST /v1/rooms/{room}/hold` takes at a prefill: `{}`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HoldRequest {}

impl EngineApi for Prefill {
    type View = RoomView;
    type Hold = HoldRequest;
    const ROLE: &'static str = "prefill";

    fn view(&self, room: u64) -> Result<RoomView, RoomError> {
        self.table.view(room)
    }

    async fn wait(&self, room: u64, timeout: Duration) -> Result<RoomView, RoomError> {
        self.table.wait(room, timeout).await
    }

    /// Every transfer stops, its decodes are told with Abort, later requests for the room are
    /// refused.
    async fn abort(self: &Arc<Self>, room: u64) -> Result<RoomView, RoomError> {
        self.table.known(room)?;
        let why = "aborted by the prefill engine";
        self.clone()
            .abort_room(room, Reason::new(FailureCode::Aborted, why))
            .await;
        self.table.view(room)
    }

    /// Decodes that asked for the room already are not failed with `timeout_ready`, and their
    /// own ready timeout waits too (the room is named in every heartbeat to them), until the
    /// room is announced, unheld, or `--room-max-ms` after the hold.
    fn hold(self: &Arc<Self>, room: u64, _: HoldRequest) -> Result<(), RoomError> {
        self.table.refuse_while_draining(Self::ROLE)?;
        self.holds.hold(room)
    }

    /// The engine's request left its queue without being computed.
    fn unhold(self: &Arc<Self>, room: u64) {
        self.holds.release(room);
    }

    fn pool(&self) -> PoolCounts {
        PoolCounts::of(&self.alloc)
    }

    fn metrics(&self) -> String {
        let mut g = Gauges {
            pool: self.pool.labels(),
            pool_total: self.alloc.total_pages(),
            pool_free: self.alloc.free_pages(),
            pinned_bytes: self.slots.pinned_bytes(),
            ..Gauges::default()
        };
        for peer in self.peers().values() {
            g.slots_in_use += peer.slots.saturating_sub(peer.credits.available_permits());
        }
        self.table.count(&mut g);
        self.metrics.render(&g)
    }

    async fn draining(&self) {
        self.draining.say().await;
    }
}

impl Tested for Prefill {
    fn faults(&self) -> &Faults {
        &self.faults
    }
}

/// A room's pages and, when the agent allocated them, their lease.
type RoomPages = (Arc<[u32]>, Option<Arc<PageLease>>);

impl Prefill {
    /// Pages for a room's first piece: the engine's (validated) or the agent's own.
    pub(super) fn room_pages(&self, req: &ReadyRequest) -> Result<RoomPages, RoomError> {
        let needed = self.cfg.layout.pages_for(req.tokens);
        fields::fits_pool(req.tokens, needed, self.pool.num_pages())?;
        match (&req.pages, &self.synthetic) {
            (Some(pages), _) => {
                fields::validate_pages(pages, needed, self.pool.num_pages(), 0)?;
                Ok((pages.as_slice().into(), None))
            }
            (None, Some(_)) => {
                let lease = self
                    .alloc
                    .allocate(needed)
                    .map_err(|e| RoomError::Exhausted(e.to_string()))?;
                Ok((lease.pages().into(), Some(Arc::new(lease))))
            }
            (None, None) => Err(RoomError::BadRequest(
                "pages are required (the agent fills pages itself only with --synthetic)".into(),
            )),
        }
    }

    /// Follows the engine's interprocess event (`cuda_ipc_event`) on the pool's device. The
    /// driver calls (opening the handle, queuing the wait) run on a blocking thread, never on
    /// the agent's async ones.
    pub(super) async fn follow_ipc(
        &self,
        handle: crate::kernel::cuda::IpcEventHandle,
    ) -> Result<crate::kernel::cuda::ReadyEvent, RoomError> {
        let pool = self.pool.clone();
        let followed = tokio::task::spawn_blocking(move || pool.follow_ipc(&handle))
            .await
            .map_err(|e| {
                RoomError::Unavailable(format!("cuda_ipc_event cannot be followed: {e}"))
            })?;
        match followed {
            None => Err(RoomError::BadRequest(
                "cuda_ipc_event marks device memory ready; this agent's pool is host memory".into(),
            )),
            Some(Ok(ready)) => Ok(ready),
            Some(Err(e @ crate::kernel::cuda::CudaError::EventHandle { .. })) => {
                Err(RoomError::BadRequest(format!("cuda_ipc_event: {e}")))
            }
            Some(Err(e)) => Err(RoomError::Unavailable(format!(
                "cuda_ipc_event cannot be followed: {e}"
            ))),
        }
    }

    /// [`Prefill::ready`], after the CUDA event `ready_on` where one is given.
    pub(super) async fn ready_piece(
        self: &Arc<Self>,
        room_id: u64,
        mut req: ReadyRequest,
        ready_on: Option<Arc<crate::kernel::cuda::ReadyEvent>>,
    ) -> Result<RoomView, RoomError> {
        let l = &self.cfg.layout;
        if req.tokens == 0 {
            return Err(RoomError::BadRequest("tokens must be > 0".into()));
        }
        if req
            .aux
            .as_ref()
            .is_some_and(|a| a.len() > protocol::MAX_AUX)
        {
            return Err(RoomError::BadRequest(format!(
                "aux is larger than {} bytes",
                protocol::MAX_AUX
            )));
        }
        let tokens = req.token_range.map_or(0..req.tokens, |[a, b]| a..b);
        let layers = req.layer_range.map_or(l.layers.clone(), |[a, b]| a..b);
        if tokens.is_empty() || tokens.end > req.tokens {
            return Err(RoomError::BadRequest(format!(
                "token_range {tokens:?} must be a non-empty range within 0..{}",
                req.tokens
            )));
        }
        l.check_piece_start(tokens.start)
            .map_err(|e| RoomError::BadRequest(format!("token_range {tokens:?}: {e}")))?;
        if layers.is_empty() || layers.start < l.layers.start || layers.end > l.layers.end {
            return Err(RoomError::BadRequest(format!(
                "layer_range {layers:?} must be a non-empty range within this rank's layers {:?}",
                l.layers
            )));
        }
        if !self.rooms().contains_key(&room_id) {
            self.table.refuse_while_draining(Self::ROLE)?;
            // Only reads reach here on a prefill that serves them (its engine announces
            // nothing); each decode bounds its reads by its own --max-rooms, and several
            // reading at once must not fail one another's.
            if !self.cfg.serve_reads {
                self.table.admit(&self.metrics)?;
            }
        }
        let ready_on = match (req.cuda_ipc_event.take(), ready_on) {
            (None, ready_on) => ready_on,
            (Some(_), Some(_)) => {
                return Err(RoomError::BadRequest(
                    "a piece is ready after one CUDA event: cuda_ipc_event or the event of this \
                     process, not both"
                        .into(),
                ));
            }
            (Some(handle), None) => Some(Arc::new(self.follow_ipc(handle).await?)),
        };
        let whole = req.token_range.is_none() && req.layer_range.is_none();
        let last = req.last.unwrap_or(whole);
        let piece = Piece {
            tokens,
            layers,
            ready_on,
        };
        // First piece: pages (outside the lock: allocation may be refused, synthetic fill is slow).
        let first = self.rooms().get(&room_id).is_none_or(|r| r.ready.is_none());
        // Announced: no longer waiting in the engine's queue.
        self.holds.release(room_id);
        let fresh = if first {
            Some(self.room_pages(&req)?)
        } else {
            None
        };
        let paced = (self.synthetic.as_ref())
            .and_then(|engine| engine.layer_pacing())
            .filter(|_| whole);
        let (view, (pages, lease)) = {
            let mut rooms = self.rooms();
            let room = rooms.entry(room_id).or_insert_with(Room::new);
            if room.status.state().is_final() {
                // The engine learns why, not only that it was too late.
                let why = room.status.reason().map(|r| format!(" ({r})"));
                return Err(RoomError::Conflict(format!(
                    "room {room_id} is {}{}",
                    room.status.state().name(),
                    why.unwrap_or_default()
                )));
            }
            if let Some((pages, lease)) = fresh {
                if room.ready.is_some() {
                    return Err(RoomError::Conflict(format!(
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
            if req.room_key.is_some() && room.key.is_some() && room.key != req.room_key {
                return Err(RoomError::Conflict(format!(
                    "room {room_id} was announced with another room_key"
                )));
            }
            room.key = room.key.or(req.room_key);
            if req.prompt_digest.is_some()
                && room.digest.is_some()
                && room.digest != req.prompt_digest
            {
                return Err(RoomError::Conflict(format!(
                    "room {room_id} was announced with another prompt_digest"
                )));
            }
            room.digest = room.digest.or(req.prompt_digest);
            let Some(ready) = room.ready.as_mut() else {
                return Err(RoomError::Conflict(format!(
                    "room {room_id} lost its pages"
                )));
            };
            if ready.tokens != req.tokens {
                return Err(RoomError::BadRequest(format!(
                    "room {room_id} has {} tokens, this piece says {}",
                    ready.tokens, req.tokens
                )));
            }
            if ready.last {
                return Err(RoomError::Conflict(format!(
                    "room {room_id}: the last piece was already announced"
                )));
            }
            let local = piece.layers.start - l.layers.start..piece.layers.end - l.layers.start;
            if !ready.announced.claim(local, piece.tokens.clone(), 0..1) {
                return Err(RoomError::Conflict(format!(
                    "room {room_id}: tokens {:?} x layers {:?} overlap a piece announced before",
                    piece.tokens, piece.layers
                )));
            }
            if let Some(aux) = req.aux {
                ready.aux = aux;
            }
            // Taken under the same lock as the claim: an abort releasing the lease after this
            // point cannot free the pages under the fill.
            let keep = (ready.pages.clone(), ready.lease.clone());
            (room.view(room_id), keep)
        };
        if let Some(delay) = paced {
            let room = (room_id, req.tokens);
            tokio::spawn(announce_paced(
                self.clone(),
                room,
                (pages, lease),
                piece,
                delay,
            ));
        } else {
            fill(self, (room_id, req.tokens), (pages, lease), &piece).await?;
            announce(self, room_id, piece, last);
            // The transfer task just spawned waits in this worker's queue behind this call;
            // yielding lets it start its first chunk before the engine's answer goes out.
            tokio::task::yield_now().await;
        }
        Ok(view)
    }
}

/// Has the synthetic engine, where the agent has one, fill a piece of a room (id, tokens);
/// with none, the engine wrote the KV.
pub(super) async fn fill(
    inner: &Arc<Prefill>,
    room: (u64, usize),
    pages: (Arc<[u32]>, Option<Arc<PageLease>>),
    piece: &Piece,
) -> Result<(), RoomError> {
    let Some(engine) = &inner.synthetic else {
        return Ok(());
    };
    let l0 = inner.cfg.layout.layers.start;
    let layers = piece.layers.start - l0..piece.layers.end - l0;
    engine
        .fill(&inner.pool, room, pages, piece.tokens.clone(), layers)
        .await
}

/// Hands a filled piece to the room's task (starting it if the request is there).
pub(super) fn announce(inner: &Arc<Prefill>, room_id: u64, piece: Piece, last: bool) {
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

/// The synthetic engine's layer-wise prefill: one layer every `delay`.
pub(super) async fn announce_paced(
    inner: Arc<Prefill>,
    (room_id, room_tokens): (u64, usize),
    (pages, lease): (Arc<[u32]>, Option<Arc<PageLease>>),
    whole: Piece,
    delay: Duration,
) {
    for layer in whole.layers.clone() {
        tokio::time::sleep(delay).await;
        let piece = Piece {
            tokens: whole.tokens.clone(),
            layers: layer..layer + 1,
            ready_on: None,
        };
        let room = (room_id, room_tokens);
        if let Err(e) = fill(&inner, room, (pages.clone(), lease.clone()), &piece).await {
            tracing::warn!(room = room_id, error = %e, "synthetic fill failed");
            return;
        }
        announce(&inner, room_id, piece, layer + 1 == whole.layers.end);
    }
}

/// A part of a room the engine announced as ready: tokens x global layers, and for a device
/// pool the event after which its KV is written on the device.
#[derive(Clone, Debug)]
pub(super) struct Piece {
    pub(super) tokens: Range<usize>,
    pub(super) layers: Range<usize>,
    pub(super) ready_on: Option<Arc<crate::kernel::cuda::ReadyEvent>>,
}

pub(super) struct Ready {
    pub(super) tokens: usize,
    pub(super) pages: Arc<[u32]>,
    /// Present when the agent allocated (and filled) the pages.
    /// Shared with running synthetic fills, so pages never return to the pool while a fill
    /// still writes them.
    pub(super) lease: Option<Arc<PageLease>>,
    pub(super) aux: Vec<u8>,
    /// Cells announced so far (local layer x token); pieces may not overlap.
    pub(super) announced: Coverage,
    /// The engine marked its last piece.
    pub(super) last: bool,
}

/// What one decode rank asked of a room (heterogeneous TP: several decode ranks may ask one
/// prefill rank for parts of the same room).
pub(super) struct Transfer {
    pub(super) peer: Arc<Peer>,
    /// `None` for the tombstone of an abort that overtook its request.
    pub(super) req: Option<TransferRequest>,
    /// Index of the next announced piece this transfer sends.
    pub(super) next_piece: usize,
    pub(super) sent: usize,
    pub(super) wake: Arc<Notify>,
    pub(super) cancel: CancellationToken,
    pub(super) started: bool,
    pub(super) running: bool,
    pub(super) requested_at: Instant,
    /// The prefill engine aborted the room: the decode is told with Abort, not AbortAck.
    pub(super) engine_abort: bool,
    /// Why the decode aborted it.
    pub(super) abort_reason: Option<Reason>,
    /// Sends and writes from the room's pages still in flight (`transfer.rs`, `Job::sends`).
    pub(super) sends: tokio_util::task::TaskTracker,
    /// `transferring` until the transfer ends: `success`, `failed` or `aborted`.
    pub(super) state: RoomState,
    pub(super) reason: Option<Reason>,
    /// Its decode died before the room was delivered: it failed, and the room waits for
    /// another decode as if it had never asked (its task may still be ending).
    pub(super) lost: bool,
}

impl Transfer {
    pub(super) fn new(peer: Arc<Peer>, req: Option<TransferRequest>) -> Self {
        Transfer {
            peer,
            req,
            next_piece: 0,
            sent: 0,
            wake: Arc::new(Notify::new()),
            cancel: CancellationToken::new(),
            started: false,
            running: false,
            requested_at: Instant::now(),
            engine_abort: false,
            abort_reason: None,
            sends: tokio_util::task::TaskTracker::new(),
            state: RoomState::Transferring,
            reason: None,
            lost: false,
        }
    }

    /// A decode's request that counts: not a tombstone, not lost with its decode.
    pub(super) fn asks(&self) -> bool {
        self.req.is_some() && !self.lost
    }

    pub(super) fn end(&mut self, state: RoomState, reason: Option<Reason>) {
        if !self.state.is_final() {
            self.state = state;
            self.reason = reason;
        }
    }
}

pub(super) struct Room {
    pub(super) status: RoomStatus,
    pub(super) ready: Option<Ready>,
    /// Every piece announced so far, in order; each transfer keeps its own cursor.
    pub(super) pieces: Vec<Piece>,
    /// By decode instance.
    pub(super) transfers: HashMap<Uuid, Transfer>,
    /// How many decode ranks will ask (from their requests).
    pub(super) requesters: usize,
    /// The prefill engine aborted the room.
    pub(super) engine_abort: Option<Reason>,
    pub(super) final_at: Option<Instant>,
    /// The room's key, when the engine announced one: only requests that carry it are served.
    pub(super) key: Option<Secret>,
    /// The digest of the engine's prompt, when it announced one: requests with another are
    /// refused.
    pub(super) digest: Option<PromptDigest>,
    /// When a decode's heartbeat last named the room (its engine holds the request queued),
    /// and which decode: a ready room no decode asked for yet lives a TTL from then, up to
    /// `room_max`. Its pages count against that decode's `--max-held-pages`.
    pub(super) renewed: Option<(Instant, Uuid)>,
    /// The room's decode died before the room was delivered: when, and why. The room waits
    /// for another decode for `--requeue-ms` from then (or from a later renewal), then fails
    /// with that reason.
    pub(super) requeued: Option<(Instant, Reason)>,
    /// When a decode that held the room let it go without asking, and why: unless another
    /// decode asks, the room fails `--requeue-ms` from then (or expires at its TTL, if that is
    /// sooner).
    pub(super) let_go: Option<(Instant, Reason)>,
}

impl Room {
    pub(super) fn new() -> Self {
        Room {
            status: RoomStatus::default(),
            ready: None,
            pieces: Vec::new(),
            transfers: HashMap::new(),
            requesters: 0,
            engine_abort: None,
            final_at: None,
            key: None,
            digest: None,
            renewed: None,
            requeued: None,
            let_go: None,
        }
    }

    /// The decode holding the room for a queued request: ready, asked by no decode yet, and
    /// renewed by that one last.
    pub(super) fn holder(&self) -> Option<Uuid> {
        let (_, decode) = self.renewed?;
        (self.ready.is_some() && !self.asked()).then_some(decode)
    }

    /// A decode asked for the room (one lost with its decode does not count).
    pub(super) fn asked(&self) -> bool {
        self.transfers.values().any(Transfer::asks)
    }

    /// The transfer of `decode`, which died before the room was delivered, is lost: the room
    /// waits for another decode as if that one had never asked, `transferring` again
    /// `waiting_for_input` once no other decode's transfer runs. Returns whether it was
    /// requeued (a room no longer waiting for that decode, or final, is not).
    pub(super) fn requeue(&mut self, decode: Uuid, reason: &Reason) -> bool {
        if self.status.state().is_final() {
            return false;
        }
        let Some(t) = self.transfers.get_mut(&decode) else {
            return false;
        };
        if !t.asks() || t.state.is_final() {
            return false;
        }
        t.lost = true;
        t.end(RoomState::Failed, Some(reason.clone()));
        self.requesters = (self.transfers.values())
            .filter(|t| t.asks())
            .filter_map(|t| t.req.as_ref().map(|r| r.requesters as usize))
            .max()
            .unwrap_or(0);
        if !self
            .transfers
            .values()
            .any(|t| t.asks() && !t.state.is_final())
        {
            self.status.requeue();
        }
        self.requeued = Some((Instant::now(), reason.clone()));
        // The dead decode's holds end with it; another decode's heartbeats renew the room.
        self.renewed = None;
        true
    }

    pub(super) fn running(&self) -> bool {
        self.transfers.values().any(|t| t.running)
    }
}

impl Prefill {
    /// Records the first time the room reached a stage of its transfer (its timings).
    pub(super) fn mark_first(&self, room_id: u64, stage: &'static str) {
        if let Some(room) = self.rooms().get_mut(&room_id) {
            room.status.mark_first(stage);
        }
    }

    /// Moves the room to a final state once every decode rank that will ask has been served,
    /// and returns the agent's own pages once no gather reads them.
    pub(super) fn settle(&self, room: &mut Room) {
        if let Some(reason) = room.engine_abort.clone()
            && !room.running()
        {
            room.status.abort(reason, true);
        }
        let asked = room.transfers.values().filter(|t| t.asks()).count();
        let all_final = room.transfers.values().all(|t| t.state.is_final());
        if !room.status.state().is_final() && asked > 0 && asked >= room.requesters && all_final {
            let first_failure = room
                .transfers
                .values()
                .find(|t| t.state == RoomState::Failed && !t.lost);
            if let Some(t) = first_failure {
                let reason = t
                    .reason
                    .clone()
                    .unwrap_or_else(|| Reason::new(FailureCode::BadMessage, "transfer failed"));
                room.status.fail(reason);
            } else if room
                .transfers
                .values()
                .any(|t| t.state == RoomState::Aborted)
            {
                room.status.abort(
                    Reason::new(FailureCode::Aborted, "aborted by the decode"),
                    true,
                );
            } else {
                room.status.advance(RoomState::Success);
            }
        }
        if room.status.state().is_final() && room.final_at.is_none() {
            room.final_at = Some(Instant::now());
            self.metrics
                .room_final(room.status.state(), room.status.reason().map(|r| r.code));
        }
        if room.status.state().is_final() && !room.running() {
            if let Some(ready) = &mut room.ready {
                ready.lease = None;
            }
            room.status.touch();
        }
    }

    /// Starts the task of every requested transfer once the engine announced a first piece.
    pub(super) fn start_ready(self: &Arc<Self>, room_id: u64, room: &mut Room) {
        if room.ready.is_none() || room.status.state().is_final() {
            return;
        }
        // Requests that came before the key and digest were known, and do not match them, are
        // refused.
        let mut refused = Vec::new();
        for (decode, t) in room.transfers.iter_mut() {
            let Some(req) = t.req.as_ref().filter(|_| !t.state.is_final()) else {
                continue;
            };
            if let Some(reason) = self.misfit(room_id, room.key, room.digest, req, *decode) {
                t.end(RoomState::Failed, Some(reason.clone()));
                refused.push((*decode, t.peer.identity.clone(), reason));
            }
        }
        if !refused.is_empty() {
            room.transfers
                .retain(|decode, _| refused.iter().all(|(d, _, _)| d != decode));
            let inner = self.clone();
            tokio::spawn(async move {
                for (_, identity, reason) in refused {
                    inner.refuse(&identity, Some(room_id), reason.code, reason.message);
                }
            });
        }
        for (decode, t) in room.transfers.iter_mut() {
            if t.req.is_some() && !t.started && !t.state.is_final() {
                self.metrics.ready_wait.observe(t.requested_at.elapsed());
                t.started = true;
                t.running = true;
                let span =
                    tracing::info_span!("room", room = room_id, role = "prefill", decode = %decode);
                tokio::spawn(
                    self.clone()
                        .serve_transfer(room_id, *decode)
                        .instrument(span),
                );
            }
        }
        if room.running() {
            room.status.advance(RoomState::Transferring);
        }
    }

    /// The prefill engine aborts a room: every transfer stops (a running one when its current
    /// chunk is out) and its decode is told with Abort; later requests are refused.
    pub(super) async fn abort_room(self: Arc<Self>, room_id: u64, reason: Reason) {
        let tell: Vec<Arc<Peer>> = {
            let mut rooms = self.rooms();
            let room = rooms.entry(room_id).or_insert_with(Room::new);
            if room.status.state().is_final() {
                return;
            }
            room.engine_abort = Some(reason.clone());
            let mut tell = Vec::new();
            for t in room.transfers.values_mut() {
                t.cancel.cancel();
                if t.running {
                    t.engine_abort = true; // its task tells the decode when it stops
                } else if !t.state.is_final() {
                    t.end(RoomState::Aborted, Some(reason.clone()));
                    tell.push(t.peer.clone());
                }
            }
            self.settle(room);
            tell
        };
        let msg = Message::Abort(protocol::Abort {
            room: room_id,
            instance: self.instance,
            code: reason.code,
            message: reason.message,
        });
        for peer in tell {
            self.reply(&peer.identity, msg.clone());
        }
    }

    /// Why a decode's request does not fit the room the engine announced, if it does not:
    /// without the room's key (`unauthorized`), or for another prompt (`prompt_mismatch`).
    /// Counted and logged.
    pub(super) fn misfit(
        &self,
        room: u64,
        key: Option<Secret>,
        digest: Option<PromptDigest>,
        req: &TransferRequest,
        decode: Uuid,
    ) -> Option<Reason> {
        if key.is_some_and(|key| req.room_key != Some(key)) {
            self.metrics.protocol_error("unauthorized");
            tracing::warn!(room, %decode, "request without the room's key refused");
            return Some(Reason::new(
                FailureCode::Unauthorized,
                format!("room {room}: the request does not carry the room's key"),
            ));
        }
        match (digest, req.prompt_digest) {
            (Some(ours), Some(theirs)) if ours != theirs => {
                tracing::warn!(room, %decode, %ours, %theirs, "request for another prompt refused");
                Some(Reason::new(
                    FailureCode::PromptMismatch,
                    format!(
                        "room {room}: the decode's prompt (digest {theirs}) is not the one this prefill computed the room's KV for (digest {ours})"
                    ),
                ))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn the_view_serializes_as_the_wire_format() {
        let view = RoomView {
            bytes: 16384,
            reason: None,
            room: 42,
            safe_to_reuse: false,
            state: RoomState::Transferring,
            timings: [("created", 1.0), ("ready", 3.0)].into_iter().collect(),
            tokens: Some(40),
            transfers: vec![TransferView {
                bytes: 16384,
                decode_instance: Uuid::nil(),
                reason: Some(Reason::new(FailureCode::Aborted, "x")),
                sends_in_flight: 1,
                state: RoomState::Aborted,
            }],
        };
        let json = serde_json::to_string(&view).unwrap();
        let via_value = serde_json::to_string(&serde_json::to_value(&view).unwrap()).unwrap();
        assert_eq!(json, via_value, "fields out of alphabetical order");
        assert!(
            json.starts_with(r#"{"bytes":16384,"reason":null,"room":"42","#),
            "{json}"
        );
    }

    #[test]
    pub(super) fn a_ready_piece_parses_from_the_wire_format() {
        let req: ReadyRequest = serde_json::from_str(
            r#"{"tokens":40,"token_range":[32,40],"last":true,"aux":"aGVsbG8="}"#,
        )
        .unwrap();
        assert_eq!(req.aux.as_deref(), Some(b"hello".as_slice()));
        assert_eq!((req.token_range, req.last), (Some([32, 40]), Some(true)));
        let back = serde_json::to_value(&req).unwrap();
        assert_eq!(back["aux"], "aGVsbG8=");
        let bad = serde_json::from_str::<ReadyRequest>(r#"{"tokens":16,"aux":"!!"}"#);
        assert!(
            bad.unwrap_err()
                .to_string()
                .contains("aux is not valid base64")
        );
    }
}
