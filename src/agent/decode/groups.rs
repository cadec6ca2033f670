//! The prefill groups a decode looks up in the registry, remembered for [`FRESH`]: a room
//! asked for within that time of the last lookup of its group goes to the prefill without an
//! HTTP round trip to the registry (a large share of a small room's fixed cost).
//!
//! A remembered group can be stale in one way that matters: a prefill rank restarted (a new
//! instance). Its old control connection dies or goes silent, and every group is forgotten
//! when a peer is lost ([`Groups::forget`], called by `peer_lost`) or a prefill refuses a
//! request as addressed to an instance it no longer is. So only the rooms asked for between
//! the restart and the moment this decode sees the old connection close (milliseconds for a
//! clean stop) go to the old instance; they fail `peer_dead` with the reason, and the engine
//! asks again. After a crash the registry itself lists the dead rank until its lease
//! expires, longer than [`FRESH`].
//!
//! Lookups of one group fly one at a time, and the rooms that waited for a lookup share its
//! outcome: a thousand rooms asked for at once, or while a group is incomplete, make one lookup
//! at a time, not a thousand. A lookup that gave up on an incomplete group at its bootstrap
//! timeout is not shared (each room waits its own), nor one that began before the decode
//! forgot every group.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_bootstrap::{ClientError, PrefillGroup, RegistryClient};

use super::Decode;
use crate::reason::{FailureCode, Reason};

/// How long a looked-up group is used without asking the registry again.
pub(super) const FRESH: Duration = Duration::from_secs(1);

/// Registry URLs named by rooms whose clients (and their connections) are kept.
const CLIENTS: usize = 16;

/// Groups whose flights are kept before those nobody waits on are dropped.
const FLIGHTS: usize = 256;

/// A group's lookups, one at a time: the outcome of the last that the rooms waiting for it
/// share, and when it came.
type Flight = Arc<tokio::sync::Mutex<Option<(Instant, Result<PrefillGroup, Reason>)>>>;

/// Groups by (registry URL, DP rank), with the time each was looked up, the lookups in flight,
/// and the clients of the registries rooms named.
#[derive(Default)]
pub(super) struct Groups {
    seen: Mutex<HashMap<(String, u32), (Instant, PrefillGroup)>>,
    flights: Mutex<HashMap<(String, u32), Flight>>,
    clients: Mutex<HashMap<String, RegistryClient>>,
    /// Counts [`Groups::forget`]: what a lookup begun before it found is neither remembered
    /// nor shared.
    generation: AtomicU64,
}

impl Groups {
    /// The client of the registry at `url` (a room's own registry), made once per URL so that
    /// its rooms share one connection: at most [`CLIENTS`] URLs are kept. Only a registry the
    /// decode trusts ([`crate::agent::TrustedRegistries`]) gets one: the client sends the token.
    pub(super) fn client(
        &self,
        url: &str,
        trusted: &crate::agent::TrustedRegistries,
        token: Option<&str>,
    ) -> Result<RegistryClient, Reason> {
        trusted
            .check(url)
            .map_err(|e| Reason::new(FailureCode::Unreachable, e.to_string()))?;
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(url) {
            return Ok(client.clone());
        }
        let client = RegistryClient::new(url.to_owned(), token.map(str::to_owned))
            .map_err(|e| Reason::new(FailureCode::Unreachable, e.to_string()))?;
        if clients.len() >= CLIENTS {
            clients.clear();
        }
        clients.insert(url.to_owned(), client.clone());
        Ok(client)
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u32), (Instant, PrefillGroup)>> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fresh(&self, key: &(String, u32)) -> Option<PrefillGroup> {
        let seen = self.seen();
        let (at, group) = seen.get(key)?;
        (at.elapsed() < FRESH).then(|| group.clone())
    }

    /// The flight of `key`'s lookups.
    fn flight(&self, key: &(String, u32)) -> Flight {
        let mut flights = self.flights.lock().unwrap_or_else(|e| e.into_inner());
        if flights.len() >= FLIGHTS {
            flights.retain(|_, f| Arc::strong_count(f) > 1);
        }
        flights.entry(key.clone()).or_default().clone()
    }

    /// Forgets every group: the next room of each asks the registry.
    pub(super) fn forget(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.seen().clear();
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }
}

impl Decode {
    /// The prefill group `dp_rank` as `client`'s registry lists it: remembered if looked up
    /// less than [`FRESH`] ago, else the outcome of the lookup this call waited for, else
    /// asked for until it is complete or the bootstrap timeout passes.
    pub(super) async fn lookup(
        &self,
        client: &RegistryClient,
        dp_rank: u32,
    ) -> Result<PrefillGroup, Reason> {
        let key = (client.base_url().to_owned(), dp_rank);
        if let Some(group) = self.groups.fresh(&key) {
            return Ok(group);
        }
        let started = Instant::now();
        let flight = self.groups.flight(&key);
        let mut last = flight.lock().await;
        if let Some(group) = self.groups.fresh(&key) {
            return Ok(group);
        }
        if let Some((at, outcome)) = last.as_ref()
            && *at >= started
        {
            return outcome.clone();
        }
        let generation = self.groups.generation();
        let (outcome, gave_up) = self.ask(client, dp_rank, started).await;
        let current = self.groups.generation() == generation;
        if let (Ok(group), true) = (&outcome, current) {
            self.groups
                .seen()
                .insert(key, (Instant::now(), group.clone()));
        }
        *last = (current && !gave_up).then(|| (Instant::now(), outcome.clone()));
        outcome
    }

    /// Asks `client`'s registry for group `dp_rank` until it is complete or the bootstrap
    /// timeout (from `started`) passes; and whether it failed by giving up at that timeout.
    async fn ask(
        &self,
        client: &RegistryClient,
        dp_rank: u32,
        started: Instant,
    ) -> (Result<PrefillGroup, Reason>, bool) {
        let deadline = started + self.timeouts().bootstrap;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            match client.lookup_prefill(dp_rank).await {
                Ok(group) => return (Ok(group), false),
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tracing::debug!(error = %e, "prefill group not ready; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    let gave_up = e.is_retryable();
                    let code = match e {
                        ClientError::Incomplete { .. } | ClientError::Unreachable { .. } => {
                            FailureCode::TimeoutBootstrap
                        }
                        ClientError::Unauthorized { .. } => FailureCode::Unauthorized,
                        _ => FailureCode::Unreachable,
                    };
                    let plural = if attempts == 1 { "" } else { "s" };
                    let reason = Reason::new(
                        code,
                        format!(
                            "prefill group dp_rank={dp_rank} at {}: {attempts} lookup{plural} in \
                             {} ms, the last: {e}",
                            client.base_url(),
                            started.elapsed().as_millis()
                        ),
                    );
                    return (Err(reason), gave_up);
                }
            }
        }
    }
}
