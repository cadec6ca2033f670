//! [`Worker`]: a UCP worker in single-thread mode, its progress and wakeup, its tagged
//! receives; the [`Request`]s its operations run as ([`Started`]: done at once, or a request),
//! and the list their completion callbacks fill ([`Worker::completed`]).
//!
//! Invariants: a worker is destroyed only after every endpoint and request made from it (each
//! holds an `Rc` of it); every request it starts reports its end through [`Completion`]s,
//! never through polling; the buffers of an incomplete request are its owner's to keep until
//! it ends.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::rc::Rc;

use super::context::Context;
use crate::transport::ucx::memory_type::MemoryType;
use crate::transport::ucx::result::{self, UcxError, request_or_done};
use crate::transport::ucx::sys::{self, ucs_status_t};

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
        let ptr = unsafe { result::worker_create(context.as_ptr(), &params) }?;
        Ok(Rc::new(Worker {
            ptr,
            ended: Completions::default(),
            _context: context.clone(),
        }))
    }

    /// The raw handle, for calls of [`crate::transport::ucx::result`] and tests.
    pub fn as_ptr(&self) -> NonNull<sys::ucp_worker> {
        self.ptr
    }

    /// The requests that ended since the last call, in the order they ended. A request ending
    /// at once when started (`Started::Done`) is not reported.
    pub fn completed(&self) -> Vec<Completion> {
        self.ended.0.take()
    }

    /// Request parameters whose completion is reported by [`Worker::completed`].
    pub(super) fn tracked(&self, receive: bool) -> sys::ucp_request_param_t {
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

    /// The worker's address, to give to peers (they connect with
    /// [`Endpoint::connect`](super::Endpoint::connect)).
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
        memory: MemoryType,
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
        memory: MemoryType,
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

/// An in-flight UCP request. Dropping it frees it (`ucp_request_free`); UCX then releases it
/// whenever it completes, so the *buffer* of an incomplete request must outlive it: its owner
/// cancels, progresses to completion, and only then drops both.
pub struct Request {
    ptr: NonNull<c_void>,
    worker: Rc<Worker>,
}

impl Request {
    pub(super) fn new(ptr: NonNull<c_void>, worker: &Rc<Worker>) -> Self {
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
