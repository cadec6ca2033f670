//! Tests that need nothing but this crate: agents, pools, kernels and the UCX layer driven from
//! inside the test process (a child process at most re-runs this binary). One module per
//! concept; they run in parallel.

#[path = "../common/mod.rs"]
mod common;

mod agents_restart_in_process;
mod engine_memory;
mod formats;
mod inprocess_api;
mod kernel_cpu;
mod metrics_port_agents;
mod pool_shm;
mod reads;
mod registry_lookups_in_process;
mod tls_ports;
mod ucx_layer;
mod ucx_throughput;
