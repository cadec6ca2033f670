//! The decode's drain for shutdown (SIGTERM): the registry is told that the rank drains, new
//! rooms are refused (503), rooms in flight finish for up to `--drain-timeout-ms`, the rest are
//! aborted. Then rooms that landed but were not taken yet stay takeable until the engine takes
//! them or `--drain-untaken-ms` has passed since the last of them landed (counted from SIGTERM
//! at the earliest), so a shutdown does not discard KV the engine is about to take. New rooms
//! are refused (503) all along.

use std::time::{Duration, Instant};

use super::{Decode, DecodeAgent};
use crate::agent::room::RoomState;

impl DecodeAgent {
    /// Stops accepting rooms (503), lets in-flight rooms finish for up to the drain timeout,
    /// then aborts the rest. Landed rooms stay takeable until taken or `drain_untaken` passed
    /// since the last one landed (`drain.rs`).
    pub async fn drain(&self) {
        let inner = &self.inner;
        inner.draining.say().await;
        inner.table.drain();
        let draining_since = Instant::now();
        let deadline = draining_since + inner.timeouts().drain;
        let in_flight = || {
            inner
                .rooms()
                .values()
                .filter(|r| !r.status.state().is_final())
                .count()
        };
        crate::agent::wait_until(deadline, || in_flight() == 0).await;
        let aborted = inner
            .table
            .abort_unfinished("decode", |room, reason| inner.abort_room(room, reason))
            .await;
        // Let the aborts be acknowledged (a dead prefill counts after `dead_after`) and the
        // engine see the final states before the API goes away.
        let settle = Instant::now() + inner.timeouts().dead_after;
        crate::agent::wait_until(settle, || in_flight() == 0).await;
        if aborted > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        inner.keep_untaken(draining_since).await;
    }
}

/// How often the untaken rooms are counted.
const POLL: Duration = Duration::from_millis(20);

impl Decode {
    /// Waits until no landed (`success`) room is left untaken, or the window has passed since
    /// the last one landed (or since `draining_since`, whichever is later), or shutdown.
    pub(super) async fn keep_untaken(&self, draining_since: Instant) {
        let window = self.timeouts().drain_untaken;
        let mut told = false;
        loop {
            let (untaken, last_landed) = {
                let rooms = self.rooms();
                let landed = rooms
                    .values()
                    .filter(|r| r.status.state() == RoomState::Success);
                landed.fold((0usize, draining_since), |(n, last), r| {
                    (n + 1, r.final_at.map_or(last, |t| t.max(last)))
                })
            };
            if untaken == 0 {
                if told {
                    tracing::info!("every landed room was taken");
                }
                return;
            }
            let since = last_landed.elapsed();
            if since >= window {
                tracing::warn!(
                    untaken,
                    window_ms = window.as_millis() as u64,
                    "landed rooms not taken within --drain-untaken-ms; discarding them"
                );
                return;
            }
            if !told {
                told = true;
                tracing::info!(
                    untaken,
                    window_ms = window.as_millis() as u64,
                    "keeping landed rooms takeable until taken or --drain-untaken-ms passes"
                );
            }
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = tokio::time::sleep(POLL.min(window - since)) => {}
            }
        }
    }
}
