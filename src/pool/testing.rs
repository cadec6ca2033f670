//! Pools and contents the unit tests of several modules share.

use super::HostPool;
use crate::layout::{KvLayout, ModelSpec};

/// A pool of 8 `tiny` pages: a sealed memory file when `shareable` (one a decode serves for
/// mapped writes), anonymous memory otherwise.
pub(crate) fn tiny_pool(shareable: bool) -> HostPool {
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    match shareable {
        true => HostPool::shareable(layout, 8).unwrap(),
        false => HostPool::anonymous(layout, 8).unwrap(),
    }
}

/// `n` bytes of a xorshift sequence: no period a misplaced run could hide in.
pub(crate) fn xorshift_bytes(n: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
