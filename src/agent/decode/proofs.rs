//! What proves a prefill's data connection to this decode ([`transport::ProofCheck`]): the key
//! this decode gives the prefill in Hello, while the decode says Hello to it or keeps it as a
//! peer, alone or as the `sender_key` of a chunk header (after libzmq re-establishes a
//! connection, a chunk the prefill was sending may go before the proof it sends again); from a
//! prefill older than [`protocol::DATA_PROOFS`] (which sends an empty frame), an empty frame
//! while such a prefill is one. A connection that sends anything else first proves nothing:
//! it is never read and is dropped at the proof deadline.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::protocol;
use crate::transport::ProofCheck;

/// The proofs this decode accepts now.
#[derive(Default)]
pub(super) struct DataProofs(Mutex<Accepted>);

#[derive(Default)]
struct Accepted {
    /// The keys given out (random: each held by one peer).
    keys: HashSet<[u8; 16]>,
    /// Prefills older than [`protocol::DATA_PROOFS`] being said Hello to or kept as peers.
    older: usize,
}

impl DataProofs {
    fn accepted(&self) -> MutexGuard<'_, Accepted> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The check the data port's transport runs on a connection's first frame.
    pub(super) fn check(self: &Arc<Self>) -> ProofCheck {
        let proofs = self.clone();
        Arc::new(move |frame: &[u8]| match frame.len() {
            0 => proofs.accepted().older > 0,
            16 => proofs.accepted().keys.contains(frame),
            _ => match protocol::Message::decode(frame) {
                Ok(protocol::Message::Chunk(chunk)) => {
                    let key = chunk.sender_key.as_bytes();
                    proofs.accepted().keys.contains(&key[..])
                }
                _ => false,
            },
        })
    }

    /// Accepts `key` (and, for a prefill older than [`protocol::DATA_PROOFS`], an empty frame)
    /// until the returned guard is dropped.
    pub(super) fn admit(self: &Arc<Self>, key: &protocol::Secret, older: bool) -> Admitted {
        let key = *key.as_bytes();
        let mut accepted = self.accepted();
        accepted.keys.insert(key);
        accepted.older += usize::from(older);
        Admitted {
            proofs: self.clone(),
            key,
            older,
        }
    }
}

/// A prefill's proof, accepted while this lives (with the peer, or the Hello that makes it).
pub(super) struct Admitted {
    proofs: Arc<DataProofs>,
    key: [u8; 16],
    older: bool,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut accepted = self.proofs.accepted();
        accepted.keys.remove(&self.key);
        accepted.older -= usize::from(self.older);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_proves_while_its_peer_lives_and_an_empty_frame_only_for_older_prefills() {
        let proofs = Arc::new(DataProofs::default());
        let check = proofs.check();
        let key = protocol::Secret::from_bytes([7; 16]);
        assert!(!check(key.as_bytes()), "no key given out yet");
        let current = proofs.admit(&key, false);
        assert!(check(key.as_bytes()));
        assert!(
            !check(&[7; 15]) && !check(&[8; 16]) && !check(b""),
            "nothing else"
        );
        let other = protocol::Secret::from_bytes([9; 16]);
        let older = proofs.admit(&other, true);
        assert!(
            check(b""),
            "an empty frame, while an older prefill is a peer"
        );
        drop(older);
        assert!(!check(b"") && !check(other.as_bytes()));
        assert!(check(key.as_bytes()));
        // A chunk header carrying the key proves the connection too; one with another does not.
        let chunk = |sender_key| {
            protocol::Message::Chunk(protocol::Chunk {
                room: 1,
                prefill_instance: uuid::Uuid::from_u128(5),
                seq: 0,
                tokens: 0..16,
                layers: 0..2,
                heads: 0..2,
                len: 64,
                checksum: 0,
                direct: false,
                placed: None,
                secret: protocol::Secret::from_bytes([3; 16]),
                sender_key,
            })
            .encode()
        };
        assert!(check(&chunk(key)));
        assert!(!check(&chunk(protocol::Secret::from_bytes([8; 16]))));
        assert!(!check(b"not a chunk, not a key"));
        drop(current);
        assert!(!check(key.as_bytes()), "the peer is gone");
        assert!(!check(&chunk(key)));
    }
}
