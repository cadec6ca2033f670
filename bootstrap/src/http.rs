//! Serving an axum router on a TCP listener: the registry, the agents' engine API and the
//! proxy all serve through [`serve`].
//!
//! A connection is unproven ([`crate::admission`]) from its accept until it made a request that
//! was not refused with 401: the oldest unproven connections are dropped first once
//! [`MAX_UNPROVEN`](crate::admission::MAX_UNPROVEN) wait, and any unproven for
//! [`PROOF_DEADLINE`](crate::admission::PROOF_DEADLINE) is dropped, so connections that never
//! send a request (or only requests without the token) never stop a client's from being
//! served. A proven connection is served for as long as its client keeps it, as with any
//! keep-alive HTTP/1.1 server.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::{Admission, Admitted};

/// How long the accept loop pauses after the OS refused an accept (out of descriptors): the
/// dropping of unproven connections frees some meanwhile.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// Serves `app` on `listener` until `shutdown` is cancelled, then lets open requests finish
/// and returns once every connection closed. `what` names the port in logs ("registry",
/// "engine API", "proxy").
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    shutdown: CancellationToken,
    what: &'static str,
) -> std::io::Result<()> {
    let admission = Admission::new(what);
    let tasks = TaskTracker::new();
    loop {
        let next = tokio::time::Instant::from_std(admission.expire());
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep_until(next) => continue,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(port = what, error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
        };
        let admitted = admission.admit(peer.to_string());
        tasks.spawn(connection(stream, app.clone(), admitted, shutdown.clone()));
    }
    drop(listener);
    tasks.close();
    tasks.wait().await;
    Ok(())
}

async fn connection(
    stream: tokio::net::TcpStream,
    app: axum::Router,
    admitted: Admitted,
    shutdown: CancellationToken,
) {
    let admitted = Arc::new(admitted);
    let inner = TowerToHyperService::new(app);
    let proof = admitted.clone();
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let response = hyper::service::Service::call(&inner, request);
        let proof = proof.clone();
        async move {
            let response = response.await?;
            if response.status() != axum::http::StatusCode::UNAUTHORIZED {
                proof.prove();
            }
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(served);
    tokio::select! {
        _ = served.as_mut() => {}
        () = admitted.dropped() => {}
        () = shutdown.cancelled() => {
            served.as_mut().graceful_shutdown();
            tokio::select! {
                _ = served => {}
                () = admitted.dropped() => {}
            }
        }
    }
}
