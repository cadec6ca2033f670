//! Streaming and flow control across real processes (release binary, `tiny` preset, every
//! timeout explicit): rooms announced in token chunks, layer ranges and mixes; prefix offsets;
//! aux payloads; many rooms through a staging budget smaller than one room; a killed prefill
//! (`peer_dead`), a restarted prefill, a restarted registry, and a wrong token.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{
    AgentOpts, BOUND, call, expect, http, http_with_token, metric, ms, pool, runtime, wait_final,
};
use kvferry::cluster::{Apis, LocalCluster, drive_rooms};
use kvferry::cluster::{Process, log_dir};
use kvferry::layout::{KvLayout, ModelSpec};
use reqwest::{Client, Method, StatusCode};
use serde_json::{Value, json};

/// Agent flags for these tests: fast heartbeats, a peer dead after one silent second.
fn args(extra: &[&str]) -> Vec<String> {
    let opts = AgentOpts {
        heartbeat_ms: 100,
        peer_dead_ms: 1000,
        ..AgentOpts::default()
    };
    let mut v = opts.args();
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

fn tiny_bytes(tokens: usize) -> u64 {
    let l = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    l.room_bytes(tokens).unwrap() as u64
}

async fn ready(http: &Client, prefill: &str, room: u64, body: Value) -> (StatusCode, Value) {
    call(
        http,
        Method::POST,
        &format!("{prefill}/v1/rooms/{room}/ready"),
        Some(&body),
    )
    .await
}

async fn request(http: &Client, decode: &str, room: u64, body: Value) -> Value {
    let url = format!("{decode}/v1/rooms/{room}");
    expect(http, Method::POST, &url, Some(&body), StatusCode::CREATED).await
}

async fn take(http: &Client, decode: &str, room: u64) -> Value {
    let url = format!("{decode}/v1/rooms/{room}/take");
    expect(http, Method::POST, &url, None, StatusCode::OK).await
}

/// Requests a room at the decode, announces it in `pieces` at the prefill, and checks that it
/// lands intact with exactly the room's bytes.
async fn pieces_land(http: &Client, c: &LocalCluster, room: u64, tokens: usize, pieces: &[Value]) {
    let (p, d) = (
        c.prefill().field("api").unwrap(),
        c.decode().field("api").unwrap(),
    );
    request(http, &d, room, json!({ "tokens": tokens })).await;
    for (i, piece) in pieces.iter().enumerate() {
        let mut body = piece.clone();
        body["tokens"] = json!(tokens);
        let (status, v) = ready(http, &p, room, body).await;
        assert_eq!(status, StatusCode::ACCEPTED, "piece {i} {piece}: {v}");
        if i + 1 < pieces.len() {
            // Not done before the last piece is in.
            let view = expect(
                http,
                Method::GET,
                &format!("{d}/v1/rooms/{room}"),
                None,
                StatusCode::OK,
            )
            .await;
            assert_ne!(
                view["state"],
                "success",
                "room {room} succeeded after piece {i} of {}",
                pieces.len()
            );
        }
    }
    let view = wait_final(http, &d, room).await;
    assert_eq!(view["state"], "success", "{view}");
    let taken = take(http, &d, room).await;
    assert_eq!(taken["verified"], true, "{taken}");
    assert_eq!(taken["bytes"].as_u64(), Some(tiny_bytes(tokens)), "{taken}");
}

#[test]
fn rooms_arrive_in_token_chunks_layer_ranges_and_mixes() {
    let c = LocalCluster::start(&common::release_binary(), "stream-pieces", &args(&[])).unwrap();
    let http = http();
    runtime().block_on(async {
        let chunks = [
            json!({"token_range": [0, 16]}),
            json!({"token_range": [16, 40]}),
            json!({"token_range": [40, 48], "last": true}),
        ];
        pieces_land(&http, &c, 1, 48, &chunks).await;
        let layers = [
            json!({"layer_range": [0, 1]}),
            json!({"layer_range": [1, 2]}),
            json!({"layer_range": [2, 3]}),
            json!({"layer_range": [3, 4], "last": true}),
        ];
        pieces_land(&http, &c, 2, 40, &layers).await;
        let mix = [
            json!({"token_range": [0, 32], "layer_range": [0, 2]}),
            json!({"token_range": [0, 50], "layer_range": [2, 4]}),
            json!({"token_range": [32, 50], "layer_range": [0, 2], "last": true}),
        ];
        pieces_land(&http, &c, 3, 50, &mix).await;

        // Pieces that arrive twice or overlap are refused, and the room still lands.
        let p = c.prefill().field("api").unwrap();
        let d = c.decode().field("api").unwrap();
        request(&http, &d, 4, json!({"tokens": 32})).await;
        let first = json!({"tokens": 32, "token_range": [0, 16]});
        assert_eq!(
            ready(&http, &p, 4, first.clone()).await.0,
            StatusCode::ACCEPTED
        );
        let (status, v) = ready(&http, &p, 4, first).await;
        assert_eq!(status, StatusCode::CONFLICT, "a piece twice: {v}");
        let (status, v) = ready(&http, &p, 4, json!({"tokens": 32, "token_range": [8, 24]})).await;
        assert_eq!(status, StatusCode::CONFLICT, "an overlapping piece: {v}");
        println!("refused: {}", v["error"]);
        let (status, v) = ready(&http, &p, 4, json!({"tokens": 32, "token_range": [16, 40]})).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "a piece beyond the room: {v}"
        );
        let last = json!({"tokens": 32, "token_range": [16, 32], "last": true});
        assert_eq!(ready(&http, &p, 4, last).await.0, StatusCode::ACCEPTED);
        assert_eq!(wait_final(&http, &d, 4).await["state"], "success");
        assert_eq!(take(&http, &d, 4).await["verified"], true);
    });
}

#[test]
fn prefix_offsets_move_only_the_suffix_and_aux_arrives_intact() {
    let c = LocalCluster::start(&common::release_binary(), "stream-prefix", &args(&[])).unwrap();
    let http = http();
    runtime().block_on(async {
        let (p, d) = (
            c.prefill().field("api").unwrap(),
            c.decode().field("api").unwrap(),
        );
        let aux: Vec<u8> = (0..=255u8).rev().collect();
        let aux64 = base64::engine::general_purpose::STANDARD.encode(&aux);
        request(&http, &d, 7, json!({"tokens": 100, "start_token": 37})).await;
        let (status, v) = ready(&http, &p, 7, json!({"tokens": 100, "aux": aux64})).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{v}");
        assert_eq!(wait_final(&http, &d, 7).await["state"], "success");
        let taken = take(&http, &d, 7).await;
        let suffix = tiny_bytes(100 - 37);
        assert_eq!(
            taken["bytes"].as_u64(),
            Some(suffix),
            "only the suffix lands: {taken}"
        );
        assert_eq!(taken["verified"], true, "{taken}");
        assert_eq!(
            taken["aux"].as_str(),
            Some(aux64.as_str()),
            "aux arrives intact"
        );
        let sent = expect(
            &http,
            Method::GET,
            &format!("{p}/v1/rooms/7"),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(
            sent["bytes"].as_u64(),
            Some(suffix),
            "only the suffix is sent: {sent}"
        );
        let counted = metric(
            &http,
            &d,
            "kvferry_kv_bytes_total{role=\"decode\",direction=\"received\"}",
        )
        .await;
        assert_eq!(counted, Some(suffix as f64));
        let counted = metric(
            &http,
            &p,
            "kvferry_kv_bytes_total{role=\"prefill\",direction=\"sent\"}",
        )
        .await;
        assert_eq!(counted, Some(suffix as f64));
        println!(
            "prefix 37 of 100 tokens: {suffix} bytes moved of {}",
            tiny_bytes(100)
        );
    });
}

#[test]
fn eight_rooms_fit_a_staging_budget_smaller_than_one_room() {
    // 2 slots of 4 KiB per peer pair; each room is 256 tokens = 512 KiB.
    let budget = ["--staging-slots", "2", "--chunk-bytes", "4096"];
    let c =
        LocalCluster::start(&common::release_binary(), "stream-budget", &args(&budget)).unwrap();
    assert!(tiny_bytes(256) > 2 * 4096);
    let (p, d) = (
        c.prefill().field("api").unwrap(),
        c.decode().field("api").unwrap(),
    );
    let started = Instant::now();
    let rooms: Vec<(u64, usize)> = (1..=8).map(|r| (r, 256)).collect();
    let results = runtime()
        .block_on(drive_rooms(&Apis::pair(&p, &d), rooms, 8))
        .unwrap();
    println!(
        "8 rooms of {} bytes through 8 KiB of staging in {:.0} ms",
        tiny_bytes(256),
        ms(started.elapsed())
    );
    for r in &results {
        assert!(r.verified, "room {} {} {:?}", r.room, r.state, r.code);
        assert_eq!(r.bytes, tiny_bytes(256));
    }
}

#[test]
fn a_killed_prefill_fails_its_rooms_and_a_restarted_one_serves_new_rooms() {
    let exe = common::release_binary();
    let c = LocalCluster::start(&exe, "stream-kill", &args(&[])).unwrap();
    let http = http();
    let d = c.decode().field("api").unwrap();
    let registry = c.registry.field("url").unwrap();
    runtime().block_on(async {
        // Rooms the prefill was asked for but never told are ready.
        for room in 1..=3 {
            request(&http, &d, room, json!({"tokens": 32})).await;
            common::wait_state(&http, &d, room, &["waiting_for_input"], BOUND).await;
        }
        let (total, _) = pool(&http, &d).await;
        c.prefill().signal("KILL").unwrap();
        let killed = Instant::now();
        for room in 1..=3 {
            let v = wait_final(&http, &d, room).await;
            assert_eq!(v["state"], "failed", "{v}");
            assert_eq!(v["reason"]["code"], "peer_dead", "{v}");
            assert_eq!(v["safe_to_reuse"], true, "{v}");
            take(&http, &d, room).await;
        }
        let detected = killed.elapsed();
        println!(
            "kill -9 of the prefill -> peer_dead on 3 rooms in {:.0} ms",
            ms(detected)
        );
        assert!(detected < BOUND);
        assert_eq!(
            pool(&http, &d).await,
            (total, total),
            "the failed rooms' pages returned"
        );
    });

    // A new prefill registers under a new instance; new rooms go to it.
    let mut prefill_args = vec!["prefill".to_owned(), "--bootstrap".to_owned(), registry];
    prefill_args.extend(args(&[]));
    let logs = log_dir("stream-restart").unwrap();
    let restarted = Process::spawn(&exe, "prefill2", &prefill_args, &logs, BOUND).unwrap();
    let p = restarted.field("api").unwrap();
    let rooms: Vec<(u64, usize)> = (10..15).map(|r| (r, 40)).collect();
    let results = runtime()
        .block_on(drive_rooms(&Apis::pair(&p, &d), rooms, 5))
        .unwrap();
    assert!(results.iter().all(|r| r.verified), "{results:?}");
    println!("after the restart: {} rooms verified", results.len());
}

fn spawn_registry(exe: &Path, logs: &Path, name: &str, port: u16) -> Process {
    let args: Vec<String> = [
        "bootstrap",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--lease-ttl-ms",
        "1500",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    Process::spawn(exe, name, &args, logs, BOUND).unwrap()
}

#[test]
fn agents_register_again_after_a_registry_restart() {
    let exe = common::release_binary();
    let logs = log_dir("stream-registry").unwrap();
    let mut registry = spawn_registry(&exe, &logs, "registry", 0);
    let url = registry.field("url").unwrap();
    let port: u16 = url.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap();
    let agent = |role: &str| {
        let mut a = vec![role.to_owned(), "--bootstrap".to_owned(), url.clone()];
        a.extend(args(&[]));
        Process::spawn(&exe, role, &a, &logs, BOUND).unwrap()
    };
    let prefill = agent("prefill");
    let decode = agent("decode");
    registry.stop(Duration::from_secs(5));
    let _registry = spawn_registry(&exe, &logs, "registry2", port);
    let restarted = Instant::now();
    let http = http();
    runtime().block_on(async {
        let listed = common::poll_until("both agents registered again", BOUND, || async {
            let (_, v) = call(&http, Method::GET, &format!("{url}/v1/ranks"), None).await;
            (v["ranks"].as_array().map_or(0, Vec::len) == 2).then_some(v)
        })
        .await;
        println!(
            "re-registered {:.0} ms after the registry restart: {listed}",
            ms(restarted.elapsed())
        );
        let rooms = vec![(1, 20), (2, 33)];
        let (p, d) = (prefill.field("api").unwrap(), decode.field("api").unwrap());
        let results = drive_rooms(&Apis::pair(&p, &d), rooms, 2).await.unwrap();
        assert!(results.iter().all(|r| r.verified), "{results:?}");
    });
}

#[test]
fn a_hello_with_the_wrong_token_is_refused() {
    let exe = common::release_binary();
    let logs = log_dir("stream-token").unwrap();
    let registry = spawn_registry(&exe, &logs, "registry", 0);
    let url = registry.field("url").unwrap();
    let agent = |role: &str, token: &str| {
        let mut a = vec![
            role.to_owned(),
            "--bootstrap".to_owned(),
            url.clone(),
            "--token".to_owned(),
            token.to_owned(),
        ];
        a.extend(args(&[]));
        Process::spawn(&exe, role, &a, &logs, BOUND).unwrap()
    };
    let _prefill = agent("prefill", "right");
    let decode = agent("decode", "wrong");
    // The decode's own API takes its own token.
    let http = http_with_token("wrong");
    runtime().block_on(async {
        let d = decode.field("api").unwrap();
        request(&http, &d, 1, json!({"tokens": 16})).await;
        let v = wait_final(&http, &d, 1).await;
        assert_eq!(v["state"], "failed", "{v}");
        assert_eq!(v["reason"]["code"], "unauthorized", "{v}");
        println!("refused: {}", v["reason"]["message"]);
    });
}
