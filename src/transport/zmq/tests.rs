//! The control sockets against each other and against raw peers: frames cross, the token is
//! enforced in the handshake, frames above the cap close only their connection, and a peer
//! whose connection drops is reported lost once the grace has passed.

use std::io::{Read as _, Write as _};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::control::ControlOptions;
use super::*;

const WAIT: Duration = Duration::from_secs(10);

fn options(token: Option<&str>) -> ControlOptions {
    ControlOptions {
        max_frame: 4096,
        auth: Auth::new(token),
        proof: None,
    }
}

/// Connects to `endpoint` with `token`, waiting at most `wait`; asserts the connect is refused
/// as unauthorized with a message that contains `says`, and prints how long it took.
async fn refused(endpoint: &str, wait: Duration, token: Option<&str>, says: &str) {
    let started = Instant::now();
    let e = ControlClient::connect(endpoint, wait, &options(token), Bytes::new())
        .await
        .err()
        .expect("refused");
    println!("{token:?}: {e} after {:?}", started.elapsed());
    assert_eq!(
        e.kind,
        crate::transport::TransportErrorKind::Unauthorized,
        "{e}"
    );
    assert!(e.message.contains(says), "{e}");
}

async fn next_frame(server: &mut ControlServer) -> (PeerId, Bytes) {
    match tokio::time::timeout(WAIT, server.recv()).await {
        Ok(Some(ControlEvent::Frame(peer, frame))) => (peer, frame),
        Ok(Some(other)) => panic!("expected a frame, got {other:?}"),
        Ok(None) => panic!("the socket thread stopped"),
        Err(_) => panic!("no frame within {WAIT:?}"),
    }
}

#[tokio::test]
async fn frames_cross_both_ways_with_the_token() {
    let (endpoint, mut server, replier) =
        ControlServer::bind("127.0.0.1", 0, &options(Some("t0k")))
            .await
            .expect("bind");
    let ControlClient { mut send, mut recv } =
        ControlClient::connect(&endpoint, WAIT, &options(Some("t0k")), Bytes::new())
            .await
            .expect("connect");
    send.send(Bytes::from_static(b"hello")).await.expect("send");
    let (peer, frame) = next_frame(&mut server).await;
    assert_eq!(&frame[..], b"hello");
    assert_eq!(
        control::routing_id(&peer).len(),
        16,
        "a decode names itself with 16 random bytes"
    );
    assert_eq!(peer.len(), 24, "then 8 bytes of its connection");
    replier
        .send(&peer, Bytes::from_static(b"ack"))
        .await
        .expect("reply");
    let back = tokio::time::timeout(WAIT, recv.recv())
        .await
        .expect("in time")
        .expect("frame");
    assert_eq!(&back[..], b"ack");
    // A peer that is not there is an error at once, not a silent drop.
    let e = replier
        .send(&Bytes::from_static(b"nobody"), Bytes::from_static(b"x"))
        .await
        .expect_err("no such peer");
    assert!(e.message.contains("no such peer"), "{e}");
}

#[tokio::test]
async fn the_password_derived_from_the_token_or_the_token_itself_passes_and_nothing_else() {
    let (endpoint, mut server, _replier) =
        ControlServer::bind("127.0.0.1", 0, &options(Some("t0k")))
            .await
            .expect("bind");
    for (what, options) in [
        ("derived", options(Some("t0k"))),
        ("in clear, as an older peer", {
            let mut o = options(Some("t0k"));
            o.auth = o.auth.in_clear();
            o
        }),
    ] {
        let ControlClient {
            mut send,
            recv: _recv,
        } = ControlClient::connect(&endpoint, WAIT, &options, Bytes::new())
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        send.send(Bytes::from_static(b"in")).await.expect("send");
        assert_eq!(&next_frame(&mut server).await.1[..], b"in", "{what}");
    }
    refused(&endpoint, WAIT, Some("t0k2"), "refused this agent's token").await;
}

/// A prefill's control socket takes a connection's messages only once one proves it (a valid
/// Hello). A decode whose connection is re-established is another peer: its first frame there
/// (a heartbeat, not a Hello) is delivered, under its routing id and a new connection, so that
/// the agent can ask it to say Hello again; nothing sent to the first connection's peer goes
/// to the new one, and that peer is lost after the grace.
#[tokio::test]
async fn a_re_established_connection_is_a_new_peer_of_the_same_routing_id() {
    let mut opts = options(Some("t0k"));
    opts.proof = Some(|frame: &[u8]| frame == b"hello");
    let (endpoint, mut server, replier) = ControlServer::bind("127.0.0.1", 0, &opts)
        .await
        .expect("bind");
    let ControlClient {
        mut send,
        recv: _recv,
    } = ControlClient::connect(&endpoint, WAIT, &opts, Bytes::from_static(b"beat"))
        .await
        .expect("connect");
    send.send(Bytes::from_static(b"before"))
        .await
        .expect("send");
    send.send(Bytes::from_static(b"hello")).await.expect("send");
    let (peer, first) = next_frame(&mut server).await;
    assert_eq!(
        &first[..],
        b"hello",
        "a frame before the proof was delivered"
    );
    // One byte over the cap: the server closes the connection, the client reconnects.
    send.send(Bytes::from(vec![7u8; 4097]))
        .await
        .expect("queued");
    let (again, beat) = next_frame(&mut server).await;
    assert_eq!(&beat[..], b"beat");
    assert_eq!(control::routing_id(&again), control::routing_id(&peer));
    assert_ne!(
        again, peer,
        "the re-established connection is the same peer"
    );
    let e = replier
        .send(&peer, Bytes::from_static(b"to the first"))
        .await
        .expect_err("sent to the new connection");
    assert!(e.message.contains("no such peer"), "{e}");
    replier
        .send(&again, Bytes::from_static(b"to the new one"))
        .await
        .expect("sent");
    match tokio::time::timeout(WAIT, server.recv()).await {
        Ok(Some(ControlEvent::Lost(lost, why))) => {
            assert_eq!(lost, peer, "{why}");
        }
        other => panic!("expected the first connection's peer lost, got {other:?}"),
    }
}

#[tokio::test]
async fn a_wrong_or_missing_token_fails_the_handshake_as_unauthorized() {
    let (endpoint, _server, _replier) =
        ControlServer::bind("127.0.0.1", 0, &options(Some("right")))
            .await
            .expect("bind");
    for (token, says) in [
        (Some("wrong"), "refused this agent's token"),
        (None, "another security mechanism"),
    ] {
        refused(&endpoint, WAIT, token, says).await;
    }
}

#[tokio::test]
async fn a_peer_closing_every_connection_in_the_handshake_is_a_refusal_not_a_timeout() {
    // What a prefill wanting another mechanism looks like when its mismatch is never
    // reported: each connection closed once the greetings start. Only the count of dropped
    // handshakes can end the connect; its timeout is a minute.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("tcp://{}", listener.local_addr().expect("address"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let mut greeting = [0u8; 10];
            let _ = s.read_exact(&mut greeting);
        }
    });
    refused(
        &endpoint,
        Duration::from_secs(60),
        None,
        "closed 3 connections",
    )
    .await;
}

/// A raw TCP peer: a ZMTP 3.0 greeting (NULL mechanism, as client), then `rest`.
fn raw_peer(endpoint: &str, rest: &[u8]) -> std::net::TcpStream {
    let addr = endpoint.trim_start_matches("tcp://");
    let mut s = std::net::TcpStream::connect(addr).expect("tcp connect");
    let mut greeting = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 0];
    greeting.extend_from_slice(b"NULL");
    greeting.resize(64, 0);
    s.write_all(&greeting).expect("greeting");
    let _ = s.write_all(rest);
    s
}

/// Whether the peer closed `s` within `WAIT` (reads until EOF or a reset).
fn closed_by_peer(s: &mut std::net::TcpStream) -> bool {
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

#[tokio::test]
async fn a_frame_announcing_more_than_the_cap_closes_its_connection_only() {
    let (endpoint, mut server, _replier) = ControlServer::bind("127.0.0.1", 0, &options(None))
        .await
        .expect("bind");
    // A READY command is itself a frame: announce 2^40 bytes for it (long frame, command).
    let mut huge = vec![0x06];
    huge.extend_from_slice(&(1u64 << 40).to_be_bytes());
    let ep = endpoint.clone();
    let closed = tokio::task::spawn_blocking(move || closed_by_peer(&mut raw_peer(&ep, &huge)))
        .await
        .expect("raw peer");
    assert!(closed, "libzmq kept a connection that announced 2^40 bytes");
    // The socket serves the next peer. (A connection lives as long as its receiving half.)
    let ControlClient {
        mut send,
        recv: _recv,
    } = ControlClient::connect(&endpoint, WAIT, &options(None), Bytes::new())
        .await
        .expect("connect after the attack");
    send.send(Bytes::from_static(b"still here"))
        .await
        .expect("send");
    assert_eq!(&next_frame(&mut server).await.1[..], b"still here");
    // A frame one byte over the cap from a real client closes its connection too; the frame
    // never arrives, and the client's next frame does once libzmq has reconnected.
    let ControlClient {
        send: mut big,
        recv: _big_recv,
    } = ControlClient::connect(
        &endpoint,
        WAIT,
        &options(None),
        Bytes::from_static(b"again"),
    )
    .await
    .expect("connect");
    big.send(Bytes::from(vec![7u8; 4097]))
        .await
        .expect("queued");
    // The server dropped the connection; the client is back and says so at once.
    assert_eq!(&next_frame(&mut server).await.1[..], b"again");
    big.send(Bytes::from_static(b"after")).await.expect("send");
    assert_eq!(&next_frame(&mut server).await.1[..], b"after");
}

#[tokio::test]
async fn a_peer_whose_connection_drops_is_lost_after_the_grace_on_both_sides() {
    let (endpoint, mut server, replier) = ControlServer::bind("127.0.0.1", 0, &options(None))
        .await
        .expect("bind");
    let client = ControlClient::connect(&endpoint, WAIT, &options(None), Bytes::new())
        .await
        .expect("connect");
    let ControlClient { mut send, recv } = client;
    send.send(Bytes::from_static(b"hi")).await.expect("send");
    let (peer, _) = next_frame(&mut server).await;
    // The client goes away (as a killed process: its socket closes).
    drop((send, recv));
    let started = Instant::now();
    match tokio::time::timeout(WAIT, server.recv()).await {
        Ok(Some(ControlEvent::Lost(lost, why))) => {
            println!("server: lost after {:?}: {why}", started.elapsed());
            assert_eq!(lost, peer);
            assert!(
                started.elapsed() >= RECONNECT_GRACE,
                "lost before the grace"
            );
        }
        other => panic!("expected the peer lost, got {other:?}"),
    }
    // And the other way: the server goes away, the client's receive fails as soon as its
    // retry is refused (nothing listens on the port any more).
    let ControlClient {
        recv: mut r2,
        send: _s2,
    } = ControlClient::connect(&endpoint, WAIT, &options(None), Bytes::new())
        .await
        .expect("connect");
    drop((server, replier));
    let started = Instant::now();
    let e = tokio::time::timeout(WAIT, r2.recv())
        .await
        .expect("within the bound")
        .expect_err("lost");
    println!("client: lost after {:?}: {e}", started.elapsed());
    assert!(e.message.contains("reconnecting to it was refused"), "{e}");
}

/// Frames sent while the peer does not read fill libzmq's queues; the sends wait (they are not
/// failed as a dead connection) and every frame arrives, in order, once the peer reads. Frames
/// posted without waiting to a peer that does not read are bounded per peer.
#[tokio::test]
async fn a_peer_that_reads_late_gets_every_frame_in_order_and_posts_are_bounded() {
    const FRAME: usize = 256 << 10;
    const FRAMES: usize = 120;
    let opts = ControlOptions {
        max_frame: FRAME,
        auth: Auth::new(None),
        proof: None,
    };
    let (endpoint, mut server, replier) = ControlServer::bind("127.0.0.1", 0, &opts)
        .await
        .expect("bind");
    let ControlClient { mut send, mut recv } =
        ControlClient::connect(&endpoint, WAIT, &opts, Bytes::new())
            .await
            .expect("connect");
    // The decode's direction: the server's owner does not read until every send was issued.
    let sender = tokio::spawn(async move {
        for i in 0..FRAMES {
            let frame = Bytes::from(vec![u8::try_from(i % 251).unwrap_or(0); FRAME]);
            send.send(frame)
                .await
                .map_err(|e| format!("frame {i}: {e}"))?;
        }
        Ok::<_, String>(send)
    });
    // Long enough for libzmq's queues and the socket buffers to fill behind an idle reader.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut peer = None;
    for i in 0..FRAMES {
        let (p, frame) = next_frame(&mut server).await;
        assert_eq!(frame.len(), FRAME);
        assert!(
            frame.iter().all(|&b| usize::from(b) == i % 251),
            "frame {i} out of order"
        );
        peer = Some(p);
    }
    tokio::time::timeout(WAIT, sender)
        .await
        .expect("every send resolved")
        .expect("sender task")
        .expect("no send failed");
    // The prefill's direction: posts to a decode that never reads stop at the bound; the ones
    // that go arrive in the order they were posted.
    let peer = peer.expect("a peer");
    for i in 0..(control::PENDING_PER_PEER * 4) {
        let mut frame = vec![0u8; FRAME];
        frame[..8].copy_from_slice(&(i as u64).to_le_bytes());
        replier.post(&peer, Bytes::from(frame), WAIT);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (mut got, mut last) = (0, None::<u64>);
    while let Ok(Ok(frame)) = tokio::time::timeout(Duration::from_secs(2), recv.recv()).await {
        assert_eq!(frame.len(), FRAME);
        let index = u64::from_le_bytes(frame[..8].try_into().expect("8 bytes"));
        assert!(
            last.is_none_or(|l| index > l),
            "post {index} after {last:?}"
        );
        last = Some(index);
        got += 1;
    }
    println!(
        "{got} of {} posted frames arrived",
        control::PENDING_PER_PEER * 4
    );
    assert!(
        got > control::PENDING_PER_PEER,
        "a full queue waited out: {got}"
    );
    assert!(
        got < control::PENDING_PER_PEER * 4,
        "posts are bounded per peer: {got}"
    );
}
