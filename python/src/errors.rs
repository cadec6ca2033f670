//! One exception hierarchy, created once with the module: `kvferry.Error` and below it one
//! class per kind of refusal ([`RoomError`]), one per room failure code ([`FailureCode`]), and
//! the package's own (bad options, memory that does not fit, an agent that cannot start, a
//! wait that ran out of time). The message is always kvferry's own.

// `create_exception!` declares its types `pub`; they are reachable from Python only.
#![allow(unreachable_pub)]

use kvferry::agent::RoomError;
use kvferry::reason::{FailureCode, Reason};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(kvferry, Error, PyException, "Every error kvferry raises.");
create_exception!(
    kvferry,
    ConfigError,
    Error,
    "The agent's options were refused."
);
create_exception!(
    kvferry,
    RegionError,
    Error,
    "The engine's memory does not fit the layout, or is not memory kvferry can use."
);
create_exception!(
    kvferry,
    StartError,
    Error,
    "The agent could not start (registry, sockets)."
);
create_exception!(
    kvferry,
    WaitTimeout,
    Error,
    "The room was not final when the wait's timeout ran out; it goes on."
);

create_exception!(
    kvferry,
    BadRequest,
    Error,
    "The request is malformed or can never be served as given."
);
create_exception!(
    kvferry,
    UnknownRoom,
    Error,
    "The agent does not know the room (never created, taken, or expired)."
);
create_exception!(
    kvferry,
    Conflict,
    Error,
    "The request conflicts with the room's state."
);
create_exception!(
    kvferry,
    Exhausted,
    Error,
    "No capacity now (rooms or agent-owned pages); retry later or elsewhere."
);
create_exception!(
    kvferry,
    Unavailable,
    Error,
    "The agent cannot serve now: it is draining or closed."
);
create_exception!(
    kvferry,
    Forbidden,
    Error,
    "The request names a registry the decode does not trust with its token (neither \
     --bootstrap's nor in --allowed-registries); nothing was sent to it."
);

create_exception!(
    kvferry,
    RoomFailed,
    Error,
    "The room failed; `code`, `message` and `view` say how."
);
create_exception!(
    kvferry,
    PeerDead,
    RoomFailed,
    "peer_dead: the peer stopped answering heartbeats or its connection died."
);
create_exception!(
    kvferry,
    TimeoutBootstrap,
    RoomFailed,
    "timeout_bootstrap: the prefill group did not register in time."
);
create_exception!(
    kvferry,
    TimeoutReady,
    RoomFailed,
    "timeout_ready: the prefill engine did not announce the room's pages in time."
);
create_exception!(
    kvferry,
    TimeoutStall,
    RoomFailed,
    "timeout_stall: a transfer made no progress in time."
);
create_exception!(
    kvferry,
    Aborted,
    RoomFailed,
    "aborted: an engine or a peer aborted the room."
);
create_exception!(
    kvferry,
    Checksum,
    RoomFailed,
    "checksum: a chunk's checksum did not match its bytes."
);
create_exception!(
    kvferry,
    IncompatibleLayout,
    RoomFailed,
    "incompatible_layout: the peers' KV layouts cannot be paired."
);
create_exception!(
    kvferry,
    IncompatibleVersion,
    RoomFailed,
    "incompatible_version: the peers share no protocol version."
);
create_exception!(
    kvferry,
    Unreachable,
    RoomFailed,
    "unreachable: an advertised address could not be reached."
);
create_exception!(
    kvferry,
    Unauthorized,
    RoomFailed,
    "unauthorized: the peer refused our token."
);
create_exception!(
    kvferry,
    BadMessage,
    RoomFailed,
    "bad_message: a message was malformed or inconsistent with the room."
);
create_exception!(
    kvferry,
    VerifyFailed,
    RoomFailed,
    "verify_failed: landed bytes differ from the synthetic pattern."
);
create_exception!(
    kvferry,
    PeerUnknownRoom,
    RoomFailed,
    "unknown_room: the peer does not know the room."
);
create_exception!(
    kvferry,
    Shutdown,
    RoomFailed,
    "shutdown: the agent is shutting down."
);
create_exception!(
    kvferry,
    PromptMismatch,
    RoomFailed,
    "prompt_mismatch: the decode's prompt differs from the one the prefill computed the room's KV for."
);

/// The exception type of a failure code (exhaustive: a new code does not compile without one).
fn failure_type(py: Python<'_>, code: FailureCode) -> Bound<'_, pyo3::types::PyType> {
    match code {
        FailureCode::PeerDead => py.get_type::<PeerDead>(),
        FailureCode::TimeoutBootstrap => py.get_type::<TimeoutBootstrap>(),
        FailureCode::TimeoutReady => py.get_type::<TimeoutReady>(),
        FailureCode::TimeoutStall => py.get_type::<TimeoutStall>(),
        FailureCode::Aborted => py.get_type::<Aborted>(),
        FailureCode::Checksum => py.get_type::<Checksum>(),
        FailureCode::IncompatibleLayout => py.get_type::<IncompatibleLayout>(),
        FailureCode::IncompatibleVersion => py.get_type::<IncompatibleVersion>(),
        FailureCode::Unreachable => py.get_type::<Unreachable>(),
        FailureCode::Unauthorized => py.get_type::<Unauthorized>(),
        FailureCode::BadMessage => py.get_type::<BadMessage>(),
        FailureCode::VerifyFailed => py.get_type::<VerifyFailed>(),
        FailureCode::UnknownRoom => py.get_type::<PeerUnknownRoom>(),
        FailureCode::Shutdown => py.get_type::<Shutdown>(),
        FailureCode::PromptMismatch => py.get_type::<PromptMismatch>(),
    }
}

/// The exception of a refused room operation.
pub(crate) fn room_error(e: RoomError) -> PyErr {
    let message = e.to_string();
    match e {
        RoomError::BadRequest(_) => BadRequest::new_err(message),
        RoomError::UnknownRoom(_) => UnknownRoom::new_err(message),
        RoomError::Conflict(_) => Conflict::new_err(message),
        RoomError::Exhausted(_) => Exhausted::new_err(message),
        RoomError::Unavailable(_) => Unavailable::new_err(message),
        RoomError::Forbidden(_) => Forbidden::new_err(message),
    }
}

/// The exception of a failed room: the reason's class, message `code: message`, and the
/// attributes `room`, `code`, `message`, `view`.
pub(crate) fn room_failed(
    py: Python<'_>,
    room: u64,
    reason: &Reason,
    view: Bound<'_, PyDict>,
) -> PyErr {
    let err = PyErr::from_type(
        failure_type(py, reason.code),
        format!("room {room}: {reason}"),
    );
    let value = err.value(py);
    let set = || -> PyResult<()> {
        value.setattr("room", room)?;
        value.setattr("code", reason.code.name())?;
        value.setattr("message", &reason.message)?;
        value.setattr("view", view)?;
        Ok(())
    };
    match set() {
        Ok(()) => err,
        Err(e) => e,
    }
}

/// A wait's timeout, with the room's last view as `view`.
pub(crate) fn wait_timeout(
    py: Python<'_>,
    room: u64,
    timeout: f64,
    state: &str,
    view: Bound<'_, PyDict>,
) -> PyErr {
    let err = WaitTimeout::new_err(format!("room {room} is still {state} after {timeout} s"));
    let value = err.value(py);
    match value
        .setattr("room", room)
        .and_then(|()| value.setattr("view", view))
    {
        Ok(()) => err,
        Err(e) => e,
    }
}

/// Adds every exception to the module, and `FAILURE_CODES` (code name -> exception class).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("RegionError", py.get_type::<RegionError>())?;
    m.add("StartError", py.get_type::<StartError>())?;
    m.add("WaitTimeout", py.get_type::<WaitTimeout>())?;
    m.add("BadRequest", py.get_type::<BadRequest>())?;
    m.add("UnknownRoom", py.get_type::<UnknownRoom>())?;
    m.add("Conflict", py.get_type::<Conflict>())?;
    m.add("Exhausted", py.get_type::<Exhausted>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("Forbidden", py.get_type::<Forbidden>())?;
    m.add("RoomFailed", py.get_type::<RoomFailed>())?;
    let codes = PyDict::new(py);
    for &code in FailureCode::ALL {
        let ty = failure_type(py, code);
        m.add(ty.name()?.to_string(), &ty)?;
        codes.set_item(code.name(), ty)?;
    }
    m.add("FAILURE_CODES", codes)?;
    Ok(())
}
