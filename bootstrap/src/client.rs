//! The typed async client of the registry, used by the agents: register, heartbeat (which
//! re-registers by itself when the registry forgot the instance), deregister, look up a prefill
//! group, and [`RegistryClient::keep_alive`], a task that keeps one lease alive until cancelled.
//!
//! Errors are classified: [`ClientError::is_retryable`] is true for an incomplete group, an
//! unreachable registry or a 5xx; a 4xx (bad registration, conflict, wrong token) is fatal.
//! The client remembers what it registered (per instance id) so it can register again after a
//! registry restart; the memory sits behind a short `std::sync::Mutex` never held across
//! `.await`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use reqwest::{RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::types::{
    ErrorBody, Health, InvalidRegistration, Lease, PrefillGroup, RankInfo, RankList, Registration,
};

/// How long one request to the registry may take, connect included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest heartbeat period, whatever the lease.
const MIN_HEARTBEAT_PERIOD: Duration = Duration::from_millis(10);

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The prefill group exists only in part (or not at all) yet: retry later.
    #[error("prefill group dp_rank={dp_rank} not ready: {message}")]
    Incomplete {
        /// The group asked for.
        dp_rank: u32,
        /// The registry's message, naming how many of how many ranks registered.
        message: String,
    },
    /// The registry could not be reached or did not answer in time: retry later.
    #[error("{op}: registry at {url} unreachable: {source}")]
    Unreachable {
        /// The operation that failed.
        op: &'static str,
        /// The URL asked.
        url: String,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The registration disagrees with its group or with this instance's earlier one (409).
    #[error("{op}: conflict: {message}")]
    Conflict {
        /// The operation that failed.
        op: &'static str,
        /// The registry's message, naming the field and both values.
        message: String,
    },
    /// Missing or wrong bearer token (401).
    #[error("{op}: unauthorized: {message}")]
    Unauthorized {
        /// The operation that failed.
        op: &'static str,
        /// The registry's message.
        message: String,
    },
    /// Any other 4xx: the request was wrong and retrying will not help.
    #[error("{op}: registry rejected the request ({status}): {message}")]
    Rejected {
        /// The operation that failed.
        op: &'static str,
        /// The HTTP status.
        status: u16,
        /// The registry's message.
        message: String,
    },
    /// A 5xx other than an incomplete group: retry later.
    #[error("{op}: registry failed ({status}): {message}")]
    Server {
        /// The operation that failed.
        op: &'static str,
        /// The HTTP status.
        status: u16,
        /// The registry's message.
        message: String,
    },
    /// A success status with a body this client cannot read (version skew).
    #[error("{op}: unreadable answer from the registry: {source}")]
    Decode {
        /// The operation that failed.
        op: &'static str,
        /// The decoding error.
        #[source]
        source: reqwest::Error,
    },
    /// The registry forgot this instance and this client never registered it, so it cannot
    /// register it again.
    #[error(
        "heartbeat: the registry does not know instance {0} and this client never registered it"
    )]
    NotRegistered(Uuid),
    /// The registration fails validation; nothing was sent.
    #[error("register: invalid registration: {0}")]
    Invalid(#[from] InvalidRegistration),
    /// The base URL or the HTTP client setup is unusable.
    #[error("registry client for {url:?}: {message}")]
    Setup {
        /// The base URL given.
        url: String,
        /// What is wrong with it.
        message: String,
    },
}

impl ClientError {
    /// True when the same call may succeed later (incomplete group, registry down, 5xx).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClientError::Incomplete { .. }
                | ClientError::Unreachable { .. }
                | ClientError::Server { .. }
        )
    }
}

/// What a heartbeat did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The lease was renewed.
    Renewed(Lease),
    /// The registry did not know the instance (restart, expiry): it was registered again.
    Reregistered(Lease),
}

impl Renewal {
    /// The lease now held.
    pub fn lease(self) -> Lease {
        match self {
            Renewal::Renewed(l) | Renewal::Reregistered(l) => l,
        }
    }
}

/// A client of one registry. Cheap to clone; clones share the connection pool and the memory
/// of what was registered.
#[derive(Debug, Clone)]
pub struct RegistryClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    registered: Mutex<HashMap<Uuid, Registration>>,
}

impl RegistryClient {
    /// A client of the registry at `base_url` (e.g. `http://10.0.0.1:8998`), sending `token`
    /// as a bearer token on writes when given. Proxy environment variables are ignored: the
    /// registry is cluster-internal.
    pub fn new(base_url: impl Into<String>, token: Option<String>) -> Result<Self, ClientError> {
        let url: String = base_url.into();
        let base = url.trim_end_matches('/').to_owned();
        let setup = |message: String| ClientError::Setup {
            url: url.clone(),
            message,
        };
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(setup(
                "the URL must start with http:// or https://".to_owned(),
            ));
        }
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| setup(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                base,
                token,
                registered: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The base URL, without a trailing slash.
    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// Registers `registration` (validated first) and remembers it for re-registration.
    pub async fn register(&self, registration: &Registration) -> Result<Lease, ClientError> {
        const OP: &str = "register";
        registration.validate()?;
        let url = self.url("/v1/ranks");
        let req = self.write(self.inner.http.post(&url)).json(registration);
        let resp = send(OP, &url, req).await?;
        let lease = read_json(OP, check(OP, resp).await?).await?;
        self.remembered()
            .insert(registration.instance_id, registration.clone());
        Ok(lease)
    }

    /// Renews the lease of `instance_id`. When the registry does not know it (it restarted,
    /// or the lease expired), registers again what this client registered under that id.
    pub async fn heartbeat(&self, instance_id: Uuid) -> Result<Renewal, ClientError> {
        const OP: &str = "heartbeat";
        let url = self.url(&format!("/v1/ranks/{instance_id}/heartbeat"));
        let resp = send(OP, &url, self.write(self.inner.http.post(&url))).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            let again = self.remembered().get(&instance_id).cloned();
            let Some(registration) = again else {
                return Err(ClientError::NotRegistered(instance_id));
            };
            tracing::info!(%instance_id, "registry does not know this instance; registering again");
            return self
                .register(&registration)
                .await
                .map(Renewal::Reregistered);
        }
        read_json(OP, check(OP, resp).await?)
            .await
            .map(Renewal::Renewed)
    }

    /// Removes `instance_id` from the registry and from this client's memory. Returns false
    /// when the registry did not know it (already expired or removed).
    pub async fn deregister(&self, instance_id: Uuid) -> Result<bool, ClientError> {
        const OP: &str = "deregister";
        self.remembered().remove(&instance_id);
        let url = self.url(&format!("/v1/ranks/{instance_id}"));
        let resp = send(OP, &url, self.write(self.inner.http.delete(&url))).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(false);
        }
        check(OP, resp).await.map(|_| true)
    }

    /// The complete prefill group `dp_rank`, or [`ClientError::Incomplete`] (retryable) while
    /// some of its ranks are not registered.
    pub async fn lookup_prefill(&self, dp_rank: u32) -> Result<PrefillGroup, ClientError> {
        const OP: &str = "lookup_prefill";
        let url = self.url(&format!("/v1/groups/{dp_rank}"));
        let resp = send(OP, &url, self.inner.http.get(&url)).await?;
        if resp.status() == StatusCode::SERVICE_UNAVAILABLE {
            return Err(ClientError::Incomplete {
                dp_rank,
                message: error_message(resp).await,
            });
        }
        read_json(OP, check(OP, resp).await?).await
    }

    /// Every live registration.
    pub async fn list_ranks(&self) -> Result<Vec<RankInfo>, ClientError> {
        const OP: &str = "list_ranks";
        let url = self.url("/v1/ranks");
        let resp = send(OP, &url, self.inner.http.get(&url)).await?;
        let list: RankList = read_json(OP, check(OP, resp).await?).await?;
        Ok(list.ranks)
    }

    /// The registry's health summary.
    pub async fn health(&self) -> Result<Health, ClientError> {
        const OP: &str = "health";
        let url = self.url("/healthz");
        let resp = send(OP, &url, self.inner.http.get(&url)).await?;
        read_json(OP, check(OP, resp).await?).await
    }

    /// Registers `registration`, then keeps its lease alive on a tokio task: a heartbeat every
    /// third of the lease, registering again when the registry forgot it, warning (rate
    /// limited) while the registry is unreachable. When `cancel` fires, the task deregisters
    /// and ends. The first registration's error is returned here, before any task starts.
    pub async fn keep_alive(
        &self,
        registration: Registration,
        cancel: CancellationToken,
    ) -> Result<KeepAlive, ClientError> {
        let lease = self.register(&registration).await?;
        let client = self.clone();
        let handle = tokio::spawn(async move {
            client
                .keep_alive_loop(registration.instance_id, lease, cancel)
                .await;
        });
        Ok(KeepAlive { lease, handle })
    }

    async fn keep_alive_loop(&self, instance_id: Uuid, lease: Lease, cancel: CancellationToken) {
        let mut period = heartbeat_period(lease);
        let mut failures: u64 = 0;
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(period) => {}
            }
            match self.heartbeat(instance_id).await {
                Ok(renewal) => {
                    if failures > 0 {
                        tracing::info!(%instance_id, failures, "registry reachable again");
                    }
                    failures = 0;
                    period = heartbeat_period(renewal.lease());
                }
                Err(e) => {
                    failures += 1;
                    // Warn on the first failure, then once every 10, so a long outage does
                    // not flood the log.
                    if failures % 10 == 1 {
                        tracing::warn!(%instance_id, failures, retryable = e.is_retryable(), error = %e, "heartbeat failed");
                    }
                }
            }
        }
        match self.deregister(instance_id).await {
            Ok(_) => tracing::debug!(%instance_id, "deregistered"),
            Err(e) => tracing::warn!(%instance_id, error = %e, "deregister on shutdown failed"),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.inner.base)
    }

    fn write(&self, req: RequestBuilder) -> RequestBuilder {
        match &self.inner.token {
            Some(token) => req.bearer_auth(token),
            None => req,
        }
    }

    fn remembered(&self) -> MutexGuard<'_, HashMap<Uuid, Registration>> {
        self.inner
            .registered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// A lease kept alive by [`RegistryClient::keep_alive`].
#[derive(Debug)]
pub struct KeepAlive {
    lease: Lease,
    handle: JoinHandle<()>,
}

impl KeepAlive {
    /// The lease granted by the first registration.
    pub fn lease(&self) -> Lease {
        self.lease
    }

    /// Waits until the task has ended (after its token was cancelled and it deregistered).
    pub async fn stopped(self) {
        if let Err(e) = self.handle.await {
            tracing::warn!(error = %e, "lease keep-alive task ended abnormally");
        }
    }
}

fn heartbeat_period(lease: Lease) -> Duration {
    (Duration::from_millis(lease.lease_ttl_ms) / 3).max(MIN_HEARTBEAT_PERIOD)
}

async fn send(op: &'static str, url: &str, req: RequestBuilder) -> Result<Response, ClientError> {
    req.send().await.map_err(|source| ClientError::Unreachable {
        op,
        url: url.to_owned(),
        source,
    })
}

/// The response if its status is a success, else the classified error.
async fn check(op: &'static str, resp: Response) -> Result<Response, ClientError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let message = error_message(resp).await;
    let code = status.as_u16();
    Err(match status {
        StatusCode::CONFLICT => ClientError::Conflict { op, message },
        StatusCode::UNAUTHORIZED => ClientError::Unauthorized { op, message },
        s if s.is_server_error() => ClientError::Server {
            op,
            status: code,
            message,
        },
        _ => ClientError::Rejected {
            op,
            status: code,
            message,
        },
    })
}

/// The `error` of a JSON error body, or the raw body when it is not one.
async fn error_message(resp: Response) -> String {
    let status = resp.status();
    match resp.text().await {
        Ok(text) => match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => body.error,
            Err(_) if text.is_empty() => status.to_string(),
            Err(_) => text,
        },
        Err(e) => format!("{status} (body unreadable: {e})"),
    }
}

async fn read_json<T: DeserializeOwned>(
    op: &'static str,
    resp: Response,
) -> Result<T, ClientError> {
    resp.json()
        .await
        .map_err(|source| ClientError::Decode { op, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_must_be_http() {
        assert!(matches!(
            RegistryClient::new("10.0.0.1:8998", None),
            Err(ClientError::Setup { .. })
        ));
        let c = RegistryClient::new("http://127.0.0.1:8998/", None).unwrap();
        assert_eq!(c.base_url(), "http://127.0.0.1:8998");
    }

    #[test]
    fn heartbeat_period_is_a_third_of_the_lease() {
        assert_eq!(
            heartbeat_period(Lease { lease_ttl_ms: 9000 }),
            Duration::from_secs(3)
        );
        assert_eq!(
            heartbeat_period(Lease { lease_ttl_ms: 1 }),
            MIN_HEARTBEAT_PERIOD
        );
    }
}
