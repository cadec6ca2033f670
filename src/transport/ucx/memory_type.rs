//! Where memory that UCX reads or writes lives ([`MemoryType`]), and which kinds a UCP context
//! moves ([`MemoryTypes`]). Every send, receive and registration names its kind, so UCX never
//! guesses a pointer's kind; memory of a kind the context does not move is refused before UCX
//! sees it.

use super::sys;

/// The kinds of memory a UCP context sends from and receives into, as `ucp_context_query`
/// reports them (`UCP_ATTR_FIELD_MEMORY_TYPES`: a bitmap of `ucs_memory_type_t`). UCX finds
/// them at run time: a libucx built with CUDA (its `cuda_copy`/`cuda_ipc` transports loaded
/// and a CUDA driver present) reports [`MemoryType::Cuda`]; Debian's libucx 1.13, built
/// without CUDA, reports host memory only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryTypes(pub u64);

impl MemoryTypes {
    /// Whether `kind` is among them.
    pub fn has(self, kind: MemoryType) -> bool {
        self.0 & (1 << kind.raw()) != 0
    }

    /// Whether UCX can send CUDA device memory and receive into it.
    pub fn sends_device_memory(self) -> bool {
        self.has(MemoryType::Cuda)
    }
}

/// Where memory that UCX reads or writes lives: every send, receive and registration names it
/// (`UCP_OP_ATTR_FIELD_MEMORY_TYPE`, `UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`), so that UCX
/// never has to guess a pointer's kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Host memory (`UCS_MEMORY_TYPE_HOST`).
    #[default]
    Host,
    /// CUDA device memory (`UCS_MEMORY_TYPE_CUDA`): only where [`MemoryTypes::sends_device_memory`].
    Cuda,
}

impl MemoryType {
    /// The `ucs_memory_type_t` value.
    pub fn raw(self) -> sys::ucs_memory_type_t {
        match self {
            MemoryType::Host => sys::UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => sys::UCS_MEMORY_TYPE_CUDA,
        }
    }
}
