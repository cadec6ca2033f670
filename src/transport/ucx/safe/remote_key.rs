//! [`RemoteKey`]: a peer's remote key, unpacked for one endpoint with the bounds of the region
//! it was packed from, and the [`Put`]s that write with it through that endpoint into that
//! region.
//!
//! Invariants: a packed key reaches UCX only validated and copied
//! ([`crate::transport::ucx::packed`]); the key holds an `Rc` of its endpoint and is destroyed
//! before it, and after every put that writes with it (each holds an `Rc` of it); a put
//! reaches UCX only within the region's bounds.

use std::ptr::{self, NonNull};
use std::rc::Rc;

use super::endpoint::Endpoint;
use super::lent::{Lent, Outgoing};
use super::worker::Started;
use crate::transport::ucx::packed;
use crate::transport::ucx::result::{UcxError, check};
use crate::transport::ucx::sys;

/// A peer's remote key, unpacked for one endpoint, with the bounds of its region.
pub struct RemoteKey {
    ptr: NonNull<sys::ucp_rkey>,
    ep: Rc<Endpoint>,
    base: u64,
    size: u64,
}

/// A put in flight: what it reads, and the key it writes with.
pub struct Put<S> {
    source: S,
    _key: Rc<RemoteKey>,
}

impl<S: Lent> Lent for Put<S> {}

impl RemoteKey {
    /// Unpacks, for `ep`, a remote key the peer packed with
    /// [`MemHandle::rkey`](super::MemHandle::rkey) for its region of `size` bytes at `base`
    /// (as the peer describes it along with the key).
    pub fn unpack(
        ep: &Rc<Endpoint>,
        packed: &[u8],
        base: u64,
        size: u64,
    ) -> Result<RemoteKey, UcxError> {
        if base.checked_add(size).is_none() {
            return Err(UcxError::OutOfBounds {
                offset: base,
                len: 0,
                size,
            });
        }
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
            base,
            size,
        })
    }

    /// Bytes of the key's region.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Starts a put, through the key's endpoint, of `source` (contiguous memory) to `offset`
    /// in the key's region. The put owns `source` and holds the key until it ends (or gives
    /// `source` back with the error: out of the region's bounds, memory of a kind the context
    /// does not move, or not started).
    pub fn put<S: Outgoing>(
        self: &Rc<Self>,
        source: S,
        offset: u64,
    ) -> Result<Started<Put<S>>, (UcxError, S)> {
        let raw = source.outgoing();
        if raw.datatype != sys::UCP_DATATYPE_BYTES {
            let e = UcxError::call("ucp_put_nbx of pieces", sys::UCS_ERR_INVALID_PARAM);
            return Err((e, source));
        }
        if offset
            .checked_add(raw.count as u64)
            .is_none_or(|end| end > self.size)
        {
            let e = UcxError::OutOfBounds {
                offset,
                len: raw.count,
                size: self.size,
            };
            return Err((e, source));
        }
        let live = self.ep.worker.moves("ucp_put_nbx", raw.memory);
        let ep = match live.and_then(|()| self.ep.live("ucp_put_nbx")) {
            Ok(ep) => ep,
            Err(e) => return Err((e, source)),
        };
        let mut param = self.ep.worker.tracked(false);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.datatype = raw.datatype;
        param.memory_type = raw.memory.raw();
        // SAFETY: endpoint and key are live (the key holds an Rc of its endpoint, the put an
        // Rc of the key); `offset..+len` lies in the region (checked above; base+size does not
        // overflow, checked in `unpack`); what `raw` describes stays readable, in place,
        // while `source` lives (`Outgoing`), and the put owns `source` until UCX reports it
        // ended (or leaks it), or gives it back only once UCX is done with it.
        let ptr = unsafe {
            sys::ucp_put_nbx(
                ep,
                raw.buffer,
                raw.count,
                self.base + offset,
                self.ptr.as_ptr(),
                &param,
            )
        };
        let put = Put {
            source,
            _key: self.clone(),
        };
        match self.ep.worker.started("ucp_put_nbx", ptr, put) {
            Ok(started) => Ok(started),
            Err((e, put)) => Err((e, put.source)),
        }
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: the key is live and destroyed once, before its endpoint (held by Rc).
        unsafe { sys::ucp_rkey_destroy(self.ptr.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use bytes::Bytes;

    use super::*;
    use crate::transport::ucx::UcxConfig;
    use crate::transport::ucx::region::{Region, RegisterableMemory};
    use crate::transport::ucx::safe::{Context, MemHandle, Worker};

    /// Progresses `worker` until `started` has ended, successfully.
    fn wait<L: Lent>(worker: &Worker, started: Started<L>) {
        let Started::Pending(mut request) = started else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            assert!(Instant::now() < deadline, "a request never ended");
            worker.progress();
            for c in worker.completed() {
                request = match request.end(c) {
                    Ok(ended) => return assert_eq!(ended.status, sys::UCS_OK),
                    Err((request, _)) => request,
                };
            }
        }
    }

    /// A put lands at its offset in the key's region, and one reaching past the region's end
    /// is refused before UCX sees it, its source handed back.
    #[test]
    fn puts_stay_within_the_keys_region() {
        let config = UcxConfig::tcp_loopback();
        let context = Context::new(config.vars(), true).unwrap();
        let worker = Worker::new(&context).unwrap();
        let region = Arc::new(Region::new(64).unwrap());
        let handle = MemHandle::map(&context, region.clone()).unwrap();
        let ep = Rc::new(Endpoint::connect(&worker, &worker.address().unwrap(), true).unwrap());
        let base = RegisterableMemory::base(region.as_ref()) as u64;
        let key = Rc::new(RemoteKey::unpack(&ep, &handle.rkey().unwrap(), base, 64).unwrap());
        for (offset, len) in [(63, 2), (64, 1), (u64::MAX, 1)] {
            let source = Bytes::from(vec![9u8; len]);
            match key.put(source, offset) {
                Err((UcxError::OutOfBounds { .. }, back)) => assert_eq!(back.len(), len),
                Err((e, _)) => panic!("{offset}+{len}: {e}"),
                Ok(_) => panic!("{offset}+{len}: a put past the region's end started"),
            }
        }
        let put = key.put(Bytes::from_static(b"abc"), 61);
        wait(&worker, put.unwrap_or_else(|(e, _)| panic!("{e}")));
        wait(&worker, ep.flush().unwrap());
        assert_eq!(region.read(60, 4).unwrap(), [0, b'a', b'b', b'c']);
    }
}
