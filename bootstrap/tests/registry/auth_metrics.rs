//! The bearer token on every route but `/healthz` (reads too), and the values `/metrics` exposes after
//! a known sequence of operations.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::{TestServer, decode, prefill, ttl_ms, wait_until};
use kvferry_bootstrap::{ClientError, ErrorBody, RegistryClient, ServerConfig};
use reqwest::StatusCode;

const TOKEN: &str = "s3cret-token";

#[tokio::test]
async fn every_route_but_healthz_needs_the_token() {
    let server = TestServer::start(ServerConfig {
        token: Some(TOKEN.to_owned()),
        ..ServerConfig::default()
    })
    .await;
    let http = kvferry_wire::http::client().build().unwrap();
    let r = prefill(0, 0, 1, 0, 1);
    let register = || http.post(server.at("/v1/ranks")).json(&r);

    for (name, req) in [
        ("no token", register()),
        ("wrong token", register().bearer_auth("nope")),
        ("basic auth", register().basic_auth("user", Some(TOKEN))),
        (
            "token as prefix",
            register().bearer_auth(format!("{TOKEN}x")),
        ),
    ] {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{name}");
        let body: ErrorBody = resp.json().await.unwrap();
        assert!(!body.error.is_empty(), "{name}");
    }
    let resp = register().bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);

    let heartbeat = server.at(&format!("/v1/ranks/{}/heartbeat", r.instance_id));
    let delete = server.at(&format!("/v1/ranks/{}", r.instance_id));
    let status = |req: reqwest::RequestBuilder| async move { req.send().await.unwrap().status() };
    assert_eq!(
        status(http.post(&heartbeat)).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        status(http.post(&heartbeat).bearer_auth(TOKEN)).await,
        StatusCode::OK
    );
    assert_eq!(status(http.delete(&delete)).await, StatusCode::UNAUTHORIZED);

    assert_eq!(
        status(http.get(server.at("/healthz"))).await,
        StatusCode::OK
    );
    // Reads need it too, and so do unknown routes (the check runs before routing).
    for path in ["/metrics", "/v1/ranks", "/v1/groups/0", "/nope"] {
        let resp = http.get(server.at(path)).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{path}");
        assert_eq!(resp.headers()["content-type"], "application/json", "{path}");
        let body: ErrorBody = resp.json().await.unwrap();
        assert!(body.error.contains("Authorization"), "{path}: {body:?}");
        assert_eq!(
            status(http.get(server.at(path)).bearer_auth(TOKEN)).await,
            if path == "/nope" {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::OK
            },
            "{path}"
        );
    }

    // The typed client sends the token; without it, it gets a typed, fatal error.
    let anonymous = RegistryClient::new(&server.url, None).unwrap();
    let err = anonymous
        .register(&prefill(1, 0, 1, 0, 1))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Unauthorized { .. }) && !err.is_retryable(),
        "{err}"
    );
    assert!(matches!(
        anonymous.list_ranks().await,
        Err(ClientError::Unauthorized { .. })
    ));
    let client = RegistryClient::new(&server.url, Some(TOKEN.to_owned())).unwrap();
    client.register(&prefill(1, 0, 1, 0, 1)).await.unwrap();
    // The client sends the token on reads too.
    assert_eq!(client.list_ranks().await.unwrap().len(), 2);
    client.lookup_prefill(1).await.unwrap();
    client.health().await.unwrap();
    assert!(client.deregister(r.instance_id).await.unwrap());
    server.stop().await;
}

/// `/metrics` as `name{labels}` -> value, after checking that it is OpenMetrics text a strict
/// parser accepts (every sample in a declared family, `# EOF` at the end).
async fn scrape(server: &TestServer) -> HashMap<String, f64> {
    let resp = kvferry_wire::http::client()
        .build()
        .unwrap()
        .get(server.at("/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let content_type = resp.headers()["content-type"].to_str().unwrap().to_owned();
    assert_eq!(content_type, kvferry_wire::http::OPENMETRICS_CONTENT_TYPE);
    let text = resp.text().await.unwrap();
    if let Err(e) = openmetrics_parser::openmetrics::parse_openmetrics(&text) {
        panic!("not OpenMetrics: {e:?}\n{text}");
    }
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|line| {
            let (key, value) = line.rsplit_once(' ').expect("sample line");
            (key.to_owned(), value.parse().unwrap())
        })
        .collect()
}

#[tokio::test]
async fn metrics_count_what_happened() {
    let server = TestServer::start(ServerConfig::default()).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    let http = kvferry_wire::http::client().build().unwrap();

    let a = prefill(0, 0, 2, 0, 1);
    client.register(&a).await.unwrap();
    client.lookup_prefill(0).await.unwrap_err(); // incomplete
    client.register(&prefill(0, 1, 2, 0, 1)).await.unwrap();
    client.register(&decode(0, 0, 1)).await.unwrap();
    client.register(&a).await.unwrap(); // refresh
    client.lookup_prefill(0).await.unwrap();
    client.lookup_prefill(0).await.unwrap();
    client.lookup_prefill(1).await.unwrap_err(); // incomplete
    let mut conflicting = prefill(0, 1, 4, 0, 1);
    conflicting.tp_rank = 3;
    client.register(&conflicting).await.unwrap_err(); // conflict
    let mut impossible = prefill(0, 0, 2, 0, 1);
    impossible.tp_rank = 2;
    let resp = http
        .post(server.at("/v1/ranks"))
        .json(&impossible)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(
        http.get(server.at("/nope")).send().await.unwrap().status(),
        404
    );
    assert_eq!(
        http.get(server.at("/v1/groups/x"))
            .send()
            .await
            .unwrap()
            .status(),
        400
    );
    assert_eq!(
        http.patch(server.at("/v1/ranks"))
            .send()
            .await
            .unwrap()
            .status(),
        405
    );

    let m = scrape(&server).await;
    for (key, want) in [
        ("kvferry_bootstrap_ranks{role=\"prefill\"}", 2.0),
        ("kvferry_bootstrap_ranks{role=\"decode\"}", 1.0),
        ("kvferry_bootstrap_groups", 1.0),
        ("kvferry_bootstrap_registrations_total", 4.0),
        ("kvferry_bootstrap_lookups_total{result=\"complete\"}", 2.0),
        (
            "kvferry_bootstrap_lookups_total{result=\"incomplete\"}",
            2.0,
        ),
        ("kvferry_bootstrap_lease_expiries_total", 0.0),
        (
            "kvferry_bootstrap_rejected_requests_total{reason=\"bad_request\"}",
            2.0,
        ),
        (
            "kvferry_bootstrap_rejected_requests_total{reason=\"conflict\"}",
            1.0,
        ),
        (
            "kvferry_bootstrap_rejected_requests_total{reason=\"not_found\"}",
            1.0,
        ),
        (
            "kvferry_bootstrap_rejected_requests_total{reason=\"method_not_allowed\"}",
            1.0,
        ),
        (
            "kvferry_bootstrap_rejected_requests_total{reason=\"unauthorized\"}",
            0.0,
        ),
        (
            "kvferry_bootstrap_rejected_requests_total{reason=\"too_large\"}",
            0.0,
        ),
    ] {
        assert_eq!(m.get(key), Some(&want), "{key}");
    }
    server.stop().await;
}

#[tokio::test]
async fn metrics_count_lease_expiries() {
    let server = TestServer::start(ttl_ms(200)).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    for tp_rank in 0..3 {
        client
            .register(&prefill(0, tp_rank, 4, 0, 1))
            .await
            .unwrap();
    }
    let a = prefill(0, 3, 4, 0, 1);
    client.register(&a).await.unwrap();
    client.deregister(a.instance_id).await.unwrap(); // removed, not expired
    // No request touches the registry but /metrics: the sweeper and the scrape expire leases.
    wait_until("expiries counted", Duration::from_secs(15), || async {
        scrape(&server).await["kvferry_bootstrap_lease_expiries_total"] == 3.0
    })
    .await;
    let m = scrape(&server).await;
    assert_eq!(m["kvferry_bootstrap_ranks{role=\"prefill\"}"], 0.0);
    assert_eq!(m["kvferry_bootstrap_groups"], 0.0);
    assert_eq!(m["kvferry_bootstrap_registrations_total"], 4.0);
    server.stop().await;
}
