//! The wire against hostile peers, as an attacker on the same network would try it (real
//! processes, real sockets; docs/reliability.md "Threat model" has the table these back):
//! - a frame header announcing 2^40 bytes on every listening TCP port of every role, and sent
//!   back by a fake prefill to a decode that connects to it: nothing allocates it, every
//!   process keeps serving, a room then verifies;
//! - a memory flood on the control and data ports: RSS growth stays within the documented
//!   bound;
//! - forged chunks (whole room, half a room, correct checksum, the real prefill's instance id)
//!   into the decode's data port, with and without a token: counted as `forged`, the room lands
//!   the real bytes and verifies;
//! - a rogue decode (no token, a wrong token, the right token but not the room's requester)
//!   gets no KV;
//! - kill -9 of either agent mid-transfer with `--peer-dead-ms 60000`: only the dropped
//!   connection can explain a fast `peer_dead`, and the time is printed;
//! - a room or a hold naming a registry the decode does not trust is refused (403) and that
//!   registry, and the prefill it lists, receive nothing: neither the token nor a connection.
//!
//! Needs `cargo build --release --bin kvferry` first.

use crate::common;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use kvferry::protocol::{Chunk, Message, Secret};
use reqwest::{Client, Method, StatusCode};
use serde_json::json;

/// KV bytes per token of the `tiny` preset: 4 layers x 4 heads x 32 x fp16 x (K, V).
const TINY_BYTES_PER_TOKEN: u64 = 4 * 4 * 32 * 2 * 2;

fn opts() -> AgentOpts {
    AgentOpts {
        pool_pages: 64,
        ..AgentOpts::default()
    }
}

/// A registry, a prefill and a decode (tiny, zmq-tcp); `flags` are (flag, value) pairs set on
/// both agents (an empty value: a switch).
fn cluster(tag: &str, flags: &[(&str, &str)]) -> FaultCluster {
    let mut args = all_timeouts(&opts(), 60_000, 30_000);
    for (flag, value) in flags {
        match value.is_empty() {
            true => args.push((*flag).to_owned()),
            false => set_flag(&mut args, flag, value),
        }
    }
    FaultCluster::start(tag, &args, &[], &[], &[])
}

/// `host:port` of a `tcp://` endpoint or an `http://` URL.
fn addr(endpoint: &str) -> String {
    let rest = endpoint
        .trim_start_matches("tcp://")
        .trim_start_matches("http://");
    let rest = rest.split('/').next().unwrap_or(rest);
    rest.replace("[::ffff:127.0.0.1]", "127.0.0.1")
}

/// A long message frame header announcing `len` bytes.
fn long_frame(len: u64) -> Vec<u8> {
    let mut f = vec![0x02];
    f.extend_from_slice(&len.to_be_bytes());
    f
}

/// Connects to `endpoint`, writes `parts` (stopping at the first write the peer refuses) and
/// then up to `stream` junk bytes; returns the bytes written and whether the peer closed the
/// connection within the bound.
fn attack(endpoint: &str, parts: &[Vec<u8>], stream: usize) -> (usize, bool) {
    let mut s = TcpStream::connect(addr(endpoint)).expect("tcp connect");
    s.set_write_timeout(Some(Duration::from_secs(5))).ok();
    let mut written = 0;
    for p in parts {
        if s.write_all(p).is_err() {
            return (written, true);
        }
        written += p.len();
    }
    let junk = vec![0x5Au8; 1 << 20];
    while written < stream {
        match s.write(&junk) {
            Ok(n) => written += n,
            Err(_) => return (written, true),
        }
    }
    s.set_read_timeout(Some(BOUND)).ok();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break false,
            Err(_) => break true,
        }
    };
    (written, closed)
}

/// An HTTP request announcing a 2^40-byte body, then 3 MiB of it (more than any route takes):
/// the status line answered, or `None` if the server closed the connection without one.
fn http_attack(url: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr(url)).expect("tcp connect");
    let head = format!(
        "POST /v1/rooms/1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        1u64 << 40
    );
    s.write_all(head.as_bytes()).ok()?;
    let _ = s.write_all(&vec![b'{'; 3 << 20]);
    s.set_read_timeout(Some(BOUND)).ok();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    text.lines().next().map(str::to_owned)
}

/// A 32-token room of the tiny preset from request to take, verified.
async fn verified_room(http: &Client, c: &FaultCluster, room: u64) {
    let apis = kvferry::cluster::Apis::pair(&c.prefill_api, &c.decode_api);
    let results = kvferry::cluster::drive_rooms(&apis, vec![(room, 32)], 1)
        .await
        .expect("a room");
    assert!(
        results.iter().all(|r| r.verified && r.state == "success"),
        "{results:?}"
    );
    healthy(http, &c.prefill_api).await;
    healthy(http, &c.decode_api).await;
}

/// A field of `/proc/PID/status` in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Resident memory now.
fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// The highest resident memory since the process started.
fn peak_kib(pid: u32) -> u64 {
    status_kib(pid, "VmHWM:")
}

#[test]
fn a_2_pow_40_byte_frame_on_every_port_allocates_nothing_and_every_role_serves_on() {
    let mut c = cluster("hostile-huge", &[]);
    let zmq_ports = [
        (
            "prefill control",
            c.prefill.field("control").unwrap(),
            "DEALER",
        ),
        ("decode data", c.decode.field("data").unwrap(), "PUSH"),
    ];
    for (name, endpoint, socket_type) in &zmq_ports {
        // In the handshake (a command frame) and after it (a message frame).
        for (when, parts) in [
            (
                "handshake",
                vec![
                    zmtp_greeting("NULL"),
                    vec![0x06],
                    (1u64 << 40).to_be_bytes().to_vec(),
                ],
            ),
            (
                "message",
                vec![
                    zmtp_greeting("NULL"),
                    zmtp_ready(socket_type),
                    long_frame(1 << 40),
                ],
            ),
        ] {
            let t = Instant::now();
            let (written, closed) = attack(endpoint, &parts, 64 << 20);
            println!(
                "[hostile-huge] {name} {endpoint}, 2^40 bytes announced in the {when}: {written} bytes taken, closed {closed} after {:.0} ms",
                ms(t.elapsed())
            );
            assert!(closed, "{name} kept a connection that announced 2^40 bytes");
            assert!(
                written < 64 << 20,
                "{name} read {written} bytes into a 2^40-byte frame"
            );
        }
    }
    for (name, url) in [
        ("registry", c.registry_url.clone()),
        ("prefill api", c.prefill_api.clone()),
        ("decode api", c.decode_api.clone()),
    ] {
        let answer = http_attack(&url);
        println!("[hostile-huge] {name} {url}, Content-Length 2^40: {answer:?}");
        if let Some(line) = answer {
            assert!(line.contains(" 4"), "{name} answered {line}");
        }
    }
    for p in [&mut c.prefill, &mut c.decode, &mut c.registry] {
        assert!(p.alive(), "{} died; see {}", p.name, p.log.display());
    }
    runtime().block_on(verified_room(&http(), &c, 1));
}

/// A fake prefill that answers a decode's connection with a greeting and a frame header
/// announcing 2^40 bytes: the decode drops that connection, fails the room, and serves on.
#[test]
fn a_fake_prefill_announcing_2_pow_40_bytes_fails_the_room_not_the_decode() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let endpoint = format!("tcp://{}", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for conn in listener.incoming().take(8) {
            let Ok(mut s) = conn else { return };
            let mut g = [0u8; 64];
            let _ = s.read_exact(&mut g);
            let mut out = zmtp_greeting("NULL");
            out.extend(zmtp_ready("ROUTER"));
            out.extend(long_frame(1 << 40));
            let _ = s.write_all(&out);
            let _ = s.write_all(&vec![0x5A; 1 << 20]);
            std::thread::spawn(move || {
                let mut sink = [0u8; 4096];
                while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    let (registry, mut decode, api) = decode_with_fake_prefill("hostile-fake-prefill", &endpoint);
    runtime().block_on(async {
        let http = http();
        let url = format!("{api}/v1/rooms/5");
        expect(
            &http,
            Method::POST,
            &url,
            Some(&json!({"tokens": 32})),
            StatusCode::CREATED,
        )
        .await;
        let v = wait_final(&http, &api, 5).await;
        println!("[hostile-fake-prefill] {}", v["reason"]);
        assert_eq!(v["state"], "failed", "{v}");
        healthy(&http, &api).await;
    });
    assert!(
        decode.wait_exit(Duration::ZERO).is_none(),
        "the decode died"
    );
    drop(registry);
}

#[test]
fn a_memory_flood_on_the_control_and_data_ports_stays_within_the_bound() {
    let c = cluster("hostile-flood", &[]);
    let (prefill_pid, decode_pid) = (c.prefill.pid(), c.decode.pid());
    let before = (rss_kib(prefill_pid), rss_kib(decode_pid));
    // 16 GiB announced, 400 MiB streamed into it, on each port.
    let control = c.prefill.field("control").unwrap();
    let data = c.decode.field("data").unwrap();
    for (name, endpoint, socket_type) in [("control", &control, "DEALER"), ("data", &data, "PUSH")]
    {
        let t = Instant::now();
        let (written, closed) = attack(
            endpoint,
            &[
                zmtp_greeting("NULL"),
                zmtp_ready(socket_type),
                long_frame(16 << 30),
            ],
            400 << 20,
        );
        println!(
            "[hostile-flood] {name}: 16 GiB announced, {} MiB taken before the close ({closed}) in {:.0} ms",
            written >> 20,
            ms(t.elapsed())
        );
        assert!(closed, "{name}: the connection stayed open");
    }
    // The largest messages each port takes, as fast as a real libzmq peer sends them, on 4
    // connections to each port; then one message of frames that never ends (every frame but none last: libzmq's
    // high-water mark counts whole messages).
    let flood = |endpoint: String, kind: zmq::SocketType, frames: Vec<Vec<u8>>, more: bool| {
        std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let s = ctx.socket(kind).expect("socket");
            s.set_sndhwm(4).ok();
            s.set_linger(2000).ok();
            s.set_sndtimeo(5000).ok();
            s.connect(&endpoint).expect("connect");
            let mut sent = 0usize;
            'flood: for _ in 0..80 {
                for (i, f) in frames.iter().enumerate() {
                    let flags = if more || i + 1 < frames.len() {
                        zmq::SNDMORE
                    } else {
                        0
                    };
                    if s.send(&f[..], flags).is_err() {
                        break 'flood;
                    }
                    sent += f.len();
                }
            }
            sent
        })
    };
    let control_frame = vec![vec![0xAB; kvferry::protocol::MAX_FRAME]];
    // The largest data message: a header at its cap and one chunk-sized frame per pool range.
    let mut data_frames = vec![vec![0xCD; kvferry::transport::zmq::data::MAX_HEADER]];
    data_frames.extend((0..kvferry::transport::MAX_PIECES).map(|_| vec![0xEF; 1 << 20]));
    let data_message: usize = data_frames.iter().map(Vec::len).sum();
    let peak = |pid| peak_kib(pid).max(rss_kib(pid));
    let mut floods = Vec::new();
    for _ in 0..4 {
        floods.push(flood(
            control.clone(),
            zmq::DEALER,
            control_frame.clone(),
            false,
        ));
        floods.push(flood(data.clone(), zmq::PUSH, data_frames.clone(), false));
    }
    let sent: usize = floods.into_iter().map(|f| f.join().unwrap_or(0)).sum();
    let after = (peak(prefill_pid), peak(decode_pid));
    let grew = |(b, a): (u64, u64)| a.saturating_sub(b) << 10;
    let (prefill_grew, decode_grew) = (grew((before.0, after.0)), grew((before.1, after.1)));
    // The documented bound: connections x (HWM + 1) x largest frame, plus the agent's own
    // working memory for the frames it reads (generous slack: 128 MiB).
    let control_bound =
        4 * (kvferry::transport::zmq::control::HWM as usize + 1) * kvferry::protocol::MAX_FRAME;
    let data_bound = 4 * (kvferry::transport::zmq::data::RECV_HWM as usize + 1) * data_message;
    println!(
        "[hostile-flood] {} MiB sent by 8 flooding peers; peak RSS over the start: prefill +{} MiB (bound {} MiB), decode +{} MiB (bound {} MiB)",
        sent >> 20,
        prefill_grew >> 20,
        control_bound >> 20,
        decode_grew >> 20,
        data_bound >> 20
    );
    assert!(prefill_grew as usize <= control_bound + (128 << 20));
    assert!(decode_grew as usize <= data_bound + (128 << 20));
    let endless = [
        flood(
            control.clone(),
            zmq::DEALER,
            vec![vec![0x11; 1 << 20]],
            true,
        ),
        flood(data.clone(), zmq::PUSH, vec![vec![0x22; 1 << 20]], true),
    ];
    let sent: usize = endless.into_iter().map(|f| f.join().unwrap_or(0)).sum();
    let endless_after = (peak(prefill_pid), peak(decode_pid));
    println!(
        "[hostile-flood] one endless message of 1 MiB frames per port ({} MiB sent): peak RSS prefill +{} MiB, decode +{} MiB",
        sent >> 20,
        grew((before.0, endless_after.0)) >> 20,
        grew((before.1, endless_after.1)) >> 20
    );
    runtime().block_on(async {
        let http = http();
        let refused = metric_sum(
            &http,
            &c.decode_api,
            "kvferry_protocol_errors_total",
            "decode",
        )
        .await;
        println!("[hostile-flood] data frames the decode refused: {refused:?}");
        verified_room(&http, &c, 1).await;
    });
}

/// One forged chunk for `room`: the real prefill's instance, correct length and checksum of
/// junk bytes, secrets that are not the transfer's.
fn forged_chunk(
    room: u64,
    instance: uuid::Uuid,
    tokens: std::ops::Range<u32>,
) -> (Vec<u8>, Vec<u8>) {
    let len = u64::from(tokens.end - tokens.start) * TINY_BYTES_PER_TOKEN;
    let payload = vec![0x66u8; len as usize];
    let header = Message::Chunk(Chunk {
        room,
        prefill_instance: instance,
        seq: 0,
        tokens,
        layers: 0..4,
        heads: 0..4,
        len,
        checksum: xxhash_rust::xxh3::xxh3_64(&payload),
        direct: false,
        placed: None,
        secret: Secret::random().expect("random"),
        sender_key: Secret::random().expect("random"),
    })
    .encode();
    (header, payload)
}

async fn forged_count(http: &Client, decode: &str) -> f64 {
    metric(
        http,
        decode,
        "kvferry_protocol_errors_total{role=\"decode\",kind=\"forged\"}",
    )
    .await
    .unwrap_or(0.0)
}

/// Requests `room` at the decode, sends forged chunks (whole room, first half) through `push`
/// after `first` (a would-be proof of its connection), then announces the room at the prefill:
/// the real bytes land and verify. Returns how many forged chunks the decode counted.
async fn forged_then_real(
    http: &Client,
    c: &FaultCluster,
    room: u64,
    (push, first): (&zmq::Socket, Option<&[u8]>),
) -> f64 {
    let instance: uuid::Uuid = c
        .prefill
        .field("instance")
        .unwrap()
        .parse()
        .expect("a uuid");
    let before = forged_count(http, &c.decode_api).await;
    let url = format!("{}/v1/rooms/{room}", c.decode_api);
    expect(
        http,
        Method::POST,
        &url,
        Some(&json!({"tokens": 32})),
        StatusCode::CREATED,
    )
    .await;
    wait_state(http, &c.decode_api, room, &["waiting_for_input"], BOUND).await;
    // Sent while the room waits for them: read, they would be counted (or land).
    send_forged(push, first, room, instance);
    let v = call(http, Method::GET, &url, None).await.1;
    assert_eq!(
        v["state"], "waiting_for_input",
        "forged chunks moved the room: {v}"
    );
    assert_eq!(v["bytes"], 0, "{v}");
    let ready = format!("{}/v1/rooms/{room}/ready", c.prefill_api);
    expect(
        http,
        Method::POST,
        &ready,
        Some(&json!({"tokens": 32})),
        StatusCode::ACCEPTED,
    )
    .await;
    let taken = take_verified(http, &c.decode_api, room).await;
    assert_eq!(taken["bytes"], 32 * TINY_BYTES_PER_TOKEN, "{taken}");
    forged_count(http, &c.decode_api).await - before
}

/// Sends two forged chunks of `room` (a whole-room one and a half-room one) on `push`, after
/// `first` (a would-be proof) when given.
fn send_forged(push: &zmq::Socket, first: Option<&[u8]>, room: u64, instance: uuid::Uuid) {
    if let Some(first) = first {
        let _ = push.send(first, zmq::DONTWAIT);
    }
    for tokens in [0..32, 0..16] {
        let (h, p) = forged_chunk(room, instance, tokens);
        let _ = push.send_multipart([h, p], zmq::DONTWAIT);
    }
}

#[test]
fn forged_chunks_never_land_and_the_real_bytes_verify() {
    let c = cluster("hostile-forged", &[("--checksum", "")]);
    let ctx = zmq::Context::new();
    let data = c.decode.field("data").unwrap();
    // Without a token anyone reaches the data port, but a connection is read only once it
    // proved itself with the key the decode gave its prefill in Hello: neither a chunk first,
    // nor an empty frame (what prefills before protocol version 11 send, accepted only while
    // one is a peer), nor a guessed key proves one.
    for (room, first) in [(1, None), (2, Some(&b""[..])), (3, Some(&[0x5a; 16][..]))] {
        let push = ctx.socket(zmq::PUSH).expect("PUSH");
        push.set_linger(0).ok();
        push.set_sndtimeo(0).ok();
        push.connect(&data)
            .expect("connect to the decode's data port");
        runtime().block_on(async {
            let counted = forged_then_real(&http(), &c, room, (&push, first)).await;
            println!(
                "[hostile-forged] no token, first {first:?}: the real room verified, {counted} forged chunks read"
            );
            assert_eq!(counted, 0.0, "a connection that never proved itself was read");
        });
    }
}

#[test]
fn with_a_token_forgers_cannot_connect_and_token_holders_cannot_forge() {
    let c = cluster(
        "hostile-forged-token",
        &[("--checksum", ""), ("--token", "s3cret")],
    );
    let ctx = zmq::Context::new();
    let data = c.decode.field("data").unwrap();
    let outsider = ctx.socket(zmq::PUSH).expect("PUSH");
    outsider.set_linger(0).ok();
    outsider.set_sndtimeo(0).ok();
    outsider.connect(&data).expect("connect");
    let insider = ctx.socket(zmq::PUSH).expect("PUSH");
    insider.set_linger(0).ok();
    insider.set_sndtimeo(0).ok();
    insider.set_plain_username(Some("kvferry")).ok();
    insider.set_plain_password(Some("s3cret")).ok();
    insider.connect(&data).expect("connect");
    runtime().block_on(async {
        let http = http_with_token("s3cret");
        // Without the token the handshake fails: nothing the outsider queues is delivered.
        let counted = forged_then_real(&http, &c, 1, (&outsider, None)).await;
        assert_eq!(counted, 0.0, "an unauthenticated peer's chunk reached the decode");
        // With the token (an insider) the handshake passes, but without a key the decode gave
        // it in Hello the connection is never read.
        let counted = forged_then_real(&http, &c, 2, (&insider, Some(&[0x5a; 16]))).await;
        println!("[hostile-forged-token] outsider refused at the handshake; insider's {counted} forged chunks read, the real rooms verified");
        assert_eq!(counted, 0.0, "a token holder's connection without a key was read");
    });
}

/// Starts a decode agent against the cluster's registry with `extra` flags.
fn rogue_decode(c: &FaultCluster, extra: &[&str]) -> Process {
    let mut args = owned(&[
        "decode",
        "--bootstrap",
        &c.registry_url,
        "--dp-size",
        "2",
        "--dp-rank",
        "1",
    ]);
    args.extend(all_timeouts(&opts(), 60_000, 30_000));
    args.extend(owned(extra));
    common::spawn(&release_binary(), &[], "rogue-decode", &args, &[], &c.logs)
}

#[test]
fn a_rogue_decode_gets_no_kv() {
    let c = cluster("hostile-rogue", &[("--token", "s3cret")]);
    let key = Secret::random().expect("random").to_hex();
    runtime().block_on(async {
        let http = http_with_token("s3cret");
        for (why, flags) in [
            ("no token", vec![]),
            ("a wrong token", vec!["--token", "guess"]),
        ] {
            let rogue = rogue_decode(&c, &flags);
            let rogue_http = http_with_token("guess");
            let api = rogue.field("api").unwrap();
            let url = format!("{api}/v1/rooms/77");
            expect(&rogue_http, Method::POST, &url, Some(&json!({"tokens": 32})), StatusCode::CREATED).await;
            let v = wait_final(&rogue_http, &api, 77).await;
            println!("[hostile-rogue] {why}: {} {}", v["state"], v["reason"]);
            assert_eq!(v["state"], "failed", "{v}");
            assert_eq!(v["reason"]["code"], "unauthorized", "{v}");
            assert_eq!(v["bytes"], 0, "{v}");
        }
        // The right token, but not the room's requester: the router gave the room's key to the
        // prefill and to the real decode only. Room 10: the rogue asks before the prefill engine
        // announces the room; room 11: after.
        let rogue = rogue_decode(&c, &["--token", "s3cret"]);
        let rogue_api = rogue.field("api").unwrap();
        for (room, rogue_first) in [(10u64, true), (11, false)] {
            let real = format!("{}/v1/rooms/{room}", c.decode_api);
            let fake = format!("{rogue_api}/v1/rooms/{room}");
            let ready = format!("{}/v1/rooms/{room}/ready", c.prefill_api);
            expect(&http, Method::POST, &real, Some(&json!({"tokens": 32, "room_key": key})), StatusCode::CREATED).await;
            if rogue_first {
                expect(&http, Method::POST, &fake, Some(&json!({"tokens": 32})), StatusCode::CREATED).await;
                wait_state(&http, &rogue_api, room, &["waiting_for_input"], BOUND).await;
            }
            expect(&http, Method::POST, &ready, Some(&json!({"tokens": 32, "room_key": key})), StatusCode::ACCEPTED).await;
            if !rogue_first {
                expect(&http, Method::POST, &fake, Some(&json!({"tokens": 32, "room_key": Secret::random().expect("random").to_hex()})), StatusCode::CREATED).await;
            }
            let v = wait_final(&http, &rogue_api, room).await;
            println!("[hostile-rogue] right token, room {room} (rogue first: {rogue_first}): {} {}", v["state"], v["reason"]);
            assert_eq!(v["state"], "failed", "{v}");
            assert_eq!(v["reason"]["code"], "unauthorized", "{v}");
            assert_eq!(v["bytes"], 0, "{v}");
            take_verified(&http, &c.decode_api, room).await;
        }
        let refused = metric(&http, &c.prefill_api, "kvferry_protocol_errors_total{role=\"prefill\",kind=\"unauthorized\"}").await;
        assert_eq!(refused, Some(2.0), "the prefill counted both keyless requests");
    });
}

/// A room whose prefill announced only its first two layers: mid-transfer for as long as the
/// test wants, whatever the machine's speed.
async fn half_sent_room(http: &Client, c: &FaultCluster, room: u64) {
    let url = format!("{}/v1/rooms/{room}", c.decode_api);
    expect(
        http,
        Method::POST,
        &url,
        Some(&json!({"tokens": 32})),
        StatusCode::CREATED,
    )
    .await;
    let ready = format!("{}/v1/rooms/{room}/ready", c.prefill_api);
    let piece = json!({"tokens": 32, "layer_range": [0, 2], "last": false});
    expect(
        http,
        Method::POST,
        &ready,
        Some(&piece),
        StatusCode::ACCEPTED,
    )
    .await;
    let half = 32 * TINY_BYTES_PER_TOKEN / 2;
    poll_until("half the room landed", BOUND, || async {
        let v = call(http, Method::GET, &url, None).await.1;
        (v["bytes"].as_u64() == Some(half)).then_some(())
    })
    .await;
}

#[test]
fn kill_9_of_either_agent_mid_transfer_is_seen_from_the_connection() {
    for victim in ["decode", "prefill"] {
        let c = cluster(
            &format!("hostile-kill-{victim}"),
            &[("--peer-dead-ms", "60000")],
        );
        runtime().block_on(async {
            let http = http();
            half_sent_room(&http, &c, 3).await;
            let (survivor, killed) = match victim {
                "decode" => (&c.prefill_api, &c.decode),
                _ => (&c.decode_api, &c.prefill),
            };
            killed.signal("KILL").unwrap();
            let t = Instant::now();
            let v = wait_final(&http, survivor, 3).await;
            let took = t.elapsed();
            println!(
                "[hostile-kill] kill -9 of the {victim} mid-transfer: the survivor's room {} ({}) {:.0} ms later (--peer-dead-ms 60000)",
                v["state"],
                v["reason"],
                ms(took)
            );
            assert_eq!(v["state"], "failed", "{v}");
            assert_eq!(v["reason"]["code"], "peer_dead", "{v}");
            assert!(took < Duration::from_secs(20), "took {took:?}: the heartbeat, not the connection");
            healthy(&http, survivor).await;
        });
    }
}

/// A listener on loopback that records the first bytes of every connection it accepts and
/// answers each with `answer`, if any: a fake registry (an HTTP answer) or a fake prefill.
struct Recorder {
    addr: String,
    got: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Recorder {
    fn start(answer: Option<Vec<u8>>) -> Recorder {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = got.clone();
        // Detached: it ends with the test process.
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                conn.set_read_timeout(Some(Duration::from_millis(500))).ok();
                let mut bytes = Vec::new();
                let mut buf = [0u8; 4096];
                while !bytes.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => bytes.extend_from_slice(&buf[..n]),
                    }
                }
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&bytes).into_owned());
                if let Some(answer) = &answer {
                    let _ = conn.write_all(answer);
                }
            }
        });
        Recorder { addr, got }
    }

    fn got(&self) -> Vec<String> {
        self.got.lock().unwrap().clone()
    }
}

#[test]
fn a_room_cannot_make_the_decode_send_its_token_to_a_registry_it_names() {
    let c = cluster("hostile-registry", &[("--token", "s3cret")]);
    let http = http_with_token("s3cret");
    runtime().block_on(async {
        // The fake registry lists the real prefill group, with the control endpoint of a fake
        // prefill: a decode that trusted it would ask it with its token, then say Hello there.
        let url = format!("{}/v1/groups/0", c.registry_url);
        let (status, group) = call(&http, Method::GET, &url, None).await;
        assert_eq!(status, StatusCode::OK, "{group}");
        let served = |prefill: &Recorder| {
            let real = c.prefill.field("control").unwrap();
            let body = group.to_string().replace(&real, &format!("tcp://{}", prefill.addr));
            assert_ne!(body, group.to_string(), "the group names {real}");
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            Some([head.into_bytes(), body.into_bytes()].concat())
        };
        let prefill = Recorder::start(None);
        let registry = Recorder::start(served(&prefill));
        let fake = format!("http://{}", registry.addr);
        let real = c.registry_url.clone();
        let room = |n: u64| format!("{}/v1/rooms/{n}", c.decode_api);
        for (n, why, bootstrap) in [
            (40, "a registry of its own", fake.clone()),
            (41, "a list that adds one", format!("{real},{fake}")),
            (42, "the trusted one as user info", format!("http://{}@{}", addr(&real), registry.addr)),
        ] {
            let body = json!({"tokens": 32, "bootstrap": bootstrap});
            let (status, v) = call(&http, Method::POST, &room(n), Some(&body)).await;
            println!("[hostile-registry] room naming {why}: {status} {v}");
            assert_eq!(status, StatusCode::FORBIDDEN, "{why}: {v}");
            assert!(v["error"].as_str().unwrap().contains("nothing was sent to it"), "{v}");
            let hold = format!("{}/hold", room(n));
            let (status, v) = call(&http, Method::POST, &hold, Some(&json!({"bootstrap": bootstrap}))).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "hold, {why}: {v}");
            let (status, _) = call(&http, Method::GET, &room(n), None).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "no room was made");
        }
        // The instrument works: a decode told to trust a second fake registry sends it the
        // token and connects to the prefill it lists. It runs after the refusals, whose
        // requests would have gone out first.
        let prefill2 = Recorder::start(None);
        let registry2 = Recorder::start(served(&prefill2));
        let trusting = rogue_decode(&c, &["--token", "s3cret", "--allowed-registries", &registry2.addr]);
        let api = trusting.field("api").unwrap();
        let body = json!({"tokens": 32, "bootstrap": format!("http://{}", registry2.addr)});
        expect(&http, Method::POST, &format!("{api}/v1/rooms/43"), Some(&body), StatusCode::CREATED).await;
        poll_until("the trusting decode reached the fake prefill", BOUND, || async {
            (!prefill2.got().is_empty()).then_some(())
        })
        .await;
        let asked = registry2.got();
        println!(
            "[hostile-registry] trusted: the fake registry got {} request(s), the fake prefill {} connection(s); untrusted: {} and {}",
            asked.len(),
            prefill2.got().len(),
            registry.got().len(),
            prefill.got().len()
        );
        assert!(
            asked.iter().any(|r| r.to_ascii_lowercase().contains("authorization: bearer s3cret")),
            "{asked:?}"
        );
        assert_eq!(registry.got(), Vec::<String>::new(), "the untrusted registry was contacted");
        assert_eq!(prefill.got(), Vec::<String>::new(), "the untrusted registry's prefill was contacted");
    });
}

/// Relays each connection to `listen` on to `to`, keeping every byte it carries each way (what
/// a reader on the path sees): (decode to prefill, prefill to decode), over all connections.
struct OnThePath {
    seen: std::sync::Arc<std::sync::Mutex<(Vec<u8>, Vec<u8>)>>,
}

impl OnThePath {
    fn start(listen: &str, to: String) -> OnThePath {
        use std::sync::{Arc, Mutex};
        let listener = std::net::TcpListener::bind(listen).expect("the path's port");
        let seen = Arc::new(Mutex::new((Vec::new(), Vec::new())));
        let all = seen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(&to) else {
                    return;
                };
                for (mut from, mut into, up) in [
                    (
                        client.try_clone().unwrap(),
                        server.try_clone().unwrap(),
                        true,
                    ),
                    (server, client, false),
                ] {
                    let seen = all.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 65536];
                        while let Ok(n @ 1..) = from.read(&mut buf) {
                            {
                                let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                                let side = if up { &mut s.0 } else { &mut s.1 };
                                side.extend_from_slice(&buf[..n]);
                            }
                            if into.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = into.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        OnThePath { seen }
    }

    fn seen(&self) -> (Vec<u8>, Vec<u8>) {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn holds(seen: &[u8], needle: &[u8]) -> bool {
    seen.windows(needle.len()).any(|w| w == needle)
}

/// One ZMTP 3 frame: whether it is a command, and its body.
struct Zmtp {
    command: bool,
    body: Vec<u8>,
}

impl Zmtp {
    /// The frame at the start of `bytes` and its length there.
    fn parse(bytes: &[u8]) -> Option<(Zmtp, usize)> {
        let flags = *bytes.first()?;
        let (len, head) = match flags & 0x02 {
            0 => (usize::from(*bytes.get(1)?), 2),
            _ => (
                usize::try_from(u64::from_be_bytes(bytes.get(1..9)?.try_into().ok()?)).ok()?,
                9,
            ),
        };
        let body = bytes.get(head..head + len)?.to_vec();
        let command = flags & 0x04 != 0;
        Some((Zmtp { command, body }, head + len))
    }

    /// The next frame read from `s`.
    fn read(s: &mut TcpStream) -> std::io::Result<Zmtp> {
        let mut head = [0u8; 9];
        s.read_exact(&mut head[..2])?;
        let len = match head[0] & 0x02 {
            0 => usize::from(head[1]),
            _ => {
                s.read_exact(&mut head[2..])?;
                u64::from_be_bytes(head[1..9].try_into().unwrap()) as usize
            }
        };
        let mut body = vec![0u8; len];
        s.read_exact(&mut body)?;
        Ok(Zmtp {
            command: head[0] & 0x04 != 0,
            body,
        })
    }

    /// The protocol message this frame holds, if it is one.
    fn message(&self) -> Option<Message> {
        (!self.command)
            .then(|| Message::decode(&self.body).ok())
            .flatten()
    }
}

/// The frames one side of a ZeroMQ connection sent (greeting, then frames), each with its
/// bytes as sent.
fn zmtp_frames(stream: &[u8]) -> Vec<(Zmtp, Vec<u8>)> {
    let mut at = 64;
    let mut out = Vec::new();
    while let Some((frame, len)) = stream.get(at..).and_then(Zmtp::parse) {
        out.push((frame, stream[at..at + len].to_vec()));
        at += len;
    }
    out
}

/// The protocol messages in what one side of a ZeroMQ connection sent.
fn messages(stream: &[u8]) -> Vec<Message> {
    zmtp_frames(stream)
        .iter()
        .filter_map(|(f, _)| f.message())
        .collect()
}

/// Replays what a ZeroMQ client sent (`stream`: greeting, then frames, ZMTP 3) to `s`, in step
/// with the server as the client was (each handshake command waits for the server's answer,
/// the protocol's Hello for the server's message), up to and with the first message frame
/// that decodes as `last`; then returns the messages the server answers with, until one that
/// decodes as one of `until` or the stream ends.
fn replay(s: &mut TcpStream, stream: &[u8], last: &str, until: &[&str]) -> Vec<Message> {
    s.write_all(&stream[..64]).expect("greeting");
    let mut greeting = [0u8; 64];
    s.read_exact(&mut greeting).expect("the server's greeting");
    let mut at = 64;
    loop {
        let (frame, len) =
            Zmtp::parse(&stream[at..]).unwrap_or_else(|| panic!("no {last} recorded"));
        s.write_all(&stream[at..at + len]).expect("replay");
        at += len;
        let sent = frame.message().map(|m| m.name());
        if sent == Some(last) {
            break;
        }
        // The client's HELLO and INITIATE are answered (WELCOME, READY), its Hello too.
        let name = frame
            .body
            .get(1..1 + usize::from(*frame.body.first().unwrap_or(&0)));
        let answered = matches!(name, Some(b"HELLO" | b"INITIATE")) || sent == Some("hello");
        if answered {
            let answer = Zmtp::read(s).expect("the server's answer");
            assert!(answer.command || sent.is_some(), "an answer out of step");
        }
    }
    let mut answers = Vec::new();
    while let Ok(frame) = Zmtp::read(s) {
        if let Some(m) = frame.message() {
            let done = until.contains(&m.name());
            answers.push(m);
            if done {
                break;
            }
        }
    }
    answers
}

/// A reader on the path between a decode and its prefill's control port never sees the token:
/// the prefill binds 127.0.0.1 and advertises 127.0.0.2, where a relay listens, so the decode
/// reaches it only through the relay; rooms land through it, the token proven, never sent
/// (with an agent older than protocol 12 both the ZeroMQ handshake and the Hello carried it).
/// The decode's recorded bytes up to its answer to the challenge, replayed on a connection of
/// their own, pass the ZeroMQ handshake (the password derived from the token is replayable)
/// and are refused: the challenge is new, the recorded answer proves nothing, no HelloAck.
#[test]
fn the_token_never_crosses_the_control_path_and_a_replayed_handshake_is_refused() {
    let tag = "hostile-token-path";
    let token = "s3cret-token-on-the-path";
    let mut args = all_timeouts(&opts(), 60_000, 30_000);
    set_flag(&mut args, "--token", token);
    let c = FaultCluster::start(tag, &args, &["--advertise-host", "127.0.0.2"], &[], &[]);
    let control = c.prefill.field("control").unwrap();
    let port = addr(&control).rsplit_once(':').unwrap().1.to_owned();
    assert!(control.starts_with("tcp://127.0.0.2:"), "{control}");
    let path = OnThePath::start(&format!("127.0.0.2:{port}"), format!("127.0.0.1:{port}"));
    let apis = kvferry::cluster::Apis::pair(&c.prefill_api, &c.decode_api)
        .with_token(Some(token.to_owned()));
    let results = runtime()
        .block_on(kvferry::cluster::drive_rooms(
            &apis,
            vec![(1, 32), (2, 64)],
            1,
        ))
        .expect("rooms through the path");
    assert!(
        results.iter().all(|r| r.verified && r.state == "success"),
        "{results:?}"
    );
    let (up, down) = path.seen();
    println!(
        "[{tag}] the path carried {} bytes to the prefill and {} back, 2 rooms verified",
        up.len(),
        down.len()
    );
    let acks = messages(&down)
        .iter()
        .filter(|m| m.name() == "hello_ack")
        .count();
    assert_eq!(
        acks, 1,
        "the decode's Hello was not answered through the path"
    );
    assert!(
        !holds(&up, token.as_bytes()),
        "the token crossed the path to the prefill"
    );
    assert!(
        !holds(&down, token.as_bytes()),
        "the token crossed the path to the decode"
    );
    // The recorded greeting, handshake, Hello and answer, on a connection of their own. They
    // present the decode's routing id: the decode is stopped, so that it does not reconnect
    // meanwhile (its connection is another peer's, as the replay's is).
    c.decode.signal("STOP").unwrap();
    let mut s = TcpStream::connect(format!("127.0.0.1:{port}")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let started = Instant::now();
    let answers = replay(&mut s, &up, "challenge_reply", &["error", "hello_ack"]);
    println!(
        "[{tag}] the replay was answered in {:?}: {answers:?}",
        started.elapsed()
    );
    let names: Vec<_> = answers.iter().map(Message::name).collect();
    assert!(
        !names.contains(&"hello_ack"),
        "a replayed handshake was accepted: {answers:?}"
    );
    let refused = answers.iter().any(|m| match m {
        Message::Error(e) => {
            e.code == kvferry::reason::FailureCode::Unauthorized && e.message.contains("token")
        }
        _ => false,
    });
    assert!(
        refused,
        "the replay was not refused as unauthorized: {answers:?}"
    );
    // Its connection presents the decode's routing id, yet is no peer: the decode's recorded
    // request for room 1, sent on it, is not served but answered "say Hello again".
    let request = zmtp_frames(&up)
        .into_iter()
        .find(|(f, _)| matches!(f.message(), Some(Message::TransferRequest(_))))
        .expect("a recorded request");
    s.write_all(&request.1).expect("the recorded request");
    let mut told = Vec::new();
    while let Ok(frame) = Zmtp::read(&mut s) {
        if let Some(Message::Error(e)) = frame.message() {
            let named = e.room.is_some();
            told.push(e);
            if named {
                break;
            }
        }
    }
    println!("[{tag}] the decode's request on the replay's connection: {told:?}");
    assert!(
        told.iter().any(|e| e.room == Some(1)
            && e.code == kvferry::reason::FailureCode::PeerDead
            && e.message.contains("say Hello again")),
        "a connection presenting the decode's routing id acted as the decode: {told:?}"
    );
    c.decode.signal("CONT").unwrap();
}

/// A decode's side of the handshake as the test plays it: a ZAP handler of its own (it
/// records the password each ZeroMQ connection to the test's sockets presents), a PULL data
/// socket behind it, and DEALERs to the prefill's control port.
struct PlayedDecode {
    ctx: zmq::Context,
    passwords: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    data: zmq::Socket,
    endpoint: String,
}

impl PlayedDecode {
    fn new() -> PlayedDecode {
        let ctx = zmq::Context::new();
        let zap = ctx.socket(zmq::REP).expect("REP");
        zap.bind("inproc://zeromq.zap.01")
            .expect("the ZAP endpoint");
        let passwords = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = passwords.clone();
        std::thread::spawn(move || {
            while let Ok(request) = zap.recv_multipart(0) {
                seen.lock()
                    .unwrap()
                    .push(request.get(7).cloned().unwrap_or_default());
                let id = request.get(1).cloned().unwrap_or_default();
                let ok: Vec<Vec<u8>> = vec![
                    b"1.0".to_vec(),
                    id,
                    b"200".to_vec(),
                    b"OK".to_vec(),
                    b"u".to_vec(),
                    vec![],
                ];
                if zap.send_multipart(ok, 0).is_err() {
                    return;
                }
            }
        });
        let data = ctx.socket(zmq::PULL).expect("PULL");
        data.set_plain_server(true).expect("PLAIN");
        data.set_zap_domain("played").expect("domain");
        data.set_linger(0).expect("linger");
        data.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = data.get_last_endpoint().unwrap().unwrap();
        PlayedDecode {
            ctx,
            passwords,
            data,
            endpoint,
        }
    }

    /// A DEALER to `control` presenting `password` (ZAP PLAIN).
    fn dealer(&self, control: &str, password: &str) -> zmq::Socket {
        let s = self.ctx.socket(zmq::DEALER).expect("DEALER");
        s.set_linger(0).expect("linger");
        s.set_rcvtimeo(30_000).expect("timeout");
        s.set_plain_username(Some("kvferry")).expect("user");
        s.set_plain_password(Some(password)).expect("password");
        s.connect(control).expect("connect");
        s
    }
}

fn next_message(s: &zmq::Socket) -> Message {
    let frame = s.recv_bytes(0).expect("an answer within 30 s");
    Message::decode(&frame).expect("an answer that decodes")
}

/// A version-12 prefill with a token serves a decode of version 11 on loopback the old way (the
/// token in the ZeroMQ handshake and in Hello; its data port gets the token too, as it
/// expects), and one of version 12 only through the challenge (its data port gets the derived
/// password, never the token); a version-12 Hello that carries the token instead of a nonce is
/// refused.
#[test]
fn the_token_goes_in_clear_only_to_a_decode_older_than_token_proofs() {
    let token = "s3cret-of-two-versions";
    let c = cluster("hostile-token-versions", &[("--token", token)]);
    let control = c.prefill.field("control").unwrap();
    let played = PlayedDecode::new();
    let hello = |max_version: u16, token: &str, nonce: Option<Secret>| {
        let mut hello = common::rogue::hello(played.endpoint.clone(), None, None);
        if let Message::Hello(h) = &mut hello {
            h.max_version = max_version;
            h.token = token.to_owned();
            h.chunk_key = Secret::random().unwrap();
            h.nonce = nonce;
        }
        hello.encode()
    };
    let derived = kvferry::protocol::zap_password(token);

    // Version 11: the token itself, both ways.
    let older = played.dealer(&control, token);
    older.send(hello(11, token, None), 0).expect("send");
    match next_message(&older) {
        Message::HelloAck(a) => assert_eq!(a.version, 11),
        other => panic!("an older decode on loopback was refused: {other:?}"),
    }
    let presented = played.passwords.lock().unwrap().clone();
    assert_eq!(
        presented,
        vec![token.as_bytes().to_vec()],
        "to an older decode's data port"
    );

    // Version 12 without a nonce: the token sent instead of proven is refused.
    let sends = played.dealer(&control, &derived);
    sends.send(hello(12, token, None), 0).expect("send");
    match next_message(&sends) {
        Message::Error(e) => {
            assert_eq!(e.code, kvferry::reason::FailureCode::Unauthorized, "{e:?}")
        }
        other => panic!("a version-12 Hello with the token in it was served: {other:?}"),
    }

    // Version 12: challenged, the prefill's proof checked, the answer proven.
    let newer = played.dealer(&control, &derived);
    let nonce = Secret::random().unwrap();
    let frame = hello(12, "", Some(nonce));
    newer.send(frame.clone(), 0).expect("send");
    let Message::Challenge(challenge) = next_message(&newer) else {
        panic!("a version-12 Hello with a nonce was not challenged")
    };
    let handshake = kvferry::protocol::Handshake {
        hello: &frame,
        decode_nonce: &nonce,
        prefill_nonce: &challenge.nonce,
    };
    use kvferry::protocol::Prover;
    assert!(
        handshake.verify(token, Prover::Prefill, &challenge.proof),
        "the prefill's proof"
    );
    let reply = Message::ChallengeReply(kvferry::protocol::ChallengeReply {
        proof: handshake.prove(token, Prover::Decode),
    });
    newer.send(reply.encode(), 0).expect("send");
    match next_message(&newer) {
        Message::HelloAck(a) => assert_eq!(a.version, 12),
        other => panic!("a proven decode was refused: {other:?}"),
    }
    let presented = played.passwords.lock().unwrap().clone();
    assert_eq!(presented.len(), 2, "{presented:?}");
    assert_eq!(
        presented[1],
        derived.as_bytes(),
        "to a version-12 decode's data port"
    );
    println!(
        "[hostile-token-versions] version 11 served with the token in clear on loopback; version 12 with it in place of a nonce refused; version 12 challenged and served, its data port given the derived password"
    );
    drop(played.data);
}
