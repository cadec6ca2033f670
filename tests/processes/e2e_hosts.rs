//! Hosts apart: three network namespaces on one switched network (`common::netns`), a registry
//! host, a prefill host with two prefill ranks (TP2) and a decode host with one decode rank
//! (TP1). Every process binds its host's wildcard address, advertises the host's own address
//! (`--advertise-host`) and listens on pinned ports, with a shared token, as on a real cluster:
//! the registry and the engine APIs serve HTTPS with certificates of the test's own CA, which
//! the agents and the test trust (`--tls-ca`), so the token never crosses the network in an
//! HTTP request in clear. The test's HTTP client runs in the switch, so it reaches every host
//! over the network.
//!
//! Per transport (zmq-tcp; ucx-tcp with UCX pinned to the namespace's veth device):
//! - rooms of mixed lengths land verified (every byte checked by the synthetic decode on take);
//! - the prefill host's link is cut while three rooms are transferring: the decode fails them
//!   `peer_dead` (heartbeats every 100 ms, `--peer-dead-ms 1000`), their pages return;
//! - the link comes back: the prefill's pages return, and new rooms land verified, with every
//!   process the same one as before the cut.
//!
//! Needs root and iproute2 (skipped elsewhere, a failure with `CI=true`) and
//! `cargo build --release --all-features --bin kvferry`. Run one at a time:
//! `cargo test --all-features --test processes e2e_hosts:: -- --test-threads=1 --nocapture`.

use crate::common;

use std::time::{Duration, Instant};

use common::netns::{DEVICE, Hosts};
use common::*;
use kvferry::cluster::{Apis, drive_rooms};
use serde_json::json;

/// The cluster's shared secret (registry routes, agent registrations and Hello).
const TOKEN: &str = "hosts-apart-token";

/// Pinned ports (the namespaces are the test's own: nothing else listens there).
const REGISTRY_PORT: u16 = 8998;
const CONTROL_PORT: u16 = 7100;
const DATA_PORT: u16 = 7200;
const API_PORT: u16 = 7300;

/// Heartbeats every 100 ms; a peer silent for this long is dead.
const PEER_DEAD_MS: u64 = 1000;

/// 4 layers x 1.5 s: a room is `transferring` for ~6 s, long enough to be caught by the cut.
const LAYER_MS: &str = "1500";

#[test]
fn hosts_apart_over_zmq_tcp() {
    hosts_apart("zmq-tcp", &[]);
}

#[cfg(feature = "ucx")]
#[test]
fn hosts_apart_over_ucx_tcp() {
    hosts_apart("ucx", &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", DEVICE)]);
}

fn hosts_apart(transport: &'static str, env: &[(&str, &str)]) {
    let tag = format!("hosts-{transport}");
    let Some(net) = Hosts::create_or_skip(&tag, &["registry", "prefill", "decode"]) else {
        return;
    };
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir(&tag).expect("log dir");
    let (reg_host, pre_host, dec_host) = (
        net.host("registry"),
        net.host("prefill"),
        net.host("decode"),
    );
    println!(
        "[{tag}] registry {}, prefill {}, decode {} (device {DEVICE}); logs in {}",
        reg_host.ip,
        pre_host.ip,
        dec_host.ip,
        logs.display()
    );
    // One certificate for every host's address, signed by the test's CA.
    let ips = [
        reg_host.ip.as_str(),
        pre_host.ip.as_str(),
        dec_host.ip.as_str(),
    ];
    let certs = common::tls::certificates_in(&logs, &ips);
    kvferry_wire::tls::trust(&certs.ca).expect("trust the test's CA");
    let path = |p: &std::path::Path| p.display().to_string();
    let tls = [
        ("--tls-cert", path(&certs.cert)),
        ("--tls-key", path(&certs.key)),
        ("--tls-ca", path(&certs.ca)),
    ];
    let mut registry_args = owned(&[
        "bootstrap",
        "--host",
        "0.0.0.0",
        "--port",
        &REGISTRY_PORT.to_string(),
        "--token",
        TOKEN,
    ]);
    for (flag, value) in &tls[..2] {
        set_flag(&mut registry_args, flag, value);
    }
    let registry = common::spawn(
        &exe,
        &reg_host.exec(),
        "registry",
        &registry_args,
        env,
        &logs,
    );
    let url = format!("https://{}:{REGISTRY_PORT}", reg_host.ip);
    let opts = AgentOpts {
        transport,
        heartbeat_ms: 100,
        peer_dead_ms: PEER_DEAD_MS,
        ..AgentOpts::default()
    };
    // Rank `rank` of `size` on `host`: wildcard binds, the host's address advertised, pinned
    // ports (one set per rank), the API on the host's address for the test's client.
    let agent = |role: &str, host: &common::netns::Host, rank: u16, size: u16| {
        let mut args = owned(&[role, "--bootstrap", &url, "--token", TOKEN]);
        args.extend(all_timeouts(&opts, 60_000, 30_000));
        for (flag, value) in [
            ("--host", "0.0.0.0".to_owned()),
            ("--advertise-host", host.ip.clone()),
            ("--control-port", (CONTROL_PORT + rank).to_string()),
            ("--data-port", (DATA_PORT + rank).to_string()),
            ("--api-host", host.ip.clone()),
            ("--api-port", (API_PORT + rank).to_string()),
            ("--tp-rank", rank.to_string()),
            ("--tp-size", size.to_string()),
            ("--synthetic-layer-ms", LAYER_MS.to_owned()),
        ]
        .into_iter()
        .chain(tls.iter().cloned())
        {
            set_flag(&mut args, flag, &value);
        }
        let name = format!("{role}-{rank}");
        let spawned = common::spawn(&exe, &host.exec(), &name, &args, env, &logs);
        let api = spawned.field("api").unwrap();
        let want = format!("https://{}:{}", host.ip, API_PORT + rank);
        assert_eq!(api, want, "{name}'s API is where it was pinned");
        (spawned, api)
    };
    let (mut prefill0, p0) = agent("prefill", pre_host, 0, 2);
    let (mut prefill1, p1) = agent("prefill", pre_host, 1, 2);
    let (mut decode, d) = agent("decode", dec_host, 0, 1);
    let pids = [prefill0.pid(), prefill1.pid(), decode.pid()];
    let apis = Apis {
        prefill: vec![vec![p0.clone(), p1.clone()]],
        decode: vec![vec![d.clone()]],
        token: Some(TOKEN.to_owned()),
    };

    std::thread::scope(|s| {
        let body = s.spawn(|| {
            net.enter();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let http = http_with_token(TOKEN);
                for api in [&p0, &p1, &d] {
                    healthy(&http, api).await;
                }
                let (total, _) = pool(&http, &d).await;

                // Rooms of mixed lengths (not multiples of the 16-token page), all at once.
                let rooms: Vec<(u64, usize)> = [1usize, 17, 300, 1000, 2047, 64]
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| (100 + i as u64, t))
                    .collect();
                let t = Instant::now();
                let results = drive_rooms(&apis, rooms.clone(), rooms.len())
                    .await
                    .expect("rooms across hosts");
                for r in &results {
                    assert_eq!(r.state, "success", "room {} across hosts: {r:?}", r.room);
                    assert!(r.verified, "room {} landed but did not verify: {r:?}", r.room);
                }
                println!(
                    "[{tag}] {} rooms TP2 -> TP1 across hosts, all verified, in {:.0} ms",
                    results.len(),
                    ms(t.elapsed())
                );

                // Three rooms held in flight (their first halves announced), then the prefill
                // host's link is cut.
                let cut_rooms = [1u64, 2, 3];
                for &room in &cut_rooms {
                    request(&http, &d, room, json!({ "tokens": 2048 })).await;
                    ready_piece(&http, &p0, room, 2048, 0..1024, false).await;
                    ready_piece(&http, &p1, room, 2048, 0..1024, false).await;
                }
                for &room in &cut_rooms {
                    wait_state(&http, &d, room, &["transferring"], BOUND).await;
                }
                net.set_link("prefill", false);
                let (cut, cut_ms) = (Instant::now(), now_ms());
                let mut worst = 0.0f64;
                for &room in &cut_rooms {
                    let v = wait_final(&http, &d, room).await;
                    assert_eq!(v["state"], "failed", "{v}");
                    assert_reason(&v, "peer_dead");
                    worst = worst.max(at(&v, "failed").unwrap_or(f64::NAN) - cut_ms);
                    wait_safe(&http, &d, room).await;
                    take(&http, &d, room).await;
                }
                println!(
                    "[{tag}] link cut -> {} transferring rooms failed peer_dead, the last {worst:.0} ms after the cut (agent clock; --peer-dead-ms {PEER_DEAD_MS}); seen in {:.0} ms",
                    cut_rooms.len(),
                    ms(cut.elapsed())
                );
                assert!(cut.elapsed() < BOUND);
                assert_eq!(pool(&http, &d).await, (total, total), "decode pages after the takes");

                // Down long enough for the prefills to give up on the decode too.
                tokio::time::sleep(
                    Duration::from_millis(3 * PEER_DEAD_MS).saturating_sub(cut.elapsed()),
                )
                .await;
                net.set_link("prefill", true);
                let up = Instant::now();
                for api in [&p0, &p1] {
                    for &room in &cut_rooms {
                        // A prefill either posted every chunk before the link died
                        // (`success`: posted is all it can know) or failed `peer_dead`.
                        let v = wait_final(&http, api, room).await;
                        if v["state"] != "success" {
                            assert_eq!(v["state"], "failed", "{v}");
                            assert_reason(&v, "peer_dead");
                        }
                    }
                    poll_until("prefill pages back", BOUND, || async {
                        let (all, free) = pool(&http, api).await;
                        (all == free).then_some(())
                    })
                    .await;
                }

                let rooms: Vec<(u64, usize)> = vec![(200, 48), (201, 700), (202, 1500)];
                let results = drive_rooms(&apis, rooms.clone(), rooms.len())
                    .await
                    .expect("rooms after the link came back");
                for r in &results {
                    assert_eq!(r.state, "success", "room {} after the link came back: {r:?}", r.room);
                    assert!(r.verified, "room {} after the link came back: {r:?}", r.room);
                }
                println!(
                    "[{tag}] link back: {} new rooms landed verified {:.0} ms after it came up",
                    results.len(),
                    ms(up.elapsed())
                );
            });
        });
        if let Err(panic) = body.join() {
            std::panic::resume_unwind(panic);
        }
    });
    // Nothing was restarted: the same three agents served before and after the cut.
    for (p, want) in [&mut prefill0, &mut prefill1, &mut decode]
        .into_iter()
        .zip(pids)
    {
        assert!(p.alive(), "{} exited; see {}", p.name, p.log.display());
        assert_eq!(p.pid(), want);
    }
    drop(decode);
    drop(prefill1);
    drop(prefill0);
    drop(registry);
    drop(net);
}
