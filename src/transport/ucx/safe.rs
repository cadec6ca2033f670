//! Safe owners of UCP handles: [`Context`], [`Worker`], [`Endpoint`], [`MemHandle`],
//! [`RemoteKey`], [`Request`].
//!
//! Invariants:
//! - each is a `NonNull` handle released exactly once in `Drop` (which never panics);
//! - each holds an `Rc` of the object it was made from (a worker its context, an endpoint its
//!   worker, a remote key its endpoint, a request its worker), so parents outlive children and
//!   destruction follows UCX's required order by construction; the one exception is
//!   [`Endpoint::close`], which closes an endpoint whose remote keys are still held (by puts in
//!   flight), as UCX allows;
//! - a peer's worker address or rkey reaches UCX only validated and copied ([`super::packed`]);
//! - `Rc` makes them `!Send` and `!Sync`: all calls happen on the thread that created them,
//!   which is what `UCS_THREAD_MODE_SINGLE` requires;
//! - operations that hand UCX a buffer are `unsafe fn`: the caller keeps the buffer alive and
//!   unmoved until the returned [`Request`] completes ([`super::worker`] does so by owning
//!   buffer and request together);
//! - every request of a [`Worker`] reports its end through a callback into the worker's list
//!   ([`Worker::completed`]), so finding what ended costs nothing per request still running.
//!
//! Receives that can be revoked are in [`super::revocable`].

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::atomic::{AtomicI8, Ordering};

use super::result::{self, check, request_or_done};
use super::sys::{self, ucs_status_t};
use super::{UcxError, packed};

/// Settings every context gets, over the environment's and the caller's: the worker address
/// format [`super::packed`] validates peers' addresses against. UCX 1.13 parses an address by
/// its own settings (in unified mode without the lengths a peer packed), so both sides must
/// use this one.
const FORCED_VARS: [(&str, &str); 2] = [("ADDRESS_VERSION", "v1"), ("UNIFIED_MODE", "n")];

/// A UCP context (`ucp_init`) with tag matching and wakeup, and RMA when asked for.
///
/// RMA (`UCP_FEATURE_RMA`) is a trust decision, not a speed setting: a context with it installs
/// libucx's software put and get handlers on every transport without native RMA (tcp, shared
/// memory), which execute any connected peer's put or get at whatever address it names, in this
/// process, with no key check. Only a writer over transports whose hardware checks remote keys
/// (RDMA) asks for it (`transport/ucx/data.rs`).
pub struct Context {
    ptr: NonNull<sys::ucp_context>,
    rma: bool,
}

impl Context {
    /// Reads UCX's config (defaults, then `UCX_*` environment), applies `vars` on top (names
    /// without the `UCX_` prefix, e.g. `("TLS", "tcp")`) and initialises a context for one
    /// worker, with RMA when `rma` (see [`Context`]).
    pub fn new(vars: &[(String, String)], rma: bool) -> Result<Rc<Context>, UcxError> {
        let config = result::config_read()?;
        let context = Self::init_with(config, vars, rma);
        // SAFETY: config came from config_read and is released exactly once, here; ucp_init
        // copies what it needs.
        unsafe { result::config_release(config) };
        context
    }

    fn init_with(
        config: NonNull<sys::ucp_config_t>,
        vars: &[(String, String)],
        rma: bool,
    ) -> Result<Rc<Context>, UcxError> {
        let forced = FORCED_VARS.iter().map(|&(n, v)| (n, v));
        for (name, value) in vars
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .chain(forced)
        {
            // SAFETY: config is live until the caller releases it after this function.
            unsafe { result::config_modify(config, name, value) }?;
        }
        let name = c"kvferry";
        let params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES
                | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                | sys::UCP_PARAM_FIELD_NAME,
            features: sys::UCP_FEATURE_TAG
                | sys::UCP_FEATURE_WAKEUP
                | if rma { sys::UCP_FEATURE_RMA } else { 0 },
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: name.as_ptr(),
        };
        // SAFETY: params is fully initialised and only the fields in field_mask are read;
        // config is live (see above).
        let ptr = unsafe { result::init(&params, config) }?;
        Ok(Rc::new(Context { ptr, rma }))
    }

    /// The raw handle, for [`super::result`] calls.
    pub fn as_ptr(&self) -> NonNull<sys::ucp_context> {
        self.ptr
    }

    /// Whether this context has RMA: one-sided writes, and peers' puts and gets run here.
    pub fn rma(&self) -> bool {
        self.rma
    }

    /// The memory types this context sends and receives (`ucp_context_query`).
    pub fn memory_types(&self) -> Result<super::MemoryTypes, UcxError> {
        // SAFETY: the handle is live for as long as `self`.
        unsafe { result::context_memory_types(self.ptr) }.map(super::MemoryTypes)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the handle is live; every worker and memory handle holds an Rc of this
        // context, so none is left when this runs.
        unsafe { sys::ucp_cleanup(self.ptr.as_ptr()) }
    }
}

/// A UCP worker in single-thread mode.
pub struct Worker {
    ptr: NonNull<sys::ucp_worker>,
    /// Filled by the completion callbacks of this worker's requests.
    ended: Completions,
    _context: Rc<Context>,
}

/// A request's end as its completion callback saw it.
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    /// The request ([`Request::key`]).
    pub request: usize,
    /// `UCS_OK`, or why it failed (`UCS_ERR_CANCELED` after [`Request::cancel`]).
    pub status: ucs_status_t,
    /// For a tagged receive: the sender's tag and the length received.
    pub info: sys::ucp_tag_recv_info_t,
}

/// Where completion callbacks record ends. UCX calls them on the worker's thread, inside
/// progress or cancel; a `Cell` (taken, pushed, put back) has no borrow that could fail there.
#[derive(Default)]
struct Completions(Cell<Vec<Completion>>);

impl Completions {
    fn push(&self, c: Completion) {
        let mut ended = self.0.take();
        ended.push(c);
        self.0.set(ended);
    }
}

/// Completion callback of sends, puts and flushes.
unsafe extern "C" fn on_sent(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void) {
    // SAFETY: user_data is the `Completions` of the request's worker (`Worker::tracked`), which
    // outlives its requests (each holds an Rc of it); UCX calls back on the worker's thread and
    // never after the request was freed. Nothing here can panic across the FFI boundary.
    let ended = unsafe { &*user_data.cast::<Completions>() };
    ended.push(Completion {
        request: request as usize,
        status,
        info: sys::ucp_tag_recv_info_t::default(),
    });
}

/// Completion callback of tagged receives.
unsafe extern "C" fn on_received(
    request: *mut c_void,
    status: ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    user_data: *mut c_void,
) {
    // SAFETY: as in `on_sent`; `info`, when not null, points to UCX's record of the receive,
    // valid during the call.
    let (ended, info) = unsafe {
        (
            &*user_data.cast::<Completions>(),
            info.as_ref().copied().unwrap_or_default(),
        )
    };
    ended.push(Completion {
        request: request as usize,
        status,
        info,
    });
}

impl Worker {
    /// Creates a worker of `context`.
    pub fn new(context: &Rc<Context>) -> Result<Rc<Worker>, UcxError> {
        let name = c"kvferry-worker";
        // SAFETY: ucp_worker_params_t is plain old data (integers, pointers, an array), for
        // which all-zero bytes are valid; only the fields in field_mask are read.
        let mut params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE | sys::UCP_WORKER_PARAM_FIELD_NAME;
        params.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        params.name = name.as_ptr();
        // SAFETY: the context is live (we hold an Rc of it).
        let ptr = unsafe { result::worker_create(context.ptr, &params) }?;
        Ok(Rc::new(Worker {
            ptr,
            ended: Completions::default(),
            _context: context.clone(),
        }))
    }

    /// The raw handle, for calls of [`super::result`] and tests.
    pub fn as_ptr(&self) -> NonNull<sys::ucp_worker> {
        self.ptr
    }

    /// The requests that ended since the last call, in the order they ended. A request ending
    /// at once when started (`Started::Done`) is not reported.
    pub fn completed(&self) -> Vec<Completion> {
        self.ended.0.take()
    }

    /// Request parameters whose completion is reported by [`Worker::completed`].
    fn tracked(&self, receive: bool) -> sys::ucp_request_param_t {
        let mut param = result::request_param();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb = if receive {
            sys::ucp_request_param_cb {
                recv: Some(on_received),
            }
        } else {
            sys::ucp_request_param_cb {
                send: Some(on_sent),
            }
        };
        param.user_data = (&raw const self.ended).cast_mut().cast();
        param
    }

    /// The worker's address, to give to peers (they connect with [`Endpoint::connect`]).
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        // SAFETY: the worker is live and used on its own thread (`Worker` is !Send).
        unsafe { result::worker_address(self.ptr) }
    }

    /// One round of progress; the number of events it handled.
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is live and used on its own thread.
        unsafe { sys::ucp_worker_progress(self.ptr.as_ptr()) }
    }

    /// The event file descriptor to sleep on after [`Worker::arm`]. Owned by UCX.
    pub fn event_fd(&self) -> Result<i32, UcxError> {
        // SAFETY: the worker is live; the context has UCP_FEATURE_WAKEUP.
        unsafe { result::worker_efd(self.ptr) }
    }

    /// Arms the event fd: `Ok(true)` when it is safe to sleep, `Ok(false)` when events are
    /// pending and the caller must progress first.
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: the worker is live and used on its own thread.
        unsafe { result::worker_arm(self.ptr) }
    }

    /// Posts a tagged receive of at most `capacity` bytes into `buffer`. Always returns a
    /// request (`UCP_OP_ATTR_FLAG_NO_IMM_CMPL`): UCX 1.13 does not report the received tag
    /// and length of an immediate completion, the completion callback does (UCX calls it
    /// inside this call then).
    ///
    /// # Safety
    /// `buffer` is valid for writes of `capacity` bytes and stays allocated and unmoved until
    /// the returned request completes (or forever, if the worker is leaked).
    pub unsafe fn tag_recv(
        self: &Rc<Self>,
        buffer: *mut u8,
        capacity: usize,
        tag: u64,
        mask: u64,
        memory: super::MemoryType,
    ) -> Result<Started<()>, UcxError> {
        // SAFETY: the caller's contract.
        unsafe {
            self.recv_as(
                buffer.cast(),
                capacity,
                sys::UCP_DATATYPE_BYTES,
                tag,
                mask,
                memory,
            )
        }
    }

    /// `ucp_tag_recv_nbx` of `count` elements of `datatype` at `buffer` (`memory` of that
    /// kind), reported through [`Worker::completed`], never completing at once.
    ///
    /// # Safety
    /// What `datatype` writes through `buffer` stays valid until the request completes.
    pub(super) unsafe fn recv_as(
        self: &Rc<Self>,
        buffer: *mut c_void,
        count: usize,
        datatype: sys::ucp_datatype_t,
        tag: u64,
        mask: u64,
        memory: super::MemoryType,
    ) -> Result<Started<()>, UcxError> {
        let mut param = self.tracked(true);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE
            | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE
            | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        param.datatype = datatype;
        param.memory_type = memory.raw();
        // SAFETY: the worker is live; buffer validity is the caller's contract.
        let ptr =
            unsafe { sys::ucp_tag_recv_nbx(self.ptr.as_ptr(), buffer, count, tag, mask, &param) };
        Ok(match request_or_done("ucp_tag_recv_nbx", ptr)? {
            None => Started::Done(()),
            Some(req) => Started::Pending(Request::new(req, self)),
        })
    }

    /// Drops every tagged message waiting unexpected (no receive was posted for it) whose tag's
    /// top 32 bits are not `keep`, and returns how many: each is received into nothing, which
    /// UCX ends as truncated, discarding its bytes (those of its fragments still on the way
    /// too) and telling a rendezvous sender. `seen` gets each one's tag and length. Messages
    /// under `keep` stay queued for a receive to come.
    pub fn drop_unexpected(&self, keep: u32, mut seen: impl FnMut(u64, usize)) -> usize {
        let mut dropped = 0;
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: as below; a probe that removes nothing only looks. An empty queue (the usual
        // case) costs this one call.
        let any = unsafe { sys::ucp_tag_probe_nb(self.ptr.as_ptr(), 0, 0, 0, &mut info) };
        if any.is_null() {
            return 0;
        }
        // A tag outside `keep` differs from it in at least one of its top 32 bits: one probe
        // per bit, matching the tags whose bit differs from `keep`'s.
        for bit in 32..64 {
            let mask = 1u64 << bit;
            let tag = !(u64::from(keep) << 32) & mask;
            loop {
                let mut info = sys::ucp_tag_recv_info_t::default();
                // SAFETY: the worker is live and used on its own thread; `info` is a valid
                // out-pointer for the call.
                let message =
                    unsafe { sys::ucp_tag_probe_nb(self.ptr.as_ptr(), tag, mask, 1, &mut info) };
                if message.is_null() {
                    break;
                }
                // No callback and no buffer: nothing is written, nothing reported.
                let param = result::request_param();
                // SAFETY: `message` was just removed from the queue by the probe, as the call
                // requires; a receive of 0 bytes never touches its (null) buffer.
                let ptr = unsafe {
                    sys::ucp_tag_msg_recv_nbx(
                        self.ptr.as_ptr(),
                        std::ptr::null_mut(),
                        0,
                        message,
                        &param,
                    )
                };
                if sys::ucs_ptr_is_ptr(ptr) {
                    // SAFETY: a request of this worker, freed once: UCX finishes it on its own
                    // (a request freed before it ends is released when it ends).
                    unsafe { sys::ucp_request_free(ptr) };
                }
                seen(info.sender_tag, info.length);
                dropped += 1;
            }
        }
        dropped
    }

    /// Starts flushing every endpoint of the worker.
    pub fn flush(self: &Rc<Self>) -> Result<Started<()>, UcxError> {
        let param = self.tracked(false);
        // SAFETY: the worker is live; the param sets only the completion callback.
        let ptr = unsafe { sys::ucp_worker_flush_nbx(self.ptr.as_ptr(), &param) };
        Ok(match request_or_done("ucp_worker_flush_nbx", ptr)? {
            None => Started::Done(()),
            Some(req) => Started::Pending(Request::new(req, self)),
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: the handle is live; endpoints and requests hold an Rc of this worker, so
        // none is left when this runs.
        unsafe { sys::ucp_worker_destroy(self.ptr.as_ptr()) }
    }
}

/// An operation UCX either completed at once or still runs.
pub enum Started<T> {
    /// Completed during the call (with what it produced).
    Done(T),
    /// In flight: its end is reported by [`Worker::completed`] during progress.
    Pending(Request),
}

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
    worker: Rc<Worker>,
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
            sys::ucp_ep_create(worker.ptr.as_ptr(), &params, &mut ep)
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
    fn live(&self, op: &'static str) -> Result<*mut sys::ucp_ep, UcxError> {
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

    /// Starts a tagged send of the `parts` (one message: their concatenation), all of them
    /// `memory` of one kind (UCX takes one memory type per request).
    ///
    /// # Safety
    /// Every `(pointer, length)` in `parts` is readable, and `parts` itself (UCX keeps a
    /// pointer to the iov array) stays allocated and unmoved, until the request completes.
    pub unsafe fn tag_send(
        &self,
        parts: &[sys::ucp_dt_iov_t],
        tag: u64,
        memory: super::MemoryType,
    ) -> Result<Started<()>, UcxError> {
        let mut param = self.worker.tracked(false);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.memory_type = memory.raw();
        let (buffer, count) = match parts {
            [one] => {
                param.datatype = sys::UCP_DATATYPE_BYTES;
                (one.buffer.cast_const(), one.length)
            }
            many => {
                param.datatype = sys::UCP_DATATYPE_IOV;
                (many.as_ptr().cast::<c_void>(), many.len())
            }
        };
        let ep = self.live("ucp_tag_send_nbx")?;
        // SAFETY: the endpoint is live; buffer validity is the caller's contract.
        let ptr = unsafe { sys::ucp_tag_send_nbx(ep, buffer, count, tag, &param) };
        Ok(match request_or_done("ucp_tag_send_nbx", ptr)? {
            None => Started::Done(()),
            Some(req) => Started::Pending(Request::new(req, &self.worker)),
        })
    }

    /// Starts a put of `len` bytes at `buffer` to `remote_addr` in the region of `rkey`.
    ///
    /// # Safety
    /// `buffer` is readable for `len` bytes until the request completes; `remote_addr..+len`
    /// lies in the region `rkey` was packed from (the caller checked the peer's bounds).
    pub unsafe fn put(
        &self,
        buffer: *const u8,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Started<()>, UcxError> {
        let mut param = self.worker.tracked(false);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.datatype = sys::UCP_DATATYPE_BYTES;
        param.memory_type = sys::UCS_MEMORY_TYPE_HOST;
        let ep = self.live("ucp_put_nbx")?;
        // SAFETY: endpoint and rkey are live (the rkey holds an Rc of its endpoint); buffer and
        // bounds are the caller's contract.
        let ptr = unsafe {
            sys::ucp_put_nbx(
                ep,
                buffer.cast(),
                len,
                remote_addr,
                rkey.ptr.as_ptr(),
                &param,
            )
        };
        Ok(match request_or_done("ucp_put_nbx", ptr)? {
            None => Started::Done(()),
            Some(req) => Started::Pending(Request::new(req, &self.worker)),
        })
    }

    /// Starts a flush: completes once every operation started on this endpoint has completed
    /// remotely (puts are visible in the peer's memory).
    pub fn flush(&self) -> Result<Started<()>, UcxError> {
        let param = self.worker.tracked(false);
        let ep = self.live("ucp_ep_flush_nbx")?;
        // SAFETY: the endpoint is live; the param sets only the completion callback.
        let ptr = unsafe { sys::ucp_ep_flush_nbx(ep, &param) };
        Ok(match request_or_done("ucp_ep_flush_nbx", ptr)? {
            None => Started::Done(()),
            Some(req) => Started::Pending(Request::new(req, &self.worker)),
        })
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

    /// Unpacks a remote key the peer packed with [`MemHandle::rkey`].
    pub fn unpack_rkey(self: &Rc<Self>, packed: &[u8]) -> Result<RemoteKey, UcxError> {
        // UCX reads the key without a length and reports no malformed framing (a 2-byte key
        // "unpacks"): only a validated copy reaches it.
        packed::check_rkey(packed)?;
        let owned = packed::owned_copy(packed);
        let ep = self.live("ucp_ep_rkey_unpack")?;
        let mut rkey = ptr::null_mut();
        // SAFETY: the endpoint is live; `owned` holds a packed rkey whose every framed length
        // lies inside it (checked above) followed by zeroes, readable for the call (UCX copies
        // what it keeps).
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(ep, owned.as_ptr().cast(), &mut rkey)
        })?;
        let ptr = NonNull::new(rkey)
            .ok_or_else(|| UcxError::call("ucp_ep_rkey_unpack", sys::UCS_ERR_NO_MESSAGE))?;
        Ok(RemoteKey {
            ptr,
            _ep: self.clone(),
        })
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

/// Memory registered with a context (`ucp_mem_map` of an existing buffer): host memory, or
/// CUDA device memory where the context handles it.
pub struct MemHandle {
    ptr: NonNull<sys::ucp_mem>,
    context: Rc<Context>,
}

impl MemHandle {
    /// Registers `len` bytes at `base`, `memory` of that kind
    /// (`UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`), for local and remote reads and writes.
    ///
    /// # Safety
    /// The memory stays mapped (and is not reused for anything else) until the handle drops.
    pub unsafe fn map(
        context: &Rc<Context>,
        base: *mut u8,
        len: usize,
        memory: super::MemoryType,
    ) -> Result<Self, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_PROT
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: base.cast(),
            length: len,
            flags: 0,
            prot: sys::UCP_MEM_MAP_PROT_LOCAL_READ
                | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
                | sys::UCP_MEM_MAP_PROT_REMOTE_READ
                | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE,
            memory_type: memory.raw(),
        };
        let mut memh = ptr::null_mut();
        // SAFETY: the context is live; the memory's lifetime is the caller's contract.
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(context.ptr.as_ptr(), &params, &mut memh)
        })?;
        let ptr = NonNull::new(memh)
            .ok_or_else(|| UcxError::call("ucp_mem_map", sys::UCS_ERR_NO_MESSAGE))?;
        Ok(MemHandle {
            ptr,
            context: context.clone(),
        })
    }

    /// The packed remote key: bytes a peer unpacks with [`Endpoint::unpack_rkey`].
    pub fn rkey(&self) -> Result<Vec<u8>, UcxError> {
        // SAFETY: both handles are live and the memory was mapped in this context.
        unsafe { result::rkey_pack(self.context.ptr, self.ptr) }
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and unmapped once; the context outlives it (Rc).
        let status = unsafe { sys::ucp_mem_unmap(self.context.ptr.as_ptr(), self.ptr.as_ptr()) };
        if status != sys::UCS_OK {
            tracing::warn!(error = %result::status_name(status), "ucp_mem_unmap");
        }
    }
}

/// A peer's remote key, unpacked for one endpoint.
pub struct RemoteKey {
    ptr: NonNull<sys::ucp_rkey>,
    _ep: Rc<Endpoint>,
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: the key is live and destroyed once, before its endpoint (held by Rc).
        unsafe { sys::ucp_rkey_destroy(self.ptr.as_ptr()) }
    }
}

/// An in-flight UCP request. Dropping it frees it (`ucp_request_free`); UCX then releases it
/// whenever it completes, so the *buffer* of an incomplete request must outlive it: its owner
/// cancels, progresses to completion, and only then drops both.
pub struct Request {
    ptr: NonNull<c_void>,
    worker: Rc<Worker>,
}

impl Request {
    fn new(ptr: NonNull<c_void>, worker: &Rc<Worker>) -> Self {
        Request {
            ptr,
            worker: worker.clone(),
        }
    }

    /// The request's identity while it is live: its [`Completion::request`]. UCX may reuse
    /// the address for a new request once this one is freed.
    pub fn key(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Asks UCX to cancel (receives are cancelled; sends and puts run on until they complete
    /// or their endpoint closes). Its end is still reported by [`Worker::completed`].
    pub fn cancel(&self) {
        // SAFETY: request and worker are live; cancelling a completed request does nothing.
        unsafe { sys::ucp_request_cancel(self.worker.ptr.as_ptr(), self.ptr.as_ptr()) }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: freed once; the worker is live (Rc).
        unsafe { sys::ucp_request_free(self.ptr.as_ptr()) }
    }
}
