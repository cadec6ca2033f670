//! `zmq-ipc`'s one-sided writes through the decode's pool file mapped into the prefill
//! (`transport/mapped.rs`), across real processes (release binary):
//! - 1P1D, TP2 -> TP1 and TP1 -> TP2 (1 KiB head slices; the prefill writes both decode
//!   ranks' halves of a chunk in one pass when their writes meet), 100 rooms each with
//!   checksums, every byte verified, every chunk direct; with `--direct-writes never` every
//!   chunk staged;
//! - a corrupted direct chunk fails the room, and its pages stay unsafe to reuse until the
//!   writing prefill has stopped;
//! - a prefill killed mid-room fails it with `peer_dead`; the pages become safe to reuse only
//!   after `--peer-dead-ms`, since a mapped writer's death cannot be told from a pause.

use crate::common;

use std::time::{Duration, Instant};

use common::{
    AgentOpts, BOUND, decode_chunks, drive_verified, expect, http, metric, ready, ready_piece,
    request, runtime, set_flag, wait_final, wait_safe, wait_state,
};
use kvferry::cluster::{LocalCluster, Shape, drive_rooms};
use reqwest::{Method, StatusCode};
use serde_json::json;

fn opts(model: &'static str, pool_pages: usize, peer_dead_ms: u64) -> Vec<String> {
    AgentOpts {
        model,
        pool_pages,
        transport: "zmq-ipc",
        heartbeat_ms: 100,
        peer_dead_ms,
        ..AgentOpts::default()
    }
    .args()
}

#[test]
fn hundred_rooms_1p1d_and_heterogeneous_tp_land_by_mapped_writes_or_staged_when_told() {
    let exe = common::release_binary();
    for (label, prefill, decode, writes) in [
        ("1p1d", Shape::ONE, Shape::ONE, "auto"),
        ("tp2-tp1", Shape::tp(2), Shape::ONE, "auto"),
        ("tp1-tp2", Shape::ONE, Shape::tp(2), "auto"),
        ("1p1d-never", Shape::ONE, Shape::ONE, "never"),
    ] {
        let tag = format!("mapped-{label}");
        let mut args = opts("tiny", 512, 2000);
        set_flag(&mut args, "--direct-writes", writes);
        args.push("--checksum".to_owned());
        let c = LocalCluster::start_shaped(&exe, &tag, &args, prefill, decode)
            .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
        let apis = c.apis().unwrap();
        // Mixed lengths: partial last pages, one-page and many-page rooms.
        let rooms: Vec<(u64, usize)> = (1..=100)
            .map(|r| (r, 1 + (r as usize * 97) % 500))
            .collect();
        let elapsed = drive_verified(&tag, &c, rooms, 8);
        for d in &apis.decode[0] {
            let (direct, staged) = (
                decode_chunks(&tag, d, "direct"),
                decode_chunks(&tag, d, "staged"),
            );
            println!(
                "{tag}: {d}: 100 rooms verified in {:.0} ms; chunks direct {direct}, staged {staged}",
                elapsed.as_secs_f64() * 1e3
            );
            match writes {
                "never" => assert!(direct == 0.0 && staged >= 100.0, "{tag}: {direct} direct"),
                _ => assert!(direct >= 100.0 && staged == 0.0, "{tag}: {staged} staged"),
            }
        }
        // TP1 -> TP2: the prefill writes the two ranks' halves of a chunk in one pass when
        // their writes meet (within 10 ms of each other: not asserted, timing decides).
        let p = c.prefill().field("api").unwrap();
        let series = "kvferry_chunks_total{role=\"prefill\",path=\"one_pass\"}";
        let one_pass = runtime().block_on(metric(&http(), &p, series));
        println!("{tag}: prefill wrote {one_pass:?} chunks in one pass with another rank's");
        if label != "tp1-tp2" {
            assert_eq!(one_pass, Some(0.0), "{tag}: one decode rank per room");
        }
    }
}

/// A room of llama3-8b (512 MiB) with checksums, and the prefill set to corrupt the checksum of
/// its chunk `corrupt` (or nothing): its layers announced 50 ms apart, or with `hold` only its
/// first half announced, so that it stays `transferring`. The cluster and the APIs of its
/// prefill and decode.
fn one_slow_room(
    tag: &str,
    peer_dead_ms: u64,
    corrupt: Option<&str>,
    hold: bool,
) -> (LocalCluster, String, String) {
    let mut args = opts("llama3-8b", 272, peer_dead_ms);
    args.extend(["--checksum", "--synthetic-layer-ms", "50"].map(String::from));
    if let Some(n) = corrupt {
        args.extend(["--fault-corrupt-chunk".to_owned(), n.to_owned()]);
    }
    let c = LocalCluster::start(&common::release_binary(), tag, &args)
        .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
    let (p, d) = (
        c.prefill().field("api").unwrap(),
        c.decode().field("api").unwrap(),
    );
    runtime().block_on(async {
        let http = http();
        request(&http, &d, 1, json!({"tokens": 4096})).await;
        match hold {
            // Held mid-transfer: the rest is never announced.
            true => ready_piece(&http, &p, 1, 4096, 0..2048, false).await,
            false => ready(&http, &p, 1, 4096).await,
        };
    });
    (c, p, d)
}

#[test]
fn a_corrupted_mapped_chunk_fails_the_room_and_its_pages_wait_for_the_writer_to_stop() {
    let tag = "mapped-checksum";
    let (_c, p, d) = one_slow_room(tag, 2000, Some("2"), false);
    runtime().block_on(async {
        let http = http();
        let v = wait_final(&http, &d, 1).await;
        assert_eq!(v["state"], "failed", "{tag}: {v}");
        assert_eq!(v["reason"]["code"], "checksum", "{tag}: {v}");
        let failed_seen = Instant::now();
        let (v, _) = wait_safe(&http, &d, 1).await;
        // The prefill was told to stop; the pages were safe only once it had (its AbortAck).
        let sent = wait_final(&http, &p, 1).await;
        assert_eq!(sent["state"], "aborted", "{tag}: prefill {sent}");
        let direct = metric(&http, &d, r#"kvferry_chunks_total{role="decode",path="direct"}"#).await;
        assert!(direct.is_some_and(|n| n >= 1.0), "{tag}: {direct:?} direct chunks");
        println!(
            "{tag}: failed `checksum` after {} bytes; safe {:.0} ms later, once the prefill stopped",
            v["bytes"],
            failed_seen.elapsed().as_secs_f64() * 1e3
        );
    });
}

#[test]
fn a_mapped_writer_killed_mid_room_fails_it_and_its_pages_wait_out_peer_dead() {
    let tag = "mapped-kill";
    let peer_dead = Duration::from_millis(1500);
    let (c, _p, d) = one_slow_room(tag, peer_dead.as_millis() as u64, None, true);
    runtime().block_on(async {
        let http = http();
        wait_state(&http, &d, 1, &["transferring"], BOUND).await;
        c.prefill().signal("KILL").unwrap();
        let killed = Instant::now();
        let v = wait_final(&http, &d, 1).await;
        assert_eq!(v["state"], "failed", "{tag}: {v}");
        assert_eq!(v["reason"]["code"], "peer_dead", "{tag}: {v}");
        let (v, _) = wait_safe(&http, &d, 1).await;
        let safe_after = killed.elapsed();
        // Writes of a prefill declared dead are counted possible for --peer-dead-ms after it
        // was: never safe sooner than that after the kill.
        assert!(
            safe_after >= peer_dead,
            "{tag}: safe {safe_after:?} after the kill: {v}"
        );
        println!(
            "{tag}: peer_dead, then safe to reuse {:.0} ms after the kill (--peer-dead-ms {})",
            safe_after.as_secs_f64() * 1e3,
            peer_dead.as_millis()
        );
        let url = format!("{d}/v1/rooms/1/take");
        expect(&http, Method::POST, &url, None, StatusCode::OK).await;
    });
}

/// Hellos whose pool key could not come from a decode's pool socket are refused with
/// `bad_message`; a well-formed key naming a socket nobody serves (a decode in another network
/// namespace) is accepted and staged; and the prefill keeps serving.
#[test]
fn forged_pool_keys_are_refused_or_staged_and_the_prefill_keeps_serving() {
    use common::rogue::{answers, hello};
    use kvferry::memory::RemoteMemory;
    use kvferry::protocol::Message;
    let tag = "mapped-forged-keys";
    let c = LocalCluster::start(&common::release_binary(), tag, &opts("tiny", 512, 2000))
        .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
    let control = c.prefill().field("control").expect("control endpoint");
    let data = c.decode().field("data").expect("decode data endpoint");
    let pool = |key: Vec<u8>| {
        let m = RemoteMemory {
            base: 0,
            size: 1 << 20,
            key,
        };
        Some(m)
    };
    let named = |name: &[u8]| [vec![7u8; 16], name.to_vec()].concat();
    let forged = [
        ("no key", pool(vec![])),
        ("a secret alone", pool(vec![7; 16])),
        ("another socket's name", pool(named(b"dbus-session"))),
        ("an over-long name", pool(named(&[b'k'; 200]))),
    ];
    let nowhere = pool(named(b"kvferry-pool-0123456789abcdef0123456789abcdef"));
    let mut messages: Vec<Message> = forged
        .iter()
        .map(|(_, p)| hello(data.clone(), None, p.clone()))
        .collect();
    messages.push(hello(data.clone(), None, nowhere));
    let got = answers(&control, messages);
    for ((what, _), answer) in forged.iter().zip(&got) {
        match answer {
            Message::Error(e) => {
                assert_eq!(e.code.to_string(), "bad_message", "{what}: {}", e.message);
                println!("[{tag}] {what}: {} {}", e.code, e.message);
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    match got.last() {
        Some(Message::HelloAck(ack)) => {
            assert!(
                !ack.direct,
                "{tag}: no pool mapped, yet direct writes announced"
            );
            println!("[{tag}] a key naming no socket: accepted, staged");
        }
        other => panic!("{tag}: a key naming no socket: {other:?}"),
    }
    let apis = c.apis().unwrap();
    let results = runtime()
        .block_on(drive_rooms(&apis, vec![(1, 100), (2, 300)], 1))
        .unwrap();
    assert!(results.iter().all(|r| r.verified), "{tag}: {results:?}");
}
