//! Layout arithmetic against hand-computed shapes.

use super::*;

#[test]
fn presets_have_the_published_shapes() {
    let l8 = ModelSpec::preset("llama3-8b").unwrap();
    assert_eq!((l8.num_layers, l8.num_kv_heads, l8.head_dim), (32, 8, 128));
    let l70 = ModelSpec::preset("llama3-70b").unwrap();
    assert_eq!(
        (l70.num_layers, l70.num_kv_heads, l70.head_dim),
        (80, 8, 128)
    );
    let q = ModelSpec::preset("qwen2.5-7b").unwrap();
    assert_eq!((q.num_layers, q.num_kv_heads, q.head_dim), (28, 4, 128));
    let ds = ModelSpec::preset("deepseek-v3").unwrap();
    assert_eq!(ds.kind, AttentionKind::Mla);
    assert_eq!((ds.num_layers, ds.num_kv_heads, ds.head_dim), (61, 1, 576));
    for (name, spec) in PRESETS {
        spec.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let err = ModelSpec::preset("gpt-9").unwrap_err();
    assert!(err.to_string().contains("llama3-8b"), "{err}");
}

#[test]
fn llama3_8b_byte_counts() {
    let l = KvLayout::new(ModelSpec::preset("llama3-8b").unwrap(), 16).unwrap();
    assert_eq!(l.head_bytes(), 256);
    assert_eq!(l.block_bytes().unwrap(), 16 * 8 * 256); // 32 KiB per page per K or V
    // 128 KiB of KV per token: 32 layers x 2 x 8 heads x 256 bytes.
    assert_eq!(l.room_bytes(1).unwrap(), 131_072);
    assert_eq!(l.room_bytes(4096).unwrap(), 512 << 20);
    assert_eq!(l.pages_for(4096), 256);
    assert_eq!(l.pages_for(4097), 257);
    assert_eq!(l.pool_bytes(10).unwrap(), 10 * 32 * 2 * 32768);
}

/// A page count no pool can have (a peer's exposed size) is refused, never wrapped.
#[test]
fn offsets_into_an_impossible_pool_are_refused() {
    let l = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 4).unwrap();
    let huge = usize::MAX / l.page_span().unwrap() + 1;
    assert!(l.pool_bytes(huge).is_err());
    let per_layer_page = l.block_bytes().unwrap() * l.planes();
    let beyond = usize::MAX / per_layer_page + 1;
    let last = (l.num_layers() - 1, l.planes() - 1);
    assert!(matches!(
        l.plane_offset(last.0, last.1, beyond),
        Err(LayoutError::Overflow { .. })
    ));
    let pages = 5;
    let end = l.plane_offset(last.0, last.1, pages).unwrap();
    assert!(end < l.pool_bytes(pages).unwrap());
}

/// The worked example of docs/engines.md ("The byte layout of an `shm:` pool").
#[test]
fn shm_pool_worked_example_of_the_operations_guide() {
    let l = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16)
        .unwrap()
        .with_order(PageOrder::TokenMajor, KvPlacement::Planes)
        .unwrap();
    assert_eq!(l.block_bytes().unwrap(), 4096);
    assert_eq!(l.pool_bytes(64).unwrap(), 2_097_152);
    assert_eq!(l.pool_bytes(65).unwrap(), 2_129_920);
    let page5 = l.plane_offset(2, 1, 64).unwrap() + 5 * l.page_stride().unwrap();
    assert_eq!(page5, 1_331_200);
    assert_eq!(page5 + l.element_offset(3, 1), 1_332_032);
    let hnd = l
        .clone()
        .with_order(PageOrder::HeadMajor, KvPlacement::Planes)
        .unwrap();
    assert_eq!(hnd.element_offset(3, 1), (16 + 3) * 32 * 2);
}

#[test]
fn plane_offsets_tile_the_pool_exactly() {
    let model = ModelSpec::preset("tiny").unwrap();
    for placement in [KvPlacement::Planes, KvPlacement::Interleaved] {
        let l = KvLayout::new(model, 4)
            .unwrap()
            .with_order(PageOrder::TokenMajor, placement)
            .unwrap();
        let pages = 5;
        let block = l.block_bytes().unwrap();
        let stride = l.page_stride().unwrap();
        let mut seen = vec![false; l.pool_bytes(pages).unwrap() / block];
        for layer in 0..l.num_layers() {
            for plane in 0..l.planes() {
                for p in 0..pages {
                    let off = l.plane_offset(layer, plane, pages).unwrap() + p * stride;
                    assert_eq!(off % block, 0);
                    assert!(
                        !std::mem::replace(&mut seen[off / block], true),
                        "{placement:?}"
                    );
                }
            }
        }
        assert!(seen.iter().all(|s| *s), "{placement:?} leaves holes");
    }
}

#[test]
fn bad_layouts_are_refused_with_the_field() {
    let model = ModelSpec::preset("tiny").unwrap();
    let e = KvLayout::new(model, 0).unwrap_err();
    assert!(e.to_string().contains("page_size"), "{e}");
    let e = KvLayout::new(model, 16)
        .unwrap()
        .with_slice(2..5, 0..4)
        .unwrap_err();
    assert!(e.to_string().contains("heads 2..5"), "{e}");
    let e = KvLayout::new(model, 16)
        .unwrap()
        .with_slice(0..4, 3..3)
        .unwrap_err();
    assert!(e.to_string().contains("layers"), "{e}");
    let mla = ModelSpec {
        num_kv_heads: 2,
        ..ModelSpec::preset("deepseek-v3").unwrap()
    };
    assert!(mla.validate().unwrap_err().to_string().contains("MLA"));
    let huge = ModelSpec::mha(usize::MAX / 2, 8, 128, Dtype::Fp32);
    assert!(matches!(
        KvLayout::new(huge, 16),
        Err(LayoutError::Overflow { .. })
    ));
    let l = KvLayout::new(model, 16).unwrap();
    assert!(matches!(
        l.pool_bytes(usize::MAX),
        Err(LayoutError::Overflow { .. })
    ));
}

#[test]
fn rank_slices_split_heads_and_layers() {
    let l8 = KvLayout::new(ModelSpec::preset("llama3-8b").unwrap(), 16).unwrap();
    let r = l8.clone().for_rank(1, 4, 0, 1).unwrap();
    assert_eq!((r.heads.clone(), r.layers.clone()), (2..4, 0..32));
    // 8 heads over TP 16: each rank holds one replicated head.
    let r = l8.clone().for_rank(15, 16, 0, 1).unwrap();
    assert_eq!(r.heads, 7..8);
    assert!(
        l8.clone()
            .for_rank(0, 3, 0, 1)
            .unwrap_err()
            .to_string()
            .contains("divide")
    );
    assert!(l8.clone().for_rank(4, 4, 0, 1).is_err());
    let ds = KvLayout::new(ModelSpec::preset("deepseek-v3").unwrap(), 64).unwrap();
    let s0 = ds.clone().for_rank(3, 8, 0, 2).unwrap();
    let s1 = ds.for_rank(3, 8, 1, 2).unwrap();
    assert_eq!(
        (s0.heads.clone(), s0.layers.clone(), s1.layers.clone()),
        (0..1, 0..31, 31..61)
    );
}

#[test]
fn names_round_trip() {
    for d in Dtype::ALL {
        assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
    }
    assert_eq!(
        "head_major".parse::<PageOrder>().unwrap(),
        PageOrder::HeadMajor
    );
    assert_eq!("mla".parse::<AttentionKind>().unwrap(), AttentionKind::Mla);
    assert_eq!(
        "interleaved".parse::<KvPlacement>().unwrap(),
        KvPlacement::Interleaved
    );
    assert!(
        "fp64"
            .parse::<Dtype>()
            .unwrap_err()
            .to_string()
            .contains("bf16")
    );
}

#[test]
fn formats_refuse_other_attention_kinds_and_unknown_names() {
    let mla = KvLayout::new(ModelSpec::preset("tiny-mla").unwrap(), 16).unwrap();
    let e = mla
        .with_format(&KvFormat::named("vllm-cpu-vec").unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("vllm-cpu-vec holds mha KV"), "{e}");
    let e = KvFormat::named("vllm-tpu").unwrap_err();
    assert!(e.to_string().contains("sglang-mha"), "{e}");
}

#[test]
fn token_granular_formats_pair_and_head_granular_ones_only_with_themselves() {
    let model = ModelSpec::preset("tiny").unwrap();
    let with = |name: &str, page_size| {
        KvLayout::new(model, page_size)
            .unwrap()
            .with_format(&KvFormat::named(name).unwrap())
            .unwrap()
    };
    let (nhd, hnd, cpu) = (
        with("vllm-flash-nhd", 16),
        with("vllm-flash-hnd", 16),
        with("vllm-cpu-vec", 16),
    );
    assert_eq!(wire_order(&nhd, &hnd), Ok(PageOrder::HeadMajor));
    assert_eq!(wire_order(&hnd, &nhd), Ok(PageOrder::TokenMajor));
    assert_eq!(wire_order(&cpu, &cpu), Ok(PageOrder::VllmCpuVec));
    let e = wire_order(&cpu, &nhd).unwrap_err();
    assert!(
        e.contains("vllm_cpu_vec") && e.contains("token_major"),
        "{e}"
    );
    // vec pages of other sizes are re-blocked; a span is no pool's order.
    assert_eq!(
        wire_order(&cpu, &with("vllm-cpu-vec", 32)),
        Ok(PageOrder::VllmCpuVecSpan)
    );
    assert!(
        cpu.clone()
            .with_order(PageOrder::VllmCpuVecSpan, KvPlacement::Interleaved)
            .is_err()
    );
    // Token-granular pools of different page sizes meet in token rows.
    assert_eq!(
        wire_order(&hnd, &with("vllm-flash-hnd", 32)),
        Ok(PageOrder::TokenMajor)
    );
    // A piece of a head-granular pool stages whole pages.
    assert_eq!(cpu.staged_tokens(&(16..40), cpu.order), 32);
    assert_eq!(cpu.staged_tokens(&(16..40), PageOrder::VllmCpuVecSpan), 24);
    assert_eq!(nhd.staged_tokens(&(16..40), nhd.order), 24);
}
