//! A decode remembers a prefill group it looked up for a second: rooms asked for back to back
//! share one registry lookup (an HTTP round trip each, most of a small room's fixed cost),
//! and a prefill that restarts meanwhile gets the rooms asked for once the decode saw its old
//! instance go (it forgets what it remembered when a peer is lost). A room asked for before
//! that may still go to the old instance and fail `peer_dead`, with the reason. Rooms that
//! name their registry (as the vLLM connector's do) share one client of it, and its connection.
//! Rooms asked for at once while their group is incomplete wait for one lookup at a time and
//! share its outcome.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvferry::agent::EngineApi;
use kvferry::agent::decode::{DecodeAgent, RoomRequest};
use kvferry::agent::prefill::{PrefillAgent, ReadyRequest};
use tokio_util::sync::CancellationToken;

/// The generous bound on every wait; waits print how long they took.
const BOUND: Duration = Duration::from_secs(60);

/// The registry's count of complete prefill group lookups.
async fn lookups(http: &reqwest::Client, registry: &str) -> u64 {
    lookups_of(http, registry, "complete").await
}

/// The registry's count of prefill group lookups that found the group `result`.
async fn lookups_of(http: &reqwest::Client, registry: &str, result: &str) -> u64 {
    let text = http
        .get(format!("{registry}/metrics"))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .expect("registry metrics")
        .text()
        .await
        .expect("metrics body");
    let line = text
        .lines()
        .find(|l| {
            l.starts_with(&format!(
                r#"kvferry_bootstrap_lookups_total{{result="{result}"}}"#
            ))
        })
        .unwrap_or_else(|| panic!("no {result} lookups counter in:\n{text}"));
    line.rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("a count")
}

/// A TCP relay to `to`: its URL, and the count of connections it accepted.
async fn counting_relay(to: &str) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let to = to.trim_start_matches("http://").to_owned();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::Relaxed);
            let to = to.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (url, accepted)
}

/// Moves `room` (40 tokens) from `prefill` to `decode`, the decode looking its group up in
/// `bootstrap` (its own registry when None); its final state's name and reason.
async fn room_via(
    prefill: &PrefillAgent,
    decode: &DecodeAgent,
    room: u64,
    bootstrap: Option<String>,
) -> (String, String) {
    let req = RoomRequest {
        tokens: 40,
        bootstrap,
        ..RoomRequest::default()
    };
    decode.request(room, req).await.expect("room requested");
    let ready = ReadyRequest {
        tokens: 40,
        ..ReadyRequest::default()
    };
    // A room sent to a prefill that is gone fails at the decode; its ready may fail too.
    let _ = prefill.ready(room, ready).await;
    let t = Instant::now();
    let view = loop {
        let v = decode
            .wait(room, Duration::from_secs(10))
            .await
            .expect("view");
        if v.state.is_final() || t.elapsed() > BOUND {
            break v;
        }
    };
    let taken = decode.take(room).await;
    let verified = taken.as_ref().is_ok_and(|t| t.verified == Some(true));
    let reason = format!("{:?} (verified on take: {verified})", view.reason);
    let state = match (view.state.name(), verified) {
        ("success", false) => "unverified".to_owned(),
        (s, _) => s.to_owned(),
    };
    (state, reason)
}

/// [`room_via`] the decode's own registry.
async fn room(prefill: &PrefillAgent, decode: &DecodeAgent, r: u64) -> (String, String) {
    room_via(prefill, decode, r, None).await
}

#[test]
fn rooms_naming_their_registry_share_one_connection_to_it() {
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let (registry, served) = common::registry_in_process(&shutdown).await;
        let (relay, accepted) = counting_relay(&registry).await;
        let cfg = common::in_process_config(&registry, &[]);
        let prefill = PrefillAgent::start(cfg, shutdown.clone()).await.unwrap();
        // The decode trusts the relay (a room naming another registry is refused).
        let trusting = common::in_process_config(&registry, &["--allowed-registries", &relay]);
        let decode = DecodeAgent::start(trusting, shutdown.clone())
            .await
            .unwrap();
        // Each room names the registry through the relay, as an engine that gets the registry
        // with each request does; rooms more than FRESH apart each look their group up.
        for r in 1..=3 {
            if r > 1 {
                tokio::time::sleep(Duration::from_millis(1100)).await;
            }
            let (state, reason) = room_via(&prefill, &decode, r, Some(relay.clone())).await;
            assert_eq!(state, "success", "room {r}: {reason}");
        }
        let connections = accepted.load(Ordering::Relaxed);
        println!("3 rooms, each looking its group up, opened {connections} connection(s)");
        assert_eq!(
            connections, 1,
            "one client per registry URL, its connection kept"
        );
        shutdown.cancel();
        prefill.join().await;
        decode.join().await;
        served.await.unwrap().unwrap();
    });
}

#[test]
fn rooms_back_to_back_share_a_lookup_and_a_restarted_prefill_still_serves() {
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let (registry, served) = common::registry_in_process(&shutdown).await;
        let cfg = common::in_process_config(&registry, &[]);
        let old_stop = shutdown.child_token();
        let old = PrefillAgent::start(cfg.clone(), old_stop.clone())
            .await
            .unwrap();
        let decode = DecodeAgent::start(cfg.clone(), shutdown.clone())
            .await
            .unwrap();
        let http = kvferry_wire::http::client().build().unwrap();

        let before = lookups(&http, &registry).await;
        let t = Instant::now();
        for r in 1..=8 {
            let (state, reason) = room(&old, &decode, r).await;
            assert_eq!(state, "success", "room {r}: {reason}");
        }
        let took = t.elapsed();
        let asked = lookups(&http, &registry).await - before;
        println!("8 rooms in {took:?} asked the registry {asked} time(s)");
        // One lookup per second of rooms at most: without the memory, one per room.
        let most = 1 + took.as_secs();
        assert!(
            (1..=most).contains(&asked),
            "8 rooms in {took:?} looked their group up {asked} times; at most {most} expected"
        );

        // The prefill restarts: a new instance on new ports, the old one gone.
        old_stop.cancel();
        old.join().await;
        let new = PrefillAgent::start(cfg, shutdown.clone()).await.unwrap();
        let t = Instant::now();
        let mut r = 100;
        let served_by_new = loop {
            r += 1;
            let (state, reason) = room(&new, &decode, r).await;
            println!("room {r} after the restart: {state} {reason}");
            if state == "success" {
                break r;
            }
            assert!(
                t.elapsed() < BOUND,
                "no room reached the restarted prefill within {BOUND:?}"
            );
        };
        println!(
            "room {served_by_new} landed through the restarted prefill {:?} after it started",
            t.elapsed()
        );
        for r in 200..203 {
            let (state, reason) = room(&new, &decode, r).await;
            assert_eq!(state, "success", "room {r}: {reason}");
        }
        shutdown.cancel();
        new.join().await;
        decode.join().await;
        served.await.unwrap().unwrap();
    });
}

#[test]
fn rooms_asked_for_at_once_before_their_prefill_registers_share_one_lookup() {
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let (registry, served) = common::registry_in_process(&shutdown).await;
        let cfg = common::in_process_config(&registry, &[]);
        let decode = DecodeAgent::start(cfg.clone(), shutdown.clone())
            .await
            .unwrap();
        let http = kvferry_wire::http::client().build().unwrap();
        // 16 rooms (48 of the pool's 64 pages) asked for at once, before any prefill
        // registered: each waits for the group.
        const ROOMS: u64 = 16;
        let t = Instant::now();
        let asked = (1..=ROOMS).map(|r| {
            let req = RoomRequest {
                tokens: 40,
                ..RoomRequest::default()
            };
            decode.request(r, req)
        });
        for a in futures_util::future::join_all(asked).await {
            a.expect("room requested");
        }
        while lookups_of(&http, &registry, "incomplete").await == 0 {
            assert!(t.elapsed() < BOUND, "no lookup reached the registry");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let waited = lookups_of(&http, &registry, "incomplete").await;
        let prefill = PrefillAgent::start(cfg, shutdown.clone()).await.unwrap();
        for r in 1..=ROOMS {
            let ready = ReadyRequest {
                tokens: 40,
                ..ReadyRequest::default()
            };
            prefill.ready(r, ready).await.expect("ready");
        }
        for r in 1..=ROOMS {
            let view = common::final_view(&decode, r).await;
            assert_eq!(view.state.name(), "success", "room {r}: {:?}", view.reason);
            decode.take(r).await.expect("take");
        }
        let complete = lookups(&http, &registry).await;
        let incomplete = lookups_of(&http, &registry, "incomplete").await;
        println!(
            "{ROOMS} rooms asked for at once landed in {:?}: {complete} complete lookup(s), \
             {incomplete} of an incomplete group ({waited} before the prefill started)",
            t.elapsed()
        );
        assert_eq!(
            complete, 1,
            "the rooms waiting for their group share one lookup"
        );
        shutdown.cancel();
        prefill.join().await;
        decode.join().await;
        served.await.unwrap().unwrap();
    });
}

#[test]
fn a_room_behind_a_lookup_that_gave_up_waits_its_own_bootstrap_timeout() {
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let (registry, served) = common::registry_in_process(&shutdown).await;
        let timeout = Duration::from_secs(3);
        let ms = timeout.as_millis().to_string();
        let cfg = common::in_process_config(&registry, &["--timeout-bootstrap-ms", &ms]);
        let decode = DecodeAgent::start(cfg, shutdown.clone()).await.unwrap();
        let room = || RoomRequest {
            tokens: 40,
            ..RoomRequest::default()
        };
        // No prefill ever registers: room 1's lookup gives up at its timeout; room 2, asked a
        // second later, waits behind it, then for its own timeout.
        let first = Instant::now();
        decode.request(1, room()).await.expect("room 1 requested");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let second = Instant::now();
        decode.request(2, room()).await.expect("room 2 requested");
        for (r, asked) in [(1, first), (2, second)] {
            let view = common::final_view(&decode, r).await;
            let took = asked.elapsed();
            let code = view.reason.as_ref().map(|why| why.code.name());
            assert_eq!(
                (view.state.name(), code),
                ("failed", Some("timeout_bootstrap")),
                "room {r}: {:?}",
                view.reason
            );
            println!("room {r} failed timeout_bootstrap {took:?} after it was asked");
            assert!(
                took >= timeout,
                "room {r} failed {took:?} after it was asked, before its bootstrap timeout {timeout:?}"
            );
        }
        shutdown.cancel();
        decode.join().await;
        served.await.unwrap().unwrap();
    });
}
