//! `--transport ucx` across real processes (release binary built with the `ucx` feature), over
//! UCX's tcp transport pinned to loopback (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`: the machine's
//! other interface is never a target) and over shared memory (`UCX_TLS=posix,cma,self`):
//! 1P1D and TP2 -> TP1, 100 rooms each, every byte verified; a prefill killed mid-transfer
//! fails its rooms with `peer_dead` and the decode keeps serving rooms of a restarted prefill.
#![cfg(feature = "ucx")]

mod common;

use std::time::Instant;

use common::{AgentOpts, BOUND, expect, http, runtime, wait_final, wait_state};
use kvferry::cli::cluster::{Process, log_dir};
use kvferry::cli::demo::{Apis, LocalCluster, Shape, drive_rooms};
use reqwest::{Method, StatusCode};
use serde_json::json;

/// The UCX environments under test.
fn envs() -> [(&'static str, Vec<(String, String)>); 2] {
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    [
        (
            "tcp",
            vec![pair("UCX_TLS", "tcp"), pair("UCX_NET_DEVICES", "lo")],
        ),
        ("shm", vec![pair("UCX_TLS", "posix,cma,self")]),
    ]
}

fn opts(model: &'static str, pool_pages: usize) -> Vec<String> {
    let o = AgentOpts {
        model,
        pool_pages,
        transport: "ucx",
        heartbeat_ms: 100,
        peer_dead_ms: 1000,
        ..AgentOpts::default()
    };
    o.args()
}

#[test]
fn hundred_rooms_over_ucx_tcp_and_shm_1p1d_and_tp2_to_tp1() {
    let exe = common::release_binary();
    for (name, env) in envs() {
        for (prefill, label) in [(Shape::ONE, "1p1d"), (Shape::tp(2), "tp2-tp1")] {
            let tag = format!("ucx-{name}-{label}");
            let c = LocalCluster::start_shaped_env(
                &exe,
                &tag,
                &opts("tiny", 256),
                prefill,
                Shape::ONE,
                &env,
            )
            .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
            let rooms: Vec<(u64, usize)> = (1..=100)
                .map(|r| (r, 1 + (r as usize * 37) % 400))
                .collect();
            let started = Instant::now();
            let results = runtime()
                .block_on(drive_rooms(&c.apis().unwrap(), rooms, 8))
                .unwrap();
            for r in &results {
                assert!(
                    r.verified,
                    "{tag}: room {} {} {:?}; logs in {}",
                    r.room,
                    r.state,
                    r.code,
                    c.logs.display()
                );
            }
            println!(
                "{tag}: 100 rooms verified in {:.0} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}

#[test]
fn a_prefill_killed_mid_transfer_fails_rooms_and_a_restarted_one_serves() {
    let exe = common::release_binary();
    for (name, env) in envs() {
        let tag = format!("ucx-kill-{name}");
        // llama3-8b, 4096 tokens: 512 MiB, long enough to be caught mid-transfer.
        let args = opts("llama3-8b", 272);
        let c = LocalCluster::start_shaped_env(&exe, &tag, &args, Shape::ONE, Shape::ONE, &env)
            .unwrap();
        let (p, d) = (
            c.prefill().field("api").unwrap(),
            c.decode().field("api").unwrap(),
        );
        let http = http();
        runtime().block_on(async {
            let body = json!({"tokens": 4096});
            expect(
                &http,
                Method::POST,
                &format!("{d}/v1/rooms/1"),
                Some(&body),
                StatusCode::CREATED,
            )
            .await;
            expect(
                &http,
                Method::POST,
                &format!("{p}/v1/rooms/1/ready"),
                Some(&body),
                StatusCode::ACCEPTED,
            )
            .await;
            let v = wait_state(&http, &d, 1, &["transferring", "success"], BOUND).await;
            c.prefill().signal("KILL").unwrap();
            let killed = Instant::now();
            let v2 = wait_final(&http, &d, 1).await;
            if v["state"] == "transferring" && v2["state"] != "success" {
                assert_eq!(v2["state"], "failed", "{v2}");
                assert_eq!(v2["reason"]["code"], "peer_dead", "{v2}");
                println!(
                    "{tag}: killed mid-transfer -> peer_dead in {:.0} ms",
                    killed.elapsed().as_secs_f64() * 1e3
                );
            } else {
                println!("{tag}: the room landed before the kill; nothing to fail");
            }
            expect(
                &http,
                Method::POST,
                &format!("{d}/v1/rooms/1/take"),
                None,
                StatusCode::OK,
            )
            .await;
        });
        // A restarted prefill registers a new instance; the decode serves rooms from it.
        let url = c.registry.field("url").unwrap();
        let mut prefill_args = vec!["prefill".to_owned(), "--bootstrap".to_owned(), url];
        prefill_args.extend(args.clone());
        let logs = log_dir(&format!("{tag}-restart")).unwrap();
        let p2 = Process::spawn_env(&exe, "prefill2", &prefill_args, &env, &logs, BOUND).unwrap();
        let apis = Apis::pair(&p2.field("api").unwrap(), &d);
        let results = runtime()
            .block_on(drive_rooms(&apis, vec![(10, 512), (11, 16), (12, 4096)], 1))
            .unwrap();
        assert!(results.iter().all(|r| r.verified), "{tag}: {results:?}");
        println!("{tag}: after the restart 3 rooms verified");
    }
}
