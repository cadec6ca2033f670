//! The prefill's drain for shutdown: the registry is told that the rank drains, new rooms are
//! refused (503), rooms in flight finish for up to `--drain-timeout-ms`, and the rest are
//! aborted (their decodes are told).

use super::PrefillAgent;
use std::time::Instant;

impl PrefillAgent {
    /// Stops accepting new rooms (503), lets rooms in flight finish for up to the drain
    /// timeout, then aborts the rest (their decodes are told).
    pub async fn drain(&self) {
        let inner = &self.inner;
        inner.draining.say().await;
        inner.table.drain();
        let deadline = Instant::now() + inner.timeouts().drain;
        let busy = || {
            inner
                .rooms()
                .values()
                .filter(|r| {
                    r.transfers
                        .values()
                        .any(|t| t.req.is_some() && !t.state.is_final())
                })
                .count()
        };
        crate::agent::wait_until(deadline, || busy() == 0).await;
        inner
            .table
            .abort_unfinished("prefill", |room, reason| {
                inner.clone().abort_room(room, reason)
            })
            .await;
    }
}
