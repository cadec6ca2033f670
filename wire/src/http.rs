//! Serving an axum router on a TCP listener: the registry, the agents' engine API and the
//! proxy all serve through [`serve`].
//!
//! A connection is unproven ([`crate::admission`]) from its accept until a request came on it
//! ([`Proof::Request`], a port without a token) or a request its app let past the token check
//! ([`Proof::Authorized`]): the oldest unproven connections are dropped first once
//! [`MAX_UNPROVEN`](crate::admission::MAX_UNPROVEN) wait, and any unproven for
//! [`PROOF_DEADLINE`](crate::admission::PROOF_DEADLINE) is dropped, so connections that never
//! send a request (or only requests without the token) never stop a client's from being
//! served. The proof comes as the request arrives, not with its answer: a request that takes
//! longer than the deadline to answer (a completion through the proxy) keeps its connection.
//! A proven connection is served while its client keeps sending requests: from each answer on,
//! the next request's head must arrive whole within [`HEADER_TIMEOUT`], else the connection is
//! closed, so neither an idle keep-alive connection nor one that sends its headers a byte at a
//! time holds a socket and a task for ever. A request being answered is never timed out.
//! A port given a certificate ([`ServerTls`]) serves HTTPS only: its TLS handshake must end
//! within the same bound as a request head.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::{Admission, Admitted};
use crate::tls::ServerTls;

/// The content type of every kvferry `/metrics` answer (registry, agents, proxy): the
/// OpenMetrics text format that `prometheus-client` writes.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why a request's `Authorization` header does not carry the bearer token a port needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BearerError {
    /// No `Authorization` header.
    #[error("missing Authorization header: this port needs `Authorization: Bearer <token>`")]
    Missing,
    /// A bearer token, not the port's.
    #[error("wrong bearer token")]
    Wrong,
    /// Something else than `Bearer <token>`.
    #[error("Authorization header is not of the form `Bearer <token>`")]
    Malformed,
}

/// Checks that `value` (a request's `Authorization` header) is `Bearer <token>`, comparing the
/// token in constant time. The registry and the agents' engine API both check with this.
pub fn check_bearer(value: Option<&HeaderValue>, token: &str) -> Result<(), BearerError> {
    let value = value.ok_or(BearerError::Missing)?;
    let presented = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or(BearerError::Malformed)?;
    match constant_time_eq(presented.as_bytes(), token.as_bytes()) {
        true => Ok(()),
        false => Err(BearerError::Wrong),
    }
}

/// Compares without stopping at the first differing byte (the length is not secret).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long a connection has to send a request's head once the server waits for it (after the
/// accept, and after each answer on a kept-alive connection); then it is closed. Clients of
/// kvferry's ports reuse a kept-alive connection only while it has been idle for less
/// ([`CLIENT_IDLE`]).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long kvferry's own HTTP clients keep an idle connection for reuse: well below
/// [`HEADER_TIMEOUT`], so that a request never goes out on a connection the server is closing.
pub const CLIENT_IDLE: Duration = Duration::from_secs(20);

/// The builder of kvferry's HTTP clients (of its own ports and of engines'): no proxy from
/// the environment, idle connections kept for [`CLIENT_IDLE`] at most, HTTPS trusting the
/// system's roots and the certificates given to [`crate::tls::trust`].
pub fn client() -> reqwest::ClientBuilder {
    #[allow(clippy::disallowed_methods)] // the one place that builds them
    crate::tls::client(
        reqwest::Client::builder()
            .no_proxy()
            .pool_idle_timeout(CLIENT_IDLE),
    )
}

/// How long the accept loop pauses after the OS refused an accept (out of descriptors): the
/// dropping of unproven connections frees some meanwhile.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// What proves a connection served by [`serve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proof {
    /// Any request (a port without a token).
    Request,
    /// A request the app let past its token check: the app calls [`prove`] then.
    Authorized,
}

/// The connection a request came on, in the request's extensions.
#[derive(Clone)]
struct Connection(Arc<Admitted>);

/// Proves the connection `request` came on (an app serving with [`Proof::Authorized`] calls
/// this once the request passed its token check).
pub fn prove<B>(request: &hyper::Request<B>) {
    if let Some(Connection(admitted)) = request.extensions().get() {
        admitted.prove();
    }
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then lets open requests finish
/// and returns once every connection closed. `what` names the port in logs ("registry",
/// "engine API", "proxy"); `proof` says what proves a connection; with `tls`, every
/// connection is HTTPS.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    shutdown: CancellationToken,
    what: &'static str,
    proof: Proof,
    tls: Option<ServerTls>,
) -> std::io::Result<()> {
    let port = Port {
        app,
        what,
        proof,
        tls,
        header_timeout: HEADER_TIMEOUT,
    };
    serve_with(listener, port, shutdown).await
}

/// How a port serves each of its connections.
#[derive(Clone)]
struct Port {
    app: axum::Router,
    what: &'static str,
    proof: Proof,
    tls: Option<ServerTls>,
    /// The bound on a request head and on a TLS handshake ([`HEADER_TIMEOUT`]).
    header_timeout: Duration,
}

/// [`serve`] of a [`Port`] (tests give another bound than [`HEADER_TIMEOUT`]).
async fn serve_with(
    listener: TcpListener,
    port: Port,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let what = port.what;
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
        tasks.spawn(connection(stream, port.clone(), admitted, shutdown.clone()));
    }
    drop(listener);
    tasks.close();
    tasks.wait().await;
    Ok(())
}

/// Serves one accepted connection, after its TLS handshake on an HTTPS port.
async fn connection(
    stream: tokio::net::TcpStream,
    port: Port,
    admitted: Admitted,
    shutdown: CancellationToken,
) {
    let admitted = Arc::new(admitted);
    let Some(tls) = port.tls.clone() else {
        return http(stream, port, admitted, shutdown).await;
    };
    let handshake = tokio::time::timeout(port.header_timeout, tls.acceptor().accept(stream));
    let stream = tokio::select! {
        shaken = handshake => match shaken {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                tracing::debug!(port = port.what, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(port = port.what, "TLS handshake not done in time: closed");
                return;
            }
        },
        () = admitted.dropped() => return,
        () = shutdown.cancelled() => return,
    };
    http(stream, port, admitted, shutdown).await
}

/// Serves HTTP/1.1 on one connection (plain or TLS).
async fn http<S>(stream: S, port: Port, admitted: Arc<Admitted>, shutdown: CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let Port {
        app,
        proof,
        header_timeout,
        ..
    } = port;
    let inner = TowerToHyperService::new(app);
    let connection = Connection(admitted.clone());
    let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
        if proof == Proof::Request {
            connection.0.prove();
        }
        request.extensions_mut().insert(connection.clone());
        hyper::service::Service::call(&inner, request)
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn a_bearer_is_checked_and_each_refusal_says_why() {
        let header = |v: &str| HeaderValue::from_str(v).unwrap();
        assert_eq!(check_bearer(Some(&header("Bearer t0k")), "t0k"), Ok(()));
        assert_eq!(check_bearer(Some(&header("Bearer  t0k ")), "t0k"), Ok(()));
        assert_eq!(check_bearer(None, "t0k"), Err(BearerError::Missing));
        assert_eq!(
            check_bearer(Some(&header("Bearer t0")), "t0k"),
            Err(BearerError::Wrong)
        );
        assert_eq!(
            check_bearer(Some(&header("Bearer ")), "t0k"),
            Err(BearerError::Wrong)
        );
        for malformed in ["t0k", "Basic dDBr", "bearer t0k"] {
            assert_eq!(
                check_bearer(Some(&header(malformed)), "t0k"),
                Err(BearerError::Malformed),
                "{malformed}"
            );
        }
    }
    use crate::admission::PROOF_DEADLINE;
    use axum::Router;
    use axum::extract::Request;
    use axum::middleware::{self, Next};
    use axum::routing::get;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// The status line of a GET to `/slow` on a fresh connection ("" when the connection closed
    /// without an answer), served with `proof`; `/slow` answers after `delay` (never without
    /// one), and the app proves each request when `app_proves`.
    async fn slow_answer(proof: Proof, app_proves: bool, delay: Option<Duration>) -> String {
        let mut app = Router::new().route(
            "/slow",
            get(move || async move {
                match delay {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
                "done"
            }),
        );
        if app_proves {
            app = app.layer(middleware::from_fn(|req: Request, next: Next| async move {
                prove(&req);
                next.run(req).await
            }));
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(listener, app, shutdown.clone(), "test", proof, None));
        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        client
            .write_all(b"GET /slow HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
            .await
            .expect("request");
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(120), client.read_to_end(&mut answer));
        assert!(
            read.await.is_ok(),
            "the connection neither answered nor closed"
        );
        shutdown.cancel();
        server.abort();
        let answer = String::from_utf8_lossy(&answer);
        answer.lines().next().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn a_request_proves_its_connection_as_it_arrives_not_with_its_answer() {
        let long = Some(2 * PROOF_DEADLINE);
        let (any, authorized, unproven) = tokio::join!(
            slow_answer(Proof::Request, false, long),
            slow_answer(Proof::Authorized, true, long),
            // Control: a request the app never lets past its token check leaves the connection
            // unproven, and the deadline drops it.
            slow_answer(Proof::Authorized, false, None),
        );
        assert_eq!(any, "HTTP/1.1 200 OK", "a port without a token");
        assert_eq!(authorized, "HTTP/1.1 200 OK", "a port with a token");
        assert_eq!(unproven, "", "an unproven connection is dropped");
    }

    /// Reads `client` until `until` came, or the connection closed; what it read.
    async fn read_until(client: &mut tokio::net::TcpStream, until: &str) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&got).contains(until) {
            match client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    /// A proven connection (no admission deadline applies to it) whose next request head does
    /// not come whole within the bound is closed: idle after an answer, or sending that head a
    /// byte at a time. An answer that takes longer than the bound is not cut.
    #[tokio::test]
    async fn a_kept_alive_connection_is_closed_when_its_next_head_does_not_come() {
        let bound = Duration::from_millis(500);
        let app = Router::new().route("/x", get(|| async { "x-body" })).route(
            "/slow",
            get(move || async move {
                tokio::time::sleep(4 * bound).await;
                "slow-body"
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let shutdown = CancellationToken::new();
        let port = Port {
            app,
            what: "test",
            proof: Proof::Request,
            tls: None,
            header_timeout: bound,
        };
        let server = tokio::spawn(serve_with(listener, port, shutdown.clone()));
        for trickle in [false, true] {
            let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
            client
                .write_all(b"GET /slow HTTP/1.1\r\nhost: test\r\n\r\n")
                .await
                .expect("request");
            let answer = read_until(&mut client, "slow-body").await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            let (mut reader, mut writer) = client.into_split();
            let started = std::time::Instant::now();
            let writing = tokio::spawn(async move {
                for &b in b"GET /x HTTP/1.1\r\nhost: test\r\n" {
                    if !trickle || writer.write_all(&[b]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                std::future::pending::<()>().await
            });
            let mut rest = Vec::new();
            let closed =
                tokio::time::timeout(Duration::from_secs(60), reader.read_to_end(&mut rest)).await;
            writing.abort();
            let waited = started.elapsed();
            assert!(
                closed.is_ok(),
                "trickle {trickle}: the connection was still open after 60 s"
            );
            assert!(
                waited >= bound,
                "trickle {trickle}: closed after {waited:?}"
            );
            println!("trickle {trickle}: closed after {waited:?} (bound {bound:?})");
        }
        shutdown.cancel();
        server.abort();
    }
}
