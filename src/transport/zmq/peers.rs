//! The connections of one bound socket, from its monitor's accept and disconnect events and
//! the descriptor each message came in on. A connection is unproven
//! ([`kvferry_wire::admission`]) until a message that proves it arrives (on the prefill's
//! control socket a valid Hello, on the decode's data socket a current peer's key
//! (`transport::ProofCheck`); with a token, only after its
//! handshake presented the token); messages before that are dropped unread by the agent, and
//! the connection's deadline runs on. Unproven ones are bounded on their own
//! (oldest shut down first, none held past the deadline), and only proven ones count against
//! [`MAX_PER_PEER`] per address. With the per-connection bound (`(HWM + 1) x` the largest
//! frame), this bounds the memory one host can make a socket hold, and connections that never
//! send a message never take a real peer's place.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvferry_wire::admission::{Dropped, Unproven};

/// Proven connections one address may hold to one socket: every rank of a host connects once
/// to each peer socket, so this leaves room for hosts of many ranks.
pub const MAX_PER_PEER: usize = 64;

/// The connections of one bound socket.
#[derive(Default)]
pub(super) struct Connections {
    unproven: Unproven<i32>,
    /// Every connection held, by descriptor: its address (none on ipc).
    address_of: HashMap<i32, Option<IpAddr>>,
    /// Proven connections per address.
    per_address: HashMap<IpAddr, usize>,
    /// The proven connections counted in `per_address`.
    counted: HashMap<i32, IpAddr>,
    /// Connections refused beyond [`MAX_PER_PEER`], and when each is shut down.
    refused: Vec<(i32, Instant)>,
}

/// How long a refused connection stays open after its refusal: long enough for the socket to
/// send the peer why.
pub(super) const REFUSAL_LINGER: Duration = Duration::from_millis(200);

/// What to do with a message, by the connection it came over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Hand it to the agent.
    Deliver,
    /// The connection was just refused (why): drop the message, and tell the peer if the
    /// socket can.
    Refuse(String),
    /// The connection was refused already: drop the message.
    Drop,
}

impl Connections {
    /// A connection was accepted on `fd` at `now`: unproven until its first message. The
    /// oldest unproven one is shut down when there are too many.
    pub(super) fn accepted(&mut self, fd: i32, now: Instant) {
        // A connection whose first message was read before this event is counted already.
        if fd < 0 || self.address_of.contains_key(&fd) {
            return;
        }
        self.address_of.insert(fd, peer_address(fd));
        if let Some(old) = self.unproven.admit(fd, now) {
            self.drop_unproven(old, Dropped::Crowded);
        }
    }

    /// A message arrived over `fd`; `proves`: whether it is one that proves a connection, asked
    /// only while the connection is unproven (or not seen yet). The first that does proves it, which then counts against its address's [`MAX_PER_PEER`]:
    /// beyond it, the connection is refused. Messages before it are dropped (the connection
    /// stays unproven, its deadline unchanged). A refused connection's messages are not
    /// delivered; the connection is shut down after [`REFUSAL_LINGER`], so that the socket can
    /// tell its peer why first (a ROUTER can).
    pub(super) fn message(
        &mut self,
        fd: i32,
        now: Instant,
        proves: impl FnOnce() -> bool,
    ) -> Verdict {
        if self.refused.iter().any(|&(f, _)| f == fd) {
            return Verdict::Drop;
        }
        // The monitor's accept event and the socket's first message come over two sockets, in
        // no fixed order: a connection not seen yet is one whose first message this is, or one
        // already closed whose last message is read after its disconnect event. Only a proof
        // files it: a descriptor filed here for nothing could be shut down at the deadline
        // after libzmq closed it and the process reused its number.
        let unseen = fd >= 0 && !self.address_of.contains_key(&fd);
        if (unseen || self.unproven.contains(&fd)) && !proves() {
            tracing::debug!(fd, "a message before the connection's proof: dropped");
            return Verdict::Drop;
        }
        if unseen {
            self.address_of.insert(fd, peer_address(fd));
        }
        if !self.unproven.prove(&fd) && !unseen {
            return Verdict::Deliver;
        }
        let Some(Some(address)) = self.address_of.get(&fd).copied() else {
            return Verdict::Deliver;
        };
        let held = self.per_address.entry(address).or_default();
        if *held >= MAX_PER_PEER {
            let limit = format!(
                "connection refused: the limit of {MAX_PER_PEER} connections from one address \
                 ({address}) that proved themselves"
            );
            tracing::warn!(peer = %address, %limit, "connection refused");
            self.refused.push((fd, now + REFUSAL_LINGER));
            return Verdict::Refuse(limit);
        }
        *held += 1;
        self.counted.insert(fd, address);
        Verdict::Deliver
    }

    /// The connection on `fd` was closed.
    pub(super) fn disconnected(&mut self, fd: i32) {
        self.unproven.forget(&fd);
        self.refused.retain(|&(f, _)| f != fd);
        self.address_of.remove(&fd);
        let Some(address) = self.counted.remove(&fd) else {
            return;
        };
        if let Some(held) = self.per_address.get_mut(&address) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                self.per_address.remove(&address);
            }
        }
    }

    /// Shuts down the connections unproven past their deadline, and the refused ones whose
    /// linger ended; the next deadline.
    pub(super) fn expire(&mut self, now: Instant) -> Option<Instant> {
        let (late, mut next) = self.unproven.expire(now);
        for fd in late {
            self.drop_unproven(fd, Dropped::Late);
        }
        self.refused.retain(|&(fd, at)| {
            if at <= now {
                shut_down(fd);
                return false;
            }
            next = Some(next.map_or(at, |n| n.min(at)));
            true
        });
        next
    }

    fn drop_unproven(&mut self, fd: i32, why: Dropped) {
        let peer = match self.address_of.get(&fd) {
            Some(Some(address)) => address.to_string(),
            _ => "local".to_owned(),
        };
        tracing::warn!(%peer, limit = %why.limit(), "connection dropped");
        shut_down(fd);
    }

    #[cfg(test)]
    fn held(&self, address: IpAddr) -> usize {
        self.per_address.get(&address).copied().unwrap_or(0)
    }
}

/// The descriptors are libzmq's: kvferry only looks at them and shuts one down, which makes
/// libzmq's own read fail so that libzmq closes it.
#[allow(unsafe_code)]
mod fd {
    use std::net::IpAddr;
    use std::os::fd::BorrowedFd;

    /// The address of the peer connected on `fd`, if it is an internet socket.
    pub(super) fn peer_address(fd: i32) -> Option<IpAddr> {
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a connection libzmq reported accepted and has not reported closed;
        // it stays open for this call, which neither closes nor keeps it.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let address = rustix::net::getpeername(borrowed).ok()??;
        let address = std::net::SocketAddr::try_from(address).ok()?;
        Some(address.ip().to_canonical())
    }

    /// Shuts the connection on `fd` down (without closing the descriptor, which stays
    /// libzmq's).
    pub(super) fn shut_down(fd: i32) {
        if fd < 0 {
            return;
        }
        // SAFETY: as in `peer_address`; shutdown(2) does not close the descriptor.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let _ = rustix::net::shutdown(borrowed, rustix::net::Shutdown::Both);
    }
}

use fd::{peer_address, shut_down};

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;
    use std::os::fd::AsRawFd as _;

    fn pair(listener: &std::net::TcpListener) -> (std::net::TcpStream, std::net::TcpStream) {
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        (client, server)
    }

    fn shut(client: &mut std::net::TcpStream) -> bool {
        client
            .set_read_timeout(Some(std::time::Duration::from_millis(200)))
            .expect("timeout");
        let mut buf = [0u8; 1];
        matches!(client.read(&mut buf), Ok(0))
    }

    #[test]
    fn proven_connections_beyond_the_limit_from_one_address_are_shut_down() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let (mut clients, mut accepted) = (Vec::new(), Vec::new());
        let mut conns = Connections::default();
        let now = Instant::now();
        for i in 0..=MAX_PER_PEER {
            let (client, server) = pair(&listener);
            conns.accepted(server.as_raw_fd(), now);
            let verdict = conns.message(server.as_raw_fd(), now, || true);
            match i < MAX_PER_PEER {
                true => assert_eq!(verdict, Verdict::Deliver),
                false => assert!(
                    matches!(&verdict, Verdict::Refuse(why) if why.contains("64 connections from one address")),
                    "{verdict:?}"
                ),
            }
            clients.push(client);
            accepted.push(server);
        }
        let local: IpAddr = "127.0.0.1".parse().expect("ip");
        assert_eq!(conns.held(local), MAX_PER_PEER);
        // The one over the limit was refused, with the limit, its later messages dropped; it
        // is shut down once the linger ended: its client reads the end of the stream.
        let last_fd = accepted.last().expect("one").as_raw_fd();
        assert_eq!(conns.message(last_fd, now, || true), Verdict::Drop);
        let mut last = clients.pop().expect("a client");
        assert!(!shut(&mut last), "shut down before the peer could be told");
        assert_eq!(conns.expire(now + REFUSAL_LINGER), None);
        assert!(shut(&mut last), "not shut down");
        assert!(!shut(&mut clients[0]), "a counted one stays");
        // One closes: the next one from that address is counted again.
        conns.disconnected(accepted[0].as_raw_fd());
        assert_eq!(conns.held(local), MAX_PER_PEER - 1);
        conns.disconnected(accepted[0].as_raw_fd());
        assert_eq!(
            conns.held(local),
            MAX_PER_PEER - 1,
            "a second close counts once"
        );
        conns.disconnected(accepted[MAX_PER_PEER].as_raw_fd());
        assert_eq!(conns.held(local), MAX_PER_PEER - 1, "an uncounted one");
    }

    #[test]
    fn a_first_message_read_before_its_accept_event_counts_against_the_limit() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let mut conns = Connections::default();
        let now = Instant::now();
        let mut held = Vec::new();
        for i in 0..=MAX_PER_PEER {
            let (client, server) = pair(&listener);
            let fd = server.as_raw_fd();
            // The message first, the accept event after it.
            let verdict = conns.message(fd, now, || true);
            conns.accepted(fd, now);
            match i < MAX_PER_PEER {
                true => assert_eq!(verdict, Verdict::Deliver),
                false => assert!(matches!(verdict, Verdict::Refuse(_)), "{verdict:?}"),
            }
            held.push((client, server));
        }
        let local: IpAddr = "127.0.0.1".parse().expect("ip");
        assert_eq!(conns.held(local), MAX_PER_PEER);
        // None of them is taken for silent: none is shut down as late.
        conns.expire(now + Duration::from_secs(3600));
        assert!(!shut(&mut held[0].0), "a counted connection was shut down");
    }

    #[test]
    fn messages_before_the_proof_are_dropped_and_never_file_a_descriptor() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let mut conns = Connections::default();
        let now = Instant::now();
        let local: IpAddr = "127.0.0.1".parse().expect("ip");
        // Accepted, then a message that is not a proof: dropped, still unproven, counted
        // nowhere; the proof then delivers and counts it.
        let (mut proven, server) = pair(&listener);
        conns.accepted(server.as_raw_fd(), now);
        assert_eq!(
            conns.message(server.as_raw_fd(), now, || false),
            Verdict::Drop
        );
        assert_eq!(conns.held(local), 0);
        assert_eq!(
            conns.message(server.as_raw_fd(), now, || true),
            Verdict::Deliver
        );
        // A proven connection's messages are delivered without being tested again.
        let untested = || panic!("a proven connection's message was tested");
        assert_eq!(
            conns.message(server.as_raw_fd(), now, untested),
            Verdict::Deliver
        );
        assert_eq!(conns.held(local), 1);
        // Read before its accept event, or after its disconnect event (the descriptor then
        // names nothing, or another socket of the process): dropped and not filed, so
        // nothing is ever shut down on that number.
        let (mut other, reused) = pair(&listener);
        conns.accepted(reused.as_raw_fd(), now);
        conns.disconnected(reused.as_raw_fd());
        assert_eq!(
            conns.message(reused.as_raw_fd(), now, || false),
            Verdict::Drop
        );
        let (mut silent, unproven) = pair(&listener);
        conns.accepted(unproven.as_raw_fd(), now);
        conns.expire(now + kvferry_wire::admission::PROOF_DEADLINE);
        assert!(shut(&mut silent), "the unproven one expired");
        assert!(
            !shut(&mut other),
            "a descriptor filed by a stray message was shut down"
        );
        assert!(!shut(&mut proven), "the proven one stays");
    }

    #[test]
    fn silent_connections_never_take_a_proven_connections_place() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let mut conns = Connections::default();
        let now = Instant::now();
        let limit = kvferry_wire::admission::MAX_UNPROVEN;
        let mut silent = Vec::new();
        for _ in 0..limit + 10 {
            let (client, server) = pair(&listener);
            conns.accepted(server.as_raw_fd(), now);
            silent.push((client, server));
        }
        // The 10 oldest silent ones were shut down to make room.
        for (client, _) in &mut silent[..10] {
            assert!(shut(client), "the oldest go first");
        }
        assert!(!shut(&mut silent[10].0));
        // A peer that connects now and sends gets its place whatever the silent ones hold.
        let (mut peer, server) = pair(&listener);
        conns.accepted(server.as_raw_fd(), now);
        conns.message(server.as_raw_fd(), now, || true);
        let local: IpAddr = "127.0.0.1".parse().expect("ip");
        assert_eq!(conns.held(local), 1);
        assert!(!shut(&mut peer));
        // Past the deadline every silent one is shut down; the peer stays.
        let later = now + kvferry_wire::admission::PROOF_DEADLINE;
        assert_eq!(conns.expire(later), None);
        for (client, _) in &mut silent[10..] {
            assert!(shut(client), "expired");
        }
        assert!(!shut(&mut peer));
        assert_eq!(conns.held(local), 1);
    }
}
