//! The servers a proxy routes to: those listed (`--prefill`, `--decode`) and those found in the
//! registry (`discovery.rs`), their requests outstanding, their health, whether they drain,
//! what their agents registered (which servers they can pair with), and (prefill servers) their
//! kvferry groups, one per vLLM data-parallel rank.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kvferry_bootstrap::Registration;

use anyhow::Context as _;
use serde_json::{Value, json};

/// One vLLM server.
#[derive(Debug)]
pub struct Backend {
    /// Its base URL (`http://host:port`).
    pub url: String,
    /// Its place among the servers of its role, from 1 (listed ones first, in the list's
    /// order; discovered ones as found): how answers to clients name it.
    place: usize,
    /// Found in the registry, not listed: removed once no rank registers it any more.
    discovered: bool,
    outstanding: AtomicUsize,
    /// Requests routed to it, ever.
    routed: AtomicU64,
    /// When it was last picked, in picks of its role (0: never): ties go to the least
    /// recently picked, so servers of equal load take turns and a new one gets the next.
    last_pick: AtomicU64,
    healthy: AtomicBool,
    /// Its agents registered as draining, or it refused a request because it shuts down: it
    /// gets no new requests until it is seen restarted (down, then healthy again).
    draining: AtomicBool,
    /// It refused a request because it shuts down (an answer of vLLM's drain): draining until
    /// it is seen restarted, whatever the registry says.
    refused: AtomicBool,
    /// One of its agents' registrations, once the registry listed one: what it can pair with.
    registered: Mutex<Option<Registration>>,
    /// A health check of it is under way.
    checking: AtomicBool,
    /// A prefill server's kvferry group of each of its vLLM data-parallel ranks
    /// (`kvferry_identify`); empty until known.
    groups: Mutex<Vec<u32>>,
    /// Counts the requests routed to it: each goes to the next data-parallel rank.
    turn: AtomicUsize,
}

/// A prefill server's data-parallel rank and that rank's kvferry group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rank {
    /// vLLM's data-parallel rank, named in the `X-data-parallel-rank` header; `None` for a
    /// server of one rank (no header).
    pub dp: Option<usize>,
    pub group: u32,
}

impl Backend {
    fn new(url: &str, place: usize, discovered: bool) -> Self {
        Backend {
            url: url.trim_end_matches('/').to_owned(),
            place,
            discovered,
            outstanding: AtomicUsize::new(0),
            routed: AtomicU64::new(0),
            last_pick: AtomicU64::new(0),
            healthy: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            registered: Mutex::new(None),
            checking: AtomicBool::new(false),
            groups: Mutex::new(Vec::new()),
            turn: AtomicUsize::new(0),
        }
    }

    /// Its place among the servers of its role, from 1.
    pub fn place(&self) -> usize {
        self.place
    }

    /// Found in the registry rather than listed.
    pub fn discovered(&self) -> bool {
        self.discovered
    }

    /// Requests routed to it, ever.
    pub fn routed(&self) -> u64 {
        self.routed.load(Ordering::Relaxed)
    }

    /// Whether it drains (its agents said so, or it refused a request because it shuts down).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// What its agents registered, once the registry listed it.
    pub fn registration(&self) -> Option<Registration> {
        self.registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// What the registry says of it now: draining or not, and one of its registrations.
    pub(super) fn registered_as(&self, registration: Option<Registration>, draining: bool) {
        let was = self.draining();
        let now = draining || self.refused.load(Ordering::Relaxed);
        if was != now {
            tracing::warn!(server = %self.url, draining = now, "server drain changed");
        }
        self.draining.store(now, Ordering::Relaxed);
        if registration.is_some() {
            *self.registered.lock().unwrap_or_else(|e| e.into_inner()) = registration;
        }
    }

    /// Requests routed to it and not answered yet.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Whether its last health check passed (false until the first one did).
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Marks it healthy or not, as its health checks do.
    #[cfg(test)]
    pub(super) fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }

    /// A prefill server's kvferry groups, by data-parallel rank, once it said.
    pub fn groups(&self) -> Vec<u32> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_groups(&self, groups: Vec<u32>) {
        *self.groups.lock().unwrap_or_else(|e| e.into_inner()) = groups;
    }

    /// The data-parallel rank the next request goes to (in turn), with its group; `None`
    /// until the server said its groups.
    pub fn next_rank(&self) -> Option<Rank> {
        let groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        let dp = self.turn.fetch_add(1, Ordering::Relaxed) % groups.len().max(1);
        let group = *groups.get(dp)?;
        let dp = (groups.len() > 1).then_some(dp);
        Some(Rank { dp, group })
    }
}

/// A request counted against a backend until it is dropped.
#[derive(Debug)]
pub struct Lease(Arc<Backend>);

impl Lease {
    /// The server the request went to.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The servers of one role.
#[derive(Debug)]
pub struct Backends {
    all: RwLock<Vec<Arc<Backend>>>,
    /// Servers listed (`--prefill`, `--decode`): places 1 to this.
    listed: usize,
    /// The place the next discovered server gets.
    next_place: AtomicUsize,
    /// Picks so far.
    picks: AtomicU64,
    /// Prefill servers in concurrent pairing: usable only once their kvferry group is known.
    identify: bool,
    /// The key of the proxy's own calls to them (`--api-key`): health checks and
    /// `kvferry_identify`, made by its rounds only, never on a client's request.
    api_key: Option<String>,
    /// The key is not sent to a server over plain HTTP beyond loopback
    /// ([`Backends::in_clear_refused`]); whether that was said yet.
    refuse_in_clear: bool,
    said_in_clear: AtomicBool,
}

impl Backends {
    /// `identify`: ask each server for its kvferry group whenever it becomes healthy, and use
    /// it only once it answered (prefill servers in concurrent pairing). `api_key`: sent with
    /// the proxy's own calls to them (servers started with `--api-key`).
    pub fn new(urls: &[String], identify: bool, api_key: Option<String>) -> Self {
        Backends {
            all: RwLock::new(
                (urls.iter().enumerate())
                    .map(|(i, u)| Arc::new(Backend::new(u, i + 1, false)))
                    .collect(),
            ),
            listed: urls.len(),
            next_place: AtomicUsize::new(urls.len() + 1),
            picks: AtomicU64::new(0),
            identify,
            api_key,
            refuse_in_clear: false,
            said_in_clear: AtomicBool::new(false),
        }
    }

    /// These servers, with the key kept from any of them reached over plain HTTP beyond
    /// loopback when `refused` (a proxy without `--insecure`): such a server, found in the
    /// registry, answers the proxy's calls 401 and is routed around, said once in the log.
    pub fn in_clear_refused(mut self, refused: bool) -> Self {
        self.refuse_in_clear = refused;
        self
    }

    /// Every server now: listed ones in the order given, then discovered ones as found.
    pub fn all(&self) -> Vec<Arc<Backend>> {
        self.all.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How many servers were listed.
    pub fn listed(&self) -> usize {
        self.listed
    }

    /// The server of `url`, listed or discovered.
    pub fn find(&self, url: &str) -> Option<Arc<Backend>> {
        let url = url.trim_end_matches('/');
        self.all().into_iter().find(|b| b.url == url)
    }

    /// Adds a server found in the registry (unusable until its first health check passes).
    pub(super) fn discover(&self, url: &str) -> Arc<Backend> {
        let mut all = self.all.write().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = all.iter().find(|b| b.url == url.trim_end_matches('/')) {
            return b.clone();
        }
        let place = self.next_place.fetch_add(1, Ordering::Relaxed);
        let b = Arc::new(Backend::new(url, place, true));
        tracing::warn!(server = %b.url, place, "server discovered in the registry");
        all.push(b.clone());
        b
    }

    /// Removes a discovered server that no rank registers any more (its requests in flight keep
    /// their leases and finish).
    pub(super) fn forget(&self, url: &str) {
        let mut all = self.all.write().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = all.iter().position(|b| b.discovered && b.url == url) {
            let b = all.remove(i);
            tracing::warn!(server = %b.url, place = b.place, "server gone from the registry: routed to no more");
        }
    }

    /// Whether `b` can take a request now: healthy, not draining, and (prefill servers in
    /// concurrent pairing) its kvferry groups known.
    pub fn usable(&self, b: &Backend) -> bool {
        b.healthy()
            && !b.draining()
            && (!self.identify
                || !b
                    .groups
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_empty())
    }

    /// Whether any server can take a request now.
    pub fn any_usable(&self) -> bool {
        self.all().iter().any(|b| self.usable(b))
    }

    /// The usable server with the fewest requests outstanding (ties: the least recently
    /// picked, then the first), counted until the lease drops; `None` when none is usable.
    pub fn pick(&self) -> Option<Lease> {
        self.pick_where(|_| true)
    }

    /// [`Backends::pick`] among the servers `fits` accepts.
    pub fn pick_where(&self, mut fits: impl FnMut(&Arc<Backend>) -> bool) -> Option<Lease> {
        let all = self.all();
        let best = all
            .iter()
            .filter(|b| self.usable(b) && fits(b))
            .min_by_key(|b| (b.outstanding(), b.last_pick.load(Ordering::Relaxed)))?;
        best.outstanding.fetch_add(1, Ordering::Relaxed);
        best.routed.fetch_add(1, Ordering::Relaxed);
        let pick = self.picks.fetch_add(1, Ordering::Relaxed) + 1;
        best.last_pick.store(pick, Ordering::Relaxed);
        Some(Lease(best.clone()))
    }

    /// Stops routing to the server of `lease` (it refused a connection) until a health round
    /// finds it answering again.
    pub fn route_around(&self, lease: &Lease, error: &dyn std::fmt::Display) {
        if lease.0.healthy.swap(false, Ordering::Relaxed) {
            tracing::warn!(server = %lease.0.url, %error, "server unreachable: routed around until it answers a health check");
        }
    }

    /// The server of `lease` checked now, out of turn: whether it answers its health check
    /// (if not, it is routed around until a later check passes).
    pub async fn recheck(&self, http: &reqwest::Client, lease: &Lease, timeout: Duration) -> bool {
        self.check(http, &lease.0, timeout).await;
        lease.0.healthy()
    }

    /// Sends the server of `lease` no new requests (it refused one because it shuts down)
    /// until it is seen restarted: down, then healthy again.
    pub fn drained(&self, lease: &Lease) {
        lease.0.refused.store(true, Ordering::Relaxed);
        if !lease.0.draining.swap(true, Ordering::Relaxed) {
            tracing::warn!(server = %lease.0.url, "server refused a request because it shuts down: no new requests until it restarts");
        }
    }

    /// One round of health checks of every server at once. A server that becomes healthy is
    /// asked for its kvferry group first when the role needs it.
    pub async fn check_all(&self, http: &reqwest::Client, timeout: Duration) {
        let all = self.all();
        let checks = all.iter().map(|b| self.check(http, b, timeout));
        futures_util::future::join_all(checks).await;
    }

    /// A health check of every server whose last one has ended, each in a task of its own: a
    /// server that takes its time to answer (up to `timeout`) holds up no other check, nor the
    /// next round.
    pub fn check_each(self: &Arc<Self>, http: &reqwest::Client, timeout: Duration) {
        for b in self.all() {
            if b.checking.swap(true, Ordering::Relaxed) {
                continue;
            }
            let (all, http) = (self.clone(), http.clone());
            tokio::spawn(async move {
                all.check(&http, &b, timeout).await;
                b.checking.store(false, Ordering::Relaxed);
            });
        }
    }

    /// The key of the proxy's own calls to these servers (`--api-key`).
    pub fn api_key(&self) -> Option<&str> {
        self.api_key.as_deref()
    }

    /// `request` to `url` with the proxy's key, if it has one and may send it there.
    fn own(&self, url: &str, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let Some(key) = &self.api_key else {
            return request;
        };
        let in_clear = crate::exposure::check_clear_url(("server", url), true, false);
        match (self.refuse_in_clear, in_clear) {
            (true, Err(e)) => {
                if !self.said_in_clear.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "--api-key not sent to a server found over plain HTTP");
                }
                request
            }
            _ => request.bearer_auth(key),
        }
    }

    async fn check(&self, http: &reqwest::Client, b: &Backend, timeout: Duration) {
        let answered = self
            .own(&b.url, http.get(format!("{}/health", b.url)))
            .timeout(timeout)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        let was = b.healthy();
        if !answered && b.refused.swap(false, Ordering::Relaxed) {
            // Down after refusing for its shutdown: once it answers again it is a new server.
            b.draining.store(false, Ordering::Relaxed);
        }
        if answered && self.identify && (!was || b.groups().is_empty()) {
            match self.identify_ranks(http, &b.url, timeout).await {
                Ok(groups) => b.set_groups(groups),
                Err(e) => {
                    tracing::warn!(server = %b.url, error = %format!("{e:#}"), "a prefill server did not say its kvferry groups");
                    b.set_groups(Vec::new());
                    b.healthy.store(false, Ordering::Relaxed);
                    return;
                }
            }
        }
        if b.healthy.swap(answered, Ordering::Relaxed) != answered {
            tracing::warn!(server = %b.url, healthy = answered, groups = ?b.groups(), "server health changed");
        }
    }

    /// A prefill server's kvferry group of each of its vLLM data-parallel ranks: a short
    /// request with `kvferry_identify` to each rank in turn (`X-data-parallel-rank`: 0, 1, ...)
    /// until one is refused (vLLM answers 400 for a rank beyond its ranks) or a rank other than
    /// the one asked answers (a server that ignores the header has one).
    async fn identify_ranks(
        &self,
        http: &reqwest::Client,
        url: &str,
        timeout: Duration,
    ) -> anyhow::Result<Vec<u32>> {
        let mut groups = Vec::new();
        for rank in 0..MAX_DP_RANKS {
            match self.identify(http, url, timeout, rank).await {
                Ok(said) if said.dp_rank == rank => groups.push(said.group),
                Ok(_) | Err(Identify::Refused(_)) if rank > 0 => break,
                Ok(said) => anyhow::bail!(
                    "asked data-parallel rank 0 with X-data-parallel-rank, rank {} answered",
                    said.dp_rank
                ),
                Err(Identify::Refused(e) | Identify::Failed(e)) => return Err(e),
            }
        }
        Ok(groups)
    }

    /// What one `kvferry_identify` request to data-parallel rank `rank` says.
    async fn identify(
        &self,
        http: &reqwest::Client,
        url: &str,
        timeout: Duration,
        rank: usize,
    ) -> Result<Identity, Identify> {
        let model = async {
            let models: Value = self
                .own(url, http.get(format!("{url}/v1/models")))
                .timeout(timeout)
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            let model = models["data"][0]["id"].as_str();
            anyhow::Ok(model.context("no model in /v1/models")?.to_owned())
        };
        let model = model.await.map_err(Identify::Failed)?;
        let body = json!({"model": model, "prompt": [1], "max_tokens": 1,
                          "kv_transfer_params": {"kvferry_identify": true}});
        let sent = self
            .own(url, http.post(format!("{url}/v1/completions")))
            .header(DP_RANK_HEADER, rank)
            .timeout(timeout)
            .json(&body)
            .send()
            .await;
        let answer = sent.map_err(|e| Identify::Failed(e.into()))?;
        if answer.status().is_client_error() {
            let e = anyhow::anyhow!("rank {rank} refused: {}", answer.status());
            return Err(Identify::Refused(e));
        }
        let said = async {
            let answer: Value = answer.error_for_status()?.json().await?;
            let params = &answer["kv_transfer_params"];
            let group = params["kvferry_dp_rank"].as_u64().context(
                "its answer names no kvferry_dp_rank: is it running KvferryConnector as kv_producer?",
            )?;
            let dp_rank = params["kvferry_engine_dp_rank"].as_u64().unwrap_or(0);
            anyhow::Ok(Identity {
                group: u32::try_from(group)?,
                dp_rank: usize::try_from(dp_rank)?,
            })
        };
        said.await.map_err(Identify::Failed)
    }
}

/// vLLM's header naming the data-parallel rank a request goes to.
pub(super) const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// The most data-parallel ranks asked of one server.
const MAX_DP_RANKS: usize = 256;

/// A prefill engine's answer to `kvferry_identify`.
struct Identity {
    group: u32,
    /// The engine's vLLM data-parallel rank.
    dp_rank: usize,
}

/// Why a `kvferry_identify` request told nothing.
enum Identify {
    /// The server refused it (4xx): for a data-parallel rank, one it does not have.
    Refused(anyhow::Error),
    Failed(anyhow::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draining_server_gets_no_new_requests_until_it_restarts() {
        let b = Backends::new(&["http://a".into(), "http://b".into()], false, None);
        for s in b.all() {
            s.healthy.store(true, Ordering::Relaxed);
        }
        let first = b.pick().expect("a");
        b.drained(&first);
        drop(first);
        for _ in 0..3 {
            assert_eq!(b.pick().expect("b").backend().url, "http://b");
        }
        // The registry saying it does not drain does not undo its own refusal...
        b.all()[0].registered_as(None, false);
        assert!(b.all()[0].draining());
        // ...its restart does.
        b.all()[0].refused.store(false, Ordering::Relaxed);
        b.all()[0].registered_as(None, false);
        assert!(!b.all()[0].draining());
    }

    #[test]
    fn discovered_servers_take_the_next_places_and_go_when_forgotten() {
        let b = Backends::new(&["http://a".into()], false, None);
        let found = b.discover("http://c/");
        assert_eq!((found.place(), found.discovered()), (2, true));
        assert!(Arc::ptr_eq(&b.discover("http://c"), &found), "found once");
        b.forget("http://a");
        b.forget("http://c");
        let urls: Vec<String> = b.all().iter().map(|s| s.url.clone()).collect();
        assert_eq!(urls, ["http://a"], "a listed server is never forgotten");
    }

    #[test]
    fn the_least_outstanding_usable_server_is_picked_and_released() {
        let b = Backends::new(&["http://a".into(), "http://b/".into()], false, None);
        assert!(
            b.pick().is_none(),
            "no server is usable before its first health check"
        );
        for s in b.all() {
            s.healthy.store(true, Ordering::Relaxed);
        }
        let first = b.pick().expect("one");
        assert_eq!(first.backend().url, "http://a");
        assert_eq!(first.backend().place(), 1);
        let second = b.pick().expect("two");
        assert_eq!(second.backend().url, "http://b");
        assert_eq!(second.backend().place(), 2);
        drop(first);
        assert_eq!(b.pick().expect("a again").backend().url, "http://a");
        drop(second);
        // Equal loads take turns, and a server found now gets the next request.
        let turns: Vec<String> = (0..3)
            .map(|_| b.pick().unwrap().backend().url.clone())
            .collect();
        assert_eq!(turns, ["http://b", "http://a", "http://b"]);
        let c = b.discover("http://c");
        c.healthy.store(true, Ordering::Relaxed);
        assert_eq!(b.pick().expect("c").backend().url, "http://c");
        c.healthy.store(false, Ordering::Relaxed);
        b.all()[0].healthy.store(false, Ordering::Relaxed);
        assert_eq!(b.pick().expect("b only").backend().url, "http://b");
        b.all()[1].healthy.store(false, Ordering::Relaxed);
        assert!(b.pick().is_none());
    }

    #[test]
    fn a_server_that_must_identify_is_unusable_until_it_did() {
        let b = Backends::new(&["http://p".into()], true, None);
        b.all()[0].healthy.store(true, Ordering::Relaxed);
        assert!(!b.any_usable());
        b.all()[0].set_groups(vec![3]);
        let rank = b.pick().expect("identified").backend().next_rank();
        assert_eq!(rank, Some(Rank { dp: None, group: 3 }));
    }

    #[test]
    fn requests_to_a_server_of_several_data_parallel_ranks_take_turns() {
        let b = Backend::new("http://p", 1, false);
        assert_eq!(
            b.next_rank(),
            None,
            "no rank before the server said its groups"
        );
        b.set_groups(vec![7, 9]);
        let ranks: Vec<Rank> = (0..3).filter_map(|_| b.next_rank()).collect();
        let at = |dp, group| Rank {
            dp: Some(dp),
            group,
        };
        assert_eq!(ranks, [at(1, 9), at(0, 7), at(1, 9)]);
    }
}
