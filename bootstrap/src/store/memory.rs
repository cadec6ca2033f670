//! The in-memory store (the default): the pure [`Registry`] of this process behind one
//! `std::sync::Mutex`, locked only for a synchronous registry call and never across an
//! `.await`. State is lost when the process stops; clients register again by themselves.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::{Store, StoreError};
use crate::registry::{Registered, Registry, RegistryStats};
use crate::types::{PrefillGroup, RankInfo, Registration};

/// The registry held in this process.
#[derive(Debug)]
pub struct MemoryStore {
    registry: Mutex<Registry>,
    ttl: Duration,
}

impl MemoryStore {
    /// An empty store granting leases of `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            registry: Mutex::new(Registry::new(ttl)),
            ttl,
        }
    }

    /// The registry, locked. A panic elsewhere cannot leave the registry half-updated in a way
    /// worse than refusing service, so a poisoned lock is taken over.
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store for MemoryStore {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    async fn register(&self, r: Registration) -> Result<Registered, StoreError> {
        Ok(self.registry().register(r, Instant::now())?)
    }

    async fn heartbeat(&self, instance_id: Uuid) -> Result<(), StoreError> {
        Ok(self.registry().heartbeat(instance_id, Instant::now())?)
    }

    async fn deregister(&self, instance_id: Uuid) -> Result<Registration, StoreError> {
        Ok(self.registry().deregister(instance_id, Instant::now())?)
    }

    async fn lookup_prefill(&self, dp_rank: u32) -> Result<PrefillGroup, StoreError> {
        Ok(self.registry().lookup_prefill(dp_rank, Instant::now())?)
    }

    async fn list(&self) -> Result<Vec<RankInfo>, StoreError> {
        Ok(self.registry().list(Instant::now()))
    }

    async fn stats(&self) -> Result<RegistryStats, StoreError> {
        Ok(self.registry().stats(Instant::now()))
    }

    async fn sweep(&self) {
        self.registry().expire(Instant::now());
    }
}
