//! From a selection to one launch of `kv_gather` or `kv_scatter`: the kernel's parameters and
//! its geometry, in plain Rust (no CUDA), so that the host emulation test drives the CUDA source
//! with exactly what a GPU launch would get.
//!
//! Geometry: one CUDA block per *segment* (the selected tokens and heads of one page of one
//! plane of one selected layer), `gridDim.x` = layers x planes x page blocks; the block's
//! threads copy the segment in 16-byte units where alignment allows. `blockDim.x` is sized to
//! the largest segment (32..256 threads, whole warps), and `gridDim.y` splits a segment larger
//! than [`UNITS_PER_THREAD`] units per thread across several blocks. Why: 256 threads of 32
//! registers let 8 blocks stay resident per SM, enough loads in flight to cover memory latency;
//! a tiny segment gets one warp, not eight idle ones; the split spreads huge pages over the SMs.
//!
//! Invariant: [`plan`] validates the selection against the layout (the checks the CPU kernel
//! runs, [`Selection::validate_in`]) and checks every quantity the kernel computes in 32 bits,
//! before anything is launched.
#![deny(unsafe_code)]

use crate::kernel::{KernelError, Selection};
use crate::layout::{KvLayout, LayoutError, PageOrder};

use super::CudaError;

/// Threads per block at most: 8 warps keep several blocks resident per SM.
pub const MAX_THREADS: u32 = 256;
/// 16-byte units one thread copies per segment before the segment is split across blocks.
pub const UNITS_PER_THREAD: u64 = 8;
/// Largest `gridDim.x` (2^31 - 1).
const MAX_GRID_X: u64 = (1 << 31) - 1;
/// Largest `gridDim.y`.
const MAX_GRID_Y: u64 = 65_535;

/// The kernel's by-value parameter; mirrors `struct KvXferParams` in `kernels/kv_transfer.cu`
/// field by field (same order, same C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvXferParams {
    /// Address of the pool's plane table (`u64` per (layer, plane)), see [`plane_table`].
    pub planes: u64,
    /// Address of the `u32` pool page of each page block ([`LaunchPlan::pages`]).
    pub pages: u64,
    /// Address of the staging buffer.
    pub staging: u64,
    /// Bytes between consecutive pages of one plane.
    pub page_stride: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// Heads the pool holds.
    pub pool_heads: u32,
    /// Bytes of one head of one token.
    pub head_bytes: u32,
    /// Bytes from one head of a token to the next in a page (`KvLayout::cell_bytes`).
    pub cell_bytes: u32,
    /// Planes per layer.
    pub num_planes: u32,
    /// First selected local layer.
    pub layer0: u32,
    /// First selected local head.
    pub head0: u32,
    /// Selected heads.
    pub heads: u32,
    /// Page blocks per plane.
    pub page_blocks: u32,
    /// First selected token, counted from the start of the first page block's page.
    pub first_token: u32,
    /// End of the selected tokens, same origin.
    pub end_token: u32,
    /// Pool page order: 0 token-major, 1 head-major.
    pub pool_order: u32,
    /// Staging block order: 0 token-major, 1 head-major.
    pub wire_order: u32,
}

/// One launch: geometry, parameters (addresses still zero), and the page indices to upload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchPlan<'a> {
    /// `(gridDim.x, gridDim.y)`.
    pub grid: (u32, u32),
    /// `blockDim.x`.
    pub block: u32,
    /// Parameters; the caller fills `planes`, `pages` and `staging` with addresses.
    pub params: KvXferParams,
    /// Pool page of each page block, to be placed at `params.pages`.
    pub pages: &'a [u32],
}

/// The plane table of a pool of `num_pages` pages whose regions (one per
/// [`KvLayout::num_regions`], in the layout's region order) start at the addresses `regions`:
/// the address of page 0 of every (local layer, plane), layer-major. Uploaded once per pool.
pub fn plane_table(
    layout: &KvLayout,
    num_pages: usize,
    regions: &[u64],
) -> Result<Vec<u64>, LayoutError> {
    (0..layout.num_layers())
        .flat_map(|layer| {
            (0..layout.planes()).map(move |plane| {
                let (region, offset) = layout.plane_location(layer, plane, num_pages)?;
                let base = regions.get(region).ok_or_else(|| LayoutError::Invalid {
                    field: "regions",
                    reason: format!("{} given, region {region} needed", regions.len()),
                })?;
                Ok(base.wrapping_add(offset as u64))
            })
        })
        .collect()
}

/// The region addresses of a one-buffer pool at `base`: its regions back to back, which holds
/// the same bytes as one region (see [`KvLayout::plane_location`]).
pub fn one_buffer(layout: &KvLayout, num_pages: usize, base: u64) -> Result<Vec<u64>, LayoutError> {
    let each = layout.region_bytes(num_pages)? as u64;
    Ok((0..layout.num_regions() as u64)
        .map(|i| base + i * each)
        .collect())
}

/// The kernel's code for a page order; the CUDA kernel moves token-granular orders only (the
/// head-granular one is vLLM's CPU format, in host memory).
pub(super) fn order_code(order: PageOrder) -> Result<u32, LayoutError> {
    match order {
        PageOrder::TokenMajor => Ok(0),
        PageOrder::HeadMajor => Ok(1),
        PageOrder::VllmCpuVec | PageOrder::VllmCpuAmx | PageOrder::VllmCpuVecSpan => {
            Err(LayoutError::Invalid {
                field: "page order",
                reason: format!(
                    "{} is a host-memory format; the CUDA kernel does not move it",
                    order.name()
                ),
            })
        }
    }
}

fn fit(what: &'static str, value: u64, limit: u64) -> Result<u32, CudaError> {
    if value > limit || value > u64::from(u32::MAX) {
        return Err(CudaError::TooLarge { what, value, limit });
    }
    Ok(value as u32)
}

/// Plans the launch moving `sel` of a pool (`layout`, `num_pages`) to or from a staging buffer
/// of `staging_len` bytes in `wire` order. `destination` (scatter) refuses duplicate pages.
/// `Ok(None)` when the selection is empty: nothing to launch.
pub fn plan<'a>(
    layout: &KvLayout,
    num_pages: usize,
    sel: &Selection<'a>,
    wire: PageOrder,
    staging_len: usize,
    destination: bool,
) -> Result<Option<LaunchPlan<'a>>, KernelError> {
    sel.validate_in(layout, num_pages, wire, staging_len, destination)?;
    if staging_len == 0 {
        return Ok(None);
    }
    let u32_max = u64::from(u32::MAX);
    let page_size = layout.page_size;
    // Everything inside one block is indexed in 32 bits; below 2^31 a thread's unit index plus
    // its stride (at most 65535 x 256) cannot wrap either.
    // A block's cells span every plane's heads where the planes share cells.
    let cells =
        layout.block_bytes()? as u64 / layout.head_bytes() as u64 * layout.cell_bytes() as u64;
    fit("block bytes", cells, (1 << 31) - 1)?;
    let first_page = sel.tokens.start / page_size;
    let end_page = layout.pages_for(sel.tokens.end);
    let origin = first_page * page_size;
    let end_token = (sel.tokens.end - origin) as u64;
    // The kernel computes `page start + page_size` for the last page block.
    fit(
        "end token + page size",
        end_token + page_size as u64,
        u32_max,
    )?;
    let page_blocks = (end_page - first_page) as u64;
    let planes = layout.planes() as u64;
    let segments = sel.layers.len() as u64 * planes * page_blocks;
    let grid_x = fit(
        "segments (layers x planes x page blocks)",
        segments,
        MAX_GRID_X,
    )?;

    let max_tokens = sel.tokens.len().min(page_size) as u64;
    let max_segment = max_tokens * sel.heads.len() as u64 * layout.head_bytes() as u64;
    let units = max_segment.div_ceil(16);
    let block = units.next_multiple_of(32).clamp(32, u64::from(MAX_THREADS));
    let splits = units
        .div_ceil(block * UNITS_PER_THREAD)
        .clamp(1, MAX_GRID_Y);

    let params = KvXferParams {
        planes: 0,
        pages: 0,
        staging: 0,
        page_stride: layout.page_stride()? as u64,
        page_size: page_size as u32,
        pool_heads: layout.num_heads() as u32,
        head_bytes: layout.head_bytes() as u32,
        cell_bytes: layout.cell_bytes() as u32,
        num_planes: planes as u32,
        layer0: sel.layers.start as u32,
        head0: sel.heads.start as u32,
        heads: sel.heads.len() as u32,
        page_blocks: page_blocks as u32,
        first_token: (sel.tokens.start - origin) as u32,
        end_token: end_token as u32,
        pool_order: order_code(layout.order)?,
        wire_order: order_code(wire)?,
    };
    Ok(Some(LaunchPlan {
        grid: (grid_x, splits as u32),
        block: block as u32,
        params,
        pages: &sel.pages[first_page..end_page],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvPlacement, ModelSpec};

    fn llama(page_size: usize) -> KvLayout {
        KvLayout::new(ModelSpec::preset("llama3-8b").unwrap(), page_size).unwrap()
    }

    #[test]
    fn llama3_8b_room_is_one_block_per_page_of_every_plane() {
        let l = llama(16);
        let pages: Vec<u32> = (0..256).collect();
        let sel = Selection {
            pages: &pages,
            tokens: 0..4096,
            layers: 0..32,
            heads: 0..8,
        };
        let bytes = l.room_bytes(4096).unwrap();
        let p = plan(&l, 256, &sel, PageOrder::TokenMajor, bytes, true)
            .unwrap()
            .unwrap();
        // 32 KiB segments: 2048 units over 256 threads, 8 each, no split.
        assert_eq!(p.grid, (32 * 2 * 256, 1));
        assert_eq!(p.block, 256);
        assert_eq!(p.pages.len(), 256);
        assert_eq!((p.params.first_token, p.params.end_token), (0, 4096));
    }

    #[test]
    fn token_ranges_start_at_their_first_page_and_small_segments_get_small_blocks() {
        let l = llama(16);
        let pages = [7u32, 3, 9, 4];
        let sel = Selection {
            pages: &pages,
            tokens: 20..40,
            layers: 1..3,
            heads: 2..3,
        };
        let bytes = sel.bytes_in(&l, PageOrder::TokenMajor).unwrap();
        let p = plan(&l, 10, &sel, PageOrder::HeadMajor, bytes, false)
            .unwrap()
            .unwrap();
        assert_eq!(p.pages, &[3, 9]);
        assert_eq!((p.params.first_token, p.params.end_token), (4, 24));
        assert_eq!(p.grid, (2 * 2 * 2, 1));
        // 16 tokens x 256 bytes = 256 units: 256 threads; one head of one token: 32 threads.
        assert_eq!(p.block, 256);
        let one = Selection {
            tokens: 0..1,
            ..sel.clone()
        };
        let bytes = one.bytes_in(&l, PageOrder::TokenMajor).unwrap();
        assert_eq!(
            plan(&l, 10, &one, PageOrder::HeadMajor, bytes, false)
                .unwrap()
                .unwrap()
                .block,
            32
        );
    }

    #[test]
    fn huge_pages_are_split_across_blocks_and_empty_selections_launch_nothing() {
        let l = llama(1024);
        let sel = Selection {
            pages: &[0],
            tokens: 0..1024,
            layers: 0..1,
            heads: 0..8,
        };
        let bytes = sel.bytes_in(&l, PageOrder::TokenMajor).unwrap();
        let p = plan(&l, 1, &sel, PageOrder::TokenMajor, bytes, false)
            .unwrap()
            .unwrap();
        // 2 MiB per segment = 131072 units = 64 blocks of 256 threads x 8 units.
        assert_eq!(p.grid, (2, 64));
        let empty = Selection {
            tokens: 5..5,
            ..sel
        };
        assert_eq!(
            plan(&l, 1, &empty, PageOrder::TokenMajor, 0, false),
            Ok(None)
        );
    }

    #[test]
    fn selections_are_validated_and_32_bit_limits_enforced() {
        let l = llama(16);
        let sel = Selection {
            pages: &[5],
            tokens: 0..16,
            layers: 0..32,
            heads: 0..8,
        };
        let err = plan(&l, 4, &sel, PageOrder::TokenMajor, 0, false).unwrap_err();
        assert_eq!(
            err,
            KernelError::PageOutOfRange {
                page: 5,
                num_pages: 4
            }
        );
        // A block of 2^22 tokens x 8 heads x 256 bytes is 8 GiB: more than 32-bit indexing.
        let big = llama(1 << 22);
        let sel = Selection {
            pages: &[0],
            tokens: 0..1,
            layers: 0..1,
            heads: 0..1,
        };
        let bytes = sel.bytes_in(&big, PageOrder::TokenMajor).unwrap();
        let err = plan(&big, 1, &sel, PageOrder::TokenMajor, bytes, false).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::Cuda(CudaError::TooLarge {
                    what: "block bytes",
                    ..
                })
            ),
            "{err}"
        );
    }

    #[test]
    fn plane_table_matches_the_layout_offsets() {
        let l = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 4)
            .unwrap()
            .with_order(PageOrder::HeadMajor, KvPlacement::Interleaved)
            .unwrap();
        let t = plane_table(&l, 3, &one_buffer(&l, 3, 1000).unwrap()).unwrap();
        assert_eq!(t.len(), 4 * 2);
        assert_eq!(t[5], 1000 + l.plane_offset(2, 1, 3).unwrap() as u64);
    }
}
