//! Test reference: where the engines' own tensor shapes put an element, by numpy-style strides
//! of the shapes their documentation gives (docs/architecture.md, docs/vllm.md), written
//! independently of the layout arithmetic so that the formats are checked against the engines'
//! shapes, not against themselves. Three granularities: the engine's tensors (regions) and their
//! sizes ([`engine_regions`]), the start of a head of a token ([`engine_offset`]), and each
//! element of a head ([`element_offsets`]).

/// Dimensions of one rank's pool.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub layers: usize,
    /// K/V planes per layer (1 for MLA).
    pub planes: usize,
    pub pages: usize,
    pub page_size: usize,
    pub heads: usize,
    /// Bytes of one head of one token.
    pub head_bytes: usize,
}

/// Byte offset of the row-major index `idx` in a tensor of shape `shape` with `unit`-byte
/// elements. A plain loop, not a zip: the tests call this for every element they place, in
/// unoptimised builds, where iterator adapters cost many times the arithmetic.
fn at(shape: &[usize], idx: &[usize], unit: usize) -> usize {
    assert_eq!(shape.len(), idx.len());
    let mut offset = 0;
    let mut k = 0;
    while k < shape.len() {
        assert!(idx[k] < shape[k], "index {idx:?} outside {shape:?}");
        offset = offset * shape[k] + idx[k];
        k += 1;
    }
    offset * unit
}

/// `(regions, bytes of each)`: the engine tensors that hold the KV of a pool of `d` in `format`,
/// in the format's order (the order of `engine_offset`'s region index), all the same size.
pub fn engine_regions(format: &str, d: Dims) -> (usize, usize) {
    let page = d.page_size * d.heads * d.head_bytes;
    match format {
        "kvferry" | "kvferry-head-major" | "vllm-cpu-vec" | "vllm-cpu-amx" => {
            (1, d.layers * d.planes * d.pages * page)
        }
        "vllm-nhd" | "vllm-hnd" | "vllm-flash-nhd" | "vllm-flash-hnd" | "flashinfer" => {
            (d.layers, 2 * d.pages * page)
        }
        "sglang-mha" => (d.layers * 2, d.pages * page),
        "sglang-mla" | "vllm-mla" => (d.layers, d.pages * page),
        other => panic!("no reference for format {other}"),
    }
}

/// `(region, byte offset in it)` of head `h` of token slot `t` of page `page` of plane `p` of
/// layer `l`, in the engine tensor the format names. For `vllm-cpu-*`, a (block, head) holds its
/// tokens interleaved (but for vec's V half, `[block_size][head_size]`): `t = 0` names the start
/// of the head's K or V half (use [`element_offsets`] for its elements).
pub fn engine_offset(
    format: &str,
    d: Dims,
    (l, p, page, t, h): (usize, usize, usize, usize, usize),
) -> (usize, usize) {
    let (n, bs, hh, hb) = (d.pages, d.page_size, d.heads, d.head_bytes);
    match format {
        // One buffer [layer][plane][page][token][head][dim].
        "kvferry" => (
            0,
            at(&[d.layers, d.planes, n, bs, hh], &[l, p, page, t, h], hb),
        ),
        // One buffer [layer][plane][page][head][token][dim].
        "kvferry-head-major" => (
            0,
            at(&[d.layers, d.planes, n, hh, bs], &[l, p, page, h, t], hb),
        ),
        // One buffer, layer after layer; per layer [blocks, kv_heads, block_size, 2 x head]
        // viewed as [blocks][heads][K^T: head_size x block_size | V: block_size x head_size].
        "vllm-cpu-vec" | "vllm-cpu-amx" => {
            // Only vec's V half keeps whole token rows.
            assert!(
                t == 0 || (format == "vllm-cpu-vec" && p == 1),
                "{format}: slot {t} of plane {p} is no row of its own"
            );
            let head_block = at(&[d.layers, n, hh], &[l, page, h], 2 * bs * hb);
            match p {
                0 => (0, head_block + t * hb),
                _ => (0, head_block + bs * hb + t * hb),
            }
        }
        // Per layer [blocks, block_size, kv_heads, 2 x head_size]: K then V in each cell.
        "vllm-nhd" => (l, at(&[n, bs, hh, 2], &[page, t, h, p], hb)),
        // Per layer [blocks, kv_heads, block_size, 2 x head_size].
        "vllm-hnd" => (l, at(&[n, hh, bs, 2], &[page, h, t, p], hb)),
        // Per layer [2, blocks, block_size, kv_heads, head_size].
        "vllm-flash-nhd" => (l, at(&[2, n, bs, hh], &[p, page, t, h], hb)),
        // Per layer [2, blocks, kv_heads, block_size, head_size].
        "vllm-flash-hnd" => (l, at(&[2, n, hh, bs], &[p, page, h, t], hb)),
        // Per layer [blocks, 2, block_size, kv_heads, head_size].
        "flashinfer" => (l, at(&[n, 2, bs, hh], &[page, p, t, h], hb)),
        // Per layer a K and a V buffer [slots, kv_heads, head_dim]; slot = page x page_size + t.
        "sglang-mha" => (l * 2 + p, at(&[n * bs, hh], &[page * bs + t, h], hb)),
        // Per layer one buffer [slots, 1, latent] (SGLang), [blocks, block_size, latent] (vLLM).
        "sglang-mla" => (l, at(&[n * bs, 1], &[page * bs + t, h], hb)),
        "vllm-mla" => (l, at(&[n, bs], &[page, t], hb)),
        other => panic!("no reference for format {other}"),
    }
}

/// `(region, byte offset in it of each element of the head)`: element `i` of head `h` of token
/// slot `t` of page `page` of plane `p` of layer `l`, for `i` in `0..head_bytes / elem_bytes`.
/// vLLM CPU orders each half of a (block, head) by its ISA (docs/vllm.md; B = block size,
/// D = head size, element (slot s, dim i)): `vec` keeps K transposed, `[D][B]`, and V `[B][D]`;
/// `amx` keeps K `[B/16][D/2][16][2]` and V `[D/16][B/2][16][2]`. Every other format keeps a
/// head's elements in order from the head's start. (One call gives a whole head: the tests place
/// every element of every head, in unoptimised builds.)
pub fn element_offsets(
    format: &str,
    d: Dims,
    elem_bytes: usize,
    (l, p, page, t, h): (usize, usize, usize, usize, usize),
) -> (usize, Vec<usize>) {
    assert_eq!(
        d.head_bytes % elem_bytes,
        0,
        "{d:?}: heads of whole elements"
    );
    let (bs, hd, eb) = (d.page_size, d.head_bytes / elem_bytes, elem_bytes);
    assert!(t < bs, "slot {t} outside {d:?}");
    if format == "vllm-cpu-amx" {
        assert!(
            bs % 16 == 0 && hd % 16 == 0,
            "{d:?}: amx blocks of 16 slots and dims"
        );
    }
    let vllm_cpu = matches!(format, "vllm-cpu-vec" | "vllm-cpu-amx");
    // vLLM CPU: from the start of the head's K or V half; the others: from the head's start.
    let (region, start) = engine_offset(format, d, (l, p, page, if vllm_cpu { 0 } else { t }, h));
    let offsets = (0..hd).map(|i| {
        start
            + match (format, p) {
                ("vllm-cpu-vec", 0) => at(&[hd, bs], &[i, t], eb),
                ("vllm-cpu-vec", _) => at(&[bs, hd], &[t, i], eb),
                ("vllm-cpu-amx", 0) => at(
                    &[bs / 16, hd / 2, 16, 2],
                    &[t / 16, i / 2, t % 16, i % 2],
                    eb,
                ),
                ("vllm-cpu-amx", _) => at(
                    &[hd / 16, bs / 2, 16, 2],
                    &[i / 16, t / 2, i % 16, t % 2],
                    eb,
                ),
                _ => i * eb,
            }
    });
    (region, offsets.collect())
}

/// The regions of an engine whose KV lives in `buffers` (one per region, in the format's order),
/// for `HostPool::engine`.
pub fn regions(buffers: &mut [Vec<u8>]) -> Vec<kvferry::pool::EngineRegion> {
    buffers
        .iter_mut()
        .map(|b| kvferry::pool::EngineRegion {
            addr: b.as_mut_ptr() as usize,
            len: b.len(),
        })
        .collect()
}
