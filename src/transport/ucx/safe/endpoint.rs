//! [`Endpoint`]: a connection to a remote worker, its tagged sends (of what they own, until they
//! end) and flushes, and the failure of its peer as UCX's error handler records it.
//!
//! Invariants: a peer's worker address reaches UCX only validated and copied
//! ([`crate::transport::ucx::packed`]); the error handler's state lives from `connect` until
//! the endpoint is closed and dropped, after which UCX calls no handler.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::atomic::{AtomicI8, Ordering};

use super::lent::Outgoing;
use super::worker::{Started, Worker};
use crate::transport::ucx::packed;
use crate::transport::ucx::result::{self, UcxError, check, request_or_done};
use crate::transport::ucx::sys::{self, ucs_status_t};

/// The failure an endpoint's error handler recorded (0 while healthy). Boxed, so its address
/// is stable for the handler's `arg`.
struct EpState {
    failed: AtomicI8,
}

unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: ucs_status_t) {
    if arg.is_null() {
        return;
    }
    // SAFETY: `arg` is the leaked EpState of a live Endpoint: UCX never calls the error handler
    // of an endpoint after ucp_ep_close_nbx, which runs in Endpoint::drop before the box is
    // freed. Only an atomic store happens here: no panic can cross the FFI boundary.
    let state = unsafe { &*arg.cast::<EpState>() };
    let status = if status == sys::UCS_OK {
        sys::UCS_ERR_CONNECTION_RESET
    } else {
        status
    };
    state.failed.store(status, Ordering::Release);
}

/// A connection to a remote worker.
pub struct Endpoint {
    ptr: NonNull<sys::ucp_ep>,
    /// From `Box::into_raw`, so the pointer the error handler holds is never invalidated by a
    /// move of the Box; freed in `Drop` after the endpoint is closed.
    state: NonNull<EpState>,
    supervised: bool,
    /// Set by [`Endpoint::close`]: the handle is gone, nothing may use it.
    closed: Cell<bool>,
    pub(super) worker: Rc<Worker>,
}

impl Endpoint {
    /// Connects to the worker whose address (from [`Worker::address`]) is `address`. UCX wires
    /// up lazily: an unreachable peer shows as a failure of the first operations.
    ///
    /// `supervised` asks for `UCP_ERR_HANDLING_MODE_PEER` (UCX reports a dead peer through
    /// the error handler, see [`Endpoint::failure`]); UCX 1.13 refuses it, with
    /// `UCS_ERR_UNREACHABLE`, when no selected transport can detect peer failure (its
    /// shared-memory transports). Unsupervised endpoints learn of a dead peer only through
    /// [`Endpoint::set_failed`].
    pub fn connect(
        worker: &Rc<Worker>,
        address: &[u8],
        supervised: bool,
    ) -> Result<Endpoint, UcxError> {
        // UCX reads the address without a length: only a validated copy reaches it.
        packed::check_worker_address(address)?;
        let owned = packed::owned_copy(address);
        let state = NonNull::from(Box::leak(Box::new(EpState {
            failed: AtomicI8::new(sys::UCS_OK),
        })));
        let arg = state.as_ptr().cast::<c_void>();
        let params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER
                | sys::UCP_EP_PARAM_FIELD_USER_DATA,
            address: owned.as_ptr().cast(),
            err_mode: if supervised {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_endpoint_error),
                arg,
            },
            // UCX 1.13 passes the endpoint's user_data to the error handler: same pointer.
            user_data: arg,
            flags: 0,
            sockaddr: sys::ucs_sock_addr_t {
                addr: ptr::null(),
                addrlen: 0,
            },
            conn_request: ptr::null_mut(),
            name: ptr::null(),
            local_sockaddr: sys::ucs_sock_addr_t {
                addr: ptr::null(),
                addrlen: 0,
            },
        };
        let mut ep = ptr::null_mut();
        // SAFETY: the worker is live; `owned` holds a worker address whose every framed length
        // lies inside it (checked above) followed by zeroes, and lives for the call (UCX
        // unpacks the address before returning); `arg` is the leaked EpState, freed only after
        // the endpoint is closed (or below, when there is none).
        let created = check("ucp_ep_create", unsafe {
            sys::ucp_ep_create(worker.as_ptr().as_ptr(), &params, &mut ep)
        })
        .and_then(|()| {
            NonNull::new(ep).ok_or_else(|| UcxError::call("ucp_ep_create", sys::UCS_ERR_NO_MESSAGE))
        });
        let ptr = match created {
            Ok(ptr) => ptr,
            Err(e) => {
                // SAFETY: no endpoint holds the state: it came from Box::leak above and is
                // freed once, here.
                drop(unsafe { Box::from_raw(state.as_ptr()) });
                return Err(e);
            }
        };
        Ok(Endpoint {
            ptr,
            state,
            supervised,
            closed: Cell::new(false),
            worker: worker.clone(),
        })
    }

    /// The handle for `op`, unless the endpoint was closed.
    pub(super) fn live(&self, op: &'static str) -> Result<*mut sys::ucp_ep, UcxError> {
        match self.closed.get() {
            false => Ok(self.ptr.as_ptr()),
            true => Err(UcxError::call(op, sys::UCS_ERR_NOT_CONNECTED)),
        }
    }

    /// The raw handle, for tests.
    pub fn as_ptr(&self) -> NonNull<sys::ucp_ep> {
        self.ptr
    }

    fn state(&self) -> &EpState {
        // SAFETY: the state is live from `connect` until `Drop` frees it; only shared
        // references (and the handler's atomic stores) exist meanwhile.
        unsafe { self.state.as_ref() }
    }

    /// Whether UCX reports this endpoint's peer failure (`UCP_ERR_HANDLING_MODE_PEER`).
    pub fn supervised(&self) -> bool {
        self.supervised
    }

    /// Records that the peer is dead (learnt elsewhere, e.g. a missed heartbeat), with the
    /// status later operations report. Dropping the endpoint then force-closes it, which
    /// completes its outstanding requests.
    pub fn set_failed(&self, status: ucs_status_t) {
        let status = if status == sys::UCS_OK {
            sys::UCS_ERR_CONNECTION_RESET
        } else {
            status
        };
        let _ = self.state().failed.compare_exchange(
            sys::UCS_OK,
            status,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// The status the error handler recorded, once the peer has failed.
    pub fn failure(&self) -> Option<ucs_status_t> {
        match self.state().failed.load(Ordering::Acquire) {
            sys::UCS_OK => None,
            status => Some(status),
        }
    }

    /// Starts a tagged send of `message`, which the request owns until it ends (or comes back
    /// with the error when the send does not start, memory of a kind the context does not move
    /// included, or done when it completed at once).
    pub fn tag_send<L: Outgoing>(&self, message: L, tag: u64) -> Result<Started<L>, (UcxError, L)> {
        let raw = message.outgoing();
        let ep = match self
            .worker
            .moves("ucp_tag_send_nbx", raw.memory)
            .and_then(|()| self.live("ucp_tag_send_nbx"))
        {
            Ok(ep) => ep,
            Err(e) => return Err((e, message)),
        };
        let mut param = self.worker.tracked(false);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.datatype = raw.datatype;
        param.memory_type = raw.memory.raw();
        // SAFETY: the endpoint is live; what `raw` describes stays readable, in place, while
        // `message` lives (`Outgoing`), and `message` goes into the request, which keeps it
        // until UCX reports the send ended (or leaks it), or comes back only once UCX is done
        // with it (completed at once, or not started).
        let ptr = unsafe { sys::ucp_tag_send_nbx(ep, raw.buffer, raw.count, tag, &param) };
        self.worker.started("ucp_tag_send_nbx", ptr, message)
    }

    /// Starts a flush: completes once every operation started on this endpoint has completed
    /// remotely (puts are visible in the peer's memory).
    pub fn flush(&self) -> Result<Started<()>, UcxError> {
        let param = self.worker.tracked(false);
        let ep = self.live("ucp_ep_flush_nbx")?;
        // SAFETY: the endpoint is live; the param sets only the completion callback.
        let ptr = unsafe { sys::ucp_ep_flush_nbx(ep, &param) };
        self.worker
            .started("ucp_ep_flush_nbx", ptr, ())
            .map_err(|(e, ())| e)
    }

    /// UCX's description of the endpoint (`ucp_ep_print_info`): its lanes, each with the
    /// transport and device it uses and what it carries (`am`, `rma_bw`, ...).
    pub fn info(&self) -> Result<String, UcxError> {
        let ep = self.live("ucp_ep_print_info")?;
        let mut buf: *mut libc::c_char = ptr::null_mut();
        let mut len: libc::size_t = 0;
        // SAFETY: open_memstream writes the buffer pointer and length through the two live
        // locals when the stream is flushed or closed.
        let stream = unsafe { libc::open_memstream(&mut buf, &mut len) };
        if stream.is_null() {
            return Err(UcxError::Os {
                op: "open_memstream",
                message: std::io::Error::last_os_error().to_string(),
            });
        }
        // SAFETY: the endpoint is live and `stream` is an open FILE; after fclose `buf` holds
        // `len` bytes allocated by libc, copied and then freed exactly once.
        unsafe {
            sys::ucp_ep_print_info(ep, stream);
            libc::fclose(stream);
            let text = if buf.is_null() {
                String::new()
            } else {
                let bytes = std::slice::from_raw_parts(buf.cast::<u8>(), len);
                String::from_utf8_lossy(bytes).into_owned()
            };
            libc::free(buf.cast());
            Ok(text)
        }
    }
}

impl Endpoint {
    /// Closes the endpoint now, even while remote keys unpacked for it (held by puts still
    /// queued) keep this object alive: forced if the peer failed or the endpoint is supervised
    /// (its requests then complete with an error), else by flushing (they complete as the
    /// peer takes them). Later operations fail; a second call does nothing. Remote keys may
    /// outlive the close: UCX 1.13's `ucp_rkey_destroy` touches only the key and its worker.
    pub fn close(&self) {
        if self.closed.replace(true) {
            return;
        }
        let mut param = result::request_param();
        // FORCE needs PEER mode on both sides unless the peer is dead (ucp.h); an unsupervised
        // endpoint to a live peer closes by flushing.
        if self.supervised || self.failure().is_some() {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: the handle is live and closed once. FORCE completes the endpoint's
        // outstanding requests with an error (their owners still hold their buffers); either
        // mode marks it closed, after which UCX calls no error handler, so `state` may go.
        let ptr = unsafe { sys::ucp_ep_close_nbx(self.ptr.as_ptr(), &param) };
        match request_or_done("ucp_ep_close_nbx", ptr) {
            // SAFETY: a close request holds no buffer of ours; freeing it lets UCX release it
            // when it completes during a later progress or the worker's destruction.
            Ok(Some(req)) => unsafe { sys::ucp_request_free(req.as_ptr()) },
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "closing a UCX endpoint"),
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close();
        // SAFETY: the state came from Box::leak in `connect` and is freed once, here, after
        // the close (see `close`: no error handler runs any more).
        drop(unsafe { Box::from_raw(self.state.as_ptr()) });
    }
}
