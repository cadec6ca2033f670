//! The registry on the etcd store, against a real three-member etcd cluster on 127.0.0.1
//! (the `etcd` and `etcdctl` binaries; Debian packages etcd-server and etcd-client), with two
//! registry replicas in this process on that cluster:
//! - a registration through one replica is seen through the other, and so are
//!   deregistrations, topology conflicts and lookups;
//! - two replicas racing to register one slot for two instances: exactly one 201, one 409;
//! - a dead agent's lease expires in etcd and it disappears from every replica;
//! - with one etcd member killed (-9, the leader), both replicas keep serving;
//! - an etcd that cannot be reached (connections refused, or accepted and never answered)
//!   gives a 503 with a clear message within a bound, and a client with several registry URLs
//!   fails over to a replica that works; its metrics port stays live (`/livez` 200) and says it
//!   is not ready (`/readyz` 503).
//!
//! Without etcd installed the tests print why and pass, except under CI=true, where they fail.

#![cfg(feature = "etcd")]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::etcd::{BOUND, EtcdCluster, etcd_installed, free_ports};
use common::{TestServer, prefill, wait_until};
use kvferry_bootstrap::{ClientError, ErrorBody, Registration, RegistryClient, Role, ServerConfig};
use reqwest::StatusCode;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// `n` endpoints `127.0.0.1:PORT` that accept TCP connections (the kernel's backlog) and never
/// answer, held until the listeners are dropped: an etcd that cannot be reached, whose ports no
/// other test can take meanwhile.
fn silent_endpoints(n: usize) -> (Vec<std::net::TcpListener>, Vec<String>) {
    let listeners: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let endpoints = listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    (listeners, endpoints)
}

/// A registry replica in this process on `store`, with leases of `ttl`.
async fn replica(store: &str, ttl: Duration) -> TestServer {
    TestServer::start(ServerConfig {
        store: store.parse().expect("a valid --store"),
        ..ServerConfig::with_lease_ttl(ttl)
    })
    .await
}

fn http() -> reqwest::Client {
    kvferry_wire::http::client().timeout(BOUND).build().unwrap()
}

/// POST /v1/ranks: the status and the error body when not a success.
async fn post(http: &reqwest::Client, server: &str, r: &Registration) -> (StatusCode, ErrorBody) {
    let resp = http
        .post(format!("{server}/v1/ranks"))
        .json(r)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body = if status.is_success() {
        ErrorBody::new("")
    } else {
        resp.json().await.unwrap()
    };
    (status, body)
}

/// The instance ids listed by `client`.
/// The instances a replica lists; a moment of etcd unavailability (an election) is retried
/// within the bound.
async fn listed(client: &RegistryClient) -> Vec<Uuid> {
    let start = Instant::now();
    loop {
        match client.list_ranks().await {
            Ok(ranks) => return ranks.iter().map(|i| i.registration.instance_id).collect(),
            Err(e) if start.elapsed() < BOUND => {
                println!("listing ranks: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("listing ranks for {BOUND:?}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_view_and_a_race_has_one_winner() {
    if !etcd_installed() {
        return;
    }
    let cluster = EtcdCluster::start();
    let a = replica(&cluster.store(), Duration::from_secs(10)).await;
    let b = replica(&cluster.store(), Duration::from_secs(10)).await;
    let ca = RegistryClient::new(&a.url, None).unwrap();
    let cb = RegistryClient::new(&b.url, None).unwrap();

    // Registered through A, seen through B; the group completes across replicas.
    let r0 = prefill(0, 0, 2, 0, 1);
    let r1 = prefill(0, 1, 2, 0, 1);
    let lease = ca.register(&r0).await.unwrap();
    assert_eq!(lease.lease_ttl_ms, 10_000);
    assert_eq!(listed(&cb).await, vec![r0.instance_id]);
    let err = cb.lookup_prefill(0).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("prefill group dp_rank=0 incomplete: 1 of 2 ranks registered"),
        "{err}"
    );
    cb.register(&r1).await.unwrap();
    let group = ca.lookup_prefill(0).await.unwrap();
    assert_eq!(group.ranks, vec![r0.clone(), r1.clone()]);
    assert_eq!((group.tp_size, group.pp_size), (2, 1));
    let info = &ca.list_ranks().await.unwrap()[0];
    assert!(
        (1..=10_000).contains(&info.lease_remaining_ms),
        "{}",
        info.lease_remaining_ms
    );
    let health = cb.health().await.unwrap();
    assert_eq!((health.prefill_ranks, health.groups), (2, 1));

    // The same refusals as the memory store, whichever replica is asked.
    let http = http();
    let mut other_tp = prefill(0, 1, 4, 0, 1);
    other_tp.tp_rank = 3;
    let (status, body) = post(&http, &b.url, &other_tp).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        body.error.contains("tp_size 4 conflicts with 2"),
        "{}",
        body.error
    );
    let mut moved = r0.clone();
    moved.tp_rank = 1;
    let (status, body) = post(&http, &b.url, &moved).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        body.error
            .contains("is already registered as prefill dp_rank=0 tp_rank=0"),
        "{}",
        body.error
    );
    let thief = prefill(0, 0, 2, 0, 1);
    let (status, body) = post(&http, &b.url, &thief).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body.holder, Some(r0.instance_id));
    assert_eq!(body.lease_ttl_ms, Some(10_000));
    assert!(
        body.holder_lease_remaining_ms
            .is_some_and(|ms| ms > 0 && ms <= 10_000)
    );
    // The holder re-registering through the other replica refreshes (200).
    assert_eq!(post(&http, &b.url, &r0).await.0, StatusCode::OK);
    assert_eq!(post(&http, &a.url, &r0).await.0, StatusCode::OK);
    // Decodes of identical ranks each get a slot of their own, through either replica; each
    // refreshes its own and leaves with its own.
    let twins = [prefill(0, 0, 2, 0, 1), prefill(0, 0, 2, 0, 1)].map(|mut d| {
        d.role = Role::Decode;
        d
    });
    for (d, url) in twins.iter().zip([&a.url, &b.url]) {
        assert_eq!(post(&http, url, d).await.0, StatusCode::CREATED);
    }
    assert_eq!(post(&http, &a.url, &twins[1]).await.0, StatusCode::OK);
    assert_eq!(cb.health().await.unwrap().decode_ranks, 2);
    for d in &twins {
        assert!(ca.deregister(d.instance_id).await.unwrap());
    }

    // Deregistered through B, gone from A; heartbeats of unknown instances are 404.
    assert!(cb.deregister(r1.instance_id).await.unwrap());
    assert!(!ca.deregister(r1.instance_id).await.unwrap());
    assert_eq!(listed(&ca).await, vec![r0.instance_id]);
    let resp = http
        .post(a.at(&format!("/v1/ranks/{}/heartbeat", r1.instance_id)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    cb.heartbeat(r0.instance_id).await.unwrap();

    // Two replicas racing for one free slot with two instances: one 201, one 409, 20 times.
    let rounds = 20;
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let start = Instant::now();
    for round in 0..rounds {
        let mut tasks = Vec::new();
        for url in [a.url.clone(), b.url.clone()] {
            let (http, barrier) = (http.clone(), barrier.clone());
            let r = prefill(1, round, 32, 0, 1);
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let (status, body) = post(&http, &url, &r).await;
                (status, body, r.instance_id)
            }));
        }
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap());
        }
        let won: Vec<_> = outcomes
            .iter()
            .filter(|o| o.0 == StatusCode::CREATED)
            .collect();
        let lost: Vec<_> = outcomes
            .iter()
            .filter(|o| o.0 == StatusCode::CONFLICT)
            .collect();
        assert_eq!(
            (won.len(), lost.len()),
            (1, 1),
            "round {round}: {:?}",
            outcomes
                .iter()
                .map(|o| (o.0, &o.1.error))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            lost[0].1.holder,
            Some(won[0].2),
            "the loser is told the winner"
        );
    }
    println!("{rounds} races: {:?}", start.elapsed());
    let group1 = cb.list_ranks().await.unwrap();
    assert_eq!(
        group1
            .iter()
            .filter(|i| i.registration.dp_rank == 1)
            .count(),
        rounds as usize
    );

    // A replica whose etcd cannot be reached answers 503; a client given it first fails over.
    let (_held, dead) = silent_endpoints(2);
    let broken = replica(
        &format!("etcd://{}", dead.join(",")),
        Duration::from_secs(10),
    )
    .await;
    let both = RegistryClient::new(format!("{},{}", broken.url, a.url), None).unwrap();
    let r2 = common::decode(1, 5, 8);
    let took = Instant::now();
    both.register(&r2).await.unwrap();
    println!("failover past a replica without etcd: {:?}", took.elapsed());
    assert_eq!(both.base_url(), a.url);
    assert!(listed(&cb).await.contains(&r2.instance_id));

    broken.stop().await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_removes_a_dead_agent_from_every_replica() {
    if !etcd_installed() {
        return;
    }
    let cluster = EtcdCluster::start();
    let ttl = Duration::from_secs(2);
    let a = replica(&cluster.store(), ttl).await;
    let b = replica(&cluster.store(), ttl).await;
    let ca = RegistryClient::new(&a.url, None).unwrap();
    let cb = RegistryClient::new(&b.url, None).unwrap();

    // A live agent renews its lease through B; a dead one registered once through A.
    let live = prefill(0, 0, 2, 0, 1);
    let cancel = CancellationToken::new();
    let keep = cb.keep_alive(live.clone(), cancel.clone()).await.unwrap();
    let dead = prefill(0, 1, 2, 0, 1);
    // Taken before the registration: etcd grants the lease after it.
    let registered = Instant::now();
    ca.register(&dead).await.unwrap();
    assert_eq!(ca.lookup_prefill(0).await.unwrap().ranks.len(), 2);

    for (name, client) in [("A", &ca), ("B", &cb)] {
        wait_until(
            &format!("dead agent gone from replica {name}"),
            BOUND,
            || async { !listed(client).await.contains(&dead.instance_id) },
        )
        .await;
    }
    let gone = registered.elapsed();
    println!(
        "lease {ttl:?}: the dead agent disappeared from both replicas {gone:?} after registering"
    );
    assert!(gone >= ttl, "gone before its lease ran out: {gone:?}");
    for (name, client) in [("A", &ca), ("B", &cb)] {
        // Polled: on a stalled machine the live agent's lease may lapse for a moment before
        // its keep-alive registers it again.
        wait_until(&format!("only the live agent at {name}"), BOUND, || async {
            listed(client).await == vec![live.instance_id]
        })
        .await;
        let err = client.lookup_prefill(0).await.unwrap_err();
        assert!(err.to_string().contains("of 2"), "{err}");
    }
    // The dead agent's heartbeat is unknown (its client would register again).
    let http = http();
    let resp = http
        .post(a.at(&format!("/v1/ranks/{}/heartbeat", dead.instance_id)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    // The live agent outlived several leases on its keep-alive.
    assert!(registered.elapsed() > ttl);
    assert!(listed(&ca).await.contains(&live.instance_id));

    cancel.cancel();
    keep.stopped().await;
    wait_until("deregistered on stop", BOUND, || async {
        listed(&ca).await.is_empty()
    })
    .await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_and_lookups_survive_a_killed_etcd_member() {
    if !etcd_installed() {
        return;
    }
    let mut cluster = EtcdCluster::start();
    // Leases far longer than the test: registrations made before the kill must still be
    // there at the end without a keep-alive, however slow the election and the writes.
    let a = replica(&cluster.store(), Duration::from_secs(120)).await;
    let b = replica(&cluster.store(), Duration::from_secs(120)).await;
    let ca = RegistryClient::new(&a.url, None).unwrap();
    let cb = RegistryClient::new(&b.url, None).unwrap();
    let before = prefill(0, 0, 2, 0, 1);
    ca.register(&before).await.unwrap();

    let leader = cluster.leader();
    cluster.kill(leader);
    println!("killed etcd member m{leader} (the leader) with SIGKILL");
    let killed = Instant::now();

    // The first operation through each replica may meet the election: retried on 503 until
    // it succeeds, within the bound.
    let after = prefill(0, 1, 2, 0, 1);
    let mut unavailable = 0;
    loop {
        match cb.register(&after).await {
            Ok(_) => break,
            Err(e @ ClientError::Server { status: 503, .. }) => {
                unavailable += 1;
                assert!(
                    killed.elapsed() < BOUND,
                    "still failing after {BOUND:?}: {e}"
                );
                assert!(e.to_string().contains("registry store unavailable"), "{e}");
            }
            Err(e) => panic!("register after the kill: {e}"),
        }
    }
    println!(
        "first registration after the kill: {:?} ({unavailable} answers 503 before)",
        killed.elapsed()
    );
    let group = wait_until("group complete through A", BOUND, || async {
        ca.lookup_prefill(0).await.is_ok()
    })
    .await;
    println!("lookup through A after the kill: {group:?}");

    // From then on, every operation through both replicas works first time.
    let start = Instant::now();
    let mut operations = 0;
    for round in 0..10 {
        let (first, second) = if round % 2 == 0 {
            (&ca, &cb)
        } else {
            (&cb, &ca)
        };
        let (r0, r1) = (prefill(1, 0, 2, 0, 1), prefill(1, 1, 2, 0, 1));
        first.register(&r0).await.unwrap();
        second.register(&r1).await.unwrap();
        for client in [first, second] {
            assert_eq!(
                client.lookup_prefill(1).await.unwrap().ranks,
                vec![r0.clone(), r1.clone()]
            );
        }
        second.heartbeat(r0.instance_id).await.unwrap();
        first.heartbeat(r1.instance_id).await.unwrap();
        assert!(second.deregister(r0.instance_id).await.unwrap());
        assert!(first.deregister(r1.instance_id).await.unwrap());
        operations += 8;
    }
    println!(
        "{operations} operations through both replicas with a member down: {:?}",
        start.elapsed()
    );
    assert_eq!(
        ca.lookup_prefill(0).await.unwrap().ranks,
        vec![before, after]
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn an_unreachable_etcd_is_a_503_with_a_clear_message_within_a_bound() {
    // No etcd needed: one endpoint refuses connections (a port bound, then released), two
    // accept them and never answer.
    let (_held, silent) = silent_endpoints(2);
    let refused = format!("127.0.0.1:{}", free_ports(1)[0]);
    let dead = [vec![refused], silent].concat();
    let server = replica(
        &format!("etcd://{}", dead.join(",")),
        Duration::from_secs(10),
    )
    .await;
    let http = http();
    let r = prefill(0, 0, 1, 0, 1);
    let requests = [
        http.post(server.at("/v1/ranks")).json(&r),
        http.get(server.at("/v1/groups/0")),
        http.post(server.at(&format!("/v1/ranks/{}/heartbeat", r.instance_id))),
        http.delete(server.at(&format!("/v1/ranks/{}", r.instance_id))),
        http.get(server.at("/v1/ranks")),
        http.get(server.at("/healthz")),
    ];
    for req in requests {
        let start = Instant::now();
        let resp = req.send().await.unwrap();
        let took = start.elapsed();
        let status = resp.status();
        let url = resp.url().path().to_owned();
        let body: ErrorBody = resp.json().await.unwrap();
        println!("{url}: {status} after {took:?}: {}", body.error);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{url}");
        assert!(took < Duration::from_secs(20), "bounded: {url}: {took:?}");
        assert!(
            body.error.starts_with("registry store unavailable: ")
                && body.error.contains(&format!("etcd at http://{}", dead[0]))
                && body.error.contains("did not serve it within 3000 ms"),
            "{url}: {}",
            body.error
        );
    }
    // Metrics, on either port, still scrape (the process is up) and say the store is down,
    // without the store's own figures.
    for url in [server.at("/metrics"), format!("{}/metrics", server.metrics)] {
        let resp = http.get(&url).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{url}");
        let text = resp.text().await.unwrap();
        assert!(
            text.contains("kvferry_bootstrap_store_up 0"),
            "{url}: {text}"
        );
        assert!(!text.contains("kvferry_bootstrap_ranks"), "{url}: {text}");
    }
    // The metrics port: live whatever etcd does (a liveness probe restarts no replica), not
    // ready while its store cannot answer.
    let live = http
        .get(format!("{}/livez", server.metrics))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), StatusCode::OK);
    let start = Instant::now();
    let ready = http
        .get(format!("{}/readyz", server.metrics))
        .send()
        .await
        .unwrap();
    let took = start.elapsed();
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    let why = ready.text().await.unwrap();
    println!("/readyz on the metrics port: 503 after {took:?}: {why}");
    assert!(took < Duration::from_secs(20), "bounded: {took:?}");
    assert!(
        why.starts_with("not ready: registry store unavailable: ") && why.contains("etcd at"),
        "{why}"
    );
    let live = http
        .get(format!("{}/livez", server.metrics))
        .send()
        .await
        .unwrap();
    assert_eq!(
        live.status(),
        StatusCode::OK,
        "still live after the store failed"
    );
    // Bad input is still refused before the store is asked.
    let mut invalid = r.clone();
    invalid.tp_rank = 1;
    let (status, body) = post(&http, &server.url, &invalid).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body.error.contains("tp_rank 1 must be < tp_size 1"),
        "{}",
        body.error
    );
    server.stop().await;
}
