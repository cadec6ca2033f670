//! The registry with nothing single-point, across real processes: a three-member etcd cluster
//! on 127.0.0.1 started by the test, two registry replicas (`kvferry bootstrap --store
//! etcd://...`), a prefill and a decode agent given both replicas (`--bootstrap A,B`). During a
//! run of rooms, kill -9 of replica A (the one the agents use first) and of the etcd leader:
//! - the rooms already paired land verified (the registry is not on the data path);
//! - rooms requested after the failover are looked up through B, paired and land verified;
//! - the agents' leases outlive the failover (renewed through B past several lease lengths);
//! - a decode agent started afterwards with a dead replica first registers through the next
//!   one and lands rooms; killed -9, its lease lapses and every live replica stops listing it.
//!
//! Needs `etcd` and `etcdctl` (Debian etcd-server, etcd-client; skipped without them, a failure
//! with `CI=true`) and `cargo build --release --all-features --bin kvferry`.

#![cfg(feature = "etcd")]

use crate::common;

use crate::etcd;

use std::time::{Duration, Instant};

use common::*;
use etcd::{EtcdCluster, etcd_installed};
use kvferry::cluster::{Apis, drive_rooms};
use serde_json::json;

/// Registry leases: short, so that a lapse is seen quickly and a failover that did not renew
/// would show within the test.
const LEASE_MS: u64 = 3000;

#[test]
fn replicas_on_etcd_survive_a_killed_replica_and_a_killed_etcd_member() {
    if !etcd_installed() {
        return;
    }
    let mut cluster = EtcdCluster::start();
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir("registry-etcd").expect("log dir");
    println!(
        "[registry-etcd] etcd {:?}; logs in {}",
        cluster.clients,
        logs.display()
    );
    let store = cluster.store();
    let replica = |name: &str| {
        let args = owned(&[
            "bootstrap",
            "--port",
            "0",
            "--store",
            &store,
            "--lease-ttl-ms",
            &LEASE_MS.to_string(),
        ]);
        let r = common::spawn(&exe, &[], name, &args, &[], &logs);
        let url = r.field("url").unwrap();
        (r, url)
    };
    let (a, url_a) = replica("registry-a");
    let (_b, url_b) = replica("registry-b");
    let both = format!("{url_a},{url_b}");
    let opts = AgentOpts {
        heartbeat_ms: 100,
        peer_dead_ms: 5000,
        ..AgentOpts::default()
    };
    let agent = |role: &str, name: &str, bootstrap: &str, extra: &[&str]| {
        let mut args = owned(&[role, "--bootstrap", bootstrap]);
        args.extend(all_timeouts(&opts, 60_000, 30_000));
        args.extend(owned(extra));
        let s = common::spawn(&exe, &[], name, &args, &[], &logs);
        let api = s.field("api").unwrap();
        (s, api)
    };
    let (prefill, p) = agent("prefill", "prefill", &both, &[]);
    let (decode, d) = agent("decode", "decode", &both, &[]);

    runtime().block_on(async {
        let http = http();
        let (total, _) = pool(&http, &d).await;
        // Rooms held mid-transfer while the registry and etcd fail under them: the first half
        // of each is announced, the rest only after the kills.
        let in_flight = [1u64, 2, 3];
        for &room in &in_flight {
            request(&http, &d, room, json!({ "tokens": 300 })).await;
            ready_piece(&http, &p, room, 300, 0..150, false).await;
        }
        for &room in &in_flight {
            wait_state(&http, &d, room, &["transferring"], BOUND).await;
        }

        let leader = cluster.leader();
        a.signal("KILL").unwrap();
        cluster.kill(leader);
        let failed_over = Instant::now();
        println!("[registry-etcd] killed registry replica A and etcd member {leader} (the leader) while rooms {in_flight:?} transferred");
        for &room in &in_flight {
            ready_piece(&http, &p, room, 300, 150..300, true).await;
        }
        for &room in &in_flight {
            let v = wait_final(&http, &d, room).await;
            assert_eq!(v["state"], "success", "a room paired before the failover: {v}");
            assert_eq!(take(&http, &d, room).await["verified"], true, "room {room}");
        }
        println!(
            "[registry-etcd] rooms paired before the failover landed verified ({:.0} ms after the kills)",
            ms(failed_over.elapsed())
        );

        // New rooms: the decode looks the prefill group up again, through B.
        let apis = Apis::pair(&p, &d);
        let rooms: Vec<(u64, usize)> = vec![(10, 17), (11, 500), (12, 64)];
        let results = drive_rooms(&apis, rooms, 3).await.expect("rooms after the failover");
        for r in &results {
            assert_eq!(r.state, "success", "room {} after the failover: {r:?}", r.room);
            assert!(r.verified, "room {} after the failover: {r:?}", r.room);
        }
        println!(
            "[registry-etcd] {} rooms requested after the failover paired and landed verified ({:.0} ms after the kills)",
            results.len(),
            ms(failed_over.elapsed())
        );

        // Leases renewed through B: still listed after several lease lengths.
        tokio::time::sleep(Duration::from_millis(3 * LEASE_MS).saturating_sub(failed_over.elapsed())).await;
        let listed = registered(&http, &url_b).await;
        assert_eq!(listed.len(), 2, "prefill and decode still registered through B: {listed:?}");
        // Renewed, not lapsed and registered again (an agent whose lease lapsed registers
        // again under the same id and would be listed just the same): each agent moved to B
        // and never found its lease gone.
        for agent in [&prefill, &decode] {
            let log = std::fs::read_to_string(&agent.log).unwrap_or_default();
            assert!(log.contains("registry: now using this URL"), "{} never moved to B: {}", agent.name, agent.log.display());
            assert!(!log.contains("registering again"), "{}'s lease lapsed during the failover: {}", agent.name, agent.log.display());
        }
        assert_eq!(pool(&http, &d).await, (total, total), "decode pages back");
    });

    // A replica restarted on the same etcd serves the same view; a decode started with the
    // dead replica first registers through the next one.
    let (_c, url_c) = replica("registry-c");
    let late = format!("{url_a},{url_c}");
    let (decode2, d2) = agent(
        "decode",
        "decode-2",
        &late,
        &["--dp-rank", "1", "--dp-size", "2"],
    );
    let instance2 = decode2.field("instance").unwrap();
    runtime().block_on(async {
        let http = http();
        for url in [&url_b, &url_c] {
            let listed = registered(&http, url).await;
            assert!(listed.contains(&instance2), "{url} lists the new decode: {listed:?}");
        }
        let results = drive_rooms(&Apis::pair(&p, &d2), vec![(20, 100)], 1)
            .await
            .expect("a room on the new decode");
        assert!(results[0].verified && results[0].state == "success", "{:?}", results[0]);

        decode2.signal("KILL").unwrap();
        let killed = Instant::now();
        for url in [&url_b, &url_c] {
            poll_until("the dead decode's lease lapses", BOUND, || async {
                (!registered(&http, url).await.contains(&instance2)).then_some(())
            })
            .await;
        }
        println!(
            "[registry-etcd] a decode killed -9 left both live replicas' views {:.0} ms later (lease {LEASE_MS} ms)",
            ms(killed.elapsed())
        );
    });
}
