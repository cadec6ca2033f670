//! How many connections each peer address holds to one bound socket, from the socket
//! monitor's accept and disconnect events; a connection beyond [`MAX_PER_PEER`] from one
//! address is shut down at once. With the per-connection bound (`(HWM + 1) x` the largest
//! frame), this bounds the memory one host can make a socket hold.

use std::collections::HashMap;
use std::net::IpAddr;

/// Connections one address may hold to one socket: every rank of a host connects once to
/// each peer socket, so this leaves room for hosts of many ranks.
pub const MAX_PER_PEER: usize = 64;

/// The connections of one bound socket, by descriptor and by address.
#[derive(Default)]
pub(super) struct Connections {
    by_fd: HashMap<i32, IpAddr>,
    per_address: HashMap<IpAddr, usize>,
}

impl Connections {
    /// A connection was accepted on `fd`: counted, or shut down when its address has
    /// [`MAX_PER_PEER`] already.
    pub(super) fn accepted(&mut self, fd: i32) {
        let Some(address) = peer_address(fd) else {
            return;
        };
        let held = self.per_address.entry(address).or_default();
        if *held >= MAX_PER_PEER {
            tracing::warn!(peer = %address, held = *held, "connection refused: too many from one address");
            shut_down(fd);
            return;
        }
        *held += 1;
        self.by_fd.insert(fd, address);
    }

    /// The connection on `fd` was closed.
    pub(super) fn disconnected(&mut self, fd: i32) {
        let Some(address) = self.by_fd.remove(&fd) else {
            return;
        };
        if let Some(held) = self.per_address.get_mut(&address) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                self.per_address.remove(&address);
            }
        }
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

    #[test]
    fn connections_beyond_the_limit_from_one_address_are_shut_down() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let addr = listener.local_addr().expect("addr");
        let mut clients = Vec::new();
        let mut accepted = Vec::new();
        let mut conns = Connections::default();
        for _ in 0..=MAX_PER_PEER {
            clients.push(std::net::TcpStream::connect(addr).expect("connect"));
            let (s, _) = listener.accept().expect("accept");
            conns.accepted(s.as_raw_fd());
            accepted.push(s);
        }
        let local: IpAddr = "127.0.0.1".parse().expect("ip");
        assert_eq!(conns.held(local), MAX_PER_PEER);
        // The one over the limit was shut down: its client reads the end of the stream.
        let mut last = clients.pop().expect("a client");
        let mut buf = [0u8; 1];
        assert_eq!(last.read(&mut buf).expect("read"), 0, "not shut down");
        // One closes: the next one from that address is counted again.
        conns.disconnected(accepted[0].as_raw_fd());
        assert_eq!(conns.held(local), MAX_PER_PEER - 1);
        conns.disconnected(accepted[0].as_raw_fd());
        assert_eq!(
            conns.held(local),
            MAX_PER_PEER - 1,
            "a second close counts once"
        );
        conns.disconnected(-1);
    }
}
