//! Tests of the ZeroMQ data plane: chunks cross both socket families and their payloads are
//! released, chunks sent from a pool arrive in pieces, closed senders end their sends, and
//! messages of another shape are refused.

use super::*;
use crate::transport::FRAME_ROOM;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The proof the tests' senders present, and the check their receivers run.
const PROOF: &[u8] = b"0123456789abcdef";

/// The header of a chunk from a sender the receiver knows (the key in a real chunk header).
const KNOWN_HEADER: &[u8] = b"header of a known sender";

fn check() -> ProofCheck {
    Arc::new(|frame: &[u8]| frame == PROOF || frame == KNOWN_HEADER)
}

fn proof() -> Credentials {
    Credentials {
        proof: Bytes::from_static(PROOF),
        token_in_clear: false,
    }
}

/// A payload owner that counts its drops, as a staging slot returns to its pool.
struct Counted(Vec<u8>, Arc<AtomicUsize>);

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.1.fetch_add(1, Ordering::SeqCst);
    }
}

async fn round_trip(kind: TransportKind) {
    let t = ZmqData::new(kind, 2 << 20, Auth::default());
    let (endpoint, mut rx) = t.listen("127.0.0.1", 0, check()).await.expect("listen");
    let mut tx = t
        .connect(&endpoint, Duration::from_secs(5), proof())
        .await
        .expect("connect");
    let dropped = Arc::new(AtomicUsize::new(0));
    for i in 0..20u8 {
        let buf = vec![i; FRAME_ROOM + (1 << 20)];
        let addr = buf[FRAME_ROOM..].as_ptr();
        let counted = |buf| Bytes::from_owner(Counted(buf, dropped.clone()));
        let frame = Frame::in_place(&[i, 1, 2], buf, counted).expect("frame");
        assert_eq!(
            frame.payload().as_ptr(),
            addr,
            "the frame is built in place"
        );
        tx.send(frame).await.expect("send");
        let (h, p) = rx.recv().await.expect("recv");
        assert_eq!(&h[..], &[i, 1, 2]);
        assert_eq!(p.len(), 1 << 20);
        assert!(p.iter().all(|&b| b == i));
        assert_ne!(p.as_ptr(), addr, "a copy crossed a socket");
    }
    // The sender drops each payload once libzmq has written it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while dropped.load(Ordering::SeqCst) < 20 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(dropped.load(Ordering::SeqCst), 20);
    tx.send(Frame::header_only(b"h"))
        .await
        .expect("empty payload");
    let (_, p) = rx.recv().await.expect("recv");
    assert!(p.is_empty());
}

#[tokio::test]
async fn chunks_cross_tcp_and_payloads_are_released() {
    round_trip(TransportKind::ZmqTcp).await;
}

#[tokio::test]
async fn chunks_cross_ipc_and_payloads_are_released() {
    round_trip(TransportKind::ZmqIpc).await;
}

#[tokio::test]
async fn a_chunk_sent_from_a_pool_arrives_in_pieces_and_holds_the_pool_until_written() {
    use crate::layout::{KvLayout, ModelSpec};
    let t = ZmqData::new(TransportKind::ZmqTcp, 2 << 20, Auth::default());
    let (endpoint, mut rx) = t.listen("127.0.0.1", 0, check()).await.expect("listen");
    let mut tx = t
        .connect(&endpoint, Duration::from_secs(5), proof())
        .await
        .expect("connect");
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let pool = Arc::new(HostPool::anonymous(layout, 64).unwrap());
    let bytes: Vec<u8> = (0..pool.size()).map(|i| (i * 7 % 251) as u8).collect();
    pool.write(0, &bytes).unwrap();
    let spans =
        [(5000, 3000), (100, 1), (70_000, 65_536)].map(|(offset, len)| Span { offset, len });
    let sent = tx.send_from(Frame::header_only(b"hdr"), pool.clone(), spans.to_vec());
    let (h, p) = rx.recv_payload().await.expect("recv");
    assert_eq!(&h[..], b"hdr");
    let Payload::Pieces(pieces) = p else {
        panic!("three ranges come as three pieces: {p:?}")
    };
    for (piece, span) in pieces.iter().zip(&spans) {
        let at = span.offset as usize;
        assert_eq!(&piece[..], &bytes[at..at + span.len as usize]);
    }
    assert_eq!(pieces.len(), 3);
    tokio::time::timeout(Duration::from_secs(10), sent)
        .await
        .expect("resolved once libzmq let go of the ranges")
        .expect("sent");
    // Only the test holds the pool again: every frame let go of it.
    assert_eq!(Arc::strong_count(&pool), 1);
    // One range comes as one payload, as a gathered chunk does.
    let one = vec![Span { offset: 8, len: 16 }];
    tx.send_from(Frame::header_only(b"h1"), pool.clone(), one)
        .await
        .expect("sent");
    let (_, p) = rx.recv_payload().await.expect("recv");
    assert!(
        matches!(&p, Payload::Host(b) if b[..] == bytes[8..24]),
        "{p:?}"
    );
    // Ranges outside the pool, or too many, are refused before anything is sent.
    let outside = vec![Span {
        offset: pool.size() as u64 - 4,
        len: 8,
    }];
    let many = vec![Span { offset: 0, len: 1 }; MAX_PIECES + 1];
    for runs in [outside, many] {
        let e = tx
            .send_from(Frame::header_only(b"x"), pool.clone(), runs)
            .await
            .expect_err("refused");
        assert!(e.to_string().contains("outside the pool"), "{e}");
    }
}

#[tokio::test]
async fn closing_a_sender_ends_sends_its_gone_peer_never_takes() {
    let t = ZmqData::new(TransportKind::ZmqTcp, 2 << 20, Auth::default());
    let (endpoint, rx) = t.listen("127.0.0.1", 0, check()).await.expect("listen");
    let mut tx = t
        .connect(&endpoint, Duration::from_secs(5), proof())
        .await
        .expect("connect");
    // The receiver goes. Sends go on being queued until libzmq has noticed and its queue
    // is full; from then on a send waits for a peer that will never take it.
    drop(rx);
    let mut stuck = None;
    for i in 0..100_000u32 {
        let mut send = tx.send(Frame::header_only(&i.to_le_bytes()));
        if tokio::time::timeout(Duration::from_millis(200), &mut send)
            .await
            .is_err()
        {
            stuck = Some(send);
            break;
        }
    }
    let stuck = stuck.expect("a send to a gone peer waits");
    let queued_after = tx.send(Frame::header_only(b"queued behind it"));
    let closed = std::time::Instant::now();
    tx.close();
    for send in [stuck, queued_after] {
        // It ends: with the close's error, or sent if libzmq took it at the last moment.
        let r = tokio::time::timeout(Duration::from_secs(30), send)
            .await
            .expect("the send ended once the sender closed");
        if let Err(e) = r {
            assert!(e.to_string().contains("peer is gone"), "{e}");
        }
    }
    println!("sends ended {:?} after the close", closed.elapsed());
    let after = tx.send(Frame::header_only(b"late")).await;
    assert!(
        after
            .expect_err("closed")
            .to_string()
            .contains("peer is gone")
    );
}

#[tokio::test]
async fn connect_to_nobody_fails_after_the_timeout() {
    let t = ZmqData::new(TransportKind::ZmqTcp, 1 << 20, Auth::default());
    // A port that was just free: bind and drop a listener.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let start = std::time::Instant::now();
    let r = t
        .connect(
            &format!("tcp://127.0.0.1:{port}"),
            Duration::from_millis(300),
            proof(),
        )
        .await;
    let e = r.err().expect("unreachable");
    assert_eq!(e.op, "connect");
    assert!(e.message.contains("no answer"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn a_message_of_another_shape_is_an_error_and_the_socket_goes_on() {
    let t = ZmqData::new(TransportKind::ZmqTcp, 1 << 20, Auth::default());
    let (endpoint, mut rx) = t.listen("127.0.0.1", 0, check()).await.expect("listen");
    let raw = context().socket(zmq::PUSH).expect("socket");
    raw.connect(&endpoint).expect("connect");
    raw.send(PROOF, 0).expect("send");
    raw.send("one frame", 0).expect("send");
    raw.send_multipart(vec!["p"; MAX_PIECES + 2], 0)
        .expect("send");
    raw.send_multipart(["h", "p"], 0).expect("send");
    raw.send_multipart(["h", "p", "q"], 0).expect("send");
    for _ in 0..2 {
        let e = rx.recv().await.expect_err("not a chunk");
        assert!(e.to_string().contains("1 to 8 payload frames"), "{e}");
    }
    let (h, p) = rx.recv().await.expect("a good chunk after bad ones");
    assert_eq!((&h[..], &p[..]), (&b"h"[..], &b"p"[..]));
    // A chunk in pieces, joined for a caller that takes one buffer.
    let (h, p) = rx.recv().await.expect("a chunk in pieces");
    assert_eq!((&h[..], &p[..]), (&b"h"[..], &b"pq"[..]));
}

/// The local addresses of the established TCP connections to `port` on 127.0.0.1 (IPv4, or
/// IPv4-mapped on a socket that allows IPv6).
fn connections_to(port: u16) -> Vec<String> {
    let remote = format!("0100007F:{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|path| {
            std::fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .skip(1)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // f[1] local, f[2] remote, f[3] state (01: established).
            (f.get(2).is_some_and(|r| r.ends_with(&remote)) && f.get(3) == Some(&"01"))
                .then(|| f[1].to_owned())
        })
        .collect()
}

#[tokio::test]
async fn a_connection_idle_past_the_proof_deadline_before_its_first_chunk_is_kept() {
    // A decode's receiver shuts down connections whose first message does not come within the
    // proof deadline; a prefill connects when the decode says Hello and may compute the first
    // room longer than that. The sender proves its connection at once, so it is kept (a
    // dropped one would be replaced by a connection from another local port), and no chunk
    // is ever sent into one being shut down.
    let t = ZmqData::new(TransportKind::ZmqTcp, 1 << 20, Auth::default());
    let (endpoint, mut rx) = t.listen("127.0.0.1", 0, check()).await.expect("listen");
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let mut tx = t
        .connect(&endpoint, Duration::from_secs(5), proof())
        .await
        .expect("connect");
    let before = connections_to(port);
    assert_eq!(before.len(), 1, "{before:?}");
    tokio::time::sleep(kvferry_wire::admission::PROOF_DEADLINE + Duration::from_secs(2)).await;
    assert_eq!(
        connections_to(port),
        before,
        "the idle connection was replaced"
    );
    let frame = Frame::in_place(&[7], vec![0; FRAME_ROOM + 5], Bytes::from).expect("frame");
    tx.send(frame).await.expect("send");
    let (h, p) = rx.recv().await.expect("the first chunk");
    assert_eq!((&h[..], p.len()), (&[7u8][..], 5));
}

#[tokio::test]
async fn nothing_is_read_from_a_data_connection_before_a_valid_proof() {
    let t = ZmqData::new(TransportKind::ZmqTcp, 1 << 20, Auth::default());
    let (endpoint, mut rx) = t.listen("127.0.0.1", 0, check()).await.expect("listen");
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    // Garbage, an empty frame, a wrong key and a well-formed chunk: none is a proof, none is
    // read.
    let rogue = context().socket(zmq::PUSH).expect("socket");
    // Once shut down it stays down: libzmq would connect again within 100 ms, a new unproven
    // connection beside the proven one (CI saw the count go to 1, then back to 2).
    rogue.set_reconnect_ivl(-1).expect("no reconnection");
    rogue.connect(&endpoint).expect("connect");
    rogue.send("garbage", 0).expect("send");
    rogue.send("", 0).expect("send");
    rogue.send(&b"0123456789abcdeX"[..], 0).expect("send");
    rogue.send_multipart(["forged", "chunk"], 0).expect("send");
    // A sender with the key, connected after it: its chunk is the first one delivered.
    let mut tx = t
        .connect(&endpoint, Duration::from_secs(5), proof())
        .await
        .expect("connect");
    let frame = Frame::in_place(&[7], vec![0; FRAME_ROOM + 5], Bytes::from).expect("frame");
    tx.send(frame).await.expect("send");
    let (h, p) = rx.recv().await.expect("the proven sender's chunk");
    assert_eq!(
        (&h[..], p.len()),
        (&[7u8][..], 5),
        "a rogue message was read"
    );
    // The unproven connection is shut down at the deadline; the proven one stays.
    let deadline =
        Instant::now() + kvferry_wire::admission::PROOF_DEADLINE + Duration::from_secs(60);
    while connections_to(port).len() > 1 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        connections_to(port).len(),
        1,
        "the unproven connection is still open"
    );
    let frame = Frame::in_place(&[8], vec![0; FRAME_ROOM + 1], Bytes::from).expect("frame");
    tx.send(frame).await.expect("send");
    let (h, _) = rx.recv().await.expect("the proven sender's second chunk");
    assert_eq!(&h[..], &[8u8][..]);
}

#[tokio::test]
async fn a_chunk_that_overtakes_the_proof_proves_its_connection_by_its_header() {
    // After libzmq re-establishes a connection, a chunk being sent may go before the proof the
    // sender sends again: a header the check accepts proves the connection, and the chunk lands.
    let t = ZmqData::new(TransportKind::ZmqTcp, 1 << 20, Auth::default());
    let (endpoint, mut rx) = t.listen("127.0.0.1", 0, check()).await.expect("listen");
    let raw = context().socket(zmq::PUSH).expect("socket");
    raw.connect(&endpoint).expect("connect");
    raw.send_multipart([KNOWN_HEADER, b"payload"], 0)
        .expect("send");
    raw.send(PROOF, 0).expect("send");
    raw.send_multipart([KNOWN_HEADER, b"second"], 0)
        .expect("send");
    let (h, p) = rx.recv().await.expect("the chunk that came first");
    assert_eq!((&h[..], &p[..]), (KNOWN_HEADER, &b"payload"[..]));
    let (_, p) = rx
        .recv()
        .await
        .expect("the chunk after the proof sent again");
    assert_eq!(
        &p[..],
        &b"second"[..],
        "the proof sent again landed as a chunk"
    );
}
