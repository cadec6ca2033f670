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
//! returns a staging slot to its pool). A chunk sent from the prefill's pool
//! ([`DataSender::send_from`], at most [`MAX_PIECES`] ranges) goes the same way without a
//! gather, one frame per range; its send resolves only once libzmq has let go of every range,
//! since until then it reads the pool. libzmq's encoder hands a large frame's memory straight
//! to `send(2)` and its decoder reads a large frame straight into the message's own buffer,
//! which the receiver hands out as `Bytes` without a copy (the frames of a chunk sent from a
//! pool as [`Payload::Pieces`], which the decode scatters one after the other). Each payload
//! byte is copied twice on its way, by the kernel's send and receive, plus the decode's scatter
//! (and the prefill's gather when the chunk is more ranges); the header is copied.
//!
//! It replaced the `zeromq` crate's PUSH/PULL, which copies every payload into its write
//! buffer and zero-fills its read buffer (5 copies and a memset per byte, against libzmq's
//! 4 passes when gathered). End to end libzmq ran rooms at about the crate's rate: its thread
//! hops (tokio, socket thread, I/O thread) cost about what the copies gain.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::monitor::{Event, Monitor};
use super::{Auth, context, owned, rest_of_message, spawn, tcp_address};
use crate::memory::{RemoteMemory, Span};
use crate::pool::HostPool;
use crate::transport::{
    BoxFuture, Credentials, DataReceiver, DataSender, Frame, Listening, MAX_PIECES, Payload,
    ProofCheck, Transport, TransportError, TransportKind, mapped,
};

/// Messages queued per connection before a send blocks. Credits already bound the chunks in
/// flight per peer pair to the decode's staging slots (8 by default), so this is a backstop
/// against a peer that ignores them, not the flow control.
pub const HWM: i32 = 16;

/// Messages a receiver queues per connection before it stops reading it: what a peer that
/// ignores credits can make it hold, each message up to 1 + [`MAX_PIECES`] frames. The
/// receiver's thread takes messages off as they come, so a legitimate sender meets it only
/// when the agent lands chunks slower than they arrive, and then TCP slows the sender anyway.
pub const RECV_HWM: i32 = 4;

/// Largest header frame (a Chunk message) a receiver accepts next to its payload limit.
pub const MAX_HEADER: usize = 64 << 10;

/// How long a socket thread blocks in libzmq before it looks whether its owner is gone.
const POLL_MS: i32 = 100;

/// How long a closed sender still tries to deliver chunks libzmq has queued (each holds a
/// staging slot until then).
const LINGER_MS: i32 = 5_000;

/// Bytes of a proof message: a key (an empty frame from a prefill before protocol version 11).
const PROOF_BYTES: usize = 16;

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
        check: ProofCheck,
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
                        receive_loop(&socket, &monitor, (&endpoint, &check), &chunks_tx);
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

    /// ZeroMQ has no one-sided writes of its own: a pool key is refused, except over
    /// `zmq-ipc` one naming a pool socket ([`mapped`]), where a version-6 decode put it (which
    /// is ignored: that decode is staged into; version 7 sends it as `shared_pool`).
    fn check_memory(&self, memory: &RemoteMemory) -> Result<(), TransportError> {
        match self.kind {
            TransportKind::ZmqIpc => mapped::check_key(memory),
            _ => Err(TransportError::malformed(
                "hello",
                "-",
                "ZeroMQ has no one-sided writes, yet the decode exposed its pool to them",
            )),
        }
    }

    fn connect(
        &self,
        endpoint: &str,
        timeout: Duration,
        credentials: Credentials,
    ) -> BoxFuture<'static, Result<Box<dyn DataSender>, TransportError>> {
        let endpoint = endpoint.to_owned();
        let auth = match credentials.token_in_clear {
            true => self.auth.in_clear(),
            false => self.auth.clone(),
        };
        let proof = credentials.proof;
        Box::pin(async move {
            let (connected_tx, connected_rx) = oneshot::channel();
            let (jobs_tx, jobs_rx) = std_mpsc::channel::<Job>();
            let closed = Arc::new(AtomicBool::new(false));
            let closing = closed.clone();
            let ep = endpoint.clone();
            spawn("kvferry-zmq-push", move || {
                let (mut socket, monitor) = match connect(&ep, timeout, &auth, &proof) {
                    Ok(connected) => {
                        let _ = connected_tx.send(Ok(()));
                        connected
                    }
                    Err(e) => {
                        let _ = connected_tx.send(Err(e));
                        return;
                    }
                };
                // Ends when the sender is dropped; the socket then lingers for queued chunks.
                loop {
                    match jobs_rx.recv_timeout(Duration::from_millis(POLL_MS as u64)) {
                        Ok(job) => {
                            if let Some(result) = send_chunk(&mut socket, &job, &closing) {
                                let _ = job.done.send(result.map_err(|e| match e {
                                    Unsent::Closed => TransportError::new("send", &ep, CLOSED),
                                    Unsent::Zmq(e) => {
                                        TransportError::new("send", &ep, format!("libzmq: {e}"))
                                    }
                                }));
                            }
                        }
                        Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                        Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                    // libzmq reconnects by itself after a connection drops: the new one is
                    // proven at once too.
                    while let Some(event) = monitor.next() {
                        if event == Event::Ready {
                            prove(&socket, &proof);
                        }
                    }
                }
                super::monitor::stop(&mut socket);
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
    socket.set_rcvhwm(RECV_HWM).map_err(err)?;
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

/// A PUSH socket connected to `endpoint` whose handshake (and authentication) completed and
/// whose connection is proven with `proof`, with its monitor running (the caller stops it), or an error if
/// that does not happen within `timeout` (unauthorized when the receiver refused the
/// credentials). With `ZMQ_IMMEDIATE` chunks are queued only on a connection that completed
/// its handshake.
fn connect(
    endpoint: &str,
    timeout: Duration,
    auth: &Auth,
    proof: &[u8],
) -> Result<(zmq::Socket, Monitor), TransportError> {
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
        .and_then(|()| super::monitor::handshake(&monitor, endpoint, timeout));
    if let Err(e) = shaken {
        super::monitor::stop(&mut socket);
        return Err(e);
    }
    prove(&socket, proof);
    Ok((socket, monitor))
}

/// Sends a proof ([`ProofCheck`]): one frame, which the receiver checks as its connection's
/// first message and drops. A receiver takes nothing from a connection before its proof, and
/// shuts down one whose proof does not come within [`kvferry_wire::admission::PROOF_DEADLINE`];
/// a data connection may wait longer than that for its first chunk (a room the engine computes
/// after the decode asked for it), so the proof goes as soon as the handshake completed.
fn prove(socket: &zmq::Socket, proof: &[u8]) {
    let _ = socket.send(proof, zmq::DONTWAIT);
}

/// One chunk for a sender thread, and where its result goes.
struct Job {
    header: Bytes,
    payload: Vec<Piece>,
    done: oneshot::Sender<Result<(), TransportError>>,
}

/// One payload frame: bytes the frame owns, or a range of a pool (held, with the chunk's
/// [`Released`], until libzmq lets go of the frame).
enum Piece {
    Bytes(Bytes),
    Pool(Arc<HostPool>, Span, Arc<Released>),
}

/// Says when the last frame holding it is gone: every range of a chunk sent from a pool.
struct Released(Option<oneshot::Sender<()>>);

impl Drop for Released {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
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
    let empty = [Piece::Bytes(Bytes::new())];
    let pieces = match job.payload.is_empty() {
        true => &empty[..],
        false => &job.payload[..],
    };
    for (i, piece) in pieces.iter().enumerate() {
        let mut frame = match piece {
            Piece::Bytes(bytes) => zero_copy::Frame::new(bytes.clone()),
            Piece::Pool(pool, span, released) => {
                zero_copy::Frame::from_pool(pool.clone(), *span, released.clone())
            }
        };
        let flags = if i + 1 < pieces.len() {
            zmq::SNDMORE
        } else {
            0
        };
        loop {
            match frame.send(socket, flags) {
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR)
                    if closed.load(Ordering::Relaxed) =>
                {
                    return Some(Err(Unsent::Closed));
                }
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {}
                Ok(()) => break,
                Err(e) => return Some(Err(Unsent::Zmq(e))),
            }
        }
    }
    Some(Ok(()))
}

/// Receives chunks from `socket` into `chunks` until the receiver is dropped.
/// Connections are watched as [`super::peers`] says: unproven until a message whose first frame
/// `check` takes for a proof (anything before it is dropped unread), then at most
/// [`super::peers::MAX_PER_PEER`] from one address. A one-frame message of a proof's size is a
/// proof and lands nothing.
fn receive_loop(
    socket: &zmq::Socket,
    monitor: &Monitor,
    (endpoint, check): (&str, &ProofCheck),
    chunks: &mpsc::Sender<Result<(Bytes, Payload), TransportError>>,
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
        let watch = |connections: &mut super::peers::Connections| {
            while let Some(event) = monitor.next() {
                match event {
                    Event::Accepted { fd } => connections.accepted(fd, Instant::now()),
                    Event::Disconnected { fd } => connections.disconnected(fd),
                    _ => {}
                }
            }
        };
        watch(&mut connections);
        connections.expire(Instant::now());
        let mut header = zmq::Message::new();
        match socket.recv(&mut header, zmq::DONTWAIT) {
            Ok(()) => {
                // The disconnect of a descriptor is reported before the descriptor can be
                // reused: read it before the message is attributed to the descriptor (libzmq's
                // `__fd` property of the frames its decoder produced).
                watch(&mut connections);
                let fd = header.gets("__fd").and_then(|s| s.parse::<i32>().ok());
                if let Some(fd) = fd
                    && connections.message(fd, Instant::now(), || check(&header))
                        != super::peers::Verdict::Deliver
                {
                    // A PUSH peer cannot be answered: its connection just goes.
                    let _ = rest_of_message(socket, header, 0);
                    continue;
                }
                if !header.get_more() && matches!(header.len(), 0 | PROOF_BYTES) {
                    // A sender's proof ([`prove`]), the first or one sent again: nothing to land.
                    continue;
                }
            }
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                // The context is going away (ETERM) or the socket broke: say so once; `recv`
                // then waits forever rather than failing in a loop.
                let _ = chunks.blocking_send(Err(err(format!("libzmq: {e}"))));
                return;
            }
        }
        let chunk = receive_rest(socket, header).map_err(err);
        if chunks.blocking_send(chunk).is_err() {
            return;
        }
    }
}

/// The header and payload of a message whose header frame is `header`, or why the message
/// is not a chunk (its frames are drained, so the socket stays usable).
fn receive_rest(socket: &zmq::Socket, header: zmq::Message) -> Result<(Bytes, Payload), String> {
    let frames = rest_of_message(socket, header, 1 + MAX_PIECES);
    let mut frames = frames.map_err(|e| format!("libzmq: {e}"))?.into_iter();
    let header = frames.next().map(owned);
    let mut pieces: Vec<Bytes> = frames.map(owned).collect();
    match (header, pieces.len()) {
        (Some(header), 1) => Ok((header, Payload::Host(pieces.remove(0)))),
        (Some(header), 2..=MAX_PIECES) => Ok((header, Payload::Pieces(pieces))),
        _ => Err(format!(
            "a data message must have a header frame and 1 to {MAX_PIECES} payload frames"
        )),
    }
}

struct ZmqSender {
    /// The sender thread's queue; `None` once closed.
    jobs: Option<std_mpsc::Sender<Job>>,
    /// Set by `close`: the thread fails what it holds and what is queued at once.
    closed: Arc<AtomicBool>,
    endpoint: String,
}

impl ZmqSender {
    /// Hands a chunk to the socket thread; resolves once it is queued on the socket.
    fn queue(
        &self,
        header: Bytes,
        payload: Vec<Piece>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
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
}

impl DataSender for ZmqSender {
    fn send(&mut self, frame: Frame) -> BoxFuture<'static, Result<(), TransportError>> {
        self.queue(frame.header(), vec![Piece::Bytes(frame.payload())])
    }

    fn sends_from_pool(&self) -> bool {
        true
    }

    fn send_from(
        &mut self,
        prefix: Frame,
        source: Arc<HostPool>,
        runs: Vec<Span>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let outside = runs.iter().find(|r| {
            r.offset
                .checked_add(r.len)
                .is_none_or(|end| end > source.size() as u64)
        });
        if let Some(r) = outside.or(runs.get(MAX_PIECES)) {
            let e = TransportError::new(
                "send_from",
                &self.endpoint,
                format!(
                    "{} ranges, one at {r:?}: more than {MAX_PIECES} or outside the pool",
                    runs.len()
                ),
            );
            return Box::pin(async move { Err(e) });
        }
        let (tx, released) = oneshot::channel();
        let holder = Arc::new(Released(Some(tx)));
        let pieces = runs
            .into_iter()
            .map(|r| Piece::Pool(source.clone(), r, holder.clone()))
            .collect();
        drop(holder);
        let queued = self.queue(prefix.header(), pieces);
        Box::pin(async move {
            queued.await?;
            // libzmq reads the ranges until its I/O thread wrote them (or, the peer gone, the
            // socket's linger ended).
            let _ = released.await;
            Ok(())
        })
    }

    fn close(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
        self.jobs = None;
    }
}

struct ZmqReceiver {
    chunks: mpsc::Receiver<Result<(Bytes, Payload), TransportError>>,
    endpoint: String,
}

impl DataReceiver for ZmqReceiver {
    /// A chunk that came in pieces is joined (a copy); the agent takes them as they are.
    fn recv(&mut self) -> BoxFuture<'_, Result<(Bytes, Bytes), TransportError>> {
        Box::pin(async move {
            match self.recv_payload().await? {
                (header, Payload::Host(payload)) => Ok((header, payload)),
                (header, Payload::Pieces(pieces)) => Ok((header, pieces.concat().into())),
                (_, Payload::Device(_)) => Err(TransportError::new(
                    "recv",
                    &self.endpoint,
                    "ZeroMQ receives host memory only",
                )),
            }
        })
    }

    fn recv_payload(&mut self) -> BoxFuture<'_, Result<(Bytes, Payload), TransportError>> {
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

/// Sending a `Bytes`, or a range of a pool, as a libzmq frame without copying it. The `zmq` crate wraps only a
/// `Box<[u8]>` (or `Vec<u8>`) zero-copy, and a staging slot's `Bytes` cannot become one without
/// a copy, so this calls `zmq_msg_init_data` itself with a free function that drops the
/// `Bytes`.
#[allow(unsafe_code)]
mod zero_copy {
    use std::ffi::c_void;
    use std::sync::Arc;

    use bytes::Bytes;

    use crate::memory::Span;
    use crate::pool::HostPool;

    /// A libzmq message that views memory it keeps alive (a `Bytes`, a pool's range) until
    /// libzmq is done with it.
    pub(super) struct Frame {
        msg: zmq_sys::zmq_msg_t,
    }

    /// What keeps a frame's memory alive until libzmq lets go of it.
    type Owner = Box<dyn Send>;

    /// libzmq calls this once the last reference to the message's content is gone: after its
    /// I/O thread has written the bytes, or when an unsent message is closed.
    unsafe extern "C" fn drop_owner(_data: *mut c_void, hint: *mut c_void) {
        // SAFETY: `hint` is the `Box<Owner>` leaked in `Frame::owning`, and libzmq calls this
        // once.
        drop(unsafe { Box::from_raw(hint.cast::<Owner>()) });
    }

    impl Frame {
        pub(super) fn new(bytes: Bytes) -> Frame {
            let (data, len) = (bytes.as_ptr(), bytes.len());
            // SAFETY: a `Bytes` is immutable, and its memory lives as long as it does.
            unsafe { Frame::owning(data, len, Box::new(bytes)) }
        }

        /// A frame of `span` of `pool`, holding the pool and `released` until libzmq lets go.
        /// The span lies within the pool (the caller checked).
        pub(super) fn from_pool(
            pool: Arc<HostPool>,
            span: Span,
            released: Arc<super::Released>,
        ) -> Frame {
            let data = pool.base_ptr().wrapping_add(span.offset as usize);
            // SAFETY: the span lies within the pool's mapping, which lives as long as `pool`;
            // the agent writes no page a send reads until the send resolves, and the send
            // resolves only after `released` (held here) is dropped.
            unsafe { Frame::owning(data, span.len as usize, Box::new((pool, released))) }
        }

        /// A frame of the `len` bytes at `data`, which stay valid and unchanged while `owner`
        /// lives.
        ///
        /// # Safety
        /// As above: `data..data+len` must stay readable and unchanged until `owner` drops.
        unsafe fn owning(data: *const u8, len: usize, owner: Owner) -> Frame {
            let mut msg = zmq_sys::zmq_msg_t::default();
            if len == 0 {
                // SAFETY: `msg` is a valid zmq_msg_t to initialise.
                let rc = unsafe { zmq_sys::zmq_msg_init(&mut msg) };
                assert_eq!(rc, 0, "zmq_msg_init cannot fail");
                return Frame { msg };
            }
            let owner = Box::into_raw(Box::new(owner));
            // SAFETY: `data..data+len` stays valid and unchanged while `owner` lives (the
            // caller's promise), and libzmq calls `drop_owner(data, owner)` exactly once when
            // it no longer needs it. libzmq never writes through the pointer of a message it
            // sends.
            let rc = unsafe {
                zmq_sys::zmq_msg_init_data(
                    &mut msg,
                    data.cast_mut().cast::<c_void>(),
                    len,
                    Some(drop_owner),
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
mod tests;
