//! The registry's metrics port ([`kvferry_wire::metrics_port`]): `/metrics`, `/livez` and
//! `/readyz` without the token the registry's own port asks for, read-only (any other method
//! 405 and changes nothing, any other path 404), `kvferry_build_info` as the caller gave it, and
//! hostile bytes refused while it keeps serving. The etcd outage (`/livez` 200, `/readyz` 503) is
//! in `etcd.rs`.

use crate::common;

use common::{TestServer, prefill};
use kvferry_bootstrap::ServerConfig;
use kvferry_wire::BuildInfo;
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const TOKEN: &str = "metrics-port-token";

/// The status line the metrics port answers `raw` with ("" when it closed without one).
async fn status_line(metrics: &str, raw: &[u8]) -> String {
    let addr = metrics.trim_start_matches("http://");
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer and close before a huge request was all written.
    let _ = c.write_all(raw).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(60), c.read_to_end(&mut got));
    let _ = read.await.expect("an answer or a close within a minute");
    let got = String::from_utf8_lossy(&got);
    got.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn the_metrics_port_serves_three_paths_read_only_without_the_token() {
    let build = BuildInfo {
        version: "9.8.7",
        revision: "0123abc",
        protocol: 42,
    };
    let server = TestServer::start(ServerConfig {
        token: Some(TOKEN.to_owned()),
        build: Some(build),
        ..ServerConfig::default()
    })
    .await;
    let http = kvferry_wire::http::client().build().unwrap();
    let r = prefill(0, 0, 1, 0, 1);
    let resp = http
        .post(server.at("/v1/ranks"))
        .json(&r)
        .bearer_auth(TOKEN);
    assert_eq!(resp.send().await.unwrap().status(), StatusCode::CREATED);
    let at = |path: &str| format!("{}{path}", server.metrics);
    let get = |path: &str| http.get(at(path)).send();

    let resp = get("/metrics").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()["content-type"],
        kvferry_wire::http::OPENMETRICS_CONTENT_TYPE
    );
    let text = resp.text().await.unwrap();
    for line in [
        r#"kvferry_build_info{version="9.8.7",revision="0123abc",protocol="42"} 1"#,
        r#"kvferry_bootstrap_ranks{role="prefill"} 1"#,
        "kvferry_bootstrap_registrations_total 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    // The main port's /metrics says the same build (with the token).
    let main = http.get(server.at("/metrics")).bearer_auth(TOKEN);
    let main = main.send().await.unwrap().text().await.unwrap();
    assert!(
        main.contains(r#"kvferry_build_info{version="9.8.7""#),
        "{main}"
    );
    for (path, body) in [("/livez", "ok\n"), ("/readyz", "ready\n")] {
        let resp = get(path).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        assert_eq!(resp.text().await.unwrap(), body, "{path}");
        let head = http.head(at(path)).send().await.unwrap();
        assert_eq!(head.status(), StatusCode::OK, "HEAD {path}");
    }

    // Read-only: a write to any path of the port is 405 and registers nothing; the registry's
    // own routes are not there.
    let other = prefill(1, 0, 1, 0, 1);
    for method in [
        reqwest::Method::POST,
        reqwest::Method::PUT,
        reqwest::Method::DELETE,
    ] {
        for path in ["/metrics", "/livez", "/readyz"] {
            let resp = http
                .request(method.clone(), at(path))
                .json(&other)
                .send()
                .await;
            let resp = resp.unwrap();
            assert_eq!(
                resp.status(),
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}"
            );
            assert_eq!(resp.headers()["allow"], "GET, HEAD", "{method} {path}");
        }
        let resp = http.request(method.clone(), at("/v1/ranks")).json(&other);
        let status = resp.send().await.unwrap().status();
        assert_eq!(status, StatusCode::NOT_FOUND, "{method} /v1/ranks");
    }
    for path in ["/", "/healthz", "/v1/ranks", "/v1/groups/0", "/metricsx"] {
        assert_eq!(
            get(path).await.unwrap().status(),
            StatusCode::NOT_FOUND,
            "{path}"
        );
    }
    let listed = http.get(server.at("/v1/ranks")).bearer_auth(TOKEN);
    let listed: kvferry_bootstrap::RankList = listed.send().await.unwrap().json().await.unwrap();
    let ids: Vec<_> = listed
        .ranks
        .iter()
        .map(|i| i.registration.instance_id)
        .collect();
    assert_eq!(
        ids,
        vec![r.instance_id],
        "nothing registered through the metrics port"
    );
    let text = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        text.lines()
            .any(|l| l == "kvferry_bootstrap_registrations_total 1"),
        "{text}"
    );

    // Hostile bytes: an error, and the port keeps serving.
    let garbage = status_line(&server.metrics, b"\x16\x03\x01\x00\xff garbage\r\n\r\n").await;
    assert_eq!(garbage, "HTTP/1.1 400 Bad Request");
    let mut huge = b"GET /metrics HTTP/1.1\r\nhost: x\r\n".to_vec();
    for i in 0..20_000 {
        huge.extend_from_slice(format!("x-filler-{i}: {}\r\n", "y".repeat(64)).as_bytes());
    }
    huge.extend_from_slice(b"\r\n");
    let refused = status_line(&server.metrics, &huge).await;
    assert!(
        refused.is_empty() || refused.starts_with("HTTP/1.1 431"),
        "huge headers: {refused:?}"
    );
    assert_eq!(get("/livez").await.unwrap().status(), StatusCode::OK);
    assert_eq!(get("/readyz").await.unwrap().status(), StatusCode::OK);
    server.stop().await;
}
