//! The servers a proxy routes to: their requests outstanding, their health, and (prefill
//! servers) their kvferry group.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{Value, json};

/// One vLLM server.
#[derive(Debug)]
pub struct Backend {
    /// Its base URL (`http://host:port`).
    pub url: String,
    outstanding: AtomicUsize,
    healthy: AtomicBool,
    /// A prefill server's kvferry DP group (`kvferry_identify`); `u64::MAX` until known.
    group: AtomicU64,
}

impl Backend {
    fn new(url: &str) -> Self {
        Backend {
            url: url.trim_end_matches('/').to_owned(),
            outstanding: AtomicUsize::new(0),
            healthy: AtomicBool::new(false),
            group: AtomicU64::new(u64::MAX),
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

    /// The prefill server's kvferry group, once it said.
    pub fn group(&self) -> Option<u32> {
        u32::try_from(self.group.load(Ordering::Relaxed)).ok()
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
    /// The key of the proxy's own calls to them (`--api-key`).
    api_key: Option<String>,
}

impl Backends {
    /// `identify`: ask each server for its kvferry group whenever it becomes healthy, and use
    /// it only once it answered (prefill servers in concurrent pairing). `api_key`: sent with
    /// the proxy's own calls to them (servers started with `--api-key`).
    pub fn new(urls: &[String], identify: bool, api_key: Option<String>) -> Self {
        Backends {
            all: urls.iter().map(|u| Arc::new(Backend::new(u))).collect(),
            identify,
            api_key,
        }
    }

    /// Every server, in the order given.
    pub fn all(&self) -> &[Arc<Backend>] {
        &self.all
    }

    fn usable(&self, b: &Backend) -> bool {
        b.healthy() && (!self.identify || b.group().is_some())
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
        if answered && self.identify && (!was || b.group().is_none()) {
            match self.identify(http, &b.url, timeout).await {
                Ok(group) => b.group.store(u64::from(group), Ordering::Relaxed),
                Err(e) => {
                    tracing::warn!(server = %b.url, error = %format!("{e:#}"), "a prefill server did not say its kvferry group");
                    b.group.store(u64::MAX, Ordering::Relaxed);
                    b.healthy.store(false, Ordering::Relaxed);
                    return;
                }
            }
        }
        if b.healthy.swap(answered, Ordering::Relaxed) != answered {
            tracing::warn!(server = %b.url, healthy = answered, group = ?b.group(), "server health changed");
        }
    }

    /// A prefill server's kvferry DP group: one short request with `kvferry_identify`.
    async fn identify(
        &self,
        http: &reqwest::Client,
        url: &str,
        timeout: Duration,
    ) -> anyhow::Result<u32> {
        let models: Value = self
            .own(http.get(format!("{url}/v1/models")))
            .timeout(timeout)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let model = models["data"][0]["id"]
            .as_str()
            .context("no model in /v1/models")?
            .to_owned();
        let body = json!({"model": model, "prompt": [1], "max_tokens": 1,
                          "kv_transfer_params": {"kvferry_identify": true}});
        let answer: Value = self
            .own(http.post(format!("{url}/v1/completions")))
            .timeout(timeout)
            .json(&body)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let group = answer["kv_transfer_params"]["kvferry_dp_rank"]
            .as_u64()
            .context(
                "its answer names no kvferry_dp_rank: is it running KvferryConnector as kv_producer?",
            )?;
        Ok(u32::try_from(group)?)
    }
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
        let second = b.pick().expect("two");
        assert_eq!(second.backend().url, "http://b");
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
        b.all()[0].group.store(3, Ordering::Relaxed);
        assert_eq!(b.pick().expect("identified").backend().group(), Some(3));
    }
}
