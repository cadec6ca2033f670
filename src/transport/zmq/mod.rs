//! ZeroMQ for both planes, on libzmq (the `zmq` crate; libzmq 4.3 built from source by
//! `zeromq-src`): the control plane's ROUTER/DEALER ([`control`]) and the `zmq-tcp` /
//! `zmq-ipc` data plane's PUSH/PULL ([`data`]).
//!
//! What every socket here gets, so that a peer cannot make an agent allocate or hold more than
//! a stated bound (docs/reliability.md, "Threat model"):
//! - `ZMQ_MAXMSGSIZE`: libzmq checks a frame's announced length against it before it
//!   allocates the frame, and drops the connection of a peer that announces more;
//! - explicit high-water marks, so that a connection holds at most `HWM + 1` frames of that
//!   size (the one being read, and the queue behind it), and at most [`peers::MAX_PER_PEER`]
//!   connections from one address once they proved themselves; connections that have not yet
//!   are bounded apart, oldest dropped first, for at most the proof deadline ([`peers`]);
//! - with a cluster token, ZAP PLAIN authentication ([`Auth`], `zap.rs`): a connection that
//!   does not present the password derived from the token ([`crate::protocol::zap_password`])
//!   is closed during the handshake, before libzmq reads a message from it. The token itself
//!   goes only to and from peers older than [`crate::protocol::TOKEN_PROOFS`]
//!   ([`Auth::in_clear`]); with newer ones it is proven on the control connection instead
//!   (`protocol/challenge.rs`). This build's libzmq has no CURVE (the `zmq-sys` build links
//!   no libsodium): what travels after the handshake is not encrypted.
//!
//! Connections are watched through libzmq's socket monitor ([`monitor`]): the side that
//! connects sees its connection drop, the side that binds sees which peer's connection
//! dropped; a dropped connection that is not re-established within [`RECONNECT_GRACE`] is a
//! dead peer.

pub mod control;
pub mod data;
mod monitor;
pub mod peers;
mod zap;

pub use control::{
    ControlClient, ControlClientRecv, ControlClientSend, ControlEvent, ControlReplier,
    ControlServer, PeerId,
};
pub use data::ZmqData;

use std::io::{Read as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// How long a dropped connection may take to come back before its peer counts as dead. A
/// process that died (kill -9, crash) closes its connections at once and never reconnects; a
/// connection reset by the network between two live agents is re-established by libzmq within
/// its reconnect interval (100 ms).
pub const RECONNECT_GRACE: Duration = Duration::from_millis(500);

/// libzmq I/O threads per process: a decode fed by two prefill ranks reads both connections
/// at once, each connection's kernel copies on a thread of its own: such rooms (TP2 -> TP1) run
/// faster than with one thread, and rooms over one connection the same (docs/benchmarks.md,
/// "Figures behind design choices").
const IO_THREADS: i32 = 2;

/// The process's libzmq context (one for every socket, so that the ZAP handler serves them all).
pub(crate) fn context() -> &'static zmq::Context {
    static CONTEXT: OnceLock<zmq::Context> = OnceLock::new();
    CONTEXT.get_or_init(|| {
        // libzmq starts its I/O and reaper threads with the context's first socket, and they
        // inherit the CPUs and scheduling of the thread that creates it: an agent thread's
        // (crate::cpus), not an engine's pinned one.
        let on_agent_thread = || {
            crate::cpus::on_agent_thread();
            let ctx = new_context();
            if let Err(e) = ctx.socket(zmq::PAIR) {
                tracing::warn!("libzmq's threads not started by an agent thread: {e}");
            }
            ctx
        };
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .spawn_scoped(s, on_agent_thread)
                .map(|t| t.join())
        })
        .ok()
        .and_then(Result::ok)
        .unwrap_or_else(new_context)
    })
}

fn new_context() -> zmq::Context {
    let ctx = zmq::Context::new();
    if let Err(e) = ctx.set_io_threads(IO_THREADS) {
        tracing::warn!("libzmq kept its default I/O threads: {e}");
    }
    ctx
}

/// How an agent's libzmq sockets authenticate: with the cluster token (ZAP PLAIN, the password
/// derived from it) or not at all. Cheap to clone.
#[derive(Clone, Default)]
pub struct Auth {
    token: Option<Arc<str>>,
    /// Presents the token itself, to a peer older than token proofs.
    in_clear: bool,
    /// Takes the token itself from peers beyond loopback too (`--insecure`).
    insecure: bool,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mechanism = if self.token.is_some() {
            "PLAIN"
        } else {
            "NULL"
        };
        f.debug_struct("Auth")
            .field("mechanism", &mechanism)
            .field("in_clear", &self.in_clear)
            .finish()
    }
}

/// User name a client presents with its password (ZAP PLAIN needs one; only the password
/// counts).
const PLAIN_USER: &str = "kvferry";

impl Auth {
    /// Authentication with `token`, or none when it is `None` or empty.
    pub fn new(token: Option<&str>) -> Auth {
        Auth {
            token: token.filter(|t| !t.is_empty()).map(Arc::from),
            in_clear: false,
            insecure: false,
        }
    }

    /// This authentication, taking the token itself (from peers older than
    /// [`crate::protocol::TOKEN_PROOFS`]) from beyond loopback too: `--insecure`. Without,
    /// such a peer is refused in the handshake unless it is on loopback.
    pub fn insecure(self, insecure: bool) -> Auth {
        Auth { insecure, ..self }
    }

    /// This authentication towards a peer older than [`crate::protocol::TOKEN_PROOFS`]: a
    /// socket that connects presents the token itself, in clear (the agents send it only on
    /// loopback, or with `--insecure`).
    pub fn in_clear(&self) -> Auth {
        Auth {
            in_clear: true,
            ..self.clone()
        }
    }

    /// Makes `socket` (which binds) require the token from every connection, and close a
    /// connection whose handshake is not done within the proof deadline (libzmq's
    /// `ZMQ_HANDSHAKE_IVL`, 30 s by default); the returned registration must live as long as
    /// the socket.
    fn server(&self, socket: &zmq::Socket) -> Result<Option<zap::Domain>, zmq::Error> {
        let deadline = kvferry_wire::admission::PROOF_DEADLINE.as_millis();
        socket.set_handshake_ivl(i32::try_from(deadline).unwrap_or(i32::MAX))?;
        let Some(token) = &self.token else {
            return Ok(None);
        };
        let domain = zap::Domain::register(token.clone(), self.insecure)?;
        socket.set_plain_server(true)?;
        socket.set_zap_domain(domain.name())?;
        Ok(Some(domain))
    }

    /// Makes `socket` (which connects) present the password derived from the token, or the
    /// token itself ([`Auth::in_clear`]).
    fn client(&self, socket: &zmq::Socket) -> Result<(), zmq::Error> {
        if let Some(token) = &self.token {
            socket.set_plain_username(Some(PLAIN_USER))?;
            match self.in_clear {
                true => socket.set_plain_password(Some(token))?,
                false => socket.set_plain_password(Some(&crate::protocol::zap_password(token)))?,
            }
        }
        Ok(())
    }
}

/// Wakes a socket thread blocked in `zmq::poll` when work is queued for it: a socket pair
/// whose read end the thread polls next to its libzmq sockets.
struct Wake {
    tx: UnixStream,
    rx: UnixStream,
}

impl Wake {
    fn new() -> std::io::Result<Wake> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(Wake { tx, rx })
    }

    /// A handle that wakes the thread.
    fn waker(&self) -> std::io::Result<Waker> {
        Ok(Waker(Arc::new(self.tx.try_clone()?)))
    }

    fn poll_item(&self) -> zmq::PollItem<'static> {
        zmq::PollItem::from_fd(self.rx.as_raw_fd(), zmq::POLLIN)
    }

    /// Consumes pending wake-ups.
    fn drain(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.rx).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// Wakes a socket thread; cheap to clone.
#[derive(Clone)]
struct Waker(Arc<UnixStream>);

impl Waker {
    fn wake(&self) {
        // A full socket buffer means a wake-up is pending already.
        let _ = (&*self.0).write(&[1]);
    }
}

/// A bind address for `host` and `port` (0: the OS picks) over tcp, with IPv6 literals in
/// brackets.
pub(crate) fn tcp_address(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

/// A libzmq frame owned by the `Bytes` that views it (libzmq frees it on drop): received bytes
/// are handed out without a copy.
struct Owned(zmq::Message);

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

fn owned(msg: zmq::Message) -> bytes::Bytes {
    bytes::Bytes::from_owner(Owned(msg))
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(|| {
            crate::cpus::on_agent_thread();
            f()
        })
        .map(drop)
}

/// Reads every frame of the message whose first frame is `first` (so that the socket stays
/// usable), keeping at most `keep` of them. libzmq delivers a message's frames together.
fn rest_of_message(
    socket: &zmq::Socket,
    first: zmq::Message,
    keep: usize,
) -> Result<Vec<zmq::Message>, zmq::Error> {
    let mut more = first.get_more();
    let mut frames = vec![first];
    while more {
        let mut next = zmq::Message::new();
        socket.recv(&mut next, zmq::DONTWAIT)?;
        more = next.get_more();
        if frames.len() <= keep {
            frames.push(next);
        }
    }
    Ok(frames)
}

#[cfg(test)]
mod tests;
