//! How a rank describes itself: its registration in the registry and its layout in Hello
//! (and back), and whether two ranks' layouts can be paired.

use std::collections::BTreeMap;
use std::ops::Range;

use kvferry_bootstrap as registry;
use uuid::Uuid;

use crate::layout::{KvLayout, PageOrder};
use crate::protocol::WireLayout;
use crate::reason::{FailureCode, Reason};

use super::AgentConfig;

/// This rank as announced in Hello.
pub(crate) fn wire_layout(layout: &KvLayout) -> WireLayout {
    WireLayout {
        kind: layout.model.kind,
        dtype: layout.model.dtype,
        order: layout.order,
        num_layers: layout.model.num_layers as u32,
        num_kv_heads: layout.model.num_kv_heads as u32,
        head_dim: layout.model.head_dim as u32,
        page_size: layout.page_size as u32,
        heads: layout.heads.start as u32..layout.heads.end as u32,
        layers: layout.layers.start as u32..layout.layers.end as u32,
    }
}

/// The pool layout a peer's Hello describes: the inverse of [`wire_layout`], for a pool of
/// planes (the wire layout has no placement; the decode exposes only such pools).
pub(crate) fn layout_of(w: &WireLayout) -> Result<KvLayout, crate::layout::LayoutError> {
    let model = crate::layout::ModelSpec {
        kind: w.kind,
        num_layers: w.num_layers as usize,
        num_kv_heads: w.num_kv_heads as usize,
        head_dim: w.head_dim as usize,
        dtype: w.dtype,
    };
    let range = |r: &Range<u32>| r.start as usize..r.end as usize;
    // The wire names no placement: a pool announced to peers has its planes apart, except
    // vLLM CPU pages, which hold a head's K and V side by side.
    let placement = match w.order {
        PageOrder::VllmCpuVec | PageOrder::VllmCpuAmx => crate::layout::KvPlacement::Interleaved,
        _ => crate::layout::KvPlacement::Planes,
    };
    KvLayout::new(model, w.page_size as usize)?
        .with_order(w.order, placement)?
        .with_slice(range(&w.heads), range(&w.layers))
}

fn range(r: &Range<usize>) -> registry::IndexRange {
    registry::IndexRange {
        start: r.start as u32,
        end: r.end as u32,
    }
}

/// This rank's registration.
pub(crate) fn registration(
    role: registry::Role,
    instance: Uuid,
    cfg: &AgentConfig,
    control_endpoint: String,
    data_endpoints: BTreeMap<String, String>,
) -> registry::Registration {
    let l = &cfg.layout;
    let r = cfg.ranks;
    registry::Registration {
        instance_id: instance,
        role,
        dp_rank: r.dp_rank,
        dp_size: r.dp_size,
        tp_rank: r.tp_rank,
        tp_size: r.tp_size,
        pp_rank: r.pp_rank,
        pp_size: r.pp_size,
        layout: registry::KvLayout {
            kind: l.model.kind,
            num_layers: l.model.num_layers as u32,
            num_kv_heads: l.model.num_kv_heads as u32,
            head_dim: l.model.head_dim as u32,
            dtype: l.model.dtype,
            page_size: l.page_size as u32,
            order: Some(l.order),
        },
        slice: registry::Slice {
            heads: range(&l.heads),
            layers: range(&l.layers),
        },
        control_endpoint,
        data_endpoints,
        about: registry::About {
            protocol: Some(registry::Versions {
                min: crate::protocol::MIN_VERSION,
                max: crate::protocol::VERSION,
            }),
            kvferry_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
            ..cfg.about.clone()
        },
    }
}

/// Refuses a peer whose layout cannot be paired with ours at the negotiated protocol
/// `version`, naming the field and both values.
pub(crate) fn check_compatible(
    ours: &WireLayout,
    theirs: &WireLayout,
    version: u16,
) -> Result<(), Reason> {
    let fields: [(&str, String, String); 5] = [
        ("kind", ours.kind.to_string(), theirs.kind.to_string()),
        ("dtype", ours.dtype.to_string(), theirs.dtype.to_string()),
        (
            "head_dim",
            ours.head_dim.to_string(),
            theirs.head_dim.to_string(),
        ),
        (
            "num_layers",
            ours.num_layers.to_string(),
            theirs.num_layers.to_string(),
        ),
        (
            "num_kv_heads",
            ours.num_kv_heads.to_string(),
            theirs.num_kv_heads.to_string(),
        ),
    ];
    for (field, a, b) in fields {
        if a != b {
            return Err(Reason::new(
                FailureCode::IncompatibleLayout,
                format!("{field} differs: ours {a}, peer's {b}"),
            ));
        }
    }
    let incompatible = |m: String| Reason::new(FailureCode::IncompatibleLayout, m);
    let (a, b) = (
        layout_of(ours).map_err(|e| incompatible(e.to_string()))?,
        layout_of(theirs).map_err(|e| incompatible(e.to_string()))?,
    );
    let wire = crate::layout::wire_order(&a, &b).map_err(|why| {
        incompatible(format!(
            "ours {} against the peer's {}: {why}",
            a.order, b.order
        ))
    })?;
    if wire == PageOrder::VllmCpuVecSpan && version < crate::protocol::VEC_SPAN {
        return Err(incompatible(format!(
            "{} pages of {} and {} tokens are re-blocked from protocol version {} on; this pair speaks {version}",
            a.order,
            a.page_size,
            b.page_size,
            crate::protocol::VEC_SPAN
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_layout_reads_back_as_the_pool_layout_it_describes() {
        use crate::layout::{KvPlacement, ModelSpec, PageOrder};
        for (model, order, tp_rank, tp, pp_rank, pp) in [
            ("llama3-8b", PageOrder::TokenMajor, 1, 2, 0, 1),
            ("qwen2.5-7b", PageOrder::HeadMajor, 0, 4, 1, 2),
            ("deepseek-v3", PageOrder::TokenMajor, 3, 4, 0, 1),
        ] {
            let l = KvLayout::new(ModelSpec::preset(model).unwrap(), 16)
                .unwrap()
                .with_order(order, KvPlacement::Planes)
                .unwrap()
                .for_rank(tp_rank, tp, pp_rank, pp)
                .unwrap();
            assert_eq!(layout_of(&wire_layout(&l)).unwrap(), l, "{model}");
        }
    }

    #[test]
    fn incompatible_layouts_name_the_field_and_both_values() {
        const V: u16 = crate::protocol::VERSION;
        let l = crate::layout::KvLayout::new(crate::layout::ModelSpec::preset("tiny").unwrap(), 16)
            .unwrap();
        let ours = wire_layout(&l);
        let theirs = WireLayout {
            head_dim: 64,
            ..ours.clone()
        };
        let r = check_compatible(&ours, &theirs, V).unwrap_err();
        assert_eq!(r.code, FailureCode::IncompatibleLayout);
        assert_eq!(r.message, "head_dim differs: ours 32, peer's 64");
        assert!(check_compatible(&ours, &ours, V).is_ok());
        // Token-granular pools of other page sizes pair; pages that move whole do not.
        let p32 = WireLayout {
            page_size: 32,
            ..ours.clone()
        };
        assert!(check_compatible(&ours, &p32, V).is_ok());
        let cpu = |page_size| WireLayout {
            order: PageOrder::VllmCpuVec,
            page_size,
            ..ours.clone()
        };
        // vLLM CPU vec pages of other sizes are re-blocked; amx pages move only whole.
        assert!(check_compatible(&cpu(16), &cpu(32), V).is_ok());
        let r = check_compatible(&cpu(16), &cpu(32), crate::protocol::VEC_SPAN - 1).unwrap_err();
        assert!(
            r.message.contains("re-blocked from protocol version"),
            "{}",
            r.message
        );
        let amx = |page_size| WireLayout {
            order: PageOrder::VllmCpuAmx,
            ..cpu(page_size)
        };
        let r = check_compatible(&amx(16), &amx(32), V).unwrap_err();
        assert!(
            r.message
                .contains("page_size must match (source 16, destination 32)"),
            "{}",
            r.message
        );
        let r = check_compatible(&cpu(16), &ours, V).unwrap_err();
        assert!(
            r.message.contains("vllm_cpu_vec") && r.message.contains("token_major"),
            "{}",
            r.message
        );
    }
}
