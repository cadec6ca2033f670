//! Bad input on the control plane (issue 10): 10,000 random and mutated messages from a raw
//! ZeroMQ DEALER at a live prefill agent's control endpoint (the `control` field of its
//! listening line). The mix: random byte strings, random bytes behind a valid magic, valid
//! frames of every message kind with random fields, mutated valid frames (flipped bytes,
//! truncation, trailing bytes, wrong body length, wrong magic / version / kind / flags),
//! oversized frames and multi-frame messages.
//!
//! The DEALER proves its connection first with a Hello the prefill refuses (messages before a
//! valid Hello are dropped unread). Asserted: the prefill stays alive and healthy; every
//! single-frame message except a Heartbeat is answered with exactly one Error frame (read back and decoded); the agent's
//! `kvferry_bad_messages_total` grows by at least the undecodable and multi-frame messages; a
//! room then transfers and verifies. Bounded time, seed printed.
//!
//! Needs `cargo build --release --bin kvferry` first.

// The tables of cases are tuples; naming their types would not make them clearer.
#![allow(clippy::type_complexity)]

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use kvferry::cluster::{Apis, LocalCluster, drive_rooms};
use kvferry::layout::{AttentionKind, Dtype, PageOrder};
use kvferry::protocol::{
    Abort, AbortAck, Chunk, Credit, Done, ErrorMsg, HEADER_LEN, Heartbeat, Hello, HelloAck,
    MAX_BODY, Message, Placed, Posted, PromptDigest, Ranks, Role, Secret, TransferRequest, VERSION,
    WireLayout,
};
use kvferry::reason::FailureCode;
use rand::rngs::StdRng;
use rand::{Rng, RngCore as _, SeedableRng as _};
use uuid::Uuid;

const MESSAGES: usize = 10_000;

fn uuid(rng: &mut StdRng) -> Uuid {
    Uuid::from_bytes(rng.random())
}

fn range(rng: &mut StdRng) -> std::ops::Range<u32> {
    let a: u32 = if rng.random_bool(0.5) {
        rng.random_range(0..64)
    } else {
        rng.random()
    };
    let b = if rng.random_bool(0.5) {
        a.saturating_add(rng.random_range(0..64))
    } else {
        rng.random_range(a..=u32::MAX)
    };
    a..b
}

fn text(rng: &mut StdRng, max: usize) -> String {
    let len = rng.random_range(0..=max);
    (0..len)
        .map(|_| match rng.random_range(0..10) {
            0 => char::from_u32(rng.random_range(0x80..0xD7FF)).unwrap_or('?'),
            _ => char::from(rng.random_range(0x20u8..0x7f)),
        })
        .collect()
}

fn code(rng: &mut StdRng) -> FailureCode {
    FailureCode::ALL[rng.random_range(0..FailureCode::ALL.len())]
}

/// A valid message of any kind with random fields.
fn random_message(rng: &mut StdRng) -> Message {
    match rng.random_range(0..11) {
        0 => Message::Hello(Hello {
            min_version: rng.random_range(0..6),
            max_version: rng.random_range(0..6),
            instance: uuid(rng),
            role: if rng.random_bool(0.5) {
                Role::Decode
            } else {
                Role::Prefill
            },
            ranks: Ranks {
                dp_rank: rng.random_range(0..4),
                dp_size: rng.random_range(0..4),
                tp_rank: rng.random_range(0..4),
                tp_size: rng.random_range(0..4),
                pp_rank: rng.random_range(0..4),
                pp_size: rng.random_range(0..4),
            },
            layout: WireLayout {
                kind: if rng.random_bool(0.5) {
                    AttentionKind::Mha
                } else {
                    AttentionKind::Mla
                },
                dtype: Dtype::ALL[rng.random_range(0..Dtype::ALL.len())],
                order: if rng.random_bool(0.5) {
                    PageOrder::TokenMajor
                } else {
                    PageOrder::HeadMajor
                },
                num_layers: rng.random_range(0..100),
                num_kv_heads: rng.random_range(0..100),
                head_dim: rng.random(),
                page_size: rng.random(),
                heads: range(rng),
                layers: range(rng),
            },
            data_endpoint: if rng.random_bool(0.5) {
                format!("tcp://127.0.0.1:{}", rng.random_range(1..1024))
            } else {
                text(rng, 40)
            },
            // Never the cluster's (empty) token: a random Hello must not become a peer.
            token: format!("x{}", text(rng, 20)),
            slots: rng.random_range(0..16),
            slot_bytes: rng.random(),
            pool: rng.random_bool(0.5).then(|| kvferry::memory::RemoteMemory {
                base: rng.random(),
                size: rng.random(),
                key: (0..rng.random_range(0..64)).map(|_| rng.random()).collect(),
            }),
            revocable_runs: rng.random_bool(0.5),
            chunk_key: Secret::from_bytes(rng.random()),
            shared_pool: rng.random_bool(0.5).then(|| kvferry::memory::RemoteMemory {
                base: rng.random(),
                size: rng.random(),
                key: (0..rng.random_range(0..64)).map(|_| rng.random()).collect(),
            }),
            nonce: rng
                .random_bool(0.5)
                .then(|| Secret::from_bytes(rng.random())),
        }),
        1 => Message::HelloAck(HelloAck {
            version: rng.random(),
            instance: uuid(rng),
            direct: rng.random_bool(0.5),
        }),
        2 => Message::TransferRequest(TransferRequest {
            room: rng.random(),
            prefill_instance: uuid(rng),
            tokens: range(rng),
            layers: range(rng),
            heads: range(rng),
            wire_order: if rng.random_bool(0.5) {
                PageOrder::TokenMajor
            } else {
                PageOrder::HeadMajor
            },
            dst_pages: (0..rng.random_range(0..64)).map(|_| rng.random()).collect(),
            requesters: rng.random_range(0..4),
            secret: Secret::from_bytes(rng.random()),
            room_key: rng
                .random_bool(0.5)
                .then(|| Secret::from_bytes(rng.random())),
            prompt_digest: rng
                .random_bool(0.5)
                .then(|| PromptDigest::from_bytes(rng.random())),
            src_pages: rng
                .random_bool(0.5)
                .then(|| (0..rng.random_range(0..64)).map(|_| rng.random()).collect()),
        }),
        3 => Message::Chunk(Chunk {
            room: rng.random(),
            prefill_instance: uuid(rng),
            seq: rng.random(),
            tokens: range(rng),
            layers: range(rng),
            heads: range(rng),
            len: rng.random(),
            checksum: rng.random(),
            direct: rng.random_bool(0.5),
            placed: rng.random_bool(0.3).then(|| Placed {
                key: rng.random(),
                runs: (0..rng.random_range(0..8)).map(|_| rng.random()).collect(),
            }),
            secret: Secret::from_bytes(rng.random()),
            sender_key: Secret::from_bytes(rng.random()),
        }),
        4 => Message::Done(Done {
            room: rng.random(),
            prefill_instance: uuid(rng),
            chunks: rng.random(),
            bytes: rng.random(),
            aux: (0..rng.random_range(0..256))
                .map(|_| rng.random())
                .collect(),
        }),
        5 => Message::Abort(Abort {
            room: rng.random(),
            instance: uuid(rng),
            code: code(rng),
            message: text(rng, 64),
        }),
        6 => Message::AbortAck(AbortAck {
            room: rng.random(),
            instance: uuid(rng),
        }),
        7 => Message::Heartbeat(Heartbeat {
            instance: uuid(rng),
            seq: rng.random(),
            rooms: (0..rng.random_range(0..4)).map(|_| rng.random()).collect(),
        }),
        8 => Message::Error(ErrorMsg {
            room: rng.random_bool(0.5).then(|| rng.random()),
            code: code(rng),
            message: text(rng, 64),
        }),
        9 => Message::Credit(Credit {
            instance: uuid(rng),
            slots: rng.random(),
        }),
        _ => Message::Posted(Posted {
            instance: uuid(rng),
            key: rng.random(),
            accepted: rng.random_bool(0.5),
        }),
    }
}

fn random_bytes(rng: &mut StdRng, max: usize) -> Vec<u8> {
    let mut v = vec![0u8; rng.random_range(0..=max)];
    rng.fill_bytes(&mut v);
    v
}

/// A valid frame, damaged one way.
fn mutate(rng: &mut StdRng, mut f: Vec<u8>) -> Vec<u8> {
    match rng.random_range(0..9) {
        0 => {
            for _ in 0..rng.random_range(1..=4) {
                let i = rng.random_range(0..f.len());
                f[i] ^= 1 << rng.random_range(0..8);
            }
        }
        1 => f.truncate(rng.random_range(0..f.len())),
        2 => f.extend(random_bytes(rng, 32).into_iter().chain([0])),
        3 => {
            // Wrong body length: off by a little, or anything.
            let len = u32::from_le_bytes(f[8..12].try_into().unwrap_or_default());
            let wrong = if rng.random_bool(0.5) {
                len.wrapping_add(rng.random_range(1..8))
            } else {
                rng.random()
            };
            f[8..12].copy_from_slice(&wrong.to_le_bytes());
        }
        4 => f[..4].copy_from_slice(&rng.random::<[u8; 4]>()),
        5 => {
            let v = if rng.random_bool(0.5) {
                0
            } else {
                rng.random_range(VERSION + 1..=u16::MAX)
            };
            f[4..6].copy_from_slice(&v.to_le_bytes());
        }
        6 => {
            f[6] = if rng.random_bool(0.5) {
                0
            } else {
                rng.random_range(11..=255)
            }
        }
        7 => f[7] = rng.random_range(1..=255),
        _ => {
            // Header of one kind, body of another.
            f[6] = rng.random_range(1..=10);
        }
    }
    f
}

/// One message to send: its frames and what the prefill should make of it.
struct Case {
    frames: Vec<Vec<u8>>,
    kind: &'static str,
}

fn case(rng: &mut StdRng, i: usize) -> Case {
    // A few of the largest frames the socket accepts, at fixed places (a larger one closes
    // the connection: tests/processes/e2e_hostile.rs).
    if i == 100 || i == 5000 {
        let mut f = Message::Heartbeat(Heartbeat {
            instance: uuid(rng),
            seq: 1,
            rooms: vec![],
        })
        .encode();
        f[8..12].copy_from_slice(&(MAX_BODY as u32).to_le_bytes());
        f.resize(HEADER_LEN + MAX_BODY, 0xAB);
        return Case {
            frames: vec![f],
            kind: "largest",
        };
    }
    if i == 200 {
        return Case {
            frames: vec![
                random_bytes(rng, 0)
                    .into_iter()
                    .chain(vec![0x5A; 1 << 20])
                    .collect(),
            ],
            kind: "random 1 MiB",
        };
    }
    match rng.random_range(0..100) {
        0..15 => Case {
            frames: vec![random_bytes(rng, 200)],
            kind: "random bytes",
        },
        15..25 => {
            let mut f = b"KVFY".to_vec();
            f.extend(random_bytes(rng, 120));
            Case {
                frames: vec![f],
                kind: "magic + random",
            }
        }
        25..50 => Case {
            frames: vec![random_message(rng).encode()],
            kind: "valid",
        },
        50..95 => {
            let f = random_message(rng).encode();
            Case {
                frames: vec![mutate(rng, f)],
                kind: "mutated",
            }
        }
        _ => {
            let n = rng.random_range(2..=4);
            let frames = (0..n)
                .map(|_| {
                    if rng.random_bool(0.5) {
                        random_message(rng).encode()
                    } else {
                        random_bytes(rng, 64)
                    }
                })
                .collect();
            Case {
                frames,
                kind: "multi-frame",
            }
        }
    }
}

/// What the prefill answers to one frame that is a whole message: an Error, except to a
/// Heartbeat (nothing). Whether it is one of the frames the agent counts as bad: undecodable.
fn expectation(frame: &[u8]) -> (bool, bool) {
    match Message::decode(frame) {
        Ok(Message::Heartbeat(_)) => (false, false),
        Ok(_) => (true, false),
        Err(_) => (true, true),
    }
}

/// The prefill's count of refused messages: `kvferry_bad_messages_total{role="prefill"}`, or the
/// sum over the kinds of `kvferry_protocol_errors_total{role="prefill",kind=...}`.
async fn bad_messages(http: &reqwest::Client, prefill: &str) -> f64 {
    if let Some(v) = metric(
        http,
        prefill,
        "kvferry_bad_messages_total{role=\"prefill\"}",
    )
    .await
    {
        return v;
    }
    metric_sum(http, prefill, "kvferry_protocol_errors_total", "prefill")
        .await
        .unwrap_or(0.0)
}

#[test]
fn ten_thousand_garbage_control_messages_leave_the_prefill_serving() {
    let opts = AgentOpts {
        heartbeat_ms: 100,
        peer_dead_ms: 1000,
        ..AgentOpts::default()
    };
    let mut cluster = LocalCluster::start(
        &release_binary(),
        "garbage",
        &all_timeouts(&opts, 60_000, 30_000),
    )
    .expect("cluster");
    let prefill = cluster.prefill().field("api").expect("prefill api");
    let decode = cluster.decode().field("api").expect("decode api");
    let control = cluster
        .prefill()
        .field("control")
        .expect("prefill control endpoint");
    println!(
        "[garbage] prefill {prefill} control {control}; logs in {}",
        cluster.logs.display()
    );
    let seed = test_seed();
    println!("[garbage] seed {seed} (KVFERRY_TEST_SEED={seed} replays it)");
    let mut rng = StdRng::seed_from_u64(seed);

    runtime().block_on(async {
        let http = http();
        let bad_before = bad_messages(&http, &prefill).await;

        // One thread owns the raw DEALER (libzmq sockets are not thread-safe): it sends every
        // case and reads the answers, keeping at most a few answers due at a time, as a peer
        // that reads its socket does (the prefill drops answers to a peer that does not).
        let (replies, seen) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new((BTreeMap::<String, usize>::new(), Vec::<String>::new()))));
        let cases: Vec<Case> = (0..MESSAGES).map(|i| case(&mut rng, i)).collect();
        let t = Instant::now();
        let (socket_replies, socket_seen, control) = (replies.clone(), seen.clone(), control.clone());
        let stats = tokio::task::spawn_blocking(move || {
            let ctx = zmq::Context::new();
            let socket = ctx.socket(zmq::DEALER).expect("a DEALER");
            socket.set_linger(0).expect("linger");
            socket.connect(&control).expect("connecting a DEALER to the prefill");
            // A connection proves itself with a valid Hello (anything before it is dropped
            // unread): this one's layout is not the prefill's, so it is refused with an Error.
            let mut hello = rogue::hello("tcp://127.0.0.1:9".to_owned(), None, None);
            if let Message::Hello(h) = &mut hello {
                h.layout.num_kv_heads += 1;
                h.layout.heads.end += 1;
            }
            socket.send(hello.encode(), 0).expect("send the Hello");
            let read = |wait: i64| -> bool {
                if socket.poll(zmq::POLLIN, wait).unwrap_or(0) == 0 {
                    return false;
                }
                let Ok(frames) = socket.recv_multipart(0) else { return false };
                let mut seen = socket_seen.lock().unwrap_or_else(|e| e.into_inner());
                match (frames.len(), frames.first().map(|f| Message::decode(f))) {
                    (1, Some(Ok(Message::Error(e)))) => *seen.0.entry(e.code.to_string()).or_default() += 1,
                    other => seen.1.push(format!("{other:?}")),
                }
                socket_replies.fetch_add(1, Ordering::Relaxed);
                true
            };
            let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
            // The Hello's refusal, then the cases'.
            let (mut expected_replies, mut undecodable, mut multi) = (1usize, 0usize, 0usize);
            for c in cases {
                *kinds.entry(c.kind).or_default() += 1;
                if c.frames.len() == 1 {
                    let (reply, bad) = expectation(&c.frames[0]);
                    expected_replies += usize::from(reply);
                    undecodable += usize::from(bad);
                } else {
                    multi += 1;
                }
                socket.send_multipart(c.frames, 0).expect("send");
                while read(0) {}
                let deadline = Instant::now() + BOUND;
                while expected_replies > socket_replies.load(Ordering::Relaxed) + 8 && Instant::now() < deadline {
                    read(100);
                }
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            while socket_replies.load(Ordering::Relaxed) < expected_replies && Instant::now() < deadline {
                read(100);
            }
            // Anything extra would arrive now.
            while read(300) {}
            (kinds, expected_replies, undecodable, multi)
        })
        .await
        .expect("the socket thread");
        let (kinds, expected_replies, undecodable, multi) = stats;
        println!(
            "[garbage] sent {MESSAGES} messages: {kinds:?}; {undecodable} undecodable single frames, {multi} multi-frame, {expected_replies} answers due"
        );
        let total = t.elapsed();
        let got = replies.load(Ordering::Relaxed);
        let (codes, strange) = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
        println!("[garbage] Error replies by code: {codes:?}");
        assert!(strange.is_empty(), "replies that are not one Error frame: {strange:?}");
        let bad_after = bad_messages(&http, &prefill).await;
        let text = http.get(format!("{prefill}/metrics")).send().await.expect("metrics").text().await.expect("text");
        let kinds: Vec<&str> = text.lines().filter(|l| l.starts_with("kvferry_protocol_errors_total") || l.starts_with("kvferry_bad_messages_total")).collect();
        println!("[garbage] prefill refused messages by kind: {kinds:?}");
        println!(
            "[garbage] {got} replies within {:.0} ms; bad_messages {bad_before} -> {bad_after}",
            ms(total)
        );
        assert_eq!(got, expected_replies, "one Error per answerable message, nothing else");
        assert!(
            bad_after - bad_before >= (undecodable + multi) as f64,
            "bad_messages grew by {} for {undecodable} undecodable and {multi} multi-frame messages",
            bad_after - bad_before
        );
        // Each refused message is counted once: never more than were sent.
        assert!(
            bad_after - bad_before <= MESSAGES as f64,
            "the prefill counted {} refused messages for {MESSAGES} sent: some are counted twice",
            bad_after - bad_before
        );
        assert!(total < Duration::from_secs(90), "the flood took {total:?}");
        healthy(&http, &prefill).await;
    });
    assert!(
        cluster.prefills[0][0].wait_exit(Duration::ZERO).is_none(),
        "the prefill exited; see {}",
        cluster.prefill().log.display()
    );

    runtime().block_on(async {
        let http = http();
        let rooms: Vec<(u64, usize)> = vec![(1, 16), (2, 300), (3, 1000)];
        let t = Instant::now();
        let results = drive_rooms(&Apis::pair(&prefill, &decode), rooms, 3)
            .await
            .expect("rooms after the garbage");
        assert!(
            results.iter().all(|r| r.verified && r.state == "success"),
            "{results:?}"
        );
        println!(
            "[garbage] afterwards 3 rooms verified in {:.0} ms",
            ms(t.elapsed())
        );
        healthy(&http, &prefill).await;
        healthy(&http, &decode).await;
    });
}
