//! The synthetic engine built into the agents (`--synthetic`): the prefill fills a room's pages
//! with a deterministic pattern and the decode checks every landed byte against it.
//!
//! The pattern of a head's bytes is a function of (room, token position, global layer, plane,
//! global head, byte offset), computed a machine word at a time by [`pattern_word`], the one
//! definition both sides use. Because it encodes the global head and layer, a head or a layer
//! landed in the wrong place is caught, not only a flipped byte.
//!
//! Fill and verify go one layer at a time through the transfer kernel (token-major staging of
//! one layer), so they need one layer of scratch memory, not a room's worth.

use std::ops::Range;

use super::pool::AgentPool;
use crate::kernel::{KernelError, Selection};
use crate::layout::{KvLayout, PageOrder};

/// One 8-byte word of the pattern.
pub fn pattern_word(room: u64, token: u64, layer: u64, plane: u64, head: u64, word: u64) -> u64 {
    let mut x = room
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(token << 24 ^ layer << 12 ^ plane << 11 ^ head)
        .wrapping_add(word.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    // splitmix64 finaliser
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Writes the pattern of one layer (global index `layer`) for `tokens` into `out`, in the
/// token-major staging order of a selection of every head the pool holds.
fn layer_pattern(l: &KvLayout, room: u64, layer: usize, tokens: &Range<usize>, out: &mut [u8]) {
    let hb = l.head_bytes();
    let mut at = 0;
    for plane in 0..l.planes() {
        for token in tokens.clone() {
            for head in l.heads.clone() {
                let dst = &mut out[at..at + hb];
                for (w, bytes) in dst.chunks_mut(8).enumerate() {
                    let word = pattern_word(
                        room,
                        token as u64,
                        layer as u64,
                        plane as u64,
                        head as u64,
                        w as u64,
                    );
                    bytes.copy_from_slice(&word.to_le_bytes()[..bytes.len()]);
                }
                at += hb;
            }
        }
    }
}

/// Where landed bytes first differ from the pattern.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VerifyError {
    /// A byte differs.
    #[error(
        "byte {byte} of head {head}, plane {plane}, token {token}, layer {layer} differs from the pattern"
    )]
    Mismatch {
        /// Global layer.
        layer: usize,
        /// Plane (0 = K or latent, 1 = V).
        plane: usize,
        /// Token position in the room.
        token: usize,
        /// Global head.
        head: usize,
        /// Byte within the head.
        byte: usize,
    },
    /// The selection could not be read.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

fn layer_selection<'a>(
    l: &KvLayout,
    pages: &'a [u32],
    tokens: &Range<usize>,
    local: usize,
) -> Selection<'a> {
    Selection {
        pages,
        tokens: tokens.clone(),
        layers: local..local + 1,
        heads: 0..l.num_heads(),
    }
}

/// Fills `tokens` x local `layers` of a room held in `pages` with the pattern, every head the
/// pool holds.
pub(crate) fn fill(
    pool: &AgentPool,
    room: u64,
    pages: &[u32],
    tokens: Range<usize>,
    layers: Range<usize>,
) -> Result<(), KernelError> {
    let l = pool.layout();
    let mut buf = Vec::new();
    for local in layers {
        let sel = layer_selection(l, pages, &tokens, local);
        buf.resize(sel.bytes_in(l)?, 0);
        layer_pattern(l, room, l.layers.start + local, &tokens, &mut buf);
        pool.scatter(&buf, PageOrder::TokenMajor, &sel)?;
    }
    Ok(())
}

/// Checks `tokens` of a room held in `pages` against the pattern.
pub(crate) fn verify(
    pool: &AgentPool,
    room: u64,
    pages: &[u32],
    tokens: Range<usize>,
) -> Result<(), VerifyError> {
    let l = pool.layout();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for local in 0..l.num_layers() {
        let sel = layer_selection(l, pages, &tokens, local);
        let n = sel.bytes_in(l)?;
        got.resize(n, 0);
        want.resize(n, 0);
        pool.gather(&sel, PageOrder::TokenMajor, &mut got, None)?;
        let layer = l.layers.start + local;
        layer_pattern(l, room, layer, &tokens, &mut want);
        if got != want {
            let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            let hb = l.head_bytes();
            let (head_index, byte) = (i / hb, i % hb);
            let per_plane = tokens.len() * l.num_heads();
            let (plane, rest) = (head_index / per_plane, head_index % per_plane);
            return Err(VerifyError::Mismatch {
                layer,
                plane,
                token: tokens.start + rest / l.num_heads(),
                head: l.heads.start + rest % l.num_heads(),
                byte,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::EnginePool;
    use crate::layout::ModelSpec;
    use crate::pool::HostPool;

    #[test]
    fn filled_rooms_verify_and_a_flipped_byte_is_located() {
        let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16)
            .unwrap()
            .with_slice(1..3, 1..4)
            .unwrap();
        let k = AgentPool::new(
            EnginePool::Host(HostPool::anonymous(layout.clone(), 8).unwrap()),
            1,
        )
        .unwrap();
        let pool = k.host().unwrap().clone();
        let pages = [5, 2, 7];
        fill(&k, 42, &pages, 0..40, 0..3).unwrap();
        verify(&k, 42, &pages, 0..40).unwrap();
        // Another room's pattern differs.
        assert!(verify(&k, 43, &pages, 0..40).is_err());
        // Flip one byte: layer 2 (local 1), V plane, token 17 (page 2 at slot 1), head 2
        // (local 1), byte 3.
        let off = pool.block_offset(1, 1, 2).unwrap() + layout.element_offset(1, 1) + 3;
        let b = pool.read(off, 1).unwrap()[0];
        pool.write(off, &[!b]).unwrap();
        assert_eq!(
            verify(&k, 42, &pages, 0..40).unwrap_err(),
            VerifyError::Mismatch {
                layer: 2,
                plane: 1,
                token: 17,
                head: 2,
                byte: 3
            }
        );
    }

    #[test]
    fn pattern_separates_every_coordinate() {
        let base = pattern_word(1, 2, 3, 1, 5, 6);
        for other in [
            pattern_word(2, 2, 3, 1, 5, 6),
            pattern_word(1, 3, 3, 1, 5, 6),
            pattern_word(1, 2, 4, 1, 5, 6),
            pattern_word(1, 2, 3, 0, 5, 6),
            pattern_word(1, 2, 3, 1, 6, 6),
            pattern_word(1, 2, 3, 1, 5, 7),
        ] {
            assert_ne!(base, other);
        }
    }
}
