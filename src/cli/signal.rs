//! Graceful shutdown: the first SIGINT or SIGTERM cancels the process's shutdown token.

use tokio_util::sync::CancellationToken;

/// Cancels `shutdown` on the first SIGINT or SIGTERM.
pub(crate) async fn cancel_on_signal(shutdown: CancellationToken) {
    let name = wait_for_signal().await;
    tracing::info!(signal = name, "shutting down");
    shutdown.cancel();
}

#[cfg(unix)]
async fn wait_for_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; only SIGINT stops the process");
            return match tokio::signal::ctrl_c().await {
                Ok(()) => "SIGINT",
                Err(_) => std::future::pending().await,
            };
        }
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        r = tokio::signal::ctrl_c() => match r {
            Ok(()) => "SIGINT",
            Err(_) => { term.recv().await; "SIGTERM" }
        },
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() -> &'static str {
    match tokio::signal::ctrl_c().await {
        Ok(()) => "ctrl-c",
        Err(_) => std::future::pending().await,
    }
}
