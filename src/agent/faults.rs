//! Fault injection for tests, and the timeouts an agent runs with.
//!
//! A prefill corrupts one chunk: chunks are numbered from 1 as they are gathered, and the one
//! numbered `--fault-corrupt-chunk` (from the start), or armed while the agent runs, has its
//! bytes inverted (a direct chunk: its checksum) after checksumming.
//!
//! An agent's timeouts are its configuration's ([`Timeouts`]) until a test changes them while it
//! runs: engine servers shared by many tests need no restart for one that wants a room to outlive
//! a short timeout. Every wait reads them when it starts (a heartbeat loop at each beat).
//!
//! A prefill holds its chunks: the N-th chunk to go from now on, and every later one, waits
//! before it is sent until the hold is released (or its transfer ends): a room held
//! mid-transfer for as long as a test needs, without a window of time.
//!
//! All are armed through the engine API's `POST /v1/faults`, served only with
//! `--fault-injection`: `{"corrupt_chunk": N}` (prefill) corrupts the N-th chunk sent from now;
//! `{"hold_chunks": N}` (prefill) holds the N-th chunk to go from now and those after it,
//! `{"hold_chunks": 0}` releases them; every answer names the decodes whose chunks are held now
//! (`held_for`: their agents' instances), so that a test knows a decode's room is mid-transfer;
//! `{"timeouts": {"room_ttl_ms": 1000, ...}}` (either role) sets the timeouts named, by their
//! flags' names, checked together as at start. The answer says what is armed and the timeouts
//! before and after, so that a test can set them back.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Timeouts;
use super::engine_api::EngineApi;

/// The chunks gathered so far, the one to corrupt (0: none), the chunks that went past the
/// hold and the first one it holds (0: none), and the timeouts in force.
pub(crate) struct Faults {
    sent: AtomicU64,
    corrupt: AtomicU64,
    passed: AtomicU64,
    hold_from: AtomicU64,
    released: tokio::sync::Notify,
    /// The chunks held now, by the decode they go to.
    held: Mutex<BTreeMap<uuid::Uuid, usize>>,
    timeouts: RwLock<Timeouts>,
}

/// `POST /v1/faults`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Arm {
    /// Corrupt the `corrupt_chunk`-th chunk sent from now (1: the next).
    pub corrupt_chunk: Option<u64>,
    /// Hold the `hold_chunks`-th chunk to go from now (1: the next) and every later one until
    /// released; 0 releases them.
    pub hold_chunks: Option<u64>,
    /// Timeouts to set, in ms.
    pub timeouts: Option<TimeoutsMs>,
}

/// Timeouts in ms by their flags' names (`--room-ttl-ms`: `room_ttl_ms`); in a request, those
/// to change.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TimeoutsMs {
    pub timeout_bootstrap_ms: Option<u64>,
    pub timeout_connect_ms: Option<u64>,
    pub room_ttl_ms: Option<u64>,
    pub room_max_ms: Option<u64>,
    pub timeout_send_ms: Option<u64>,
    pub timeout_ready_ms: Option<u64>,
    pub timeout_stall_ms: Option<u64>,
    pub drain_timeout_ms: Option<u64>,
    pub drain_untaken_ms: Option<u64>,
    pub heartbeat_ms: Option<u64>,
    pub peer_dead_ms: Option<u64>,
    pub requeue_ms: Option<u64>,
}

/// The answer: the number the armed chunk will have and the chunks sent so far (when a chunk
/// was armed), and the timeouts before and after the request.
#[derive(Debug, Serialize)]
pub(crate) struct Armed {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub corrupt_chunk: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunks_sent: Option<u64>,
    /// The number the first held chunk will have (0: released), and the chunks gone so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_chunks: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunks_passed: Option<u64>,
    /// The decode agents (instances) whose chunks are held now.
    pub held_for: Vec<uuid::Uuid>,
    pub timeouts_were: TimeoutsMs,
    pub timeouts: TimeoutsMs,
}

/// Each field of [`Timeouts`] with its flag's name.
macro_rules! each_timeout {
    ($m:ident) => {
        $m!(
            bootstrap timeout_bootstrap_ms,
            connect timeout_connect_ms,
            room_ttl room_ttl_ms,
            room_max room_max_ms,
            send timeout_send_ms,
            ready timeout_ready_ms,
            stall timeout_stall_ms,
            drain drain_timeout_ms,
            drain_untaken drain_untaken_ms,
            heartbeat heartbeat_ms,
            dead_after peer_dead_ms,
            requeue requeue_ms
        )
    };
}

impl TimeoutsMs {
    fn of(t: &Timeouts) -> Self {
        macro_rules! all {
            ($($field:ident $name:ident),*) => {
                TimeoutsMs { $($name: Some(t.$field.as_millis() as u64)),* }
            };
        }
        each_timeout!(all)
    }

    /// `t` with the timeouts this names changed.
    fn applied_to(&self, mut t: Timeouts) -> Timeouts {
        macro_rules! apply {
            ($($field:ident $name:ident),*) => {
                $(if let Some(ms) = self.$name { t.$field = Duration::from_millis(ms); })*
            };
        }
        each_timeout!(apply);
        t
    }
}

impl Faults {
    pub(crate) fn new(corrupt: Option<u64>, timeouts: Timeouts) -> Self {
        Faults {
            sent: AtomicU64::new(0),
            corrupt: AtomicU64::new(corrupt.unwrap_or(0)),
            passed: AtomicU64::new(0),
            hold_from: AtomicU64::new(0),
            released: tokio::sync::Notify::new(),
            held: Mutex::new(BTreeMap::new()),
            timeouts: RwLock::new(timeouts),
        }
    }

    /// The timeouts in force.
    pub(crate) fn timeouts(&self) -> Timeouts {
        *self.timeouts.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Numbers the next chunk; whether it is the one to corrupt.
    pub(crate) fn next_chunk(&self) -> (u64, bool) {
        let nth = self.sent.fetch_add(1, Ordering::Relaxed) + 1;
        (nth, self.corrupt.load(Ordering::Relaxed) == nth)
    }

    /// A chunk about to go to `decode`: it waits while the hold holds it, until the hold is
    /// released or `cancel` (its transfer ended), and goes on at once without a hold.
    pub(crate) async fn pass(
        &self,
        cancel: &tokio_util::sync::CancellationToken,
        decode: uuid::Uuid,
    ) {
        let nth = self.passed.fetch_add(1, Ordering::Relaxed) + 1;
        let mut held = None;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let from = self.hold_from.load(Ordering::Relaxed);
            if from == 0 || nth < from {
                return;
            }
            if held.is_none() {
                tracing::warn!(chunk = nth, %decode, "fault injection: a chunk held");
                held = Some(Held::new(&self.held, decode));
            }
            tokio::select! {
                () = released => {}
                () = cancel.cancelled() => return,
            }
        }
    }

    /// Arms what `arm` asks for (nothing of it when any part is refused). `sends_chunks`: the
    /// role has chunks to corrupt.
    pub(crate) fn arm(&self, arm: Arm, sends_chunks: bool) -> Result<Armed, String> {
        if arm.corrupt_chunk.is_some() && !sends_chunks {
            return Err("corrupt_chunk: this agent sends no chunks (a prefill's switch)".into());
        }
        if arm.hold_chunks.is_some() && !sends_chunks {
            return Err("hold_chunks: this agent sends no chunks (a prefill's switch)".into());
        }
        if arm.corrupt_chunk == Some(0) {
            return Err("corrupt_chunk counts chunks from the next one, which is 1".into());
        }
        let mut timeouts = self.timeouts.write().unwrap_or_else(|e| e.into_inner());
        let were = *timeouts;
        let now = match &arm.timeouts {
            Some(change) => change.applied_to(were),
            None => were,
        };
        if arm.timeouts.is_some() {
            now.check()?;
        }
        *timeouts = now;
        let (mut corrupt_chunk, mut chunks_sent) = (None, None);
        if let Some(n) = arm.corrupt_chunk {
            let sent = self.sent.load(Ordering::Relaxed);
            self.corrupt.store(sent + n, Ordering::Relaxed);
            (corrupt_chunk, chunks_sent) = (Some(sent + n), Some(sent));
        }
        let (mut hold_chunks, mut chunks_passed) = (None, None);
        if let Some(n) = arm.hold_chunks {
            let passed = self.passed.load(Ordering::Relaxed);
            let from = if n == 0 { 0 } else { passed + n };
            self.hold_from.store(from, Ordering::Relaxed);
            if from == 0 {
                self.released.notify_waiters();
            }
            (hold_chunks, chunks_passed) = (Some(from), Some(passed));
        }
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        Ok(Armed {
            corrupt_chunk,
            chunks_sent,
            hold_chunks,
            chunks_passed,
            held_for: held.keys().copied().collect(),
            timeouts_were: TimeoutsMs::of(&were),
            timeouts: TimeoutsMs::of(&now),
        })
    }
}

/// A chunk counted held for its decode while it lives.
struct Held<'a>(&'a Mutex<BTreeMap<uuid::Uuid, usize>>, uuid::Uuid);

impl<'a> Held<'a> {
    fn new(held: &'a Mutex<BTreeMap<uuid::Uuid, usize>>, decode: uuid::Uuid) -> Self {
        *held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(decode)
            .or_default() += 1;
        Held(held, decode)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.1);
            }
        }
    }
}

/// An agent with test switches: the engine API's `POST /v1/faults` arms them (`api.rs`).
pub(crate) trait Tested: EngineApi {
    /// The switches and the timeouts in force.
    fn faults(&self) -> &Faults;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corrupt(n: u64) -> Arm {
        Arm {
            corrupt_chunk: Some(n),
            ..Arm::default()
        }
    }

    #[test]
    fn the_armed_chunk_counts_from_the_chunks_already_sent() {
        let f = Faults::new(Some(2), Timeouts::default());
        assert_eq!(f.next_chunk(), (1, false));
        assert_eq!(f.next_chunk(), (2, true));
        let armed = f.arm(corrupt(2), true).unwrap();
        assert_eq!((armed.corrupt_chunk, armed.chunks_sent), (Some(4), Some(2)));
        assert_eq!(f.next_chunk(), (3, false));
        assert_eq!(f.next_chunk(), (4, true));
        assert_eq!(f.next_chunk(), (5, false));
        assert!(f.arm(corrupt(0), true).is_err());
        let refused = f.arm(corrupt(1), false).unwrap_err();
        assert!(refused.contains("sends no chunks"), "{refused}");
    }

    #[tokio::test]
    async fn held_chunks_wait_until_released_or_their_transfer_ends() {
        let f = std::sync::Arc::new(Faults::new(None, Timeouts::default()));
        let never = tokio_util::sync::CancellationToken::new();
        let hold = |n| Arm {
            hold_chunks: Some(n),
            ..Arm::default()
        };
        let (a, b) = (uuid::Uuid::from_u128(1), uuid::Uuid::from_u128(2));
        f.pass(&never, a).await;
        let armed = f.arm(hold(2), true).unwrap();
        assert_eq!((armed.hold_chunks, armed.chunks_passed), (Some(3), Some(1)));
        assert!(armed.held_for.is_empty());
        f.pass(&never, a).await; // the 2nd goes: the hold starts at the 3rd
        let held = tokio::spawn({
            let f = f.clone();
            async move { f.pass(&tokio_util::sync::CancellationToken::new(), a).await }
        });
        let cancel = tokio_util::sync::CancellationToken::new();
        let ended = tokio::spawn({
            let (f, cancel) = (f.clone(), cancel.clone());
            async move { f.pass(&cancel, b).await }
        });
        let look = || f.arm(Arm::default(), true).unwrap().held_for;
        while look() != [a, b] {
            tokio::task::yield_now().await;
        }
        assert!(!held.is_finished() && !ended.is_finished());
        cancel.cancel();
        ended.await.unwrap();
        assert!(!held.is_finished(), "only the ended transfer's chunk went");
        assert_eq!(look(), [a], "the ended transfer's chunk is held no more");
        assert_eq!(f.arm(hold(0), true).unwrap().hold_chunks, Some(0));
        held.await.unwrap();
        assert!(look().is_empty());
        f.pass(&never, a).await;
        assert!(
            f.arm(hold(1), false)
                .unwrap_err()
                .contains("sends no chunks")
        );
    }

    #[test]
    fn timeouts_change_as_named_and_are_checked_together() {
        let f = Faults::new(None, Timeouts::default());
        let change = TimeoutsMs {
            room_ttl_ms: Some(1000),
            timeout_ready_ms: Some(1000),
            heartbeat_ms: Some(100),
            ..TimeoutsMs::default()
        };
        let armed = f
            .arm(
                Arm {
                    timeouts: Some(change),
                    ..Arm::default()
                },
                false,
            )
            .unwrap();
        assert_eq!(armed.timeouts_were, TimeoutsMs::of(&Timeouts::default()));
        let t = f.timeouts();
        assert_eq!(t.room_ttl, Duration::from_secs(1));
        assert_eq!(t.ready, Duration::from_secs(1));
        assert_eq!(t.heartbeat, Duration::from_millis(100));
        assert_eq!(
            t.stall,
            Timeouts::default().stall,
            "a timeout not named keeps its value"
        );
        assert_eq!(armed.timeouts, TimeoutsMs::of(&t));
        assert_eq!(armed.corrupt_chunk, None);
        // Set back from the answer's `timeouts_were`.
        f.arm(
            Arm {
                timeouts: Some(armed.timeouts_were),
                ..Arm::default()
            },
            false,
        )
        .unwrap();
        assert_eq!(
            TimeoutsMs::of(&f.timeouts()),
            TimeoutsMs::of(&Timeouts::default())
        );
        // A heartbeat no shorter than the dead-peer bound is refused, and nothing changes.
        let bad = Arm {
            timeouts: Some(TimeoutsMs {
                heartbeat_ms: Some(10_000),
                room_ttl_ms: Some(5),
                ..TimeoutsMs::default()
            }),
            ..Arm::default()
        };
        let refused = f.arm(bad, false).unwrap_err();
        assert!(refused.contains("--peer-dead-ms"), "{refused}");
        assert_eq!(
            TimeoutsMs::of(&f.timeouts()),
            TimeoutsMs::of(&Timeouts::default())
        );
    }
}
