//! What a running agent of either role keeps besides its state ([`Serving`]): its tasks (the
//! role's own and the engine API's) and its registration in the registry, renewed until
//! shutdown.

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

impl Serving {
    /// Registers the rank (its lease renewed until `shutdown`), then runs the role's `tasks`
    /// and serves the engine API `app` on `listener` beside them; `role`: its name, and whether
    /// `app` checks a token.
    pub(crate) async fn start(
        registry: &RegistryClient,
        registration: Registration,
        mut tasks: JoinSet<()>,
        (listener, app): (TcpListener, Router),
        shutdown: CancellationToken,
        role: (&'static str, bool),
    ) -> Result<Self, AgentError> {
        let keep_alive = registry.keep_alive(registration, shutdown.clone()).await?;
        api::spawn_api(&mut tasks, listener, app, shutdown, role);
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
