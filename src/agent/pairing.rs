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
//!   each head comes from one of the ranks holding it, chosen by the decode's TP rank so that
//!   decode ranks spread over prefill ranks instead of all reading rank 0;
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
}

/// The segments a decode rank (`decode`, TP rank `decode_tp_rank`) receives from the prefill
/// ranks `prefill`.
pub fn plan(
    prefill: &[RankSlice],
    decode: &RankSlice,
    decode_tp_rank: usize,
) -> Result<Vec<Segment>, PairingError> {
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
    let mut out: Vec<Segment> = Vec::new();
    for w in cuts.windows(2) {
        let layers = w[0]..w[1];
        let mut current: Option<Segment> = None;
        for head in decode.heads.clone() {
            let holders: Vec<usize> = (0..prefill.len())
                .filter(|&i| {
                    prefill[i].layers.contains(&layers.start) && prefill[i].heads.contains(&head)
                })
                .collect();
            if holders.is_empty() {
                return Err(PairingError::Uncovered {
                    layer: layers.start,
                    head,
                });
            }
            let source = holders[decode_tp_rank % holders.len()];
            match current.as_mut() {
                Some(s) if s.prefill == source && s.heads.end == head => s.heads.end = head + 1,
                _ => {
                    out.extend(current.take());
                    current = Some(Segment {
                        prefill: source,
                        layers: layers.clone(),
                        heads: head..head + 1,
                    });
                }
            }
        }
        out.extend(current);
    }
    // Merge a rank's segments over adjacent layer windows (e.g. a prefill stage spanning
    // several windows cut by other stages' boundaries).
    out.sort_by_key(|s| (s.prefill, s.heads.start, s.layers.start));
    let mut merged: Vec<Segment> = Vec::new();
    for s in out {
        match merged.last_mut() {
            Some(m)
                if m.prefill == s.prefill
                    && m.heads == s.heads
                    && m.layers.end == s.layers.start =>
            {
                m.layers.end = s.layers.end;
            }
            _ => merged.push(s),
        }
    }
    Ok(merged)
}

/// How many of the decode ranks `decodes` (slice and TP rank each) receive from prefill rank
/// `prefill_rank`.
pub fn requesters(
    prefill: &[RankSlice],
    decodes: &[(RankSlice, usize)],
    prefill_rank: usize,
) -> usize {
    decodes
        .iter()
        .filter(|(slice, tp)| {
            plan(prefill, slice, *tp).is_ok_and(|p| p.iter().any(|s| s.prefill == prefill_rank))
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvLayout, ModelSpec};
    use proptest::prelude::*;

    fn slices(model: &str, tp: usize, pp: usize) -> Vec<(RankSlice, usize)> {
        let base = KvLayout::new(ModelSpec::preset(model).unwrap(), 16).unwrap();
        let mut v = Vec::new();
        for p in 0..pp {
            for t in 0..tp {
                let l = base.clone().for_rank(t, tp, p, pp).unwrap();
                v.push((
                    RankSlice {
                        heads: l.heads,
                        layers: l.layers,
                    },
                    t,
                ));
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
        let prefill: Vec<RankSlice> = slices(model, ptp, ppp)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        slices(model, dtp, dpp)
            .into_iter()
            .map(|(d, t)| {
                let p = plan(&prefill, &d, t).unwrap();
                check(&prefill, &d, &p);
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
        let decode = RankSlice {
            heads: 0..8,
            layers: 0..10,
        };
        assert_eq!(
            plan(&prefill, &decode, 0),
            Err(PairingError::Uncovered { layer: 0, head: 4 })
        );
    }

    #[test]
    fn requesters_count_the_decode_ranks_reading_a_prefill_rank() {
        let prefill: Vec<RankSlice> = slices("llama3-8b", 1, 1)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(requesters(&prefill, &slices("llama3-8b", 4, 1), 0), 4);
        let prefill: Vec<RankSlice> = slices("llama3-8b", 4, 1)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
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
        fn every_layer_and_head_is_received_exactly_once(
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
            for p in 0..dpp {
                for t in 0..dtp {
                    let d = slice(dtp, dpp, t, p);
                    let segs = plan(&prefill, &d, t).unwrap();
                    check(&prefill, &d, &segs);
                    // Bulk: at most one segment per prefill rank.
                    let mut ranks: Vec<usize> = segs.iter().map(|s| s.prefill).collect();
                    ranks.sort_unstable();
                    ranks.dedup();
                    prop_assert_eq!(ranks.len(), segs.len());
                }
            }
        }
    }
}
