//! Graceful shutdown: the first SIGINT or SIGTERM cancels the process's shutdown token.
//!
//! The handlers are installed before [`on_signal`] returns, so a signal sent right after a
//! process printed its listening line is never lost to the default action (which would kill
//! the process instead of shutting it down).

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Installs the SIGINT and SIGTERM handlers now; the returned task cancels `shutdown` on the
/// first of them. Must be called inside a tokio runtime.
pub(crate) fn on_signal(shutdown: CancellationToken) -> JoinHandle<()> {
    let term = install(SignalKind::terminate(), "SIGTERM");
    let int = install(SignalKind::interrupt(), "SIGINT");
    tokio::spawn(async move {
        let name = tokio::select! {
            () = recv(term) => "SIGTERM",
            () = recv(int) => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down");
        shutdown.cancel();
    })
}

fn install(kind: SignalKind, name: &str) -> Option<Signal> {
    signal(kind)
        .inspect_err(|e| tracing::warn!(signal = name, error = %e, "cannot listen for the signal"))
        .ok()
}

async fn recv(signal: Option<Signal>) {
    match signal {
        Some(mut s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}
