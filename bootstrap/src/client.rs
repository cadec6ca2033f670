//! The typed async client of the registry, used by the agents: register, heartbeat (which
//! re-registers by itself when the registry forgot the instance), deregister, look up a prefill
//! group, and [`RegistryClient::keep_alive`], a task that keeps one lease alive until cancelled.
//!
//! Errors are classified: [`ClientError::is_retryable`] is true for an incomplete group, an
//! unreachable registry, a 5xx or a slot held by another live instance (which may be this
//! rank's dead predecessor whose lease has not lapsed yet); any other 4xx (bad registration,
//! conflict, wrong token) is fatal.
//!
//! The registry never replaces a live rank, so [`RegistryClient::keep_alive`]:
//! - on start, retries a registration refused because the slot is held
//!   ([`ClientError::SlotHeld`]) until the holder's lease lapses, and gives up
//!   ([`ClientError::SlotStillHeld`]) only when the same holder still holds the slot
//!   [`HOLDER_RENEWING_LEASES`] lease lengths after it was first seen: a dead holder's lease
//!   lapses within one, so that holder is alive and renewing (another process serves the rank);
//! - while running, learns that its instance was replaced (its lease lapsed, another instance
//!   took the slot) when its heartbeat is unknown and registering again meets the new holder
//!   ([`ClientError::Replaced`]); it then stops and reports it through [`KeepAlive::lost`],
//!   instead of fighting the new holder for the slot.
//!
//! A client may be given several registry URLs (replicas on one etcd store): each request
//! tries them in order from the one that last answered, fails over to the next on a
//! connection error, a timeout or a 5xx, and sticks with the first that answers; a 4xx is an
//! answer (final, not retried elsewhere). When every URL fails, the last failure is returned.
//!
//! Every request carries the bearer token when one is given.
//! The client remembers what it registered (per instance id) so it can register again after a
//! registry restart; the memory sits behind a short `std::sync::Mutex` never held across
//! `.await`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use reqwest::{RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::types::{
    Admitted, ErrorBody, Health, InvalidRegistration, Lease, PrefillGroup, RankInfo, RankList,
    Registration,
};

/// How long one request to the registry may take, connect included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest heartbeat period, whatever the lease.
const MIN_HEARTBEAT_PERIOD: Duration = Duration::from_millis(10);
/// A registration gives up on a held slot when the same holder still holds it this many lease
/// lengths after it was first met: a dead holder's lease would have lapsed within one.
pub const HOLDER_RENEWING_LEASES: u32 = 3;
/// Added to a holder's remaining lease before registering again, so the retry lands after the
/// registry expired it.
const HELD_RETRY_MARGIN: Duration = Duration::from_millis(50);

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
    #[error("{op}: registry at {url} unreachable: {}", causes(source))]
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
    /// The slot is held by another live instance (409 naming it): retryable, the holder may be
    /// this rank's dead predecessor whose lease has not lapsed yet.
    #[error("{op}: {message}")]
    SlotHeld {
        /// The operation that failed.
        op: &'static str,
        /// The instance holding the slot.
        holder: Uuid,
        /// What is left of the holder's lease.
        remaining: Duration,
        /// The registry's lease length.
        lease_ttl: Duration,
        /// The registry's message, naming the slot and the holder.
        message: String,
    },
    /// The slot stayed held by the same live instance for longer than a dead instance's lease
    /// could last: another process is serving this rank and renewing its lease.
    #[error(
        "register: {role} dp_rank={dp_rank} tp_rank={tp_rank} pp_rank={pp_rank} is served by live \
         instance {holder}, which kept renewing its lease for {waited_ms} ms (more than \
         {HOLDER_RENEWING_LEASES} leases of {lease_ttl_ms} ms): another process runs this rank; \
         stop it or give this one other ranks"
    )]
    SlotStillHeld {
        /// The slot's role.
        role: crate::types::Role,
        /// The slot's dp rank.
        dp_rank: u32,
        /// The slot's tp rank.
        tp_rank: u32,
        /// The slot's pp rank.
        pp_rank: u32,
        /// The instance holding the slot.
        holder: Uuid,
        /// How long this client saw it holding the slot.
        waited_ms: u64,
        /// The registry's lease length.
        lease_ttl_ms: u64,
    },
    /// This instance's lease lapsed and another instance took its slot: this process no longer
    /// serves the rank and must not register again.
    #[error(
        "heartbeat: instance {instance} was replaced by instance {by} after its lease lapsed \
         (this process missed its heartbeats); the rank is served by the new instance, so this one \
         stops instead of registering again"
    )]
    Replaced {
        /// This client's instance.
        instance: Uuid,
        /// The instance now holding the slot.
        by: Uuid,
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
    #[error("{op}: unreadable answer from the registry: {}", causes(source))]
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
    /// The registration was still waiting for a held slot when it was cancelled.
    #[error("register: cancelled while waiting for the slot held by instance {holder}")]
    Cancelled {
        /// The instance holding the slot.
        holder: Uuid,
    },
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
    /// True when the same call may succeed later (incomplete group, registry down, 5xx, a slot
    /// held by an instance that may be dead).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClientError::Incomplete { .. }
                | ClientError::Unreachable { .. }
                | ClientError::Server { .. }
                | ClientError::SlotHeld { .. }
        )
    }
}

/// `e` and every error under it, `: `-separated: reqwest's own text names only the request
/// ("error sending request for url ..."), its sources say why (refused, timed out...).
fn causes(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
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

/// A client of one registry (one URL, or several replicas on one store). Cheap to clone;
/// clones share the connection pool, the URL in use and the memory of what was registered.
#[derive(Debug, Clone)]
pub struct RegistryClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    /// The registry URLs, without trailing slashes, in the order given.
    bases: Vec<String>,
    /// Index into `bases` of the URL that last answered: requests start there.
    current: AtomicUsize,
    token: Option<String>,
    registered: Mutex<HashMap<Uuid, Registration>>,
}

impl RegistryClient {
    /// A client of the registry at `base_url` (e.g. `http://10.0.0.1:8998`), or of the
    /// replicas at a comma-separated list of URLs (`http://a:8998,http://b:8998`, tried in
    /// order, see the module doc), sending `token` as a bearer token on every request when
    /// given. Proxy environment variables are ignored: the registry is cluster-internal.
    pub fn new(base_url: impl Into<String>, token: Option<String>) -> Result<Self, ClientError> {
        let url: String = base_url.into();
        let setup = |message: String| ClientError::Setup {
            url: url.clone(),
            message,
        };
        let mut bases = Vec::new();
        for one in url.split(',').map(str::trim) {
            let base = one.trim_end_matches('/').to_owned();
            if !(base.starts_with("http://") || base.starts_with("https://")) {
                return Err(setup(format!(
                    "{one:?}: every URL must start with http:// or https://"
                )));
            }
            bases.push(base);
        }
        // No redirects: the token goes to the registries the agent was given, not to where
        // one of them points.
        let http = kvferry_wire::http::client()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| setup(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                bases,
                current: AtomicUsize::new(0),
                token,
                registered: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The base URL in use (the one that last answered, the first at start), without a
    /// trailing slash.
    pub fn base_url(&self) -> &str {
        let i = self.inner.current.load(Ordering::Relaxed);
        self.inner.bases.get(i).map_or("", String::as_str)
    }

    /// Every base URL, in the order given.
    pub fn base_urls(&self) -> &[String] {
        &self.inner.bases
    }

    /// Registers `registration` (validated first) and remembers it for re-registration.
    pub async fn register(&self, registration: &Registration) -> Result<Lease, ClientError> {
        const OP: &str = "register";
        registration.validate()?;
        let resp = self
            .send(OP, "/v1/ranks", |http, url| {
                http.post(url).json(registration)
            })
            .await?;
        let admitted: Admitted = read_json(OP, check(OP, resp).await?).await?;
        if let Some(why) = &admitted.unmatched {
            tracing::warn!(instance_id = %registration.instance_id, role = %registration.role, %why, "the registry says no instance of the other role can exchange KV with this one");
        }
        self.remembered()
            .insert(registration.instance_id, registration.clone());
        Ok(admitted.lease)
    }

    /// Renews the lease of `instance_id`. When the registry does not know it (it restarted,
    /// or the lease expired), registers again what this client registered under that id.
    pub async fn heartbeat(&self, instance_id: Uuid) -> Result<Renewal, ClientError> {
        const OP: &str = "heartbeat";
        let path = format!("/v1/ranks/{instance_id}/heartbeat");
        let resp = self.send(OP, &path, |http, url| http.post(url)).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            let again = self.remembered().get(&instance_id).cloned();
            let Some(registration) = again else {
                return Err(ClientError::NotRegistered(instance_id));
            };
            tracing::warn!(%instance_id, "registry does not know this instance (registry restarted or lease lapsed); registering again");
            return match self.register(&registration).await {
                Ok(lease) => Ok(Renewal::Reregistered(lease)),
                Err(ClientError::SlotHeld { holder, .. }) => {
                    self.remembered().remove(&instance_id);
                    Err(ClientError::Replaced {
                        instance: instance_id,
                        by: holder,
                    })
                }
                Err(e) => Err(e),
            };
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
        let path = format!("/v1/ranks/{instance_id}");
        let resp = self.send(OP, &path, |http, url| http.delete(url)).await?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(false);
        }
        check(OP, resp).await.map(|_| true)
    }

    /// The complete prefill group `dp_rank`, or [`ClientError::Incomplete`] (retryable) while
    /// some of its ranks are not registered.
    pub async fn lookup_prefill(&self, dp_rank: u32) -> Result<PrefillGroup, ClientError> {
        const OP: &str = "lookup_prefill";
        let path = format!("/v1/groups/{dp_rank}");
        let resp = self.send(OP, &path, |http, url| http.get(url)).await?;
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
        let resp = self
            .send(OP, "/v1/ranks", |http, url| http.get(url))
            .await?;
        let list: RankList = read_json(OP, check(OP, resp).await?).await?;
        Ok(list.ranks)
    }

    /// The registry's health summary.
    pub async fn health(&self) -> Result<Health, ClientError> {
        const OP: &str = "health";
        let resp = self.send(OP, "/healthz", |http, url| http.get(url)).await?;
        read_json(OP, check(OP, resp).await?).await
    }

    /// Registers `registration`, waiting out a dead predecessor's lease (see the module doc),
    /// then keeps its lease alive on a tokio task: a heartbeat every third of the lease,
    /// registering again when the registry forgot it, warning (rate limited) while the
    /// registry is unreachable. When `cancel` fires, the task deregisters and ends; when the
    /// instance turns out replaced, the task ends and [`KeepAlive::lost`] says why. The first
    /// registration's error is returned here, before any task starts.
    pub async fn keep_alive(
        &self,
        registration: Registration,
        cancel: CancellationToken,
    ) -> Result<KeepAlive, ClientError> {
        let lease = self.register_when_free(&registration, &cancel).await?;
        let client = self.clone();
        let (lost_tx, lost) = tokio::sync::watch::channel(None);
        let handle = tokio::spawn(async move {
            client
                .keep_alive_loop(registration.instance_id, lease, cancel, lost_tx)
                .await;
        });
        Ok(KeepAlive {
            lease,
            handle,
            lost,
        })
    }

    /// [`Self::register`], retried while the slot is held by an instance whose lease may be
    /// a dead one's; [`ClientError::SlotStillHeld`] once the same holder has held it for
    /// [`HOLDER_RENEWING_LEASES`] lease lengths.
    pub async fn register_when_free(
        &self,
        registration: &Registration,
        cancel: &CancellationToken,
    ) -> Result<Lease, ClientError> {
        let mut first_seen: Option<(Uuid, tokio::time::Instant)> = None;
        loop {
            let (holder, remaining, lease_ttl) = match self.register(registration).await {
                Err(ClientError::SlotHeld {
                    holder,
                    remaining,
                    lease_ttl,
                    ..
                }) => (holder, remaining, lease_ttl),
                other => return other,
            };
            let now = tokio::time::Instant::now();
            let since = match first_seen {
                Some((h, t)) if h == holder => t,
                _ => {
                    first_seen = Some((holder, now));
                    now
                }
            };
            let waited = now - since;
            if waited > lease_ttl * HOLDER_RENEWING_LEASES {
                let r = registration;
                let e = ClientError::SlotStillHeld {
                    role: r.role,
                    dp_rank: r.dp_rank,
                    tp_rank: r.tp_rank,
                    pp_rank: r.pp_rank,
                    holder,
                    waited_ms: millis(waited),
                    lease_ttl_ms: millis(lease_ttl),
                };
                tracing::error!(instance_id = %r.instance_id, %holder, error = %e, "giving up registering");
                return Err(e);
            }
            tracing::warn!(
                instance_id = %registration.instance_id,
                %holder,
                holder_lease_remaining_ms = millis(remaining),
                waited_ms = millis(waited),
                "slot held by another live instance (a restarted rank's predecessor until its lease lapses); waiting"
            );
            let pause = (remaining + HELD_RETRY_MARGIN).min(lease_ttl.max(MIN_HEARTBEAT_PERIOD));
            tokio::select! {
                () = cancel.cancelled() => return Err(ClientError::Cancelled { holder }),
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    async fn keep_alive_loop(
        &self,
        instance_id: Uuid,
        lease: Lease,
        cancel: CancellationToken,
        lost: tokio::sync::watch::Sender<Option<String>>,
    ) {
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
                Err(e @ ClientError::Replaced { .. }) => {
                    tracing::error!(%instance_id, error = %e, "lease lost to another instance; this instance stops");
                    lost.send_replace(Some(e.to_string()));
                    return;
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

    /// Sends the request `build` makes for `path` to the registry URLs in turn, from the one
    /// that last answered: the next is tried on a transport error (connection, timeout) or a
    /// 5xx; the first other answer (success or 4xx) is returned and its URL kept for the next
    /// requests. When every URL failed, the last failure is returned (a 5xx as a response).
    async fn send(
        &self,
        op: &'static str,
        path: &str,
        build: impl Fn(&reqwest::Client, &str) -> RequestBuilder,
    ) -> Result<Response, ClientError> {
        let bases = &self.inner.bases;
        let start = self.inner.current.load(Ordering::Relaxed);
        let mut last = None;
        for k in 0..bases.len() {
            let i = (start + k) % bases.len();
            let url = format!("{}{path}", bases[i]);
            let failure = match self.authed(build(&self.inner.http, &url)).send().await {
                Ok(resp) if !resp.status().is_server_error() => {
                    if i != start {
                        self.inner.current.store(i, Ordering::Relaxed);
                        tracing::info!(op, url = bases[i], "registry: now using this URL");
                    }
                    return Ok(resp);
                }
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    last = Some(Ok(resp));
                    format!("status {status}")
                }
                Err(source) => {
                    let e = ClientError::Unreachable {
                        op,
                        url: url.clone(),
                        source,
                    };
                    let text = e.to_string();
                    last = Some(Err(e));
                    text
                }
            };
            if k + 1 < bases.len() {
                tracing::debug!(op, %url, failure, "registry URL failed; trying the next");
            }
        }
        last.unwrap_or_else(|| {
            Err(ClientError::Setup {
                url: String::new(),
                message: "no registry URL".to_owned(),
            })
        })
    }

    fn authed(&self, req: RequestBuilder) -> RequestBuilder {
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
    lost: tokio::sync::watch::Receiver<Option<String>>,
}

impl KeepAlive {
    /// The lease granted by the first registration.
    pub fn lease(&self) -> Lease {
        self.lease
    }

    /// Resolves, with the reason, once the instance was replaced by another one (its lease
    /// lapsed and another instance took the slot); pending forever otherwise. The process
    /// should stop: it no longer serves the rank.
    pub async fn lost(&self) -> String {
        let mut rx = self.lost.clone();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return reason;
            }
            if rx.changed().await.is_err() {
                // The task ended without losing the lease (cancelled): never resolves.
                std::future::pending::<()>().await;
            }
        }
    }

    /// What tells, at any time, whether the instance was replaced: the reason [`Self::lost`]
    /// resolves with, once it was; `None` until then.
    pub fn replaced(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.lost.clone()
    }

    /// Waits until the task has ended (after its token was cancelled and it deregistered).
    pub async fn stopped(self) {
        if let Err(e) = self.handle.await {
            tracing::warn!(error = %e, "lease keep-alive task ended abnormally");
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn heartbeat_period(lease: Lease) -> Duration {
    (Duration::from_millis(lease.lease_ttl_ms) / 3).max(MIN_HEARTBEAT_PERIOD)
}

/// The response if its status is a success, else the classified error.
async fn check(op: &'static str, resp: Response) -> Result<Response, ClientError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = error_body(resp).await;
    let message = body.error;
    let code = status.as_u16();
    Err(match status {
        StatusCode::CONFLICT => match (body.holder, body.holder_lease_remaining_ms) {
            (Some(holder), Some(remaining)) => ClientError::SlotHeld {
                op,
                holder,
                remaining: Duration::from_millis(remaining),
                lease_ttl: Duration::from_millis(body.lease_ttl_ms.unwrap_or(remaining)),
                message,
            },
            _ => ClientError::Conflict { op, message },
        },
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
    error_body(resp).await.error
}

/// The JSON error body, or one made of the raw body when it is not one.
async fn error_body(resp: Response) -> ErrorBody {
    let status = resp.status();
    match resp.text().await {
        Ok(text) => match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => body,
            Err(_) if text.is_empty() => ErrorBody::new(status.to_string()),
            Err(_) => ErrorBody::new(text),
        },
        Err(e) => ErrorBody::new(format!("{status} (body unreadable: {e})")),
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
mod tests;
