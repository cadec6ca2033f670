//! The room table both roles own: each role's rooms by id, the admission of new rooms
//! (`--max-rooms`, refused while the agent drains), and what the engine API's shared
//! operations read of it (a room's view, its next change, the rooms not final yet, the count
//! by state for the metrics).
//!
//! A role's room ([`TableRoom`]) says what the engine sees of it; the table knows nothing else
//! of it. The lock is short and never held across an `.await`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;

use super::engine_api::{MAX_WAIT, RoomError};
use super::metrics::{Gauges, Metrics};
use super::room::{RoomState, RoomStatus};
use crate::reason::{FailureCode, Reason};

/// A room of either role, as the table reads it.
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

/// A role's rooms by id.
pub(crate) struct RoomTable<R> {
    rooms: Mutex<HashMap<u64, R>>,
    /// `--max-rooms`: rooms in flight at most.
    max_rooms: usize,
    /// Set when the agent drains for shutdown: new rooms and holds are refused.
    draining: AtomicBool,
}

/// A room's view and, while it may still change (not final, or not yet safe to reuse), a
/// receiver that wakes on its next change.
type Look<V> = (V, Option<watch::Receiver<RoomState>>);

impl<R: TableRoom> RoomTable<R> {
    pub(crate) fn new(max_rooms: usize) -> Self {
        RoomTable {
            rooms: Mutex::new(HashMap::new()),
            max_rooms,
            draining: AtomicBool::new(false),
        }
    }

    /// The rooms, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<u64, R>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The room's view now.
    pub(crate) fn view(&self, room: u64) -> Result<R::View, RoomError> {
        Ok(self.look(room)?.0)
    }

    /// The room's view at its next change or after `timeout` (at most [`MAX_WAIT`]),
    /// whichever comes first; at once when the room can no longer change. Awaits a watch
    /// channel: the reactor is never blocked.
    pub(crate) async fn wait(&self, room: u64, timeout: Duration) -> Result<R::View, RoomError> {
        next_change(timeout, || self.look(room)).await
    }

    /// Refuses a room the table does not have.
    pub(crate) fn known(&self, room: u64) -> Result<(), RoomError> {
        match self.lock().contains_key(&room) {
            true => Ok(()),
            false => Err(RoomError::UnknownRoom(room)),
        }
    }

    /// Refuses new work while the agent drains for shutdown; `role` names where to send it.
    pub(crate) fn refuse_while_draining(&self, role: &str) -> Result<(), RoomError> {
        match self.draining.load(Ordering::Relaxed) {
            true => Err(RoomError::Unavailable(format!(
                "the agent is draining for shutdown: send the room to another {role} rank"
            ))),
            false => Ok(()),
        }
    }

    /// From now on, new rooms and holds are refused.
    pub(crate) fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Refuses a new room while `--max-rooms` rooms are in flight (counted as refused in
    /// `metrics`).
    pub(crate) fn admit(&self, metrics: &Metrics) -> Result<(), RoomError> {
        let in_flight = self
            .lock()
            .values()
            .filter(|r| !r.status().state().is_final())
            .count();
        if in_flight >= self.max_rooms {
            metrics.rejected.inc();
            return Err(RoomError::Exhausted(format!(
                "{in_flight} rooms in flight; this agent admits at most {} (--max-rooms)",
                self.max_rooms
            )));
        }
        Ok(())
    }

    /// The rooms not final yet.
    fn unfinished(&self) -> Vec<u64> {
        self.lock()
            .iter()
            .filter(|(_, r)| !r.status().state().is_final())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Aborts every room not final yet with `abort`, telling their peers that the `role` agent
    /// is shutting down (the end of a drain); returns how many.
    pub(crate) async fn abort_unfinished<F: Future<Output = ()>>(
        &self,
        role: &str,
        abort: impl Fn(u64, Reason) -> F,
    ) -> usize {
        let left = self.unfinished();
        tracing::info!(aborted = left.len(), "drained");
        let why = format!("the {role} agent is shutting down");
        for &room in &left {
            abort(room, Reason::new(FailureCode::Shutdown, why.clone())).await;
        }
        left.len()
    }

    /// Counts the rooms by state into `g`.
    pub(crate) fn count(&self, g: &mut Gauges) {
        for room in self.lock().values() {
            g.room(room.status().state());
        }
    }

    fn look(&self, room: u64) -> Result<Look<R::View>, RoomError> {
        let rooms = self.lock();
        let r = rooms.get(&room).ok_or(RoomError::UnknownRoom(room))?;
        let changing = !r.safe_to_reuse();
        Ok((r.view(room), changing.then(|| r.status().subscribe())))
    }
}

/// The view of a room at its next change or after `timeout` (at most [`MAX_WAIT`]),
/// whichever comes first; at once when the room can no longer change.
async fn next_change<V>(
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

#[cfg(test)]
mod tests {
    use super::*;

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
