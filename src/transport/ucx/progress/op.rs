//! What an operation in flight on the progress thread is: [`Pending`], a request filed with
//! the buffers it uses, and [`Op`], what it does and whom it answers, with the sources and
//! destinations ops carry ([`PutSource`], [`Receiving`]).
//!
//! Invariant: a `Pending` frees its request before its buffers go (field order), and is
//! dropped only once UCX reports the request ended (or leaked with it).

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;

use super::group::Group;
use crate::transport::RecvBuffers;
use crate::transport::ucx::command::{EndpointId, Received, Reply};
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::result::UcxError;
use crate::transport::ucx::safe::{RemoteKey, Request, Revocable, RevocableBox};
use crate::transport::ucx::sys;

/// An operation in flight: the request and the buffers it uses, dropped together only after
/// completion.
pub(super) struct Pending {
    // Field order: the request is freed before the buffers are released.
    pub(super) request: Request,
    pub(super) ep: Option<EndpointId>,
    pub(super) op: Op,
    pub(super) cancelled: bool,
    /// The watched endpoint failed (a receive from it was cancelled for that reason).
    pub(super) peer_failed: Option<sys::ucs_status_t>,
}

impl Pending {
    pub(super) fn new(request: Request, ep: Option<EndpointId>, op: Op) -> Pending {
        Pending {
            request,
            ep,
            op,
            cancelled: false,
            peer_failed: None,
        }
    }

    pub(super) fn cancel(&mut self) {
        self.cancelled = true;
        self.request.cancel();
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
        _parts: Vec<Bytes>,
        _from: Option<Arc<dyn RegisterableMemory>>,
        _iov: Vec<sys::ucp_dt_iov_t>,
        reply: Reply<()>,
    },
    /// A put; the runs of a
    /// [`Command::Write`](crate::transport::ucx::command::Command::Write) have no reply of
    /// their own (the flush that follows them answers).
    Put {
        /// The key the put writes with: destroyed only after the put completed.
        _key: Rc<RemoteKey>,
        _data: PutSource,
        reply: Option<Reply<()>>,
    },
    Flush {
        reply: Reply<()>,
    },
    Recv {
        buffer: Vec<u8>,
        capacity: usize,
        /// Whose buffer it is ([`crate::transport::RecvBuffers`]): it goes back there,
        /// filled or not.
        into: Option<Arc<dyn RecvBuffers>>,
        reply: Reply<Received>,
    },
    /// One run of a `Command::SendRuns` or `Command::RecvRuns` (`receiving`: a receive,
    /// of exactly `expect` bytes); its group answers.
    Run {
        _memory: Arc<dyn RegisterableMemory>,
        group: Rc<Group>,
        receiving: Option<Receiving>,
    },
}

impl Op {
    /// Answers the caller, if the operation has one.
    pub(super) fn answer(self, result: Result<(), UcxError>) {
        match self {
            Op::Send { reply, .. }
            | Op::Flush { reply }
            | Op::Put {
                reply: Some(reply), ..
            } => {
                let _ = reply.send(result);
            }
            Op::Run { group, .. } => group.done(result),
            Op::Put { reply: None, .. } | Op::Recv { .. } => {}
        }
    }

    pub(super) fn name(&self) -> &'static str {
        match self {
            Op::Send { .. } => "send_tag",
            Op::Put { .. } => "put",
            Op::Flush { .. } => "flush",
            Op::Recv { .. } => "recv_tag",
            Op::Run {
                receiving: None, ..
            } => "send_run",
            Op::Run {
                receiving: Some(_), ..
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
                receiving: Some(r), ..
            } => r.target.as_deref(),
            _ => None,
        }
    }

    pub(super) fn abandoned(&self) -> bool {
        match self {
            Op::Send { reply, .. }
            | Op::Flush { reply }
            | Op::Put {
                reply: Some(reply), ..
            } => reply.is_closed(),
            Op::Put { reply: None, .. } => false,
            Op::Recv { reply, .. } => reply.is_closed(),
            Op::Run { group, .. } => group.abandoned(),
        }
    }
}

/// What a put reads from, kept alive (in the put's Pending entry) until it completes.
pub(super) enum PutSource {
    Bytes(Bytes),
    Memory(Arc<dyn RegisterableMemory>),
}

impl PutSource {
    pub(super) fn base(&self) -> *const u8 {
        match self {
            PutSource::Bytes(b) => b.as_ptr(),
            PutSource::Memory(m) => m.base(),
        }
    }

    pub(super) fn size(&self) -> usize {
        match self {
            PutSource::Bytes(b) => b.len(),
            PutSource::Memory(m) => m.size(),
        }
    }

    pub(super) fn share(&self) -> PutSource {
        match self {
            PutSource::Bytes(b) => PutSource::Bytes(b.clone()),
            PutSource::Memory(m) => PutSource::Memory(m.clone()),
        }
    }
}

/// A receiving run: the length its message must have, and its [`Revocable`] destination on
/// an eager worker.
pub(super) struct Receiving {
    pub(super) expect: usize,
    pub(super) target: Option<RevocableBox>,
}
