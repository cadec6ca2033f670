//! Which instances can exchange KV: a prefill's and a decode's registrations pair when their
//! protocol versions meet, they serve the same model, their KV has the same kind, dtype,
//! layers, heads and head size, and their page orders and sizes can exchange KV
//! (`kvferry_wire::kv::wire_order`, the rule the agents' Hello applies: a vLLM CPU page moves
//! only whole, to a pool of its own order and page size). The registry tells an instance that
//! pairs with none of the other role at registration (and in `GET /v1/ranks`); a router pairs
//! only instances that pass ([`pairable`]). What a field left unsaid (an older agent's
//! registration) never keeps two instances apart.

use crate::types::{Registration, Role};

/// Whether a prefill and a decode registration can exchange KV; why not, naming the field and
/// both values (the prefill's first).
pub fn pairable(prefill: &Registration, decode: &Registration) -> Result<(), String> {
    let (p, d) = (&prefill.about, &decode.about);
    if let (Some(a), Some(b)) = (p.protocol, d.protocol)
        && (a.max < b.min || b.max < a.min)
    {
        return Err(format!(
            "protocol versions do not meet: prefill {a}, decode {b}"
        ));
    }
    if let (Some(a), Some(b)) = (&p.model, &d.model)
        && a != b
    {
        return Err(format!("model differs: prefill {a:?}, decode {b:?}"));
    }
    let (a, b) = (&prefill.layout, &decode.layout);
    let fields = [
        ("kind", a.kind.to_string(), b.kind.to_string()),
        ("dtype", a.dtype.to_string(), b.dtype.to_string()),
        (
            "num_layers",
            a.num_layers.to_string(),
            b.num_layers.to_string(),
        ),
        (
            "num_kv_heads",
            a.num_kv_heads.to_string(),
            b.num_kv_heads.to_string(),
        ),
        ("head_dim", a.head_dim.to_string(), b.head_dim.to_string()),
    ];
    for (field, x, y) in fields {
        if x != y {
            return Err(format!("KV {field} differs: prefill {x}, decode {y}"));
        }
    }
    if let (Some(x), Some(y)) = (a.order, b.order) {
        kvferry_wire::kv::wire_order((x, a.page_size as usize), (y, b.page_size as usize))
            .map_err(|why| format!("KV pages cannot move between them: {why}"))?;
    }
    Ok(())
}

/// Why `r` pairs with none of `others`' instances of the other role; `None` when it pairs
/// with one of them or there is none.
pub fn unmatched<'a>(
    r: &Registration,
    others: impl IntoIterator<Item = &'a Registration>,
) -> Option<String> {
    let mut first = None;
    let mut count = 0;
    for other in others.into_iter().filter(|o| o.role != r.role) {
        let paired = match r.role {
            Role::Prefill => pairable(r, other),
            Role::Decode => pairable(other, r),
        };
        match paired {
            Ok(()) => return None,
            Err(why) => {
                count += 1;
                first.get_or_insert(why);
            }
        }
    }
    let other = match r.role {
        Role::Prefill => "decode",
        Role::Decode => "prefill",
    };
    first.map(|why| {
        format!(
            "this {} can exchange KV with none of the {count} {other} ranks registered: {why}",
            r.role
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{
        About, AttentionKind, Dtype, IndexRange, KvLayout, PageOrder, Slice, Versions,
    };
    use std::collections::BTreeMap;
    use uuid::Uuid;

    fn rank(role: Role, head_dim: u32, protocol: (u16, u16)) -> Registration {
        Registration {
            instance_id: Uuid::new_v4(),
            role,
            dp_rank: 0,
            dp_size: 1,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            layout: KvLayout {
                kind: AttentionKind::Mha,
                num_layers: 2,
                num_kv_heads: 2,
                head_dim,
                dtype: Dtype::Fp32,
                page_size: 16,
                order: None,
            },
            slice: Slice {
                heads: IndexRange::new(0, 2),
                layers: IndexRange::new(0, 2),
            },
            control_endpoint: "tcp://127.0.0.1:1".into(),
            data_endpoints: BTreeMap::new(),
            about: About {
                protocol: Some(Versions {
                    min: protocol.0,
                    max: protocol.1,
                }),
                model: Some("tiny".into()),
                ..About::default()
            },
        }
    }

    #[test]
    fn instances_pair_when_versions_meet_and_the_kv_is_the_same() {
        let p = rank(Role::Prefill, 64, (6, 9));
        assert_eq!(pairable(&p, &rank(Role::Decode, 64, (9, 10))), Ok(()));
        let why = pairable(&p, &rank(Role::Decode, 64, (10, 11))).unwrap_err();
        assert_eq!(
            why,
            "protocol versions do not meet: prefill 6..=9, decode 10..=11"
        );
        let why = pairable(&p, &rank(Role::Decode, 32, (9, 9))).unwrap_err();
        assert_eq!(why, "KV head_dim differs: prefill 64, decode 32");
        let mut other_model = rank(Role::Decode, 64, (9, 9));
        other_model.about.model = Some("big".into());
        assert!(
            pairable(&p, &other_model)
                .unwrap_err()
                .contains("model differs")
        );
    }

    #[test]
    fn page_orders_and_sizes_pair_as_their_pages_can_move() {
        let with = |role, order, page_size| {
            let mut r = rank(role, 64, (9, 9));
            r.layout.order = Some(order);
            r.layout.page_size = page_size;
            r
        };
        use PageOrder::{HeadMajor, TokenMajor, VllmCpuAmx, VllmCpuVec};
        // Token-granular pages re-block token by token: any orders and sizes.
        let p = with(Role::Prefill, TokenMajor, 16);
        assert_eq!(pairable(&p, &with(Role::Decode, HeadMajor, 32)), Ok(()));
        // vLLM CPU pages move only to the same order; vec pages of other sizes re-blocked,
        // amx pages only whole.
        let cpu = with(Role::Prefill, VllmCpuVec, 32);
        assert_eq!(pairable(&cpu, &with(Role::Decode, VllmCpuVec, 32)), Ok(()));
        assert_eq!(pairable(&cpu, &with(Role::Decode, VllmCpuVec, 64)), Ok(()));
        let amx = with(Role::Prefill, VllmCpuAmx, 32);
        assert_eq!(
            pairable(&amx, &with(Role::Decode, VllmCpuAmx, 64)).unwrap_err(),
            "KV pages cannot move between them: vllm_cpu_amx pages move whole: page_size must \
             match (source 32, destination 64)"
        );
        for other in [VllmCpuAmx, TokenMajor] {
            let why = pairable(&cpu, &with(Role::Decode, other, 32)).unwrap_err();
            assert!(
                why.contains("cannot exchange KV") && why.contains(other.name()),
                "{why}"
            );
        }
        // An agent that registered no order pairs as before.
        assert_eq!(pairable(&cpu, &rank(Role::Decode, 64, (9, 9))), Ok(()));
    }

    #[test]
    fn what_an_older_agent_left_unsaid_keeps_nobody_apart() {
        let p = rank(Role::Prefill, 64, (9, 9));
        let mut old = rank(Role::Decode, 64, (1, 1));
        old.about = About::default();
        assert_eq!(pairable(&p, &old), Ok(()));
    }

    #[test]
    fn an_instance_that_pairs_with_nobody_is_told_why() {
        let d = rank(Role::Decode, 32, (9, 9));
        let prefills = [
            rank(Role::Prefill, 64, (9, 9)),
            rank(Role::Prefill, 64, (9, 9)),
        ];
        let why = unmatched(&d, &prefills).expect("unmatched");
        assert_eq!(
            why,
            "this decode can exchange KV with none of the 2 prefill ranks registered: KV \
             head_dim differs: prefill 64, decode 32"
        );
        let good = rank(Role::Prefill, 32, (9, 9));
        assert_eq!(unmatched(&d, prefills.iter().chain([&good])), None);
        assert_eq!(
            unmatched(&d, [&rank(Role::Decode, 64, (9, 9))]),
            None,
            "no prefill yet"
        );
    }
}
