//! [`Context`]: the UCP context (`ucp_init`) a worker is made from, with the settings every
//! context is forced to, and its RMA choice.
//!
//! Invariant: a context is cleaned up only after every worker and registration made from it
//! (each holds an `Rc` of it).

use std::ptr::NonNull;
use std::rc::Rc;

use crate::transport::ucx::memory_type::MemoryTypes;
use crate::transport::ucx::result::{self, UcxError};
use crate::transport::ucx::sys;
use crate::transport::ucx::version::UcxVersion;

/// Settings every context gets, over the environment's and the caller's: the worker address
/// format [`crate::transport::ucx::packed`] validates peers' addresses against. UCX parses an
/// address by its own settings (in unified mode without the lengths a peer packed), so both
/// sides must use this one (`v1` is the default of 1.13 and 1.22 alike).
const FORCED_VARS: [(&str, &str); 2] = [("ADDRESS_VERSION", "v1"), ("UNIFIED_MODE", "n")];

/// A UCP context (`ucp_init`) with tag matching and wakeup, and RMA when asked for.
///
/// RMA (`UCP_FEATURE_RMA`) is a trust decision, not a speed setting: a context with it installs
/// libucx's software put and get handlers on every transport without native RMA (tcp, shared
/// memory), which execute any connected peer's put or get at whatever address it names, in this
/// process, with no key check. Only a writer over transports whose hardware checks remote keys
/// (RDMA) asks for it (`transport/ucx/data.rs`).
pub struct Context {
    ptr: NonNull<sys::ucp_context>,
    rma: bool,
}

impl Context {
    /// Reads UCX's config (defaults, then `UCX_*` environment), applies `vars` on top (names
    /// without the `UCX_` prefix, e.g. `("TLS", "tcp")`) and initialises a context for one
    /// worker, with RMA when `rma` (see [`Context`]).
    pub fn new(vars: &[(String, String)], rma: bool) -> Result<Rc<Context>, UcxError> {
        UcxVersion::loaded()
            .family()
            .map_err(UcxError::Unsupported)?;
        let config = result::config_read()?;
        let context = Self::init_with(config, vars, rma);
        // SAFETY: config came from config_read and is released exactly once, here; ucp_init
        // copies what it needs.
        unsafe { result::config_release(config) };
        context
    }

    fn init_with(
        config: NonNull<sys::ucp_config_t>,
        vars: &[(String, String)],
        rma: bool,
    ) -> Result<Rc<Context>, UcxError> {
        let forced = FORCED_VARS.iter().map(|&(n, v)| (n, v));
        for (name, value) in vars
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .chain(forced)
        {
            // SAFETY: config is live until the caller releases it after this function.
            unsafe { result::config_modify(config, name, value) }?;
        }
        let name = c"kvferry";
        let params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES
                | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                | sys::UCP_PARAM_FIELD_NAME,
            features: sys::UCP_FEATURE_TAG
                | sys::UCP_FEATURE_WAKEUP
                | if rma { sys::UCP_FEATURE_RMA } else { 0 },
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: name.as_ptr(),
        };
        // SAFETY: params is fully initialised and only the fields in field_mask are read;
        // config is live (see above).
        let ptr = unsafe { result::init(&params, config) }?;
        Ok(Rc::new(Context { ptr, rma }))
    }

    /// The raw handle, for [`crate::transport::ucx::result`] calls.
    pub fn as_ptr(&self) -> NonNull<sys::ucp_context> {
        self.ptr
    }

    /// Whether this context has RMA: one-sided writes, and peers' puts and gets run here.
    pub fn rma(&self) -> bool {
        self.rma
    }

    /// The memory types this context sends and receives (`ucp_context_query`).
    pub fn memory_types(&self) -> Result<MemoryTypes, UcxError> {
        // SAFETY: the handle is live for as long as `self`.
        unsafe { result::context_memory_types(self.ptr) }.map(MemoryTypes)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the handle is live; every worker and memory handle holds an Rc of this
        // context, so none is left when this runs.
        unsafe { sys::ucp_cleanup(self.ptr.as_ptr()) }
    }
}
