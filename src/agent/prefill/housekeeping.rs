//! The prefill's housekeeping, once a heartbeat: heartbeats to every decode peer (naming the
//! rooms held for it), peers silent for `--peer-dead-ms` found dead, ready rooms no decode asked
//! for within `--room-ttl-ms` expired (and remembered, so that a late request is refused at
//! once), final rooms forgotten `--room-ttl-ms` later (reads at once), rooms whose decode died
//! before they were delivered and that no other decode asked for within `--requeue-ms` failed
//! with `peer_dead`, and requests whose room the engine never announced failed with
//! `timeout_ready`.

use super::{Peer, Prefill};
use crate::agent::room::RoomState;
use crate::protocol::{self, Message};
use crate::reason::{FailureCode, Reason};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Heartbeats to every peer, dead-peer detection and room expiry, on one timer.
pub(super) async fn housekeeping(inner: Arc<Prefill>) {
    let mut tick =
        tokio::time::interval(inner.timeouts().heartbeat.min(Duration::from_millis(200)));
    let mut last_beat = Instant::now();
    let mut seq = 0u64;
    loop {
        tokio::select! {
            () = inner.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let t = inner.timeouts();
        let peers: Vec<Arc<Peer>> = inner.peers().values().cloned().collect();
        for peer in &peers {
            let silent = peer.silent_for();
            if silent >= 2 * t.heartbeat {
                inner.metrics.heartbeat_misses.inc();
            }
            if silent >= t.dead_after {
                inner.peer_dead(peer, &format!("silent for {} ms", silent.as_millis()));
            }
        }
        if last_beat.elapsed() >= t.heartbeat {
            last_beat = Instant::now();
            seq += 1;
            let mut held = inner.held_by_peer();
            let peers: Vec<Arc<Peer>> = inner.peers().values().cloned().collect();
            for peer in peers {
                let beat = Message::Heartbeat(protocol::Heartbeat {
                    instance: inner.instance,
                    seq,
                    rooms: held.remove(&peer.instance).unwrap_or_default(),
                });
                inner.reply(&peer.identity, beat);
            }
        }
        inner.fail_unready().await;
        inner.fail_unclaimed(t);
        let ttl = t.room_ttl;
        // A read's room is of no use once final: no engine takes it, and its decode never
        // asks for it again (every read is a room of its own).
        let final_ttl = if inner.cfg.serve_reads {
            Duration::ZERO
        } else {
            ttl
        };
        let mut orphans = Vec::new();
        inner.rooms().retain(|id, room| {
            let old = room.final_at.is_some_and(|t| t.elapsed() >= final_ttl);
            // Ready pages no decode asked for are released a TTL after they were announced or
            // last held by a decode for a queued request, and at most `room_max` after.
            let age = crate::agent::room::now_ms() - room.status.at("created").unwrap_or(0.0);
            let idle = room
                .renewed
                .map_or(age, |(r, _)| r.elapsed().as_secs_f64() * 1e3);
            // A room requeued for a lost decode fails instead (`fail_unclaimed`).
            let orphan = room.requeued.is_none()
                && !room.asked()
                && (idle >= ttl.as_secs_f64() * 1e3 || age >= t.room_max.as_secs_f64() * 1e3);
            let keep = !(old || orphan) || room.running();
            if !keep && orphan {
                orphans.push((*id, room.renewed.is_some()));
            }
            keep
        });
        if !orphans.is_empty() {
            tracing::warn!(rooms = ?orphans, ttl_ms = ttl.as_millis() as u64, "ready rooms no decode asked for expired (true: held for a queued decode until --room-max-ms)");
            inner.metrics.expired.inc_by(orphans.len() as u64);
        }
        inner.expired().note(orphans, ttl);
    }
}

/// Rooms that expired unasked, remembered for [`Expired::REMEMBERED`] TTLs (at most
/// [`Expired::MAX`] of them, the oldest forgotten first).
#[derive(Default)]
pub(super) struct Expired {
    /// Oldest first.
    pub(super) order: std::collections::VecDeque<u64>,
    /// When each expired, and whether a decode held it for a queued request until then.
    pub(super) rooms: HashMap<u64, (Instant, bool)>,
}

impl Expired {
    const REMEMBERED: u32 = 10;
    const MAX: usize = 1 << 16;

    /// Adds the rooms that expired now (each with whether it was held) and forgets those
    /// remembered long enough.
    pub(super) fn note(&mut self, rooms: Vec<(u64, bool)>, ttl: Duration) {
        let now = Instant::now();
        for (room, held) in rooms {
            if let std::collections::hash_map::Entry::Vacant(e) = self.rooms.entry(room) {
                e.insert((now, held));
                self.order.push_back(room);
            }
        }
        let long = ttl * Self::REMEMBERED;
        while let Some(&room) = self.order.front() {
            let at = self.rooms.get(&room).map_or(now, |(at, _)| *at);
            if self.order.len() <= Self::MAX && now.duration_since(at) < long {
                break;
            }
            self.order.pop_front();
            self.rooms.remove(&room);
        }
    }

    /// How long ago `room` expired, and whether it was held, if it is remembered.
    pub(super) fn ago(&self, room: u64) -> Option<(Duration, bool)> {
        self.rooms
            .get(&room)
            .map(|(at, held)| (at.elapsed(), *held))
    }
}

impl Prefill {
    /// The held rooms each decode asked for, to name in its heartbeat (holds `room_max` old
    /// are dropped): its ready timeout waits for them as the engine's queue does.
    pub(super) fn held_by_peer(&self) -> HashMap<Uuid, Vec<u64>> {
        let held = self.holds.live(self.timeouts().room_max);
        let rooms = self.rooms();
        let mut out: HashMap<Uuid, Vec<u64>> = HashMap::new();
        for (id, ()) in held {
            for decode in rooms
                .get(&id)
                .map(|r| r.transfers.keys())
                .into_iter()
                .flatten()
            {
                out.entry(*decode).or_default().push(id);
            }
        }
        out
    }

    /// Fails the rooms whose decode died before they were delivered, or let them go without
    /// asking, and that no other decode
    /// asked for within `--requeue-ms` of that (or of a later heartbeat of a decode that holds
    /// the room for a queued request), nor within `--room-max-ms` of their creation.
    pub(super) fn fail_unclaimed(&self, t: crate::agent::Timeouts) {
        let mut failed = Vec::new();
        let mut rooms = self.rooms();
        for (id, room) in rooms.iter_mut() {
            let Some((at, reason)) = room.requeued.as_ref().or(room.let_go.as_ref()) else {
                continue;
            };
            if room.asked() || room.status.state().is_final() {
                continue;
            }
            let since = room.renewed.map_or(*at, |(r, _)| r.max(*at));
            let age = crate::agent::room::now_ms() - room.status.at("created").unwrap_or(0.0);
            if since.elapsed() < t.requeue && age < t.room_max.as_secs_f64() * 1e3 {
                continue;
            }
            let reason = Reason::new(
                reason.code,
                format!(
                    "{}; no other decode asked for the room within {} ms (--requeue-ms)",
                    reason.message,
                    t.requeue.as_millis()
                ),
            );
            room.status.fail(reason);
            self.settle(room);
            failed.push(*id);
        }
        if !failed.is_empty() {
            tracing::warn!(rooms = ?failed, requeue_ms = t.requeue.as_millis() as u64, "rooms whose decode died or let them go failed: no other decode asked for them");
        }
    }

    /// Fails transfers requested long ago whose room the engine never announced (unless the
    /// engine holds the room's request in its queue).
    pub(super) async fn fail_unready(&self) {
        let ready = self.timeouts().ready;
        let held: std::collections::HashSet<u64> = self
            .holds
            .live(self.timeouts().room_max)
            .into_iter()
            .map(|(room, ())| room)
            .collect();
        let late: Vec<(u64, Arc<Peer>, Reason)> = {
            let mut rooms = self.rooms();
            let mut out = Vec::new();
            for (id, room) in rooms.iter_mut().filter(|(id, _)| !held.contains(id)) {
                let mut changed = false;
                for t in room.transfers.values_mut() {
                    if t.req.is_some()
                        && !t.started
                        && !t.state.is_final()
                        && t.requested_at.elapsed() >= ready
                    {
                        let reason = Reason::new(
                            FailureCode::TimeoutReady,
                            format!(
                                "the prefill engine announced nothing within {} ms of the request",
                                ready.as_millis()
                            ),
                        );
                        t.end(RoomState::Failed, Some(reason.clone()));
                        out.push((*id, t.peer.clone(), reason));
                        changed = true;
                    }
                }
                if changed {
                    self.settle(room);
                }
            }
            out
        };
        for (room, peer, reason) in late {
            self.refuse(&peer.identity, Some(room), reason.code, reason.message);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn expired_rooms_are_remembered_for_ten_ttls_and_at_most_max_of_them() {
        let mut expired = Expired::default();
        let hour = Duration::from_secs(3600);
        expired.note(vec![(1, false), (2, true)], hour);
        expired.note(vec![(2, false), (3, false)], hour);
        assert!(
            expired
                .ago(1)
                .is_some_and(|(ago, held)| ago < hour && !held)
        );
        assert!(
            expired.ago(2).is_some_and(|(_, held)| held),
            "the first note stands"
        );
        assert!(expired.ago(3).is_some());
        assert_eq!(expired.ago(4), None);
        assert_eq!(
            expired.order.len(),
            3,
            "a room noted twice is remembered once"
        );
        // Past the memory (a zero TTL: at once), every room is forgotten.
        expired.note(vec![], Duration::ZERO);
        assert_eq!((expired.ago(1), expired.order.len()), (None, 0));
        // Beyond the bound, the oldest go first.
        let many: Vec<(u64, bool)> = (0..Expired::MAX as u64 + 2).map(|r| (r, false)).collect();
        expired.note(many, hour);
        assert_eq!(expired.order.len(), Expired::MAX);
        assert_eq!(expired.rooms.len(), Expired::MAX);
        assert_eq!((expired.ago(0), expired.ago(1)), (None, None));
        assert!(expired.ago(Expired::MAX as u64 + 1).is_some());
    }
}
