//! [`MemHandle`]: memory registered with a context for peers to put into, and its packed remote
//! key.
//!
//! Invariant: the handle owns the registered memory (an `Arc`) and unmaps it before letting it
//! go, and holds an `Rc` of its context, which outlives it.

use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::Arc;

use super::context::Context;
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::result::{self, UcxError, check};
use crate::transport::ucx::sys;

/// Memory registered with a context (`ucp_mem_map` of an existing [`RegisterableMemory`]):
/// host memory, or CUDA device memory where the context handles it.
pub struct MemHandle {
    ptr: NonNull<sys::ucp_mem>,
    context: Rc<Context>,
    /// Held for its drop, after the unmap.
    _memory: Arc<dyn RegisterableMemory>,
}

impl MemHandle {
    /// Registers `memory`, of its kind (`UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`), for local and
    /// remote reads and writes; the handle keeps it alive until it is unmapped.
    pub fn map(
        context: &Rc<Context>,
        memory: Arc<dyn RegisterableMemory>,
    ) -> Result<Self, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_PROT
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: memory.base().cast(),
            length: memory.size(),
            flags: 0,
            prot: sys::UCP_MEM_MAP_PROT_LOCAL_READ
                | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
                | sys::UCP_MEM_MAP_PROT_REMOTE_READ
                | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE,
            memory_type: memory.memory_type().raw(),
        };
        let mut memh = ptr::null_mut();
        // SAFETY: the context is live; `RegisterableMemory` guarantees the range stays mapped
        // while `memory` lives, and the handle holds it until after the unmap (`Drop`).
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(context.as_ptr().as_ptr(), &params, &mut memh)
        })?;
        let ptr = NonNull::new(memh)
            .ok_or_else(|| UcxError::call("ucp_mem_map", sys::UCS_ERR_NO_MESSAGE))?;
        Ok(MemHandle {
            ptr,
            context: context.clone(),
            _memory: memory,
        })
    }

    /// The packed remote key: bytes a peer unpacks with [`super::RemoteKey::unpack`].
    pub fn rkey(&self) -> Result<Vec<u8>, UcxError> {
        // SAFETY: both handles are live and the memory was mapped in this context.
        unsafe { result::rkey_pack(self.context.as_ptr(), self.ptr) }
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and unmapped once; the context outlives it (Rc).
        let status =
            unsafe { sys::ucp_mem_unmap(self.context.as_ptr().as_ptr(), self.ptr.as_ptr()) };
        if status != sys::UCS_OK {
            tracing::warn!(error = %result::status_name(status), "ucp_mem_unmap");
        }
    }
}
