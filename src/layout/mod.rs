//! KV layout: what one rank's KV pool holds and where every byte of it sits.
//!
//! A [`ModelSpec`] describes the model (attention kind, layers, total KV heads, head dim, dtype;
//! the names of the first and the last, [`AttentionKind`] and [`Dtype`], are `kvferry_wire`'s,
//! the same in the registry's JSON).
//! A [`KvLayout`] describes one rank's pool: the slice of the model it holds (a head range and a
//! layer range), the page size in tokens, the order of tokens and heads inside a page, and where
//! K and V sit relative to each other.
//!
//! All byte arithmetic of kvferry lives here, checked: page bytes, head strides, plane offsets,
//! pool bytes, selection (staging) bytes. A layout is validated once when it is built, so that
//! every later offset inside a pool of validated size cannot overflow.
//!
//! Terms used throughout the crate:
//! - a *plane* is K or V of one layer (MHA/GQA: two planes per layer; MLA: one latent plane);
//! - a *page* is `page_size` token slots of every plane;
//! - a *block* is one page of one plane: `page_size x heads held x head_bytes` bytes.

use std::ops::Range;

mod format;

pub use format::{FORMATS, Granularity, KvFormat, KvPlacement, PageOrder, RegionSplit, wire_order};
pub use kvferry_wire::kv::{AttentionKind, Dtype, UnknownName};

/// Errors building or querying a layout.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// A field has an impossible value.
    #[error("invalid layout: {field} {reason}")]
    Invalid {
        /// The field at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A byte count does not fit in the address space.
    #[error("layout arithmetic overflows computing {what}")]
    Overflow {
        /// The quantity being computed.
        what: &'static str,
    },
    /// A preset name that does not exist.
    #[error("unknown model preset {name:?}; known: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The known names, comma separated.
        known: String,
    },
    /// A name that does not parse as the enum it should.
    #[error(transparent)]
    UnknownName(UnknownName),
}

kvferry_wire::named_enum!(
    KvPlacement,
    "kv placement",
    "planes, interleaved, cells",
    [
        KvPlacement::Planes,
        KvPlacement::Interleaved,
        KvPlacement::Cells
    ]
);

/// The model-wide KV shape, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelSpec {
    /// Attention kind.
    pub kind: AttentionKind,
    /// Layers of the model.
    pub num_layers: usize,
    /// KV heads of the model (1 for MLA).
    pub num_kv_heads: usize,
    /// Elements per head (the latent width for MLA).
    pub head_dim: usize,
    /// Element type.
    pub dtype: Dtype,
}

/// Named model presets: `(name, spec)`.
pub const PRESETS: &[(&str, ModelSpec)] = &[
    ("tiny", ModelSpec::mha(4, 4, 32, Dtype::Fp16)),
    ("llama3-8b", ModelSpec::mha(32, 8, 128, Dtype::Bf16)),
    ("llama3-70b", ModelSpec::mha(80, 8, 128, Dtype::Bf16)),
    ("qwen2.5-7b", ModelSpec::mha(28, 4, 128, Dtype::Bf16)),
    (
        "deepseek-v3",
        ModelSpec {
            kind: AttentionKind::Mla,
            num_layers: 61,
            num_kv_heads: 1,
            head_dim: 576,
            dtype: Dtype::Bf16,
        },
    ),
    (
        "tiny-mla",
        ModelSpec {
            kind: AttentionKind::Mla,
            num_layers: 3,
            num_kv_heads: 1,
            head_dim: 72,
            dtype: Dtype::Fp16,
        },
    ),
];

impl ModelSpec {
    /// An MHA/GQA model.
    pub const fn mha(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: Dtype,
    ) -> Self {
        ModelSpec {
            kind: AttentionKind::Mha,
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
        }
    }

    /// Looks a preset up by name.
    pub fn preset(name: &str) -> Result<Self, LayoutError> {
        PRESETS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, spec)| *spec)
            .ok_or_else(|| LayoutError::UnknownPreset {
                name: name.to_owned(),
                known: PRESETS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), LayoutError> {
        positive("num_layers", self.num_layers)?;
        positive("num_kv_heads", self.num_kv_heads)?;
        positive("head_dim", self.head_dim)?;
        if self.kind == AttentionKind::Mla && self.num_kv_heads != 1 {
            return Err(invalid(
                "num_kv_heads",
                format!(
                    "is {} but an MLA model has exactly 1 latent head",
                    self.num_kv_heads
                ),
            ));
        }
        mul(self.head_dim, self.dtype.bytes(), "head bytes")?;
        Ok(())
    }
}

/// One rank's KV pool shape: the model, the slice of it this rank holds, and the in-memory order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// The model.
    pub model: ModelSpec,
    /// Tokens per page.
    pub page_size: usize,
    /// The model's KV heads this rank holds (half-open, global head indices).
    pub heads: Range<usize>,
    /// The model's layers this rank holds (half-open, global layer indices).
    pub layers: Range<usize>,
    /// Order inside a block.
    pub order: PageOrder,
    /// Placement of the planes of a layer.
    pub placement: KvPlacement,
    /// How layers and planes are split over memory regions.
    pub regions: RegionSplit,
}

impl KvLayout {
    /// The whole model on one rank, token-major, planes apart.
    pub fn new(model: ModelSpec, page_size: usize) -> Result<Self, LayoutError> {
        let layout = KvLayout {
            model,
            page_size,
            heads: 0..model.num_kv_heads,
            layers: 0..model.num_layers,
            order: PageOrder::TokenMajor,
            placement: KvPlacement::Planes,
            regions: RegionSplit::One,
        };
        layout.validate()?;
        Ok(layout)
    }

    /// The same layout restricted to a head range and a layer range of the model.
    pub fn with_slice(
        mut self,
        heads: Range<usize>,
        layers: Range<usize>,
    ) -> Result<Self, LayoutError> {
        self.heads = heads;
        self.layers = layers;
        self.validate()?;
        Ok(self)
    }

    /// The same layout with another page order and placement.
    pub fn with_order(
        mut self,
        order: PageOrder,
        placement: KvPlacement,
    ) -> Result<Self, LayoutError> {
        self.order = order;
        self.placement = placement;
        self.validate()?;
        Ok(self)
    }

    /// The slice a TP/PP rank holds of the whole model: heads split evenly over TP ranks
    /// (when there are fewer KV heads than TP ranks, each rank holds one replicated head; MLA's
    /// latent is replicated on every rank), layers split over PP stages with the first
    /// `layers % pp_size` stages holding one layer more (61 layers over 2 stages: 31 and 30).
    pub fn for_rank(
        self,
        tp_rank: usize,
        tp_size: usize,
        pp_rank: usize,
        pp_size: usize,
    ) -> Result<Self, LayoutError> {
        if tp_rank >= tp_size || pp_rank >= pp_size {
            return Err(invalid(
                "rank",
                format!("tp {tp_rank}/{tp_size} pp {pp_rank}/{pp_size}: rank must be < size"),
            ));
        }
        let heads_total = self.model.num_kv_heads;
        let heads = match self.model.kind {
            AttentionKind::Mla => 0..1,
            AttentionKind::Mha if heads_total >= tp_size => {
                if !heads_total.is_multiple_of(tp_size) {
                    return Err(invalid(
                        "tp_size",
                        format!("{tp_size} does not divide the model's {heads_total} KV heads"),
                    ));
                }
                let per = heads_total / tp_size;
                tp_rank * per..(tp_rank + 1) * per
            }
            AttentionKind::Mha => {
                let head = tp_rank * heads_total / tp_size;
                head..head + 1
            }
        };
        let (base, extra) = (
            self.model.num_layers / pp_size,
            self.model.num_layers % pp_size,
        );
        let start = pp_rank * base + pp_rank.min(extra);
        let layers = start..start + base + usize::from(pp_rank < extra);
        self.with_slice(heads, layers)
    }

    /// Checks every field and that one page of every plane fits the address space.
    pub fn validate(&self) -> Result<(), LayoutError> {
        self.model.validate()?;
        positive("page_size", self.page_size)?;
        check_range("heads", &self.heads, self.model.num_kv_heads)?;
        check_range("layers", &self.layers, self.model.num_layers)?;
        if self.order == PageOrder::VllmCpuVecSpan {
            return Err(invalid(
                "order",
                format!("{} is the order of a transfer, not of a pool", self.order),
            ));
        }
        if self.order.granularity() == Granularity::Head
            && self.placement != KvPlacement::Interleaved
        {
            return Err(invalid(
                "placement",
                format!(
                    "{} pages hold K and V of a head side by side (interleaved)",
                    self.order
                ),
            ));
        }
        if self.regions == RegionSplit::PerPlane && self.placement != KvPlacement::Planes {
            return Err(invalid(
                "regions",
                format!(
                    "a region per plane needs the planes apart, not {}",
                    self.placement.name()
                ),
            ));
        }
        self.page_span()?;
        Ok(())
    }

    /// Layers this rank holds.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// KV heads this rank holds.
    pub fn num_heads(&self) -> usize {
        self.heads.len()
    }

    /// Planes per layer (2 for MHA, 1 for MLA).
    pub fn planes(&self) -> usize {
        self.model.kind.planes()
    }

    /// Bytes of one head of one token. Cannot overflow once validated.
    pub fn head_bytes(&self) -> usize {
        self.model.head_dim * self.model.dtype.bytes()
    }

    /// Bytes from one head of a token to the next in a page: a head, or a whole cell of every
    /// plane's head where the planes share cells ([`KvPlacement::Cells`]).
    pub fn cell_bytes(&self) -> usize {
        match self.placement {
            KvPlacement::Cells => self.planes() * self.head_bytes(),
            KvPlacement::Planes | KvPlacement::Interleaved => self.head_bytes(),
        }
    }

    /// Bytes of one block: one page of one plane, every head held.
    pub fn block_bytes(&self) -> Result<usize, LayoutError> {
        let token = mul(self.num_heads(), self.head_bytes(), "token bytes")?;
        mul(token, self.page_size, "block bytes")
    }

    /// Bytes one page occupies across every plane of every layer held.
    pub fn page_span(&self) -> Result<usize, LayoutError> {
        let per_layer = mul(self.block_bytes()?, self.planes(), "page bytes per layer")?;
        mul(per_layer, self.num_layers(), "page bytes")
    }

    /// Distance in bytes between page `p` and page `p + 1` of one plane.
    pub fn page_stride(&self) -> Result<usize, LayoutError> {
        match self.placement {
            KvPlacement::Planes => self.block_bytes(),
            KvPlacement::Interleaved | KvPlacement::Cells => {
                mul(self.block_bytes()?, self.planes(), "page stride")
            }
        }
    }

    /// Bytes of a pool of `num_pages` pages.
    pub fn pool_bytes(&self, num_pages: usize) -> Result<usize, LayoutError> {
        mul(self.page_span()?, num_pages, "pool bytes")
    }

    /// Offset of page 0 of plane `plane` of local layer `layer`, in a pool of `num_pages` pages,
    /// with overflow checks: `num_pages` may come from a peer (the size of a pool it exposed).
    pub fn plane_offset(
        &self,
        layer: usize,
        plane: usize,
        num_pages: usize,
    ) -> Result<usize, LayoutError> {
        let block = self.block_bytes()?;
        let per_page = mul(block, self.planes(), "page bytes per layer")?;
        let layer_bytes = mul(per_page, num_pages, "layer bytes")?;
        let within = match (self.order, self.placement) {
            // K and V of each head side by side inside the page: V starts one head block in.
            (PageOrder::VllmCpuVec | PageOrder::VllmCpuAmx, _) => mul(
                plane,
                mul(self.page_size, self.head_bytes(), "plane offset")?,
                "plane offset",
            )?,
            (_, KvPlacement::Planes) => mul(
                mul(plane, block, "plane offset")?,
                num_pages,
                "plane offset",
            )?,
            (_, KvPlacement::Interleaved) => mul(plane, block, "plane offset")?,
            // A plane's head is the plane-th head of each cell.
            (_, KvPlacement::Cells) => mul(plane, self.head_bytes(), "plane offset")?,
        };
        mul(layer, layer_bytes, "layer offset")?
            .checked_add(within)
            .ok_or(LayoutError::Overflow {
                what: "plane offset",
            })
    }

    /// Offset of `(token, head)` inside one block of this layout, from the block's start in its
    /// plane; both local.
    pub fn element_offset(&self, token: usize, head: usize) -> usize {
        element_offset(
            self.order,
            token,
            head,
            self.page_size,
            self.num_heads(),
            self.cell_bytes(),
        )
    }

    /// Bytes of a selection of `tokens` tokens, `layers` layers and `heads` heads: the staging
    /// size of a gather.
    pub fn selection_bytes(
        &self,
        tokens: usize,
        layers: usize,
        heads: usize,
    ) -> Result<usize, LayoutError> {
        let per_token = mul(heads, self.head_bytes(), "selection bytes")?;
        let per_plane = mul(per_token, tokens, "selection bytes")?;
        let per_layer = mul(per_plane, self.planes(), "selection bytes")?;
        mul(per_layer, layers, "selection bytes")
    }

    /// KV bytes of a room of `tokens` tokens on this rank (every layer and head it holds).
    pub fn room_bytes(&self, tokens: usize) -> Result<usize, LayoutError> {
        self.selection_bytes(tokens, self.num_layers(), self.num_heads())
    }

    /// Pages needed for `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
}

/// Offset of `(token, head)` inside a block of `tokens x heads` heads laid out in `order`, one
/// head every `cell_bytes` bytes (a head's bytes, or a cell's: [`KvLayout::cell_bytes`]). The
/// staging wire order uses the same formula with the selection's sizes.
pub fn element_offset(
    order: PageOrder,
    token: usize,
    head: usize,
    tokens: usize,
    heads: usize,
    cell_bytes: usize,
) -> usize {
    match order {
        PageOrder::TokenMajor => (token * heads + head) * cell_bytes,
        PageOrder::HeadMajor => (head * tokens + token) * cell_bytes,
        // A head's K block then its V block; within V, token rows on the vec path (K, and
        // both halves on the amx path, are read whole; the span order's K by dims).
        PageOrder::VllmCpuVec | PageOrder::VllmCpuAmx | PageOrder::VllmCpuVecSpan => {
            (head * 2 * tokens + token) * cell_bytes
        }
    }
}

fn invalid(field: &'static str, reason: String) -> LayoutError {
    LayoutError::Invalid { field, reason }
}

fn positive(field: &'static str, value: usize) -> Result<(), LayoutError> {
    if value == 0 {
        return Err(invalid(field, "must be > 0".to_owned()));
    }
    Ok(())
}

fn check_range(field: &'static str, r: &Range<usize>, limit: usize) -> Result<(), LayoutError> {
    if r.start >= r.end || r.end > limit {
        return Err(invalid(
            field,
            format!(
                "{}..{} must be a non-empty range within 0..{limit}",
                r.start, r.end
            ),
        ));
    }
    Ok(())
}

/// Checked multiplication naming what is being computed.
pub(crate) fn mul(a: usize, b: usize, what: &'static str) -> Result<usize, LayoutError> {
    a.checked_mul(b).ok_or(LayoutError::Overflow { what })
}

#[cfg(test)]
mod tests;
