//! How a room's transfer is cut into chunks within the staging budget, and which cells of a
//! room are covered (landed at a decode, announced ready at a prefill).

use std::ops::Range;

/// Which (local layer, token, local head) cells of a room are marked: landed (decode) or
/// announced ready (prefill, one head column).
pub(crate) struct Coverage {
    tokens: usize,
    heads: usize,
    bits: Vec<u64>,
}

impl Coverage {
    pub(crate) fn new(layers: usize, tokens: usize, heads: usize) -> Self {
        Coverage {
            tokens,
            heads,
            bits: vec![0; (layers * tokens * heads).div_ceil(64)],
        }
    }

    fn cells(
        &self,
        layers: Range<usize>,
        tokens: Range<usize>,
        heads: Range<usize>,
    ) -> impl Iterator<Item = usize> + use<> {
        let (t, h) = (self.tokens, self.heads);
        layers.flat_map(move |l| {
            let heads = heads.clone();
            tokens
                .clone()
                .flat_map(move |tok| heads.clone().map(move |hd| (l * t + tok) * h + hd))
        })
    }

    /// Marks the cells; refuses (and marks nothing) if any was marked before.
    pub(crate) fn claim(
        &mut self,
        layers: Range<usize>,
        tokens: Range<usize>,
        heads: Range<usize>,
    ) -> bool {
        let set = |bits: &[u64], i: usize| bits[i / 64] >> (i % 64) & 1 == 1;
        if self
            .cells(layers.clone(), tokens.clone(), heads.clone())
            .any(|i| set(&self.bits, i))
        {
            return false;
        }
        for i in self.cells(layers, tokens, heads) {
            self.bits[i / 64] |= 1 << (i % 64);
        }
        true
    }
}

/// One chunk of a room's transfer: a token range of a layer range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    /// Tokens of the room.
    pub tokens: Range<usize>,
    /// Global layers.
    pub layers: Range<usize>,
}

/// Cuts `tokens x layers` into chunks of at most `chunk_bytes` (at least one page of one
/// layer each, so a chunk is never empty), whole layers together when they fit.
pub(crate) fn plan_chunks(
    tokens: Range<usize>,
    layers: Range<usize>,
    bytes_per_token_layer: usize,
    page_size: usize,
    chunk_bytes: usize,
    whole_pages: bool,
) -> Vec<ChunkPlan> {
    let mut out = Vec::new();
    if tokens.is_empty() || layers.is_empty() {
        return out;
    }
    // Pages that move only whole stage every token slot of the pages the tokens touch.
    let staged = match whole_pages {
        true => tokens.end.div_ceil(page_size) * page_size - tokens.start / page_size * page_size,
        false => tokens.len(),
    };
    let layer_bytes = staged * bytes_per_token_layer;
    if layer_bytes <= chunk_bytes {
        let per = (chunk_bytes / layer_bytes.max(1)).max(1);
        let mut l = layers.start;
        while l < layers.end {
            let end = (l + per).min(layers.end);
            out.push(ChunkPlan {
                tokens: tokens.clone(),
                layers: l..end,
            });
            l = end;
        }
        return out;
    }
    let per_tokens =
        (chunk_bytes / bytes_per_token_layer.max(1) / page_size * page_size).max(page_size);
    for layer in layers {
        let mut t = tokens.start;
        while t < tokens.end {
            // Cut on page boundaries of the room so each chunk covers whole page blocks.
            let end = ((t / page_size * page_size) + per_tokens).min(tokens.end);
            out.push(ChunkPlan {
                tokens: t..end,
                layers: layer..layer + 1,
            });
            t = end;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_room_within_the_budget() {
        for (tokens, layers, per, page, budget) in [
            (0..4096, 0..32, 8192, 16, 4 << 20),
            (5..4000, 3..30, 8192, 16, 4 << 20),
            (0..16, 0..32, 8192, 16, 4 << 20),
            (0..1000, 0..4, 1024, 64, 1 << 10),
            (7..9, 0..2, 100, 4, 1),
        ] {
            let chunks = plan_chunks(tokens.clone(), layers.clone(), per, page, budget, false);
            let mut covered = vec![0u32; layers.end * tokens.end];
            for c in &chunks {
                let bytes = c.tokens.len() * c.layers.len() * per;
                assert!(bytes <= budget.max(page * per), "{c:?} is {bytes} bytes");
                for l in c.layers.clone() {
                    for t in c.tokens.clone() {
                        covered[l * tokens.end + t] += 1;
                    }
                }
            }
            for l in 0..layers.end {
                for t in 0..tokens.end {
                    let want = u32::from(layers.contains(&l) && tokens.contains(&t));
                    assert_eq!(covered[l * tokens.end + t], want, "layer {l} token {t}");
                }
            }
        }
        assert!(plan_chunks(0..0, 0..4, 8, 16, 1024, false).is_empty());
    }
}
