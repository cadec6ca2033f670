//! Connections that have not yet shown they come from a peer: accepted, but with no completed
//! handshake, no first message and no authorized request yet. Every port that accepts
//! connections keeps them apart from its peers' connections, so that a host that opens
//! connections and stays silent never takes a real peer's place:
//! - at most [`MAX_UNPROVEN`] per listening socket; one more drops the oldest of them;
//! - each for at most [`PROOF_DEADLINE`]; then it is dropped;
//! - once proven, a connection leaves this set, and only then counts against the port's
//!   per-address bound (the ZeroMQ sockets') or serves requests for as long as its peer keeps it.
//!
//! A real peer proves itself within a round trip of connecting (it connects to send), so
//! dropping the oldest unproven connection first reaches an attacker's connections long before
//! a peer's. [`Unproven`] is the bookkeeping, keyed by whatever names a connection on that port
//! (libzmq's descriptors, in the ZeroMQ sockets); [`Admission`] is that for ports whose
//! connections are tokio tasks ([`crate::http::serve`], the mapped-writes socket).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// Unproven connections one listening socket holds; more drop the oldest.
pub const MAX_UNPROVEN: usize = 128;

/// How long a connection may stay unproven: its handshake, then its first message (or first
/// authorized request) must come within this.
pub const PROOF_DEADLINE: Duration = Duration::from_secs(5);

/// Why an unproven connection was dropped (for the port's log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// [`MAX_UNPROVEN`] others came after it.
    Crowded,
    /// [`PROOF_DEADLINE`] passed.
    Late,
}

impl Dropped {
    /// The limit, in words, for logs and errors.
    pub fn limit(self) -> String {
        match self {
            Dropped::Crowded => format!(
                "the limit of {MAX_UNPROVEN} connections that have not yet sent a first message \
                 (oldest dropped first)"
            ),
            Dropped::Late => format!(
                "no handshake and first message within {} ms",
                PROOF_DEADLINE.as_millis()
            ),
        }
    }
}

/// The unproven connections of one listening socket, oldest first.
#[derive(Debug)]
pub struct Unproven<K> {
    order: VecDeque<(K, Instant)>,
    limit: usize,
    deadline: Duration,
}

impl<K: PartialEq + Copy> Default for Unproven<K> {
    fn default() -> Self {
        Self::new(MAX_UNPROVEN, PROOF_DEADLINE)
    }
}

impl<K: PartialEq + Copy> Unproven<K> {
    /// At most `limit` connections, each for at most `deadline`.
    pub fn new(limit: usize, deadline: Duration) -> Self {
        Unproven {
            order: VecDeque::new(),
            limit: limit.max(1),
            deadline,
        }
    }

    /// A connection was accepted at `now`: the one it pushes out (the oldest) when the set was
    /// full.
    pub fn admit(&mut self, key: K, now: Instant) -> Option<K> {
        self.forget(&key);
        self.order.push_back((key, now));
        if self.order.len() > self.limit {
            return self.order.pop_front().map(|(k, _)| k);
        }
        None
    }

    /// Whether the connection is still unproven.
    pub fn contains(&self, key: &K) -> bool {
        self.order.iter().any(|(k, _)| k == key)
    }

    /// The connection proved itself: whether it was unproven until now.
    pub fn prove(&mut self, key: &K) -> bool {
        self.take(key)
    }

    /// The connection closed.
    pub fn forget(&mut self, key: &K) {
        self.take(key);
    }

    fn take(&mut self, key: &K) -> bool {
        match self.order.iter().position(|(k, _)| k == key) {
            Some(i) => {
                self.order.remove(i);
                true
            }
            None => false,
        }
    }

    /// The connections whose deadline passed by `now` (they leave the set), and when the next
    /// one's passes.
    pub fn expire(&mut self, now: Instant) -> (Vec<K>, Option<Instant>) {
        let mut late = Vec::new();
        while let Some(&(key, since)) = self.order.front() {
            if since + self.deadline > now {
                return (late, Some(since + self.deadline));
            }
            late.push(key);
            self.order.pop_front();
        }
        (late, None)
    }

    /// Connections held unproven.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// The unproven connections of one listener whose connections are tasks: [`Admission::admit`]
/// each as it is accepted, and run the connection until [`Admitted::dropped`].
pub struct Admission {
    /// The port, for logs ("registry", "pool socket").
    port: &'static str,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    unproven: Unproven<u64>,
    drop: HashMap<u64, (CancellationToken, String)>,
    next_id: u64,
}

impl State {
    fn drop_connection(&mut self, id: u64, why: Dropped, port: &str) {
        if let Some((token, peer)) = self.drop.remove(&id) {
            tracing::warn!(port, %peer, limit = %why.limit(), "connection dropped");
            token.cancel();
        }
    }
}

impl Admission {
    /// The admission of the port named `port` in logs.
    pub fn new(port: &'static str) -> Arc<Admission> {
        Arc::new(Admission {
            port,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection from `peer` was accepted: unproven; the oldest unproven one is dropped
    /// when there are too many.
    pub fn admit(self: &Arc<Self>, peer: String) -> Admitted {
        let mut state = self.state();
        state.next_id += 1;
        let id = state.next_id;
        let dropped = CancellationToken::new();
        let pushed_out = state.unproven.admit(id, Instant::now());
        state.drop.insert(id, (dropped.clone(), peer));
        if let Some(old) = pushed_out {
            state.drop_connection(old, Dropped::Crowded, self.port);
        }
        Admitted {
            id,
            dropped,
            proven: AtomicBool::new(false),
            admission: self.clone(),
        }
    }

    /// Drops the connections unproven past their deadline; when the next one's passes (the
    /// listener calls this again then, or sooner).
    pub fn expire(&self) -> Instant {
        let now = Instant::now();
        let mut state = self.state();
        let (late, next) = state.unproven.expire(now);
        for id in late {
            state.drop_connection(id, Dropped::Late, self.port);
        }
        next.unwrap_or(now + PROOF_DEADLINE)
    }
}

/// One accepted connection's place; dropping it says the connection closed.
pub struct Admitted {
    id: u64,
    dropped: CancellationToken,
    /// Set by the first [`Admitted::prove`]: later ones cost nothing.
    proven: AtomicBool,
    admission: Arc<Admission>,
}

impl Admitted {
    /// The connection proved itself: from now on nothing here drops it.
    pub fn prove(&self) {
        if self.proven.swap(true, Ordering::Relaxed) {
            return;
        }
        let mut state = self.admission.state();
        state.unproven.prove(&self.id);
        state.drop.remove(&self.id);
    }

    /// Resolves when the connection is to be dropped (while unproven: crowded out, or late).
    pub async fn dropped(&self) {
        self.dropped.cancelled().await
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut state = self.admission.state();
        state.unproven.forget(&self.id);
        state.drop.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_unproven_connection_goes_first() {
        let t = Instant::now();
        let mut set = Unproven::new(3, Duration::from_secs(5));
        assert_eq!(set.admit(1, t), None);
        assert_eq!(set.admit(2, t), None);
        assert_eq!(set.admit(3, t), None);
        assert!(set.prove(&1), "1 was unproven");
        assert!(!set.prove(&1), "and is proven once");
        assert_eq!(set.admit(4, t), None, "room again after a proof");
        assert_eq!(set.admit(5, t), Some(2), "the oldest unproven one goes");
        set.forget(&3);
        assert_eq!(set.len(), 2);
        assert_eq!(set.admit(6, t), None);
        assert_eq!(set.admit(7, t), Some(4));
    }

    #[test]
    fn unproven_connections_expire_at_their_deadline() {
        let t = Instant::now();
        let second = Duration::from_secs(1);
        let mut set = Unproven::new(10, 5 * second);
        set.admit(1, t);
        set.admit(2, t + second);
        set.admit(3, t + 2 * second);
        set.prove(&2);
        assert_eq!(set.expire(t + 4 * second), (vec![], Some(t + 5 * second)));
        assert_eq!(set.expire(t + 5 * second), (vec![1], Some(t + 7 * second)));
        assert_eq!(set.expire(t + 60 * second), (vec![3], None));
        assert!(set.is_empty());
    }

    #[tokio::test]
    async fn an_admission_drops_the_oldest_unproven_task_and_keeps_proven_ones() {
        let admission = Admission::new("test");
        let proven = admission.admit("a".into());
        proven.prove();
        let mut silent: Vec<Admitted> = (0..MAX_UNPROVEN)
            .map(|i| admission.admit(format!("s{i}")))
            .collect();
        let newest = admission.admit("late".into());
        // The oldest silent one is told to go; the proven one and the newest are not.
        tokio::time::timeout(Duration::from_secs(5), silent[0].dropped())
            .await
            .expect("the oldest is dropped");
        assert!(!silent[1].dropped.is_cancelled());
        assert!(!proven.dropped.is_cancelled());
        assert!(!newest.dropped.is_cancelled());
        // Closed connections leave the set.
        silent.clear();
        drop(newest);
        assert!(admission.state().unproven.is_empty());
        assert!(admission.state().drop.is_empty());
    }
}
