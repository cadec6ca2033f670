//! Engine memory formats: how an engine lays its KV cache out, as kvferry reads and writes it in
//! place.
//!
//! A format is three choices on top of a [`super::KvLayout`]'s shape:
//! - the order of tokens and heads inside one page of one plane ([`PageOrder`]), which decides
//!   the granularity a transfer can cut a page at ([`Granularity`]);
//! - where the planes of a layer sit relative to each other ([`KvPlacement`]);
//! - how layers and planes are split over memory regions ([`RegionSplit`]): one buffer, one per
//!   layer, or one per plane. Regions are the engine's own allocations; within a region, page
//!   `p` of a plane starts at `offset + p x page_stride`.
//!
//! [`FORMATS`] names the formats of the engines kvferry serves. Which pairs of formats can move
//! KV between them, and in which wire order, is [`wire_order`]'s business (docs/architecture.md
//! has the table).

pub use kvferry_wire::kv::{Granularity, PageOrder};

use super::{AttentionKind, KvLayout, LayoutError, UnknownName, invalid};

/// Where the planes of a layer sit relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvPlacement {
    /// Each plane holds all pages contiguously: SGLang's separate per-layer K and V buffers, or
    /// vLLM's per-layer `[2, pages, ...]` tensor. Page stride = block bytes.
    Planes,
    /// K and V of one page adjacent: a per-layer `[pages, 2, ...]` tensor (FlashInfer before
    /// vLLM 0.32). Page stride = planes x block bytes.
    Interleaved,
    /// K and V of one head of one token side by side, a *cell* `[K head | V head]`: vLLM 0.32's
    /// CUDA caches, per layer `[blocks, block_size, kv_heads, 2 x head_size]` (NHD) or
    /// `[blocks, kv_heads, block_size, 2 x head_size]` (HND). Page stride = planes x block
    /// bytes; a plane's heads are one cell apart ([`super::KvLayout::cell_bytes`]).
    Cells,
}

impl KvPlacement {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            KvPlacement::Planes => "planes",
            KvPlacement::Interleaved => "interleaved",
            KvPlacement::Cells => "cells",
        }
    }
}

/// How the layers and planes of a pool are split over memory regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RegionSplit {
    /// One region, layer after layer (kvferry's own pools; vLLM CPU's one buffer).
    One,
    /// A region per layer (vLLM's per-layer tensors on CUDA).
    PerLayer,
    /// A region per plane of each layer (SGLang's per-layer K and V buffers).
    PerPlane,
}

/// A named engine format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvFormat {
    /// Its name on the command line and in the Python package.
    pub name: &'static str,
    /// What it is.
    pub about: &'static str,
    /// Order inside a page.
    pub order: PageOrder,
    /// Placement of a layer's planes.
    pub placement: KvPlacement,
    /// Regions.
    pub regions: RegionSplit,
    /// The attention kind it is limited to, if any.
    pub only: Option<AttentionKind>,
}

/// The formats kvferry knows.
pub const FORMATS: &[KvFormat] = &[
    KvFormat {
        name: "kvferry",
        about: "kvferry's own pools: one buffer, [layer][plane][page][token][head][dim]",
        order: PageOrder::TokenMajor,
        placement: KvPlacement::Planes,
        regions: RegionSplit::One,
        only: None,
    },
    KvFormat {
        name: "kvferry-head-major",
        about: "kvferry's own pools with [head][token] pages: [layer][plane][page][head][token][dim]",
        order: PageOrder::HeadMajor,
        placement: KvPlacement::Planes,
        regions: RegionSplit::One,
        only: None,
    },
    KvFormat {
        name: "vllm-cpu-vec",
        about: "vLLM CPU backend, vec path: one buffer, per layer [blocks][kv_heads][K^T head_size x block_size | V block_size x head_size]",
        order: PageOrder::VllmCpuVec,
        placement: KvPlacement::Interleaved,
        regions: RegionSplit::One,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "vllm-cpu-amx",
        about: "vLLM CPU backend, amx path: one buffer, per layer [blocks][kv_heads][K | V], each half in 16 x 2 tiles",
        order: PageOrder::VllmCpuAmx,
        placement: KvPlacement::Interleaved,
        regions: RegionSplit::One,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "vllm-nhd",
        about: "vLLM 0.32 on CUDA (flash-attention, FlashInfer), NHD (LBNHC): per layer [blocks][block_size][kv_heads][K head | V head]",
        order: PageOrder::TokenMajor,
        placement: KvPlacement::Cells,
        regions: RegionSplit::PerLayer,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "vllm-hnd",
        about: "vLLM 0.32 on CUDA (flash-attention, FlashInfer), HND (LBHNC): per layer [blocks][kv_heads][block_size][K head | V head]",
        order: PageOrder::HeadMajor,
        placement: KvPlacement::Cells,
        regions: RegionSplit::PerLayer,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "vllm-flash-nhd",
        about: "vLLM flash-attention NHD before 0.32: per layer [2][blocks][block_size][kv_heads][head_size]",
        order: PageOrder::TokenMajor,
        placement: KvPlacement::Planes,
        regions: RegionSplit::PerLayer,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "vllm-flash-hnd",
        about: "vLLM flash-attention HND before 0.32: per layer [2][blocks][kv_heads][block_size][head_size]",
        order: PageOrder::HeadMajor,
        placement: KvPlacement::Planes,
        regions: RegionSplit::PerLayer,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "flashinfer",
        about: "vLLM FlashInfer before 0.32: per layer [blocks][2][block_size][kv_heads][head_size]",
        order: PageOrder::TokenMajor,
        placement: KvPlacement::Interleaved,
        regions: RegionSplit::PerLayer,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "sglang-mha",
        about: "SGLang MHA: per layer a K and a V buffer [slots][kv_heads][head_dim]; a page is page_size slots",
        order: PageOrder::TokenMajor,
        placement: KvPlacement::Planes,
        regions: RegionSplit::PerPlane,
        only: Some(AttentionKind::Mha),
    },
    KvFormat {
        name: "sglang-mla",
        about: "SGLang MLA: per layer one buffer [slots][1][kv_lora_rank + qk_rope_head_dim]",
        order: PageOrder::TokenMajor,
        placement: KvPlacement::Planes,
        regions: RegionSplit::PerLayer,
        only: Some(AttentionKind::Mla),
    },
    KvFormat {
        name: "vllm-mla",
        about: "vLLM MLA (CPU_MLA on the CPU, the MLA backends on CUDA): per layer [blocks][block_size][kv_lora_rank + qk_rope_head_dim]",
        order: PageOrder::TokenMajor,
        placement: KvPlacement::Planes,
        regions: RegionSplit::PerLayer,
        only: Some(AttentionKind::Mla),
    },
];

impl KvFormat {
    /// Looks a format up by name.
    pub fn named(name: &str) -> Result<KvFormat, LayoutError> {
        FORMATS
            .iter()
            .find(|f| f.name == name)
            .copied()
            .ok_or_else(|| LayoutError::UnknownName(UnknownName {
                what: "KV format",
                name: name.to_owned(),
                expected: "kvferry, kvferry-head-major, vllm-cpu-vec, vllm-cpu-amx, vllm-nhd, vllm-hnd, vllm-flash-nhd, vllm-flash-hnd, flashinfer, sglang-mha, sglang-mla, vllm-mla",
            }))
    }
}

impl KvLayout {
    /// The same layout in `format`; refused when the format is for another attention kind.
    pub fn with_format(mut self, format: &KvFormat) -> Result<Self, LayoutError> {
        if let Some(kind) = format.only
            && kind != self.model.kind
        {
            return Err(invalid(
                "format",
                format!(
                    "{} holds {} KV, the model is {}",
                    format.name,
                    kind.name(),
                    self.model.kind.name()
                ),
            ));
        }
        self.order = format.order;
        self.placement = format.placement;
        self.regions = format.regions;
        self.validate()?;
        Ok(self)
    }

    /// Regions a pool of this layout spans.
    pub fn num_regions(&self) -> usize {
        match self.regions {
            RegionSplit::One => 1,
            RegionSplit::PerLayer => self.num_layers(),
            RegionSplit::PerPlane => self.num_layers() * self.planes(),
        }
    }

    /// Bytes each region needs for `num_pages` pages (all regions are the same size).
    pub fn region_bytes(&self, num_pages: usize) -> Result<usize, LayoutError> {
        let all = self.pool_bytes(num_pages)?;
        Ok(all / self.num_regions())
    }

    /// Region holding plane `plane` of local layer `layer`, and the offset of its page 0 there,
    /// in a pool of `num_pages` pages. Laid back to back, regions reproduce a one-buffer pool
    /// byte for byte: `region x region_bytes + offset` is [`KvLayout::plane_offset`].
    pub fn plane_location(
        &self,
        layer: usize,
        plane: usize,
        num_pages: usize,
    ) -> Result<(usize, usize), LayoutError> {
        let whole = self.plane_offset(layer, plane, num_pages)?;
        let region = match self.regions {
            RegionSplit::One => 0,
            RegionSplit::PerLayer => layer,
            RegionSplit::PerPlane => layer * self.planes() + plane,
        };
        let size = self.region_bytes(num_pages)?;
        Ok((region, whole - region * size))
    }

    /// Refuses a piece starting at token `start` that this layout's pages cannot begin at: a
    /// head-granular page moves whole, so its pieces start on a page boundary.
    pub fn check_piece_start(&self, start: usize) -> Result<(), LayoutError> {
        if self.order.granularity() == Granularity::Head && !start.is_multiple_of(self.page_size) {
            return Err(invalid(
                "tokens",
                format!(
                    "{} pages move whole: a piece must start on a page boundary ({start} is not a multiple of the page size {})",
                    self.order.name(),
                    self.page_size
                ),
            ));
        }
        Ok(())
    }

    /// Tokens a selection of `tokens` occupies in staging in `wire` order: the tokens
    /// themselves, or whole pages when the wire moves this layout's head-granular pages as
    /// they are.
    pub fn staged_tokens(&self, tokens: &std::ops::Range<usize>, wire: PageOrder) -> usize {
        match wire.granularity() {
            Granularity::Token => tokens.len(),
            Granularity::Head if tokens.is_empty() => 0,
            Granularity::Head => {
                (self.pages_for(tokens.end) - tokens.start / self.page_size) * self.page_size
            }
        }
    }
}

/// The order the bytes of a transfer between a `source` and a `destination` pool take in
/// staging, or why the pair cannot move KV. Token-granular pools move tokens in the
/// destination's order (its scatter then copies the longest runs), whatever their orders,
/// placements and regions, and in token-major order when their page sizes differ (its page
/// blocks concatenate into plain token rows, whatever either side's page boundaries); a
/// head-granular pool moves only to and from a pool of the same order and page size, whole
/// head slices as stored.
pub fn wire_order(source: &KvLayout, destination: &KvLayout) -> Result<PageOrder, String> {
    kvferry_wire::kv::wire_order(
        (source.order, source.page_size),
        (destination.order, destination.page_size),
    )
}
