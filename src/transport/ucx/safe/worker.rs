//! [`Worker`]: a UCP worker in single-thread mode, its progress and wakeup, its tagged
//! receives; the [`Request`]s its operations run as ([`Started`]: done at once, or a request
//! owning what it lent UCX), the list their completion callbacks fill ([`Worker::completed`])
//! and how a request ends ([`Request::end`]).
//!
//! Invariants: a worker is destroyed only after every endpoint and request made from it (each
//! holds an `Rc` of it); every request it starts reports its end through one [`Completion`],
//! never through polling; a request owns what it lent UCX until its completion ends it, and a
//! request dropped before that leaks what it holds, never frees it.

use std::cell::Cell;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::rc::Rc;

use super::context::Context;

/// Where a receive's message comes from.
enum From {
    /// The next to arrive whose tag matches `tag` under `mask` (or one waiting unexpected).
    Tag { tag: u64, mask: u64 },
    /// One taken off the queue.
    Parked(Parked),
}

/// A message taken off UCX's unexpected queue ([`Worker::park_unexpected`]), to be received
/// ([`Worker::receive_parked`]) or dropped ([`Worker::discard`]) by the worker's thread: UCX
/// holds it (an eager message's bytes, a rendezvous one's request) until then.
pub struct Parked {
    message: sys::ucp_tag_message_h,
    /// Its tag.
    pub tag: u64,
    /// Its length, as its sender gave it.
    pub len: usize,
}
use super::lent::{Incoming, Lent};
use crate::transport::ucx::memory_type::{MemoryType, MemoryTypes};
use crate::transport::ucx::result::{self, UcxError, request_or_done};
use crate::transport::ucx::sys::{self, ucs_status_t};

/// A UCP worker in single-thread mode.
pub struct Worker {
    ptr: NonNull<sys::ucp_worker>,
    /// Filled by the completion callbacks of this worker's requests.
    ended: Completions,
    /// What its context moves: memory of another kind is refused before UCX sees it.
    memory_types: MemoryTypes,
    _context: Rc<Context>,
}

/// A request's end as its completion callback saw it: made only there, once per request, and
/// consumed by the [`Request::end`] it reports.
#[derive(Debug)]
pub struct Completion {
    request: usize,
    status: ucs_status_t,
    info: sys::ucp_tag_recv_info_t,
}

impl Completion {
    /// The request that ended ([`Request::key`]).
    pub fn request(&self) -> usize {
        self.request
    }
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
        let memory_types = context.memory_types()?;
        // SAFETY: the context is live (we hold an Rc of it).
        let ptr = unsafe { result::worker_create(context.as_ptr(), &params) }?;
        Ok(Rc::new(Worker {
            ptr,
            ended: Completions::default(),
            memory_types,
            _context: context.clone(),
        }))
    }

    /// The raw handle, for calls of [`crate::transport::ucx::result`] and tests.
    pub fn as_ptr(&self) -> NonNull<sys::ucp_worker> {
        self.ptr
    }

    /// The memory types its context sends and receives (`ucp_context_query`).
    pub fn memory_types(&self) -> MemoryTypes {
        self.memory_types
    }

    /// `Ok` when the context moves memory of kind `memory`; a typed refusal of `op` otherwise.
    pub fn moves(&self, op: &'static str, memory: MemoryType) -> Result<(), UcxError> {
        match self.memory_types.has(memory) {
            true => Ok(()),
            false => Err(UcxError::MemoryType {
                op,
                memory,
                why: "this libucx reports no support for it (ucp_context_query)",
            }),
        }
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

    /// Posts a tagged receive into `into`, which the request owns until it ends (a message
    /// longer than `into` ends it as truncated); memory of a kind the context does not move is
    /// refused. Always returns a request
    /// (`UCP_OP_ATTR_FLAG_NO_IMM_CMPL`): UCX 1.13 does not report the received tag and length
    /// of an immediate completion, the completion callback does (UCX calls it inside this
    /// call then). `into` comes back with the error when the receive is not posted.
    pub fn tag_recv<L: Incoming>(
        self: &Rc<Self>,
        into: L,
        tag: u64,
        mask: u64,
    ) -> Result<Started<L>, (UcxError, L)> {
        self.receive(into, From::Tag { tag, mask })
    }

    /// Receives into `into` the next message matching a tag, or one taken off the queue.
    fn receive<L: Incoming>(
        self: &Rc<Self>,
        mut into: L,
        from: From,
    ) -> Result<Started<L>, (UcxError, L)> {
        let op = match from {
            From::Tag { .. } => "ucp_tag_recv_nbx",
            From::Parked(_) => "ucp_tag_msg_recv_nbx",
        };
        let raw = match (into.incoming()).and_then(|raw| self.moves(op, raw.memory).map(|()| raw)) {
            Ok(raw) => raw,
            Err(e) => {
                if let From::Parked(parked) = from {
                    self.discard(parked);
                }
                return Err((e, into));
            }
        };
        let mut param = self.tracked(true);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE
            | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE
            | sys::UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        param.datatype = raw.datatype;
        param.memory_type = raw.memory.raw();
        let worker = self.ptr.as_ptr();
        // SAFETY: the worker is live and used on its own thread; what `raw` describes stays
        // writable, in place, while `into` lives (`Incoming`), and `into` goes into the
        // request, which keeps it until UCX reports the receive ended (or leaks it), or comes
        // back from `started` only when UCX did not post the receive. A parked message was
        // removed from the queue by a probe of this worker and is received once (consumed).
        let ptr = unsafe {
            match from {
                From::Tag { tag, mask } => {
                    sys::ucp_tag_recv_nbx(worker, raw.buffer, raw.count, tag, mask, &param)
                }
                From::Parked(p) => {
                    sys::ucp_tag_msg_recv_nbx(worker, raw.buffer, raw.count, p.message, &param)
                }
            }
        };
        self.started(op, ptr, into)
    }

    /// What a call that lent UCX `lent` returned: done (UCX is through with `lent`), a
    /// request that owns `lent`, or an error (UCX kept nothing).
    pub(super) fn started<L: Lent>(
        self: &Rc<Self>,
        op: &'static str,
        ptr: sys::ucs_status_ptr_t,
        lent: L,
    ) -> Result<Started<L>, (UcxError, L)> {
        match request_or_done(op, ptr) {
            Ok(None) => Ok(Started::Done(lent)),
            Ok(Some(req)) => Ok(Started::Pending(Request::new(req, self, lent))),
            Err(e) => Err((e, lent)),
        }
    }

    /// Drops every tagged message waiting unexpected (no receive was posted for it) whose tag's
    /// top 32 bits are not `keep`, and returns how many: each is received into nothing, which
    /// UCX ends as truncated, discarding its bytes (those of its fragments still on the way
    /// too) and telling a rendezvous sender. `seen` gets each one's tag and length. Messages
    /// under `keep` stay queued for a receive to come (or [`Worker::park_unexpected`]).
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
            while let Some(parked) = self.take_unexpected(tag, mask) {
                seen(parked.tag, parked.len);
                self.discard(parked);
                dropped += 1;
            }
        }
        dropped
    }

    /// Takes off UCX's queue every message waiting unexpected under `keep` whose tag's low 32
    /// bits have any of the bits `low` set (every message under `keep` when `low` has every
    /// bit), for `park` to hold: each must then be received
    /// ([`Worker::receive_parked`]) or dropped ([`Worker::discard`]). Under the bits a
    /// worker's posted receives match, UCX would otherwise keep a message no receive ever
    /// takes for as long as the process lives.
    pub fn park_unexpected(&self, keep: u32, low: u32, mut park: impl FnMut(Parked)) {
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: as in `take_unexpected`; a probe that removes nothing only looks.
        let any = unsafe { sys::ucp_tag_probe_nb(self.ptr.as_ptr(), 0, 0, 0, &mut info) };
        if any.is_null() {
            return;
        }
        let base = u64::from(keep) << 32;
        if low == u32::MAX {
            // Every message under `keep`, in the order they arrived.
            while let Some(parked) = self.take_unexpected(base, 0xffff_ffff_0000_0000) {
                park(parked);
            }
            return;
        }
        for bit in (0..32).filter(|b| low & (1 << b) != 0) {
            let mask = 0xffff_ffff_0000_0000 | (1u64 << bit);
            while let Some(parked) = self.take_unexpected(base | (1u64 << bit), mask) {
                park(parked);
            }
        }
    }

    /// The first message waiting unexpected whose tag matches `tag` under `mask`, taken off
    /// UCX's queue.
    fn take_unexpected(&self, tag: u64, mask: u64) -> Option<Parked> {
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: the worker is live and used on its own thread; `info` is a valid out-pointer
        // for the call.
        let message = unsafe { sys::ucp_tag_probe_nb(self.ptr.as_ptr(), tag, mask, 1, &mut info) };
        (!message.is_null()).then_some(Parked {
            message,
            tag: info.sender_tag,
            len: info.length,
        })
    }

    /// Drops a message taken off the queue: received into nothing, which UCX ends as
    /// truncated, discarding its bytes and telling a rendezvous sender.
    pub fn discard(&self, parked: Parked) {
        // No callback and no buffer: nothing is written, nothing reported.
        let param = result::request_param();
        // SAFETY: `parked.message` was removed from the queue by a probe of this worker and is
        // received once (`Parked` is consumed); a receive of 0 bytes never touches its (null)
        // buffer.
        let ptr = unsafe {
            sys::ucp_tag_msg_recv_nbx(
                self.ptr.as_ptr(),
                std::ptr::null_mut(),
                0,
                parked.message,
                &param,
            )
        };
        if sys::ucs_ptr_is_ptr(ptr) {
            // SAFETY: a request of this worker, freed once: UCX finishes it on its own (a
            // request freed before it ends is released when it ends).
            unsafe { sys::ucp_request_free(ptr) };
        }
    }

    /// Receives a message taken off the queue into `into`, as [`Worker::tag_recv`] receives
    /// one that matches it (a longer message ends it as truncated).
    pub fn receive_parked<L: Incoming>(
        self: &Rc<Self>,
        into: L,
        parked: Parked,
    ) -> Result<Started<L>, (UcxError, L)> {
        self.receive(into, From::Parked(parked))
    }

    /// Starts flushing every endpoint of the worker.
    pub fn flush(self: &Rc<Self>) -> Result<Started<()>, UcxError> {
        let param = self.tracked(false);
        // SAFETY: the worker is live; the param sets only the completion callback.
        let ptr = unsafe { sys::ucp_worker_flush_nbx(self.ptr.as_ptr(), &param) };
        self.started("ucp_worker_flush_nbx", ptr, ())
            .map_err(|(e, ())| e)
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
pub enum Started<L> {
    /// Completed during the call: what it lent UCX, back.
    Done(L),
    /// In flight: its end is reported by [`Worker::completed`] during progress.
    Pending(Request<L>),
}

/// An in-flight UCP request and what it lent UCX (`L`), which it owns until UCX reports its
/// end: [`Request::end`] with that report frees the request and hands `L` back.
///
/// Dropped before that, it cancels the request and leaks it, `L` and its worker: UCX may still
/// read or write `L`, and the request's address (the key its report carries) stays taken, so
/// that report can end no other request.
pub struct Request<L = ()> {
    ptr: NonNull<c_void>,
    worker: ManuallyDrop<Rc<Worker>>,
    lent: ManuallyDrop<L>,
}

/// How a request ended, with what it lent UCX.
pub struct Ended<L> {
    /// What the request lent UCX, UCX done with it.
    pub lent: L,
    /// `UCS_OK`, or why it failed (`UCS_ERR_CANCELED` after [`Request::cancel`]).
    pub status: ucs_status_t,
    /// For a tagged receive: the sender's tag and the length received.
    pub info: sys::ucp_tag_recv_info_t,
}

impl<L> Request<L> {
    fn new(ptr: NonNull<c_void>, worker: &Rc<Worker>, lent: L) -> Self {
        Request {
            ptr,
            worker: ManuallyDrop::new(worker.clone()),
            lent: ManuallyDrop::new(lent),
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

    /// What the request lent, for the safe layer's own looks at it.
    pub(super) fn lent(&self) -> &L {
        &self.lent
    }
}

impl<L: Lent> Request<L> {
    /// Ends the request with `c`, UCX's report of its end: frees the request and hands back
    /// what it lent, with how it ended. `Err` gives both back when `c` reports another
    /// request.
    ///
    /// A report is this request's when it carries its key: a request is freed only here,
    /// after its one report is consumed (a dropped request is never freed), so no other
    /// request of any worker holds that address while the report exists.
    pub fn end(self, c: Completion) -> Result<Ended<L>, (Self, Completion)> {
        if c.request != self.key() {
            return Err((self, c));
        }
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped nor used after its fields are taken, once each.
        let (worker, mut lent) = unsafe {
            (
                ManuallyDrop::take(&mut this.worker),
                ManuallyDrop::take(&mut this.lent),
            )
        };
        // SAFETY: the request ended (`c` is its report), so UCX releases it now and uses
        // `lent` no more; freed once, with its worker live (held until after the call).
        unsafe { sys::ucp_request_free(this.ptr.as_ptr()) };
        drop(worker);
        // SAFETY: once, with the report of the request `lent` was lent to.
        unsafe { lent.ended(c.status, &c.info) };
        Ok(Ended {
            lent,
            status: c.status,
            info: c.info,
        })
    }
}

impl<L> Drop for Request<L> {
    fn drop(&mut self) {
        // Not ended (`end` takes the request apart without dropping it): UCX may still use
        // what it lent. Cancel, and leak the lent value and the worker (ManuallyDrop), and
        // the request itself (never freed, see `Request`).
        self.cancel();
        tracing::warn!(
            request = self.key(),
            "a UCX request dropped before it ended: leaking it, what it lent UCX and its worker"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::transport::ucx::UcxConfig;
    use crate::transport::ucx::safe::RecvBuffer;

    /// A request ends only with its own report: given another request's, it comes back with
    /// that report, still posted; each then ends with its own, handing its buffer back.
    #[test]
    fn a_request_ends_only_with_its_own_report() {
        let context = Context::new(UcxConfig::tcp_loopback().vars(), false).unwrap();
        let worker = Worker::new(&context).unwrap();
        let post = |tag| {
            let buffer = RecvBuffer::new(Vec::with_capacity(8), 8).unwrap();
            match worker.tag_recv(buffer, tag, u64::MAX) {
                Ok(Started::Pending(request)) => request,
                _ => panic!("the receive of tag {tag} was not posted"),
            }
        };
        let (a, b) = (post(1), post(2));
        a.cancel();
        b.cancel();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut ended = Vec::new();
        while ended.len() < 2 {
            assert!(Instant::now() < deadline, "cancelled receives never ended");
            worker.progress();
            ended.extend(worker.completed());
        }
        let b_first = ended[0].request() == b.key();
        let (of_a, of_b) = match (ended.pop(), ended.pop()) {
            (Some(last), Some(first)) if b_first => (last, first),
            (Some(last), Some(first)) => (first, last),
            _ => unreachable!("two reports"),
        };
        let Err((a, of_b)) = a.end(of_b) else {
            panic!("a request ended with another's report");
        };
        for (request, report) in [(a, of_a), (b, of_b)] {
            let Ok(ended) = request.end(report) else {
                panic!("a request refused its own report");
            };
            assert_eq!(ended.status, sys::UCS_ERR_CANCELED);
            assert_eq!(ended.lent.into_vec().capacity(), 8);
        }
    }
}
