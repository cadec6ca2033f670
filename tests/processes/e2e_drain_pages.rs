//! Page return and drain, through the release binary on loopback:
//!
//! - an aborted room's agent-owned pages return to the decode pool as soon as the room is safe
//!   to reuse, without a take and long before `--room-ttl-ms` (the room stays readable);
//! - a draining decode (SIGTERM) keeps rooms that landed but were not taken takeable: they are
//!   taken after SIGTERM and verify, then the process exits 0; untaken ones are given up after
//!   `--drain-untaken-ms` and the process still exits 0.
//!
//! Needs `cargo build --release --all-features --bin kvferry` first.

use crate::common;

use std::time::Instant;

use common::*;
use reqwest::{Method, StatusCode};
use serde_json::json;

/// Far beyond any bound of these tests: whatever happens within them is not a timeout's doing.
const NEVER_MS: &str = "600000";

fn cluster(tag: &str, decode_extra: &[&str], prefill_extra: &[&str]) -> FaultCluster {
    // No timeout may end a room within these tests: what they see is the abort's, the
    // drain's or the take's doing.
    let args = AgentOpts {
        room_ttl_ms: 600_000,
        timeout_ready_ms: 600_000,
        timeout_stall_ms: 600_000,
        ..AgentOpts::default()
    }
    .args();
    FaultCluster::start(tag, &args, prefill_extra, decode_extra, &[])
}

#[test]
fn aborted_rooms_return_their_pages_once_safe_without_a_take() {
    let c = cluster("pages-abort", &[], &[]);
    let (d, p) = (c.decode_api.clone(), c.prefill_api.clone());
    runtime().block_on(async {
        let http = http();
        let (total, free) = pool(&http, &d).await;
        assert_eq!(total, free);
        // Room 1 aborted before its prefill is ready, room 2 in the middle of its transfer.
        for room in [1u64, 2] {
            let v = expect(&http, Method::POST, &format!("{d}/v1/rooms/{room}"), Some(&json!({ "tokens": 256 })), StatusCode::CREATED).await;
            assert_eq!(v["page_owner"], "agent", "{v}");
        }
        assert_eq!(pool(&http, &d).await, (total, total - 32), "2 rooms x 16 pages");
        wait_state(&http, &d, 2, &["waiting_for_input"], BOUND).await;
        // Room 2 held mid-transfer: its first half announced, the rest never.
        ready_piece(&http, &p, 2, 256, 0..128, false).await;
        wait_state(&http, &d, 2, &["transferring"], BOUND).await;
        for room in [1u64, 2] {
            expect(&http, Method::DELETE, &format!("{d}/v1/rooms/{room}"), None, StatusCode::OK).await;
        }
        let t = Instant::now();
        for room in [1u64, 2] {
            let (v, _) = wait_safe(&http, &d, room).await;
            assert_eq!(v["state"], "aborted", "room {room}: {v}");
        }
        poll_until("decode pool back without a take", BOUND, || async {
            (pool(&http, &d).await == (total, total)).then_some(())
        })
        .await;
        println!(
            "[pages-abort] rooms aborted before ready and mid-transfer; pool back {:.0} ms after the aborts",
            ms(t.elapsed())
        );
        // The rooms are still there, final and safe to reuse: the pages went back early, the
        // rooms did not expire (their ttl is 10 minutes).
        for room in [1u64, 2] {
            let v = expect(&http, Method::GET, &format!("{d}/v1/rooms/{room}"), None, StatusCode::OK).await;
            assert_eq!(v["safe_to_reuse"], true, "{v}");
            assert_eq!(v["page_owner"], "agent", "{v}");
        }
        // Taking them changes nothing more.
        for room in [1u64, 2] {
            expect(&http, Method::POST, &format!("{d}/v1/rooms/{room}/take"), None, StatusCode::OK).await;
        }
        assert_eq!(pool(&http, &d).await, (total, total));
        // The pages serve new rooms at once.
        expect(&http, Method::POST, &format!("{d}/v1/rooms/3"), Some(&json!({ "tokens": 64 })), StatusCode::CREATED).await;
        expect(&http, Method::POST, &format!("{p}/v1/rooms/3/ready"), Some(&json!({ "tokens": 64 })), StatusCode::ACCEPTED).await;
        assert_eq!(wait_final(&http, &d, 3).await["state"], "success");
        let taken = expect(&http, Method::POST, &format!("{d}/v1/rooms/3/take"), None, StatusCode::OK).await;
        assert_eq!(taken["verified"], true, "{taken}");
    });
}

#[test]
fn a_draining_decode_keeps_landed_rooms_takeable_until_taken_then_exits_0() {
    let mut c = cluster("drain-untaken", &["--drain-untaken-ms", NEVER_MS], &[]);
    let (d, p) = (c.decode_api.clone(), c.prefill_api.clone());
    let rt = runtime();
    let http = http();
    rt.block_on(async {
        for room in 1..=3u64 {
            request_and_ready(&http, &d, &p, room, &json!({ "tokens": 100 })).await;
            assert_eq!(wait_final(&http, &d, room).await["state"], "success");
        }
    });
    c.decode.signal("TERM").unwrap();
    let t = Instant::now();
    rt.block_on(async {
        // Draining (once the signal was handled): new rooms are refused. The probe's body is
        // refused with 400 after the drain check, so a probe that comes before the signal was
        // handled creates nothing.
        let url = format!("{d}/v1/rooms/9");
        let (status, body) = poll_until("the decode refuses new rooms", BOUND, || async {
            let got = try_call(&http, Method::POST, &url, Some(&json!({ "tokens": 0 }))).await;
            let got = got.expect("the draining decode still answers its API");
            (got.0 != StatusCode::BAD_REQUEST).then_some(got)
        })
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(
            body["error"]
                .as_str()
                .is_some_and(|e| e.contains("draining")),
            "{body}"
        );
        // Landed rooms are still taken and verify.
        for room in 1..=3u64 {
            let got = try_call(
                &http,
                Method::POST,
                &format!("{d}/v1/rooms/{room}/take"),
                None,
            )
            .await;
            let (status, taken) = got.unwrap_or_else(|| {
                panic!("room {room}: the draining decode went away before it was taken")
            });
            assert_eq!(status, StatusCode::OK, "room {room}: {taken}");
            assert_eq!(taken["verified"], true, "room {room}: {taken}");
        }
    });
    // Every landed room taken: it exits (long before --drain-untaken-ms), with 0.
    let status = c
        .decode
        .wait_exit(BOUND)
        .expect("the decode did not exit once its rooms were taken");
    println!(
        "[drain-untaken] exited {status} {:.0} ms after SIGTERM",
        ms(t.elapsed())
    );
    assert!(
        status.success(),
        "exit status {status}; log {}",
        c.decode.log.display()
    );
}

#[test]
fn a_draining_decode_gives_untaken_rooms_up_after_the_window_and_exits_0() {
    let mut c = cluster("drain-untaken-window", &["--drain-untaken-ms", "300"], &[]);
    let (d, p) = (c.decode_api.clone(), c.prefill_api.clone());
    runtime().block_on(async {
        let http = http();
        request_and_ready(&http, &d, &p, 1, &json!({ "tokens": 100 })).await;
        assert_eq!(wait_final(&http, &d, 1).await["state"], "success");
    });
    c.decode.signal("TERM").unwrap();
    let t = Instant::now();
    let status = c
        .decode
        .wait_exit(BOUND)
        .expect("the decode did not exit after the window");
    println!(
        "[drain-untaken-window] exited {status} {:.0} ms after SIGTERM",
        ms(t.elapsed())
    );
    assert!(
        status.success(),
        "exit status {status}; log {}",
        c.decode.log.display()
    );
    let log = std::fs::read_to_string(&c.decode.log).unwrap_or_default();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("not taken within --drain-untaken-ms")),
        "{log}"
    );
}
