//! The control plane on libzmq: ROUTER on the prefill (binds), DEALER on each decode's
//! connection to a prefill (connects), one protocol message per frame.
//!
//! Each socket lives on a thread of its own (libzmq sockets are not thread-safe) that polls
//! the socket, its monitor and a wake-up pipe: frames received go to the async side over a
//! bounded channel (when it is full the thread stops reading, and libzmq's high-water mark
//! pushes back on the peer), frames to send come from a queue and are handed to libzmq without
//! blocking. Every socket caps a frame at the size its owner gives (`max_frame`) and queues at
//! most [`HWM`] of them per connection.
//!
//! Peer death from the connection: the DEALER's own connection dropping, or the ROUTER seeing
//! a peer's connection drop (a peer is known by the file descriptor its frames came from,
//! libzmq's `__fd` property, against the monitor's disconnect events), starts
//! [`super::RECONNECT_GRACE`]; a peer that is not back within it is reported lost. The DEALER
//! retries at once, and a retry its peer's host refuses (nothing listens there any more) is a
//! loss right away. A decode
//! names its DEALER with a random routing id, so a connection it re-establishes is the same
//! peer to the prefill, and sends its owner's `on_reconnect` frame (a heartbeat) at once.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::monitor::{Event, Monitor};
use super::peers::Verdict;
use super::{Auth, RECONNECT_GRACE, Wake, Waker, context, owned, rest_of_message, tcp_address};
use crate::transport::TransportError;

/// Control frames queued per connection in each direction before libzmq stops reading from
/// (or refuses to send to) it. Control messages are few: a Hello, a request per room, credits
/// and heartbeats.
pub const HWM: i32 = 16;

/// Frames the socket thread hands to the async side ahead of its reads (each up to the cap:
/// part of the socket's memory bound, docs/reliability.md).
pub const AHEAD: usize = 16;

/// How soon a decode's control connection retries after it dropped (libzmq's default: 100 ms).
const RECONNECT_IVL_MS: i32 = 10;

/// How long a socket thread waits in `zmq::poll` before it looks whether its owner is gone.
const POLL_MS: i64 = 100;

/// How often frames waiting for a full peer queue are offered again.
const PENDING_POLL_MS: i64 = 2;

/// Frames that may wait for one peer's full queue; a peer that stopped reading holds no more.
pub const PENDING_PER_PEER: usize = 256;

/// Identity of a control peer as the ROUTER sees it: the decode's routing id, then 8 bytes
/// naming the connection it came over ([`routing_id`] strips them). A decode whose connection
/// is re-established is another peer: whatever its first connection proved (its Hello, the
/// token), the new one proves again, so that nobody takes over a decode's session by
/// presenting its routing id, which travels in clear. A frame sent to a peer whose connection
/// is gone fails ("no such peer"), even if its routing id came back.
pub type PeerId = Bytes;

/// The routing id of `peer` (the decode's, random), without its connection.
pub fn routing_id(peer: &PeerId) -> &[u8] {
    &peer[..peer.len().saturating_sub(8)]
}

/// What the prefill's control socket delivers.
#[derive(Debug)]
pub enum ControlEvent {
    /// One frame from a peer.
    Frame(PeerId, Bytes),
    /// A message of another shape than one frame; dropped (the socket stays usable).
    Malformed(String),
    /// A peer's connection dropped and did not come back within the grace.
    Lost(PeerId, String),
    /// A peer's connection was refused at a limit (why); its frames are dropped and the
    /// connection is shut down shortly: answer it now to tell the peer why.
    Refused(PeerId, String),
}

/// One frame to send, and where its result goes.
struct Out {
    peer: Option<PeerId>,
    frame: Bytes,
    /// Where the result goes; `None` for a frame posted without waiting.
    done: Option<oneshot::Sender<Result<(), String>>>,
    /// A posted frame still waiting for its peer's queue at this time is dropped.
    expires: Option<Instant>,
}

impl Out {
    /// Whether nobody waits for this frame any more.
    fn abandoned(&self, now: Instant) -> bool {
        self.done.as_ref().is_some_and(oneshot::Sender::is_closed)
            || self.expires.is_some_and(|at| at <= now)
    }

    fn finish(self, result: Result<(), String>) {
        match (self.done, result) {
            (Some(done), result) => {
                let _ = done.send(result);
            }
            (None, Err(why)) => tracing::debug!(%why, "a posted control frame was not sent"),
            (None, Ok(())) => {}
        }
    }
}

/// The prefill's control socket: receives from any decode.
pub struct ControlServer {
    events: mpsc::Receiver<ControlEvent>,
}

/// Sends control frames to decode peers; cheap to clone.
#[derive(Clone)]
pub struct ControlReplier {
    queue: Queue,
}

/// The sending side of a socket thread.
#[derive(Clone)]
struct Queue {
    jobs: std_mpsc::Sender<Out>,
    waker: Waker,
    endpoint: String,
}

impl Queue {
    async fn send(&self, peer: Option<PeerId>, frame: Bytes) -> Result<(), TransportError> {
        let (done, result) = oneshot::channel();
        let gone = || TransportError::new("send", &self.endpoint, "socket thread stopped");
        let out = Out {
            peer,
            frame,
            done: Some(done),
            expires: None,
        };
        self.jobs.send(out).map_err(|_| gone())?;
        self.waker.wake();
        result
            .await
            .map_err(|_| gone())?
            .map_err(|e| TransportError::new("send", &self.endpoint, e))
    }

    fn post(&self, peer: Option<PeerId>, frame: Bytes, within: Duration) {
        let out = Out {
            peer,
            frame,
            done: None,
            expires: Some(Instant::now() + within),
        };
        if self.jobs.send(out).is_ok() {
            self.waker.wake();
        }
    }
}

/// Where a control socket binds or connects, and its bounds.
#[derive(Clone, Debug)]
pub struct ControlOptions {
    /// Largest frame accepted from a peer (bytes); a peer announcing more is disconnected.
    pub max_frame: usize,
    /// Credentials.
    pub auth: Auth,
    /// A bound socket's test of a connection's proof ([`super::peers`]): whether a frame
    /// proves the connection that sent it (the prefill's: a valid Hello). `None`: any frame.
    pub proof: Option<fn(&[u8]) -> bool>,
}

impl ControlServer {
    /// Binds on `host:port` (0: the OS picks); returns the endpoint and the two halves.
    pub async fn bind(
        host: &str,
        port: u16,
        options: &ControlOptions,
    ) -> Result<(String, ControlServer, ControlReplier), TransportError> {
        let address = tcp_address(host, port);
        let (setup_tx, setup_rx) = oneshot::channel();
        let (events_tx, events) = mpsc::channel(AHEAD);
        let (jobs, jobs_rx) = std_mpsc::channel();
        let options = options.clone();
        let addr = address.clone();
        super::spawn("kvferry-control", move || {
            let err = |e: zmq::Error| TransportError::new("bind", &addr, format!("libzmq: {e}"));
            let bound = (|| {
                let socket = context().socket(zmq::ROUTER).map_err(err)?;
                configure(&socket, &options).map_err(err)?;
                socket.set_router_handover(true).map_err(err)?;
                socket.set_router_mandatory(true).map_err(err)?;
                let zap = options.auth.server(&socket).map_err(err)?;
                let monitor = Monitor::new(&socket).map_err(err)?;
                socket.bind(&addr).map_err(err)?;
                let endpoint = socket
                    .get_last_endpoint()
                    .map_err(err)?
                    .map_err(|_| TransportError::new("bind", &addr, "endpoint is not UTF-8"))?;
                let wake = Wake::new().map_err(|e| TransportError::new("bind", &addr, e))?;
                Ok((socket, zap, monitor, endpoint, wake))
            })();
            match bound {
                Ok((socket, _zap, monitor, endpoint, wake)) => {
                    let waker = wake.waker();
                    let _ = setup_tx.send(
                        waker
                            .map(|w| (endpoint, w))
                            .map_err(|e| TransportError::new("bind", &addr, e)),
                    );
                    let mut looped = Looped::new(socket, monitor, wake, jobs_rx, events_tx);
                    looped.run(&mut RouterPeers {
                        proof: options.proof,
                        ..RouterPeers::default()
                    });
                }
                Err(e) => {
                    let _ = setup_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| TransportError::new("bind", &address, e))?;
        let (endpoint, waker) = setup_rx
            .await
            .map_err(|_| TransportError::new("bind", &address, "socket thread stopped"))??;
        let queue = Queue {
            jobs,
            waker,
            endpoint: endpoint.clone(),
        };
        Ok((endpoint, ControlServer { events }, ControlReplier { queue }))
    }

    /// The next event. Ends (`None`) only when the socket thread is gone.
    pub async fn recv(&mut self) -> Option<ControlEvent> {
        self.events.recv().await
    }
}

impl ControlReplier {
    /// Sends one frame to `peer`: fails at once if there is no such peer, waits while its queue
    /// is full.
    pub async fn send(&self, peer: &PeerId, frame: Bytes) -> Result<(), TransportError> {
        self.queue.send(Some(peer.clone()), frame).await
    }

    /// Queues one frame to `peer` without waiting: it goes once the peer has room, or is
    /// dropped if it had none `within` (the peer does not read; its heartbeat will tell).
    /// At most [`PENDING_PER_PEER`] frames wait per peer; beyond, new ones are dropped.
    pub fn post(&self, peer: &PeerId, frame: Bytes, within: Duration) {
        self.queue.post(Some(peer.clone()), frame, within);
    }
}

/// The decode's control connection to one prefill.
pub struct ControlClient {
    /// Sending half.
    pub send: ControlClientSend,
    /// Receiving half.
    pub recv: ControlClientRecv,
}

/// Sending half of a [`ControlClient`].
pub struct ControlClientSend {
    queue: Queue,
}

/// Receiving half of a [`ControlClient`].
pub struct ControlClientRecv {
    events: mpsc::Receiver<ControlEvent>,
    endpoint: String,
}

impl ControlClient {
    /// Connects to a prefill's control endpoint and completes the handshake (with the token,
    /// when `options` has one), failing after `timeout` if that does not happen, or at once
    /// ([`TransportErrorKind::Unauthorized`](crate::transport::TransportErrorKind)) when the
    /// prefill refused the credentials.
    /// `on_reconnect` is sent each time the connection is re-established after a drop.
    pub async fn connect(
        endpoint: &str,
        timeout: Duration,
        options: &ControlOptions,
        on_reconnect: Bytes,
    ) -> Result<ControlClient, TransportError> {
        let (setup_tx, setup_rx) = oneshot::channel();
        let (events_tx, events) = mpsc::channel(AHEAD);
        let (jobs, jobs_rx) = std_mpsc::channel();
        let (ep, options) = (endpoint.to_owned(), options.clone());
        super::spawn("kvferry-control", move || {
            match connect(&ep, timeout, &options) {
                Ok((socket, monitor, wake, fd)) => {
                    let waker = wake.waker();
                    let _ =
                        setup_tx.send(waker.map_err(|e| TransportError::new("connect", &ep, e)));
                    let mut looped = Looped::new(socket, monitor, wake, jobs_rx, events_tx);
                    looped.run(&mut DealerPeer::new(fd, on_reconnect));
                }
                Err(e) => {
                    let _ = setup_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| TransportError::new("connect", endpoint, e))?;
        // The thread answers within `timeout`; the margin only guards against a stuck one.
        let waker = tokio::time::timeout(timeout + Duration::from_secs(1), setup_rx)
            .await
            .map_err(|_| no_answer(endpoint, timeout))?
            .map_err(|_| no_answer(endpoint, timeout))??;
        let queue = Queue {
            jobs,
            waker,
            endpoint: endpoint.to_owned(),
        };
        Ok(ControlClient {
            send: ControlClientSend { queue },
            recv: ControlClientRecv {
                events,
                endpoint: endpoint.to_owned(),
            },
        })
    }
}

fn no_answer(endpoint: &str, timeout: Duration) -> TransportError {
    TransportError::new("connect", endpoint, format!("no answer within {timeout:?}"))
}

/// A DEALER connected to `endpoint` whose handshake completed within `timeout`, its monitor,
/// its wake-up pipe and the connection's descriptor.
fn connect(
    endpoint: &str,
    timeout: Duration,
    options: &ControlOptions,
) -> Result<(zmq::Socket, Monitor, Wake, i32), TransportError> {
    let err = |e: zmq::Error| TransportError::new("connect", endpoint, format!("libzmq: {e}"));
    let mut socket = context().socket(zmq::DEALER).map_err(err)?;
    configure(&socket, options).map_err(err)?;
    socket
        .set_identity(uuid::Uuid::new_v4().as_bytes())
        .map_err(err)?;
    socket.set_immediate(true).map_err(err)?;
    // A dropped connection is retried at once: a refused retry is a dead prefill.
    socket.set_reconnect_ivl(RECONNECT_IVL_MS).map_err(err)?;
    let ms = i32::try_from(timeout.as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    socket.set_connect_timeout(ms).map_err(err)?;
    options.auth.client(&socket).map_err(err)?;
    let monitor = Monitor::new(&socket).map_err(err)?;
    let connected = Wake::new()
        .map_err(|e| TransportError::new("connect", endpoint, e))
        .and_then(|wake| {
            socket.connect(endpoint).map_err(err)?;
            Ok((
                wake,
                super::monitor::handshake(&monitor, endpoint, timeout)?,
            ))
        });
    match connected {
        Ok((wake, fd)) => Ok((socket, monitor, wake, fd)),
        Err(e) => {
            super::monitor::stop(&mut socket);
            Err(e)
        }
    }
}

/// The bounds every control socket gets.
fn configure(socket: &zmq::Socket, options: &ControlOptions) -> Result<(), zmq::Error> {
    socket.set_maxmsgsize(i64::try_from(options.max_frame).unwrap_or(i64::MAX))?;
    socket.set_rcvhwm(HWM)?;
    socket.set_sndhwm(HWM)?;
    socket.set_linger(0)?;
    socket.set_ipv6(true)
}

impl ControlClientSend {
    /// Sends one frame; fails at once if the connection is down (libzmq would otherwise queue
    /// it for a connection that may never come back). A full queue is waited out: the frame
    /// goes once the peer reads, or never if the caller stops waiting.
    pub async fn send(&mut self, frame: Bytes) -> Result<(), TransportError> {
        self.queue.send(None, frame).await
    }
}

impl ControlClientRecv {
    /// The next frame; an error once the connection is lost (dropped and not back within the
    /// grace) or the socket thread is gone.
    pub async fn recv(&mut self) -> Result<Bytes, TransportError> {
        let why = match self.events.recv().await {
            Some(ControlEvent::Frame(_, frame)) => return Ok(frame),
            Some(
                ControlEvent::Malformed(why)
                | ControlEvent::Lost(_, why)
                | ControlEvent::Refused(_, why),
            ) => why,
            None => "socket thread stopped".to_owned(),
        };
        Err(TransportError::new("recv", &self.endpoint, why))
    }
}

/// What differs between the ROUTER's and the DEALER's socket thread: the shape of a message,
/// and how connections map to peers.
trait Peers {
    /// Frames of a message on this socket before the payload (ROUTER: the routing id).
    const ENVELOPE: usize;
    /// A connection event from the monitor; may queue frames to send or events to deliver.
    fn on_event(&mut self, event: Event, now: Instant, out: &mut Effects);
    /// `frame` arrived from `peer` over connection `fd`: what to do with it.
    fn on_frame(&mut self, peer: &PeerId, fd: Option<i32>, frame: &[u8], now: Instant) -> Verdict;
    /// The peer a frame from routing id `routing` over connection `fd` is delivered as.
    fn peer_of(&self, routing: PeerId, fd: Option<i32>) -> PeerId;
    /// The routing id a frame to `peer` goes to, or why it cannot go.
    fn route(&self, peer: &PeerId) -> Result<PeerId, String>;
    /// Peers whose grace ran out by `now`, as events; and the next deadline.
    fn expire(&mut self, now: Instant, out: &mut Effects) -> Option<Instant>;
    /// Whether the socket has no connection to send on (a send would queue for nobody).
    fn down(&self) -> bool;
}

/// What a [`Peers`] hook asks of the socket thread.
#[derive(Default)]
struct Effects {
    deliver: Vec<ControlEvent>,
    send: Vec<Bytes>,
}

/// The ROUTER's view: which descriptor each routing id's frames came from, each descriptor's
/// connection (numbered as they come), and the peers (routing id and connection) whose
/// connection dropped, with the time it did.
#[derive(Default)]
struct RouterPeers {
    by_fd: HashMap<i32, PeerId>,
    fd_of: HashMap<PeerId, i32>,
    connection_of: HashMap<i32, u64>,
    connections_seen: u64,
    dropped: HashMap<PeerId, Instant>,
    /// The connections held: unproven ones apart, proven ones per address (a bound on what one
    /// host can make the socket hold).
    connections: super::peers::Connections,
    /// What proves a connection ([`ControlOptions::proof`]).
    proof: Option<fn(&[u8]) -> bool>,
}

/// `routing` followed by the 8 bytes of `connection` (big-endian): a [`PeerId`].
fn with_connection(routing: &[u8], connection: u64) -> PeerId {
    let mut peer = Vec::with_capacity(routing.len() + 8);
    peer.extend_from_slice(routing);
    peer.extend_from_slice(&connection.to_be_bytes());
    Bytes::from(peer)
}

impl RouterPeers {
    /// Numbers the connection on `fd` (from 1, in the order they are seen), once.
    fn number(&mut self, fd: i32) {
        if fd >= 0 && !self.connection_of.contains_key(&fd) {
            self.connections_seen += 1;
            self.connection_of.insert(fd, self.connections_seen);
        }
    }
}

impl Peers for RouterPeers {
    const ENVELOPE: usize = 1;

    fn on_event(&mut self, event: Event, now: Instant, _: &mut Effects) {
        match event {
            Event::Accepted { fd } => {
                self.connections.accepted(fd, now);
                self.number(fd);
            }
            Event::Disconnected { fd } => self.connections.disconnected(fd),
            _ => {}
        }
        if let Event::Disconnected { fd } = event {
            let connection = self.connection_of.remove(&fd);
            // A routing id that already came back on another connection keeps it.
            if let Some(routing) = self.by_fd.remove(&fd)
                && self.fd_of.get(&routing) == Some(&fd)
            {
                self.fd_of.remove(&routing);
                let peer = with_connection(&routing, connection.unwrap_or(0));
                self.dropped.insert(peer, now);
            }
        }
    }

    fn down(&self) -> bool {
        // The ROUTER reports an unknown peer itself (EHOSTUNREACH).
        false
    }

    fn on_frame(&mut self, peer: &PeerId, fd: Option<i32>, frame: &[u8], now: Instant) -> Verdict {
        let Some(fd) = fd else {
            return Verdict::Deliver;
        };
        // A routing id that proved a connection before (the DEALER's, random) passes on
        // another one with any frame (a decode sends a heartbeat first when libzmq re-established
        // its connection), as ZAP let it in again: it arrives as a new peer
        // ([`RouterPeers::peer_of`]), which the agent asks to say Hello.
        let known = self.fd_of.contains_key(peer)
            || (self.dropped.keys()).any(|d| routing_id(d) == &peer[..]);
        let proof = self.proof;
        let proves = || known || proof.is_none_or(|proves| proves(frame));
        let verdict = self.connections.message(fd, now, proves);
        if verdict == Verdict::Deliver {
            self.number(fd);
            if self.fd_of.insert(peer.clone(), fd) != Some(fd) {
                self.by_fd.insert(fd, peer.clone());
            }
        }
        verdict
    }

    fn peer_of(&self, routing: PeerId, fd: Option<i32>) -> PeerId {
        let connection = fd.and_then(|fd| self.connection_of.get(&fd)).copied();
        with_connection(&routing, connection.unwrap_or(0))
    }

    fn route(&self, peer: &PeerId) -> Result<PeerId, String> {
        let routing = peer.slice(..routing_id(peer).len());
        let connection = u64::from_be_bytes(peer[routing.len()..].try_into().unwrap_or([0; 8]));
        let current = (self.fd_of.get(&routing)).and_then(|fd| self.connection_of.get(fd));
        match current {
            _ if self.dropped.contains_key(peer) => {
                Err("no such peer: the connection it proved itself on is gone".to_owned())
            }
            Some(&c) if c != connection => {
                Err("no such peer: the connection it proved itself on is gone".to_owned())
            }
            // Its connection, or one no frame was delivered from yet (refused at a limit, told
            // why on the way out): libzmq has no other connection of that routing id.
            _ => Ok(routing),
        }
    }

    fn expire(&mut self, now: Instant, out: &mut Effects) -> Option<Instant> {
        let mut next = self.connections.expire(now);
        // A routing id back on another connection is another peer: the dropped one is lost
        // after the grace all the same.
        self.dropped.retain(|peer, at| {
            let deadline = *at + RECONNECT_GRACE;
            if deadline <= now {
                let why = format!(
                    "control connection closed and not re-established within {} ms",
                    RECONNECT_GRACE.as_millis()
                );
                out.deliver.push(ControlEvent::Lost(peer.clone(), why));
                false
            } else {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
                true
            }
        });
        next
    }
}

/// The DEALER's view: its one connection, and when it dropped.
struct DealerPeer {
    fd: Option<i32>,
    dropped: Option<Instant>,
    /// Reconnection retries libzmq reported since the drop.
    retries: u32,
    lost: bool,
    on_reconnect: Bytes,
}

impl DealerPeer {
    fn new(fd: i32, on_reconnect: Bytes) -> Self {
        DealerPeer {
            fd: Some(fd),
            dropped: None,
            retries: 0,
            lost: false,
            on_reconnect,
        }
    }
}

impl Peers for DealerPeer {
    const ENVELOPE: usize = 0;

    fn on_event(&mut self, event: Event, now: Instant, out: &mut Effects) {
        match event {
            Event::Disconnected { fd } if self.fd == Some(fd) => {
                self.fd = None;
                self.retries = 0;
                self.dropped.get_or_insert(now);
            }
            Event::Connected { fd } if !self.lost => {
                self.fd = Some(fd);
                self.retries = 0;
            }
            // libzmq reports a retry when it schedules the reconnection after a drop, and
            // again for each attempt that failed: a second one means the prefill's host
            // refused it, nothing listens there any more (the process died, or restarted as
            // another instance): lost now, not after the grace.
            Event::Retried if !self.lost && self.dropped.is_some() => {
                self.retries += 1;
                if self.retries >= 2 {
                    self.lost = true;
                    out.deliver.push(ControlEvent::Lost(
                        Bytes::new(),
                        "control connection closed, and reconnecting to it was refused".to_owned(),
                    ));
                }
            }
            Event::Ready if !self.lost && self.dropped.take().is_some() => {
                out.send.push(self.on_reconnect.clone());
            }
            Event::AuthFailed | Event::MechanismMismatch if !self.lost => {
                self.lost = true;
                out.deliver.push(ControlEvent::Lost(
                    Bytes::new(),
                    "the prefill refused this agent's credentials on reconnecting".to_owned(),
                ));
            }
            _ => {}
        }
    }

    fn on_frame(&mut self, _: &PeerId, _: Option<i32>, _: &[u8], _: Instant) -> Verdict {
        Verdict::Deliver
    }

    fn peer_of(&self, routing: PeerId, _: Option<i32>) -> PeerId {
        routing
    }

    fn route(&self, peer: &PeerId) -> Result<PeerId, String> {
        Ok(peer.clone())
    }

    fn down(&self) -> bool {
        // Reconnected but not yet past the handshake: the frame queued at `Ready` (a
        // heartbeat: the prefill answers it by asking for a new Hello) must be the new
        // connection's first message, so nothing is queued before it.
        self.fd.is_none() || self.dropped.is_some()
    }

    fn expire(&mut self, now: Instant, out: &mut Effects) -> Option<Instant> {
        let at = self.dropped?;
        if self.lost {
            return None;
        }
        let deadline = at + RECONNECT_GRACE;
        if deadline > now {
            return Some(deadline);
        }
        self.lost = true;
        out.deliver.push(ControlEvent::Lost(
            Bytes::new(),
            format!(
                "control connection closed and not re-established within {} ms",
                RECONNECT_GRACE.as_millis()
            ),
        ));
        None
    }
}

/// A control socket's thread: the socket, its monitor, the queue of frames to send and the
/// channel of events delivered.
struct Looped {
    socket: zmq::Socket,
    monitor: Monitor,
    wake: Wake,
    jobs: std_mpsc::Receiver<Out>,
    events: mpsc::Sender<ControlEvent>,
    /// Events the channel had no room for yet; while any wait, the socket is not read.
    backlog: VecDeque<ControlEvent>,
    /// Frames a full peer queue refused for now, in the order they were given; each goes once
    /// its peer reads, or is dropped when its sender stopped waiting for it.
    pending: VecDeque<Out>,
}

impl Drop for Looped {
    fn drop(&mut self) {
        // Before the socket closes and the monitor's reading end goes (module monitor).
        super::monitor::stop(&mut self.socket);
    }
}

impl Looped {
    fn new(
        socket: zmq::Socket,
        monitor: Monitor,
        wake: Wake,
        jobs: std_mpsc::Receiver<Out>,
        events: mpsc::Sender<ControlEvent>,
    ) -> Self {
        Looped {
            socket,
            monitor,
            wake,
            jobs,
            events,
            backlog: VecDeque::new(),
            pending: VecDeque::new(),
        }
    }

    /// Serves the socket until its owner is gone.
    fn run<P: Peers>(&mut self, peers: &mut P) {
        let mut next_deadline: Option<Instant> = None;
        loop {
            if self.events.is_closed() {
                return;
            }
            let mut ms = POLL_MS;
            if let Some(d) = next_deadline {
                let left = d.saturating_duration_since(Instant::now()).as_millis();
                ms = ms.min(i64::try_from(left).unwrap_or(ms).max(1));
            }
            if !self.backlog.is_empty() {
                ms = 1;
            }
            let mut wanted = zmq::PollEvents::empty();
            let read = self.backlog.is_empty();
            if read {
                wanted |= zmq::POLLIN;
            }
            if !self.pending.is_empty() {
                // A ROUTER reports POLLOUT when any peer has room, not the one waited for:
                // look again soon either way.
                wanted |= zmq::POLLOUT;
                ms = ms.min(PENDING_POLL_MS);
            }
            let mut items = [
                self.socket.as_poll_item(wanted),
                self.monitor.poll_item(),
                self.wake.poll_item(),
            ];
            if zmq::poll(&mut items, ms).is_err() {
                return;
            }
            self.wake.drain();
            let mut effects = Effects::default();
            self.monitor_events(peers, &mut effects);
            self.send_queued(&[], peers);
            if read {
                self.receive(peers, &mut effects);
            }
            next_deadline = peers.expire(Instant::now(), &mut effects);
            self.apply(effects, peers);
        }
    }

    fn monitor_events<P: Peers>(&mut self, peers: &mut P, effects: &mut Effects) {
        while let Some(event) = self.monitor.next() {
            peers.on_event(event, Instant::now(), effects);
        }
    }

    /// Reads the messages libzmq has, up to what the channel takes.
    fn receive<P: Peers>(&mut self, peers: &mut P, effects: &mut Effects) {
        for _ in 0..AHEAD {
            let mut first = zmq::Message::new();
            if self.socket.recv(&mut first, zmq::DONTWAIT).is_err() {
                return;
            }
            // The disconnect of a descriptor is reported before the descriptor can be reused:
            // read it before this frame is attributed to the descriptor.
            self.monitor_events(peers, effects);
            let event = match rest_of_message(&self.socket, first, P::ENVELOPE + 1) {
                Ok(mut frames) if frames.len() == P::ENVELOPE + 1 => {
                    // The descriptor the frame came in on (libzmq's `__fd` property, set on
                    // the frames its decoder produced, not on the ROUTER's routing id).
                    let fd = frames
                        .last_mut()
                        .and_then(|f| f.gets("__fd"))
                        .and_then(|s| s.parse::<i32>().ok());
                    let frame = frames.pop().map(owned).unwrap_or_default();
                    let peer = frames.pop().map(owned).unwrap_or_default();
                    let verdict = peers.on_frame(&peer, fd, &frame, Instant::now());
                    let peer = peers.peer_of(peer, fd);
                    match verdict {
                        Verdict::Deliver => ControlEvent::Frame(peer, frame),
                        Verdict::Refuse(why) => ControlEvent::Refused(peer, why),
                        Verdict::Drop => continue,
                    }
                }
                Ok(_) => ControlEvent::Malformed(format!(
                    "a control message must have exactly {} frame(s)",
                    P::ENVELOPE + 1
                )),
                Err(e) => ControlEvent::Malformed(format!("libzmq: {e}")),
            };
            effects.deliver.push(event);
            if effects.deliver.len() + self.backlog.len() >= AHEAD {
                return;
            }
        }
    }

    /// Hands queued frames to libzmq without blocking the thread. A frame whose peer's queue
    /// is full waits in `pending` (behind it, that peer's later frames: order is kept per
    /// peer); a frame for a connection that is down fails at once.
    fn send_queued<P: Peers>(&mut self, extra: &[Bytes], peers: &P) {
        let down = peers.down();
        for frame in extra {
            let _ = self.socket.send(&frame[..], zmq::DONTWAIT);
        }
        self.pending.extend(self.jobs.try_iter());
        let now = Instant::now();
        let mut blocked: Vec<Option<PeerId>> = Vec::new();
        let mut waiting: HashMap<Option<PeerId>, usize> = HashMap::new();
        for out in std::mem::take(&mut self.pending) {
            if out.abandoned(now) {
                out.finish(Err("the peer's queue stayed full".to_owned()));
                continue;
            }
            if blocked.contains(&out.peer) {
                let n = waiting.entry(out.peer.clone()).or_default();
                if *n >= PENDING_PER_PEER {
                    out.finish(Err("too many frames wait for this peer".to_owned()));
                } else {
                    *n += 1;
                    self.pending.push_back(out);
                }
                continue;
            }
            let routed = out.peer.as_ref().map(|peer| peers.route(peer)).transpose();
            let routing = match routed {
                Ok(routing) => routing,
                Err(why) => {
                    out.finish(Err(why));
                    continue;
                }
            };
            let sent = match &routing {
                Some(routing) => self
                    .socket
                    .send(&routing[..], zmq::SNDMORE | zmq::DONTWAIT)
                    .and_then(|()| self.socket.send(&out.frame[..], zmq::DONTWAIT)),
                None => self.socket.send(&out.frame[..], zmq::DONTWAIT),
            };
            let result = match sent {
                Ok(()) => Ok(()),
                Err(zmq::Error::EAGAIN) if !down => {
                    blocked.push(out.peer.clone());
                    *waiting.entry(out.peer.clone()).or_default() += 1;
                    self.pending.push_back(out);
                    continue;
                }
                Err(zmq::Error::EAGAIN) => Err("the connection is down".to_owned()),
                Err(zmq::Error::EHOSTUNREACH) => Err("no such peer".to_owned()),
                Err(e) => Err(format!("libzmq: {e}")),
            };
            out.finish(result);
        }
    }

    fn apply<P: Peers>(&mut self, effects: Effects, peers: &P) {
        self.send_queued(&effects.send, peers);
        self.backlog.extend(effects.deliver);
        while let Some(event) = self.backlog.pop_front() {
            match self.events.try_send(event) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(event)) => {
                    self.backlog.push_front(event);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            }
        }
    }
}
