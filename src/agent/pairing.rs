//! Rank pairing: which prefill ranks a decode rank receives which part of its KV from.
//!
//! [`plan`] is a pure function of the prefill group's slices and the decode rank's slice. It
//! returns segments `(prefill rank, layer range, head range)`, in global indices, such that
//! every (layer, head) the decode rank holds is received exactly once, each segment one bulk
//! transfer (the kernel's head-range gather), never one write per token and head:
//! - equal TP: one segment per PP stage, from the rank holding the same heads;
//! - prefill TP > decode TP: the decode rank gathers from every prefill rank holding a part of
//!   its heads;
//! - prefill TP < decode TP: several decode ranks take head slices of one prefill rank;
//! - replicated heads (GQA with fewer KV heads than TP ranks, and MLA's latent on every rank):
//!   the decode ranks holding a head share out the prefill ranks holding it, so that decode
//!   ranks spread over prefill ranks instead of all reading rank 0, and every holder is asked
//!   (a decode rank with several holders to itself reads its layers in parts from each): a
//!   rank nobody asks would keep the room's pages until its TTL;
//! - PP: each prefill stage sends its own layer range (uneven splits included).
//!
//! [`requesters`] tells a prefill rank how many decode ranks of a group will ask it for a
//! room, so it knows when a room is complete on its side.

use std::ops::Range;

/// The slice of the model one rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankSlice {
    /// Global KV heads.
    pub heads: Range<usize>,
    /// Global layers.
    pub layers: Range<usize>,
}

/// One bulk transfer of a decode rank's room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the source rank in the prefill slices given to [`plan`].
    pub prefill: usize,
    /// Global layers.
    pub layers: Range<usize>,
    /// Global heads.
    pub heads: Range<usize>,
}

/// Why no plan exists.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PairingError {
    /// Some (layer, head) of the decode rank is held by no prefill rank.
    #[error("layer {layer}, head {head} of this decode rank is held by no prefill rank")]
    Uncovered {
        /// Global layer.
        layer: usize,
        /// Global head.
        head: usize,
    },
    /// The decode rank is not one of its group's ranks.
    #[error("decode rank {0} is not in its group of {1} ranks")]
    NotInGroup(usize, usize),
}

/// The segments decode rank `decodes[me]` receives from the prefill ranks `prefill`;
/// `decodes` is its whole group, TP ranks in order within each PP stage.
///
/// Where several prefill ranks hold a (layer, head), the decode ranks holding it share them
/// out: with at least as many readers as holders each reads from one; with fewer, each reads
/// its layers in equal parts from several, so that every holder sends a part and none waits
/// for a request that never comes (unless a window has fewer layers than holders to share).
pub fn plan(
    prefill: &[RankSlice],
    decodes: &[RankSlice],
    me: usize,
) -> Result<Vec<Segment>, PairingError> {
    let decode = decodes
        .get(me)
        .ok_or(PairingError::NotInGroup(me, decodes.len()))?;
    // Layer boundaries where the set of prefill ranks holding a layer can change.
    let mut cuts: Vec<usize> = vec![decode.layers.start, decode.layers.end];
    for p in prefill {
        for b in [p.layers.start, p.layers.end] {
            if decode.layers.contains(&b) {
                cuts.push(b);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    let holding = |slices: &[RankSlice], layer: usize, head: usize| -> Vec<usize> {
        (0..slices.len())
            .filter(|&i| slices[i].layers.contains(&layer) && slices[i].heads.contains(&head))
            .collect()
    };
    // One segment per (prefill rank, layer range, head); merged below.
    let mut pieces: Vec<Segment> = Vec::new();
    for w in cuts.windows(2) {
        let layers = w[0]..w[1];
        for head in decode.heads.clone() {
            let holders = holding(prefill, layers.start, head);
            if holders.is_empty() {
                return Err(PairingError::Uncovered {
                    layer: layers.start,
                    head,
                });
            }
            let readers = holding(decodes, layers.start, head);
            let j = readers.iter().position(|&d| d == me).unwrap_or(0);
            let share: Vec<usize> = if readers.len() >= holders.len() {
                vec![holders[j % holders.len()]]
            } else {
                holders
                    .iter()
                    .copied()
                    .skip(j)
                    .step_by(readers.len())
                    .collect()
            };
            let parts = share.len().min(layers.len());
            for (k, &source) in share.iter().take(parts).enumerate() {
                pieces.push(Segment {
                    prefill: source,
                    layers: layers.start + layers.len() * k / parts
                        ..layers.start + layers.len() * (k + 1) / parts,
                    heads: head..head + 1,
                });
            }
        }
    }
    // Adjacent heads a rank sends for the same layers, then adjacent layers it sends for the
    // same heads (a prefill stage spanning several windows cut by other stages' boundaries),
    // are one bulk transfer.
    pieces.sort_by_key(|s| (s.prefill, s.layers.start, s.layers.end, s.heads.start));
    let mut pieces = merge(pieces, |m, s| {
        m.layers == s.layers && m.heads.end == s.heads.start
    });
    pieces.sort_by_key(|s| (s.prefill, s.heads.start, s.heads.end, s.layers.start));
    Ok(merge(pieces, |m, s| {
        m.heads == s.heads && m.layers.end == s.layers.start
    }))
}

/// Folds each segment into the previous one of the same prefill rank where `adjacent` says
/// the two ranges join.
fn merge(sorted: Vec<Segment>, adjacent: impl Fn(&Segment, &Segment) -> bool) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for s in sorted {
        match out.last_mut() {
            Some(m) if m.prefill == s.prefill && adjacent(m, &s) => {
                m.layers.end = m.layers.end.max(s.layers.end);
                m.heads.end = m.heads.end.max(s.heads.end);
            }
            _ => out.push(s),
        }
    }
    out
}

/// How many of the decode ranks `decodes` (a whole group, as for [`plan`]) receive from
/// prefill rank `prefill_rank`.
pub fn requesters(prefill: &[RankSlice], decodes: &[RankSlice], prefill_rank: usize) -> usize {
    (0..decodes.len())
        .filter(|&d| {
            plan(prefill, decodes, d).is_ok_and(|p| p.iter().any(|s| s.prefill == prefill_rank))
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvLayout, ModelSpec};
    use proptest::prelude::*;

    fn slices(model: &str, tp: usize, pp: usize) -> Vec<RankSlice> {
        let base = KvLayout::new(ModelSpec::preset(model).unwrap(), 16).unwrap();
        let mut v = Vec::new();
        for p in 0..pp {
            for t in 0..tp {
                let l = base.clone().for_rank(t, tp, p, pp).unwrap();
                v.push(RankSlice {
                    heads: l.heads,
                    layers: l.layers,
                });
            }
        }
        v
    }

    /// Every (layer, head) of the decode rank is received exactly once, from a rank holding it.
    fn check(prefill: &[RankSlice], decode: &RankSlice, segs: &[Segment]) {
        for layer in decode.layers.clone() {
            for head in decode.heads.clone() {
                let from: Vec<&Segment> = segs
                    .iter()
                    .filter(|s| s.layers.contains(&layer) && s.heads.contains(&head))
                    .collect();
                assert_eq!(from.len(), 1, "layer {layer} head {head}: {segs:?}");
                let src = &prefill[from[0].prefill];
                assert!(src.layers.contains(&layer) && src.heads.contains(&head));
            }
        }
        for s in segs {
            assert!(decode.layers.start <= s.layers.start && s.layers.end <= decode.layers.end);
            assert!(decode.heads.start <= s.heads.start && s.heads.end <= decode.heads.end);
        }
    }

    fn plans(
        model: &str,
        (ptp, ppp): (usize, usize),
        (dtp, dpp): (usize, usize),
    ) -> Vec<Vec<Segment>> {
        let prefill = slices(model, ptp, ppp);
        let decodes = slices(model, dtp, dpp);
        (0..decodes.len())
            .map(|d| {
                let p = plan(&prefill, &decodes, d).unwrap();
                check(&prefill, &decodes[d], &p);
                p
            })
            .collect()
    }

    #[test]
    fn equal_tp_is_one_segment_from_the_twin_rank() {
        let p = plans("llama3-8b", (2, 1), (2, 1));
        assert_eq!(
            p[0],
            vec![Segment {
                prefill: 0,
                layers: 0..32,
                heads: 0..4
            }]
        );
        assert_eq!(
            p[1],
            vec![Segment {
                prefill: 1,
                layers: 0..32,
                heads: 4..8
            }]
        );
    }

    #[test]
    fn tp_mismatch_is_a_few_bulk_segments() {
        // TP4 -> TP2: each decode rank gathers from two prefill ranks.
        let p = plans("llama3-8b", (4, 1), (2, 1));
        assert_eq!(
            p[1],
            vec![
                Segment {
                    prefill: 2,
                    layers: 0..32,
                    heads: 4..6
                },
                Segment {
                    prefill: 3,
                    layers: 0..32,
                    heads: 6..8
                },
            ]
        );
        // TP1 -> TP2: both decode ranks take a head slice of the one prefill rank.
        let p = plans("llama3-8b", (1, 1), (2, 1));
        assert_eq!(
            p[1],
            vec![Segment {
                prefill: 0,
                layers: 0..32,
                heads: 4..8
            }]
        );
    }

    #[test]
    fn replicated_heads_and_mla_spread_over_sources() {
        // 4 KV heads over TP 8: heads replicated on two prefill ranks each.
        let p = plans("qwen2.5-7b", (8, 1), (8, 1));
        let sources: Vec<usize> = p.iter().map(|s| s[0].prefill).collect();
        assert_eq!(sources, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        // MLA TP2 -> TP4: each decode rank from exactly one prefill rank, both used.
        let p = plans("deepseek-v3", (2, 1), (4, 1));
        assert!(p.iter().all(|s| s.len() == 1));
        let sources: Vec<usize> = p.iter().map(|s| s[0].prefill).collect();
        assert_eq!(sources, vec![0, 1, 0, 1]);
    }

    #[test]
    fn fewer_readers_than_holders_read_their_layers_in_parts_from_each() {
        // qwen2.5-7b's 4 heads over TP 8, into TP 2: each decode rank holds two heads, each
        // held by two prefill ranks, which send half the layers each.
        let p = plans("qwen2.5-7b", (8, 1), (2, 1));
        let seg = |prefill, layers, head: usize| Segment {
            prefill,
            layers,
            heads: head..head + 1,
        };
        assert_eq!(
            p[1],
            vec![
                seg(4, 0..14, 2),
                seg(5, 14..28, 2),
                seg(6, 0..14, 3),
                seg(7, 14..28, 3)
            ]
        );
        // MLA's latent on 8 prefill ranks, into TP 2: each decode rank reads from four of them.
        let p = plans("deepseek-v3", (8, 1), (2, 1));
        let sources: Vec<Vec<usize>> = p
            .iter()
            .map(|s| s.iter().map(|s| s.prefill).collect())
            .collect();
        assert_eq!(sources, vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        let layers: Vec<_> = p[0].iter().map(|s| s.layers.clone()).collect();
        assert_eq!(layers, vec![0..15, 15..30, 30..45, 45..61]);
    }

    #[test]
    fn pipeline_stages_each_send_their_layers() {
        // 61 layers over 2 stages (31 + 30) into PP1.
        let p = plans("deepseek-v3", (1, 2), (1, 1));
        assert_eq!(
            p[0],
            vec![
                Segment {
                    prefill: 0,
                    layers: 0..31,
                    heads: 0..1
                },
                Segment {
                    prefill: 1,
                    layers: 31..61,
                    heads: 0..1
                },
            ]
        );
        // PP2 -> PP3 with TP mismatch.
        plans("llama3-70b", (2, 2), (4, 3));
    }

    #[test]
    fn missing_ranks_are_reported() {
        let prefill = vec![RankSlice {
            heads: 0..4,
            layers: 0..10,
        }];
        let decodes = vec![RankSlice {
            heads: 0..8,
            layers: 0..10,
        }];
        assert_eq!(
            plan(&prefill, &decodes, 0),
            Err(PairingError::Uncovered { layer: 0, head: 4 })
        );
        assert_eq!(
            plan(&prefill, &decodes, 1),
            Err(PairingError::NotInGroup(1, 1))
        );
    }

    #[test]
    fn requesters_count_the_decode_ranks_reading_a_prefill_rank() {
        let prefill = slices("llama3-8b", 1, 1);
        assert_eq!(requesters(&prefill, &slices("llama3-8b", 4, 1), 0), 4);
        let prefill = slices("llama3-8b", 4, 1);
        let decodes = slices("llama3-8b", 2, 1);
        assert_eq!(
            (0..4)
                .map(|r| requesters(&prefill, &decodes, r))
                .collect::<Vec<_>>(),
            vec![1, 1, 1, 1]
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn every_layer_and_head_is_received_once_and_every_prefill_rank_asked(
            layers in 1usize..70,
            heads_pow in 0u32..5,
            mla in any::<bool>(),
            ptp_pow in 0u32..4, dtp_pow in 0u32..4,
            ppp in 1usize..5, dpp in 1usize..5,
        ) {
            let heads = if mla { 1 } else { 1usize << heads_pow };
            let model = if mla {
                ModelSpec { kind: crate::layout::AttentionKind::Mla, num_layers: layers, num_kv_heads: 1, head_dim: 8, dtype: crate::layout::Dtype::Fp16 }
            } else {
                ModelSpec::mha(layers, heads, 8, crate::layout::Dtype::Fp16)
            };
            let (ptp, dtp) = (1usize << ptp_pow, 1usize << dtp_pow);
            prop_assume!(ppp <= layers && dpp <= layers);
            let base = KvLayout::new(model, 4).unwrap();
            let slice = |tp: usize, pp: usize, t: usize, p: usize| {
                let l = base.clone().for_rank(t, tp, p, pp).unwrap();
                RankSlice { heads: l.heads, layers: l.layers }
            };
            let prefill: Vec<RankSlice> = (0..ppp).flat_map(|p| (0..ptp).map(move |t| (t, p))).map(|(t, p)| slice(ptp, ppp, t, p)).collect();
            let decodes: Vec<RankSlice> = (0..dpp).flat_map(|p| (0..dtp).map(move |t| (t, p))).map(|(t, p)| slice(dtp, dpp, t, p)).collect();
            for (d, decode) in decodes.iter().enumerate() {
                let segs = plan(&prefill, &decodes, d).unwrap();
                check(&prefill, decode, &segs);
                // Bulk: at most one segment per prefill rank.
                let mut ranks: Vec<usize> = segs.iter().map(|s| s.prefill).collect();
                ranks.sort_unstable();
                ranks.dedup();
                prop_assert_eq!(ranks.len(), segs.len());
            }
            // Every prefill rank is asked, wherever one stage on each side leaves a window of
            // at least a layer per holder.
            if ppp == 1 && dpp == 1 && layers >= ptp {
                for r in 0..prefill.len() {
                    prop_assert!(requesters(&prefill, &decodes, r) > 0, "prefill rank {} asked by none", r);
                }
            }
        }
    }
}
