//! The room operations both agents have, written once (`RoomOps`: read a room, wait for its
//! next change, abort it, hold it while its request is queued, count the pool, render the
//! metrics), and what the role-specific ones share: their one error type, the checks of an
//! engine's pages, and the JSON forms of request fields (room keys as hex, aux bytes as
//! base64).
//!
//! Each role implements `RoomOps` over its room table and adds its own operations in its
//! `rooms.rs` (a prefill announces rooms ready; a decode requests and takes them). The Rust
//! handles ([`super::prefill::PrefillAgent`], [`super::decode::DecodeAgent`]), and through them
//! the Python package, call these; so does the engine-facing HTTP API (`api.rs`), which parses
//! a request into the same request structs and turns a [`RoomError`] into a status in one
//! place. Nothing here knows HTTP.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tokio::sync::watch;

use super::metrics::{Gauges, Metrics};
use super::room::{RoomState, RoomStatus};
use crate::pool::allocator::PageAllocator;
use crate::protocol::Secret;
use crate::reason::{FailureCode, Reason};

/// A room of either role, as the shared operations read it.
pub(crate) trait TableRoom {
    /// What the engine sees of it.
    type View;
    /// Its view now.
    fn view(&self, room: u64) -> Self::View;
    /// No transfer reads or writes its pages any more.
    fn safe_to_reuse(&self) -> bool;
    /// Its state, reason and timings.
    fn status(&self) -> &RoomStatus;
}

/// The room operations both roles have, written once over what each role gives: its room
/// table, its pool, its limits, and its own ways to abort and hold a room.
pub(crate) trait RoomOps: Send + Sync + Sized + 'static {
    /// The role's room.
    type Room: TableRoom<View = Self::View>;
    /// The room as the engine sees it (`GET /v1/rooms/{room}`).
    type View: Serialize + Send + 'static;
    /// What holding a room takes (`POST /v1/rooms/{room}/hold`).
    type Hold: DeserializeOwned + Send + 'static;
    /// `prefill` or `decode`.
    const ROLE: &'static str;

    /// The room table.
    fn table(&self) -> MutexGuard<'_, HashMap<u64, Self::Room>>;
    /// The agent-owned pages.
    fn alloc(&self) -> &PageAllocator;
    /// The agent's metrics.
    fn metrics(&self) -> &Metrics;
    /// `--max-rooms`.
    fn max_rooms(&self) -> usize;
    /// Fault injection's switches and the timeouts in force (`POST /v1/faults`).
    fn faults(&self) -> &super::faults::Faults;
    /// Shutting down: new rooms and holds are refused.
    fn draining(&self) -> bool;
    /// Aborts a room the engine gave up on, telling its peers why.
    fn abort_with(self: &Arc<Self>, room: u64, reason: Reason) -> impl Future<Output = ()> + Send;
    /// Holds a room (after the draining check).
    fn hold_with(self: &Arc<Self>, room: u64, req: Self::Hold) -> Result<(), RoomError>;
    /// Stops holding a room; holding nothing is not an error.
    fn unhold_room(&self, room: u64);
    /// The role's own gauges: the pool's labels, pinned bytes, staging slots in use.
    fn gauges(&self) -> Gauges;
    /// Housekeeping owed before the engine reads a room or the pool (decode: aborted rooms'
    /// pages go back to the pool at once).
    fn tidy(&self) {}

    /// The room's view and, while it may still change, a receiver of its next change.
    fn look(&self, room: u64) -> Result<Look<Self::View>, RoomError> {
        let rooms = self.table();
        let r = rooms.get(&room).ok_or(RoomError::UnknownRoom(room))?;
        let changing = !r.safe_to_reuse();
        Ok((r.view(room), changing.then(|| r.status().subscribe())))
    }

    /// The room's view now (`GET /v1/rooms/{room}`).
    fn room_view(&self, room: u64) -> Result<Self::View, RoomError> {
        self.tidy();
        Ok(self.look(room)?.0)
    }

    /// The room's view at its next change, or after `timeout` (at most [`MAX_WAIT`]),
    /// whichever comes first; at once when it can no longer change
    /// (`GET /v1/rooms/{room}?wait_ms=`).
    fn wait_room(
        &self,
        room: u64,
        timeout: Duration,
    ) -> impl Future<Output = Result<Self::View, RoomError>> + Send {
        self.tidy();
        next_change(timeout, move || self.look(room))
    }

    /// Aborts `room` for the engine (`DELETE /v1/rooms/{room}`) and returns its view.
    fn abort_room(
        self: &Arc<Self>,
        room: u64,
    ) -> impl Future<Output = Result<Self::View, RoomError>> + Send {
        async move {
            if !self.table().contains_key(&room) {
                return Err(RoomError::UnknownRoom(room));
            }
            let why = format!("aborted by the {} engine", Self::ROLE);
            self.abort_with(room, Reason::new(FailureCode::Aborted, why))
                .await;
            self.room_view(room)
        }
    }

    /// Holds `room` while the engine has its request queued (`POST /v1/rooms/{room}/hold`).
    fn hold_room(self: &Arc<Self>, room: u64, req: Self::Hold) -> Result<(), RoomError> {
        self.refuse_while_draining()?;
        self.hold_with(room, req)
    }

    /// The agent-owned pages (`GET /v1/pool`).
    fn pool_counts(&self) -> PoolCounts {
        self.tidy();
        PoolCounts::of(self.alloc())
    }

    /// The metrics in the OpenMetrics text format (`GET /metrics`).
    fn render_metrics(&self) -> String {
        let mut g = self.gauges();
        g.pool_total = self.alloc().total_pages();
        g.pool_free = self.alloc().free_pages();
        for room in self.table().values() {
            g.room(room.status().state());
        }
        self.metrics().render(&g)
    }

    /// Aborts every room not final yet, telling its peers the agent is shutting down (the
    /// end of a drain); returns how many.
    fn abort_unfinished(self: &Arc<Self>) -> impl Future<Output = usize> + Send {
        async move {
            let left: Vec<u64> = self
                .table()
                .iter()
                .filter(|(_, r)| !r.status().state().is_final())
                .map(|(id, _)| *id)
                .collect();
            tracing::info!(aborted = left.len(), "drained");
            let why = format!("the {} agent is shutting down", Self::ROLE);
            for &room in &left {
                self.abort_with(room, Reason::new(FailureCode::Shutdown, why.clone()))
                    .await;
            }
            left.len()
        }
    }

    /// Refuses new work while the agent drains for shutdown.
    fn refuse_while_draining(&self) -> Result<(), RoomError> {
        match self.draining() {
            true => Err(RoomError::Unavailable(format!(
                "the agent is draining for shutdown: send the room to another {} rank",
                Self::ROLE
            ))),
            false => Ok(()),
        }
    }

    /// Refuses a new room while `--max-rooms` rooms are in flight (counted as refused).
    fn admit_room(&self) -> Result<(), RoomError> {
        let in_flight = self
            .table()
            .values()
            .filter(|r| !r.status().state().is_final())
            .count();
        if in_flight >= self.max_rooms() {
            self.metrics().rejected.inc();
            return Err(RoomError::Exhausted(format!(
                "{in_flight} rooms in flight; this agent admits at most {} (--max-rooms)",
                self.max_rooms()
            )));
        }
        Ok(())
    }
}

/// Why a room operation was refused. Nothing changed in the agent when one is returned,
/// except a refusal counted in the metrics. The message says what was wrong and, where it
/// helps, which flag sets the limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RoomError {
    /// The request is malformed, or can never be served as given (HTTP 400): a bad token
    /// count or range, pages out of range, a room that needs more pages than the whole pool.
    #[error("{0}")]
    BadRequest(String),
    /// No such room (HTTP 404): never created here, already taken, or expired.
    #[error("unknown room {0}")]
    UnknownRoom(u64),
    /// The request conflicts with the room's state (HTTP 409): a duplicate room, a take
    /// before `safe_to_reuse`, an overlapping ready piece, another room key.
    #[error("{0}")]
    Conflict(String),
    /// No capacity now (HTTP 429): `--max-rooms` reached or agent-owned pages exhausted;
    /// retry later or elsewhere.
    #[error("{0}")]
    Exhausted(String),
    /// The agent cannot serve this now (HTTP 503): it is draining for shutdown.
    #[error("{0}")]
    Unavailable(String),
    /// The request names a peer this agent does not trust with its token (HTTP 403): a
    /// registry that is neither `--bootstrap`'s nor in `--allowed-registries`. Nothing was
    /// sent to it.
    #[error(transparent)]
    Forbidden(#[from] super::Untrusted),
}

impl RoomError {
    /// Whether the same request may succeed later or on another rank (exhausted, draining);
    /// the others fail again as long as the request and the room are unchanged.
    pub fn is_retryable(&self) -> bool {
        matches!(self, RoomError::Exhausted(_) | RoomError::Unavailable(_))
    }
}

/// The agent-owned pages of a pool (`GET /v1/pool`); pages an engine names are not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PoolCounts {
    /// Pages free now.
    pub free_pages: usize,
    /// Every page of the pool.
    pub total_pages: usize,
}

impl PoolCounts {
    pub(crate) fn of(alloc: &PageAllocator) -> Self {
        PoolCounts {
            free_pages: alloc.free_pages(),
            total_pages: alloc.total_pages(),
        }
    }
}

/// The longest a wait for a room's next change lasts (`?wait_ms=` is capped to it too).
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// A room's view and, while it may still change (not final, or not yet safe to reuse), a
/// receiver that wakes on its next change.
pub(crate) type Look<V> = (V, Option<watch::Receiver<RoomState>>);

/// The view of a room at its next change or after `timeout` (at most [`MAX_WAIT`]),
/// whichever comes first; at once when the room can no longer change. Awaits a watch
/// channel: the reactor is never blocked.
pub(crate) async fn next_change<V>(
    timeout: Duration,
    look: impl Fn() -> Result<Look<V>, RoomError>,
) -> Result<V, RoomError> {
    let (view, rx) = look()?;
    let Some(mut rx) = rx else {
        return Ok(view);
    };
    let _ = tokio::time::timeout(timeout.min(MAX_WAIT), rx.changed()).await;
    Ok(look()?.0)
}

/// Refuses a room that can never fit: its `tokens` need more pages than the whole pool has
/// (exhausted would invite a retry that cannot succeed).
pub(crate) fn fits_pool(tokens: usize, needed: usize, pool_pages: usize) -> Result<(), RoomError> {
    if needed > pool_pages {
        return Err(RoomError::BadRequest(format!(
            "tokens {tokens} need {needed} pages but the whole pool has {pool_pages} (--pool-pages): this room can never fit"
        )));
    }
    Ok(())
}

/// Checks an engine's page list: enough pages for the tokens, each in the pool, none twice.
pub(crate) fn validate_pages(
    pages: &[u32],
    needed: usize,
    num_pages: usize,
) -> Result<(), RoomError> {
    if pages.len() < needed {
        return Err(RoomError::BadRequest(format!(
            "{} pages given, the tokens need {needed}",
            pages.len()
        )));
    }
    if let Some(p) = pages.iter().find(|&&p| p as usize >= num_pages) {
        return Err(RoomError::BadRequest(format!(
            "page {p} is out of range: the pool has {num_pages} pages"
        )));
    }
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(RoomError::BadRequest(format!(
            "page {} is listed twice",
            w[0]
        )));
    }
    Ok(())
}

/// A room id in JSON: a string (beyond 2^53 a JSON number breaks).
pub(crate) fn room_as_string<S: Serializer>(room: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(room)
}

/// A room key in JSON: 32 hex digits, or absent.
pub(crate) mod room_key {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(key: &Option<Secret>, s: S) -> Result<S::Ok, S::Error> {
        match key {
            Some(key) => s.serialize_str(&key.to_hex()),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Secret>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|k| {
                k.parse()
                    .map_err(|e: String| serde::de::Error::custom(format!("room_key: {e}")))
            })
            .transpose()
    }
}

/// A CUDA IPC event handle in JSON: 128 hex digits, or absent.
pub(crate) mod ipc_event {
    use super::*;
    use crate::kernel::cuda::IpcEventHandle;

    pub(crate) fn serialize<S: Serializer>(
        handle: &Option<IpcEventHandle>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match handle {
            Some(handle) => s.serialize_str(&handle.to_string()),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<IpcEventHandle>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|h| {
                h.parse()
                    .map_err(|e: String| serde::de::Error::custom(format!("cuda_ipc_event {e}")))
            })
            .transpose()
    }
}

/// Aux bytes in JSON: standard base64 (with padding), or absent.
pub(crate) mod aux {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;

    use super::*;

    pub(crate) fn serialize<S: Serializer>(
        bytes: &Option<Vec<u8>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => s.serialize_str(&STANDARD.encode(bytes)),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| {
                STANDARD
                    .decode(text)
                    .map_err(|e| serde::de::Error::custom(format!("aux is not valid base64: {e}")))
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_lists_are_checked() {
        assert_eq!(validate_pages(&[0, 1, 2], 3, 4), Ok(()));
        let bad = |pages: &[u32], needed| match validate_pages(pages, needed, 4) {
            Err(RoomError::BadRequest(m)) => m,
            other => panic!("{pages:?}: {other:?}"),
        };
        assert!(bad(&[0], 2).contains("1 pages given"));
        assert!(bad(&[0, 4], 2).contains("page 4 is out of range"));
        assert!(bad(&[2, 1, 2], 3).contains("page 2 is listed twice"));
        assert!(
            matches!(fits_pool(17, 5, 4), Err(RoomError::BadRequest(m)) if m.contains("--pool-pages"))
        );
        assert!(RoomError::Exhausted(String::new()).is_retryable());
        assert!(!RoomError::UnknownRoom(3).is_retryable());
        assert_eq!(RoomError::UnknownRoom(3).to_string(), "unknown room 3");
    }

    #[tokio::test]
    async fn a_settled_room_answers_at_once_and_a_changing_one_at_its_change() {
        let settled = next_change(MAX_WAIT, || Ok((1, None))).await;
        assert_eq!(settled, Ok(1));
        let (tx, _) = watch::channel(RoomState::Transferring);
        let tx = std::sync::Arc::new(tx);
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let started = std::time::Instant::now();
        let view = next_change(MAX_WAIT, || {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let rx = tx.subscribe();
            if n == 0 {
                // The change comes after the first look subscribed.
                let tx = tx.clone();
                tokio::spawn(async move { tx.send_replace(RoomState::Success) });
            }
            Ok((n, Some(rx)))
        })
        .await;
        println!("woke after {:?}", started.elapsed());
        assert_eq!(view, Ok(1), "the second look is the answer");
        let unknown = next_change(MAX_WAIT, || Err::<Look<()>, _>(RoomError::UnknownRoom(9)));
        assert_eq!(unknown.await, Err(RoomError::UnknownRoom(9)));
    }
}
