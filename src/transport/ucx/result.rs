//! [`UcxError`], the error of the whole UCX layer, and thin functions over [`super::sys`]: one
//! per UCP call, turning statuses into `Result<_, UcxError>` and out-pointers into return
//! values. They keep the C calling conventions (raw handles in, raw handles out); the
//! lifetimes are [`super::safe`]'s business.
//!
//! Functions taking handles are `unsafe`: the caller guarantees the handles are live and used
//! on the thread that owns their worker.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_void};
use std::ptr::{self, NonNull};

use super::memory_type::MemoryType;
use super::packed::Malformed;
use super::sys::{self, ucs_status_t};

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
        /// The endpoint, as [`EndpointId`](super::EndpointId) numbers it.
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
    /// A placed message ([`UcxWorker::recv_runs`](super::UcxWorker::recv_runs)) of another
    /// length than its run: shorter (`got`), or longer (`None`: UCX truncated it).
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
    /// A libucp of a release kvferry does not run on ([`super::version`]).
    #[error("{0}")]
    Unsupported(String),
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
    /// A peer's worker address or remote key that does not have the shape this process's UCX
    /// packs; refused before any UCX call ([`super::packed`]).
    #[error(transparent)]
    Malformed(#[from] Malformed),
    /// A remote region (one-sided writes) on a worker whose context has no RMA
    /// ([`UcxConfig::rma`](super::UcxConfig::rma)): refused before UCX sees the key.
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
            name: status_name(status),
        }
    }
}

/// `ucs_status_string` of `status` (`"Success"`, `"Connection reset by remote peer"`, ...).
pub fn status_name(status: ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any value and returns a pointer to a static string
    // (or "Unknown error" for codes it does not know); it is never freed.
    let p = unsafe { sys::ucs_status_string(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `Ok` for UCS_OK, the error otherwise.
pub fn check(op: &'static str, status: ucs_status_t) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::call(op, status))
    }
}

/// A status pointer returned by an `_nbx` call: `None` when the operation completed at once,
/// the request while it is in flight, the error otherwise.
pub fn request_or_done(
    op: &'static str,
    ptr: sys::ucs_status_ptr_t,
) -> Result<Option<NonNull<c_void>>, UcxError> {
    if sys::ucs_ptr_is_ptr(ptr) {
        Ok(NonNull::new(ptr))
    } else {
        match sys::ucs_ptr_status(ptr) {
            sys::UCS_OK => Ok(None),
            status => Err(UcxError::call(op, status)),
        }
    }
}

/// The version of the libucp loaded at run time: (major, minor, release).
pub fn version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

fn c_string(what: &str) -> Result<CString, UcxError> {
    CString::new(what).map_err(|_| UcxError::Config {
        name: what.to_owned(),
        value: String::new(),
        reason: "contains a NUL byte".into(),
    })
}

/// `ucp_config_read(NULL, NULL, ..)`: UCX's defaults overridden by the `UCX_*` environment.
pub fn config_read() -> Result<NonNull<sys::ucp_config_t>, UcxError> {
    let mut config = ptr::null_mut();
    // SAFETY: NULL prefix and file are documented defaults; `config` is a valid out-pointer.
    check("ucp_config_read", unsafe {
        sys::ucp_config_read(ptr::null(), ptr::null(), &mut config)
    })?;
    NonNull::new(config).ok_or_else(|| UcxError::call("ucp_config_read", sys::UCS_ERR_NO_MESSAGE))
}

/// `ucp_config_modify(config, name, value)`; `name` without the `UCX_` prefix.
///
/// # Safety
/// `config` comes from [`config_read`] and has not been released.
pub unsafe fn config_modify(
    config: NonNull<sys::ucp_config_t>,
    name: &str,
    value: &str,
) -> Result<(), UcxError> {
    let (c_name, c_value) = (c_string(name)?, c_string(value)?);
    // SAFETY: config is live (caller); both strings are NUL-terminated and outlive the call.
    let status =
        unsafe { sys::ucp_config_modify(config.as_ptr(), c_name.as_ptr(), c_value.as_ptr()) };
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::Config {
            name: name.to_owned(),
            value: value.to_owned(),
            reason: status_name(status),
        })
    }
}

/// `ucp_context_query` of the memory types: a bitmap of `ucs_memory_type_t` (bit
/// [`sys::UCS_MEMORY_TYPE_CUDA`] set when the context sends and receives CUDA memory).
///
/// # Safety
/// `context` is live.
pub unsafe fn context_memory_types(context: NonNull<sys::ucp_context>) -> Result<u64, UcxError> {
    // SAFETY: an all-zero `ucp_context_attr_t` is valid (integers and a char array); UCX
    // fills only the fields in `field_mask`.
    let mut attr: sys::ucp_context_attr_t = unsafe { std::mem::zeroed() };
    attr.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES;
    // SAFETY: the context is live (caller); `attr` is a valid out-pointer for the call.
    check("ucp_context_query", unsafe {
        sys::ucp_context_query(context.as_ptr(), &mut attr)
    })?;
    Ok(attr.memory_types)
}

/// `ucp_config_release`.
///
/// # Safety
/// `config` comes from [`config_read`] and is released once.
pub unsafe fn config_release(config: NonNull<sys::ucp_config_t>) {
    // SAFETY: see the function's contract.
    unsafe { sys::ucp_config_release(config.as_ptr()) }
}

/// `ucp_init` (a `static inline` wrapper of `ucp_init_version` in the header).
///
/// # Safety
/// `config` is live.
pub unsafe fn init(
    params: &sys::ucp_params_t,
    config: NonNull<sys::ucp_config_t>,
) -> Result<NonNull<sys::ucp_context>, UcxError> {
    let mut context = ptr::null_mut();
    // SAFETY: params and config are valid for the call (caller); `context` is an out-pointer.
    check("ucp_init", unsafe {
        sys::ucp_init_version(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            params,
            config.as_ptr(),
            &mut context,
        )
    })?;
    NonNull::new(context).ok_or_else(|| UcxError::call("ucp_init", sys::UCS_ERR_NO_MESSAGE))
}

/// `ucp_worker_create`.
///
/// # Safety
/// `context` is live.
pub unsafe fn worker_create(
    context: NonNull<sys::ucp_context>,
    params: &sys::ucp_worker_params_t,
) -> Result<NonNull<sys::ucp_worker>, UcxError> {
    let mut worker = ptr::null_mut();
    // SAFETY: context live (caller); params valid for the call; out-pointer valid.
    check("ucp_worker_create", unsafe {
        sys::ucp_worker_create(context.as_ptr(), params, &mut worker)
    })?;
    NonNull::new(worker).ok_or_else(|| UcxError::call("ucp_worker_create", sys::UCS_ERR_NO_MESSAGE))
}

/// `ucp_worker_get_address` copied into a `Vec`, the UCX buffer released at once.
///
/// # Safety
/// `worker` is live and owned by this thread.
pub unsafe fn worker_address(worker: NonNull<sys::ucp_worker>) -> Result<Vec<u8>, UcxError> {
    let (mut address, mut len) = (ptr::null_mut(), 0usize);
    // SAFETY: worker live (caller); two valid out-pointers.
    check("ucp_worker_get_address", unsafe {
        sys::ucp_worker_get_address(worker.as_ptr(), &mut address, &mut len)
    })?;
    if address.is_null() {
        return Err(UcxError::call(
            "ucp_worker_get_address",
            sys::UCS_ERR_NO_MESSAGE,
        ));
    }
    // SAFETY: UCX returned `len` readable bytes at `address`; they are copied before release.
    let bytes = unsafe { std::slice::from_raw_parts(address.cast::<u8>(), len) }.to_vec();
    // SAFETY: the address came from this worker and is released once.
    unsafe { sys::ucp_worker_release_address(worker.as_ptr(), address) };
    Ok(bytes)
}

/// `ucp_worker_get_efd`.
///
/// # Safety
/// `worker` is live and was created with `UCP_FEATURE_WAKEUP`.
pub unsafe fn worker_efd(worker: NonNull<sys::ucp_worker>) -> Result<i32, UcxError> {
    let mut fd = -1;
    // SAFETY: worker live (caller); valid out-pointer.
    check("ucp_worker_get_efd", unsafe {
        sys::ucp_worker_get_efd(worker.as_ptr(), &mut fd)
    })?;
    Ok(fd)
}

/// `ucp_worker_arm`: `Ok(true)` when armed (safe to sleep on the efd), `Ok(false)` when events
/// are pending (UCS_ERR_BUSY: progress again).
///
/// # Safety
/// `worker` is live and owned by this thread.
pub unsafe fn worker_arm(worker: NonNull<sys::ucp_worker>) -> Result<bool, UcxError> {
    // SAFETY: worker live (caller).
    match unsafe { sys::ucp_worker_arm(worker.as_ptr()) } {
        sys::UCS_OK => Ok(true),
        sys::UCS_ERR_BUSY => Ok(false),
        status => Err(UcxError::call("ucp_worker_arm", status)),
    }
}

/// A zeroed `ucp_request_param_t` (no field set).
pub fn request_param() -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: 0,
        flags: 0,
        request: ptr::null_mut(),
        cb: sys::ucp_request_param_cb { send: None },
        datatype: 0,
        user_data: ptr::null_mut(),
        reply_buffer: ptr::null_mut(),
        memory_type: sys::UCS_MEMORY_TYPE_HOST,
        recv_info: sys::ucp_request_param_recv_info {
            length: ptr::null_mut(),
        },
        memh: ptr::null_mut(),
    }
}

/// Copies a packed remote key out of UCX's buffer and releases the buffer.
///
/// # Safety
/// `context` and `memh` are live and `memh` was mapped in `context`.
pub unsafe fn rkey_pack(
    context: NonNull<sys::ucp_context>,
    memh: NonNull<sys::ucp_mem>,
) -> Result<Vec<u8>, UcxError> {
    let (mut buffer, mut len) = (ptr::null_mut(), 0usize);
    // SAFETY: handles live (caller); valid out-pointers.
    check("ucp_rkey_pack", unsafe {
        sys::ucp_rkey_pack(context.as_ptr(), memh.as_ptr(), &mut buffer, &mut len)
    })?;
    if buffer.is_null() {
        return Err(UcxError::call("ucp_rkey_pack", sys::UCS_ERR_NO_MESSAGE));
    }
    // SAFETY: UCX returned `len` readable bytes; copied before release.
    let bytes = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), len) }.to_vec();
    // SAFETY: the buffer came from ucp_rkey_pack and is released once.
    unsafe { sys::ucp_rkey_buffer_release(buffer) };
    Ok(bytes)
}

/// `ucp_dt_create_generic`: a datatype whose sends and receives go through `ops`.
pub fn dt_create_generic(
    ops: &'static sys::ucp_generic_dt_ops_t,
) -> Result<sys::ucp_datatype_t, UcxError> {
    let mut datatype = 0;
    // SAFETY: `ops` is static, as UCX keeps the pointer for the datatype's life; the context
    // argument may be null (it is passed back to `start_pack`/`start_unpack` only); valid
    // out-pointer.
    check("ucp_dt_create_generic", unsafe {
        sys::ucp_dt_create_generic(ops, ptr::null_mut(), &mut datatype)
    })?;
    Ok(datatype)
}
