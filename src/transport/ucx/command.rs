//! The vocabulary a [`UcxWorker`](super::UcxWorker) handle and its progress thread share: the
//! [`Command`]s the handle sends, the [`Reply`] each carries, and the ids and results they
//! name ([`EndpointId`], [`MemId`], [`RemoteRegionId`], [`Received`], [`Registered`]).
//!
//! Invariant: every command carries the sender of its own reply, so a caller that drops its
//! future is seen by the thread as a closed reply.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::region::RegisterableMemory;
use super::result::UcxError;
use crate::memory::{Span, WriteRun};
use crate::transport::RecvBuffers;

/// An endpoint of one [`UcxWorker`](super::UcxWorker) (a connection to one remote worker).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EndpointId(pub u64);

/// A memory registration of one [`UcxWorker`](super::UcxWorker).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemId(pub u64);

/// A peer's registered memory, as one [`UcxWorker`](super::UcxWorker) knows it (endpoint +
/// unpacked key + bounds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegionId(pub u64);

/// A received tagged message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    /// The sender's tag (it matched the receive's tag under its mask).
    pub tag: u64,
    /// The message.
    pub data: Bytes,
}

/// A registration: what a peer needs (in Hello) to put into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    /// Local id, for [`UcxWorker::unregister`](super::UcxWorker::unregister).
    pub id: MemId,
    /// Address of the first byte, in this process.
    pub base: u64,
    /// Bytes registered.
    pub size: u64,
    /// The packed remote key.
    pub rkey: Bytes,
}

pub(super) type Reply<T> = oneshot::Sender<Result<T, UcxError>>;

/// What the progress thread is asked to do.
pub(super) enum Command {
    Connect {
        address: Bytes,
        reply: Reply<EndpointId>,
    },
    Disconnect {
        ep: EndpointId,
        reply: Reply<()>,
    },
    SendTag {
        ep: EndpointId,
        tag: u64,
        parts: Vec<Bytes>,
        /// Ranges of memory sent after `parts`, in order, in the same message.
        from: Option<(Arc<dyn RegisterableMemory>, Vec<Span>)>,
        reply: Reply<()>,
    },
    RecvTag {
        tag: u64,
        mask: u64,
        capacity: usize,
        from: Option<EndpointId>,
        /// Whose buffer the message lands in (a fresh allocation when `None`).
        into: Option<Arc<dyn RecvBuffers>>,
        reply: Reply<Received>,
    },
    Register {
        memory: Arc<dyn RegisterableMemory>,
        reply: Reply<Registered>,
    },
    Unregister {
        id: MemId,
        reply: Reply<()>,
    },
    AddRemote {
        ep: EndpointId,
        base: u64,
        size: u64,
        rkey: Bytes,
        reply: Reply<RemoteRegionId>,
    },
    Put {
        region: RemoteRegionId,
        offset: u64,
        data: Bytes,
        reply: Reply<()>,
    },
    Flush {
        ep: EndpointId,
        reply: Reply<()>,
    },
    Write {
        region: RemoteRegionId,
        source: Arc<dyn RegisterableMemory>,
        runs: Vec<WriteRun>,
        reply: Reply<()>,
    },
    Ping {
        reply: Reply<()>,
    },
    SendRuns {
        ep: EndpointId,
        tag: u64,
        source: Arc<dyn RegisterableMemory>,
        runs: Vec<Span>,
        reply: Reply<()>,
    },
    RecvRuns {
        tag: u64,
        memory: Arc<dyn RegisterableMemory>,
        runs: Vec<Vec<Span>>,
        /// Answered once every receive is posted (dropped if they are not).
        posted: oneshot::Sender<()>,
        cancel: Arc<AtomicBool>,
        reply: Reply<()>,
    },
    Describe {
        ep: EndpointId,
        reply: Reply<String>,
    },
    FailEndpoint {
        ep: EndpointId,
        reply: Reply<()>,
    },
    Supervised {
        ep: EndpointId,
        reply: Reply<bool>,
    },
    Shutdown {
        reply: Option<oneshot::Sender<()>>,
    },
}
