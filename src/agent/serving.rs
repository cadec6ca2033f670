//! What a running agent of either role keeps besides its state ([`Serving`]): its tasks (the
//! role's own and the engine API's) and its registration in the registry, renewed until
//! shutdown, and marked draining once its engine shuts down ([`Draining`]).

use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use kvferry_bootstrap::{KeepAlive, Registration, RegistryClient};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{AgentError, api};

/// A running agent's tasks and registry lease.
pub(crate) struct Serving {
    tasks: JoinSet<()>,
    keep_alive: KeepAlive,
}

/// What tells the registry that this rank drains: its registration, said again with
/// `draining` set. Routers that read the registry (`kvferry proxy --bootstrap`) send its engine
/// server no new requests; the rank keeps serving its rooms as before.
pub(crate) struct Draining {
    registry: RegistryClient,
    registration: Registration,
    said: AtomicBool,
}

impl Draining {
    pub(crate) fn new(registry: RegistryClient, registration: Registration) -> Self {
        Draining {
            registry,
            registration,
            said: AtomicBool::new(false),
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

impl Serving {
    /// Registers the rank (its lease renewed until `shutdown`), then runs the role's `tasks`
    /// and serves the engine API `app` on `listener` (over HTTPS with its TLS) beside them;
    /// `role`: its name, and whether `app` checks a token.
    pub(crate) async fn start(
        registry: &RegistryClient,
        registration: Registration,
        mut tasks: JoinSet<()>,
        (listener, app, tls): (TcpListener, Router, Option<kvferry_wire::tls::ServerTls>),
        shutdown: CancellationToken,
        role: (&'static str, bool),
    ) -> Result<Self, AgentError> {
        let keep_alive = registry.keep_alive(registration, shutdown.clone()).await?;
        api::spawn_api(&mut tasks, (listener, app, tls), shutdown, role);
        Ok(Serving { tasks, keep_alive })
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
