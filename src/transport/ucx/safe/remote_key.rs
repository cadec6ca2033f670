//! [`RemoteKey`]: a peer's remote key, unpacked for one endpoint, and the puts that write with
//! it through that endpoint into the peer's registered memory.
//!
//! Invariants: a packed key reaches UCX only validated and copied
//! ([`crate::transport::ucx::packed`]); the key holds an `Rc` of its endpoint and is destroyed
//! before it.

use std::ptr::{self, NonNull};
use std::rc::Rc;

use super::endpoint::Endpoint;
use super::worker::{Request, Started};
use crate::transport::ucx::packed;
use crate::transport::ucx::result::{UcxError, check, request_or_done};
use crate::transport::ucx::sys;

/// A peer's remote key, unpacked for one endpoint.
pub struct RemoteKey {
    ptr: NonNull<sys::ucp_rkey>,
    ep: Rc<Endpoint>,
}

impl RemoteKey {
    /// Unpacks, for `ep`, a remote key the peer packed with
    /// [`MemHandle::rkey`](super::MemHandle::rkey).
    pub fn unpack(ep: &Rc<Endpoint>, packed: &[u8]) -> Result<RemoteKey, UcxError> {
        // UCX reads the key without a length and reports no malformed framing (a 2-byte key
        // "unpacks"): only a validated copy reaches it.
        packed::check_rkey(packed)?;
        let owned = packed::owned_copy(packed);
        let handle = ep.live("ucp_ep_rkey_unpack")?;
        let mut rkey = ptr::null_mut();
        // SAFETY: the endpoint is live; `owned` holds a packed rkey whose every framed length
        // lies inside it (checked above) followed by zeroes, readable for the call (UCX copies
        // what it keeps).
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(handle, owned.as_ptr().cast(), &mut rkey)
        })?;
        let ptr = NonNull::new(rkey)
            .ok_or_else(|| UcxError::call("ucp_ep_rkey_unpack", sys::UCS_ERR_NO_MESSAGE))?;
        Ok(RemoteKey {
            ptr,
            ep: ep.clone(),
        })
    }

    /// Starts a put, through the key's endpoint, of `len` bytes at `buffer` to `remote_addr`
    /// in the region of this key.
    ///
    /// # Safety
    /// `buffer` is readable for `len` bytes until the request completes; `remote_addr..+len`
    /// lies in the region the key was packed from (the caller checked the peer's bounds).
    pub unsafe fn put(
        &self,
        buffer: *const u8,
        len: usize,
        remote_addr: u64,
    ) -> Result<Started<()>, UcxError> {
        let mut param = self.ep.worker.tracked(false);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.datatype = sys::UCP_DATATYPE_BYTES;
        param.memory_type = sys::UCS_MEMORY_TYPE_HOST;
        let ep = self.ep.live("ucp_put_nbx")?;
        // SAFETY: endpoint and key are live (the key holds an Rc of its endpoint); buffer and
        // bounds are the caller's contract.
        let ptr = unsafe {
            sys::ucp_put_nbx(
                ep,
                buffer.cast(),
                len,
                remote_addr,
                self.ptr.as_ptr(),
                &param,
            )
        };
        Ok(match request_or_done("ucp_put_nbx", ptr)? {
            None => Started::Done(()),
            Some(req) => Started::Pending(Request::new(req, &self.ep.worker)),
        })
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: the key is live and destroyed once, before its endpoint (held by Rc).
        unsafe { sys::ucp_rkey_destroy(self.ptr.as_ptr()) }
    }
}
