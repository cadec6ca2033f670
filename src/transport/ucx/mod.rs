//! UCX (system libucx 1.13, UCP API) for the data plane: tagged sends of chunks, one-sided puts
//! into a peer's registered memory, and peer-failure reporting.
//!
//! Layers, bottom up:
//! - [`sys`]: raw `extern "C"` declarations and `#[repr(C)]` structs, checked against the
//!   headers by tests/in_process/ucx_layer.rs;
//! - [`result`]: one thin function per call, returning `Result<_, UcxError>`;
//! - [`safe`]: `Context`, `Worker`, `Endpoint`, `MemHandle`, `RemoteKey`, `Request`: `NonNull`
//!   handles with RAII `Drop`, each keeping its parent alive (`Rc`), so nothing is destroyed
//!   before what depends on it. They are `!Send`: UCP objects never leave the thread that made
//!   them;
//! - [`worker`] (with `progress.rs`): [`UcxWorker`], a cloneable async handle to one progress
//!   thread that owns a context and a worker, takes commands over a channel and replies
//!   through oneshots.
//!
//! Invariants:
//! - every buffer UCX reads or writes is owned by the operation in the progress thread (`Bytes`
//!   for sends and puts, a `Vec<u8>` for receives, an `Arc` of the region for registrations),
//!   never borrowed by a future; a dropped future only marks its operation abandoned, and the
//!   thread cancels it and waits for UCX to complete it before releasing the buffer;
//! - on an eager worker ([`UcxConfig::eager`], tcp) a placed run is received through this
//!   crate's own unpack callback ([`revocable::Revocable`]): a cancel revokes it at once, so its
//!   place in the pool is the caller's again even while UCX never ends the request (a sender
//!   that died mid-message);
//! - endpoints use `UCP_ERR_HANDLING_MODE_PEER`: when a peer dies the error handler records it
//!   and every pending or later operation on that endpoint fails with
//!   [`UcxError::PeerFailed`];
//! - without libucx installed the crate does not build with the `ucx` feature (the libraries
//!   are linked); the feature is off by default.
#![allow(unsafe_code)]

pub mod data;
pub mod devices;
pub mod packed;
mod progress;
pub mod region;
pub mod result;
pub mod revocable;
pub mod safe;
pub mod settings;
pub mod sys;
pub mod worker;

pub use region::{Region, RegisterableMemory};
pub use worker::{
    EndpointId, MemId, Received, Registered, RemoteRegionId, Span, UcxConfig, UcxWorker,
    Unexpected, WriteRun,
};

/// The kinds of memory a UCP context sends from and receives into, as `ucp_context_query`
/// reports them (`UCP_ATTR_FIELD_MEMORY_TYPES`: a bitmap of `ucs_memory_type_t`). UCX finds
/// them at run time: a libucx built with CUDA (its `cuda_copy`/`cuda_ipc` transports loaded
/// and a CUDA driver present) reports [`MemoryType::Cuda`]; Debian's libucx 1.13, built
/// without CUDA, reports host memory only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryTypes(pub u64);

impl MemoryTypes {
    /// Whether `kind` is among them.
    pub fn has(self, kind: MemoryType) -> bool {
        self.0 & (1 << kind.raw()) != 0
    }

    /// Whether UCX can send CUDA device memory and receive into it.
    pub fn sends_device_memory(self) -> bool {
        self.has(MemoryType::Cuda)
    }
}

/// Where memory that UCX reads or writes lives: every send, receive and registration names it
/// (`UCP_OP_ATTR_FIELD_MEMORY_TYPE`, `UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`), so that UCX
/// never has to guess a pointer's kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Host memory (`UCS_MEMORY_TYPE_HOST`).
    #[default]
    Host,
    /// CUDA device memory (`UCS_MEMORY_TYPE_CUDA`): only where [`MemoryTypes::sends_device_memory`].
    Cuda,
}

impl MemoryType {
    /// The `ucs_memory_type_t` value.
    pub fn raw(self) -> sys::ucs_memory_type_t {
        match self {
            MemoryType::Host => sys::UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => sys::UCS_MEMORY_TYPE_CUDA,
        }
    }
}

/// Errors of the UCX layer. [`UcxError::is_peer_failure`] separates a dead peer (fail the
/// rooms it touched) from a local problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxError {
    /// A UCX call returned an error status.
    #[error("{op}: {name} ({status})")]
    Call {
        /// The UCP function or operation.
        op: &'static str,
        /// The raw `ucs_status_t`.
        status: i8,
        /// `ucs_status_string` of it.
        name: String,
    },
    /// The peer of an endpoint failed (its error handler ran, or the operation completed with
    /// a connection error): the endpoint is dead, and so is every operation on it.
    #[error("{op} on endpoint {endpoint}: peer failed: {name} ({status})")]
    PeerFailed {
        /// The operation that observed the failure.
        op: &'static str,
        /// The endpoint, as [`EndpointId`] numbers it.
        endpoint: u64,
        /// The raw `ucs_status_t` UCX reported.
        status: i8,
        /// `ucs_status_string` of it.
        name: String,
    },
    /// A received message was longer than the receive buffer.
    #[error("recv: a message matching the tag is longer than the {capacity}-byte buffer")]
    Truncated {
        /// Bytes the receive could hold.
        capacity: usize,
    },
    /// A placed message ([`UcxWorker::recv_runs`]) of another length than its run: shorter
    /// (`got`), or longer (`None`: UCX truncated it).
    #[error("recv_run: expected a {expected}-byte message, got {}", match got { Some(n) => format!("{n} bytes"), None => "a longer one".to_owned() })]
    Length {
        /// Bytes of the run.
        expected: usize,
        /// Bytes received, when not longer.
        got: Option<usize>,
    },
    /// An id this worker does not know (never created, or already removed).
    #[error("{what} {id} is unknown to this worker")]
    Unknown {
        /// `endpoint`, `memory` or `remote region`.
        what: &'static str,
        /// The id.
        id: u64,
    },
    /// Memory of a kind this worker's context cannot move (CUDA memory on a libucx built
    /// without CUDA, or where the run-time CUDA support did not load): refused before UCX
    /// sees the pointer.
    #[error("{op}: UCX cannot move {memory:?} memory here ({why})")]
    MemoryType {
        /// The operation refused.
        op: &'static str,
        /// The memory's kind.
        memory: MemoryType,
        /// Why (what the context supports, or the path that takes host memory only).
        why: &'static str,
    },
    /// A put outside the remote region the peer advertised.
    #[error("put of {len} bytes at offset {offset} exceeds the remote region of {size} bytes")]
    OutOfBounds {
        /// Offset into the region.
        offset: u64,
        /// Bytes to write.
        len: usize,
        /// Bytes of the region.
        size: u64,
    },
    /// A UCX config variable that UCX refused.
    #[error("UCX config {name}={value}: {reason}")]
    Config {
        /// Variable name without the `UCX_` prefix.
        name: String,
        /// Value.
        value: String,
        /// Why.
        reason: String,
    },
    /// An operating-system call of the progress thread failed (eventfd, poll, thread spawn).
    #[error("{op}: {message}")]
    Os {
        /// The call.
        op: &'static str,
        /// The OS error.
        message: String,
    },
    /// A peer's worker address or remote key that does not have the shape UCX 1.13 packs;
    /// refused before any UCX call ([`packed`]).
    #[error(transparent)]
    Malformed(#[from] packed::Malformed),
    /// A remote region (one-sided writes) on a worker whose context has no RMA
    /// ([`UcxConfig::rma`]): refused before UCX sees the key.
    #[error(
        "one-sided writes need a UCX context with RMA, which kvferry asks for only over RDMA \
         transports (UCX_TLS naming only rc/dc transports)"
    )]
    NoRma,
    /// The progress thread has stopped (shut down, or failed at start): nothing more runs.
    #[error("the UCX worker has shut down")]
    WorkerGone,
}

impl UcxError {
    /// True when the error means the remote peer is gone (fail its rooms, do not retry).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, UcxError::PeerFailed { .. })
    }

    /// A [`UcxError::Call`] for `status`, with its name from UCX.
    pub(crate) fn call(op: &'static str, status: sys::ucs_status_t) -> Self {
        UcxError::Call {
            op,
            status,
            name: result::status_name(status),
        }
    }
}
