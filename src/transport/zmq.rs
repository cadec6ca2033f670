//! ZeroMQ sockets (the pure-Rust `zeromq` crate on tokio): the control plane (ROUTER on the
//! prefill, DEALER on the decode) and the `zmq-tcp` / `zmq-ipc` data plane (PUSH on the
//! prefill, PULL on the decode, one two-frame message per chunk: header, payload).
//!
//! Payloads travel as `Bytes` frames: a sender hands over its staging buffer without a copy
//! and a receiver scatters straight out of the received frame.

use std::time::Duration;

use bytes::Bytes;
use zeromq::prelude::*;
use zeromq::{
    DealerRecvHalf, DealerSendHalf, DealerSocket, PullSocket, PushSocket, RouterRecvHalf,
    RouterSendHalf, RouterSocket, SocketOptions, ZmqMessage,
};

use super::{
    BoxFuture, DataReceiver, DataSender, Listening, Transport, TransportError, TransportKind,
};

/// The ZeroMQ data plane of one kind (`zmq-tcp` or `zmq-ipc`).
#[derive(Debug)]
pub struct ZmqData {
    kind: TransportKind,
}

impl ZmqData {
    /// The ZeroMQ data plane over `kind`'s socket family.
    pub fn new(kind: TransportKind) -> Self {
        ZmqData { kind }
    }
}

/// A bind address for `host` on a fresh port (tcp) or a fresh socket file (ipc).
fn bind_address(kind: TransportKind, host: &str) -> String {
    match kind {
        TransportKind::ZmqTcp => format!("tcp://{host}:0"),
        TransportKind::ZmqIpc => {
            let dir = std::env::temp_dir();
            let name = format!("kvferry-{}.sock", uuid::Uuid::new_v4().simple());
            format!("ipc://{}", dir.join(name).display())
        }
    }
}

fn options(timeout: Option<Duration>) -> SocketOptions {
    // The crate's default read buffer (64 KiB at most) measured fastest here for 1 MiB
    // chunks: larger buffers cost more in reallocation than they save in reads.
    let mut o = SocketOptions::default();
    if let Some(t) = timeout {
        o.connect_timeout(t);
    }
    o
}

impl Transport for ZmqData {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    fn listen(&self, host: &str) -> BoxFuture<'static, Result<Listening, TransportError>> {
        let address = bind_address(self.kind, host);
        Box::pin(async move {
            let mut socket = PullSocket::with_options(options(None));
            let endpoint = socket
                .bind(&address)
                .await
                .map_err(|e| TransportError::new("bind", &address, e))?;
            let receiver: Box<dyn DataReceiver> = Box::new(ZmqReceiver {
                socket,
                endpoint: endpoint.to_string(),
            });
            Ok((endpoint.to_string(), receiver))
        })
    }

    fn connect(
        &self,
        endpoint: &str,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<Box<dyn DataSender>, TransportError>> {
        let endpoint = endpoint.to_owned();
        Box::pin(async move {
            let mut socket = PushSocket::with_options(options(Some(timeout)));
            tokio::time::timeout(timeout, socket.connect(&endpoint))
                .await
                .map_err(|_| {
                    TransportError::new(
                        "connect",
                        &endpoint,
                        format!("no answer within {timeout:?}"),
                    )
                })?
                .map_err(|e| TransportError::new("connect", &endpoint, e))?;
            let sender: Box<dyn DataSender> = Box::new(ZmqSender { socket, endpoint });
            Ok(sender)
        })
    }
}

struct ZmqSender {
    socket: PushSocket,
    endpoint: String,
}

impl DataSender for ZmqSender {
    fn send(&mut self, header: Bytes, payload: Bytes) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let mut msg = ZmqMessage::from(header);
            msg.push_back(payload);
            self.socket
                .send(msg)
                .await
                .map_err(|e| TransportError::new("send", &self.endpoint, e))
        })
    }
}

struct ZmqReceiver {
    socket: PullSocket,
    endpoint: String,
}

impl DataReceiver for ZmqReceiver {
    fn recv(&mut self) -> BoxFuture<'_, Result<(Bytes, Bytes), TransportError>> {
        Box::pin(async move {
            let msg = self
                .socket
                .recv()
                .await
                .map_err(|e| TransportError::new("recv", &self.endpoint, e))?;
            let mut frames = msg.into_vecdeque();
            match (frames.pop_front(), frames.pop_front(), frames.is_empty()) {
                (Some(header), Some(payload), true) => Ok((header, payload)),
                (_, _, _) => Err(TransportError::new(
                    "recv",
                    &self.endpoint,
                    "a data message must have exactly two frames (header, payload)",
                )),
            }
        })
    }
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
