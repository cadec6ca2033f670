//! Test reference: where the engines' own tensor shapes put an element, by numpy-style strides
//! of the shapes their documentation gives, written independently of the layout arithmetic so
//! that the formats are checked against the engines' shapes, not against themselves.

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
/// elements.
fn at(shape: &[usize], idx: &[usize], unit: usize) -> usize {
    assert_eq!(shape.len(), idx.len());
    let mut offset = 0;
    for (&n, &i) in shape.iter().zip(idx) {
        assert!(i < n, "index {idx:?} outside {shape:?}");
        offset = offset * n + i;
    }
    offset * unit
}

/// `(region, byte offset in it)` of head `h` of token slot `t` of page `page` of plane `p` of
/// layer `l`, in the engine tensor the format names. For `vllm-cpu`, K is transposed inside
/// a (block, head): `t` then names the start of the head's K block (call with `t = 0`).
pub fn engine_offset(
    format: &str,
    d: Dims,
    (l, p, page, t, h): (usize, usize, usize, usize, usize),
) -> (usize, usize) {
    let (n, bs, hh, hb) = (d.pages, d.page_size, d.heads, d.head_bytes);
    match format {
        // One buffer [layer][plane][page][token][head][dim].
        "kvferry" => (0, at(&[d.layers, 2, n, bs, hh], &[l, p, page, t, h], hb)),
        // One buffer [layer][plane][page][head][token][dim].
        "kvferry-head-major" => (0, at(&[d.layers, 2, n, hh, bs], &[l, p, page, h, t], hb)),
        // One buffer, layer after layer; per layer [blocks, kv_heads, block_size, 2 x head]
        // viewed as [blocks][heads][K^T: head_size x block_size | V: block_size x head_size].
        "vllm-cpu-vec" | "vllm-cpu-amx" => {
            let head_block = at(&[d.layers, n, hh], &[l, page, h], 2 * bs * hb);
            match p {
                0 => (0, head_block + t * hb),
                _ => (0, head_block + bs * hb + t * hb),
            }
        }
        // Per layer [2, blocks, block_size, kv_heads, head_size].
        "vllm-flash-nhd" => (l, at(&[2, n, bs, hh], &[p, page, t, h], hb)),
        // Per layer [2, blocks, kv_heads, block_size, head_size].
        "vllm-flash-hnd" => (l, at(&[2, n, hh, bs], &[p, page, h, t], hb)),
        // Per layer [blocks, 2, block_size, kv_heads, head_size].
        "flashinfer" => (l, at(&[n, 2, bs, hh], &[page, p, t, h], hb)),
        // Per layer a K and a V buffer [slots, kv_heads, head_dim]; slot = page x page_size + t.
        "sglang-mha" => (l * 2 + p, at(&[n * bs, hh], &[page * bs + t, h], hb)),
        // Per layer one buffer [slots, 1, latent].
        "sglang-mla" => (l, at(&[n * bs, 1], &[page * bs + t, h], hb)),
        other => panic!("no reference for format {other}"),
    }
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
