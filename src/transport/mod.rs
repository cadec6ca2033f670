//! Transports move bytes between agents and know nothing of rooms.
//!
//! Two planes:
//! - the *control plane* carries protocol messages between a decode agent (which connects) and
//!   a prefill agent (which binds); it is always ZeroMQ over tcp ([`zmq::ControlServer`],
//!   [`zmq::ControlClient`]);
//! - the *data plane* carries chunks, each a header (an encoded protocol message) and a payload
//!   (staging bytes), from a prefill agent to a decode agent. It is what varies by transport:
//!   a decode agent listens with [`Transport::listen`] and advertises the endpoint in Hello; a
//!   prefill agent connects with [`Transport::connect`]. `zmq-tcp` and `zmq-ipc` are libzmq
//!   PUSH/PULL ([`libzmq::ZmqData`]; measured faster than the `zeromq` crate's, see
//!   docs/benchmarks.md).
//!
//! The trait is object-safe and small so that another transport (UCX) plugs in without
//! touching the agents: pick it with [`for_kind`].

pub mod libzmq;
#[cfg(feature = "ucx")]
pub mod ucx;
pub mod zmq;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;

/// A boxed future, for the object-safe trait methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Errors of a transport operation, naming the operation and the endpoint.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("{op} {endpoint}: {message}")]
pub struct TransportError {
    /// The operation that failed (`bind`, `connect`, `send`, `recv`).
    pub op: &'static str,
    /// The endpoint concerned.
    pub endpoint: String,
    /// What went wrong.
    pub message: String,
}

impl TransportError {
    pub(crate) fn new(op: &'static str, endpoint: &str, message: impl fmt::Display) -> Self {
        TransportError {
            op,
            endpoint: endpoint.to_owned(),
            message: message.to_string(),
        }
    }
}

/// The data-plane transports (design.md part 8 fixes the names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// ZeroMQ PUSH/PULL over tcp.
    ZmqTcp,
    /// ZeroMQ PUSH/PULL over a Unix socket (same host only).
    ZmqIpc,
    /// UCX tagged messages; UCX picks its transports from `UCX_TLS` (RDMA, tcp, shared memory).
    #[cfg(feature = "ucx")]
    Ucx,
}

impl TransportKind {
    /// Every transport this build has.
    pub const ALL: &'static [TransportKind] = &[
        TransportKind::ZmqTcp,
        TransportKind::ZmqIpc,
        #[cfg(feature = "ucx")]
        TransportKind::Ucx,
    ];

    /// The transport's name on the command line, in Hello and in bench JSON.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::ZmqTcp => "zmq-tcp",
            TransportKind::ZmqIpc => "zmq-ipc",
            #[cfg(feature = "ucx")]
            TransportKind::Ucx => "ucx",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        TransportKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = TransportKind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown transport {s:?}; this build has {}",
                    names.join(", ")
                )
            })
    }
}

/// Sends chunks to one receiver. Dropping it closes the connection.
pub trait DataSender: Send {
    /// Sends one chunk; resolves when the transport has taken the bytes.
    fn send(&mut self, header: Bytes, payload: Bytes) -> BoxFuture<'_, Result<(), TransportError>>;
}

/// Receives chunks from any number of senders.
pub trait DataReceiver: Send {
    /// The next chunk: its header and its payload.
    fn recv(&mut self) -> BoxFuture<'_, Result<(Bytes, Bytes), TransportError>>;

    /// A sender died: drop receives it may have left half-matched (they would never complete)
    /// and post fresh ones. Transports whose receives cannot hang on a dead sender do nothing.
    fn reset(&mut self) {}
}

/// A bound receiver and the endpoint senders connect to.
pub type Listening = (String, Box<dyn DataReceiver>);

/// A data-plane transport.
pub trait Transport: Send + Sync {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Binds a receiver on `host`; returns the endpoint senders connect to.
    fn listen(&self, host: &str) -> BoxFuture<'static, Result<Listening, TransportError>>;

    /// Connects a sender to a receiver's endpoint, failing after `timeout` if unreachable.
    fn connect(
        &self,
        endpoint: &str,
        timeout: std::time::Duration,
    ) -> BoxFuture<'static, Result<Box<dyn DataSender>, TransportError>>;
}

/// The transport of a kind, for chunks of at most `max_chunk` payload bytes.
pub fn for_kind(kind: TransportKind, max_chunk: usize) -> Arc<dyn Transport> {
    match kind {
        #[cfg(feature = "ucx")]
        TransportKind::Ucx => Arc::new(ucx::data::UcxData::new(max_chunk)),
        _ => {
            let _ = max_chunk; // ZeroMQ frames carry their own length.
            Arc::new(libzmq::ZmqData::new(kind))
        }
    }
}
