//! Behaviour of the registry through its typed client against a real server on 127.0.0.1:
//! registration, lookup, heartbeat, lease expiry, a live slot never replaced (a restarted rank
//! waits out its predecessor's lease, a second live holder is refused for good),
//! deregistration, group forgetting, registry restart, concurrency and topology conflicts.

use crate::common;

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
    let raw = kvferry_wire::http::client()
        .build()
        .unwrap()
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
async fn live_slot_is_refused_409_naming_the_holder() {
    let server = TestServer::start(ServerConfig::default()).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    let http = kvferry_wire::http::client().build().unwrap();
    let old = prefill(0, 0, 1, 0, 1);
    let post =
        |r: &kvferry_bootstrap::Registration| http.post(server.at("/v1/ranks")).json(r).send();
    assert_eq!(post(&old).await.unwrap().status(), 201);
    // The same instance registering again is a refresh.
    assert_eq!(post(&old).await.unwrap().status(), 200);

    // Another instance for the same slot: 409, the holder named, the slot untouched.
    let new = prefill(0, 0, 1, 0, 1);
    let resp = post(&new).await.unwrap();
    assert_eq!(resp.status(), 409);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let body: ErrorBody = resp.json().await.unwrap();
    assert_eq!(body.holder, Some(old.instance_id), "{body:?}");
    assert!(
        body.error.contains(&old.instance_id.to_string()),
        "{body:?}"
    );
    assert!(body.error.contains("held by live instance"), "{body:?}");
    let left = body.holder_lease_remaining_ms.unwrap();
    assert!(left > 0 && left <= 10_000, "{body:?}");
    assert_eq!(body.lease_ttl_ms, Some(10_000));
    let group = client.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks.len(), 1);
    assert_eq!(group.ranks[0].instance_id, old.instance_id);
    let resp = http
        .post(server.at(&format!("/v1/ranks/{}/heartbeat", old.instance_id)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    // The typed client classifies it as retryable (the holder may be a dead predecessor).
    let err = client.register(&new).await.unwrap_err();
    assert!(
        matches!(err, ClientError::SlotHeld { holder, .. } if holder == old.instance_id),
        "{err}"
    );
    assert!(err.is_retryable(), "{err}");

    // Once the holder deregisters, the slot is free.
    assert!(client.deregister(old.instance_id).await.unwrap());
    assert_eq!(post(&new).await.unwrap().status(), 201);
    server.stop().await;
}

#[tokio::test]
async fn restarted_rank_waits_out_its_dead_predecessors_lease() {
    let server = TestServer::start(ttl_ms(600)).await;
    let http = kvferry_wire::http::client().build().unwrap();
    let client = RegistryClient::new(&server.url, None).unwrap();
    // The predecessor registered and died: nothing renews its lease.
    let dead = prefill(0, 0, 1, 0, 1);
    let resp = http
        .post(server.at("/v1/ranks"))
        .json(&dead)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let restarted = prefill(0, 0, 1, 0, 1);
    let cancel = CancellationToken::new();
    let kept = tokio::time::timeout(BOUND, client.keep_alive(restarted.clone(), cancel.clone()))
        .await
        .expect("the restarted rank did not register within the bound")
        .expect("the restarted rank gave up on a dead predecessor's lease");
    let group = client.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks[0].instance_id, restarted.instance_id);
    // The dead one's instance is gone: its client, were it alive, would learn it was replaced.
    let err = client.heartbeat(dead.instance_id).await.unwrap_err();
    assert!(
        matches!(err, ClientError::NotRegistered(id) if id == dead.instance_id),
        "{err}"
    );
    cancel.cancel();
    kept.stopped().await;
    server.stop().await;
}

#[tokio::test]
async fn replaced_instance_learns_it_on_its_next_heartbeat() {
    let server = TestServer::start(ttl_ms(300)).await;
    let old_client = RegistryClient::new(&server.url, None).unwrap();
    let new_client = RegistryClient::new(&server.url, None).unwrap();
    let old = prefill(0, 0, 1, 0, 1);
    old_client.register(&old).await.unwrap();
    // The old instance misses its heartbeats: its lease lapses, then a new instance takes the
    // slot.
    wait_until("old lease lapsed", BOUND, || async {
        new_client.list_ranks().await.unwrap().is_empty()
    })
    .await;
    let new = prefill(0, 0, 1, 0, 1);
    new_client.register(&new).await.unwrap();
    // Its next heartbeat learns it was replaced, instead of registering again over the new one.
    let err = old_client.heartbeat(old.instance_id).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Replaced { instance, by } if instance == old.instance_id && by == new.instance_id),
        "{err}"
    );
    assert!(!err.is_retryable(), "{err}");
    assert!(err.to_string().contains("replaced by instance"), "{err}");
    let group = new_client.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks[0].instance_id, new.instance_id);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_live_holder_gives_up_after_the_holder_kept_renewing() {
    let server = TestServer::start(ttl_ms(1_000)).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    let first = prefill(0, 0, 1, 0, 1);
    let cancel = CancellationToken::new();
    let kept = client
        .keep_alive(first.clone(), cancel.clone())
        .await
        .unwrap();
    let second = prefill(0, 0, 1, 0, 1);
    let err = tokio::time::timeout(BOUND, client.register_when_free(&second, &cancel))
        .await
        .expect("the second holder neither registered nor gave up within the bound")
        .unwrap_err();
    assert!(
        matches!(err, ClientError::SlotStillHeld { holder, waited_ms, .. }
            if holder == first.instance_id && waited_ms > 3_000),
        "{err}"
    );
    assert!(!err.is_retryable(), "{err}");
    assert!(err.to_string().contains("kept renewing its lease"), "{err}");
    // The first one still serves.
    let group = client.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks[0].instance_id, first.instance_id);
    cancel.cancel();
    kept.stopped().await;
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
    // While the group lives, another TP size conflicts (on a slot nobody holds).
    let tp4 = prefill(0, 2, 4, 0, 1);
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
    let resp = kvferry_wire::http::client()
        .build()
        .unwrap()
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

#[tokio::test]
async fn waiting_for_a_held_slot_ends_when_cancelled() {
    let server = TestServer::start(ServerConfig::default()).await;
    let client = RegistryClient::new(&server.url, None).unwrap();
    let holder = prefill(0, 0, 1, 0, 1);
    client.register(&holder).await.unwrap();
    let cancel = CancellationToken::new();
    cancel.cancel();
    let err = client
        .register_when_free(&prefill(0, 0, 1, 0, 1), &cancel)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Cancelled { holder: h } if h == holder.instance_id),
        "{err}"
    );
    server.stop().await;
}
