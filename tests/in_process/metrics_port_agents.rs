//! An agent's metrics port (`--metrics-port`) listens before the agent registers: `/readyz` is
//! 503 while the agent waits out a dead predecessor's lease on its registry slot, 200 once it
//! registered, 503 again once its engine says it drains; `/livez` is 200 throughout, and
//! `/metrics` is the agent's own, `kvferry_build_info` first.

use crate::common;

use std::time::{Duration, Instant};

use kvferry::agent::EngineApi;
use kvferry::agent::prefill::PrefillAgent;
use reqwest::StatusCode;
use tokio_util::sync::CancellationToken;

/// The status and body of `GET url`.
async fn get(http: &reqwest::Client, url: &str) -> (StatusCode, String) {
    let resp = http.get(url).send().await.expect("metrics port answers");
    (resp.status(), resp.text().await.unwrap())
}

#[test]
fn readiness_follows_registration_and_draining() {
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let lease = Duration::from_secs(3);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let registry = format!("http://{}", listener.local_addr().unwrap());
        let config = kvferry_bootstrap::ServerConfig::with_lease_ttl(lease);
        let served = tokio::spawn(kvferry_bootstrap::serve(listener, config, shutdown.clone()));
        let http = kvferry_wire::http::client().build().unwrap();

        // A predecessor registers the slot and dies: its lease holds the slot for `lease`.
        let first_stop = shutdown.child_token();
        let first = PrefillAgent::start(
            common::in_process_config(&registry, &[]),
            first_stop.clone(),
        )
        .await
        .unwrap();
        let client = kvferry_bootstrap::RegistryClient::new(registry.as_str(), None).unwrap();
        let ranks = client.list_ranks().await.unwrap();
        let held = ranks[0].registration.clone();
        first_stop.cancel();
        first.join().await;
        client
            .register(&held)
            .await
            .expect("the dead predecessor's lease");
        let died = Instant::now();

        let port = common::closed_port().to_string();
        let cfg = common::in_process_config(&registry, &["--metrics-port", &port]);
        let starting = tokio::spawn(PrefillAgent::start(cfg, shutdown.clone()));
        let metrics = format!("http://127.0.0.1:{port}");
        let (status, why) = common::poll_until("the metrics port", common::BOUND, || {
            let (http, url) = (http.clone(), format!("{metrics}/readyz"));
            async move {
                let resp = http.get(url).send().await.ok()?;
                let status = resp.status();
                Some((status, resp.text().await.ok()?))
            }
        })
        .await;
        let not_yet = "not ready: not registered with the registry yet\n";
        assert_eq!(
            (status, why.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, not_yet)
        );
        assert_eq!(
            get(&http, &format!("{metrics}/livez")).await,
            (StatusCode::OK, "ok\n".into())
        );

        let agent = starting
            .await
            .unwrap()
            .expect("registered once the lease lapsed");
        println!(
            "registered {:?} after the predecessor died (lease {lease:?})",
            died.elapsed()
        );
        assert!(died.elapsed() >= lease / 2, "it waited for the lease");
        assert_eq!(agent.metrics_url.as_deref(), Some(metrics.as_str()));
        let (status, body) = get(&http, &format!("{metrics}/readyz")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ready\n"));
        let (status, text) = get(&http, &format!("{metrics}/metrics")).await;
        assert_eq!(status, StatusCode::OK);
        let b = kvferry::cli::BUILD;
        let build = format!(
            r#"kvferry_build_info{{version="{}",revision="{}",protocol="{}"}} 1"#,
            b.version, b.revision, b.protocol
        );
        assert!(text.lines().any(|l| l == build), "{build} in\n{text}");
        assert!(
            text.contains(r#"kvferry_pool_pages{role="prefill",state="free"} 64"#),
            "{text}"
        );

        agent.draining().await;
        let (status, body) = get(&http, &format!("{metrics}/readyz")).await;
        assert_eq!(
            (status, body.as_str()),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: draining: its engine shuts down\n"
            )
        );
        assert_eq!(
            get(&http, &format!("{metrics}/livez")).await.0,
            StatusCode::OK
        );

        shutdown.cancel();
        agent.join().await;
        served.await.unwrap().unwrap();
        let gone = http.get(format!("{metrics}/livez")).send().await;
        assert!(gone.is_err(), "the metrics port closed with the agent");
    });
}
