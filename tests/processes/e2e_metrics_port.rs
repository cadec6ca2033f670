//! Every role's metrics port (`--metrics-port`) as a process: the registry, a prefill and a
//! decode agent, and the proxy in front of stand-in servers each serve `/metrics`, `/livez` and
//! `/readyz` on it, without a token; `kvferry_build_info` there names `kvferry --version`'s
//! parts; writes are 405 and change nothing, other paths 404; garbage bytes and huge headers
//! get an error and the port keeps serving; the main ports keep their `/healthz` (and the
//! proxy its `/health`). The proxy is ready once a prefill and a decode server are usable.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode as AxumStatus;
use common::{AgentOpts, BOUND, Process, http, owned, poll_until, release_binary, runtime};
use reqwest::{Method, StatusCode};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// `kvferry_build_info`'s line as `kvferry --version` says the build.
fn build_info_line() -> String {
    let out = std::process::Command::new(release_binary())
        .arg("--version")
        .output()
        .expect("kvferry --version");
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    // "kvferry 0.1.0 (git abc1234)", then "protocol 13 (speaks 4 to 13)".
    let first = lines.next().unwrap();
    let (version, rest) = first
        .strip_prefix("kvferry ")
        .and_then(|r| r.split_once(" (git "))
        .unwrap_or_else(|| panic!("{first}"));
    let revision = rest.strip_suffix(')').unwrap();
    let protocol = lines.next().unwrap().split(' ').nth(1).unwrap();
    format!(
        r#"kvferry_build_info{{version="{version}",revision="{revision}",protocol="{protocol}"}} 1"#
    )
}

/// The status line `raw` gets from the port at `url` ("" when it closed without one).
async fn status_line(url: &str, raw: &[u8]) -> String {
    let addr = url.trim_start_matches("http://");
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer and close before a huge request was all written.
    let _ = c.write_all(raw).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(BOUND, c.read_to_end(&mut got));
    let _ = read.await.expect("an answer or a close within the bound");
    let got = String::from_utf8_lossy(&got);
    got.lines().next().unwrap_or_default().to_owned()
}

/// Waits until `url`'s `/readyz` answers `want`; its body then.
async fn readyz(url: &str, want: StatusCode) -> String {
    let http = http();
    poll_until(&format!("{url}/readyz {want}"), BOUND, || {
        let http = http.clone();
        async move {
            let resp = http.get(format!("{url}/readyz")).send().await.ok()?;
            match resp.status() == want {
                true => resp.text().await.ok(),
                false => None,
            }
        }
    })
    .await
}

/// The checks every role's metrics port passes: the three paths, read-only, 404 elsewhere,
/// hostile input refused while it keeps serving. `writes`: paths of the role's own API that
/// must not be reachable here.
async fn check_port(role: &str, url: &str, build: &str, writes: &[&str]) {
    let http = http();
    let at = |p: &str| format!("{url}{p}");
    let resp = http.get(at("/livez")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "{role} /livez");
    assert_eq!(resp.text().await.unwrap(), "ok\n", "{role} /livez");
    assert_eq!(readyz(url, StatusCode::OK).await, "ready\n", "{role}");
    let resp = http.get(at("/metrics")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "{role} /metrics");
    let text = resp.text().await.unwrap();
    assert!(
        text.lines().any(|l| l == build),
        "{role}: {build} in\n{text}"
    );
    assert!(text.ends_with("# EOF\n"), "{role}");
    for method in [Method::POST, Method::PUT, Method::DELETE] {
        // Its own paths refuse the method; the role's write routes do not exist there.
        let own = ["/metrics", "/livez", "/readyz"].map(|p| (p, StatusCode::METHOD_NOT_ALLOWED));
        let foreign = writes.iter().map(|p| (*p, StatusCode::NOT_FOUND));
        for (path, expected) in own.into_iter().chain(foreign) {
            let resp = http
                .request(method.clone(), at(path))
                .body("{}")
                .send()
                .await;
            let status = resp.unwrap().status();
            assert_eq!(status, expected, "{role} {method} {path}");
        }
    }
    for path in ["/", "/healthz", "/health", "/v1/pool", "/livez/x"] {
        let status = http.get(at(path)).send().await.unwrap().status();
        assert_eq!(status, StatusCode::NOT_FOUND, "{role} {path}");
    }
    let garbage = status_line(url, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n").await;
    assert_eq!(garbage, "HTTP/1.1 400 Bad Request", "{role}: garbage");
    let mut huge = b"GET /metrics HTTP/1.1\r\nhost: x\r\n".to_vec();
    for i in 0..20_000 {
        huge.extend_from_slice(format!("x-filler-{i}: {}\r\n", "y".repeat(64)).as_bytes());
    }
    huge.extend_from_slice(b"\r\n");
    let refused = status_line(url, &huge).await;
    assert!(
        refused.is_empty() || refused.starts_with("HTTP/1.1 431"),
        "{role}: huge headers: {refused:?}"
    );
    let resp = http.get(at("/livez")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "{role}: still serving");
    // Still ready: no write above (`/v1/draining` among them) reached the role.
    let resp = http.get(at("/readyz")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "{role}: still ready");
    println!("[metrics-port] {role}: {url} serves /metrics, /livez, /readyz, read-only");
}

/// A stand-in engine server whose `/health` answers 200 while `healthy`.
async fn stand_in(healthy: Arc<AtomicBool>) -> String {
    async fn health(State(h): State<Arc<AtomicBool>>) -> AxumStatus {
        match h.load(Ordering::Relaxed) {
            true => AxumStatus::OK,
            false => AxumStatus::SERVICE_UNAVAILABLE,
        }
    }
    let app = axum::Router::new()
        .route("/health", axum::routing::get(health))
        .with_state(healthy);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

fn start(logs: &std::path::Path, name: &str, args: Vec<String>) -> Process {
    common::spawn(
        &release_binary(),
        &[],
        name,
        &args,
        &[("RUST_LOG", "info")],
        logs,
    )
}

#[test]
fn every_role_serves_its_metrics_port_read_only() {
    let logs = kvferry::cluster::log_dir("metrics-port").expect("log dir");
    let build = build_info_line();
    let metrics_port = ["--metrics-port", "0"];
    let registry = start(
        &logs,
        "registry",
        owned(&["bootstrap", "--port", "0", "--metrics-port", "0"]),
    );
    let registry_url = registry.field("url").unwrap();
    let agent = |role: &str| {
        let mut args = owned(&[role, "--bootstrap", &registry_url]);
        args.extend(AgentOpts::default().args());
        args.extend(owned(&metrics_port));
        start(&logs, role, args)
    };
    let (prefill, decode) = (agent("prefill"), agent("decode"));
    runtime().block_on(async {
        let http = http();
        let rooms = [
            "/v1/rooms/7",
            "/v1/rooms/7/ready",
            "/v1/draining",
            "/v1/ranks",
        ];
        for p in [&registry, &prefill, &decode] {
            let role = p.listening["role"].as_str().unwrap().to_owned();
            let metrics = p.field("metrics").unwrap();
            check_port(&role, &metrics, &build, &rooms).await;
            let main = p
                .field(if role == "bootstrap" { "url" } else { "api" })
                .unwrap();
            let healthz = http.get(format!("{main}/healthz")).send().await.unwrap();
            assert_eq!(
                healthz.status(),
                StatusCode::OK,
                "{role}: the main port's /healthz"
            );
        }
        // Nothing the metrics ports were sent reached a role: no room, the two ranks listed.
        for api in [prefill.field("api").unwrap(), decode.field("api").unwrap()] {
            let room = http.get(format!("{api}/v1/rooms/7")).send().await.unwrap();
            assert_eq!(room.status(), StatusCode::NOT_FOUND, "{api}: no room 7");
        }
        let ranks: serde_json::Value = http
            .get(format!("{registry_url}/v1/ranks"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let ranks = ranks["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2, "{ranks:?}");

        // The proxy: not ready while no decode server is usable, ready once one is.
        let healthy_decode = Arc::new(AtomicBool::new(false));
        let prefill_server = stand_in(Arc::new(AtomicBool::new(true))).await;
        let decode_server = stand_in(healthy_decode.clone()).await;
        let proxy = start(
            &logs,
            "proxy",
            owned(&[
                "proxy",
                "--prefill",
                &prefill_server,
                "--decode",
                &decode_server,
                "--port",
                "0",
                "--health-ms",
                "50",
                "--metrics-port",
                "0",
            ]),
        );
        let (url, metrics) = (proxy.field("url").unwrap(), proxy.field("metrics").unwrap());
        let why = readyz(&metrics, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(why, "not ready: no usable decode server\n");
        let live = http.get(format!("{metrics}/livez")).send().await.unwrap();
        assert_eq!(
            live.status(),
            StatusCode::OK,
            "the proxy is live all the same"
        );
        // The main port's health routes answer as /readyz does.
        let main_health = |expected: StatusCode| {
            let (http, url) = (&http, &url);
            async move {
                for path in ["/health", "/healthz"] {
                    let got = http.get(format!("{url}{path}")).send().await.unwrap();
                    assert_eq!(got.status(), expected, "proxy {path}");
                }
            }
        };
        main_health(StatusCode::SERVICE_UNAVAILABLE).await;
        healthy_decode.store(true, Ordering::Relaxed);
        let writes = ["/v1/completions", "/v1/chat/completions"];
        check_port("proxy", &metrics, &build, &writes).await;
        main_health(StatusCode::OK).await;
        drop(proxy);
    });
    let mut decode = decode;
    let mut prefill = prefill;
    let mut registry = registry;
    for p in [&mut decode, &mut prefill, &mut registry] {
        let exit = p.stop(Duration::from_secs(30));
        assert!(exit.is_some_and(|s| s.success()), "{}: {exit:?}", p.name);
    }
}
