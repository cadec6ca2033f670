//! The servers a proxy routes to: their requests outstanding, their health, and (prefill
//! servers) their kvferry group.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

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
            healthy: AtomicBool::new(true),
            group: AtomicU64::new(u64::MAX),
        }
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// The prefill server's kvferry group, once it said.
    pub fn group(&self) -> Option<u32> {
        u32::try_from(self.group.load(Ordering::Relaxed)).ok()
    }

    pub fn set_group(&self, group: u32) {
        self.group.store(u64::from(group), Ordering::Relaxed);
    }
}

/// A request counted against a backend until it is dropped.
pub struct Lease(Arc<Backend>);

impl Lease {
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
}

impl Backends {
    pub fn new(urls: &[String]) -> Self {
        Backends {
            all: urls.iter().map(|u| Arc::new(Backend::new(u))).collect(),
        }
    }

    pub fn all(&self) -> &[Arc<Backend>] {
        &self.all
    }

    /// The healthy server with the fewest requests outstanding (ties: the first), counted
    /// until the lease drops; `None` when none is healthy. `usable` filters further (a prefill
    /// server whose group is known, in concurrent pairing).
    pub fn pick(&self, usable: impl Fn(&Backend) -> bool) -> Option<Lease> {
        let best = self
            .all
            .iter()
            .filter(|b| b.healthy() && usable(b))
            .min_by_key(|b| b.outstanding())?;
        best.outstanding.fetch_add(1, Ordering::Relaxed);
        Some(Lease(best.clone()))
    }

    /// Checks every server's `/health` each `period`, forever: a server that does not answer
    /// 200 within `period` is routed around until it does.
    pub async fn watch(self: Arc<Self>, http: reqwest::Client, period: Duration) {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            for b in &self.all {
                let ok = http
                    .get(format!("{}/health", b.url))
                    .timeout(period)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if b.healthy.swap(ok, Ordering::Relaxed) != ok {
                    tracing::warn!(server = %b.url, healthy = ok, "server health changed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_outstanding_healthy_server_is_picked_and_released() {
        let b = Backends::new(&["http://a".into(), "http://b/".into()]);
        let first = b.pick(|_| true).expect("one");
        assert_eq!(first.backend().url, "http://a");
        let second = b.pick(|_| true).expect("two");
        assert_eq!(second.backend().url, "http://b");
        drop(first);
        assert_eq!(b.pick(|_| true).expect("a again").backend().url, "http://a");
        b.all()[0].healthy.store(false, Ordering::Relaxed);
        b.all()[1].healthy.store(false, Ordering::Relaxed);
        assert!(b.pick(|_| true).is_none());
    }
}
