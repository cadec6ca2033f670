//! Behaviour of the registry through its typed client against a real server on 127.0.0.1:
//! registration, lookup, heartbeat, lease expiry, replacement by a restarted rank,
//! deregistration, group forgetting, registry restart, concurrency and topology conflicts.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{TestServer, decode, prefill, ttl_ms, wait_until};
use kvferry_bootstrap::{ClientError, ErrorBody, RegistryClient, Renewal, ServerConfig};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const BOUND: Duration = Duration::from_secs(15);

#[tokio::test]
async fn register_lookup_heartbeat_deregister() {
    let server = TestServer::start(ServerConfig::default()).await;
    let client = RegistryClient::new(&server.url, None).unwrap();

    let err = client.lookup_prefill(0).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Incomplete { dp_rank: 0, .. }),
        "{err}"
    );
    assert!(err.is_retryable());

    let r0 = prefill(0, 0, 2, 0, 1);
    let r1 = prefill(0, 1, 2, 0, 1);
    let lease = client.register(&r0).await.unwrap();
    assert_eq!(lease.lease_ttl_ms, 10_000);
    let err = client.lookup_prefill(0).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("prefill group dp_rank=0 incomplete: 1 of 2 ranks registered"),
        "{err}"
    );

    client.register(&r1).await.unwrap();
    let group = client.lookup_prefill(0).await.unwrap();
    assert_eq!((group.dp_rank, group.tp_size, group.pp_size), (0, 2, 1));
    assert_eq!(group.layout, common::layout());
    assert_eq!(group.ranks, vec![r0.clone(), r1.clone()]);

    assert_eq!(
        client.heartbeat(r0.instance_id).await.unwrap(),
        Renewal::Renewed(lease)
    );
    assert!(client.deregister(r0.instance_id).await.unwrap());
    assert!(!client.deregister(r0.instance_id).await.unwrap());
    let err = client.lookup_prefill(0).await.unwrap_err();
    assert!(err.to_string().contains("1 of 2"), "{err}");
    // Deregistered and forgotten by the client: a heartbeat cannot re-register it.
    assert!(matches!(
        client.heartbeat(r0.instance_id).await,
        Err(ClientError::NotRegistered(id)) if id == r0.instance_id
    ));
    let listed = client.list_ranks().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].registration, r1);
    assert!(listed[0].lease_remaining_ms <= 10_000);
    server.stop().await;
}

#[tokio::test]
async fn decode_ranks_are_listed_but_not_grouped() {
    let server = TestServer::start(ServerConfig::default()).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    let d = decode(0, 0, 1);
    client.register(&d).await.unwrap();
    assert!(matches!(
        client.lookup_prefill(0).await,
        Err(ClientError::Incomplete { .. })
    ));
    let health = client.health().await.unwrap();
    assert_eq!(
        (health.prefill_ranks, health.decode_ranks, health.groups),
        (0, 1, 0)
    );
    assert_eq!(client.list_ranks().await.unwrap()[0].registration, d);
    server.stop().await;
}

#[tokio::test]
async fn lease_expires_without_heartbeat_and_heartbeat_keeps_it() {
    // Long enough that a heartbeat (every TTL/3) survives a stall of a loaded CI machine.
    const TTL_MS: u64 = 600;
    let server = TestServer::start(ttl_ms(TTL_MS)).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    let kept = prefill(0, 0, 2, 0, 1);
    let left = prefill(0, 1, 2, 0, 1);
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let keeper = client
        .keep_alive(kept.clone(), cancel.clone())
        .await
        .unwrap();
    assert_eq!(keeper.lease().lease_ttl_ms, TTL_MS);
    client.register(&left).await.unwrap();
    assert_eq!(client.lookup_prefill(0).await.unwrap().ranks.len(), 2);

    wait_until("unrenewed lease expires", BOUND, || async {
        matches!(
            client.lookup_prefill(0).await,
            Err(ClientError::Incomplete { .. })
        )
    })
    .await;
    let since_start = started.elapsed();
    println!("lease of {TTL_MS} ms gone after {since_start:?}");
    assert!(
        since_start >= Duration::from_millis(TTL_MS),
        "expired early"
    );
    // The kept lease outlived several TTLs.
    tokio::time::sleep(Duration::from_millis(2 * TTL_MS)).await;
    let ids: Vec<Uuid> = client
        .list_ranks()
        .await
        .unwrap()
        .iter()
        .map(|r| r.registration.instance_id)
        .collect();
    assert_eq!(ids, vec![kept.instance_id]);

    // The registry no longer knows `left`: a raw heartbeat is a 404, the client re-registers.
    let raw = reqwest::Client::new()
        .post(server.at(&format!("/v1/ranks/{}/heartbeat", left.instance_id)))
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 404);
    let body: ErrorBody = raw.json().await.unwrap();
    assert!(body.error.contains("register again"), "{}", body.error);
    assert!(matches!(
        client.heartbeat(left.instance_id).await.unwrap(),
        Renewal::Reregistered(_)
    ));
    assert_eq!(client.lookup_prefill(0).await.unwrap().ranks.len(), 2);

    // Cancelling the keep-alive deregisters.
    cancel.cancel();
    tokio::time::timeout(BOUND, keeper.stopped()).await.unwrap();
    let ids: Vec<Uuid> = client
        .list_ranks()
        .await
        .unwrap()
        .iter()
        .map(|r| r.registration.instance_id)
        .collect();
    assert_eq!(ids, vec![left.instance_id]);
    server.stop().await;
}

#[tokio::test]
async fn restarted_rank_replaces_its_slot() {
    let server = TestServer::start(ServerConfig::default()).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    let http = reqwest::Client::new();
    let old = prefill(0, 0, 1, 0, 1);
    let resp = http
        .post(server.at("/v1/ranks"))
        .json(&old)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    // The same instance registering again is a refresh.
    let resp = http
        .post(server.at("/v1/ranks"))
        .json(&old)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        client.lookup_prefill(0).await.unwrap().ranks[0].instance_id,
        old.instance_id
    );

    let new = prefill(0, 0, 1, 0, 1);
    let resp = http
        .post(server.at("/v1/ranks"))
        .json(&new)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let group = client.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks.len(), 1);
    assert_eq!(group.ranks[0].instance_id, new.instance_id);
    let resp = http
        .post(server.at(&format!("/v1/ranks/{}/heartbeat", old.instance_id)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    server.stop().await;
}

#[tokio::test]
async fn group_is_forgotten_after_all_leases_expire() {
    let server = TestServer::start(ttl_ms(300)).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    for tp_rank in 0..2 {
        client
            .register(&prefill(0, tp_rank, 2, 0, 1))
            .await
            .unwrap();
    }
    client.lookup_prefill(0).await.unwrap();
    // While the group lives, another TP size conflicts.
    let tp4 = prefill(0, 0, 4, 0, 1);
    let err = client.register(&tp4).await.unwrap_err();
    assert!(matches!(err, ClientError::Conflict { .. }), "{err}");
    assert!(
        err.to_string().contains("tp_size 4 conflicts with 2"),
        "{err}"
    );

    wait_until("group forgotten", BOUND, || async {
        client.health().await.unwrap().groups == 0
    })
    .await;
    client.register(&tp4).await.unwrap();
    let err = client.lookup_prefill(0).await.unwrap_err();
    assert!(err.to_string().contains("1 of 4"), "{err}");
    server.stop().await;
}

#[tokio::test]
async fn client_registers_again_after_registry_restart() {
    let first = TestServer::start(ServerConfig::default()).await;
    let addr = first.addr;
    let client = RegistryClient::new(&first.url, None).unwrap();
    let r = prefill(1, 0, 1, 0, 1);
    client.register(&r).await.unwrap();
    assert!(matches!(
        client.heartbeat(r.instance_id).await.unwrap(),
        Renewal::Renewed(_)
    ));
    first.stop().await;

    // While the registry is down, calls fail retryably.
    let err = client.heartbeat(r.instance_id).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");

    let second = TestServer::start_on(addr, ServerConfig::default()).await;
    assert!(matches!(
        client.lookup_prefill(1).await,
        Err(ClientError::Incomplete { .. })
    ));
    assert!(matches!(
        client.heartbeat(r.instance_id).await.unwrap(),
        Renewal::Reregistered(_)
    ));
    assert_eq!(
        client.lookup_prefill(1).await.unwrap().ranks,
        vec![r.clone()]
    );
    second.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_ranks_register_concurrently() {
    let server = TestServer::start(ServerConfig::default()).await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..8)
        .flat_map(|pp_rank| (0..8).map(move |tp_rank| (tp_rank, pp_rank)))
        .map(|(tp_rank, pp_rank)| {
            let url = server.url.clone();
            tokio::spawn(async move {
                let client = RegistryClient::new(url, None).unwrap();
                let r = prefill(0, tp_rank, 8, pp_rank, 8);
                client.register(&r).await.map(|_| r.instance_id)
            })
        })
        .collect();
    let mut ids = HashSet::new();
    for task in tasks {
        ids.insert(task.await.unwrap().unwrap());
    }
    println!("64 concurrent registrations took {:?}", started.elapsed());
    let client = RegistryClient::new(&server.url, None).unwrap();
    let group = client.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks.len(), 64);
    let got: HashSet<Uuid> = group.ranks.iter().map(|r| r.instance_id).collect();
    assert_eq!(got, ids);
    let order: Vec<(u32, u32)> = group.ranks.iter().map(|r| (r.pp_rank, r.tp_rank)).collect();
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(order, sorted);
    assert_eq!(client.health().await.unwrap().prefill_ranks, 64);
    server.stop().await;
}

#[tokio::test]
async fn topology_conflict_is_409_naming_the_field() {
    let server = TestServer::start(ServerConfig::default()).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    client.register(&prefill(0, 0, 2, 0, 1)).await.unwrap();
    let mut other = prefill(0, 1, 2, 0, 1);
    other.layout.page_size = 32;
    let resp = reqwest::Client::new()
        .post(server.at("/v1/ranks"))
        .json(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    let body: ErrorBody = resp.json().await.unwrap();
    assert!(
        body.error
            .contains("page_size 32 conflicts with 16 fixed by the group's first registration"),
        "{}",
        body.error
    );
    let err = client.register(&other).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Conflict { .. }) && !err.is_retryable(),
        "{err}"
    );
    // Another DP group has its own topology.
    other.dp_rank = 1;
    client.register(&other).await.unwrap();
    server.stop().await;
}
