//! Where the registry's state lives: the [`Store`] trait the server's handlers call, its
//! configuration [`StoreConfig`] (`memory` or `etcd://H:P[,H:P...]`) and its error
//! [`StoreError`].
//!
//! - [`memory::MemoryStore`]: one process, the pure [`Registry`](crate::registry::Registry)
//!   behind a short lock (the default);
//! - `etcd::EtcdStore` (cargo feature `etcd`): every registration, lease and prefill group
//!   lives in etcd, so any number of registry replicas on the same etcd cluster serve one view
//!   and any one may die. A build without the feature refuses `etcd://...` when it is parsed,
//!   with [`StoreConfigError::EtcdNotBuilt`].
//!
//! Both stores answer with the same [`RegistryError`]s (same messages, same status codes); the
//! etcd store adds [`StoreError::Unavailable`] (503) when etcd cannot be reached in time.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod memory;

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use uuid::Uuid;

use crate::registry::{Registered, RegistryError, RegistryStats};
use crate::types::{PrefillGroup, RankInfo, Registration};

#[cfg(feature = "etcd")]
pub use etcd::EtcdStore;
pub use memory::MemoryStore;

/// Why a store operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The registry refused the operation (the same refusals whatever the store).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The store's backend (etcd) did not answer in time or failed: retryable, and a client
    /// with several registry URLs tries another replica.
    #[error("registry store unavailable: {op}: {message}")]
    Unavailable {
        /// The store operation that failed (`register`, `lookup`, ...).
        op: &'static str,
        /// What failed, naming the endpoints or the timeout.
        message: String,
    },
}

/// The registry's state and its operations, as the HTTP handlers use them. Every operation
/// happens "now": leases are measured by the store's own clock (the memory store's) or by
/// etcd's.
pub trait Store: Send + Sync + 'static {
    /// The lease length granted to every registration.
    fn ttl(&self) -> Duration;

    /// Registers (or refreshes) `r`; see [`Registry::register`](crate::registry::Registry::register).
    fn register(
        &self,
        r: Registration,
    ) -> impl Future<Output = Result<Registered, StoreError>> + Send;

    /// Renews the lease of `instance_id`.
    fn heartbeat(&self, instance_id: Uuid) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Removes `instance_id`, returning what it had registered.
    fn deregister(
        &self,
        instance_id: Uuid,
    ) -> impl Future<Output = Result<Registration, StoreError>> + Send;

    /// The prefill group `dp_rank` if all its `tp_size * pp_size` ranks are live.
    fn lookup_prefill(
        &self,
        dp_rank: u32,
    ) -> impl Future<Output = Result<PrefillGroup, StoreError>> + Send;

    /// Every live registration, prefill first, then by dp, pp, tp rank.
    fn list(&self) -> impl Future<Output = Result<Vec<RankInfo>, StoreError>> + Send;

    /// Counts for `/metrics` and `/healthz`.
    fn stats(&self) -> impl Future<Output = Result<RegistryStats, StoreError>> + Send;

    /// Periodic upkeep, called by the server every quarter lease (at most every second): the
    /// memory store expires leases here; etcd expires its leases itself.
    fn sweep(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Which store the server keeps its state in (`--store` of `kvferry bootstrap`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StoreConfig {
    /// In this process (`memory`, the default): one registry, state lost on restart.
    #[default]
    Memory,
    /// In the etcd cluster at these endpoints (`etcd://H:P[,H:P...]`), as `http://H:P`.
    Etcd {
        /// The client URLs of the cluster's members, `http://H:P`.
        endpoints: Vec<String>,
    },
}

/// Why a `--store` value cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreConfigError {
    /// Neither `memory` nor `etcd://...`.
    #[error("store {0:?}: expected `memory` or `etcd://HOST:PORT[,HOST:PORT...]`")]
    Scheme(String),
    /// An etcd endpoint is not `HOST:PORT`.
    #[error("store {store:?}: etcd endpoint {endpoint:?} is not HOST:PORT with a port > 0")]
    Endpoint {
        /// The whole value.
        store: String,
        /// The endpoint at fault.
        endpoint: String,
    },
    /// `etcd://...` in a build without the `etcd` cargo feature.
    #[error(
        "store {0:?}: this build has no etcd store; build kvferry with the cargo feature `etcd` \
         (cargo build --release --features etcd; it needs protoc, Debian package protobuf-compiler)"
    )]
    EtcdNotBuilt(String),
}

/// Whether this build has the etcd store (cargo feature `etcd`).
pub const ETCD_BUILT: bool = cfg!(feature = "etcd");

impl FromStr for StoreConfig {
    type Err = StoreConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        StoreConfig::parse(s, ETCD_BUILT)
    }
}

impl StoreConfig {
    /// `s` parsed as a build with (`etcd_built`) or without the etcd store parses it: the unit
    /// tests check both answers in any build.
    fn parse(s: &str, etcd_built: bool) -> Result<Self, StoreConfigError> {
        let s = s.trim();
        if s == "memory" {
            return Ok(StoreConfig::Memory);
        }
        let Some(list) = s.strip_prefix("etcd://") else {
            return Err(StoreConfigError::Scheme(s.to_owned()));
        };
        let mut endpoints = Vec::new();
        for endpoint in list.split(',').map(str::trim) {
            let bad = || StoreConfigError::Endpoint {
                store: s.to_owned(),
                endpoint: endpoint.to_owned(),
            };
            let (host, port) = endpoint.rsplit_once(':').ok_or_else(bad)?;
            let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
            let host_ok = !host.is_empty() && !host.contains(['/', '@', ' ']);
            if !(port_ok && host_ok) {
                return Err(bad());
            }
            endpoints.push(format!("http://{endpoint}"));
        }
        if !etcd_built {
            return Err(StoreConfigError::EtcdNotBuilt(s.to_owned()));
        }
        Ok(StoreConfig::Etcd { endpoints })
    }
}

impl fmt::Display for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreConfig::Memory => f.write_str("memory"),
            StoreConfig::Etcd { endpoints } => {
                let hosts: Vec<&str> = endpoints
                    .iter()
                    .map(|e| e.strip_prefix("http://").unwrap_or(e))
                    .collect();
                write!(f, "etcd://{}", hosts.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_flag_rejects_what_no_build_can_serve() {
        assert_eq!("memory".parse::<StoreConfig>(), Ok(StoreConfig::Memory));
        for bad in [
            "etcd://",
            "etcd://h",
            "etcd://h:0",
            "etcd://h:2379,",
            "etcd://:1",
        ] {
            let err = bad.parse::<StoreConfig>().unwrap_err();
            assert!(matches!(err, StoreConfigError::Endpoint { .. }), "{bad}");
        }
        let err = "redis://h:1".parse::<StoreConfig>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "store \"redis://h:1\": expected `memory` or `etcd://HOST:PORT[,HOST:PORT...]`"
        );
    }

    #[test]
    fn without_the_feature_an_etcd_store_is_refused_naming_the_feature() {
        let err = StoreConfig::parse("etcd://10.0.0.1:2379", false).unwrap_err();
        assert_eq!(
            err,
            StoreConfigError::EtcdNotBuilt("etcd://10.0.0.1:2379".to_owned())
        );
        let text = err.to_string();
        assert!(text.contains("cargo feature `etcd`"), "{text}");
        assert!(text.contains("--features etcd"), "{text}");
    }

    #[test]
    fn store_flag_parses_and_prints_back() {
        let c = StoreConfig::parse("etcd://10.0.0.1:2379,etcd-2:2379", true).unwrap();
        assert_eq!(
            c,
            StoreConfig::Etcd {
                endpoints: vec![
                    "http://10.0.0.1:2379".to_owned(),
                    "http://etcd-2:2379".to_owned()
                ]
            }
        );
        assert_eq!(c.to_string(), "etcd://10.0.0.1:2379,etcd-2:2379");
        // `--store` parses as this build can serve.
        assert_eq!(
            "etcd://10.0.0.1:2379".parse::<StoreConfig>().is_ok(),
            ETCD_BUILT
        );
    }
}
