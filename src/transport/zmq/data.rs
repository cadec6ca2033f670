//! The `zmq-tcp` / `zmq-ipc` data plane on libzmq (the `zmq` crate; libzmq 4.3 built from
//! source by `zeromq-src`): PUSH on the prefill, PULL on the decode, one two-frame message per
//! chunk (header, payload).
//!
//! libzmq sockets are not thread-safe, so each socket lives on a small thread of its own; the
//! async trait methods hand it work over a channel and await the answer, and never block the
//! tokio reactor.
//!
//! Copies: the payload is sent zero-copy (`zmq_msg_init_data`): libzmq holds the caller's
//! `Bytes` until its I/O thread has written the bytes into the kernel, then drops it (which
//! returns a staging slot to its pool). libzmq's encoder hands a large frame's memory straight
//! to `send(2)` and its decoder reads a large frame straight into the message's own buffer,
//! which the receiver hands out as `Bytes` without a copy. Each payload byte is copied twice on
//! its way, by the kernel's send and receive; the header (tens of bytes) is copied.
//!
//! It replaced the `zeromq` crate's PUSH/PULL, which copies every payload into its write
//! buffer and zero-fills its read buffer; docs/benchmarks.md ("ZeroMQ data plane") has both
//! measured side by side, and the cost of the thread hops.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::monitor::{Event, Monitor};
use super::{Auth, context, owned, rest_of_message, spawn, tcp_address};
use crate::transport::{
    BoxFuture, DataReceiver, DataSender, Frame, Listening, Transport, TransportError, TransportKind,
};

/// Messages queued per connection before a send blocks (or a receive stops reading). Credits
/// already bound the chunks in flight per peer pair to the decode's staging slots (8 by
/// default), so this is a backstop against a peer that ignores them, not the flow control.
pub const HWM: i32 = 16;

/// Largest header frame (a Chunk message) a receiver accepts next to its payload limit.
pub const MAX_HEADER: usize = 64 << 10;

/// How long a socket thread blocks in libzmq before it looks whether its owner is gone.
const POLL_MS: i32 = 100;

/// How long a closed sender still tries to deliver chunks libzmq has queued (each holds a
/// staging slot until then).
const LINGER_MS: i32 = 5_000;

/// Chunks a receiver thread takes off the socket ahead of `recv`.
const RECV_AHEAD: usize = 2;

/// The libzmq data plane of one kind (`zmq-tcp` or `zmq-ipc`).
#[derive(Debug)]
pub struct ZmqData {
    kind: TransportKind,
    /// Largest frame a receiver accepts: the larger of its chunk size and [`MAX_HEADER`].
    max_frame: usize,
    auth: Auth,
}

impl ZmqData {
    /// The libzmq data plane over `kind`'s socket family, for chunks of at most `max_chunk`
    /// payload bytes, authenticating with `auth`.
    pub fn new(kind: TransportKind, max_chunk: usize, auth: Auth) -> Self {
        ZmqData {
            kind,
            max_frame: max_chunk.max(MAX_HEADER),
            auth,
        }
    }
}

/// A bind address for `host` on `port` (tcp; 0: a fresh one) or a fresh socket file (ipc).
fn bind_address(kind: TransportKind, host: &str, port: u16) -> String {
    match kind {
        TransportKind::ZmqIpc => {
            let dir = std::env::temp_dir();
            let name = format!("kvferry-{}.sock", uuid::Uuid::new_v4().simple());
            format!("ipc://{}", dir.join(name).display())
        }
        _ => tcp_address(host, port),
    }
}

impl Transport for ZmqData {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    fn listen(
        &self,
        host: &str,
        port: u16,
    ) -> BoxFuture<'static, Result<Listening, TransportError>> {
        let address = bind_address(self.kind, host, port);
        let (max_frame, auth) = (self.max_frame, self.auth.clone());
        Box::pin(async move {
            let (bound_tx, bound_rx) = oneshot::channel();
            let (chunks_tx, chunks_rx) = mpsc::channel(RECV_AHEAD);
            let addr = address.clone();
            spawn("kvferry-zmq-pull", move || {
                match bind(&addr, max_frame, &auth) {
                    Ok((mut socket, monitor, endpoint, _zap)) => {
                        let _ = bound_tx.send(Ok(endpoint.clone()));
                        receive_loop(&socket, &monitor, &endpoint, &chunks_tx);
                        super::monitor::stop(&mut socket);
                    }
                    Err(e) => {
                        let _ = bound_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| TransportError::new("bind", &address, e))?;
            let endpoint = bound_rx
                .await
                .map_err(|_| TransportError::new("bind", &address, "socket thread stopped"))??;
            let receiver: Box<dyn DataReceiver> = Box::new(ZmqReceiver {
                chunks: chunks_rx,
                endpoint: endpoint.clone(),
            });
            Ok((endpoint, receiver))
        })
    }

    fn connect(
        &self,
        endpoint: &str,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<Box<dyn DataSender>, TransportError>> {
        let endpoint = endpoint.to_owned();
        let auth = self.auth.clone();
        Box::pin(async move {
            let (connected_tx, connected_rx) = oneshot::channel();
            let (jobs_tx, jobs_rx) = std_mpsc::channel::<Job>();
            let closed = Arc::new(AtomicBool::new(false));
            let closing = closed.clone();
            let ep = endpoint.clone();
            spawn("kvferry-zmq-push", move || {
                let mut socket = match connect(&ep, timeout, &auth) {
                    Ok(s) => {
                        let _ = connected_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = connected_tx.send(Err(e));
                        return;
                    }
                };
                // Ends when the sender is dropped; the socket then lingers for queued chunks.
                while let Ok(job) = jobs_rx.recv() {
                    if let Some(result) = send_chunk(&mut socket, &job, &closing) {
                        let _ = job.done.send(result.map_err(|e| match e {
                            Unsent::Closed => TransportError::new("send", &ep, CLOSED),
                            Unsent::Zmq(e) => {
                                TransportError::new("send", &ep, format!("libzmq: {e}"))
                            }
                        }));
                    }
                }
            })
            .map_err(|e| TransportError::new("connect", &endpoint, e))?;
            // The thread answers within `timeout`; the margin only guards against a stuck one.
            let answer = tokio::time::timeout(timeout + Duration::from_secs(1), connected_rx).await;
            match answer {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => return Err(e),
                Ok(Err(_)) | Err(_) => {
                    return Err(TransportError::new(
                        "connect",
                        &endpoint,
                        format!("no answer within {timeout:?}"),
                    ));
                }
            }
            let sender: Box<dyn DataSender> = Box::new(ZmqSender {
                jobs: Some(jobs_tx),
                closed,
                endpoint,
            });
            Ok(sender)
        })
    }
}

/// The pieces of a bound receiver: the socket, its monitor, the endpoint it listens on (the
/// OS's port, the socket file) and its ZAP registration (kept as long as the socket).
type Bound = (zmq::Socket, Monitor, String, Option<super::zap::Domain>);

/// A PULL socket bound to `address`.
fn bind(address: &str, max_frame: usize, auth: &Auth) -> Result<Bound, TransportError> {
    let err = |e: zmq::Error| TransportError::new("bind", address, format!("libzmq: {e}"));
    let socket = context().socket(zmq::PULL).map_err(err)?;
    socket
        .set_maxmsgsize(i64::try_from(max_frame).unwrap_or(i64::MAX))
        .map_err(err)?;
    socket.set_rcvhwm(HWM).map_err(err)?;
    socket.set_ipv6(true).map_err(err)?;
    socket.set_rcvtimeo(POLL_MS).map_err(err)?;
    socket.set_linger(0).map_err(err)?;
    let zap = auth.server(&socket).map_err(err)?;
    let monitor = Monitor::new(&socket).map_err(err)?;
    socket.bind(address).map_err(err)?;
    let endpoint = socket
        .get_last_endpoint()
        .map_err(err)?
        .map_err(|_| TransportError::new("bind", address, "endpoint is not UTF-8"))?;
    Ok((socket, monitor, endpoint, zap))
}

/// A PUSH socket connected to `endpoint` whose handshake (and authentication) completed, or
/// an error if that does not happen within `timeout` (unauthorized when the receiver refused
/// the credentials). With `ZMQ_IMMEDIATE` chunks are
/// queued only on a connection that completed its handshake.
fn connect(endpoint: &str, timeout: Duration, auth: &Auth) -> Result<zmq::Socket, TransportError> {
    let err = |e: zmq::Error| TransportError::new("connect", endpoint, format!("libzmq: {e}"));
    let ms = i32::try_from(timeout.as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    let mut socket = context().socket(zmq::PUSH).map_err(err)?;
    socket.set_sndhwm(HWM).map_err(err)?;
    socket.set_ipv6(true).map_err(err)?;
    socket.set_sndtimeo(POLL_MS).map_err(err)?;
    socket.set_linger(LINGER_MS).map_err(err)?;
    socket.set_immediate(true).map_err(err)?;
    socket.set_connect_timeout(ms).map_err(err)?;
    auth.client(&socket).map_err(err)?;
    let monitor = Monitor::new(&socket).map_err(err)?;
    let shaken = socket
        .connect(endpoint)
        .map_err(err)
        .and_then(|()| super::control::handshake(&monitor, endpoint, timeout));
    super::monitor::stop(&mut socket);
    drop(monitor);
    shaken.map(|_| socket)
}

/// One chunk for a sender thread, and where its result goes.
struct Job {
    header: Bytes,
    payload: Bytes,
    done: oneshot::Sender<Result<(), TransportError>>,
}

/// Why a chunk was not sent.
enum Unsent {
    /// The sender was closed ([`DataSender::close`]: its peer is dead).
    Closed,
    Zmq(zmq::Error),
}

/// What a send on a closed sender fails with.
const CLOSED: &str = "the connection was closed: its peer is gone";

/// Queues one chunk on `socket`. `None` if the caller gave up (dropped its future) before the
/// chunk was queued: it is then not sent at all. Once the header frame is queued the payload
/// frame follows, so that a message is never left half-sent, unless the sender is `closed`
/// meanwhile (the peer is dead: nothing will read the rest). A send waiting for the peer to
/// accept (the high-water mark reached, or no connection up) ends when the sender closes.
fn send_chunk(
    socket: &mut zmq::Socket,
    job: &Job,
    closed: &AtomicBool,
) -> Option<Result<(), Unsent>> {
    loop {
        if closed.load(Ordering::Relaxed) {
            return Some(Err(Unsent::Closed));
        }
        match socket.send(&job.header[..], zmq::SNDMORE) {
            Ok(()) => break,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) if !job.done.is_closed() => {}
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => return None,
            Err(e) => return Some(Err(Unsent::Zmq(e))),
        }
    }
    let mut payload = zero_copy::Frame::new(job.payload.clone());
    loop {
        match payload.send(socket, 0) {
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) if closed.load(Ordering::Relaxed) => {
                return Some(Err(Unsent::Closed));
            }
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {}
            r => return Some(r.map_err(Unsent::Zmq)),
        }
    }
}

/// Receives chunks from `socket` into `chunks` until the receiver is dropped.
/// Connections beyond [`super::peers::MAX_PER_PEER`] from one address are shut down as the
/// socket's monitor reports them accepted.
fn receive_loop(
    socket: &zmq::Socket,
    monitor: &Monitor,
    endpoint: &str,
    chunks: &mpsc::Sender<Result<(Bytes, Bytes), TransportError>>,
) {
    let err = |m: String| TransportError::new("recv", endpoint, m);
    let mut connections = super::peers::Connections::default();
    loop {
        if chunks.is_closed() {
            return;
        }
        let mut items = [socket.as_poll_item(zmq::POLLIN), monitor.poll_item()];
        if zmq::poll(&mut items, i64::from(POLL_MS)).is_err() {
            return;
        }
        while let Some(event) = monitor.next() {
            match event {
                Event::Accepted { fd } => connections.accepted(fd),
                Event::Disconnected { fd } => connections.disconnected(fd),
                _ => {}
            }
        }
        let mut header = zmq::Message::new();
        match socket.recv(&mut header, zmq::DONTWAIT) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                // The context is going away (ETERM) or the socket broke: say so once; `recv`
                // then waits forever rather than failing in a loop.
                let _ = chunks.blocking_send(Err(err(format!("libzmq: {e}"))));
                return;
            }
        }
        let chunk = receive_rest(socket, header)
            .map(|(h, p)| (owned(h), owned(p)))
            .map_err(err);
        if chunks.blocking_send(chunk).is_err() {
            return;
        }
    }
}

/// The payload frame of a message whose header frame is `header`, or why the message is not
/// a chunk (its frames are drained, so the socket stays usable).
fn receive_rest(
    socket: &zmq::Socket,
    header: zmq::Message,
) -> Result<(zmq::Message, zmq::Message), String> {
    let mut frames = rest_of_message(socket, header, 2).map_err(|e| format!("libzmq: {e}"))?;
    match (frames.pop(), frames.pop(), frames.is_empty()) {
        (Some(payload), Some(header), true) => Ok((header, payload)),
        _ => Err("a data message must have exactly two frames (header, payload)".to_owned()),
    }
}

struct ZmqSender {
    /// The sender thread's queue; `None` once closed.
    jobs: Option<std_mpsc::Sender<Job>>,
    /// Set by `close`: the thread fails what it holds and what is queued at once.
    closed: Arc<AtomicBool>,
    endpoint: String,
}

impl DataSender for ZmqSender {
    fn send(&mut self, frame: Frame) -> BoxFuture<'static, Result<(), TransportError>> {
        let (header, payload) = (frame.header(), frame.payload());
        let (done, result) = oneshot::channel();
        let endpoint = self.endpoint.clone();
        let Some(jobs) = &self.jobs else {
            let closed = TransportError::new("send", &endpoint, CLOSED);
            return Box::pin(async move { Err(closed) });
        };
        let gone = move || TransportError::new("send", &endpoint, "socket thread stopped");
        let queued = jobs.send(Job {
            header,
            payload,
            done,
        });
        Box::pin(async move {
            queued.map_err(|_| gone())?;
            result.await.map_err(|_| gone())?
        })
    }

    fn close(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
        self.jobs = None;
    }
}

struct ZmqReceiver {
    chunks: mpsc::Receiver<Result<(Bytes, Bytes), TransportError>>,
    endpoint: String,
}

impl DataReceiver for ZmqReceiver {
    fn recv(&mut self) -> BoxFuture<'_, Result<(Bytes, Bytes), TransportError>> {
        Box::pin(async move {
            match self.chunks.recv().await {
                Some(chunk) => chunk,
                None => {
                    tracing::debug!(endpoint = %self.endpoint, "data receiver thread stopped");
                    std::future::pending().await
                }
            }
        })
    }
}

/// Sending a `Bytes` as a libzmq frame without copying it. The `zmq` crate wraps only a
/// `Box<[u8]>` (or `Vec<u8>`) zero-copy, and a staging slot's `Bytes` cannot become one without
/// a copy, so this calls `zmq_msg_init_data` itself with a free function that drops the
/// `Bytes`.
#[allow(unsafe_code)]
mod zero_copy {
    use std::ffi::c_void;

    use bytes::Bytes;

    /// A libzmq message that views a `Bytes`, which it owns until libzmq is done with it.
    pub(super) struct Frame {
        msg: zmq_sys::zmq_msg_t,
    }

    /// libzmq calls this once the last reference to the message's content is gone: after its
    /// I/O thread has written the bytes, or when an unsent message is closed.
    unsafe extern "C" fn drop_bytes(_data: *mut c_void, hint: *mut c_void) {
        // SAFETY: `hint` is the `Box<Bytes>` leaked in `Frame::new`, and libzmq calls this once.
        drop(unsafe { Box::from_raw(hint.cast::<Bytes>()) });
    }

    impl Frame {
        pub(super) fn new(bytes: Bytes) -> Frame {
            let mut msg = zmq_sys::zmq_msg_t::default();
            if bytes.is_empty() {
                // SAFETY: `msg` is a valid zmq_msg_t to initialise.
                let rc = unsafe { zmq_sys::zmq_msg_init(&mut msg) };
                assert_eq!(rc, 0, "zmq_msg_init cannot fail");
                return Frame { msg };
            }
            let (data, len) = (bytes.as_ptr(), bytes.len());
            let owner = Box::into_raw(Box::new(bytes));
            // SAFETY: `data..data+len` stays valid and unchanged while `owner` lives (a `Bytes`
            // is immutable), and libzmq calls `drop_bytes(data, owner)` exactly once when it
            // no longer needs it. libzmq never writes through the pointer of a message it
            // sends.
            let rc = unsafe {
                zmq_sys::zmq_msg_init_data(
                    &mut msg,
                    data.cast_mut().cast::<c_void>(),
                    len,
                    Some(drop_bytes),
                    owner.cast::<c_void>(),
                )
            };
            if rc != 0 {
                // Only on allocation failure, and then libzmq has not taken the Bytes.
                // SAFETY: `owner` was leaked above and not handed to libzmq.
                drop(unsafe { Box::from_raw(owner) });
                panic!("zmq_msg_init_data: {}", zmq::Error::from_raw(errno()));
            }
            Frame { msg }
        }

        /// `zmq_msg_send`: on success libzmq owns the content (and this frame is left empty);
        /// on failure the frame keeps it and may be sent again.
        pub(super) fn send(
            &mut self,
            socket: &mut zmq::Socket,
            flags: i32,
        ) -> Result<(), zmq::Error> {
            // SAFETY: `self.msg` is an initialised message and `socket` a live socket that only
            // this thread uses.
            let rc = unsafe { zmq_sys::zmq_msg_send(&mut self.msg, socket.as_mut_ptr(), flags) };
            if rc == -1 {
                Err(zmq::Error::from_raw(errno()))
            } else {
                Ok(())
            }
        }
    }

    impl Drop for Frame {
        fn drop(&mut self) {
            // SAFETY: `self.msg` is initialised (closing a sent, hence empty, message is a
            // no-op); an unsent message's close calls `drop_bytes`.
            unsafe { zmq_sys::zmq_msg_close(&mut self.msg) };
        }
    }

    fn errno() -> i32 {
        // SAFETY: reads libzmq's thread-local errno.
        unsafe { zmq_sys::zmq_errno() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::FRAME_ROOM;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

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
        let (endpoint, mut rx) = t.listen("127.0.0.1", 0).await.expect("listen");
        let mut tx = t
            .connect(&endpoint, Duration::from_secs(5))
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
    async fn closing_a_sender_ends_sends_its_gone_peer_never_takes() {
        let t = ZmqData::new(TransportKind::ZmqTcp, 2 << 20, Auth::default());
        let (endpoint, rx) = t.listen("127.0.0.1", 0).await.expect("listen");
        let mut tx = t
            .connect(&endpoint, Duration::from_secs(5))
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
        let (endpoint, mut rx) = t.listen("127.0.0.1", 0).await.expect("listen");
        let raw = context().socket(zmq::PUSH).expect("socket");
        raw.connect(&endpoint).expect("connect");
        raw.send("one frame", 0).expect("send");
        raw.send_multipart(["a", "b", "c"], 0).expect("send");
        raw.send_multipart(["h", "p"], 0).expect("send");
        assert!(rx.recv().await.is_err());
        assert!(rx.recv().await.is_err());
        let (h, p) = rx.recv().await.expect("a good chunk after bad ones");
        assert_eq!((&h[..], &p[..]), (&b"h"[..], &b"p"[..]));
    }
}
