//! Tests of the registry client: URL checks, failover between registry URLs, and the
//! heartbeat period.

use super::*;

#[test]
fn base_url_must_be_http() {
    assert!(matches!(
        RegistryClient::new("10.0.0.1:8998", None),
        Err(ClientError::Setup { .. })
    ));
    let c = RegistryClient::new("http://127.0.0.1:8998/", None).unwrap();
    assert_eq!(c.base_url(), "http://127.0.0.1:8998");
}

#[test]
fn several_urls_are_split_and_each_checked() {
    let c = RegistryClient::new("http://a:1/, http://b:2", None).unwrap();
    assert_eq!(c.base_urls(), ["http://a:1", "http://b:2"]);
    assert_eq!(c.base_url(), "http://a:1");
    let err = RegistryClient::new("http://a:1,b:2", None).unwrap_err();
    assert!(
        err.to_string().contains("\"b:2\": every URL must start"),
        "{err}"
    );
    assert!(RegistryClient::new("http://a:1,", None).is_err());
}

/// A URL nothing listens on: a port bound, then released.
async fn dead_url() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

/// A server answering every request with `status` and a JSON error body, counting them.
async fn stub(status: u16) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = hits.clone();
    let app = axum::Router::new().fallback(move || {
        let counted = counted.clone();
        async move {
            counted.fetch_add(1, Ordering::Relaxed);
            let status = axum::http::StatusCode::from_u16(status).unwrap();
            (status, axum::Json(ErrorBody::new(format!("stub {status}"))))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, hits)
}

/// A real registry (memory store) on an ephemeral port.
async fn registry() -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let config = crate::ServerConfig::default();
    tokio::spawn(crate::serve(listener, config, stop.clone()));
    (url, stop)
}

fn registration() -> Registration {
    use crate::types::{AttentionKind, Dtype, IndexRange, KvLayout, Role, Slice};
    Registration {
        instance_id: Uuid::new_v4(),
        role: Role::Prefill,
        dp_rank: 0,
        dp_size: 1,
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        layout: KvLayout {
            kind: AttentionKind::Mha,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 64,
            dtype: Dtype::Bf16,
            page_size: 16,
            order: None,
        },
        slice: Slice {
            heads: IndexRange::new(0, 2),
            layers: IndexRange::new(0, 2),
        },
        control_endpoint: "tcp://127.0.0.1:7000".to_owned(),
        data_endpoints: std::collections::BTreeMap::new(),
        about: Default::default(),
    }
}

#[tokio::test]
async fn a_dead_url_fails_over_to_a_live_one_which_sticks() {
    let dead = dead_url().await;
    let (live, stop) = registry().await;
    let client = RegistryClient::new(format!("{dead},{live}"), None).unwrap();
    assert_eq!(client.base_url(), dead);
    let r = registration();
    client.register(&r).await.unwrap();
    assert_eq!(client.base_url(), live, "sticks with the URL that answered");
    let group = client.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks, vec![r.clone()]);
    assert!(matches!(
        client.heartbeat(r.instance_id).await,
        Ok(Renewal::Renewed(_))
    ));
    stop.cancel();
}

#[tokio::test]
async fn a_5xx_fails_over_but_a_4xx_is_final() {
    let (failing, failing_hits) = stub(500).await;
    let (live, stop) = registry().await;
    let client = RegistryClient::new(format!("{failing},{live}"), None).unwrap();
    assert_eq!(client.health().await.unwrap().status, "ok");
    assert_eq!(client.health().await.unwrap().status, "ok");
    assert_eq!(
        failing_hits.load(Ordering::Relaxed),
        1,
        "asked once, then the live URL sticks"
    );

    let (refusing, refusing_hits) = stub(400).await;
    let (next, next_hits) = stub(500).await;
    let client = RegistryClient::new(format!("{refusing},{next}"), None).unwrap();
    let err = client.health().await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Rejected { status: 400, message, .. } if message == "stub 400 Bad Request"),
        "{err}"
    );
    assert!(!err.is_retryable());
    assert_eq!(refusing_hits.load(Ordering::Relaxed), 1);
    assert_eq!(
        next_hits.load(Ordering::Relaxed),
        0,
        "a 4xx is not retried elsewhere"
    );
    stop.cancel();
}

#[tokio::test]
async fn when_every_url_fails_the_last_failure_is_returned() {
    let dead = dead_url().await;
    let (failing, hits) = stub(502).await;
    let client = RegistryClient::new(format!("{dead},{failing}"), None).unwrap();
    let err = client.health().await.unwrap_err();
    assert!(
        matches!(err, ClientError::Server { status: 502, .. }),
        "{err}"
    );
    assert!(err.is_retryable());
    assert_eq!(hits.load(Ordering::Relaxed), 1);
    let client = RegistryClient::new(format!("{failing},{dead}"), None).unwrap();
    let err = client.health().await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Unreachable { url, .. } if url.starts_with(&dead)),
        "{err}"
    );
    assert!(
        err.to_string().contains("Connection refused"),
        "the message says why the URL failed, not only which: {err}"
    );
    assert_eq!(
        client.base_url(),
        failing,
        "no URL answered: the first stays"
    );
}

#[test]
fn heartbeat_period_is_a_third_of_the_lease() {
    assert_eq!(
        heartbeat_period(Lease { lease_ttl_ms: 9000 }),
        Duration::from_secs(3)
    );
    assert_eq!(
        heartbeat_period(Lease { lease_ttl_ms: 1 }),
        MIN_HEARTBEAT_PERIOD
    );
}
