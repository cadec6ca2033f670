//! Tests that run kvferry as real processes: the release binary
//! (`cargo build --release --all-features --bin kvferry`), started with every timeout explicit,
//! on loopback or in network namespaces the test creates, beside real etcd and vLLM where a
//! module says so. The modules that start clusters run one test at a time
//! (`.config/nextest.toml`, group `multi-process`): they share 2 cores with the processes they
//! spawn.

#[path = "../common/mod.rs"]
mod common;

/// The three-member etcd cluster of the registry's own etcd tests.
#[cfg(feature = "etcd")]
#[path = "../../bootstrap/tests/common/etcd.rs"]
mod etcd;

mod cli_bootstrap;
mod cli_config;
mod cli_help;
mod cli_version;
mod e2e_bench;
mod e2e_drain_pages;
mod e2e_examples;
mod e2e_faults;
mod e2e_formats;
mod e2e_garbage;
mod e2e_held_connections;
mod e2e_hostile;
mod e2e_hosts;
mod e2e_mapped;
mod e2e_metrics;
mod e2e_metrics_port;
mod e2e_pairing;
mod e2e_proxy;
mod e2e_registry;
mod e2e_registry_etcd;
mod e2e_stream;
mod e2e_ucx;
mod e2e_ucx_malformed;
mod e2e_ucx_rogue;
mod e2e_zmq;
mod http_errors;
mod metrics_names;
/// docs/metrics.md's table of metrics, as the docs tests read it.
#[path = "../docs/metrics_table.rs"]
mod metrics_table;
mod vllm_layout;
