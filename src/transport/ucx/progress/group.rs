//! [`Group`]: the requests of one command that answer their caller together (the runs of a
//! send or a receive of placed runs), once every one has ended, with the first error.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::transport::ucx::command::Reply;
use crate::transport::ucx::result::UcxError;
use crate::transport::ucx::sys;

/// The requests of one command, answered together: once every one has completed, with the
/// first error.
pub(super) struct Group {
    remaining: Cell<usize>,
    error: RefCell<Option<UcxError>>,
    reply: RefCell<Option<Reply<()>>>,
    /// Set by the caller to cancel the group's receives (it keeps waiting for the answer).
    cancel: Option<Arc<AtomicBool>>,
    /// Whether the group's requests were cancelled.
    cancelled: Cell<bool>,
    /// The keys of the group's requests ([`crate::transport::ucx::safe::Request::key`]),
    /// ended ones included: a key found in flight is the group's only if its op says so.
    pub(super) requests: RefCell<Vec<usize>>,
}

impl Group {
    pub(super) fn new(
        count: usize,
        reply: Reply<()>,
        cancel: Option<Arc<AtomicBool>>,
    ) -> Rc<Group> {
        Rc::new(Group {
            remaining: Cell::new(count),
            error: RefCell::new(None),
            reply: RefCell::new(Some(reply)),
            cancel,
            cancelled: Cell::new(false),
            requests: RefCell::new(Vec::new()),
        })
    }

    /// Records one request's end; the last one answers.
    pub(super) fn done(&self, result: Result<(), UcxError>) {
        if let Err(e) = result {
            self.error.borrow_mut().get_or_insert(e);
        }
        let left = self.remaining.get().saturating_sub(1);
        self.remaining.set(left);
        if left == 0
            && let Some(reply) = self.reply.borrow_mut().take()
        {
            let _ = reply.send(self.error.borrow_mut().take().map_or(Ok(()), Err));
        }
    }

    /// Whether the caller cancelled the group or stopped waiting for it.
    pub(super) fn abandoned(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Acquire))
            || self.reply.borrow().as_ref().is_none_or(|r| r.is_closed())
    }

    /// True once, when the group is abandoned: its requests are then to be cancelled.
    pub(super) fn take_cancel(&self) -> bool {
        let cancel = !self.cancelled.get() && self.abandoned();
        self.cancelled.set(self.cancelled.get() || cancel);
        cancel
    }

    /// Answers the caller now that its runs are revoked (their requests may end later, or
    /// never): they write nothing more.
    pub(super) fn revoked(&self) {
        if let Some(reply) = self.reply.borrow_mut().take() {
            let cancelled = UcxError::call("recv_run", sys::UCS_ERR_CANCELED);
            let _ = reply.send(Err(cancelled));
        }
    }

    /// Whether every request has ended and the caller was answered.
    pub(super) fn answered(&self) -> bool {
        self.reply.borrow().is_none()
    }

    /// The keys of the group's requests.
    pub(super) fn requests(&self) -> Vec<usize> {
        self.requests.borrow().clone()
    }
}
