//! What an operation in flight on the progress thread is: [`Pending`], an operation filed with
//! the endpoint it watches, and [`Op`], what it does, the request that owns what it lent UCX,
//! and whom it answers ([`Run`]: a placed run's request; [`PutSource`]: what a put command
//! reads).
//!
//! Invariant: a `Pending` is dropped only once UCX reports its request ended (its request
//! then hands back what it lent), or leaked with it.

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;

use super::group::Group;
use crate::transport::RecvBuffers;
use crate::transport::ucx::command::{EndpointId, Received, Reply};
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::safe::{
    Completion, MemoryRange, Message, Put, RecvBuffer, Request, Revocable, RevocableBox, Source,
};
use crate::transport::ucx::sys;

/// An operation in flight, filed until UCX reports its request ended.
pub(super) struct Pending {
    pub(super) ep: Option<EndpointId>,
    pub(super) op: Op,
    pub(super) cancelled: bool,
    /// The watched endpoint failed (a receive from it was cancelled for that reason).
    pub(super) peer_failed: Option<sys::ucs_status_t>,
}

/// Applies `$body` to the request of `$op`, whatever it lent UCX, bound to `$r`.
macro_rules! on_request {
    ($op:expr, $r:ident => $body:expr) => {
        match $op {
            Op::Send { request: $r, .. } => $body,
            Op::Put { request: $r, .. } => $body,
            Op::Flush { request: $r, .. } => $body,
            Op::Recv { request: $r, .. } => $body,
            Op::Run {
                request: Run::Range($r),
                ..
            } => $body,
            Op::Run {
                request: Run::Revocable($r),
                ..
            } => $body,
        }
    };
}

impl Pending {
    pub(super) fn new(ep: Option<EndpointId>, op: Op) -> Pending {
        Pending {
            ep,
            op,
            cancelled: false,
            peer_failed: None,
        }
    }

    /// Its request's [`Request::key`].
    pub(super) fn key(&self) -> usize {
        on_request!(&self.op, r => r.key())
    }

    pub(super) fn cancel(&mut self) {
        self.cancelled = true;
        on_request!(&self.op, r => r.cancel());
    }

    /// What the operation is.
    pub(super) fn op(&self) -> &Op {
        &self.op
    }

    /// Whether it is a revoked receive: it writes nothing any more, ended or not.
    pub(super) fn revoked(&self) -> bool {
        self.op.revocable().is_some_and(Revocable::revoked)
    }
}

pub(super) enum Op {
    Send {
        request: Request<Message>,
        reply: Reply<()>,
    },
    /// A put (its request holds the key it writes with); the runs of a
    /// [`Command::Write`](crate::transport::ucx::command::Command::Write) have no reply of
    /// their own (the flush that follows them answers).
    Put {
        request: Request<Put<Source>>,
        reply: Option<Reply<()>>,
    },
    Flush {
        request: Request<()>,
        reply: Reply<()>,
    },
    Recv {
        request: Request<RecvBuffer>,
        capacity: usize,
        /// Whose buffer it is ([`crate::transport::RecvBuffers`]): it goes back there,
        /// filled or not.
        into: Option<Arc<dyn RecvBuffers>>,
        reply: Reply<Received>,
    },
    /// One run of a `Command::SendRuns` or `Command::RecvRuns` (`expect`: a receive, of
    /// exactly that many bytes); its group answers.
    Run {
        request: Run,
        group: Rc<Group>,
        expect: Option<usize>,
    },
}

/// A placed run's request: from or into a range of memory, or into a [`Revocable`] on an
/// eager worker.
pub(super) enum Run {
    Range(Request<MemoryRange>),
    Revocable(Request<RevocableBox>),
}

impl Run {
    /// Ends the run's request with `c` (see [`Request::end`]): its status and the length
    /// received, or the run and `c` back.
    pub(super) fn end(
        self,
        c: Completion,
    ) -> Result<(sys::ucs_status_t, usize), (Run, Completion)> {
        match self {
            Run::Range(r) => r
                .end(c)
                .map(|e| (e.status, e.info.length))
                .map_err(|(r, c)| (Run::Range(r), c)),
            Run::Revocable(r) => r
                .end(c)
                .map(|e| (e.status, e.info.length))
                .map_err(|(r, c)| (Run::Revocable(r), c)),
        }
    }
}

impl Op {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Op::Send { .. } => "send_tag",
            Op::Put { .. } => "put",
            Op::Flush { .. } => "flush",
            Op::Recv { .. } => "recv_tag",
            Op::Run { expect: None, .. } => "send_run",
            Op::Run {
                expect: Some(_), ..
            } => "recv_run",
        }
    }

    pub(super) fn group(&self) -> Option<&Rc<Group>> {
        match self {
            Op::Run { group, .. } => Some(group),
            _ => None,
        }
    }

    /// A receiving run's revocable destination.
    pub(super) fn revocable(&self) -> Option<&Revocable> {
        match self {
            Op::Run {
                request: Run::Revocable(r),
                ..
            } => Some(r.target()),
            _ => None,
        }
    }

    pub(super) fn abandoned(&self) -> bool {
        match self {
            Op::Send { reply, .. }
            | Op::Flush { reply, .. }
            | Op::Put {
                reply: Some(reply), ..
            } => reply.is_closed(),
            Op::Put { reply: None, .. } => false,
            Op::Recv { reply, .. } => reply.is_closed(),
            Op::Run { group, .. } => group.abandoned(),
        }
    }
}

/// What the puts of a command read, cut into one [`Source`] per run.
pub(super) enum PutSource {
    Bytes(Bytes),
    Memory(Arc<dyn RegisterableMemory>),
}

impl PutSource {
    pub(super) fn size(&self) -> usize {
        match self {
            PutSource::Bytes(b) => b.len(),
            PutSource::Memory(m) => m.size(),
        }
    }
}
