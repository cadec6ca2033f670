//! The decode's housekeeping: rooms past their timeouts fail (`timeout_bootstrap`,
//! `timeout_ready`, `timeout_stall`), prefills that stopped writing into the pool are stopped,
//! and rooms stuck for long are warned about, on a rate limit.

use crate::agent::decode::{Decode, Peer, Writes};
use crate::agent::room::RoomState;
use crate::agent::room_table::TableRoom as _;
use crate::reason::{FailureCode, Reason};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) async fn expire_rooms(inner: Arc<Decode>) {
    let mut tick = tokio::time::interval(Duration::from_millis(200).min(inner.timeouts().room_ttl));
    loop {
        tokio::select! {
            () = inner.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let ttl = inner.timeouts().room_ttl;
        inner.fail_stuck_rooms().await;
        let mut rooms = inner.rooms();
        for room in rooms.values_mut() {
            let mut ended = false;
            for s in room.sources.iter_mut() {
                if matches!(s.writes, Writes::Until(_)) && !s.writes.possible() {
                    s.writes = Writes::Closed;
                    ended = true;
                }
            }
            if ended {
                room.touch_if_safe();
            }
        }
        drop(rooms);
        inner.return_aborted_pages();
        let mut rooms = inner.rooms();
        let before = rooms.len();
        rooms.retain(|id, room| {
            let keep = !(room.safe_to_reuse() && room.final_at.is_some_and(|t| t.elapsed() >= ttl));
            if !keep {
                tracing::info!(
                    room = id,
                    state = room.status.state().name(),
                    "room expired untaken"
                );
            }
            keep
        });
        let expired = (before - rooms.len()) as u64;
        inner.metrics.expired.inc_by(expired);
    }
}

impl Decode {
    /// Fails rooms whose transfer shows no sign of life: waiting for the prefill engine longer
    /// than the ready timeout, or transferring without progress longer than the stall timeout.
    /// Their prefills are told to stop.
    pub(super) async fn fail_stuck_rooms(&self) {
        let t = self.timeouts();
        self.warn_stuck();
        let stuck: Vec<(u64, Reason, Vec<Arc<Peer>>)> = {
            let mut rooms = self.rooms();
            let mut out = Vec::new();
            for (id, room) in rooms.iter_mut() {
                let idle = room.progress_at.elapsed();
                let reason = match room.status.state() {
                    RoomState::WaitingForInput if idle >= t.ready => Reason::new(
                        FailureCode::TimeoutReady,
                        format!(
                            "no data from the prefill {} ms after the request",
                            idle.as_millis()
                        ),
                    ),
                    RoomState::Transferring if idle >= t.stall => Reason::new(
                        FailureCode::TimeoutStall,
                        format!(
                            "no progress for {} ms ({} of {} bytes landed)",
                            idle.as_millis(),
                            room.landed,
                            room.expected
                        ),
                    ),
                    _ => continue,
                };
                if room.status.fail(reason.clone()) {
                    self.finished(room);
                    room.stop_told = true;
                    out.push((
                        *id,
                        reason,
                        room.sources.iter().map(|s| s.peer.clone()).collect(),
                    ));
                }
            }
            out
        };
        for (room, reason, peers) in stuck {
            tracing::warn!(room, %reason, "room failed");
            for peer in peers {
                let _ = self.tell_abort(&peer, room, &reason).await;
            }
        }
        self.stop_open_writers().await;
    }

    /// Tells the sources that may still write into a failed room's pages to stop; their
    /// answer (AbortAck) closes them. Rooms fail in many places; this sweep covers them all.
    pub(super) async fn stop_open_writers(&self) {
        let told: Vec<(u64, Reason, Vec<Arc<Peer>>)> = self
            .rooms()
            .iter_mut()
            .filter(|(_, r)| r.status.state().is_final() && !r.stop_told)
            .filter_map(|(id, r)| {
                r.stop_told = true;
                let peers = r.open_writers();
                let reason = r.status.reason().cloned().unwrap_or_else(|| {
                    Reason::new(FailureCode::Aborted, "the room ended on the decode")
                });
                (!peers.is_empty()).then_some((*id, reason, peers))
            })
            .collect();
        for (room, reason, peers) in told {
            for peer in peers {
                if let Err(e) = self.tell_abort(&peer, room, &reason).await {
                    tracing::warn!(room, reason = %e, "could not tell a writer to stop");
                }
            }
        }
    }

    /// Warns (at most every 10 s) about rooms in flight for more than 10 s.
    pub(super) fn warn_stuck(&self) {
        const EVERY: Duration = Duration::from_secs(10);
        let mut last = self.stuck_warned.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < EVERY) {
            return;
        }
        let now = crate::agent::room::now_ms();
        let rooms = self.rooms();
        let stuck: Vec<(u64, &'static str)> = rooms
            .iter()
            .filter(|(_, r)| !r.status.state().is_final())
            .filter(|(_, r)| {
                r.status
                    .at("created")
                    .is_some_and(|t| now - t > EVERY.as_secs_f64() * 1e3)
            })
            .map(|(id, r)| (*id, r.status.state().name()))
            .take(8)
            .collect();
        if !stuck.is_empty() {
            tracing::warn!(rooms = ?stuck, "rooms in flight for more than 10 s");
            *last = Some(Instant::now());
        }
    }
}
