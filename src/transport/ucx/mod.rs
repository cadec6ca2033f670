//! UCX (UCP API; libucx 1.13 or 1.22, whichever libucp the process loads: [`version`]) for the
//! data plane: tagged sends of chunks, one-sided puts into a peer's registered memory, and
//! peer-failure reporting.
//!
//! Layers, bottom up (cudarc's sys / result / safe split):
//! - [`sys`]: raw `extern "C"` declarations and `#[repr(C)]` structs, checked against the
//!   headers by tests/in_process/ucx_layer.rs;
//! - [`result`]: [`UcxError`] and one thin function per call, returning `Result<_, UcxError>`;
//! - [`safe`]: one file per handle kind (`Context`, `Worker` and its `Request`s, `Endpoint`,
//!   `MemHandle`, `RemoteKey`, `Revocable`, and the progress thread's `Wakeup`): `NonNull`
//!   handles with RAII `Drop`, each keeping its parent alive (`Rc`), so nothing is destroyed
//!   before what depends on it; and one (`lent.rs`) for what operations lend UCX, owned by
//!   their requests until they end. The UCP ones are `!Send`: UCP objects never leave the
//!   thread that made them;
//! - [`worker`]: [`UcxWorker`], a cloneable async handle to one progress thread
//!   (`progress.rs`) that owns a context and a worker, takes commands (`command.rs`) over a
//!   channel and replies through oneshots; `config.rs` holds how a worker is built
//!   ([`UcxConfig`]);
//! - [`data`]: the agents' data plane over workers.
//!
//! `unsafe` is allowed in `sys`, `result`, `safe` and [`region`] (memory registered with UCX)
//! only: the progress thread lends UCX buffers through [`safe`]'s operations, which own them
//! until their requests end.
//!
//! Invariants:
//! - every buffer UCX reads or writes is owned by the request of its operation in the progress
//!   thread ([`safe::Request`]: `Bytes` or an `Arc` of registered memory for sends and puts, a
//!   `Vec<u8>` or an `Arc` of registered memory for receives) or by its registration, never
//!   borrowed by a future; a dropped future only marks its operation abandoned, and the thread
//!   cancels it and waits for UCX to complete it before releasing the buffer;
//! - on an eager worker ([`UcxConfig::eager`], tcp) a placed run is received through this
//!   crate's own unpack callback ([`safe::Revocable`]): a cancel revokes it at once, so its
//!   place in the pool is the caller's again even while UCX never ends the request (a sender
//!   that died mid-message);
//! - endpoints use `UCP_ERR_HANDLING_MODE_PEER`: when a peer dies the error handler records it
//!   and every pending or later operation on that endpoint fails with
//!   [`UcxError::PeerFailed`];
//! - without libucx installed the crate does not build with the `ucx` feature (the libraries
//!   are linked); the feature is off by default.

mod command;
mod config;
pub mod data;
pub mod devices;
pub mod memory_type;
pub mod packed;
mod progress;
pub mod region;
pub mod result;
pub mod safe;
pub mod settings;
pub mod sys;
pub mod version;
pub mod worker;

pub use crate::memory::{Span, WriteRun};
pub use command::{EndpointId, MemId, Received, Registered, RemoteRegionId};
pub use config::{UcxConfig, Unexpected};
pub use memory_type::{MemoryType, MemoryTypes};
pub use region::{Region, RegisterableMemory};
pub use result::UcxError;
pub use version::UcxVersion;
pub use worker::UcxWorker;
