//! The registry's behaviour against real servers on 127.0.0.1: its typed client, the bearer
//! token and `/metrics`, the metrics port, malformed requests, and the etcd store on a real etcd
//! cluster.

#[path = "../common/mod.rs"]
mod common;

mod api;
mod auth_metrics;
mod bad_input;
mod etcd;
mod metrics_port;
