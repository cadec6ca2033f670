//! The control plane on ZeroMQ (the pure-Rust `zeromq` crate on tokio): ROUTER on the
//! prefill, DEALER on the decode, one protocol message per frame. Control messages are small
//! and few, so the crate's framing copies cost nothing that matters here.
//!
//! The `zmq-tcp` / `zmq-ipc` data plane is libzmq's: see [`super::libzmq`]. The `zeromq`
//! crate's PUSH/PULL carried it before, and measured slower end to end (docs/benchmarks.md,
//! "ZeroMQ data plane"): its codec copies every payload into its write buffer and zero-fills
//! its read buffer, which libzmq does not.

use std::time::Duration;

use bytes::Bytes;
use zeromq::prelude::*;
use zeromq::{
    DealerRecvHalf, DealerSendHalf, DealerSocket, RouterRecvHalf, RouterSendHalf, RouterSocket,
    SocketOptions, ZmqMessage,
};

use super::TransportError;

fn options(timeout: Option<Duration>) -> SocketOptions {
    let mut o = SocketOptions::default();
    if let Some(t) = timeout {
        o.connect_timeout(t);
    }
    o
}

/// Identity of a control peer as the ROUTER sees it.
pub type PeerId = Bytes;

/// The prefill's control socket: receives from any decode, replies to one.
pub struct ControlServer {
    recv: RouterRecvHalf,
}

/// Sends control messages to decode peers; cheap to clone.
#[derive(Clone)]
pub struct ControlReplier {
    send: RouterSendHalf,
}

impl ControlServer {
    /// Binds on `host` (tcp, port chosen by the OS); returns the endpoint and the two halves.
    pub async fn bind(
        host: &str,
    ) -> Result<(String, ControlServer, ControlReplier), TransportError> {
        let address = format!("tcp://{host}:0");
        let mut socket = RouterSocket::with_options(options(None));
        let endpoint = socket
            .bind(&address)
            .await
            .map_err(|e| TransportError::new("bind", &address, e))?;
        let (send, recv) = socket.split();
        Ok((
            endpoint.to_string(),
            ControlServer { recv },
            ControlReplier { send },
        ))
    }

    /// The next message: the sender's identity and one frame. Messages of another shape are
    /// returned as an error, and the socket stays usable.
    pub async fn recv(&mut self) -> Result<(PeerId, Bytes), TransportError> {
        let msg = self
            .recv
            .recv()
            .await
            .map_err(|e| TransportError::new("recv", "control", e))?;
        let mut frames = msg.into_vecdeque();
        match (frames.pop_front(), frames.pop_front(), frames.is_empty()) {
            (Some(peer), Some(frame), true) => Ok((peer, frame)),
            _ => Err(TransportError::new(
                "recv",
                "control",
                "a control message must have exactly one frame",
            )),
        }
    }
}

impl ControlReplier {
    /// Sends one frame to `peer`.
    pub async fn send(&mut self, peer: &PeerId, frame: Bytes) -> Result<(), TransportError> {
        let mut msg = ZmqMessage::from(peer.clone());
        msg.push_back(frame);
        self.send
            .send(msg)
            .await
            .map_err(|e| TransportError::new("send", "control", e))
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
    send: DealerSendHalf,
    endpoint: String,
}

/// Receiving half of a [`ControlClient`].
pub struct ControlClientRecv {
    recv: DealerRecvHalf,
    endpoint: String,
}

impl ControlClient {
    /// Connects to a prefill's control endpoint, failing after `timeout` if unreachable.
    pub async fn connect(
        endpoint: &str,
        timeout: Duration,
    ) -> Result<ControlClient, TransportError> {
        let mut socket = DealerSocket::with_options(options(Some(timeout)));
        tokio::time::timeout(timeout, socket.connect(endpoint))
            .await
            .map_err(|_| {
                TransportError::new("connect", endpoint, format!("no answer within {timeout:?}"))
            })?
            .map_err(|e| TransportError::new("connect", endpoint, e))?;
        let (send, recv) = socket.split();
        Ok(ControlClient {
            send: ControlClientSend {
                send,
                endpoint: endpoint.to_owned(),
            },
            recv: ControlClientRecv {
                recv,
                endpoint: endpoint.to_owned(),
            },
        })
    }
}

impl ControlClientSend {
    /// Sends one frame.
    pub async fn send(&mut self, frame: Bytes) -> Result<(), TransportError> {
        self.send
            .send(ZmqMessage::from(frame))
            .await
            .map_err(|e| TransportError::new("send", &self.endpoint, e))
    }
}

impl ControlClientRecv {
    /// The next frame.
    pub async fn recv(&mut self) -> Result<Bytes, TransportError> {
        let msg = self
            .recv
            .recv()
            .await
            .map_err(|e| TransportError::new("recv", &self.endpoint, e))?;
        let mut frames = msg.into_vecdeque();
        match (frames.pop_front(), frames.is_empty()) {
            (Some(frame), true) => Ok(frame),
            _ => Err(TransportError::new(
                "recv",
                &self.endpoint,
                "a control message must have exactly one frame",
            )),
        }
    }
}
