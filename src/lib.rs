//! kvferry moves KV cache from prefill to decode in prefill/decode-disaggregated LLM serving.
//!
//! Dependencies point from the edges to the core:
//! `cli -> agent -> {transport, protocol, kernel} -> pool -> layout`, and `agent -> bootstrap
//! client` (the `kvferry-bootstrap` crate). The crate `kvferry-wire`, below both, holds what
//! they share: connection admission, HTTP serving, the KV cache's names. `layout`, `pool` and
//! `kernel` know nothing of the network. docs/architecture.md walks through the parts.

pub mod agent;
pub mod cli;
pub mod cluster;
pub mod cpus;
pub mod env;
pub mod exposure;
pub mod fd_passing;
pub mod kernel;
pub mod layout;
pub mod memory;
pub mod pool;
pub mod protocol;
pub mod proxy;
pub mod reason;
pub mod tls;
pub mod transport;
