//! A room's lifecycle, shared by both agents: the monotonic state (docs/engines.md, room JSON), the
//! reason of a failure, a timestamp per state change, and a watch channel that long-polling
//! engines wait on.
//!
//! Allowed moves: `bootstrapping -> waiting_for_input -> transferring -> success`, any state
//! before a final one to `failed` or `aborting`, `aborting -> aborted`. Final states
//! (`success`, `failed`, `aborted`) never change again; a refused move returns false. One move
//! goes back: a prefill room whose decode died before the room was delivered returns from
//! `transferring` to `waiting_for_input` ([`RoomStatus::requeue`]), for another decode.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::watch;

use crate::reason::Reason;

/// The state of a room (names fixed by the room JSON, docs/engines.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoomState {
    /// Resolving peers.
    Bootstrapping,
    /// Waiting for the engine's input (prefill) or the first bytes (decode).
    WaitingForInput,
    /// Bytes are moving.
    Transferring,
    /// Every expected byte has landed (decode) or been sent (prefill).
    Success,
    /// Failed; the reason says why.
    Failed,
    /// An abort was sent; waiting for the peer's acknowledgement.
    Aborting,
    /// Aborted and acknowledged.
    Aborted,
}

impl RoomState {
    /// Every state, for metrics.
    pub const ALL: [RoomState; 7] = [
        RoomState::Bootstrapping,
        RoomState::WaitingForInput,
        RoomState::Transferring,
        RoomState::Success,
        RoomState::Failed,
        RoomState::Aborting,
        RoomState::Aborted,
    ];

    /// The state's name in JSON and metrics.
    pub fn name(self) -> &'static str {
        match self {
            RoomState::Bootstrapping => "bootstrapping",
            RoomState::WaitingForInput => "waiting_for_input",
            RoomState::Transferring => "transferring",
            RoomState::Success => "success",
            RoomState::Failed => "failed",
            RoomState::Aborting => "aborting",
            RoomState::Aborted => "aborted",
        }
    }

    /// True for states that never change again.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            RoomState::Success | RoomState::Failed | RoomState::Aborted
        )
    }

    /// Whether a room in `self` may move to `to`.
    pub fn can_move_to(self, to: RoomState) -> bool {
        use RoomState::*;
        match (self, to) {
            (Aborting, Aborted) => true,
            (from, _) if from.is_final() || from == Aborting => false,
            (_, Failed | Aborting | Aborted) => true,
            (from, to) => to > from && to <= Success,
        }
    }
}

/// Milliseconds since the Unix epoch, for timings operators can line up across hosts.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// State, reason and timings of one room.
#[derive(Debug)]
pub struct RoomStatus {
    state: RoomState,
    reason: Option<Reason>,
    timings: Vec<(&'static str, f64)>,
    watch: watch::Sender<RoomState>,
}

impl Default for RoomStatus {
    fn default() -> Self {
        Self::new(RoomState::Bootstrapping)
    }
}

impl RoomStatus {
    /// A room entering `state` now.
    pub fn new(state: RoomState) -> Self {
        let t = now_ms();
        RoomStatus {
            state,
            reason: None,
            timings: vec![("created", t), (state.name(), t)],
            watch: watch::Sender::new(state),
        }
    }

    /// The current state.
    pub fn state(&self) -> RoomState {
        self.state
    }

    /// Why the room failed or was aborted.
    pub fn reason(&self) -> Option<&Reason> {
        self.reason.as_ref()
    }

    /// The time (ms since the epoch) the room entered `state`, if it did.
    pub fn entered(&self, state: RoomState) -> Option<f64> {
        self.at(state.name())
    }

    /// Moves to `to` if allowed; returns whether it moved.
    pub fn advance(&mut self, to: RoomState) -> bool {
        if !self.state.can_move_to(to) {
            return false;
        }
        self.state = to;
        self.timings.push((to.name(), now_ms()));
        self.watch.send_replace(to);
        true
    }

    /// Fails the room with `reason` unless it is already final; returns whether it moved.
    pub fn fail(&mut self, reason: Reason) -> bool {
        let moved = self.advance(RoomState::Failed);
        if moved {
            self.reason = Some(reason);
        }
        moved
    }

    /// A landed room whose bytes the synthetic engine's check refuses on take: `success`
    /// becomes `failed` with `reason`. The one move out of a final state, because the agent
    /// learns only at take that the bytes were wrong; it is counted apart from the rooms.
    pub fn fail_verification(&mut self, reason: Reason) -> bool {
        if self.state != RoomState::Success {
            return false;
        }
        self.state = RoomState::Failed;
        self.reason = Some(reason);
        self.timings.push((RoomState::Failed.name(), now_ms()));
        self.watch.send_replace(RoomState::Failed);
        true
    }

    /// A prefill room whose decode died before the room was delivered waits for another
    /// decode: `transferring` goes back to `waiting_for_input` (the one move back; the timings
    /// record `requeued`). Returns whether it moved.
    pub fn requeue(&mut self) -> bool {
        if self.state != RoomState::Transferring {
            return false;
        }
        self.state = RoomState::WaitingForInput;
        let now = now_ms();
        self.timings.push(("requeued", now));
        self.timings.push((RoomState::WaitingForInput.name(), now));
        self.watch.send_replace(self.state);
        true
    }

    /// Moves to `aborting` (or straight to `aborted` when `acknowledged`) with `reason`.
    pub fn abort(&mut self, reason: Reason, acknowledged: bool) -> bool {
        let to = if acknowledged {
            RoomState::Aborted
        } else {
            RoomState::Aborting
        };
        let moved = self.advance(to);
        if moved {
            self.reason = Some(reason);
        }
        moved
    }

    /// Records a named event (e.g. the engine's "ready") among the timings.
    pub fn mark(&mut self, event: &'static str) {
        self.timings.push((event, now_ms()));
    }

    /// Records a named event unless it was recorded before: the first time a stage was
    /// reached (a room's first gather, first send, first landing; docs/engines.md, "Room
    /// JSON").
    pub fn mark_first(&mut self, event: &'static str) {
        if self.at(event).is_none() {
            self.mark(event);
        }
    }

    /// The time (ms since the epoch) of a named event or state.
    pub fn at(&self, event: &str) -> Option<f64> {
        self.timings
            .iter()
            .find(|(name, _)| *name == event)
            .map(|(_, t)| *t)
    }

    /// Wakes long-pollers without a state change (e.g. a final room just became safe to
    /// reuse).
    pub fn touch(&self) {
        self.watch.send_replace(self.state);
    }

    /// A receiver that wakes on the next state change.
    pub fn subscribe(&self) -> watch::Receiver<RoomState> {
        self.watch.subscribe()
    }

    /// Timings by name (states and events such as `created`, `ready`): ms since the epoch,
    /// the latest of a name repeated.
    pub fn timings(&self) -> std::collections::BTreeMap<&'static str, f64> {
        self.timings.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reason::FailureCode;

    #[test]
    fn states_only_move_forward() {
        use RoomState::*;
        let mut s = RoomStatus::default();
        assert!(s.advance(WaitingForInput));
        assert!(!s.advance(Bootstrapping));
        assert!(
            s.advance(Success),
            "skipping transferring is allowed (empty rooms)"
        );
        assert!(!s.fail(Reason::new(FailureCode::PeerDead, "late")));
        assert_eq!(s.state(), Success);
        assert!(s.reason().is_none());
        let mut a = RoomStatus::new(Transferring);
        assert!(a.abort(Reason::new(FailureCode::Aborted, "engine"), false));
        assert!(!a.advance(Success));
        assert!(!a.fail(Reason::new(FailureCode::PeerDead, "x")));
        assert!(a.advance(Aborted));
        assert!(a.entered(Aborting).is_some() && a.entered(Aborted).is_some());
        for from in RoomState::ALL.into_iter().filter(|s| s.is_final()) {
            for to in RoomState::ALL {
                assert!(!from.can_move_to(to), "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn only_a_transferring_room_goes_back_to_waiting() {
        use RoomState::*;
        let mut s = RoomStatus::new(Transferring);
        assert!(s.requeue());
        assert_eq!(s.state(), WaitingForInput);
        assert!(s.at("requeued").is_some());
        assert!(!s.requeue(), "waiting already");
        assert!(s.advance(Transferring) && s.advance(Success));
        assert!(!s.requeue(), "a final room stays final");
        assert!(!RoomStatus::new(Aborting).requeue());
    }

    #[tokio::test]
    async fn watchers_wake_on_change() {
        let mut s = RoomStatus::default();
        let mut rx = s.subscribe();
        s.advance(RoomState::WaitingForInput);
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow(), RoomState::WaitingForInput);
    }
}
