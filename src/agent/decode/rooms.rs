//! The decode's engine API, on [`Decode`]: request a room, take it (remove-after-retrieve),
//! look up a prefill group, and the operations both roles have ([`EngineApi`]: read a room,
//! wait for its next change, abort it, hold it, count the pool), over this role's room table.
//! The HTTP API (`http.rs`) and the Python package are layers over exactly these.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::agent::Coverage;
use crate::agent::decode::{Decode, Peer};
use crate::agent::engine_api::{EngineApi, PoolCounts, RoomError, RoomLook};
use crate::agent::faults::{Faults, Tested};
use crate::agent::fields;
use crate::agent::metrics::Gauges;
use crate::agent::pairing::{self, RankSlice};
use crate::agent::room::{RoomState, RoomStatus};
use crate::agent::room_table::TableRoom;
use crate::layout::KvLayout;
use crate::pool::allocator::PageLease;
use crate::protocol::{self, Message, TransferRequest};
use crate::protocol::{PromptDigest, Secret};
use crate::reason::{FailureCode, Reason};
use kvferry_bootstrap::Registration;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument as _;
use uuid::Uuid;

/// A room request (`POST /v1/rooms/{room}`): the decode engine asks for a room's KV. The same
/// struct is the HTTP body; unknown fields are refused.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RoomRequest {
    /// Tokens of the whole prompt.
    pub tokens: usize,
    /// Tokens the decode already holds (its prefix cache): only `start_token..tokens` move.
    #[serde(default)]
    pub start_token: usize,
    /// Destination pages in the decode pool (the engine's; enough for `tokens`, each in
    /// range, none twice from the page holding `start_token` on: those before do not move).
    /// Without them the agent allocates its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages: Option<Vec<u32>>,
    /// Another registry URL for this room: one of `--bootstrap`'s or one that
    /// `--allowed-registries` lists, else the request is refused ([`RoomError::Forbidden`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<String>,
    /// The prefill DP group (default: the room modulo the prefill DP size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// The room's key from the router (32 hex digits in JSON), when the prefill engine was
    /// given one.
    #[serde(
        default,
        with = "fields::room_key",
        skip_serializing_if = "Option::is_none"
    )]
    pub room_key: Option<Secret>,
    /// The digest of the engine's prompt over the room's tokens (32 hex digits in JSON:
    /// `kvferry.prompt_digest`): a prefill whose engine computed the room for another prompt
    /// refuses it (`prompt_mismatch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_digest: Option<PromptDigest>,
    /// A read: the pages of the prefill's pool that are the room (enough for `tokens` in the
    /// prefill's page size), for a room no engine announced, from a prefill that serves reads
    /// (`--serve-reads`; others refuse it with `unauthorized`). Every prefill rank of the
    /// group serves the same pages of its own pool. Without them the room is the one the
    /// prefill's engine announces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_pages: Option<Vec<u32>>,
}

/// What `POST /v1/rooms/{room}/hold` takes: where the room will come from, as in
/// [`RoomRequest`].
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HoldRequest {
    /// Another registry URL for this room: one of `--bootstrap`'s or one that
    /// `--allowed-registries` lists, else the request is refused ([`RoomError::Forbidden`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<String>,
    /// The prefill DP group (default: the room modulo the prefill DP size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
}

/// Whose pages a decode room lands in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PageOwner {
    /// The agent allocated them; they return to its pool.
    Agent,
    /// The engine named them; they stay the engine's.
    Engine,
}

/// A decode room as the engine sees it (`GET /v1/rooms/{room}`); fields serialize in this
/// (alphabetical) order.
#[derive(Clone, Debug, Serialize)]
pub struct RoomView {
    /// KV bytes landed.
    pub bytes: usize,
    /// Chunks landed.
    pub chunks: u32,
    /// KV bytes the room needs (`start_token..tokens`).
    pub expected_bytes: usize,
    /// Whose pages the room lands in.
    pub page_owner: PageOwner,
    /// The room's pages in the decode pool.
    pub pages: Vec<u32>,
    /// Why the room failed or was aborted.
    pub reason: Option<Reason>,
    /// The room (a string in JSON).
    #[serde(serialize_with = "fields::room_as_string")]
    pub room: u64,
    /// No write into the room's pages can still arrive.
    pub safe_to_reuse: bool,
    /// One per prefill rank serving the room.
    pub sources: Vec<SourceView>,
    /// The first token requested.
    pub start_token: usize,
    /// The room's state.
    pub state: RoomState,
    /// Milliseconds since the Unix epoch of each state entered, and `created`.
    pub timings: BTreeMap<&'static str, f64>,
    /// Tokens of the whole prompt.
    pub tokens: usize,
}

/// One prefill rank serving a decode room.
#[derive(Clone, Debug, Serialize)]
pub struct SourceView {
    /// KV bytes landed from it.
    pub bytes: usize,
    /// It said Done.
    pub done: bool,
    /// Its global heads, `[start, end)`.
    pub heads: [usize; 2],
    /// Its global layers, `[start, end)`.
    pub layers: [usize; 2],
    /// The prefill agent's instance.
    pub prefill_instance: Uuid,
}

/// A taken room (`POST /v1/rooms/{room}/take`): its last view, the prefill engine's aux bytes
/// and the synthetic check.
#[derive(Clone, Debug, Serialize)]
pub struct TakenRoom {
    /// The prefill engine's aux bytes (base64 in JSON), if it sent any.
    #[serde(with = "fields::aux")]
    pub aux: Option<Vec<u8>>,
    /// The room as it was taken.
    #[serde(flatten)]
    pub room: RoomView,
    /// Whether the landed bytes match the synthetic pattern (synthetic agents, landed rooms).
    pub verified: Option<bool>,
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

    /// No write into the room's pages can still arrive (see the module doc).
    fn safe_to_reuse(&self) -> bool {
        self.status.state().is_final()
            && self.scattering == 0
            && self.sources.iter().all(|s| !s.writes.possible())
    }

    fn status(&self) -> &RoomStatus {
        &self.status
    }

    fn view(&self, room: u64) -> RoomView {
        RoomView {
            bytes: self.landed,
            chunks: self.chunks,
            expected_bytes: self.expected,
            page_owner: match self.lease.is_some() || self.returned {
                true => PageOwner::Agent,
                false => PageOwner::Engine,
            },
            pages: self.pages.to_vec(),
            reason: self.status.reason().cloned(),
            room,
            safe_to_reuse: self.safe_to_reuse(),
            sources: self
                .sources
                .iter()
                .map(|s| SourceView {
                    bytes: s.landed,
                    done: s.done.is_some(),
                    heads: [s.heads.start, s.heads.end],
                    layers: [s.layers.start, s.layers.end],
                    prefill_instance: s.peer.instance,
                })
                .collect(),
            start_token: self.start_token,
            state: self.status.state(),
            timings: self.status.timings(),
            tokens: self.tokens,
        }
    }
}

impl Decode {
    /// The prefill group `dp_rank` as the registry at `bootstrap` lists it (a trusted registry,
    /// by default `--bootstrap`'s), asked once (`GET /v1/prefill-groups/{dp_rank}`): an engine
    /// that must know a prefill server's shape before it asks for rooms (SGLang) reads it here,
    /// so that only the agent talks to registries, with its token. [`RoomError::Forbidden`] for
    /// an untrusted registry (nothing is sent), [`RoomError::Unavailable`] when the group is not
    /// complete or the registry cannot be asked.
    pub async fn prefill_group(
        &self,
        bootstrap: Option<&str>,
        dp_rank: u32,
    ) -> Result<kvferry_bootstrap::PrefillGroup, RoomError> {
        if let Some(url) = bootstrap {
            self.cfg.registries.check(url)?;
        }
        let client = self
            .registry_of(bootstrap)
            .map_err(|r| RoomError::Unavailable(r.message))?;
        client
            .lookup_prefill(dp_rank)
            .await
            .map_err(|e| RoomError::Unavailable(e.to_string()))
    }

    /// Refuses new rooms and holds once the agent drains or shuts down.
    fn refuse_while_draining(&self) -> Result<(), RoomError> {
        if self.shutdown.is_cancelled() {
            self.table.drain();
        }
        self.table.refuse_while_draining(Self::ROLE)
    }
}

impl EngineApi for Decode {
    type View = RoomView;
    type Hold = HoldRequest;
    const ROLE: &'static str = "decode";

    fn view(&self, room: u64) -> Result<RoomView, RoomError> {
        self.return_aborted_pages_of(room);
        self.table.view(room)
    }

    async fn wait(&self, room: u64, timeout: Duration) -> Result<RoomView, RoomError> {
        self.return_aborted_pages_of(room);
        self.table.wait(room, timeout).await
    }

    /// `aborting` until every prefill serving it acknowledged, then `aborted`.
    async fn abort(self: &Arc<Self>, room: u64) -> Result<RoomView, RoomError> {
        self.table.known(room)?;
        let why = "aborted by the decode engine";
        self.abort_room(room, Reason::new(FailureCode::Aborted, why))
            .await;
        self.view(room)
    }

    /// Resolves the prefill ranks, says Hello where needed and names the room in its
    /// heartbeats, so the prefill keeps the room's KV past its TTL (up to its
    /// `--room-max-ms`). Ends when the room is requested, unheld, or `--room-max-ms` after the
    /// hold. Returns at once; a prefill that cannot be reached is logged, and the room's
    /// request will fail with the reason.
    fn hold(self: &Arc<Self>, room: u64, req: HoldRequest) -> Result<(), RoomError> {
        self.refuse_while_draining()?;
        if let Some(url) = &req.bootstrap {
            self.cfg.registries.check(url)?;
        }
        self.holds.hold(room)?;
        let inner = self.clone();
        tokio::spawn(async move {
            if let Err(reason) = inner.hold_at_prefill(room, req).await {
                tracing::warn!(room, %reason, "room not held at its prefill");
            }
        });
        Ok(())
    }

    /// The engine let the request go before asking for its room (it computed the prompt
    /// itself, or dropped the request): the prefills it was held at are told ([`Decode::let_go`]).
    fn unhold(self: &Arc<Self>, room: u64) {
        if let Some(prefills) = self.holds.release(room) {
            self.let_go(room, prefills);
        }
    }

    fn pool(&self) -> PoolCounts {
        self.return_aborted_pages();
        PoolCounts::of(&self.alloc)
    }

    fn metrics(&self) -> String {
        let mut g = Gauges {
            pool: self.pool.labels(),
            pool_total: self.alloc.total_pages(),
            pool_free: self.alloc.free_pages(),
            pinned_bytes: self.recv_slots.as_ref().map_or(0, |s| s.pinned_bytes()),
            ..Gauges::default()
        };
        g.slots_in_use = self.rooms().values().map(|r| r.scattering).sum();
        self.table.count(&mut g);
        self.metrics.render(&g)
    }

    async fn draining(&self) {
        self.draining.say().await;
    }
}

impl Tested for Decode {
    fn faults(&self) -> &Faults {
        &self.faults
    }
}

impl Decode {
    /// Asks for `room` (`POST /v1/rooms/{room}`): the agent resolves the prefill group, says
    /// Hello where needed and requests the room's KV into the given pages (or its own).
    /// Returns the new room's view; the transfer goes on in the background.
    pub async fn request(
        self: &Arc<Self>,
        room_id: u64,
        mut req: RoomRequest,
    ) -> Result<RoomView, RoomError> {
        self.refuse_while_draining()?;
        if let Some(url) = &req.bootstrap {
            self.cfg.registries.check(url)?;
        }
        self.table.admit(&self.metrics)?;
        let l = &self.cfg.layout;
        if req.tokens == 0 {
            return Err(RoomError::BadRequest("tokens must be > 0".into()));
        }
        if req.start_token >= req.tokens {
            return Err(RoomError::BadRequest(format!(
                "start_token {} must be < tokens {}: there must be something to transfer",
                req.start_token, req.tokens
            )));
        }
        l.check_piece_start(req.start_token)
            .map_err(|e| RoomError::BadRequest(format!("start_token {}: {e}", req.start_token)))?;
        if u32::try_from(req.tokens).is_err() {
            return Err(RoomError::BadRequest(format!(
                "tokens {} is beyond the protocol's u32",
                req.tokens
            )));
        }
        let needed = l.pages_for(req.tokens);
        fields::fits_pool(req.tokens, needed, self.pool.num_pages())?;
        if let Some(source) = &req.source_pages
            && (source.is_empty() || source.len() > protocol::MAX_PAGES)
        {
            return Err(RoomError::BadRequest(format!(
                "{} source pages: a read names 1 to {} pages of the prefill's pool",
                source.len(),
                protocol::MAX_PAGES
            )));
        }
        // Whole pages, as this pool's own order moves them; the sources' wire orders, once
        // they are known, say what really comes (`expected` is then their sum).
        let moved = l.staged_tokens(&(req.start_token..req.tokens), l.order);
        let expected = l
            .selection_bytes(moved, l.num_layers(), l.num_heads())
            .map_err(|e| RoomError::BadRequest(format!("tokens {}: {e}", req.tokens)))?;
        let (pages, lease): (Arc<[u32]>, _) = match req.pages.take() {
            Some(pages) => {
                // Pages before the one holding `start_token` do not move.
                let first = req.start_token / l.page_size;
                fields::validate_pages(&pages, needed, self.pool.num_pages(), first)?;
                (pages.into(), None)
            }
            None => {
                let lease = (self.alloc.allocate(needed))
                    .or_else(|_| {
                        self.return_aborted_pages();
                        self.alloc.allocate(needed)
                    })
                    .map_err(|e| {
                        self.metrics.rejected.inc();
                        RoomError::Exhausted(e.to_string())
                    })?;
                (lease.pages().into(), Some(lease))
            }
        };
        let view = {
            let mut rooms = self.rooms();
            if rooms.contains_key(&room_id) {
                return Err(RoomError::Conflict(format!(
                    "room {room_id} already exists"
                )));
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
        let task_inner = self.clone();
        let span = tracing::info_span!("room", room = room_id, role = "decode");
        tokio::spawn(
            async move {
                let asked = task_inner.clone().send_request(room_id, req).await;
                task_inner.holds.release(room_id);
                if let Err(reason) = asked {
                    task_inner.fail(room_id, reason);
                }
            }
            .instrument(span),
        );
        Ok(view)
    }

    /// Returns the agent-owned pages of every aborted room that is safe to reuse to the pool,
    /// without waiting for the room to be taken or to expire (the room itself stays readable
    /// and takeable until then). Called on every housekeeping tick, before answering a pool
    /// count and when the pool cannot give a new room its pages, so the pool is whole as soon
    /// as it can be. A room's view returns that room's alone ([`Self::return_aborted_pages_of`]):
    /// a scan of every room for each view made polling many rooms quadratic.
    pub(super) fn return_aborted_pages(&self) {
        for (id, room) in self.rooms().iter_mut() {
            room.return_pages_if_aborted(*id);
        }
    }

    /// [`Self::return_aborted_pages`] for one room.
    fn return_aborted_pages_of(&self, room_id: u64) {
        if let Some(room) = self.rooms().get_mut(&room_id) {
            room.return_pages_if_aborted(room_id);
        }
    }

    /// Takes `room` (`POST /v1/rooms/{room}/take`): once it is `safe_to_reuse`, hands it over
    /// and forgets it; agent-owned pages return to the pool. A synthetic agent checks the
    /// landed bytes first (on the blocking pool), as `--synthetic-verify` says.
    pub async fn take(&self, room_id: u64) -> Result<TakenRoom, RoomError> {
        let (pages, tokens) = {
            let rooms = self.rooms();
            let room = rooms.get(&room_id).ok_or(RoomError::UnknownRoom(room_id))?;
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
                return Err(RoomError::Conflict(why));
            }
            (room.pages.clone(), room.start_token..room.tokens)
        };
        let mut verified = None;
        let succeeded = self
            .rooms()
            .get(&room_id)
            .is_some_and(|r| r.status.state() == RoomState::Success);
        if let Some(engine) = self.synthetic.as_ref().filter(|_| succeeded) {
            let result = engine.check(&self.pool, room_id, pages, tokens).await;
            verified = Some(result.is_ok());
            if let Err(e) = result {
                let mut rooms = self.rooms();
                if let Some(room) = rooms.get_mut(&room_id)
                    && room
                        .status
                        .fail_verification(Reason::new(FailureCode::VerifyFailed, e.clone()))
                {
                    self.metrics.verify_failures.inc();
                }
                tracing::error!(room = room_id, error = %e, "landed bytes differ from the synthetic pattern");
            }
        }
        let room = self
            .rooms()
            .remove(&room_id)
            .ok_or(RoomError::UnknownRoom(room_id))?;
        let aux = room
            .sources
            .iter()
            .filter_map(|s| s.done.as_ref())
            .map(|d| &d.aux)
            .find(|a| !a.is_empty())
            .cloned();
        Ok(TakenRoom {
            aux,
            room: room.view(room_id),
            verified,
        })
    }
}

pub(super) struct Room {
    pub(super) status: RoomStatus,
    pub(super) tokens: usize,
    /// The first token requested; earlier ones are the decode engine's own prefix.
    pub(super) start_token: usize,
    pub(super) pages: Arc<[u32]>,
    /// Present when the agent allocated the pages; dropping it returns them.
    pub(super) lease: Option<PageLease>,
    /// The agent-owned pages went back to the pool early: the room was aborted and became safe
    /// to reuse before it was taken.
    pub(super) returned: bool,
    pub(super) expected: usize,
    pub(super) landed: usize,
    pub(super) chunks: u32,
    pub(super) coverage: Coverage,
    /// The prefill ranks the room comes from, one bulk segment each (see `pairing.rs`).
    pub(super) sources: Vec<Source>,
    /// AbortAcks still awaited while aborting.
    pub(super) acks_pending: usize,
    pub(super) scattering: usize,
    /// The sources with open writes were told to stop (the room failed or was aborted).
    pub(super) stop_told: bool,
    pub(super) final_at: Option<Instant>,
    /// The last sign of life of the room's transfer (request sent, chunk landed, Done): the
    /// ready and stall timeouts count from it.
    pub(super) progress_at: Instant,
}

/// Where a room comes from: the prefill group's ranks, their slices, and this decode rank's
/// segments ([`pairing::plan`]).
pub(super) struct Planned {
    pub(super) ranks: Vec<Registration>,
    pub(super) slices: Vec<RankSlice>,
    pub(super) segments: Vec<pairing::Segment>,
}

/// One segment of a room: what one prefill rank sends.
pub(super) struct Source {
    pub(super) peer: Arc<Peer>,
    /// Global layers.
    pub(super) layers: std::ops::Range<usize>,
    /// Global heads.
    pub(super) heads: std::ops::Range<usize>,
    pub(super) expected: usize,
    pub(super) landed: usize,
    pub(super) chunks: u32,
    pub(super) done: Option<protocol::Done>,
    /// Whether the source may still write into the room's pages directly (module doc).
    pub(super) writes: Writes,
    /// The secret of this source's request: its chunks must carry it.
    pub(super) secret: protocol::Secret,
    /// The order its chunks' bytes come in (the request's `wire_order`).
    pub(super) wire: crate::layout::PageOrder,
}

/// Whether a source may still write into a room's pages directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Writes {
    /// It never could (staged transport), or it has said its last word on the room.
    Closed,
    /// It may, until its last word.
    Open,
    /// It was declared dead: a prefill that is alive but cut off from this decode stops
    /// writing once its own heartbeat gives up on us, about `--peer-dead-ms` later; its writes
    /// are counted possible until then.
    Until(Instant),
}

impl Writes {
    pub(super) fn possible(self) -> bool {
        match self {
            Writes::Closed => false,
            Writes::Open => true,
            Writes::Until(t) => Instant::now() < t,
        }
    }
}

impl Room {
    /// Gives its agent-owned pages back to the pool if it is aborted and safe to reuse.
    fn return_pages_if_aborted(&mut self, id: u64) {
        if self.lease.is_some() && self.status.state() == RoomState::Aborted && self.safe_to_reuse()
        {
            self.lease = None;
            self.returned = true;
            tracing::debug!(
                room = id,
                pages = self.pages.len(),
                "aborted room's pages returned to the pool"
            );
        }
    }

    /// The peers whose direct writes into the room may still arrive and who can be told.
    pub(super) fn open_writers(&self) -> Vec<Arc<Peer>> {
        let open = self.sources.iter().filter(|s| s.writes == Writes::Open);
        open.map(|s| s.peer.clone()).collect()
    }

    /// `peer` has said its last word on the room (`Closed`), or was declared dead
    /// (`Until`): its writes end.
    pub(super) fn end_writes(&mut self, peer: Uuid, end: Writes) {
        for s in self.sources.iter_mut().filter(|s| s.peer.instance == peer) {
            if s.writes != Writes::Closed {
                s.writes = end;
            }
        }
        self.touch_if_safe();
    }

    /// Wakes engines long-polling for `safe_to_reuse` once it holds.
    pub(super) fn touch_if_safe(&self) {
        if self.safe_to_reuse() {
            self.status.touch();
        }
    }
}

impl Decode {
    /// Records a move to a final state: timestamp for expiry, metrics.
    pub(super) fn finished(&self, room: &mut Room) {
        if room.status.state().is_final() && room.final_at.is_none() {
            room.final_at = Some(Instant::now());
            let code = room.status.reason().map(|r| r.code);
            self.metrics.room_final(room.status.state(), code);
        }
    }

    pub(super) fn fail(&self, room_id: u64, reason: Reason) {
        let mut rooms = self.rooms();
        if let Some(room) = rooms.get_mut(&room_id)
            && room.status.fail(reason.clone())
        {
            tracing::warn!(room = room_id, %reason, "room failed");
            self.finished(room);
        }
    }

    /// A room is complete when every source said Done and every expected byte landed; a
    /// source whose Done disagrees with what landed fails it.
    pub(super) fn check_complete(&self, room_id: u64, room: &mut Room) {
        if room.sources.is_empty() || room.sources.iter().any(|s| s.done.is_none()) {
            return;
        }
        if room.landed < room.expected || room.scattering > 0 {
            return;
        }
        let wrong = room.sources.iter().find_map(|s| {
            let d = s.done.as_ref()?;
            (d.bytes as usize != s.expected || d.chunks != s.chunks || s.landed != s.expected).then(|| {
                format!(
                    "prefill {} reported {} bytes in {} chunks; {} bytes expected, {} in {} chunks landed",
                    s.peer.endpoint, d.bytes, d.chunks, s.expected, s.landed, s.chunks
                )
            })
        });
        if let Some(message) = wrong {
            room.status
                .fail(Reason::new(FailureCode::BadMessage, message));
        } else {
            room.status.advance(RoomState::Success);
            if let (Some(a), Some(b)) = (
                room.status.entered(RoomState::WaitingForInput),
                room.status.entered(RoomState::Success),
            ) {
                self.metrics
                    .transfer
                    .observe(Duration::from_secs_f64(((b - a) / 1e3).max(0.0)));
            }
            tracing::debug!(room = room_id, bytes = room.landed, "room landed");
        }
        self.finished(room);
    }

    /// The prefill group serving `room_id` (the engine's DP rank, or the room modulo the
    /// prefill DP size), its ranks' slices, and the segments this decode rank receives.
    pub(super) async fn plan_room(
        &self,
        room_id: u64,
        bootstrap: Option<&str>,
        dp_rank: Option<u32>,
    ) -> Result<Planned, Reason> {
        let client = self.registry_of(bootstrap)?;
        let group = match dp_rank {
            Some(d) => self.lookup(&client, d).await?,
            None => {
                let first = self.lookup(&client, 0).await?;
                match (room_id % u64::from(first.dp_size.max(1))) as u32 {
                    0 => first,
                    d => self.lookup(&client, d).await?,
                }
            }
        };
        let dp_rank = group.dp_rank;
        let slices: Vec<RankSlice> = group
            .ranks
            .iter()
            .map(|r| RankSlice {
                heads: r.slice.heads.start as usize..r.slice.heads.end as usize,
                layers: r.slice.layers.start as usize..r.slice.layers.end as usize,
            })
            .collect();
        let r = self.cfg.ranks;
        let me = (r.pp_rank * r.tp_size + r.tp_rank) as usize;
        let segments = pairing::plan(&slices, &self.decode_group()?, me).map_err(|e| {
            Reason::new(
                FailureCode::IncompatibleLayout,
                format!("prefill group dp_rank={dp_rank}: {e}"),
            )
        })?;
        Ok(Planned {
            ranks: group.ranks,
            slices,
            segments,
        })
    }

    /// Resolves the prefill ranks `room_id` will come from and says Hello where needed; from
    /// then on, while the hold lasts, the room is named in every heartbeat to them.
    pub(super) async fn hold_at_prefill(
        self: Arc<Self>,
        room_id: u64,
        asked: HoldRequest,
    ) -> Result<(), Reason> {
        let planned = self
            .plan_room(room_id, asked.bootstrap.as_deref(), asked.dp_rank)
            .await?;
        let mut prefills = Vec::with_capacity(planned.segments.len());
        for seg in &planned.segments {
            prefills.push(self.peer(&planned.ranks[seg.prefill]).await?.instance);
        }
        let kept = prefills.clone();
        // Its hold ended while its prefills were found: asked for (the room is this agent's
        // now), or let go.
        if !self.holds.update(room_id, |held| *held = kept) && !self.rooms().contains_key(&room_id)
        {
            self.let_go(room_id, prefills);
        }
        Ok(())
    }

    /// Tells the prefills a room was held at (`prefills`) that this decode will not ask for
    /// it: an Abort of a room it never asked for. The room then waits there `--requeue-ms` for
    /// another decode, not its whole TTL.
    pub(super) fn let_go(self: &Arc<Self>, room: u64, prefills: Vec<Uuid>) {
        let peers: Vec<Arc<Peer>> = {
            let known = self.peers();
            prefills
                .iter()
                .filter_map(|i| known.get(i).cloned())
                .collect()
        };
        if peers.is_empty() {
            return;
        }
        let reason = Reason::new(
            FailureCode::Aborted,
            format!(
                "decode {} let the room go without asking for it",
                self.instance
            ),
        );
        let decode = self.clone();
        tokio::spawn(async move {
            for peer in peers {
                if let Err(e) = decode.tell_abort(&peer, room, &reason).await {
                    tracing::debug!(room, reason = %e, "a let-go room's prefill not told");
                }
            }
        });
    }

    /// Resolves the prefill, says Hello if needed, and asks for the room.
    pub(super) async fn send_request(
        self: Arc<Self>,
        room_id: u64,
        asked: RoomRequest,
    ) -> Result<(), Reason> {
        let Planned {
            ranks,
            slices,
            segments,
        } = self
            .plan_room(room_id, asked.bootstrap.as_deref(), asked.dp_rank)
            .await?;
        let l = &self.cfg.layout;
        let decodes = self.decode_group()?;
        let mut sources = Vec::with_capacity(segments.len());
        for seg in segments {
            let peer = self.peer(&ranks[seg.prefill]).await?;
            if asked.source_pages.is_some() && peer.version < protocol::READS {
                return Err(Reason::new(
                    FailureCode::IncompatibleVersion,
                    format!(
                        "room {room_id} is a read (source pages), which prefills speak from protocol version {}; prefill {} speaks {}",
                        protocol::READS,
                        peer.instance,
                        peer.version
                    ),
                ));
            }
            let requesters = pairing::requesters(&slices, &decodes, seg.prefill);
            let secret = protocol::Secret::random().map_err(|e| {
                Reason::new(
                    FailureCode::BadMessage,
                    format!("no random bytes for the room's secret: {e}"),
                )
            })?;
            // The decode's own order makes its scatter long runs (the prefill's gather
            // converts), unless the page sizes differ: then token rows (layout::wire_order;
            // Hello refused the pairs that cannot meet).
            let source = KvLayout {
                page_size: ranks[seg.prefill].layout.page_size as usize,
                ..l.clone()
            };
            let wire = crate::layout::wire_order(&source, l).unwrap_or(l.order);
            sources.push((peer, seg, requesters, secret, wire));
        }
        let (tokens, pages) = {
            let mut rooms = self.rooms();
            let Some(room) = rooms.get_mut(&room_id) else {
                return Ok(());
            };
            if !room.status.advance(RoomState::WaitingForInput) {
                return Ok(()); // aborted meanwhile
            }
            let tokens = room.start_token..room.tokens;
            self.metrics.bootstrap.observe(room.progress_at.elapsed());
            room.progress_at = Instant::now();
            room.sources = sources
                .iter()
                .map(|(peer, seg, _, secret, wire)| Source {
                    peer: peer.clone(),
                    layers: seg.layers.clone(),
                    heads: seg.heads.clone(),
                    expected: l
                        .selection_bytes(
                            l.staged_tokens(&tokens, *wire),
                            seg.layers.len(),
                            seg.heads.len(),
                        )
                        .unwrap_or(usize::MAX),
                    landed: 0,
                    chunks: 0,
                    done: None,
                    writes: match peer.direct {
                        true => Writes::Open,
                        false => Writes::Closed,
                    },
                    secret: *secret,
                    wire: *wire,
                })
                .collect();
            room.expected = room.sources.iter().map(|s| s.expected).sum();
            (tokens, room.pages.to_vec())
        };
        for (peer, seg, requesters, secret, wire_order) in sources {
            let req = Message::TransferRequest(TransferRequest {
                room: room_id,
                prefill_instance: peer.instance,
                tokens: tokens.start as u32..tokens.end as u32,
                layers: seg.layers.start as u32..seg.layers.end as u32,
                heads: seg.heads.start as u32..seg.heads.end as u32,
                wire_order,
                dst_pages: pages.clone(),
                requesters: requesters as u32,
                secret,
                room_key: asked.room_key,
                prompt_digest: asked.prompt_digest,
                src_pages: asked.source_pages.clone(),
            });
            peer.send(&req, self.timeouts().send).await?;
        }
        Ok(())
    }

    /// The slices of every decode rank of this agent's group (PP stages in order, TP ranks in
    /// order within each), for [`pairing::plan`].
    pub(super) fn decode_group(&self) -> Result<Vec<RankSlice>, Reason> {
        let l = &self.cfg.layout;
        let r = self.cfg.ranks;
        let whole = KvLayout::new(l.model, l.page_size)
            .map_err(|e| Reason::new(FailureCode::IncompatibleLayout, e.to_string()))?;
        let mut out = Vec::new();
        for pp in 0..r.pp_size as usize {
            for tp in 0..r.tp_size as usize {
                let s = whole
                    .clone()
                    .for_rank(tp, r.tp_size as usize, pp, r.pp_size as usize)
                    .map_err(|e| Reason::new(FailureCode::IncompatibleLayout, e.to_string()))?;
                out.push(RankSlice {
                    heads: s.heads,
                    layers: s.layers,
                });
            }
        }
        Ok(out)
    }

    /// Aborts a room that is not final: `aborting` until every prefill serving it acknowledged
    /// (at once when none was asked yet), `aborted` after.
    pub(super) async fn abort_room(&self, room_id: u64, reason: Reason) {
        let peers = {
            let mut rooms = self.rooms();
            let Some(room) = rooms.get_mut(&room_id) else {
                return;
            };
            let state = room.status.state();
            if state.is_final() || state == RoomState::Aborting {
                return;
            }
            // Before any request went out nothing can arrive: aborted at once.
            let peers: Vec<Arc<Peer>> = room.sources.iter().map(|s| s.peer.clone()).collect();
            room.status.abort(reason.clone(), peers.is_empty());
            room.stop_told = true;
            room.acks_pending = peers.len();
            self.finished(room);
            peers
        };
        for peer in peers {
            if let Err(e) = self.tell_abort(&peer, room_id, &reason).await {
                // The prefill cannot be told: with staged transports nothing more lands once
                // the room no longer accepts chunks, so its acknowledgement is not needed.
                tracing::warn!(room = room_id, reason = %e, "abort not delivered");
                let mut rooms = self.rooms();
                if let Some(room) = rooms.get_mut(&room_id) {
                    room.acks_pending = room.acks_pending.saturating_sub(1);
                    if room.acks_pending == 0 && room.status.advance(RoomState::Aborted) {
                        self.finished(room);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The JSON of a typed view is what a `serde_json::Value` of it prints: keys in sorted
    /// order, as the engine API has always answered.
    fn sorted_json<T: Serialize>(v: &T) -> String {
        let direct = serde_json::to_string(v).unwrap();
        let via_value = serde_json::to_string(&serde_json::to_value(v).unwrap()).unwrap();
        assert_eq!(direct, via_value, "fields out of alphabetical order");
        direct
    }

    #[test]
    fn views_serialize_as_the_wire_format() {
        let view = RoomView {
            bytes: 4096,
            chunks: 2,
            expected_bytes: 8192,
            page_owner: PageOwner::Engine,
            pages: vec![3, 4],
            reason: Some(Reason::new(FailureCode::PeerDead, "gone")),
            room: u64::MAX,
            safe_to_reuse: true,
            sources: vec![SourceView {
                bytes: 4096,
                done: false,
                heads: [0, 2],
                layers: [0, 4],
                prefill_instance: Uuid::nil(),
            }],
            start_token: 16,
            state: RoomState::Failed,
            timings: [("created", 1.5), ("failed", 2.25)].into_iter().collect(),
            tokens: 40,
        };
        let json = sorted_json(&view);
        assert!(json.contains(r#""room":"18446744073709551615""#), "{json}");
        assert!(json.contains(r#""page_owner":"engine""#), "{json}");
        assert!(
            json.contains(r#""reason":{"code":"peer_dead","message":"gone"}"#),
            "{json}"
        );
        let taken = TakenRoom {
            aux: Some(b"hello".to_vec()),
            room: view,
            verified: None,
        };
        let json = sorted_json(&taken);
        assert!(
            json.starts_with(r#"{"aux":"aGVsbG8=","bytes":4096,"#),
            "{json}"
        );
        assert!(json.ends_with(r#""tokens":40,"verified":null}"#), "{json}");
    }

    #[test]
    fn requests_parse_from_the_wire_format() {
        let key = "00112233445566778899aabbccddeeff";
        let req: RoomRequest = serde_json::from_str(&format!(
            r#"{{"tokens":40,"pages":[3,4,5],"start_token":16,"room_key":"{key}"}}"#
        ))
        .unwrap();
        assert_eq!((req.tokens, req.start_token), (40, 16));
        assert_eq!(req.room_key.map(|k| k.to_hex()).as_deref(), Some(key));
        let back = serde_json::to_value(&req).unwrap();
        assert_eq!(back["room_key"], key);
        assert!(back.get("dp_rank").is_none(), "{back}");
        let bad = serde_json::from_str::<RoomRequest>(r#"{"tokens":4,"room_key":"xyz"}"#);
        assert!(
            bad.unwrap_err()
                .to_string()
                .contains("room_key: a room key is 32 hex digits")
        );
        let unknown = serde_json::from_str::<RoomRequest>(r#"{"tokens":4,"bogus":1}"#);
        assert!(unknown.unwrap_err().to_string().contains("bogus"));
        assert!(
            serde_json::from_str::<RoomRequest>("{}").is_err(),
            "tokens is required"
        );
    }
}
