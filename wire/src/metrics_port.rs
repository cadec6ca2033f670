//! The metrics port: a read-only HTTP port each role (registry, agents, proxy) serves beside its
//! main one when given `--metrics-port`, for a metrics scraper and the kubelet's probes. Every
//! role answers the same paths with the same meaning:
//!
//! | path | answer |
//! | --- | --- |
//! | `/metrics` | 200: the role's OpenMetrics text (503 with the reason when the role cannot tell its figures now, as the registry while its store is down) |
//! | `/livez` | 200 while the process serves; it asks nothing else (no store, registry or peer) |
//! | `/readyz` | 200 when the role can do its work now, else 503 with the reason ([`Watched::ready`]) |
//!
//! GET and HEAD only: any other method is 405, any other path 404. Bodies are short plain text.
//! No token and no TLS: nothing served here is secret and no request changes anything. The
//! port should still be reachable only by the scraper and the kubelet (a NetworkPolicy, or a
//! loopback address). Connections are served by [`crate::http::serve`], bounded like every
//! other port of kvferry.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::http::{OPENMETRICS_CONTENT_TYPE, Proof};

/// What a role tells its metrics port, asked afresh at each request.
pub trait Watched: Send + Sync + 'static {
    /// The role's OpenMetrics text, or why it cannot be told now.
    fn metrics(&self) -> impl Future<Output = Result<String, String>> + Send;
    /// `Ok` when the role can do its work now, else why not (a short phrase).
    fn ready(&self) -> impl Future<Output = Result<(), String>> + Send;
}

/// Serves the metrics port of `watched` on `listener` (plain HTTP) until `shutdown`.
pub async fn serve<W: Watched>(
    listener: TcpListener,
    watched: Arc<W>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = router(watched);
    crate::http::serve(listener, app, shutdown, "metrics", Proof::Request, None).await
}

/// The metrics port's routes (`get` answers HEAD too, without the body).
fn router<W: Watched>(watched: Arc<W>) -> Router {
    Router::new()
        .route("/metrics", get(metrics::<W>))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz::<W>))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .with_state(watched)
}

fn text(status: StatusCode, body: String) -> Response {
    let plain = HeaderValue::from_static("text/plain; charset=utf-8");
    (status, [(header::CONTENT_TYPE, plain)], body).into_response()
}

async fn metrics<W: Watched>(State(watched): State<Arc<W>>) -> Response {
    match watched.metrics().await {
        Ok(body) => {
            let content = HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE);
            ([(header::CONTENT_TYPE, content)], body).into_response()
        }
        Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

async fn livez() -> Response {
    text(StatusCode::OK, "ok\n".to_owned())
}

async fn readyz<W: Watched>(State(watched): State<Arc<W>>) -> Response {
    match watched.ready().await {
        Ok(()) => text(StatusCode::OK, "ready\n".to_owned()),
        Err(why) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

async fn not_found() -> Response {
    let paths = "no such path: the metrics port serves /metrics, /livez and /readyz\n";
    text(StatusCode::NOT_FOUND, paths.to_owned())
}

async fn wrong_method() -> Response {
    let mut r = text(
        StatusCode::METHOD_NOT_ALLOWED,
        "the metrics port is read-only: GET or HEAD\n".to_owned(),
    );
    let allow = HeaderValue::from_static("GET, HEAD");
    r.headers_mut().insert(header::ALLOW, allow);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[derive(Default)]
    struct Fake {
        ready: AtomicBool,
        asked: AtomicUsize,
    }

    impl Watched for Fake {
        async fn metrics(&self) -> Result<String, String> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            Ok("fake_things_total 1\n# EOF\n".to_owned())
        }
        async fn ready(&self) -> Result<(), String> {
            match self.ready.load(Ordering::Relaxed) {
                true => Ok(()),
                false => Err("not registered yet".to_owned()),
            }
        }
    }

    /// Sends `raw` on a fresh connection; the status line of the answer ("" when none came).
    async fn raw(addr: std::net::SocketAddr, raw: &[u8]) -> String {
        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        // The server may answer and close before a huge request was all written.
        let _ = c.write_all(raw).await;
        let mut got = Vec::new();
        let read =
            tokio::time::timeout(std::time::Duration::from_secs(60), c.read_to_end(&mut got));
        let _ = read.await.expect("an answer or a close within a minute");
        let got = String::from_utf8_lossy(&got);
        got.lines().next().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn three_paths_read_only_and_hostile_input_refused() {
        let fake = Arc::new(Fake::default());
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(listener, fake.clone(), shutdown.clone()));
        let http = crate::http::client().build().unwrap();
        let url = |p: &str| format!("http://{addr}{p}");
        let get = |p: &str| http.get(url(p)).send();

        let r = get("/metrics").await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()[header::CONTENT_TYPE], OPENMETRICS_CONTENT_TYPE);
        assert_eq!(r.text().await.unwrap(), "fake_things_total 1\n# EOF\n");
        let r = get("/livez").await.unwrap();
        assert_eq!(
            (r.status().as_u16(), r.text().await.unwrap()),
            (200, "ok\n".into())
        );
        let r = get("/readyz").await.unwrap();
        assert_eq!(
            (r.status().as_u16(), r.text().await.unwrap()),
            (503, "not ready: not registered yet\n".into())
        );
        fake.ready.store(true, Ordering::Relaxed);
        let r = get("/readyz").await.unwrap();
        assert_eq!(
            (r.status().as_u16(), r.text().await.unwrap()),
            (200, "ready\n".into())
        );
        let r = http.head(url("/readyz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "", "HEAD has no body");

        let asked = fake.asked.load(Ordering::Relaxed);
        for method in ["POST", "PUT", "DELETE", "PATCH"] {
            for path in ["/metrics", "/livez", "/readyz"] {
                let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
                let r = http.request(m, url(path)).body("{}").send().await.unwrap();
                assert_eq!(r.status(), 405, "{method} {path}");
                assert_eq!(r.headers()[header::ALLOW], "GET, HEAD");
            }
        }
        assert_eq!(
            fake.asked.load(Ordering::Relaxed),
            asked,
            "a 405 asks nothing"
        );
        for path in ["/", "/healthz", "/v1/rooms/1", "/metrics/x"] {
            assert_eq!(get(path).await.unwrap().status(), 404, "{path}");
        }

        assert_eq!(
            raw(addr, b"\x00\xff garbage\r\n\r\n").await,
            "HTTP/1.1 400 Bad Request"
        );
        let mut huge = b"GET /livez HTTP/1.1\r\nhost: x\r\n".to_vec();
        for i in 0..20_000 {
            huge.extend_from_slice(format!("x-filler-{i}: {}\r\n", "y".repeat(64)).as_bytes());
        }
        huge.extend_from_slice(b"\r\n");
        let status = raw(addr, &huge).await;
        assert!(
            status.is_empty() || status.starts_with("HTTP/1.1 431"),
            "huge headers: {status:?}"
        );
        assert_eq!(get("/livez").await.unwrap().status(), 200, "still serving");
        shutdown.cancel();
        server.await.unwrap().unwrap();
    }
}
