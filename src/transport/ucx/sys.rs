//! Raw declarations of the part of the UCP API (libucx 1.13, `ucp/api/ucp.h`, `ucp_def.h`,
//! `ucs/type/status.h`) that this transport uses. No logic lives here.
//!
//! Invariants: every struct mirrors its C definition field for field, `#[repr(C)]`, and
//! tests/in_process/ucx_layer.rs checks sizes and offsets against the numbers gcc reports for the installed
//! headers (`layout_probe.c` next to this file). Functions the headers define `static inline`
//! (`ucp_init`) or as macros (`UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`) are reimplemented in Rust.
//! Names follow the C headers so they can be checked against them line by line.
#![allow(unsafe_code, non_camel_case_types, missing_docs)]

use std::os::raw::{c_char, c_int, c_uint, c_void};

/// `ucs_status_t`: a packed (one-byte) enum in the headers.
pub type ucs_status_t = i8;
/// `ucs_status_ptr_t`: a request pointer, NULL (UCS_OK) or an encoded error status.
pub type ucs_status_ptr_t = *mut c_void;
pub type ucp_tag_t = u64;
pub type ucp_datatype_t = u64;
/// `ucs_thread_mode_t`, `ucs_memory_type_t`, `ucp_err_handling_mode_t`: plain C enums.
pub type ucs_thread_mode_t = c_uint;
pub type ucs_memory_type_t = c_uint;
pub type ucp_err_handling_mode_t = c_uint;

/// Opaque handles.
#[repr(C)]
pub struct ucp_context {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_worker {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_ep {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_mem {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_rkey {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_config_t {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_address_t {
    _opaque: [u8; 0],
}
pub type ucp_context_h = *mut ucp_context;
pub type ucp_worker_h = *mut ucp_worker;
pub type ucp_ep_h = *mut ucp_ep;
pub type ucp_mem_h = *mut ucp_mem;
pub type ucp_rkey_h = *mut ucp_rkey;
/// A message taken off the unexpected queue by `ucp_tag_probe_nb` (opaque).
pub type ucp_tag_message_h = *mut c_void;

// ucs_status_t values (ucs/type/status.h).
pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_NO_MESSAGE: ucs_status_t = -1;
pub const UCS_ERR_INVALID_PARAM: ucs_status_t = -5;
pub const UCS_ERR_UNREACHABLE: ucs_status_t = -6;
pub const UCS_ERR_MESSAGE_TRUNCATED: ucs_status_t = -9;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
pub const UCS_ERR_CANCELED: ucs_status_t = -16;
pub const UCS_ERR_TIMED_OUT: ucs_status_t = -20;
pub const UCS_ERR_NOT_CONNECTED: ucs_status_t = -24;
pub const UCS_ERR_CONNECTION_RESET: ucs_status_t = -25;
pub const UCS_ERR_FIRST_LINK_FAILURE: ucs_status_t = -40;
pub const UCS_ERR_LAST_ENDPOINT_FAILURE: ucs_status_t = -89;
pub const UCS_ERR_LAST: ucs_status_t = -100;

// ucs_thread_mode_t.
pub const UCS_THREAD_MODE_SINGLE: ucs_thread_mode_t = 0;
// ucs_memory_type_t (ucs/memory/memory_type.h).
pub const UCS_MEMORY_TYPE_HOST: ucs_memory_type_t = 0;
pub const UCS_MEMORY_TYPE_CUDA: ucs_memory_type_t = 1;
// ucp_err_handling_mode_t.
pub const UCP_ERR_HANDLING_MODE_NONE: ucp_err_handling_mode_t = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: ucp_err_handling_mode_t = 1;

// ucp_params_field / ucp_feature.
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_TAG: u64 = 1 << 0;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_AM: u64 = 1 << 6;

// ucp_context_attr_field.
pub const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
/// `UCP_ENTITY_NAME_MAX` (ucp_def.h).
pub const UCP_ENTITY_NAME_MAX: usize = 32;

// ucp_worker_params_field.
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCP_WORKER_PARAM_FIELD_NAME: u64 = 1 << 6;

// ucp_ep_params_field.
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_EP_PARAM_FIELD_USER_DATA: u64 = 1 << 3;
// ucp_ep_close_flags_t.
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

// ucp_mem_map_params_field / prot.
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
pub const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub const UCP_MEM_MAP_PROT_LOCAL_WRITE: c_uint = 1 << 1;
pub const UCP_MEM_MAP_PROT_REMOTE_READ: c_uint = 1 << 8;
pub const UCP_MEM_MAP_PROT_REMOTE_WRITE: c_uint = 1 << 9;

// ucp_op_attr_t.
pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_DATATYPE: u32 = 1 << 3;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
pub const UCP_OP_ATTR_FIELD_RECV_INFO: u32 = 1 << 7;
pub const UCP_OP_ATTR_FLAG_NO_IMM_CMPL: u32 = 1 << 16;

// ucp_dt_type: `ucp_dt_make_contig(1)` is `(1 << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG`,
// `ucp_dt_make_iov()` is `UCP_DATATYPE_IOV`.
pub const UCP_DATATYPE_CONTIG: ucp_datatype_t = 0;
pub const UCP_DATATYPE_IOV: ucp_datatype_t = 2;
pub const UCP_DATATYPE_SHIFT: ucp_datatype_t = 3;
pub const UCP_DATATYPE_BYTES: ucp_datatype_t = (1 << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG;

// ucp_version.h.
pub const UCP_API_MAJOR: c_uint = 1;
pub const UCP_API_MINOR: c_uint = 13;

pub type ucp_request_init_callback_t = Option<unsafe extern "C" fn(request: *mut c_void)>;
pub type ucp_request_cleanup_callback_t = Option<unsafe extern "C" fn(request: *mut c_void)>;
pub type ucp_err_handler_cb_t =
    Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;

#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: ucp_request_init_callback_t,
    pub request_cleanup: ucp_request_cleanup_callback_t,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_context_attr_t`: what `ucp_context_query` reports of a context.
#[repr(C)]
pub struct ucp_context_attr_t {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: ucs_thread_mode_t,
    /// A bitmap of `ucs_memory_type_t`: bit `UCS_MEMORY_TYPE_CUDA` is set when the context
    /// can send and receive CUDA device memory.
    pub memory_types: u64,
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
}

/// `ucs_cpu_set_t`: 1024 bits.
#[repr(C)]
pub struct ucs_cpu_set_t {
    pub ucs_bits: [u64; 16],
}

#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: ucs_thread_mode_t,
    pub cpu_mask: ucs_cpu_set_t,
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

#[repr(C)]
pub struct ucp_err_handler_t {
    pub cb: ucp_err_handler_cb_t,
    pub arg: *mut c_void,
}

#[repr(C)]
pub struct ucs_sock_addr_t {
    pub addr: *const c_void,
    pub addrlen: u32,
}

#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: ucp_err_handling_mode_t,
    pub err_handler: ucp_err_handler_t,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: ucs_memory_type_t,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ucp_tag_recv_info_t {
    pub sender_tag: ucp_tag_t,
    pub length: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ucp_dt_iov_t {
    pub buffer: *mut c_void,
    pub length: usize,
}

/// `ucp_generic_dt_ops_t`: the callbacks of a generic datatype (`ucp_dt_create_generic`),
/// through which UCX packs a send and unpacks a receive piece by piece.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ucp_generic_dt_ops_t {
    pub start_pack: Option<
        unsafe extern "C" fn(
            context: *mut c_void,
            buffer: *const c_void,
            count: usize,
        ) -> *mut c_void,
    >,
    pub start_unpack: Option<
        unsafe extern "C" fn(
            context: *mut c_void,
            buffer: *mut c_void,
            count: usize,
        ) -> *mut c_void,
    >,
    pub packed_size: Option<unsafe extern "C" fn(state: *mut c_void) -> usize>,
    pub pack: Option<
        unsafe extern "C" fn(
            state: *mut c_void,
            offset: usize,
            dest: *mut c_void,
            max_length: usize,
        ) -> usize,
    >,
    pub unpack: Option<
        unsafe extern "C" fn(
            state: *mut c_void,
            offset: usize,
            src: *const c_void,
            length: usize,
        ) -> ucs_status_t,
    >,
    pub finish: Option<unsafe extern "C" fn(state: *mut c_void)>,
}

/// The `cb` union of `ucp_request_param_t`: every member is one function pointer (the two
/// kinds of operation this transport starts are declared).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ucp_request_param_cb {
    /// `ucp_send_nbx_callback_t`: sends, puts, flushes.
    pub send: Option<
        unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void),
    >,
    /// `ucp_tag_recv_nbx_callback_t`: tagged receives.
    pub recv: Option<
        unsafe extern "C" fn(
            request: *mut c_void,
            status: ucs_status_t,
            tag_info: *const ucp_tag_recv_info_t,
            user_data: *mut c_void,
        ),
    >,
}

/// The `recv_info` union of `ucp_request_param_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ucp_request_param_recv_info {
    pub length: *mut usize,
    pub tag_info: *mut ucp_tag_recv_info_t,
}

#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_request_param_cb,
    pub datatype: ucp_datatype_t,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: ucs_memory_type_t,
    pub recv_info: ucp_request_param_recv_info,
    pub memh: ucp_mem_h,
}

#[link(name = "ucs")]
unsafe extern "C" {
    pub fn ucs_status_string(status: ucs_status_t) -> *const c_char;
}

#[link(name = "ucp")]
unsafe extern "C" {
    pub fn ucp_get_version(major: *mut c_uint, minor: *mut c_uint, release: *mut c_uint);
    pub fn ucp_config_read(
        env_prefix: *const c_char,
        filename: *const c_char,
        config_p: *mut *mut ucp_config_t,
    ) -> ucs_status_t;
    pub fn ucp_config_modify(
        config: *mut ucp_config_t,
        name: *const c_char,
        value: *const c_char,
    ) -> ucs_status_t;
    pub fn ucp_config_release(config: *mut ucp_config_t);
    pub fn ucp_init_version(
        api_major_version: c_uint,
        api_minor_version: c_uint,
        params: *const ucp_params_t,
        config: *const ucp_config_t,
        context_p: *mut ucp_context_h,
    ) -> ucs_status_t;
    pub fn ucp_cleanup(context: ucp_context_h);
    pub fn ucp_context_query(context: ucp_context_h, attr: *mut ucp_context_attr_t)
    -> ucs_status_t;

    pub fn ucp_worker_create(
        context: ucp_context_h,
        params: *const ucp_worker_params_t,
        worker_p: *mut ucp_worker_h,
    ) -> ucs_status_t;
    pub fn ucp_worker_destroy(worker: ucp_worker_h);
    pub fn ucp_worker_get_address(
        worker: ucp_worker_h,
        address_p: *mut *mut ucp_address_t,
        address_length_p: *mut usize,
    ) -> ucs_status_t;
    pub fn ucp_worker_release_address(worker: ucp_worker_h, address: *mut ucp_address_t);
    pub fn ucp_worker_progress(worker: ucp_worker_h) -> c_uint;
    pub fn ucp_worker_get_efd(worker: ucp_worker_h, fd: *mut c_int) -> ucs_status_t;
    pub fn ucp_worker_arm(worker: ucp_worker_h) -> ucs_status_t;
    pub fn ucp_worker_flush_nbx(
        worker: ucp_worker_h,
        param: *const ucp_request_param_t,
    ) -> ucs_status_ptr_t;

    pub fn ucp_ep_create(
        worker: ucp_worker_h,
        params: *const ucp_ep_params_t,
        ep_p: *mut ucp_ep_h,
    ) -> ucs_status_t;
    pub fn ucp_ep_close_nbx(ep: ucp_ep_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
    pub fn ucp_ep_flush_nbx(ep: ucp_ep_h, param: *const ucp_request_param_t) -> ucs_status_ptr_t;
    pub fn ucp_ep_print_info(ep: ucp_ep_h, stream: *mut libc::FILE);

    pub fn ucp_mem_map(
        context: ucp_context_h,
        params: *const ucp_mem_map_params_t,
        memh_p: *mut ucp_mem_h,
    ) -> ucs_status_t;
    pub fn ucp_mem_unmap(context: ucp_context_h, memh: ucp_mem_h) -> ucs_status_t;
    pub fn ucp_rkey_pack(
        context: ucp_context_h,
        memh: ucp_mem_h,
        rkey_buffer_p: *mut *mut c_void,
        size_p: *mut usize,
    ) -> ucs_status_t;
    pub fn ucp_rkey_buffer_release(rkey_buffer: *mut c_void);
    pub fn ucp_ep_rkey_unpack(
        ep: ucp_ep_h,
        rkey_buffer: *const c_void,
        rkey_p: *mut ucp_rkey_h,
    ) -> ucs_status_t;
    pub fn ucp_rkey_destroy(rkey: ucp_rkey_h);

    pub fn ucp_tag_send_nbx(
        ep: ucp_ep_h,
        buffer: *const c_void,
        count: usize,
        tag: ucp_tag_t,
        param: *const ucp_request_param_t,
    ) -> ucs_status_ptr_t;
    pub fn ucp_tag_recv_nbx(
        worker: ucp_worker_h,
        buffer: *mut c_void,
        count: usize,
        tag: ucp_tag_t,
        tag_mask: ucp_tag_t,
        param: *const ucp_request_param_t,
    ) -> ucs_status_ptr_t;
    pub fn ucp_tag_probe_nb(
        worker: ucp_worker_h,
        tag: ucp_tag_t,
        tag_mask: ucp_tag_t,
        remove: c_int,
        info: *mut ucp_tag_recv_info_t,
    ) -> ucp_tag_message_h;
    pub fn ucp_tag_msg_recv_nbx(
        worker: ucp_worker_h,
        buffer: *mut c_void,
        count: usize,
        message: ucp_tag_message_h,
        param: *const ucp_request_param_t,
    ) -> ucs_status_ptr_t;
    pub fn ucp_put_nbx(
        ep: ucp_ep_h,
        buffer: *const c_void,
        count: usize,
        remote_addr: u64,
        rkey: ucp_rkey_h,
        param: *const ucp_request_param_t,
    ) -> ucs_status_ptr_t;

    pub fn ucp_dt_create_generic(
        ops: *const ucp_generic_dt_ops_t,
        context: *mut c_void,
        datatype_p: *mut ucp_datatype_t,
    ) -> ucs_status_t;
    pub fn ucp_request_cancel(worker: ucp_worker_h, request: *mut c_void);
    pub fn ucp_request_free(request: *mut c_void);
}

/// `UCS_PTR_IS_ERR`: the pointer encodes an error status (the top 100 addresses).
pub fn ucs_ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_IS_PTR`: the pointer is a request (neither NULL nor an encoded status).
pub fn ucs_ptr_is_ptr(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (UCS_ERR_LAST as isize as usize).wrapping_sub(1)
}

/// `UCS_PTR_STATUS`: UCS_INPROGRESS for a request, else the encoded status (UCS_OK for NULL).
pub fn ucs_ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t {
    if ucs_ptr_is_ptr(ptr) {
        UCS_INPROGRESS
    } else {
        ptr as isize as ucs_status_t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_pointer_macros_match_the_header() {
        let null = std::ptr::null_mut::<c_void>();
        assert!(!ucs_ptr_is_err(null));
        assert!(!ucs_ptr_is_ptr(null));
        assert_eq!(ucs_ptr_status(null), UCS_OK);
        let canceled = UCS_ERR_CANCELED as isize as *mut c_void;
        assert!(ucs_ptr_is_err(canceled));
        assert!(!ucs_ptr_is_ptr(canceled));
        assert_eq!(ucs_ptr_status(canceled), UCS_ERR_CANCELED);
        let last = UCS_ERR_LAST as isize as *mut c_void;
        assert!(ucs_ptr_is_err(last));
        let request = 0x7f00_1234_5000usize as *mut c_void;
        assert!(!ucs_ptr_is_err(request));
        assert!(ucs_ptr_is_ptr(request));
        assert_eq!(ucs_ptr_status(request), UCS_INPROGRESS);
    }
}
