//! One pass over a room's pages for several decode ranks: with heterogeneous TP one prefill
//! rank sends each decode rank its share of the heads of every token (TP1 -> TP2: the first and
//! the second half of each token's row). Each decode rank's transfer is a task of its own, and
//! written alone each reads every other slice of the source, in strides, which is slower
//! than one contiguous read (scripts/probes/strided-source.c; docs/benchmarks.md, "Figures
//! behind design choices"). When two transfers of one room write the same chunk (tokens and
//! layers) into mapped pools at about the same time, the first to come waits a little for the
//! other, and the second writes both chunks in one pass over the source, in its order
//! ([`mapped::write_together`]).
//!
//! A transfer's writes end only once its bytes are in its decode's pool, whoever wrote them:
//! a task waiting for its partner waits for the partner's write too, so a transfer never ends
//! (nor acknowledges an abort) while its chunk is still being written.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::memory::WriteRun;
use crate::pool::HostPool;
use crate::transport::mapped::{self, MappedPool};

/// How long a chunk's writes wait for the same chunk of another decode rank of the room, when
/// another transfer of the room writes mapped and none waits elsewhere. Longer than one chunk's
/// write alone, so that a transfer a chunk behind catches up (writing alone meanwhile) and the
/// two then go in step: each pair's write ends for both at once.
const PARTNER_WAIT: Duration = Duration::from_millis(10);

/// A chunk's place in its room: the room, its tokens, its global layers.
pub(super) type ChunkKey = (u64, Range<usize>, Range<usize>);

/// Chunks waiting for a partner, and the transfers of each room that write mapped.
pub(super) struct Fanout {
    state: Mutex<State>,
    tickets: AtomicU64,
    /// [`PARTNER_WAIT`], but in tests.
    wait: Duration,
}

impl Default for Fanout {
    fn default() -> Self {
        Fanout::new(PARTNER_WAIT)
    }
}

#[derive(Default)]
struct State {
    waiting: HashMap<ChunkKey, Waiting>,
    /// Transfers writing a room's chunks into mapped pools ([`Fanout::join`]): a chunk waits
    /// for a partner only where another one writes (a decode rank on another host, staged,
    /// never comes).
    writers: HashMap<u64, usize>,
}

/// A transfer counted among its room's mapped writers until dropped.
pub(super) struct Writer {
    fanout: Arc<Fanout>,
    room: u64,
}

impl Drop for Writer {
    fn drop(&mut self) {
        let mut state = self.fanout.state();
        if let Some(n) = state.writers.get_mut(&self.room) {
            *n -= 1;
            if *n == 0 {
                state.writers.remove(&self.room);
            }
        }
    }
}

/// A chunk's writes, waiting: whoever takes them writes them and sends the outcome.
struct Waiting {
    ticket: u64,
    writes: Writes,
    done: oneshot::Sender<Result<(), String>>,
}

/// What a chunk's writes do on arrival.
enum Turn {
    /// Write with the partner's, waiting there.
    Pair(Waiting, Writes),
    /// Write alone.
    Alone(Writes),
    /// Left to a partner (this ticket), who sends the outcome; or taken back after a while.
    Wait(u64, oneshot::Receiver<Result<(), String>>),
}

/// One decode rank's writes of a chunk.
pub(super) struct Writes {
    pub(super) heads: Range<usize>,
    pub(super) pool: Arc<MappedPool>,
    pub(super) runs: Vec<WriteRun>,
}

impl Fanout {
    fn new(wait: Duration) -> Self {
        Fanout {
            state: Default::default(),
            tickets: AtomicU64::new(0),
            wait,
        }
    }

    /// Counts a transfer among `room`'s mapped writers while the result lives.
    pub(super) fn join(self: &Arc<Self>, room: u64) -> Writer {
        *self.state().writers.entry(room).or_default() += 1;
        Writer {
            fanout: self.clone(),
            room,
        }
    }

    /// Writes `writes` of chunk `key` from `source`, with a partner's: one waiting, or, when
    /// another transfer of the room writes mapped, one that comes within [`PARTNER_WAIT`]
    /// (its heads apart from these, its pool another); resolves once these bytes are written,
    /// saying whether they went in one pass with a partner's.
    pub(super) async fn write(
        &self,
        key: ChunkKey,
        source: Arc<HostPool>,
        writes: Writes,
    ) -> Result<bool, String> {
        // One look and one change under the lock: two transfers coming at once must not both
        // find the place empty and both wait there.
        let turn = {
            let mut state = self.state();
            // No other transfer of the room writes mapped, or one waits at another chunk
            // (ahead: this one catches up to it without waiting).
            let alone = state.writers.get(&key.0).is_none_or(|&n| n < 2)
                || state.waiting.keys().any(|k| k.0 == key.0 && *k != key);
            let waiting = &mut state.waiting;
            match waiting.remove(&key) {
                Some(partner) if pairs(&partner.writes, &writes) => Turn::Pair(partner, writes),
                Some(other) => {
                    // Not a partner (cannot happen between a room's decode ranks): left be.
                    waiting.insert(key.clone(), other);
                    Turn::Alone(writes)
                }
                None if alone => Turn::Alone(writes),
                None => {
                    let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
                    let (done, outcome) = oneshot::channel();
                    let me = Waiting {
                        ticket,
                        writes,
                        done,
                    };
                    waiting.insert(key.clone(), me);
                    Turn::Wait(ticket, outcome)
                }
            }
        };
        match turn {
            Turn::Wait(ticket, outcome) => self.wait(key, ticket, outcome, source).await,
            Turn::Alone(writes) => write_alone(source, writes).await.map(|()| false),
            Turn::Pair(partner, writes) => blocking(move || {
                let theirs = &partner.writes;
                let both = [
                    (&*writes.pool, &writes.runs[..]),
                    (&*theirs.pool, &theirs.runs[..]),
                ];
                let result = mapped::write_together(&source, &both);
                let _ = partner.done.send(result.clone());
                result
            })
            .await
            .map(|()| true),
        }
    }

    /// Waits for a partner to write the chunk `ticket` left at `key`; after [`PARTNER_WAIT`]
    /// takes it back and writes it alone, unless a partner took it meanwhile.
    async fn wait(
        &self,
        key: ChunkKey,
        ticket: u64,
        mut outcome: oneshot::Receiver<Result<(), String>>,
        source: Arc<HostPool>,
    ) -> Result<bool, String> {
        let stopped = |_| Err("the partner's write stopped".to_owned());
        if let Ok(got) = tokio::time::timeout(self.wait, &mut outcome).await {
            return got.unwrap_or_else(stopped).map(|()| true);
        }
        let mine = {
            let waiting = &mut self.state().waiting;
            match waiting.get(&key) {
                Some(w) if w.ticket == ticket => waiting.remove(&key),
                _ => None,
            }
        };
        match mine {
            Some(w) => {
                tracing::debug!(room = key.0, tokens = ?key.1, layers = ?key.2, "no partner in time");
                write_alone(source, w.writes).await.map(|()| false)
            }
            // A partner took the writes just now: its outcome is theirs.
            None => outcome.await.unwrap_or_else(stopped).map(|()| true),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether `w` and `writes` go to different decode ranks of the room.
fn pairs(w: &Writes, writes: &Writes) -> bool {
    let apart = w.heads.end <= writes.heads.start || writes.heads.end <= w.heads.start;
    apart && !Arc::ptr_eq(&w.pool, &writes.pool)
}

/// Writes `writes` of `source` without waiting for a partner.
pub(super) async fn write_alone(source: Arc<HostPool>, writes: Writes) -> Result<(), String> {
    blocking(move || writes.pool.write(&source, &writes.runs)).await
}

/// Runs a copy on the blocking pool (copies never run on the reactor).
async fn blocking(
    copy: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> Result<(), String> {
    tokio::task::spawn_blocking(copy)
        .await
        .map_err(|e| format!("the write stopped: {e}"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::testing::{tiny_pool as pool, xorshift_bytes};

    /// Two decode ranks' pools, mapped here, and the source they take halves of.
    struct Pair {
        src: Arc<HostPool>,
        bytes: Vec<u8>,
        dsts: [HostPool; 2],
        mapped: [Arc<MappedPool>; 2],
        _serving: Vec<tokio_util::task::AbortOnDropHandle<()>>,
    }

    async fn pair() -> Pair {
        let (src, dsts) = (pool(false), [pool(true), pool(true)]);
        let bytes = xorshift_bytes(src.size());
        src.write(0, &bytes).unwrap();
        let mut mapped = Vec::new();
        let mut serving = Vec::new();
        for dst in &dsts {
            dst.fill(0xDE);
            let (memory, guard) = mapped::serve(dst).await.unwrap().expect("a memory file");
            let attached = tokio::task::spawn_blocking(move || mapped::attach(&memory, "test"));
            mapped.push(Arc::new(attached.await.unwrap().unwrap()));
            serving.push(guard);
        }
        let mapped = [mapped[0].clone(), mapped[1].clone()];
        Pair {
            src: Arc::new(src),
            bytes,
            dsts,
            mapped,
            _serving: serving,
        }
    }

    impl Pair {
        /// Rank `r`'s writes of chunk `k`: half of each of 4 rows of 2 KiB.
        fn writes(&self, r: usize, k: u64, heads: Range<usize>) -> Writes {
            let runs = (0..4)
                .map(|row| WriteRun {
                    src: (k * 4 + row) * 2048 + r as u64 * 1024,
                    dst: (k * 4 + row) * 1024,
                    len: 1024,
                })
                .collect();
            Writes {
                heads,
                pool: self.mapped[r].clone(),
                runs,
            }
        }

        /// Every byte of both pools: the chunks of each rank's range landed, the rest
        /// untouched.
        fn check(&self, ks: [Range<u64>; 2]) {
            for (r, dst) in self.dsts.iter().enumerate() {
                let mut want = vec![0xDE; dst.size()];
                for k in ks[r].clone() {
                    for run in self.writes(r, k, 0..0).runs {
                        let (s, d, n) = (run.src as usize, run.dst as usize, run.len as usize);
                        want[d..d + n].copy_from_slice(&self.bytes[s..s + n]);
                    }
                }
                assert!(dst.read(0, dst.size()).unwrap() == want, "rank {r}");
            }
        }
    }

    /// Both ranks' writes of chunks `ks` from tasks of their own, arriving together.
    async fn both(f: &Arc<Fanout>, p: &Pair, ks: Range<u64>) -> Vec<[Result<bool, String>; 2]> {
        let mut out = Vec::new();
        for k in ks {
            let key: ChunkKey = (7, k as usize..k as usize + 1, 0..1);
            let tasks = [(0, 0..4), (1, 4..8)].map(|(r, heads)| {
                let (f, src, writes, key) =
                    (f.clone(), p.src.clone(), p.writes(r, k, heads), key.clone());
                tokio::spawn(async move { f.write(key, src, writes).await })
            });
            let [a, b] = tasks;
            out.push([a.await.unwrap(), b.await.unwrap()]);
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_ranks_writing_the_same_chunks_at_once_write_each_in_one_pass() {
        // A minute's wait: a partner late on a loaded machine still comes in time.
        let f = Arc::new(Fanout::new(Duration::from_secs(60)));
        let p = pair().await;
        let _writers = [f.join(7), f.join(7)];
        // 24 chunks of two tasks coming at the same moment, on two threads: the one that
        // finds the place empty waits there, the other pairs (two that both found it empty
        // and both waited once left one of them failed with its partner's write "stopped").
        let written = both(&f, &p, 0..24).await;
        assert!(
            written.iter().all(|w| *w == [Ok(true), Ok(true)]),
            "{written:?}"
        );
        p.check([0..24, 0..24]);
        assert!(f.state().waiting.is_empty(), "nothing left waiting");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_alone_in_its_room_or_with_overlapping_heads_writes_alone() {
        // A writer waiting for a partner that is none gives up after this.
        let f = Arc::new(Fanout::new(Duration::from_millis(1)));
        let p = pair().await;
        // One mapped writer in the room: no partner is waited for.
        let one = f.join(7);
        let key: ChunkKey = (7, 0..1, 0..1);
        let alone = f
            .write(key.clone(), p.src.clone(), p.writes(0, 0, 0..4))
            .await;
        assert_eq!(alone, Ok(false));
        drop(one);
        assert!(f.state().writers.is_empty(), "the writer left");
        // Two writers whose heads overlap are no partners: each writes its own.
        let _writers = [f.join(7), f.join(7)];
        let (a, b) = tokio::join!(
            f.write((7, 1..2, 0..1), p.src.clone(), p.writes(0, 1, 0..5)),
            f.write((7, 1..2, 0..1), p.src.clone(), p.writes(1, 1, 4..8)),
        );
        assert_eq!((a, b), (Ok(false), Ok(false)));
        p.check([0..2, 1..2]);
    }
}
