//! What kvferry's registry (the `kvferry-bootstrap` crate), its agents, its proxy and its
//! transports share on the wire, below all of them:
//!
//! - [`admission`]: connections not yet proven to come from a peer, bounded apart from the
//!   peers' on every port;
//! - [`http`]: serving an axum router with that bound (registry, agents' engine API, proxy),
//!   the bearer-token check and the `/metrics` content type;
//! - [`metrics_port`]: the read-only port of `/metrics`, `/livez` and `/readyz` every role may
//!   serve beside its main one, and [`build_info`]: `kvferry_build_info` on every `/metrics`;
//! - [`tls`]: HTTPS on those ports (rustls) and the certificates kvferry's clients trust;
//! - [`kv`]: the names the KV cache goes by wherever it is described ([`Dtype`],
//!   [`AttentionKind`]), in the registry's JSON, in Hello and on the command line.
//!
//! This crate knows nothing of the registry, pools, kernels or transports.

pub mod admission;
pub mod build_info;
pub mod http;
pub mod kv;
pub mod metrics_port;
pub mod tls;

pub use build_info::BuildInfo;
pub use kv::{AttentionKind, Dtype, UnknownName};
