//! Transports move bytes between agents and know nothing of rooms.
//!
//! Two planes:
//! - the *control plane* carries protocol messages between a decode agent (which connects) and
//!   a prefill agent (which binds); it is always ZeroMQ over tcp ([`zmq::ControlServer`],
//!   [`zmq::ControlClient`]), bounded and authenticated as [`zmq`] describes;
//! - the *data plane* carries chunks, each a header (an encoded protocol message) and a payload
//!   (staging bytes), from a prefill agent to a decode agent. It is what varies by transport:
//!   a decode agent listens with [`Transport::listen`] and advertises the endpoint in Hello; a
//!   prefill agent connects with [`Transport::connect`]. `zmq-tcp` and `zmq-ipc` are libzmq
//!   PUSH/PULL ([`zmq::ZmqData`]).
//!
//! The trait is object-safe and small so that another transport (UCX) plugs in without
//! touching the agents: pick it with [`for_kind`].

pub mod mapped;
#[cfg(feature = "ucx")]
pub mod ucx;
pub mod zmq;

use crate::memory::{RemoteMemory, Span, WriteRun};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;

use crate::kernel::cuda::DevicePool;
use crate::pool::HostPool;

/// A KV pool that a transport reads and writes itself: it sends runs straight from it
/// ([`DataSender::send_runs`]), places received runs into it ([`Placer::place`]) and
/// registers it for peers ([`DataReceiver::expose`]). Host memory, or device memory where the
/// transport moves CUDA memory ([`DeviceMemory::Sends`]), which it then reads and writes only
/// with the device's own copies.
#[derive(Clone, Debug)]
pub enum PoolMemory {
    /// A host pool.
    Host(Arc<HostPool>),
    /// A device pool a transport may register ([`DevicePool::registrable`]).
    Device(Arc<DevicePool>),
}

/// A boxed future, for the object-safe trait methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Errors of a transport operation, naming the operation and the endpoint.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("{op} {endpoint}: {message}")]
pub struct TransportError {
    /// The operation that failed (`bind`, `connect`, `send`, `recv`).
    pub op: &'static str,
    /// The endpoint concerned.
    pub endpoint: String,
    /// What went wrong.
    pub message: String,
    /// What the failure means for the peer: callers match this, never `op`.
    pub kind: TransportErrorKind,
}

/// What a [`TransportError`] means for the peer that caused it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportErrorKind {
    /// The operation failed (unreachable, connection refused, timed out, dead peer, local
    /// error).
    Failed,
    /// An address or key the peer announced does not have the transport's format: refused
    /// before the transport used it (a `bad_message`, not an unreachable peer).
    Malformed,
    /// The peer refused this agent's credentials in the handshake, or asked for others (a
    /// token on one side only): `unauthorized`, not an unreachable peer.
    Unauthorized,
    /// The peer answered that it refuses what was sent (a decode refusing a placed chunk's
    /// runs: its room ended there): the room is over there, the peer is alive.
    Refused,
    /// The peer did not give an answer it owed within the timeout (a decode never saying a
    /// placed chunk's receives were posted): a stall, not a dead peer.
    Unanswered,
    /// The peer's transport cannot exchange data with this one (UCX of another release):
    /// `incompatible_version`, naming both.
    Incompatible,
}

impl TransportError {
    pub(crate) fn new(op: &'static str, endpoint: &str, message: impl fmt::Display) -> Self {
        TransportError {
            op,
            endpoint: endpoint.to_owned(),
            message: message.to_string(),
            kind: TransportErrorKind::Failed,
        }
    }

    /// A [`TransportErrorKind::Malformed`] error (an address or key the transport parses
    /// itself: UCX's, a mapped pool's).
    pub(crate) fn malformed(op: &'static str, endpoint: &str, message: impl fmt::Display) -> Self {
        Self::new(op, endpoint, message).with_kind(TransportErrorKind::Malformed)
    }

    /// A [`TransportErrorKind::Unauthorized`] error.
    pub(crate) fn unauthorized(
        op: &'static str,
        endpoint: &str,
        message: impl fmt::Display,
    ) -> Self {
        Self::new(op, endpoint, message).with_kind(TransportErrorKind::Unauthorized)
    }

    /// The same error, classified as `kind`.
    pub(crate) fn with_kind(self, kind: TransportErrorKind) -> Self {
        TransportError { kind, ..self }
    }

    /// Whether the peer's address or key was malformed ([`TransportErrorKind::Malformed`]).
    pub fn is_malformed(&self) -> bool {
        self.kind == TransportErrorKind::Malformed
    }
}

/// The data-plane transports (their names are part of the CLI and the bench JSON).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// ZeroMQ PUSH/PULL over tcp.
    ZmqTcp,
    /// ZeroMQ PUSH/PULL over a Unix socket (same host only).
    ZmqIpc,
    /// UCX tagged messages; UCX picks its transports from `UCX_TLS` (RDMA, tcp, shared memory).
    #[cfg(feature = "ucx")]
    Ucx,
}

impl TransportKind {
    /// Every transport this build has.
    pub const ALL: &'static [TransportKind] = &[
        TransportKind::ZmqTcp,
        TransportKind::ZmqIpc,
        #[cfg(feature = "ucx")]
        TransportKind::Ucx,
    ];

    /// The transport's name on the command line, in Hello and in bench JSON.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::ZmqTcp => "zmq-tcp",
            TransportKind::ZmqIpc => "zmq-ipc",
            #[cfg(feature = "ucx")]
            TransportKind::Ucx => "ucx",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        TransportKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = TransportKind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown transport {s:?}; this build has {}",
                    names.join(", ")
                )
            })
    }
}

/// How one-sided writes to a receiver travel, as the transport found out when it attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WritePath {
    /// The underlying transports that carry them (e.g. `cma`, `tcp`, `rc_mlx5`).
    pub via: String,
    /// Whether the transport can send runs straight from the pool for the receiver to place
    /// ([`DataSender::send_runs`], [`Placer`]): no gather, no scatter, and no write into
    /// the receiver's memory that the receiver did not post itself.
    pub placed: bool,
    /// Whether placed runs would go as eager messages (UCX over tcp), which the receiver must
    /// land through receives it can revoke ([`Placer::revocable`]).
    pub eager: bool,
    /// Whether one-sided writes go at all: the sender's transport context has RMA (UCX asks
    /// for it only over RDMA transports, see `ucx/data.rs`).
    pub writes: bool,
    /// Whether they are the fast and safe way there: native one-sided writes (RDMA) on an
    /// endpoint whose peer's death the transport detects. UCX 1.13 emulates puts over tcp at a
    /// fraction of its tagged-send speed, and over shared memory through a FIFO that a dead
    /// sender can wedge (`ucx/data.rs`).
    pub fast: bool,
}

/// Whether a transport sends device memory (CUDA) and receives into it, as found at run time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceMemory {
    /// It does: a chunk's payload may stay in device staging on both sides
    /// ([`DataSender::send_device`], [`DataReceiver::land_on_device`]).
    Sends,
    /// It sends host memory only, for this reason (e.g. "UCX has no CUDA memory support").
    HostOnly(String),
}

/// A chunk's payload in CUDA device memory: the device staging a prefill gathered into, or
/// the one a decode receives into ([`DeviceSink`]). The transport reads or writes it with the
/// device's own copies (UCX's CUDA transports), never with host code.
///
/// # Safety
/// Implementors guarantee that `device_ptr()..device_ptr() + len()` is device memory,
/// allocated and not reused for as long as the value lives, with no device work pending on it
/// when it is handed to a transport (the gather that filled it has completed), and that
/// nothing else writes it while a transport may read or write it.
// An unsafe trait: a transport hands `device_ptr` to UCX, which writes and reads it.
#[allow(unsafe_code)]
pub unsafe trait DeviceBytes: Send + Sync + 'static {
    /// The device address of the first byte.
    fn device_ptr(&self) -> u64;
    /// Bytes.
    fn len(&self) -> usize;
    /// Never true for a chunk's payload (for clippy's `len_without_is_empty`).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The value, for the agent that made it to take it back.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Device memory for received payloads, of the receiver's device.
pub trait DeviceSink: Send + Sync {
    /// A device buffer of exactly `len` bytes (contents unspecified).
    fn take(&self, len: usize) -> Result<Arc<dyn DeviceBytes>, String>;
}

/// Most pool ranges a staged chunk is sent from without a gather ([`DataSender::send_from`]):
/// more, shorter pieces (page tables out of order, head slices) are gathered. With raw UCX over
/// tcp a message of this many pieces goes as fast as one buffer, and one of many more pieces
/// slower. A whole-heads chunk of consecutive pages is one range per layer plane it covers.
pub const MAX_PIECES: usize = 8;

/// A received chunk's payload: host bytes, or device memory where the chunk came from device
/// staging to a receiver that lands on the device.
#[derive(Clone)]
pub enum Payload {
    /// Host memory (every transport).
    Host(Bytes),
    /// Host memory in pieces, one after the other: a chunk its sender sent from its pool
    /// without a gather, as up to [`MAX_PIECES`] messages (ZeroMQ frames).
    Pieces(Vec<Bytes>),
    /// Device memory ([`DataReceiver::land_on_device`]).
    Device(Arc<dyn DeviceBytes>),
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Payload::Host(b) => f.debug_tuple("Host").field(&b.len()).finish(),
            Payload::Pieces(p) => f.debug_tuple("Pieces").field(&p.len()).finish(),
            Payload::Device(d) => f.debug_tuple("Device").field(&d.len()).finish(),
        }
    }
}

impl Payload {
    /// Bytes of the payload.
    pub fn len(&self) -> usize {
        match self {
            Payload::Host(b) => b.len(),
            Payload::Pieces(p) => p.iter().map(Bytes::len).sum(),
            Payload::Device(d) => d.len(),
        }
    }

    /// Whether the payload has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Buffers a receiver lands host payloads in, when the agent has its own (a device pool's
/// pinned buffers, `agent/staging.rs`): `take` one of `len` bytes, and `freeze` a filled one,
/// whole, into `Bytes` (which the receiver cuts to what arrived), which give it back when
/// dropped.
pub trait RecvBuffers: Send + Sync {
    /// A buffer of exactly `len` bytes (contents unspecified).
    fn take(&self, len: usize) -> Vec<u8>;
    /// The bytes of a filled buffer; it returns to its owner when they are dropped.
    fn freeze(self: Arc<Self>, buf: Vec<u8>) -> Bytes;
}

/// Bytes a staging buffer keeps free in front of its payload, where the chunk's [`Frame`]
/// prefix (header length and header) is written in place.
pub const FRAME_ROOM: usize = 256;

/// A chunk as it goes on the data plane: `[u32 LE header length][header][payload]`, in one
/// buffer, so that a transport sends it as one message, or as header and payload frames,
/// without copying the payload.
#[derive(Clone, Debug)]
pub struct Frame {
    bytes: Bytes,
    header_len: usize,
}

impl Frame {
    /// The frame of a chunk without payload.
    pub fn header_only(header: &[u8]) -> Frame {
        let mut buf = Vec::with_capacity(4 + header.len());
        buf.extend_from_slice(&(header.len() as u32).to_le_bytes());
        buf.extend_from_slice(header);
        Frame {
            bytes: Bytes::from(buf),
            header_len: header.len(),
        }
    }

    /// The frame of `header` and the payload that `buf` holds after its first [`FRAME_ROOM`]
    /// bytes: the prefix is written into that room and the buffer handed to `freeze` (a
    /// staging slot's way back to its pool). `None` if the header does not fit the room.
    pub fn in_place(
        header: &[u8],
        mut buf: Vec<u8>,
        freeze: impl FnOnce(Vec<u8>) -> Bytes,
    ) -> Option<Frame> {
        let start = FRAME_ROOM.checked_sub(4 + header.len())?;
        let prefix = buf.get_mut(start..FRAME_ROOM)?;
        prefix[..4].copy_from_slice(&(header.len() as u32).to_le_bytes());
        prefix[4..].copy_from_slice(header);
        Some(Frame {
            bytes: freeze(buf).slice(start..),
            header_len: header.len(),
        })
    }

    /// The whole frame: one message.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The header (a slice of the frame, not a copy).
    pub fn header(&self) -> Bytes {
        self.bytes.slice(4..4 + self.header_len)
    }

    /// The payload (a slice of the frame, not a copy).
    pub fn payload(&self) -> Bytes {
        self.bytes.slice(4 + self.header_len..)
    }

    /// Splits one received message back into header and payload; `None` if it is not a frame.
    pub fn split(mut bytes: Bytes) -> Option<(Bytes, Bytes)> {
        let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
        if bytes.len() < 4 + len {
            return None;
        }
        let _ = bytes.split_to(4);
        let header = bytes.split_to(len);
        Some((header, bytes))
    }
}

/// Sends chunks to one receiver. Dropping it closes the connection.
pub trait DataSender: Send {
    /// Sends one chunk, queued before this returns (chunks go in the order queued); the future
    /// resolves when the transport is done with the frame's bytes: copied into its queues, or,
    /// where the receiver reads them (UCX rendezvous), read. A caller may keep several in
    /// flight. Dropping the future may cancel the send (UCX does).
    fn send(&mut self, frame: Frame) -> BoxFuture<'static, Result<(), TransportError>>;

    /// Whether [`DataSender::send_from`] pays: the chunk goes out of the sender's memory in one
    /// copy (the kernel's, into its socket) whatever the number of pieces, so that skipping
    /// the gather saves a copy. UCX with eager chunks (tcp) only: where the receiver reads a
    /// chunk itself (rendezvous), UCX 1.13 moves a message of pieces through its
    /// shared-memory FIFO instead, two copies in fragments. The default: no.
    fn sends_from_pool(&self) -> bool {
        false
    }

    /// Sends a chunk whose payload is the `runs` of `source`, in order, behind `prefix` (a
    /// [`Frame::header_only`]): the message [`DataSender::send`] sends of the gathered frame,
    /// without the gather. Queued and resolved as `send`; `source` must hold the bytes until
    /// it resolves. Only where [`DataSender::sends_from_pool`].
    fn send_from(
        &mut self,
        prefix: Frame,
        source: Arc<HostPool>,
        runs: Vec<Span>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let _ = (prefix, source, runs);
        Box::pin(async {
            Err(TransportError::new(
                "send_from",
                "-",
                "no sends from the pool",
            ))
        })
    }

    /// Sends a chunk whose payload is in device memory: the header frame (a
    /// [`Frame::header_only`]) and `payload`, straight from device staging. Queued and resolved
    /// as [`DataSender::send`]; `payload` is held until it resolves. Only where
    /// [`Transport::device_memory`] says [`DeviceMemory::Sends`]; the default refuses.
    fn send_device(
        &mut self,
        header: Frame,
        payload: Arc<dyn DeviceBytes>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let _ = (header, payload);
        Box::pin(async {
            Err(TransportError::new(
                "send_device",
                "-",
                "this transport sends host memory only",
            ))
        })
    }

    /// Gives up on the receiver (it is dead): sends and writes still in flight end now, with an
    /// error, so that nothing reads the sender's memory for them any more (UCX closes its
    /// endpoints by force) and no transfer waits on them (a ZeroMQ send waits for the peer
    /// to take the message, which a dead peer never does). Later operations fail. The default
    /// does nothing.
    fn close(&mut self) {}

    /// Prepares one-sided writes into memory the receiver exposed; `None` when this transport
    /// has none (the default).
    fn attach(
        &mut self,
        memory: RemoteMemory,
    ) -> BoxFuture<'_, Result<Option<WritePath>, TransportError>> {
        let _ = memory;
        Box::pin(async { Ok(None) })
    }

    /// Writes every run from `source` into the attached memory; resolves once every byte is
    /// in the receiver's memory (so a message sent after it never overtakes the bytes).
    fn write(
        &mut self,
        source: Arc<HostPool>,
        runs: Vec<WriteRun>,
    ) -> BoxFuture<'_, Result<(), TransportError>> {
        let _ = (source, runs);
        Box::pin(async { Err(TransportError::new("write", "-", "no one-sided writes")) })
    }

    /// Sends each run of `source` as its own message, for the receiver to place where it
    /// chooses ([`Placer::place`] with the same `key`). The runs are queued before this
    /// returns, behind what was sent before and ahead of what is sent after; the future
    /// resolves once the receiver has taken every byte.
    fn send_runs(
        &mut self,
        source: PoolMemory,
        key: u64,
        runs: Vec<Span>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let _ = (source, key, runs);
        Box::pin(async { Err(TransportError::new("send_runs", "-", "no placed sends")) })
    }
}

/// Placed runs landing: resolves once all have landed, or with the first error.
pub type Landing = BoxFuture<'static, Result<(), TransportError>>;

/// Receives the runs of [`DataSender::send_runs`] straight into a pool.
pub trait Placer: Send + Sync {
    /// Whether runs arriving as eager messages land through receives this placer can revoke
    /// whatever the sender does (announced in Hello; the default: no). Such receives copy
    /// each part of a message into place, so a run may land in several pieces of the pool.
    fn revocable(&self) -> bool {
        false
    }

    /// Posts receives for the runs sent under `key` into `places` of `pool` (run `i` in the
    /// pieces `places[i]`, one after the other, exactly as long together; several pieces only
    /// where [`Placer::revocable`]); resolves once they are posted (only then may the sender
    /// send them), with their [`Landing`]. When `cancel` fires, receives still open are
    /// cancelled, and the landing still resolves only once the transport writes nothing more
    /// into the pool.
    fn place(
        &self,
        pool: PoolMemory,
        key: u64,
        places: Vec<Vec<Span>>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> BoxFuture<'static, Result<Landing, TransportError>>;
}

/// The receives a [`DataReceiver`] keeps posted, for transports where a chunk that arrives
/// before its receive is posted is a hazard (UCX rendezvous: if its sender dies before a
/// receive matches it, UCX 1.13 aborts the receiving process).
pub trait Receives: Send + Sync {
    /// A sender may now have `slots` more chunks in flight: resolves once a receive is posted
    /// for each (only then may the sender be told).
    fn grant(&self, slots: usize) -> BoxFuture<'static, Result<(), TransportError>>;

    /// A sender whose `slots` were granted is gone.
    fn release(&self, slots: usize);
}

/// Receives chunks from any number of senders.
pub trait DataReceiver: Send {
    /// The next chunk: its header and its payload.
    fn recv(&mut self) -> BoxFuture<'_, Result<(Bytes, Bytes), TransportError>>;

    /// The next chunk, its payload in device memory when it came from device staging and
    /// [`DataReceiver::land_on_device`] gave this receiver a sink; in host memory otherwise
    /// (the default: [`DataReceiver::recv`]).
    fn recv_payload(&mut self) -> BoxFuture<'_, Result<(Bytes, Payload), TransportError>> {
        Box::pin(async move {
            let (header, payload) = self.recv().await?;
            Ok((header, Payload::Host(payload)))
        })
    }

    /// Lands the payloads of chunks sent from device memory in device buffers from `sink`.
    /// The default refuses: the transport receives host memory only.
    fn land_on_device(&mut self, sink: Arc<dyn DeviceSink>) -> Result<(), TransportError> {
        let _ = sink;
        Err(TransportError::new(
            "land_on_device",
            "-",
            "this transport receives host memory only",
        ))
    }

    /// Receives host payloads into `buffers` from now on; `false` when this transport lands
    /// them in buffers of its own (the default: libzmq allocates every message itself).
    fn receive_into(&mut self, buffers: Arc<dyn RecvBuffers>) -> bool {
        let _ = buffers;
        false
    }

    /// A sender died: drop receives it may have left half-matched (they would never complete)
    /// and post fresh ones. Transports whose receives cannot hang on a dead sender do nothing.
    fn reset(&mut self) {}

    /// What places runs sent with [`DataSender::send_runs`] into a pool, when this transport
    /// can (the default: it cannot).
    fn placer(&self) -> Option<Arc<dyn Placer>> {
        None
    }

    /// What keeps a receive posted for every chunk senders may have in flight, when this
    /// transport needs that (the default: it does not).
    fn receives(&self) -> Option<Arc<dyn Receives>> {
        None
    }

    /// Exposes `pool` to senders: registered with the transport, which then places runs into
    /// it ([`Placer::place`]) without registering it per run, and, where senders have one-sided
    /// writes, the key they write with; `None` when this transport has none (the default).
    fn expose(
        &mut self,
        pool: PoolMemory,
    ) -> BoxFuture<'_, Result<Option<RemoteMemory>, TransportError>> {
        let _ = pool;
        Box::pin(async { Ok(None) })
    }
}

/// A bound receiver and the endpoint senders connect to.
pub type Listening = (String, Box<dyn DataReceiver>);

/// How a receiver judges the first frame of a data connection's messages until one proves the
/// connection: the proof a sender presents first on each connection ([`Credentials::proof`]: from a prefill of protocol version 11 on, the key its decode gave it in Hello,
/// [`crate::protocol::Hello::chunk_key`]; from an older one, an empty frame), or a chunk's
/// header carrying that key (a chunk may overtake the proof on a re-established connection).
/// A connection is taken for a peer's, and anything it sends is read, only after a frame this
/// accepts: without one, a connection to a data port proves nothing and is dropped at the
/// deadline (`kvferry_wire::admission`). UCX's connections are libucx's: it takes no proofs.
pub type ProofCheck = Arc<dyn Fn(&[u8]) -> bool + Send + Sync>;

/// What a sender presents on each data connection it opens ([`Transport::connect`]), where the
/// transport's connections are its own (ZeroMQ).
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    /// The first frame on each connection ([`ProofCheck`]).
    pub proof: Bytes,
    /// The receiver is older than [`crate::protocol::TOKEN_PROOFS`]: ZeroMQ presents it the
    /// token itself ([`zmq::Auth::in_clear`]).
    pub token_in_clear: bool,
}

/// A data-plane transport.
pub trait Transport: Send + Sync {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Binds a receiver on `host` and, where the transport has ports of its own choosing
    /// (`zmq-tcp`), `port` (0: any); returns the endpoint senders connect to. Where the
    /// transport's connections are its own (ZeroMQ), `check` judges each one's proof.
    fn listen(
        &self,
        host: &str,
        port: u16,
        check: ProofCheck,
    ) -> BoxFuture<'static, Result<Listening, TransportError>>;

    /// Connects a sender to a receiver's endpoint, failing after `timeout` if unreachable
    /// ([`TransportErrorKind::Malformed`] when the endpoint is not one of this transport's);
    /// where the transport's connections are its own (ZeroMQ), each presents `credentials`.
    fn connect(
        &self,
        endpoint: &str,
        timeout: std::time::Duration,
        credentials: Credentials,
    ) -> BoxFuture<'static, Result<Box<dyn DataSender>, TransportError>>;

    /// Whether this transport sends device memory, found at run time (UCX asks its context;
    /// the default: host memory only, for this transport's kind).
    fn device_memory(&self) -> BoxFuture<'static, Result<DeviceMemory, TransportError>> {
        let why = format!("{} sends host memory only", self.kind());
        Box::pin(async move { Ok(DeviceMemory::HostOnly(why)) })
    }

    /// Whether this transport lets its peers read and write this process's memory by remote
    /// memory access (UCX RMA, asked for only by writers over RDMA; `/metrics`:
    /// `kvferry_transport_rma`). Default: no.
    fn remote_memory_access(&self) -> bool {
        false
    }

    /// Checks a receiver's exposed memory (from its Hello) before anything uses it: a key
    /// this transport could not parse is [`TransportErrorKind::Malformed`].
    fn check_memory(&self, memory: &RemoteMemory) -> Result<(), TransportError> {
        let _ = memory;
        Ok(())
    }
}

/// Whether a decode on transport `kind` offers the prefills of its host its pool's memory
/// file, for mapped writes ([`mapped`]): where the operator chose a same-host path (`zmq-ipc`,
/// or UCX with shared memory in `UCX_TLS`), not over `zmq-tcp`, whose bytes are to cross the
/// network stack.
pub fn maps_pools(kind: TransportKind) -> bool {
    match kind {
        TransportKind::ZmqTcp => false,
        TransportKind::ZmqIpc => true,
        #[cfg(feature = "ucx")]
        TransportKind::Ucx => ucx::settings::maps_pools(),
    }
}

/// `endpoint` (as a transport bound it) as peers reach it at `host`: a `tcp://` endpoint with
/// its host replaced; other endpoints (a socket file, a UCX worker address, which carries
/// UCX's own interface addresses) unchanged.
pub fn advertised(endpoint: &str, host: &str) -> String {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return endpoint.to_owned();
    };
    match rest
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
    {
        Some(port) => zmq::tcp_address(host, port),
        None => endpoint.to_owned(),
    }
}

/// The transport of a kind, for chunks of at most `max_chunk` payload bytes, of an agent
/// serving on `host` that `writes` into its peers (a prefill); ZeroMQ connections authenticate
/// with `auth` (UCX rooms are guarded by their per-room ids).
pub fn for_kind(
    kind: TransportKind,
    max_chunk: usize,
    auth: &zmq::Auth,
    host: &str,
    writes: bool,
) -> Arc<dyn Transport> {
    #[cfg(not(feature = "ucx"))]
    let _ = (host, writes);
    match kind {
        #[cfg(feature = "ucx")]
        TransportKind::Ucx => Arc::new(ucx::data::UcxData::new(max_chunk, host, writes)),
        _ => Arc::new(zmq::ZmqData::new(kind, max_chunk, auth.clone())),
    }
}

/// `--transport`'s help: the transports this build has.
#[cfg(feature = "ucx")]
pub const TRANSPORT_HELP: &str = "Data-plane transport: zmq-tcp, zmq-ipc or ucx (UCX picks \
    its own transports from UCX_TLS, e.g. UCX_TLS=tcp or UCX_TLS=sm,self)";
/// `--transport`'s help: the transports this build has.
#[cfg(not(feature = "ucx"))]
pub const TRANSPORT_HELP: &str = "Data-plane transport: zmq-tcp or zmq-ipc (ucx needs a \
    build with `--features ucx`)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_endpoints_name_the_advertised_host() {
        let bound = "tcp://[::ffff:127.0.0.1]:40111";
        assert_eq!(advertised(bound, "127.0.0.2"), "tcp://127.0.0.2:40111");
        assert_eq!(
            advertised("tcp://0.0.0.0:7", "fd00::5"),
            "tcp://[fd00::5]:7"
        );
        assert_eq!(advertised("tcp://127.0.0.1:7", "node-3"), "tcp://node-3:7");
        assert_eq!(advertised("ipc:///tmp/a.sock", "x"), "ipc:///tmp/a.sock");
        assert_eq!(advertised("ucx:0011aa", "x"), "ucx:0011aa");
    }

    #[test]
    fn frames_are_built_in_place_and_split_back() {
        // A payload gathered behind the room: the prefix lands right in front of it.
        let mut buf = vec![0xEE; FRAME_ROOM];
        buf.extend_from_slice(b"payload");
        let at = buf.as_ptr() as usize;
        let frame = Frame::in_place(b"hdr", buf, Bytes::from).expect("fits");
        assert_eq!(&frame.bytes()[..], b"\x03\x00\x00\x00hdrpayload");
        assert_eq!(
            frame.bytes().as_ptr() as usize,
            at + FRAME_ROOM - 7,
            "no copy"
        );
        assert_eq!(
            (frame.header(), frame.payload()),
            (b"hdr"[..].into(), b"payload"[..].into())
        );
        assert_eq!(
            Frame::split(frame.bytes().clone()),
            Some((frame.header(), frame.payload()))
        );
        let bare = Frame::header_only(b"hdr");
        assert_eq!(&bare.bytes()[..], b"\x03\x00\x00\x00hdr");
        assert!(bare.payload().is_empty());
        // A header larger than the room, or a buffer shorter than it, is refused.
        assert!(Frame::in_place(&[0; FRAME_ROOM], vec![0; FRAME_ROOM + 1], Bytes::from).is_none());
        assert!(Frame::in_place(b"hdr", vec![0; 10], Bytes::from).is_none());
        // Not frames: a length beyond the message, or no length at all.
        assert_eq!(
            Frame::split(Bytes::from_static(b"\x09\x00\x00\x00hdr")),
            None
        );
        assert_eq!(Frame::split(Bytes::from_static(b"\x01")), None);
    }
}
