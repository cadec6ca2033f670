//! The servers a proxy routes to: their requests outstanding, their health, and (prefill
//! servers) their kvferry groups, one per vLLM data-parallel rank.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{Value, json};

/// One vLLM server.
#[derive(Debug)]
pub struct Backend {
    /// Its base URL (`http://host:port`).
    pub url: String,
    /// Its place in `--prefill` or `--decode`, from 1: how answers to clients name it.
    place: usize,
    outstanding: AtomicUsize,
    healthy: AtomicBool,
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
    fn new(url: &str, place: usize) -> Self {
        Backend {
            url: url.trim_end_matches('/').to_owned(),
            place,
            outstanding: AtomicUsize::new(0),
            healthy: AtomicBool::new(false),
            groups: Mutex::new(Vec::new()),
            turn: AtomicUsize::new(0),
        }
    }

    /// Its place in `--prefill` or `--decode`, from 1.
    pub fn place(&self) -> usize {
        self.place
    }

    /// Requests routed to it and not answered yet.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Whether its last health check passed (false until the first one did).
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
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
    pub fn backend(&self) -> &Backend {
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
    all: Vec<Arc<Backend>>,
    /// Prefill servers in concurrent pairing: usable only once their kvferry group is known.
    identify: bool,
    /// The key of the proxy's own calls to them (`--api-key`): health checks and
    /// `kvferry_identify`, made by its rounds only, never on a client's request.
    api_key: Option<String>,
}

impl Backends {
    /// `identify`: ask each server for its kvferry group whenever it becomes healthy, and use
    /// it only once it answered (prefill servers in concurrent pairing). `api_key`: sent with
    /// the proxy's own calls to them (servers started with `--api-key`).
    pub fn new(urls: &[String], identify: bool, api_key: Option<String>) -> Self {
        Backends {
            all: (urls.iter().enumerate())
                .map(|(i, u)| Arc::new(Backend::new(u, i + 1)))
                .collect(),
            identify,
            api_key,
        }
    }

    /// Every server, in the order given.
    pub fn all(&self) -> &[Arc<Backend>] {
        &self.all
    }

    fn usable(&self, b: &Backend) -> bool {
        b.healthy()
            && (!self.identify
                || !b
                    .groups
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_empty())
    }

    /// Whether any server can take a request now.
    pub fn any_usable(&self) -> bool {
        self.all.iter().any(|b| self.usable(b))
    }

    /// The usable server with the fewest requests outstanding (ties: the first), counted
    /// until the lease drops; `None` when none is usable.
    pub fn pick(&self) -> Option<Lease> {
        let best = self
            .all
            .iter()
            .filter(|b| self.usable(b))
            .min_by_key(|b| b.outstanding())?;
        best.outstanding.fetch_add(1, Ordering::Relaxed);
        Some(Lease(best.clone()))
    }

    /// Stops routing to the server of `lease` (it refused a connection) until a health round
    /// finds it answering again.
    pub fn route_around(&self, lease: &Lease, error: &dyn std::fmt::Display) {
        if lease.0.healthy.swap(false, Ordering::Relaxed) {
            tracing::warn!(server = %lease.0.url, %error, "server unreachable: routed around until it answers a health check");
        }
    }

    /// Checks every server's `/health` each `period`, forever (the first round after
    /// `period`): a server that does not answer 200 within `timeout` is routed around until it
    /// does.
    pub async fn watch(
        self: Arc<Self>,
        http: reqwest::Client,
        period: Duration,
        timeout: Duration,
    ) {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.check_all(&http, timeout).await;
        }
    }

    /// One round of health checks of every server at once. A server that becomes healthy is
    /// asked for its kvferry group first when the role needs it.
    pub async fn check_all(&self, http: &reqwest::Client, timeout: Duration) {
        let checks = self.all.iter().map(|b| self.check(http, b, timeout));
        futures_util::future::join_all(checks).await;
    }

    /// The key of the proxy's own calls to these servers (`--api-key`).
    pub fn api_key(&self) -> Option<&str> {
        self.api_key.as_deref()
    }

    /// `request` with the proxy's key, if it has one.
    fn own(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    async fn check(&self, http: &reqwest::Client, b: &Backend, timeout: Duration) {
        let answered = self
            .own(http.get(format!("{}/health", b.url)))
            .timeout(timeout)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        let was = b.healthy();
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
                .own(http.get(format!("{url}/v1/models")))
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
            .own(http.post(format!("{url}/v1/completions")))
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
        let b = Backend::new("http://p", 1);
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
