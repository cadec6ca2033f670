//! kvferry's bootstrap registry: prefill ranks register themselves with a lease, decode ranks
//! look up the prefill group (one per DP rank) they pull KV cache from. HTTP + JSON (axum) on
//! versioned routes, with a typed async client (reqwest) for the agents.
//!
//! - [`types`]: the wire types ([`Registration`], [`PrefillGroup`], ...) and their validation;
//! - [`pairing`]: which prefill and decode instances can exchange KV;
//! - [`registry`]: the pure state (leases, groups, topology conflicts), no HTTP;
//! - [`store`]: where the state lives, behind one trait: in memory (one process, the default)
//!   or in etcd (cargo feature `etcd`: any number of replicas, leases as etcd leases);
//! - [`server`]: routes and handlers, [`serve`]; the route table is in its module doc;
//! - [`error`]: the one error type the server answers with, JSON `{"error": "..."}`;
//! - [`metrics`]: the Prometheus exposition of `/metrics`;
//! - [`client`]: [`RegistryClient`], with re-registration after a registry restart and a
//!   lease keep-alive task.
//!
//! It serves through `kvferry_wire`'s bounded HTTP loop, and its layouts name their dtype and
//! attention kind in `kvferry_wire`'s words. This crate knows nothing of pools, kernels or
//! transports: endpoints are opaque strings.

pub mod client;
pub mod error;
pub mod metrics;
pub mod pairing;
pub mod registry;
pub mod server;
pub mod store;
pub mod types;

pub use client::{ClientError, KeepAlive, RegistryClient, Renewal};
pub use error::{ApiError, RejectReason, Rejection};
pub use registry::{Registered, Registry, RegistryError, RegistryStats};
pub use server::{
    DEFAULT_BODY_LIMIT, DEFAULT_LEASE_TTL, DEFAULT_PORT, Listeners, ServerConfig, serve,
    serve_store,
};
#[cfg(feature = "etcd")]
pub use store::EtcdStore;
pub use store::{ETCD_BUILT, MemoryStore, Store, StoreConfig, StoreConfigError, StoreError};
pub use types::{
    About, Admitted, AttentionKind, Dtype, ErrorBody, Health, IndexRange, InvalidRegistration,
    KvLayout, Lease, PrefillGroup, RankInfo, RankList, Registration, Role, Slice, Versions,
};
