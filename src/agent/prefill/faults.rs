//! Fault injection for tests: the chunk a prefill corrupts. Chunks are numbered from 1 as they
//! are gathered; the one numbered `--fault-corrupt-chunk` (from the start), or armed while the
//! agent runs through the engine API's `POST /v1/faults` (served with `--fault-injection`),
//! has its bytes inverted (a direct chunk: its checksum) after checksumming.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// The chunks gathered so far and the one to corrupt (0: none).
pub(super) struct Faults {
    sent: AtomicU64,
    corrupt: AtomicU64,
}

/// `POST /v1/faults`: corrupt the `corrupt_chunk`-th chunk sent from now (1: the next).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Arm {
    pub corrupt_chunk: u64,
}

/// The answer: the number the armed chunk will have, and the chunks sent so far.
#[derive(Debug, Serialize)]
pub(super) struct Armed {
    pub corrupt_chunk: u64,
    pub chunks_sent: u64,
}

impl Faults {
    pub(super) fn new(corrupt: Option<u64>) -> Self {
        Faults {
            sent: AtomicU64::new(0),
            corrupt: AtomicU64::new(corrupt.unwrap_or(0)),
        }
    }

    /// Numbers the next chunk; whether it is the one to corrupt.
    pub(super) fn next_chunk(&self) -> (u64, bool) {
        let nth = self.sent.fetch_add(1, Ordering::Relaxed) + 1;
        (nth, self.corrupt.load(Ordering::Relaxed) == nth)
    }

    /// Arms the corruption of the `n`-th chunk from now (at least 1).
    pub(super) fn arm(&self, arm: Arm) -> Result<Armed, String> {
        if arm.corrupt_chunk == 0 {
            return Err("corrupt_chunk counts chunks from the next one, which is 1".into());
        }
        let sent = self.sent.load(Ordering::Relaxed);
        let nth = sent + arm.corrupt_chunk;
        self.corrupt.store(nth, Ordering::Relaxed);
        Ok(Armed {
            corrupt_chunk: nth,
            chunks_sent: sent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_armed_chunk_counts_from_the_chunks_already_sent() {
        let f = Faults::new(Some(2));
        assert_eq!(f.next_chunk(), (1, false));
        assert_eq!(f.next_chunk(), (2, true));
        let armed = f.arm(Arm { corrupt_chunk: 2 }).unwrap();
        assert_eq!((armed.corrupt_chunk, armed.chunks_sent), (4, 2));
        assert_eq!(f.next_chunk(), (3, false));
        assert_eq!(f.next_chunk(), (4, true));
        assert_eq!(f.next_chunk(), (5, false));
        assert!(f.arm(Arm { corrupt_chunk: 0 }).is_err());
    }
}
