//! Safe owners of the handles the UCX layer holds, one file per kind: UCP's [`Context`]
//! (context.rs), [`Worker`] with the [`Request`]s it runs (worker.rs), [`Endpoint`]
//! (endpoint.rs), [`MemHandle`] (registration.rs), [`RemoteKey`] with its [`Put`]s
//! (remote_key.rs), what operations lend UCX (lent.rs: [`Message`], [`MemoryRange`],
//! [`RecvBuffer`], [`Source`]) and [`Revocable`] receive destinations (revocable.rs); and two
//! of the OS's, the progress thread's [`Wakeup`] eventfd (wakeup.rs) and the host's
//! [`interfaces()`] (interfaces.rs).
//!
//! Invariants:
//! - each UCP handle is a `NonNull` released exactly once, in `Drop` (which never panics), a
//!   request in [`Request::end`];
//! - each holds an `Rc` of the object it was made from (a worker its context, an endpoint its
//!   worker, a remote key its endpoint, a request its worker), so parents outlive children and
//!   destruction follows UCX's required order by construction; the one exception is
//!   [`Endpoint::close`], which closes an endpoint whose remote keys are still held (by puts in
//!   flight), as UCX allows;
//! - a peer's worker address or rkey reaches UCX only validated and copied
//!   ([`super::packed`]);
//! - `Rc` makes the UCP handles `!Send` and `!Sync`: all calls happen on the thread that
//!   created them, which is what `UCS_THREAD_MODE_SINGLE` requires;
//! - operations that hand UCX a buffer take it by value, as an owner ([`Outgoing`] for what UCX
//!   reads, [`Incoming`] for what it writes, each checked against its memory when it is made),
//!   and the returned [`Request`] keeps it until [`Request::end`], with the request's
//!   [`Completion`], hands it back (a receive buffer counting the bytes UCX reported); a
//!   request dropped before it ended leaks it, never frees it; a put also holds its
//!   [`RemoteKey`], whose region's bounds it is checked against; a registration owns its
//!   memory;
//! - every request of a [`Worker`] reports its end through a callback into the worker's list
//!   ([`Worker::completed`]), so finding what ended costs nothing per request still running.
#![allow(unsafe_code)]

mod context;
mod endpoint;
mod interfaces;
mod lent;
mod registration;
mod remote_key;
mod revocable;
mod wakeup;
mod worker;

pub use context::Context;
pub use endpoint::Endpoint;
pub use interfaces::interfaces;
pub use lent::{Incoming, Lent, MemoryRange, Message, Outgoing, RawBuffer, RecvBuffer, Source};
pub use registration::MemHandle;
pub use remote_key::{Put, RemoteKey};
pub use revocable::{Revocable, RevocableBox};
pub use wakeup::Wakeup;
pub use worker::{Completion, Ended, Parked, Request, Started, Worker};
