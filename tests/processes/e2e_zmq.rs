//! End to end over ZeroMQ (issue 5, "Tests that must exist"): a real registry, prefill and
//! decode agent (release binary, OS-chosen ports, loopback only) driven over their HTTP APIs.
//!
//! - rooms land intact over `zmq-tcp` and `zmq-ipc`, 8 in flight, and every page comes back;
//! - an untaken room expires and its agent-owned pages return; a ready room no decode asked
//!   for expires at the prefill, and a later request for it is refused at once;
//! - a room a decode holds for a queued request outlives the TTL up to its maximum, and one
//!   decode's holds keep at most `--max-held-pages` without refusing any new room; a room the
//!   prefill engine holds queued outlives the ready timeout;
//! - abort before the prefill is ready and in the middle of a transfer;
//! - engine-owned pages are never counted or freed by the agent;
//! - an unreachable advertised prefill endpoint fails the room with `unreachable`, quickly;
//! - bad HTTP input gets 4xx JSON errors and changes nothing.
//!
//! Needs `cargo build --release --bin kvferry` first. Times are printed, bounds are generous.

// The tables of cases are tuples; naming their types would not make them clearer.
#![allow(clippy::type_complexity)]

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use kvferry::cluster::{Apis, LocalCluster, drive_rooms};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use kvferry::protocol::{ErrorMsg, Heartbeat, Message};
use kvferry::reason::FailureCode;

/// KV bytes per token of the `tiny` preset: 4 layers x 4 heads x 32 x fp16 x (K, V).
const TINY_BYTES_PER_TOKEN: u64 = 4 * 4 * 32 * 2 * 2;

fn start(tag: &str, opts: &AgentOpts) -> (LocalCluster, String, String) {
    let t = Instant::now();
    let cluster = LocalCluster::start(&release_binary(), tag, &opts.args())
        .unwrap_or_else(|e| panic!("starting the cluster: {e:#}"));
    let prefill = cluster.prefill().field("api").expect("prefill api");
    let decode = cluster.decode().field("api").expect("decode api");
    println!(
        "[{tag}] cluster up in {:.0} ms: prefill {prefill}, decode {decode}; logs in {}",
        ms(t.elapsed()),
        cluster.logs.display()
    );
    (cluster, prefill, decode)
}

fn hundred_rooms(tag: &str, transport: &'static str) {
    let opts = AgentOpts {
        transport,
        ..AgentOpts::default()
    };
    let (cluster, prefill, decode) = start(tag, &opts);
    let rt = runtime();
    rt.block_on(async {
        let http = http();
        let (d_total, d_free) = pool(&http, &decode).await;
        let (p_total, p_free) = pool(&http, &prefill).await;
        assert_eq!((d_total, d_free, p_total, p_free), (512, 512, 512, 512));

        // Mixed lengths, 1..=500 tokens: partial last pages, single-page and 32-page rooms.
        let rooms: Vec<(u64, usize)> = (1..=100u64).map(|r| (r, ((r * 97) % 500 + 1) as usize)).collect();
        let t = Instant::now();
        let results = drive_rooms(&Apis::pair(&prefill, &decode), rooms.clone(), 8)
            .await
            .unwrap_or_else(|e| panic!("driving rooms: {e:#}; logs in {}", cluster.logs.display()));
        let wall = t.elapsed();
        assert_eq!(results.len(), 100);
        let mut latencies: Vec<f64> = Vec::new();
        for (r, (room, tokens)) in results.iter().zip(&rooms) {
            assert_eq!((r.room, r.tokens), (*room, *tokens));
            assert!(
                r.state == "success" && r.verified,
                "room {} ({} tokens): state {} code {:?} verified {}",
                r.room,
                r.tokens,
                r.state,
                r.code,
                r.verified
            );
            assert_eq!(r.bytes, *tokens as u64 * TINY_BYTES_PER_TOKEN, "room {} bytes", r.room);
            latencies.push(r.latency_ms);
        }
        let bytes: u64 = results.iter().map(|r| r.bytes).sum();
        latencies.sort_by(f64::total_cmp);
        println!(
            "[{tag}] 100 rooms ({:.1} MiB) verified in {:.0} ms; ready->success p50 {:.2} ms, max {:.2} ms",
            bytes as f64 / (1u64 << 20) as f64,
            ms(wall),
            latencies[50],
            latencies[99]
        );
        assert!(wall < Duration::from_secs(60), "100 tiny rooms took {wall:?}");

        // Take removed every room; every page is back on both sides.
        for (room, _) in &rooms {
            let (status, body) = call(&http, Method::GET, &format!("{decode}/v1/rooms/{room}"), None).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "GET taken room {room}: {body}");
            assert!(body["error"].is_string(), "GET taken room {room}: {body}");
        }
        assert_eq!(pool(&http, &decode).await, (512, 512), "decode pages after all takes");
        let t = Instant::now();
        poll_until("prefill pages back", BOUND, || async {
            (pool(&http, &prefill).await == (512, 512)).then_some(())
        })
        .await;
        println!("[{tag}] prefill pool whole again {:.0} ms after the last take", ms(t.elapsed()));
        let landed = metric(&http, &decode, "kvferry_rooms_total{role=\"decode\",state=\"success\"}").await;
        assert_eq!(landed, Some(100.0));
        healthy(&http, &decode).await;
        healthy(&http, &prefill).await;
    });
    drop(cluster);
}

/// 100 rooms over zmq-tcp, 8 in flight, every byte verified, every page back, take removes.
#[test]
fn hundred_rooms_over_zmq_tcp_land_verified_and_pools_refill() {
    hundred_rooms("e2e-tcp", "zmq-tcp");
}

/// The same over zmq-ipc.
#[test]
fn hundred_rooms_over_zmq_ipc_land_verified_and_pools_refill() {
    hundred_rooms("e2e-ipc", "zmq-ipc");
}

/// A landed room never taken expires after --room-ttl-ms; its pages return; it is counted. So
/// does a ready room no decode asked for, at the prefill; a later request for it is refused.
#[test]
fn untaken_room_expires_and_its_pages_return() {
    let opts = AgentOpts {
        room_ttl_ms: 500,
        ..AgentOpts::default()
    };
    let (cluster, prefill, decode) = start("e2e-expire", &opts);
    runtime().block_on(async {
        let http = http();
        let (total, _) = pool(&http, &decode).await;
        let room = 7u64;
        let body = json!({ "tokens": 100 });
        let v = expect(
            &http,
            Method::POST,
            &format!("{decode}/v1/rooms/{room}"),
            Some(&body),
            StatusCode::CREATED,
        )
        .await;
        assert_eq!(v["page_owner"], "agent");
        ready(&http, &prefill, room, 100).await;
        let v = wait_final(&http, &decode, room).await;
        assert_eq!(v["state"], "success", "{v}");
        let success_at = v["timings"]["success"].as_f64().expect("success timing");
        assert_eq!(
            pool(&http, &decode).await,
            (total, total - 7),
            "100 tokens hold 7 pages until expiry"
        );

        poll_until("room expired (GET -> 404)", BOUND, || async {
            let (status, _) = call(
                &http,
                Method::GET,
                &format!("{decode}/v1/rooms/{room}"),
                None,
            )
            .await;
            (status == StatusCode::NOT_FOUND).then_some(())
        })
        .await;
        // The agent's own timestamps (ms since the epoch, same host): no earlier than the ttl.
        let gone_after = now_ms() - success_at;
        println!("[e2e-expire] room gone {gone_after:.0} ms after success (ttl 500 ms)");
        assert!(
            gone_after >= 500.0,
            "expired {gone_after:.0} ms after success, before its ttl"
        );
        assert_eq!(
            pool(&http, &decode).await,
            (total, total),
            "decode pages after expiry"
        );
        let expired = metric(
            &http,
            &decode,
            "kvferry_rooms_expired_total{role=\"decode\"}",
        )
        .await;
        assert_eq!(expired, Some(1.0));
        let took = call(
            &http,
            Method::POST,
            &format!("{decode}/v1/rooms/{room}/take"),
            None,
        )
        .await;
        assert_error("take an expired room", took, StatusCode::NOT_FOUND);
        poll_until("prefill pages back", BOUND, || async {
            (pool(&http, &prefill).await == (total, total)).then_some(())
        })
        .await;

        // A ready room no decode asks for expires at the prefill (its pages return, it is
        // counted); a decode that asks for it later is refused at once with `unknown_room`,
        // saying it expired, instead of waiting --timeout-ready-ms for a room the engine will
        // never announce again.
        let room = 8u64;
        ready(&http, &prefill, room, 100).await;
        assert_eq!(pool(&http, &prefill).await, (total, total - 7));
        poll_until("unasked room expired at the prefill", BOUND, || async {
            (pool(&http, &prefill).await == (total, total)).then_some(())
        })
        .await;
        let expired = metric(
            &http,
            &prefill,
            "kvferry_rooms_expired_total{role=\"prefill\"}",
        )
        .await;
        assert_eq!(expired, Some(1.0));
        let t = Instant::now();
        let url = format!("{decode}/v1/rooms/{room}");
        expect(&http, Method::POST, &url, Some(&body), StatusCode::CREATED).await;
        let v = wait_final(&http, &decode, room).await;
        println!(
            "[e2e-expire] a request for a room that expired unasked refused in {:.0} ms",
            ms(t.elapsed())
        );
        assert_eq!(v["state"], "failed", "{v}");
        assert_eq!(v["reason"]["code"], "unknown_room", "{v}");
        let message = v["reason"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("room {room} expired here"))
                && message.contains("no decode asked for it"),
            "{v}"
        );
    });
    drop(cluster);
}

/// A room the decode held for a queued request and then let go without asking (its engine
/// computed the prompt itself, or dropped the request) is told to the prefill, where it fails
/// `--requeue-ms` later (code `aborted`, naming the decode that let it go) instead of waiting
/// out its 60 s TTL. A room another decode asks for meanwhile would land: the rule is the lost
/// decode's.
#[test]
fn a_room_its_decode_let_go_waits_only_requeue_ms_at_the_prefill() {
    let opts = AgentOpts {
        heartbeat_ms: 100,
        ..AgentOpts::default()
    };
    let mut args = opts.args();
    args.extend(["--requeue-ms", "300"].map(String::from));
    let cluster = LocalCluster::start(&release_binary(), "e2e-let-go", &args)
        .unwrap_or_else(|e| panic!("starting the cluster: {e:#}"));
    let prefill = cluster.prefill().field("api").expect("prefill api");
    let decode = cluster.decode().field("api").expect("decode api");
    runtime().block_on(async {
        let http = http();
        let room = 41;
        ready(&http, &prefill, room, 100).await;
        let url = format!("{decode}/v1/rooms/{room}/hold");
        expect(&http, Method::POST, &url, Some(&json!({})), StatusCode::ACCEPTED).await;
        let (status, _) = call(&http, Method::DELETE, &url, None).await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        let let_go = std::time::Instant::now();
        let at_prefill = format!("{prefill}/v1/rooms/{room}");
        let view = poll_until("the let-go room failed at the prefill", BOUND, || async {
            let (_, v) = call(&http, Method::GET, &at_prefill, None).await;
            (v["state"] == "failed").then_some(v)
        })
        .await;
        let took = let_go.elapsed();
        println!("[e2e-let-go] the room failed at the prefill {took:?} after its decode let it go (ttl 60 s)");
        assert_eq!(view["reason"]["code"], "aborted", "{view}");
        let message = view["reason"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("let the room go without asking for it")
                && message.contains("within 300 ms (--requeue-ms)"),
            "{message}"
        );
        assert!(took < Duration::from_secs(60), "it waited out its TTL");
    });
}

/// A ready room whose decode holds it for a queued request (`POST .../hold`) outlives the
/// prefill's TTL, renewed by the decode's heartbeats, and lands when asked for; one no decode
/// holds expires at the TTL, as does one whose hold ended. While the decode's holds keep
/// `--max-held-pages`, a new room is still accepted (a decode's holds never refuse rooms), but
/// the decode's hold of it is not honoured: it expires at its TTL, the held room lives on. A
/// held room still expires `--room-max-ms` after its announcement.
#[test]
fn held_rooms_outlive_their_ttl_up_to_their_maximum_and_the_held_page_limit() {
    // TTL 1.5 s against heartbeats every 100 ms; 100 tokens are 7 pages, so one held room
    // reaches the limit of 7 pages.
    let opts = AgentOpts {
        room_ttl_ms: 1_500,
        heartbeat_ms: 100,
        ..AgentOpts::default()
    };
    let mut args = opts.args();
    args.extend(["--room-max-ms", "6000", "--max-held-pages", "7"].map(String::from));
    let tag = "e2e-held";
    let cluster = LocalCluster::start(&release_binary(), tag, &args)
        .unwrap_or_else(|e| panic!("starting the cluster: {e:#}"));
    let prefill = cluster.prefill().field("api").expect("prefill api");
    let decode = cluster.decode().field("api").expect("decode api");
    runtime().block_on(async {
        let http = http();
        let body = json!({ "tokens": 100 });
        let hold = |room: u64| {
            let (http, url) = (http.clone(), format!("{decode}/v1/rooms/{room}/hold"));
            async move {
                expect(
                    &http,
                    Method::POST,
                    &url,
                    Some(&json!({})),
                    StatusCode::ACCEPTED,
                )
                .await
            }
        };
        let at_prefill = |room: u64| {
            let (http, url) = (http.clone(), format!("{prefill}/v1/rooms/{room}"));
            async move { call(&http, Method::GET, &url, None).await }
        };
        // Room 1 is held, room 2 not, room 3 held and then released.
        for room in [1, 2, 3] {
            ready(&http, &prefill, room, 100).await;
        }
        hold(1).await;
        hold(3).await;
        let created = at_prefill(1).await.1["timings"]["created"]
            .as_f64()
            .expect("created timing");
        let url = format!("{decode}/v1/rooms/3/hold");
        let (status, _) = call(&http, Method::DELETE, &url, None).await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        for room in [2, 3] {
            poll_until("an unheld room expired at the prefill", BOUND, || async {
                (at_prefill(room).await.0 == StatusCode::NOT_FOUND).then_some(())
            })
            .await;
        }
        let age = now_ms() - created;
        println!("[{tag}] unheld rooms expired {age:.0} ms after their announcement (ttl 1500 ms)");
        assert!(age >= 1_500.0, "expired before their TTL: {age:.0} ms");
        // Twice the TTL: the held room is still there.
        tokio::time::sleep(Duration::from_secs_f64((3_000.0 - age).max(0.0) / 1e3)).await;
        assert_eq!(
            at_prefill(1).await.0,
            StatusCode::OK,
            "the held room expired"
        );

        // The held room keeps 7 pages, the decode's limit: a new room is accepted, held by
        // the same decode in vain (past its budget), and expires at its TTL.
        ready(&http, &prefill, 4, 100).await;
        let announced = now_ms();
        hold(4).await;
        poll_until("a hold past the decode's budget expired", BOUND, || async {
            (at_prefill(4).await.0 == StatusCode::NOT_FOUND).then_some(())
        })
        .await;
        let age = now_ms() - announced;
        println!("[{tag}] the hold past the budget expired {age:.0} ms after its announcement");
        assert_eq!(
            at_prefill(1).await.0,
            StatusCode::OK,
            "the held room expired"
        );
        // It expired as a room no decode held (a held one would say so, as room 5 below).
        let url = format!("{decode}/v1/rooms/4");
        expect(&http, Method::POST, &url, Some(&body), StatusCode::CREATED).await;
        let v = wait_final(&http, &decode, 4).await;
        assert_eq!(v["reason"]["code"], "unknown_room", "{v}");
        assert!(
            v["reason"]["message"]
                .as_str()
                .is_some_and(|m| !m.contains("held it for a queued request")),
            "{v}"
        );

        // Asked for past its TTL, the held room lands whole.
        let url = format!("{decode}/v1/rooms/1");
        expect(&http, Method::POST, &url, Some(&body), StatusCode::CREATED).await;
        take_verified(&http, &decode, 1).await;

        // Held and never asked for: gone at the maximum, and a late request says so.
        ready(&http, &prefill, 5, 100).await;
        hold(5).await;
        let created = at_prefill(5).await.1["timings"]["created"]
            .as_f64()
            .expect("created timing");
        poll_until("a held room expired at its maximum", BOUND, || async {
            (at_prefill(5).await.0 == StatusCode::NOT_FOUND).then_some(())
        })
        .await;
        let age = now_ms() - created;
        println!("[{tag}] the held room expired {age:.0} ms after its announcement (max 6000 ms)");
        assert!(
            age >= 6_000.0,
            "a held room expired before its maximum: {age:.0} ms"
        );
        let url = format!("{decode}/v1/rooms/5");
        expect(&http, Method::POST, &url, Some(&body), StatusCode::CREATED).await;
        let v = wait_final(&http, &decode, 5).await;
        assert_eq!(v["reason"]["code"], "unknown_room", "{v}");
        assert!(
            v["reason"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("held it for a queued request")),
            "{v}"
        );
    });
    drop(cluster);
}

/// Concurrent pairing with a queue at the prefill: a decode asks for a room whose request still
/// waits in the prefill engine's queue. The prefill engine holds the room
/// (`POST .../hold` at the prefill): neither side's ready timeout fails it (the prefill names
/// it in its heartbeats to that decode), and it lands once announced. An unheld room fails
/// `timeout_ready`.
#[test]
fn a_room_held_by_the_prefill_engine_waits_past_the_ready_timeout() {
    let opts = AgentOpts {
        timeout_ready_ms: 1_000,
        heartbeat_ms: 100,
        ..AgentOpts::default()
    };
    let (cluster, prefill, decode) = start("e2e-held-prefill", &opts);
    runtime().block_on(async {
        let http = http();
        let body = json!({ "tokens": 100 });
        let url = format!("{prefill}/v1/rooms/9/hold");
        expect(
            &http,
            Method::POST,
            &url,
            Some(&json!({})),
            StatusCode::ACCEPTED,
        )
        .await;
        for room in [9, 10] {
            let url = format!("{decode}/v1/rooms/{room}");
            expect(&http, Method::POST, &url, Some(&body), StatusCode::CREATED).await;
        }
        let t = Instant::now();
        let v = wait_final(&http, &decode, 10).await;
        assert_eq!(v["reason"]["code"], "timeout_ready", "{v}");
        // Twice the ready timeout: the held room still waits.
        tokio::time::sleep(Duration::from_millis(2_000).saturating_sub(t.elapsed())).await;
        let url = format!("{decode}/v1/rooms/9");
        let v = expect(&http, Method::GET, &url, None, StatusCode::OK).await;
        assert_eq!(v["state"], "waiting_for_input", "{v}");
        println!(
            "[e2e-held-prefill] the held room waited {:.0} ms (ready timeout 1000 ms)",
            ms(t.elapsed())
        );
        ready(&http, &prefill, 9, 100).await;
        take_verified(&http, &decode, 9).await;
    });
    drop(cluster);
}

/// Abort a room the prefill was never told is ready: it ends `aborted`, safe to reuse, and its
/// agent-owned pages come back at once (the room stays takeable).
#[test]
fn abort_before_ready_ends_aborted_and_pages_return_once_safe() {
    let (cluster, prefill, decode) = start("e2e-abort-early", &AgentOpts::default());
    runtime().block_on(async {
        let http = http();
        let (total, _) = pool(&http, &decode).await;
        let room = 11u64;
        let url = format!("{decode}/v1/rooms/{room}");
        expect(
            &http,
            Method::POST,
            &url,
            Some(&json!({ "tokens": 64 })),
            StatusCode::CREATED,
        )
        .await;
        wait_state(&http, &decode, room, &["waiting_for_input"], BOUND).await;
        assert_eq!(pool(&http, &decode).await, (total, total - 4));
        // Not final yet: take refuses.
        let early = call(&http, Method::POST, &format!("{url}/take"), None).await;
        assert_error("take before final", early, StatusCode::CONFLICT);

        let t = Instant::now();
        let v = expect(&http, Method::DELETE, &url, None, StatusCode::OK).await;
        assert!(
            ["aborting", "aborted"].contains(&v["state"].as_str().unwrap_or("")),
            "{v}"
        );
        let v = wait_final(&http, &decode, room).await;
        println!(
            "[e2e-abort-early] aborted {:.1} ms after DELETE",
            ms(t.elapsed())
        );
        assert_eq!(v["state"], "aborted", "{v}");
        assert_eq!(v["reason"]["code"], "aborted", "{v}");
        assert_eq!(v["safe_to_reuse"], true, "{v}");
        assert_eq!(v["bytes"], 0, "{v}");
        // A second DELETE is harmless.
        let again = expect(&http, Method::DELETE, &url, None, StatusCode::OK).await;
        assert_eq!(again["state"], "aborted");
        // The aborted room is safe to reuse: its agent-owned pages are back without a take.
        assert_eq!(
            pool(&http, &decode).await,
            (total, total),
            "pages return once an aborted room is safe to reuse"
        );

        let taken = expect(
            &http,
            Method::POST,
            &format!("{url}/take"),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(taken["state"], "aborted", "{taken}");
        assert_eq!(
            taken["verified"],
            Value::Null,
            "an aborted room is not verified: {taken}"
        );
        assert_eq!(
            pool(&http, &decode).await,
            (total, total),
            "pages after take"
        );
        assert_error(
            "GET after take",
            call(&http, Method::GET, &url, None).await,
            StatusCode::NOT_FOUND,
        );

        // The prefill heard of the room and knows it was aborted; a late ready is refused.
        let p = wait_final(&http, &prefill, room).await;
        println!("[e2e-abort-early] prefill's view: {}", p["state"]);
        assert_eq!(p["state"], "aborted", "{p}");
        let late = call(
            &http,
            Method::POST,
            &format!("{prefill}/v1/rooms/{room}/ready"),
            Some(&json!({ "tokens": 64 })),
        )
        .await;
        assert_error("ready after abort", late, StatusCode::CONFLICT);
        assert_eq!(
            pool(&http, &prefill).await,
            (total, total),
            "prefill pages after a refused ready"
        );
    });
    drop(cluster);
}

/// Abort a big room (llama3-8b, 4096 tokens = 512 MiB) while it is `transferring` (held there:
/// only its first half is announced): it ends `aborted` with part of its bytes landed, safe to
/// reuse, the prefill stops too, and every page comes back.
#[test]
fn abort_mid_transfer_ends_aborted_and_pages_return() {
    let opts = AgentOpts {
        model: "llama3-8b",
        pool_pages: 272,
        ..AgentOpts::default()
    };
    let (cluster, prefill, decode) = start("e2e-abort-mid", &opts);
    let room_bytes: u64 = 4096 * 32 * 8 * 128 * 2 * 2;
    runtime().block_on(async {
        let http = http();
        let room = 101;
        let url = format!("{decode}/v1/rooms/{room}");
        expect(&http, Method::POST, &url, Some(&json!({ "tokens": 4096 })), StatusCode::CREATED).await;
        ready_piece(&http, &prefill, room, 4096, 0..2048, false).await;
        wait_state(&http, &decode, room, &["transferring"], BOUND).await;
        let t = Instant::now();
        let del = expect(&http, Method::DELETE, &url, None, StatusCode::OK).await;
        let first = wait_final(&http, &decode, room).await;
        let final_in = t.elapsed();
        // Final, maybe while a scatter into the pages still runs. The room may become safe
        // between that read and the take, so what holds at any timing is: take refuses (409)
        // exactly while the room is not safe to reuse, and a take that succeeds answers a room
        // that is safe to reuse.
        let mut early_take = None;
        if first["safe_to_reuse"] != true {
            let (status, body) = call(&http, Method::POST, &format!("{url}/take"), None).await;
            match status {
                StatusCode::CONFLICT => {
                    assert!(body["error"].as_str().is_some_and(|e| e.contains("safe_to_reuse")), "{body}");
                }
                StatusCode::OK => {
                    assert_eq!(body["safe_to_reuse"], true, "a take succeeded on an unsafe room: {body}");
                    early_take = Some(body);
                }
                other => panic!("take while a scatter may run: {other} {body}"),
            }
        }
        let (v, unsafe_for) = match &early_take {
            Some(taken) => (taken.clone(), Duration::ZERO),
            None => wait_safe(&http, &decode, room).await,
        };
        println!(
            "[e2e-abort-mid] DELETE mid-transfer -> {} -> {} in {:.1} ms (safe_to_reuse {:.1} ms later), {} of {room_bytes} bytes landed",
            del["state"],
            v["state"],
            ms(final_in),
            ms(unsafe_for),
            v["bytes"]
        );
        assert_eq!(v["state"], "aborted", "{v}");
        assert_eq!(v["reason"]["code"], "aborted", "{v}");
        assert_eq!(v["safe_to_reuse"], true, "{v}");
        let landed = v["bytes"].as_u64().unwrap_or(0);
        assert!(landed > 0 && landed <= room_bytes / 2, "{v}");
        if early_take.is_none() {
            expect(&http, Method::POST, &format!("{url}/take"), None, StatusCode::OK).await;
        }
        assert_eq!(pool(&http, &decode).await, (272, 272), "decode pages after take");
        let p = wait_final(&http, &prefill, room).await;
        println!("[e2e-abort-mid] prefill {} after sending {} bytes", p["state"], p["bytes"]);
        assert_eq!(p["state"], "aborted", "the prefill of an aborted room: {p}");
        poll_until("prefill pages back", BOUND, || async {
            (pool(&http, &prefill).await == (272, 272)).then_some(())
        })
        .await;
        healthy(&http, &decode).await;
        healthy(&http, &prefill).await;
    });
    drop(cluster);
}

/// Pages the engine names stay the engine's: never taken from or returned to the agent's pool,
/// and the landed bytes still verify.
#[test]
fn engine_owned_pages_are_never_counted_or_freed() {
    let opts = AgentOpts {
        pool_pages: 64,
        ..AgentOpts::default()
    };
    let (cluster, prefill, decode) = start("e2e-engine-pages", &opts);
    runtime().block_on(async {
        let http = http();
        assert_eq!(pool(&http, &decode).await, (64, 64));
        // One agent-owned room first, so the pool is not trivially full.
        let room_a = 21u64;
        expect(
            &http,
            Method::POST,
            &format!("{decode}/v1/rooms/{room_a}"),
            Some(&json!({ "tokens": 48 })),
            StatusCode::CREATED,
        )
        .await;
        let before = pool(&http, &decode).await;
        assert_eq!(before, (64, 61));

        // Pages out of order, spread over the pool (none of room A's 0..3).
        let room = 22u64;
        let pages = json!([63, 5, 40, 10, 17, 33, 62]);
        let body = json!({ "tokens": 100, "pages": pages });
        let url = format!("{decode}/v1/rooms/{room}");
        let v = expect(&http, Method::POST, &url, Some(&body), StatusCode::CREATED).await;
        assert_eq!(v["page_owner"], "engine", "{v}");
        assert_eq!(v["pages"], pages, "{v}");
        assert_eq!(
            pool(&http, &decode).await,
            before,
            "engine pages are not counted"
        );
        expect(
            &http,
            Method::POST,
            &format!("{prefill}/v1/rooms/{room}/ready"),
            Some(&json!({ "tokens": 100 })),
            StatusCode::ACCEPTED,
        )
        .await;
        let v = wait_final(&http, &decode, room).await;
        assert_eq!(v["state"], "success", "{v}");
        assert_eq!(v["safe_to_reuse"], true, "{v}");
        assert_eq!(v["bytes"].as_u64(), Some(100 * TINY_BYTES_PER_TOKEN));
        assert_eq!(pool(&http, &decode).await, before);
        let taken = expect(
            &http,
            Method::POST,
            &format!("{url}/take"),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(taken["verified"], true, "{taken}");
        assert_eq!(taken["page_owner"], "engine");
        assert_eq!(
            pool(&http, &decode).await,
            before,
            "take frees no engine page"
        );

        // An aborted engine-owned room frees nothing either.
        let room_c = 23u64;
        let url_c = format!("{decode}/v1/rooms/{room_c}");
        expect(
            &http,
            Method::POST,
            &url_c,
            Some(&json!({ "tokens": 16, "pages": [9] })),
            StatusCode::CREATED,
        )
        .await;
        wait_state(&http, &decode, room_c, &["waiting_for_input"], BOUND).await;
        expect(&http, Method::DELETE, &url_c, None, StatusCode::OK).await;
        let v = wait_final(&http, &decode, room_c).await;
        assert_eq!(
            (v["state"].as_str(), v["safe_to_reuse"].as_bool()),
            (Some("aborted"), Some(true)),
            "{v}"
        );
        expect(
            &http,
            Method::POST,
            &format!("{url_c}/take"),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(
            pool(&http, &decode).await,
            before,
            "an aborted engine room frees nothing"
        );

        // The agent's own room still returns its pages.
        expect(
            &http,
            Method::DELETE,
            &format!("{decode}/v1/rooms/{room_a}"),
            None,
            StatusCode::OK,
        )
        .await;
        wait_final(&http, &decode, room_a).await;
        expect(
            &http,
            Method::POST,
            &format!("{decode}/v1/rooms/{room_a}/take"),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(pool(&http, &decode).await, (64, 64));
    });
    drop(cluster);
}

/// Asks the decode at `api` for a 32-token room and waits for its final state.
async fn room_to_its_end(http: &reqwest::Client, api: &str, room: u64) -> Value {
    let url = format!("{api}/v1/rooms/{room}");
    expect(
        http,
        Method::POST,
        &url,
        Some(&json!({ "tokens": 32 })),
        StatusCode::CREATED,
    )
    .await;
    wait_final(http, api, room).await
}

/// A prefill whose advertised control endpoint nobody listens on: the room fails with
/// `unreachable`, naming the address, within the connect timeout (not a silent hang).
#[test]
fn unreachable_prefill_endpoint_fails_the_room_with_its_address() {
    let port = closed_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (registry, decode, api) = decode_with_fake_prefill("e2e-unreachable", &endpoint);

    runtime().block_on(async {
        let http = http();
        let (total, _) = pool(&http, &api).await;

        let t = Instant::now();
        let room = 31u64;
        let v = room_to_its_end(&http, &api, room).await;
        let took = t.elapsed();
        println!(
            "[e2e-unreachable] failed after {:.0} ms (connect timeout 1000 ms): {}",
            ms(took),
            v["reason"]
        );
        assert_eq!(v["state"], "failed", "{v}");
        assert_eq!(v["reason"]["code"], "unreachable", "{v}");
        let message = v["reason"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("127.0.0.1:{port}")),
            "the message names the address: {message}"
        );
        assert_eq!(v["safe_to_reuse"], true, "{v}");
        assert!(took < BOUND, "took {took:?}");

        // Taking the failed room returns its pages; the agent keeps serving.
        let taken = expect(
            &http,
            Method::POST,
            &format!("{api}/v1/rooms/{room}/take"),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(taken["state"], "failed");
        assert_eq!(pool(&http, &api).await, (total, total));
        let failures = metric(
            &http,
            &api,
            "kvferry_room_failures_total{role=\"decode\",code=\"unreachable\"}",
        )
        .await;
        assert_eq!(failures, Some(1.0));
        healthy(&http, &api).await;
    });
    drop(decode);
    drop(registry);
}

/// A prefill's heartbeat may reach a decode before the answer to its Hello (the prefill files
/// the connection's peer, which its heartbeat timer serves, before answering). A fake prefill
/// answers Hello with a heartbeat, then refuses it: the room fails with the refusal's code and
/// message, not with "answered Hello with heartbeat" (seen once in CI, e2e_garbage).
#[test]
fn a_heartbeat_before_the_hello_answer_is_skipped() {
    let rt = runtime();
    use kvferry::transport::zmq::{Auth, ControlEvent, ControlServer, control::ControlOptions};
    let options = ControlOptions {
        max_frame: kvferry::protocol::MAX_FRAME,
        auth: Auth::default(),
        proof: None,
    };
    let (endpoint, mut server, replier) = rt
        .block_on(ControlServer::bind("127.0.0.1", 0, &options))
        .expect("fake prefill control socket");
    let fake = rt.spawn(async move {
        let Some(ControlEvent::Frame(peer, frame)) = server.recv().await else {
            panic!("no Hello from the decode");
        };
        assert!(
            matches!(Message::decode(&frame), Ok(Message::Hello(_))),
            "not a Hello"
        );
        let beat = Message::Heartbeat(Heartbeat {
            instance: uuid::Uuid::nil(),
            seq: 1,
            rooms: vec![],
        });
        let refusal = Message::Error(ErrorMsg {
            room: None,
            code: FailureCode::IncompatibleLayout,
            message: "fake prefill: refused after a heartbeat".to_owned(),
        });
        for m in [beat, refusal] {
            replier
                .send(&peer, m.encode().into())
                .await
                .expect("answer");
        }
        // Keep the socket open until the test ends.
        std::future::pending::<()>().await;
    });
    let (registry, decode, api) = decode_with_fake_prefill("e2e-hello-heartbeat", &endpoint);
    rt.block_on(async {
        let http = http();
        let v = room_to_its_end(&http, &api, 41).await;
        println!("[e2e-hello-heartbeat] {}", v["reason"]);
        assert_eq!(v["state"], "failed", "{v}");
        assert_eq!(v["reason"]["code"], "incompatible_layout", "{v}");
        let message = v["reason"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("refused after a heartbeat"), "{message}");
        healthy(&http, &api).await;
    });
    fake.abort();
    drop(decode);
    drop(registry);
}

/// Bad input to both agents' HTTP APIs: JSON 4xx errors, nothing changes, the agent serves on.
#[test]
fn bad_http_input_is_refused_and_changes_nothing() {
    let opts = AgentOpts {
        pool_pages: 64,
        ..AgentOpts::default()
    };
    let (cluster, prefill, decode) = start("e2e-bad-input", &opts);
    runtime().block_on(async {
        let http = http();
        // A live room with engine pages, so duplicates conflict and the pool stays full.
        let live = 1u64;
        let live_url = format!("{decode}/v1/rooms/{live}");
        expect(
            &http,
            Method::POST,
            &live_url,
            Some(&json!({ "tokens": 16, "pages": [0] })),
            StatusCode::CREATED,
        )
        .await;
        let baseline = pool(&http, &decode).await;
        assert_eq!(baseline, (64, 64));

        let d = |path: &str| format!("{decode}{path}");
        let unknown = d("/v1/rooms/999");
        let room = d("/v1/rooms/2");
        let j = |v: Value| Some(v);
        let cases: Vec<(
            &str,
            Method,
            String,
            Option<Value>,
            Option<&str>,
            StatusCode,
        )> = vec![
            (
                "GET unknown room",
                Method::GET,
                unknown.clone(),
                None,
                None,
                StatusCode::NOT_FOUND,
            ),
            (
                "GET unknown room with wait",
                Method::GET,
                format!("{unknown}?wait_ms=10"),
                None,
                None,
                StatusCode::NOT_FOUND,
            ),
            (
                "take unknown room",
                Method::POST,
                format!("{unknown}/take"),
                None,
                None,
                StatusCode::NOT_FOUND,
            ),
            (
                "DELETE unknown room",
                Method::DELETE,
                unknown.clone(),
                None,
                None,
                StatusCode::NOT_FOUND,
            ),
            (
                "duplicate room",
                Method::POST,
                live_url.clone(),
                j(json!({ "tokens": 16 })),
                None,
                StatusCode::CONFLICT,
            ),
            (
                "duplicate room, engine pages",
                Method::POST,
                live_url.clone(),
                j(json!({ "tokens": 16, "pages": [1] })),
                None,
                StatusCode::CONFLICT,
            ),
            (
                "take a room not final",
                Method::POST,
                format!("{live_url}/take"),
                None,
                None,
                StatusCode::CONFLICT,
            ),
            (
                "page out of range",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 16, "pages": [64] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "page far out of range",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 16, "pages": [4294967295u32] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "duplicate pages",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 32, "pages": [3, 3] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "too few pages",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 33, "pages": [1, 2] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "empty page list",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 1, "pages": [] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "negative page",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 16, "pages": [-1] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "tokens 0",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 0 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "tokens 0 with pages",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 0, "pages": [] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "tokens missing",
                Method::POST,
                room.clone(),
                j(json!({})),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "tokens a string",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": "16" })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "tokens negative",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": -5 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "more tokens than the whole pool (can never fit)",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 64 * 16 + 1 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "unknown field",
                Method::POST,
                room.clone(),
                j(json!({ "tokens": 16, "bogus": 1 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "malformed JSON",
                Method::POST,
                room.clone(),
                None,
                Some("{\"tokens\": 16"),
                StatusCode::BAD_REQUEST,
            ),
            (
                "not JSON at all",
                Method::POST,
                room.clone(),
                None,
                Some("tokens=16"),
                StatusCode::BAD_REQUEST,
            ),
            (
                "JSON array body",
                Method::POST,
                room.clone(),
                None,
                Some("[16]"),
                StatusCode::BAD_REQUEST,
            ),
            (
                "non-numeric room (create)",
                Method::POST,
                d("/v1/rooms/abc"),
                j(json!({ "tokens": 16 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "non-numeric room (GET)",
                Method::GET,
                d("/v1/rooms/abc"),
                None,
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "non-numeric room (take)",
                Method::POST,
                d("/v1/rooms/abc/take"),
                None,
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "non-numeric room (DELETE)",
                Method::DELETE,
                d("/v1/rooms/abc"),
                None,
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "negative room",
                Method::POST,
                d("/v1/rooms/-1"),
                j(json!({ "tokens": 16 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "room beyond u64",
                Method::POST,
                d("/v1/rooms/18446744073709551616"),
                j(json!({ "tokens": 16 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "fractional room",
                Method::GET,
                d("/v1/rooms/1.5"),
                None,
                None,
                StatusCode::BAD_REQUEST,
            ),
        ];
        for (what, method, url, body, raw, want) in cases {
            let got = match raw {
                Some(raw) => call_raw(&http, method, &url, raw).await,
                None => call(&http, method, &url, body.as_ref()).await,
            };
            assert_error(&format!("decode: {what}"), got, want);
            assert_eq!(
                pool(&http, &decode).await,
                baseline,
                "decode pool changed after: {what}"
            );
            healthy(&http, &decode).await;
        }
        // None of the refused creates left a room behind.
        let got = call(&http, Method::GET, &room, None).await;
        assert_error("room 2 was never created", got, StatusCode::NOT_FOUND);
        // The live room is untouched.
        let v = expect(&http, Method::GET, &live_url, None, StatusCode::OK).await;
        assert_eq!(
            (v["pages"].clone(), v["tokens"].clone()),
            (json!([0]), json!(16)),
            "{v}"
        );

        // Prefill.
        let p = |path: &str| format!("{prefill}{path}");
        let ready = p("/v1/rooms/3/ready");
        // A room whose ready was accepted, for the duplicate.
        expect(
            &http,
            Method::POST,
            &p("/v1/rooms/4/ready"),
            Some(&json!({ "tokens": 16 })),
            StatusCode::ACCEPTED,
        )
        .await;
        let p_baseline = pool(&http, &prefill).await;
        assert_eq!(p_baseline, (64, 63));
        let cases: Vec<(
            &str,
            Method,
            String,
            Option<Value>,
            Option<&str>,
            StatusCode,
        )> = vec![
            (
                "GET unknown room",
                Method::GET,
                p("/v1/rooms/999"),
                None,
                None,
                StatusCode::NOT_FOUND,
            ),
            (
                "GET unknown room with wait",
                Method::GET,
                p("/v1/rooms/999?wait_ms=10"),
                None,
                None,
                StatusCode::NOT_FOUND,
            ),
            (
                "duplicate ready",
                Method::POST,
                p("/v1/rooms/4/ready"),
                j(json!({ "tokens": 16 })),
                None,
                StatusCode::CONFLICT,
            ),
            (
                "tokens 0",
                Method::POST,
                ready.clone(),
                j(json!({ "tokens": 0 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "page out of range",
                Method::POST,
                ready.clone(),
                j(json!({ "tokens": 16, "pages": [64] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "duplicate pages",
                Method::POST,
                ready.clone(),
                j(json!({ "tokens": 32, "pages": [7, 7] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "too few pages",
                Method::POST,
                ready.clone(),
                j(json!({ "tokens": 33, "pages": [1, 2] })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "aux not base64",
                Method::POST,
                ready.clone(),
                j(json!({ "tokens": 16, "aux": "!!not base64!!" })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "unknown field",
                Method::POST,
                ready.clone(),
                j(json!({ "tokens": 16, "bogus": true })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "tokens missing",
                Method::POST,
                ready.clone(),
                j(json!({})),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "malformed JSON",
                Method::POST,
                ready.clone(),
                None,
                Some("{\"tokens\":"),
                StatusCode::BAD_REQUEST,
            ),
            (
                "JSON array body",
                Method::POST,
                ready.clone(),
                None,
                Some("[16]"),
                StatusCode::BAD_REQUEST,
            ),
            (
                "non-numeric room (ready)",
                Method::POST,
                p("/v1/rooms/abc/ready"),
                j(json!({ "tokens": 16 })),
                None,
                StatusCode::BAD_REQUEST,
            ),
            (
                "non-numeric room (GET)",
                Method::GET,
                p("/v1/rooms/abc"),
                None,
                None,
                StatusCode::BAD_REQUEST,
            ),
        ];
        for (what, method, url, body, raw, want) in cases {
            let got = match raw {
                Some(raw) => call_raw(&http, method, &url, raw).await,
                None => call(&http, method, &url, body.as_ref()).await,
            };
            assert_error(&format!("prefill: {what}"), got, want);
            assert_eq!(
                pool(&http, &prefill).await,
                p_baseline,
                "prefill pool changed after: {what}"
            );
            assert_eq!(
                pool(&http, &decode).await,
                baseline,
                "decode pool changed after prefill: {what}"
            );
            healthy(&http, &prefill).await;
        }
        let got = call(&http, Method::GET, &p("/v1/rooms/3"), None).await;
        assert_error(
            "prefill room 3 was never created",
            got,
            StatusCode::NOT_FOUND,
        );

        // Rooms beyond 2^53 keep every digit: strings in JSON, u64 in paths.
        let big = u64::MAX;
        let v = expect(
            &http,
            Method::POST,
            &d(&format!("/v1/rooms/{big}")),
            Some(&json!({ "tokens": 16, "pages": [5] })),
            StatusCode::CREATED,
        )
        .await;
        assert_eq!(v["room"], big.to_string(), "{v}");
        expect(
            &http,
            Method::POST,
            &p(&format!("/v1/rooms/{big}/ready")),
            Some(&json!({ "tokens": 16 })),
            StatusCode::ACCEPTED,
        )
        .await;
        let v = wait_final(&http, &decode, big).await;
        assert_eq!(
            (v["room"].as_str(), v["state"].as_str()),
            (Some("18446744073709551615"), Some("success")),
            "{v}"
        );
        let taken = expect(
            &http,
            Method::POST,
            &d(&format!("/v1/rooms/{big}/take")),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(taken["verified"], true, "{taken}");
        assert_eq!(pool(&http, &decode).await, baseline);
        healthy(&http, &decode).await;
        healthy(&http, &prefill).await;
    });
    drop(cluster);
}
