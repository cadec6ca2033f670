//! The transfer kernel contract: gather a selection of a pool into one contiguous staging
//! buffer, and scatter a staging buffer into a selection of a pool.
//!
//! A [`Selection`] names what moves: the pages holding a room's tokens (page `i` of the list
//! holds tokens `i*page_size..(i+1)*page_size`), a token range within them, a range of the pool's
//! layers and a range of the pool's heads (local indices). Head ranges make heterogeneous TP a
//! bulk copy; token ranges make chunks and prefix offsets exact.
//!
//! Staging wire order (docs/protocol.md refers here):
//! `[layer][plane][page block][block order]`, where a *page block* is the selected tokens of one
//! page (`nt` tokens) and the *block order* is the wire order given to the kernel: token-major
//! `[token][head][head_bytes]` or head-major `[head][token][head_bytes]`, over the `nt` selected
//! tokens and the `nh` selected heads. With token-major order this is simply
//! `[layer][plane][token][head][head_bytes]`. Sender and receiver agree on the wire order (the
//! sender's page order makes its gather cheapest); a receiver with the other page order still
//! scatters correctly, in head-sized runs.
//!
//! Validation happens here, once, before any byte moves: page indices against the pool, no
//! duplicate page in a destination, the token range against the page list, layer and head ranges
//! against the pool, the staging size against the selection. The CPU kernel ([`cpu`]) serves
//! host pools, the CUDA kernel ([`cuda`]) device pools; [`kernel_for`] picks one by the pool's
//! [`MemoryKind`].

pub mod cpu;
pub mod cuda;

use std::ops::Range;
use std::sync::Arc;

use crate::layout::{KvLayout, LayoutError, PageOrder};
use crate::memory::MemoryKind;
use crate::pool::HostPool;

/// The kernel that serves one kind of pool memory.
#[derive(Clone, Debug)]
pub enum Kernel {
    /// For host pools.
    Cpu(cpu::CpuKernel),
    /// For device pools; shared by every user of the device in this process.
    Cuda(Arc<cuda::CudaKernel>),
}

/// The kernel for pools in `kind` memory. Host memory always has one; device memory needs the
/// CUDA driver, the device and NVRTC, and returns [`KernelError::Cuda`] saying which is missing.
pub fn kernel_for(kind: MemoryKind) -> Result<Kernel, KernelError> {
    match kind {
        MemoryKind::Host => Ok(Kernel::Cpu(cpu::CpuKernel::default())),
        MemoryKind::Device { ordinal } => Ok(Kernel::Cuda(cuda::CudaKernel::shared(ordinal)?)),
    }
}

/// Errors of gather and scatter; all are detected before any byte is copied.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// A page index beyond the pool.
    #[error("page {page} is out of range: the pool has {num_pages} pages")]
    PageOutOfRange {
        /// The offending page.
        page: u32,
        /// Pages in the pool.
        num_pages: usize,
    },
    /// A destination page listed twice: two tokens would land in the same slot.
    #[error("page {page} appears twice in the destination page list")]
    DuplicatePage {
        /// The offending page.
        page: u32,
    },
    /// The token range needs more pages than listed.
    #[error("tokens {start}..{end} need {needed} pages but {listed} are listed")]
    TooFewPages {
        /// Token range start.
        start: usize,
        /// Token range end.
        end: usize,
        /// Pages needed.
        needed: usize,
        /// Pages listed.
        listed: usize,
    },
    /// A layer or head range outside the pool, or reversed.
    #[error("{what} {start}..{end} is not within the pool's 0..{held}")]
    RangeOutOfPool {
        /// "layers" or "heads".
        what: &'static str,
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// What the pool holds.
        held: usize,
    },
    /// The staging buffer does not match the selection.
    #[error("staging buffer holds {actual} bytes but the selection is {expected} bytes")]
    StagingSize {
        /// Bytes of the selection.
        expected: usize,
        /// Bytes of the buffer.
        actual: usize,
    },
    /// A placed run that is not one contiguous range of the pool (or is empty).
    #[error("a run of {len} bytes at wire offset {at} is not one contiguous range of the pool")]
    NotContiguous {
        /// Offset of the run in the chunk's wire order.
        at: usize,
        /// Bytes of the run.
        len: u64,
    },
    /// A run of a copy between pools that leaves one of them.
    #[error("a run of {len} bytes at {offset} leaves the {side}'s {size} bytes")]
    RunOutside {
        /// Which memory: "source pool" or "destination".
        side: &'static str,
        /// Offset of the run there.
        offset: u64,
        /// Bytes of the run.
        len: u64,
        /// Bytes of that memory.
        size: usize,
    },
    /// A copy between memory the pool does not have (device staging of a host pool, a
    /// device payload that is not this pool's staging).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Selection arithmetic overflowed.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The CUDA kernel is unavailable or a CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
}

/// What a gather reads or a scatter writes.
#[derive(Clone, Debug)]
pub struct Selection<'a> {
    /// Pages holding the room's tokens, in token order.
    pub pages: &'a [u32],
    /// Tokens to move, counted from the first token of `pages[0]`.
    pub tokens: Range<usize>,
    /// Local layers of the pool.
    pub layers: Range<usize>,
    /// Local heads of the pool.
    pub heads: Range<usize>,
}

impl<'a> Selection<'a> {
    /// Every layer and head of `pool` for `tokens` tokens held in `pages`.
    pub fn whole(pool: &HostPool, pages: &'a [u32], tokens: usize) -> Self {
        Selection {
            pages,
            tokens: 0..tokens,
            layers: 0..pool.layout().num_layers(),
            heads: 0..pool.layout().num_heads(),
        }
    }

    /// Bytes this selection occupies in staging in `wire` order.
    pub fn bytes(&self, pool: &HostPool, wire: PageOrder) -> Result<usize, KernelError> {
        self.bytes_in(pool.layout(), wire)
    }

    /// Bytes this selection occupies in staging, for a pool of `layout` in any memory.
    pub fn bytes_in(&self, layout: &KvLayout, wire: PageOrder) -> Result<usize, KernelError> {
        Ok(layout.selection_bytes(
            layout.staged_tokens(&self.tokens, wire),
            self.layers.len(),
            self.heads.len(),
        )?)
    }

    /// Checks the selection against `pool` and a staging buffer of `staging_len` bytes in
    /// `wire` order.
    /// `destination` additionally refuses a page the tokens touch twice.
    pub fn validate(
        &self,
        pool: &HostPool,
        wire: PageOrder,
        staging_len: usize,
        destination: bool,
    ) -> Result<(), KernelError> {
        self.validate_in(
            pool.layout(),
            pool.num_pages(),
            wire,
            staging_len,
            destination,
        )
    }

    /// [`Self::validate`] for a pool of `layout` and `num_pages` pages in any memory.
    pub fn validate_in(
        &self,
        layout: &KvLayout,
        num_pages: usize,
        wire: PageOrder,
        staging_len: usize,
        destination: bool,
    ) -> Result<(), KernelError> {
        check_range("layers", &self.layers, layout.num_layers())?;
        check_range("heads", &self.heads, layout.num_heads())?;
        // Every offset into the pool is below its size: none overflows once this does not.
        layout.pool_bytes(num_pages)?;
        if self.tokens.start > self.tokens.end {
            return Err(KernelError::TooFewPages {
                start: self.tokens.start,
                end: self.tokens.end,
                needed: 0,
                listed: self.pages.len(),
            });
        }
        let needed = layout.pages_for(self.tokens.end);
        if needed > self.pages.len() {
            return Err(KernelError::TooFewPages {
                start: self.tokens.start,
                end: self.tokens.end,
                needed,
                listed: self.pages.len(),
            });
        }
        if let Some(&page) = self.pages.iter().find(|&&p| p as usize >= num_pages) {
            return Err(KernelError::PageOutOfRange { page, num_pages });
        }
        if destination {
            // Only the pages the tokens touch: the ones before stay as they are.
            let first = (self.tokens.start / layout.page_size).min(needed);
            let mut sorted = self.pages[first..needed].to_vec();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(KernelError::DuplicatePage { page: w[0] });
            }
        }
        let expected = self.bytes_in(layout, wire)?;
        if expected != staging_len {
            return Err(KernelError::StagingSize {
                expected,
                actual: staging_len,
            });
        }
        Ok(())
    }
}

fn check_range(what: &'static str, r: &Range<usize>, held: usize) -> Result<(), KernelError> {
    if r.start > r.end || r.end > held {
        return Err(KernelError::RangeOutOfPool {
            what,
            start: r.start,
            end: r.end,
            held,
        });
    }
    Ok(())
}
