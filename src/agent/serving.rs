//! What a running agent of either role keeps besides its state ([`Serving`]): its tasks (the
//! role's own, the engine API's and the metrics port's) and its registration in the registry,
//! renewed until shutdown, and marked draining once its engine shuts down ([`Draining`]).
//!
//! The metrics port (`--metrics-port`, [`kvferry_wire::metrics_port`]) listens before the
//! agent registers: `/readyz` is 503 until the registration is in, and again once the agent
//! drains, was replaced in the registry, or shuts down ([`Readiness`]). The pool is attached
//! before the port listens.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use kvferry_bootstrap::{KeepAlive, Registration, RegistryClient};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError, EngineApi, api};

/// A running agent's tasks and registry lease.
pub(crate) struct Serving {
    tasks: JoinSet<()>,
    keep_alive: KeepAlive,
    metrics_url: Option<String>,
}

/// What tells the registry that this rank drains: its registration, said again with
/// `draining` set. Routers that read the registry (`kvferry proxy --bootstrap`) send its engine
/// server no new requests; the rank keeps serving its rooms as before.
pub(crate) struct Draining {
    registry: RegistryClient,
    registration: Registration,
    said: Arc<AtomicBool>,
}

impl Draining {
    pub(crate) fn new(registry: RegistryClient, registration: Registration) -> Self {
        Draining {
            registry,
            registration,
            said: Arc::default(),
        }
    }

    /// Registers the rank again as draining (once; later calls return at once). A registry
    /// that cannot be reached is logged: the rank drains all the same, and routers learn it
    /// from the engine's refusals.
    pub(crate) async fn say(&self) {
        if self.said.swap(true, Ordering::Relaxed) {
            return;
        }
        let mut r = self.registration.clone();
        r.about.draining = true;
        match self.registry.register(&r).await {
            Ok(_) => {
                tracing::info!(instance = %r.instance_id, "registered as draining: routers send this engine no new requests")
            }
            Err(e) => {
                tracing::warn!(instance = %r.instance_id, error = %e, "could not register as draining")
            }
        }
    }
}

/// Whether a running agent is ready, as its metrics port's `/readyz` says.
struct Readiness {
    /// Set once registered: whether the instance was replaced in the registry since.
    registered: OnceLock<watch::Receiver<Option<String>>>,
    /// [`Draining`]'s word.
    draining: Arc<AtomicBool>,
    shutdown: CancellationToken,
}

impl Readiness {
    fn check(&self) -> Result<(), &'static str> {
        if self.shutdown.is_cancelled() {
            return Err("shutting down");
        }
        match self.registered.get() {
            None => return Err("not registered with the registry yet"),
            Some(replaced) if replaced.borrow().is_some() => {
                return Err("replaced in the registry by another instance");
            }
            Some(_) => {}
        }
        match self.draining.load(Ordering::Relaxed) {
            true => Err("draining: its engine shuts down"),
            false => Ok(()),
        }
    }
}

/// What the metrics port reads from a running agent.
struct Watch<T> {
    inner: Arc<T>,
    readiness: Arc<Readiness>,
}

impl<T: EngineApi> kvferry_wire::metrics_port::Watched for Watch<T> {
    async fn metrics(&self) -> Result<String, String> {
        Ok(self.inner.metrics())
    }

    async fn ready(&self) -> Result<(), String> {
        self.readiness.check().map_err(str::to_owned)
    }
}

impl Serving {
    /// Serves the metrics port of `inner` when `cfg` asks for one, registers the rank that
    /// `draining` describes (its lease renewed until `shutdown`), then runs the role's `tasks`
    /// and serves the engine API `app` on `listener` (over HTTPS with its TLS) beside them.
    pub(crate) async fn start<T: EngineApi>(
        inner: &Arc<T>,
        cfg: &AgentConfig,
        draining: &Draining,
        mut tasks: JoinSet<()>,
        (listener, app, tls): (TcpListener, Router, Option<kvferry_wire::tls::ServerTls>),
        shutdown: CancellationToken,
    ) -> Result<Self, AgentError> {
        let readiness = Arc::new(Readiness {
            registered: OnceLock::new(),
            draining: draining.said.clone(),
            shutdown: shutdown.clone(),
        });
        let metrics_url = match cfg.metrics_port {
            Some(port) => {
                let port = TcpListener::bind((cfg.metrics_host.as_str(), port)).await?;
                let url = crate::exposure::url_of(port.local_addr()?, &cfg.advertise_host, false);
                let watched = Arc::new(Watch {
                    inner: inner.clone(),
                    readiness: readiness.clone(),
                });
                let serve = kvferry_wire::metrics_port::serve(port, watched, shutdown.clone());
                tasks.spawn(async move {
                    if let Err(e) = serve.await {
                        tracing::error!(role = T::ROLE, error = %e, "metrics port stopped");
                    }
                });
                Some(url)
            }
            None => None,
        };
        let registration = draining.registration.clone();
        let keep_alive = draining
            .registry
            .keep_alive(registration, shutdown.clone())
            .await?;
        let _ = readiness.registered.set(keep_alive.replaced());
        let role = (T::ROLE, cfg.token.is_some());
        api::spawn_api(&mut tasks, (listener, app, tls), shutdown, role);
        Ok(Serving {
            tasks,
            keep_alive,
            metrics_url,
        })
    }

    /// The metrics port's URL, when the agent serves one (`--metrics-port`).
    pub(crate) fn metrics_url(&self) -> Option<String> {
        self.metrics_url.clone()
    }

    /// Resolves with the reason once this instance's registry slot was taken by another
    /// instance (its lease lapsed): the process must stop, it no longer serves the rank.
    pub(crate) async fn lease_lost(&self) -> String {
        self.keep_alive.lost().await
    }

    /// Waits for the tasks to end after shutdown was cancelled, and deregisters.
    pub(crate) async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
        self.keep_alive.stopped().await;
    }
}
