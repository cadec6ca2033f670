//! libzmq's socket monitor: a PAIR socket on which libzmq reports what happens to a socket's
//! connections (connected, handshake done or refused, disconnected), each event with the file
//! descriptor of the connection it concerns; and a connecting socket's handshake as its
//! monitor reports it.

use std::time::{Duration, Instant};

use super::context;
use crate::transport::TransportError;

/// What a socket's connection went through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Event {
    /// A connection this socket made was established (TCP); its handshake follows.
    Connected { fd: i32 },
    /// A connection to this (bound) socket was accepted; its handshake follows.
    Accepted { fd: i32 },
    /// A connection attempt of this socket failed (refused, unreachable); libzmq retries.
    Retried,
    /// A connection completed its ZMTP handshake (and authentication): it carries messages.
    Ready,
    /// A connection was closed (by the peer, the network or libzmq itself).
    Disconnected { fd: i32 },
    /// The peer refused our credentials, or we refused the peer's.
    AuthFailed,
    /// The peer speaks another security mechanism (a token on one side only).
    MechanismMismatch,
}

/// The events a [`Monitor`] listens to.
const EVENTS: u32 = zmq_sys::ZMQ_EVENT_CONNECTED
    | zmq_sys::ZMQ_EVENT_ACCEPTED
    | zmq_sys::ZMQ_EVENT_CONNECT_RETRIED
    | zmq_sys::ZMQ_EVENT_HANDSHAKE_SUCCEEDED
    | zmq_sys::ZMQ_EVENT_DISCONNECTED
    | zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_AUTH
    | zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL;

/// Stops `socket`'s monitor. Call it before the [`Monitor`] (the reading end) is dropped while
/// the socket lives, and before a monitored socket is closed: libzmq reports events from its
/// I/O threads with blocking sends, so an event for a monitor nobody reads any more (a
/// connection dropping, a reconnection retried, the connections closing with the socket)
/// blocks that I/O thread, and every socket it serves, for good. Seen as agents started in a
/// process after others stopped whose handshakes never began.
#[allow(unsafe_code)]
pub(super) fn stop(socket: &mut zmq::Socket) {
    // SAFETY: the socket is open (borrowed from its owner, on its owner's thread); a null
    // endpoint asks libzmq to stop monitoring it (zmq_socket_monitor), and no other argument
    // is read.
    unsafe { zmq_sys::zmq_socket_monitor(socket.as_mut_ptr(), std::ptr::null(), 0) };
}

/// The monitor of one socket.
pub(super) struct Monitor {
    pair: zmq::Socket,
}

impl Monitor {
    /// Starts monitoring `socket`; call before it binds or connects, so no event is missed.
    pub(super) fn new(socket: &zmq::Socket) -> Result<Monitor, zmq::Error> {
        let endpoint = format!("inproc://kvferry-monitor-{}", uuid::Uuid::new_v4().simple());
        socket.monitor(&endpoint, EVENTS as i32)?;
        let pair = context().socket(zmq::PAIR)?;
        pair.connect(&endpoint)?;
        Ok(Monitor { pair })
    }

    pub(super) fn poll_item(&self) -> zmq::PollItem<'_> {
        self.pair.as_poll_item(zmq::POLLIN)
    }

    /// The next event already reported, without waiting.
    pub(super) fn next(&self) -> Option<Event> {
        loop {
            let mut head = zmq::Message::new();
            self.pair.recv(&mut head, zmq::DONTWAIT).ok()?;
            // The second frame names the endpoint; it is not needed.
            if head.get_more() {
                let mut endpoint = zmq::Message::new();
                let _ = self.pair.recv(&mut endpoint, zmq::DONTWAIT);
            }
            if let Some(event) = parse(&head) {
                return Some(event);
            }
        }
    }
}

/// An event's first frame: u16 event id, u32 value (the connection's file descriptor for a
/// connect or a disconnect; an error code for the handshake events).
fn parse(head: &[u8]) -> Option<Event> {
    let id = u16::from_le_bytes(head.get(..2)?.try_into().ok()?);
    let value = u32::from_le_bytes(head.get(2..6)?.try_into().ok()?);
    let fd = i32::try_from(value).unwrap_or(-1);
    match u32::from(id) {
        zmq_sys::ZMQ_EVENT_CONNECTED => Some(Event::Connected { fd }),
        zmq_sys::ZMQ_EVENT_ACCEPTED => Some(Event::Accepted { fd }),
        zmq_sys::ZMQ_EVENT_CONNECT_RETRIED => Some(Event::Retried),
        zmq_sys::ZMQ_EVENT_HANDSHAKE_SUCCEEDED => Some(Event::Ready),
        zmq_sys::ZMQ_EVENT_DISCONNECTED => Some(Event::Disconnected { fd }),
        zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_AUTH => Some(Event::AuthFailed),
        zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL => Some(Event::MechanismMismatch),
        _ => None,
    }
}

/// Connections a peer may close in the middle of the handshake before the handshake counts as
/// refused. A peer that wants another mechanism closes the connection when it reads this
/// socket's greeting; libzmq reports that as a mechanism mismatch only when this side parsed
/// the peer's whole greeting first, which is a race that can be lost on every retry.
const HANDSHAKE_DROPS: u32 = 3;

/// Waits for the monitor of a socket that connects to report its handshake: the connection's
/// descriptor, or why it failed.
pub(super) fn handshake(
    monitor: &Monitor,
    endpoint: &str,
    timeout: Duration,
) -> Result<i32, TransportError> {
    let deadline = Instant::now() + timeout;
    let refused = |why: &str| TransportError::unauthorized("connect", endpoint, why);
    let mut connection = -1;
    let (mut open, mut dropped) = (false, 0);
    let mut seen: Vec<String> = Vec::new();
    loop {
        while let Some(event) = monitor.next() {
            if seen.len() < 8 {
                seen.push(format!("{event:?}"));
            }
            match event {
                Event::Connected { fd } => (connection, open) = (fd, true),
                Event::Ready => return Ok(connection),
                Event::Disconnected { .. } if open => {
                    open = false;
                    dropped += 1;
                    if dropped == HANDSHAKE_DROPS {
                        return Err(refused(&format!(
                            "the peer closed {dropped} connections in the middle of the handshake: it \
                             expects another security mechanism or token (give both agents the same \
                             --token), it is not a kvferry agent, or it dropped them at a connection \
                             limit (its log says \"connection dropped\" with the limit)"
                        )));
                    }
                }
                Event::AuthFailed => {
                    return Err(refused("the peer refused this agent's token"));
                }
                Event::MechanismMismatch => {
                    return Err(refused(
                        "the peer expects another security mechanism: give both agents the same --token",
                    ));
                }
                Event::Disconnected { .. } | Event::Accepted { .. } | Event::Retried => {}
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let what = match seen.is_empty() {
                true => "no connection event".to_owned(),
                false => format!("connection events {}", seen.join(", ")),
            };
            return Err(TransportError::new(
                "connect",
                endpoint,
                format!("no answer within {timeout:?} ({what})"),
            ));
        }
        let mut items = [monitor.poll_item()];
        let ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX).max(1);
        zmq::poll(&mut items, ms).map_err(|e| TransportError::new("connect", endpoint, e))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_parse_from_their_first_frame() {
        let frame = |id: u32, value: u32| {
            let mut f = (id as u16).to_le_bytes().to_vec();
            f.extend_from_slice(&value.to_le_bytes());
            f
        };
        assert_eq!(
            parse(&frame(zmq_sys::ZMQ_EVENT_DISCONNECTED, 17)),
            Some(Event::Disconnected { fd: 17 })
        );
        assert_eq!(
            parse(&frame(zmq_sys::ZMQ_EVENT_CONNECTED, 9)),
            Some(Event::Connected { fd: 9 })
        );
        assert_eq!(
            parse(&frame(zmq_sys::ZMQ_EVENT_ACCEPTED, 11)),
            Some(Event::Accepted { fd: 11 })
        );
        assert_eq!(
            parse(&frame(zmq_sys::ZMQ_EVENT_CONNECT_RETRIED, 20)),
            Some(Event::Retried)
        );
        assert_eq!(
            parse(&frame(zmq_sys::ZMQ_EVENT_HANDSHAKE_SUCCEEDED, 0)),
            Some(Event::Ready)
        );
        assert_eq!(
            parse(&frame(zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, 400)),
            Some(Event::AuthFailed)
        );
        assert_eq!(parse(&frame(zmq_sys::ZMQ_EVENT_LISTENING, 3)), None);
        assert_eq!(parse(&[1, 0, 0]), None, "a short frame is no event");
    }
}
