//! [`UcxWorker`]: an async, cloneable handle to one progress thread that owns a UCP context and
//! worker (and every endpoint, registration and request of them).
//!
//! The thread takes [`Command`]s over a std channel (each wakes it through an eventfd) and
//! replies through tokio oneshots. While work is in flight it calls `ucp_worker_progress`;
//! after a short spin with nothing to do it arms the worker and sleeps in poll(2) on the
//! worker's event fd and the wakeup eventfd, with a 100 ms timeout so UCX's keepalive still
//! runs on a quiet worker. No core spins while idle.
//!
//! Invariants:
//! - an operation's buffers live in its [`Pending`] entry together with its request, and an
//!   entry is only dropped once UCX reports the request complete;
//! - a caller that drops its future closes the oneshot; the thread then cancels the request
//!   (`ucp_request_cancel`) and keeps the buffers until the request completes;
//! - at shutdown, requests are cancelled and endpoints force-closed (which completes their
//!   requests) and the thread progresses until nothing is pending; only if UCX still holds a
//!   request after 5 s are the request, its buffers and the worker leaked, never freed.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::UcxError;
use super::region::RegisterableMemory;
use super::result::status_name;
use super::safe::{Context, Endpoint, MemHandle, RemoteKey, Request, Started, Worker};
use super::sys;

/// An endpoint of one [`UcxWorker`] (a connection to one remote worker).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EndpointId(pub u64);

/// A memory registration of one [`UcxWorker`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemId(pub u64);

/// A peer's registered memory, as one [`UcxWorker`] knows it (endpoint + unpacked key + bounds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegionId(pub u64);

/// A received tagged message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    /// The sender's tag (it matched the receive's tag under its mask).
    pub tag: u64,
    /// The message.
    pub data: Bytes,
}

/// A registration: what a peer needs (in Hello) to put into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    /// Local id, for [`UcxWorker::unregister`].
    pub id: MemId,
    /// Address of the first byte, in this process.
    pub base: u64,
    /// Bytes registered.
    pub size: u64,
    /// The packed remote key.
    pub rkey: Bytes,
}

/// How to build a worker's context: UCX config variables applied on top of the defaults and
/// the `UCX_*` environment (through `ucp_config_modify`, so two workers of one process can use
/// different transports).
#[derive(Clone, Debug, Default)]
pub struct UcxConfig {
    vars: Vec<(String, String)>,
    spin: Option<Duration>,
    supervise: Option<bool>,
}

impl UcxConfig {
    /// UCX's defaults and the process's `UCX_*` environment.
    pub fn new() -> Self {
        Self::default()
    }

    /// UCX over tcp on the loopback device only (`TLS=tcp`, `NET_DEVICES=lo`).
    pub fn tcp_loopback() -> Self {
        Self::new().var("TLS", "tcp").var("NET_DEVICES", "lo")
    }

    /// UCX over shared memory (`TLS=posix,cma,self`): same host only. UCX 1.13 cannot detect
    /// a dead peer on these transports, so endpoints are unsupervised (see
    /// [`UcxWorker::fail_endpoint`]).
    pub fn shared_memory() -> Self {
        Self::new()
            .var("TLS", "posix,cma,self")
            .supervise(Some(false))
    }

    /// Peer failure detection of endpoints: `Some(true)` requires it (`connect` fails where
    /// the transports lack it), `Some(false)` goes without, `None` (default) asks for it and
    /// falls back to an unsupervised endpoint when UCX refuses.
    pub fn supervise(mut self, supervise: Option<bool>) -> Self {
        self.supervise = supervise;
        self
    }

    /// Sets a UCX variable, named with or without the `UCX_` prefix (`TLS`, `UCX_TLS`).
    pub fn var(mut self, name: &str, value: &str) -> Self {
        let name = name.strip_prefix("UCX_").unwrap_or(name);
        self.vars.retain(|(n, _)| n != name);
        self.vars.push((name.to_owned(), value.to_owned()));
        self
    }

    /// How long the progress thread keeps polling UCX with nothing happening before it
    /// sleeps on the event fd (default 50 µs).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.spin = Some(spin);
        self
    }

    /// The variables set so far.
    pub fn vars(&self) -> &[(String, String)] {
        &self.vars
    }
}

type Reply<T> = oneshot::Sender<Result<T, UcxError>>;

/// What the progress thread is asked to do.
enum Command {
    Connect {
        address: Bytes,
        reply: Reply<EndpointId>,
    },
    Disconnect {
        ep: EndpointId,
        reply: Reply<()>,
    },
    SendTag {
        ep: EndpointId,
        tag: u64,
        parts: Vec<Bytes>,
        reply: Reply<()>,
    },
    RecvTag {
        tag: u64,
        mask: u64,
        capacity: usize,
        from: Option<EndpointId>,
        reply: Reply<Received>,
    },
    Register {
        memory: Arc<dyn RegisterableMemory>,
        reply: Reply<Registered>,
    },
    Unregister {
        id: MemId,
        reply: Reply<()>,
    },
    AddRemote {
        ep: EndpointId,
        base: u64,
        size: u64,
        rkey: Bytes,
        reply: Reply<RemoteRegionId>,
    },
    Put {
        region: RemoteRegionId,
        offset: u64,
        data: Bytes,
        reply: Reply<()>,
    },
    Flush {
        ep: EndpointId,
        reply: Reply<()>,
    },
    FailEndpoint {
        ep: EndpointId,
        reply: Reply<()>,
    },
    Supervised {
        ep: EndpointId,
        reply: Reply<bool>,
    },
    Shutdown {
        reply: Option<oneshot::Sender<()>>,
    },
}

struct Shared {
    commands: mpsc::Sender<Command>,
    wake: Arc<OwnedFd>,
    address: Bytes,
}

impl Shared {
    fn send(&self, command: Command) -> Result<(), UcxError> {
        self.commands
            .send(command)
            .map_err(|_| UcxError::WorkerGone)?;
        wake(&self.wake);
        Ok(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last handle is gone: stop the thread (it cleans up on its own).
        if self
            .commands
            .send(Command::Shutdown { reply: None })
            .is_ok()
        {
            wake(&self.wake);
        }
    }
}

fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. A full counter (EAGAIN)
    // already means "awake", so the result needs no handling.
    let _ = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
}

/// Wakes the progress thread when a caller's future is dropped before its reply, so the
/// abandoned operation is cancelled at once rather than at the next timeout.
struct WakeOnDrop<'a> {
    wake: &'a OwnedFd,
    armed: bool,
}

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            wake(self.wake);
        }
    }
}

/// A cloneable handle to a UCX worker running on its own progress thread. Dropping the last
/// clone stops the thread; [`UcxWorker::shutdown`] stops it and waits.
#[derive(Clone)]
pub struct UcxWorker {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for UcxWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxWorker")
            .field("address_bytes", &self.shared.address.len())
            .finish()
    }
}

impl UcxWorker {
    /// Starts a progress thread with a fresh context and worker built from `config`. Fails
    /// with the UCX status when libucx refuses the config or finds no usable transport.
    pub async fn spawn(config: UcxConfig) -> Result<UcxWorker, UcxError> {
        // SAFETY: eventfd has no memory preconditions; the result is checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(UcxError::Os {
                op: "eventfd",
                message: std::io::Error::last_os_error().to_string(),
            });
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let (commands, inbox) = mpsc::channel();
        let (ready, started) = oneshot::channel();
        let thread_wake = wake.clone();
        std::thread::Builder::new()
            .name("ucx-progress".into())
            .spawn(move || run(config, inbox, thread_wake, ready))
            .map_err(|e| UcxError::Os {
                op: "spawn the UCX progress thread",
                message: e.to_string(),
            })?;
        let address = started.await.map_err(|_| UcxError::WorkerGone)??;
        Ok(UcxWorker {
            shared: Arc::new(Shared {
                commands,
                wake,
                address,
            }),
        })
    }

    /// This worker's address: the bytes a peer passes to [`UcxWorker::connect`].
    pub fn address(&self) -> Bytes {
        self.shared.address.clone()
    }

    async fn call<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, UcxError> {
        let (reply, result) = oneshot::channel();
        self.shared.send(command(reply))?;
        let mut guard = WakeOnDrop {
            wake: &self.shared.wake,
            armed: true,
        };
        let result = result.await;
        guard.armed = false;
        result.map_err(|_| UcxError::WorkerGone)?
    }

    /// Creates an endpoint to the worker at `address`, with peer failure detection where the
    /// transports have it (see [`UcxWorker::is_supervised`]). UCX connects lazily: an
    /// unreachable peer fails the first operations, not this call.
    pub async fn connect(&self, address: Bytes) -> Result<EndpointId, UcxError> {
        self.call(|reply| Command::Connect { address, reply }).await
    }

    /// Force-closes an endpoint: its pending operations fail, its remote regions go.
    pub async fn disconnect(&self, ep: EndpointId) -> Result<(), UcxError> {
        self.call(|reply| Command::Disconnect { ep, reply }).await
    }

    /// Sends `data` as one tagged message; resolves when UCX is done with the buffer.
    pub async fn send_tag(&self, ep: EndpointId, tag: u64, data: Bytes) -> Result<(), UcxError> {
        self.send_tag_parts(ep, tag, vec![data]).await
    }

    /// Sends the concatenation of `parts` (e.g. header and payload) as one tagged message,
    /// without copying them together (a UCP iov).
    pub async fn send_tag_parts(
        &self,
        ep: EndpointId,
        tag: u64,
        parts: Vec<Bytes>,
    ) -> Result<(), UcxError> {
        self.call(|reply| Command::SendTag {
            ep,
            tag,
            parts,
            reply,
        })
        .await
    }

    /// Receives one message whose tag matches `tag` under `mask` (bits set in `mask` must be
    /// equal), of at most `capacity` bytes (longer is [`UcxError::Truncated`]).
    pub async fn recv_tag(
        &self,
        tag: u64,
        mask: u64,
        capacity: usize,
    ) -> Result<Received, UcxError> {
        self.call(|reply| Command::RecvTag {
            tag,
            mask,
            capacity,
            from: None,
            reply,
        })
        .await
    }

    /// As [`UcxWorker::recv_tag`], but fails with [`UcxError::PeerFailed`] when `from` (the
    /// endpoint to the expected sender) fails. Tags should identify that sender.
    pub async fn recv_tag_from(
        &self,
        from: EndpointId,
        tag: u64,
        mask: u64,
        capacity: usize,
    ) -> Result<Received, UcxError> {
        self.call(|reply| Command::RecvTag {
            tag,
            mask,
            capacity,
            from: Some(from),
            reply,
        })
        .await
    }

    /// Registers `memory` for peers to put into; the worker keeps it alive until
    /// [`UcxWorker::unregister`] or shutdown.
    pub async fn register(
        &self,
        memory: Arc<dyn RegisterableMemory>,
    ) -> Result<Registered, UcxError> {
        self.call(|reply| Command::Register { memory, reply }).await
    }

    /// Unregisters memory. The caller makes sure no peer can still write into it (its puts
    /// were flushed, or the peer is dead) before reusing or freeing it.
    pub async fn unregister(&self, id: MemId) -> Result<(), UcxError> {
        self.call(|reply| Command::Unregister { id, reply }).await
    }

    /// Records a peer's registration (from its [`Registered`]) for puts through `ep`.
    pub async fn add_remote_region(
        &self,
        ep: EndpointId,
        base: u64,
        size: u64,
        rkey: Bytes,
    ) -> Result<RemoteRegionId, UcxError> {
        self.call(|reply| Command::AddRemote {
            ep,
            base,
            size,
            rkey,
            reply,
        })
        .await
    }

    /// Writes `data` at `offset` into a remote region (bounds-checked against its size);
    /// resolves on local completion. The bytes are visible remotely after
    /// [`UcxWorker::flush`] of the region's endpoint.
    pub async fn put(
        &self,
        region: RemoteRegionId,
        offset: u64,
        data: Bytes,
    ) -> Result<(), UcxError> {
        self.call(|reply| Command::Put {
            region,
            offset,
            data,
            reply,
        })
        .await
    }

    /// Resolves once every operation started on `ep` has completed remotely.
    pub async fn flush(&self, ep: EndpointId) -> Result<(), UcxError> {
        self.call(|reply| Command::Flush { ep, reply }).await
    }

    /// Declares the peer of `ep` dead (learnt elsewhere, e.g. from a missed control-plane
    /// heartbeat): the endpoint is force-closed, and its pending and later operations fail
    /// with [`UcxError::PeerFailed`]. The only failure report of an unsupervised endpoint.
    pub async fn fail_endpoint(&self, ep: EndpointId) -> Result<(), UcxError> {
        self.call(|reply| Command::FailEndpoint { ep, reply }).await
    }

    /// Whether UCX itself detects the failure of `ep`'s peer (`UCP_ERR_HANDLING_MODE_PEER`).
    /// UCX 1.13's shared-memory transports cannot: such endpoints are unsupervised, and a dead
    /// peer must be reported with [`UcxWorker::fail_endpoint`].
    pub async fn is_supervised(&self, ep: EndpointId) -> Result<bool, UcxError> {
        self.call(|reply| Command::Supervised { ep, reply }).await
    }

    /// Stops the progress thread (pending operations fail with [`UcxError::WorkerGone`]) and
    /// waits until it has released every UCX object.
    pub async fn shutdown(&self) {
        let (reply, done) = oneshot::channel();
        if self
            .shared
            .send(Command::Shutdown { reply: Some(reply) })
            .is_ok()
        {
            let _ = done.await;
        }
    }
}

/// The thread's body: builds the engine, reports the address, runs until shutdown.
fn run(
    config: UcxConfig,
    inbox: mpsc::Receiver<Command>,
    wake: Arc<OwnedFd>,
    ready: oneshot::Sender<Result<Bytes, UcxError>>,
) {
    let mut engine = match Engine::new(&config) {
        Ok(engine) => engine,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    match engine.worker.address() {
        Ok(address) => {
            if ready.send(Ok(Bytes::from(address))).is_err() {
                return;
            }
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    }
    let spin = config.spin.unwrap_or(Duration::from_micros(50));
    let done = engine.serve(&inbox, &wake, spin);
    engine.close();
    drop(engine);
    if let Some(done) = done {
        let _ = done.send(());
    }
}

/// An operation in flight: the request and the buffers it uses, dropped together only after
/// completion.
struct Pending {
    // Field order: the request is freed before the buffers are released.
    request: Request,
    ep: Option<EndpointId>,
    op: Op,
    cancelled: bool,
    /// The watched endpoint failed (a receive from it was cancelled for that reason).
    peer_failed: Option<sys::ucs_status_t>,
}

enum Op {
    Send {
        _parts: Vec<Bytes>,
        _iov: Vec<sys::ucp_dt_iov_t>,
        reply: Reply<()>,
    },
    Put {
        _data: Bytes,
        reply: Reply<()>,
    },
    Flush {
        reply: Reply<()>,
    },
    Recv {
        buffer: Vec<u8>,
        capacity: usize,
        reply: Reply<Received>,
    },
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Send { .. } => "send_tag",
            Op::Put { .. } => "put",
            Op::Flush { .. } => "flush",
            Op::Recv { .. } => "recv_tag",
        }
    }

    fn abandoned(&self) -> bool {
        match self {
            Op::Send { reply, .. } | Op::Put { reply, .. } | Op::Flush { reply } => {
                reply.is_closed()
            }
            Op::Recv { reply, .. } => reply.is_closed(),
        }
    }
}

struct RemoteRegion {
    ep: EndpointId,
    endpoint: Rc<Endpoint>,
    key: RemoteKey,
    base: u64,
    size: u64,
}

/// Everything UCP of one worker, owned by its progress thread. Field order is drop order:
/// requests, remote keys, endpoints, registrations, then the worker and the context.
struct Engine {
    pending: Vec<Pending>,
    remote: HashMap<u64, RemoteRegion>,
    endpoints: HashMap<u64, Rc<Endpoint>>,
    /// Endpoints whose peer failed, closed, with the status operations on them report.
    dead: HashMap<u64, sys::ucs_status_t>,
    registered: HashMap<u64, (MemHandle, Arc<dyn RegisterableMemory>)>,
    worker: Rc<Worker>,
    context: Rc<Context>,
    next_id: u64,
    shutting_down: bool,
    supervise: Option<bool>,
}

impl Engine {
    fn new(config: &UcxConfig) -> Result<Engine, UcxError> {
        let context = Context::new(config.vars())?;
        let worker = Worker::new(&context)?;
        Ok(Engine {
            pending: Vec::new(),
            remote: HashMap::new(),
            endpoints: HashMap::new(),
            dead: HashMap::new(),
            registered: HashMap::new(),
            worker,
            context,
            next_id: 1,
            shutting_down: false,
            supervise: config.supervise,
        })
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    /// The progress loop; returns the reply of an explicit shutdown.
    fn serve(
        &mut self,
        inbox: &mpsc::Receiver<Command>,
        wake: &OwnedFd,
        spin: Duration,
    ) -> Option<oneshot::Sender<()>> {
        let efd = match self.worker.event_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, "no UCX event fd: the progress thread polls every ms");
                None
            }
        };
        let mut idle_since: Option<Instant> = None;
        loop {
            let mut busy = false;
            loop {
                match inbox.try_recv() {
                    Ok(Command::Shutdown { reply }) => return reply,
                    Ok(command) => {
                        busy = true;
                        self.handle(command);
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return None,
                }
            }
            for _ in 0..64 {
                if self.worker.progress() == 0 {
                    break;
                }
                busy = true;
            }
            busy |= self.sweep() > 0;
            if busy {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now.duration_since(*idle_since.get_or_insert(now)) < spin {
                continue;
            }
            idle_since = None;
            let timeout_ms = match efd {
                None => 1,
                Some(_) => match self.worker.arm() {
                    Ok(true) => 100,
                    Ok(false) => continue,
                    Err(e) => {
                        tracing::debug!(error = %e, "ucp_worker_arm");
                        1
                    }
                },
            };
            sleep(efd, wake, timeout_ms);
        }
    }

    /// Completes what UCX has finished and cancels what callers abandoned; the number of
    /// operations completed.
    fn sweep(&mut self) -> usize {
        self.reap_failed();
        let mut completed = 0;
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let (status, info) = match p.op {
                Op::Recv { .. } => p.request.recv_info(),
                _ => (p.request.status(), sys::ucp_tag_recv_info_t::default()),
            };
            if status == sys::UCS_INPROGRESS {
                if !p.cancelled {
                    let watched =
                        p.ep.filter(|_| matches!(p.op, Op::Recv { .. }))
                            .and_then(|ep| failure(&self.endpoints, &self.dead, ep));
                    if watched.is_some() || p.op.abandoned() || self.shutting_down {
                        p.peer_failed = watched;
                        p.cancelled = true;
                        p.request.cancel();
                    }
                }
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            completed += 1;
            self.finish(p, status, info);
        }
        completed
    }

    fn finish(&self, p: Pending, status: sys::ucs_status_t, info: sys::ucp_tag_recv_info_t) {
        let Pending {
            request,
            ep,
            op,
            peer_failed,
            ..
        } = p;
        // The request is complete: free it before its buffers go.
        drop(request);
        let name = op.name();
        let error = |status| {
            if self.shutting_down {
                return UcxError::WorkerGone;
            }
            self.classify(name, ep, status, peer_failed)
        };
        match op {
            Op::Send { reply, .. } | Op::Put { reply, .. } | Op::Flush { reply } => {
                let _ = reply.send(if status == sys::UCS_OK {
                    Ok(())
                } else {
                    Err(error(status))
                });
            }
            Op::Recv {
                buffer,
                capacity,
                reply,
            } => {
                let _ = reply.send(recv_result(buffer, capacity, status, info).map_err(
                    |e| match e {
                        RecvFail::Truncated => UcxError::Truncated { capacity },
                        RecvFail::Status(status) => error(status),
                    },
                ));
            }
        }
    }

    /// The error for a failed operation: a peer failure when its endpoint's error handler ran
    /// or the status is a connection error, else the UCX status.
    fn classify(
        &self,
        op: &'static str,
        ep: Option<EndpointId>,
        status: sys::ucs_status_t,
        peer_failed: Option<sys::ucs_status_t>,
    ) -> UcxError {
        let recorded =
            peer_failed.or_else(|| ep.and_then(|ep| failure(&self.endpoints, &self.dead, ep)));
        let connection_error = matches!(
            status,
            sys::UCS_ERR_UNREACHABLE
                | sys::UCS_ERR_NOT_CONNECTED
                | sys::UCS_ERR_CONNECTION_RESET
                | sys::UCS_ERR_TIMED_OUT
        ) || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE
            ..=sys::UCS_ERR_FIRST_LINK_FAILURE)
            .contains(&status);
        match (ep, recorded) {
            (Some(ep), Some(failure)) => UcxError::PeerFailed {
                op,
                endpoint: ep.0,
                status: failure,
                name: status_name(failure),
            },
            (Some(ep), None) if connection_error => UcxError::PeerFailed {
                op,
                endpoint: ep.0,
                status,
                name: status_name(status),
            },
            _ => UcxError::call(op, status),
        }
    }

    fn endpoint(&self, op: &'static str, ep: EndpointId) -> Result<Rc<Endpoint>, UcxError> {
        let Some(endpoint) = self.endpoints.get(&ep.0) else {
            return Err(match self.dead.get(&ep.0) {
                Some(&status) => UcxError::PeerFailed {
                    op,
                    endpoint: ep.0,
                    status,
                    name: status_name(status),
                },
                None => UcxError::Unknown {
                    what: "endpoint",
                    id: ep.0,
                },
            });
        };
        match endpoint.failure() {
            Some(status) => Err(UcxError::PeerFailed {
                op,
                endpoint: ep.0,
                status,
                name: status_name(status),
            }),
            None => Ok(endpoint.clone()),
        }
    }

    fn track(&mut self, started: Started<()>, ep: Option<EndpointId>, op: Op) {
        match started {
            Started::Pending(request) => self.pending.push(Pending {
                request,
                ep,
                op,
                cancelled: false,
                peer_failed: None,
            }),
            Started::Done(()) => match op {
                Op::Send { reply, .. } | Op::Put { reply, .. } | Op::Flush { reply } => {
                    let _ = reply.send(Ok(()));
                }
                Op::Recv { .. } => {}
            },
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Connect { address, reply } => {
                let result =
                    match Endpoint::connect(&self.worker, &address, self.supervise.unwrap_or(true))
                    {
                        Err(UcxError::Call {
                            status: sys::UCS_ERR_UNREACHABLE,
                            ..
                        }) if self.supervise.is_none() => {
                            tracing::debug!(
                                "no transport detects peer failure: an unsupervised UCX endpoint"
                            );
                            Endpoint::connect(&self.worker, &address, false)
                        }
                        other => other,
                    };
                let result = result.map(|endpoint| {
                    let id = self.id();
                    self.endpoints.insert(id, Rc::new(endpoint));
                    EndpointId(id)
                });
                let _ = reply.send(result);
            }
            Command::Disconnect { ep, reply } => {
                self.remote.retain(|_, r| r.ep != ep);
                let result = match self.endpoints.remove(&ep.0) {
                    Some(_) => Ok(()),
                    None => Err(UcxError::Unknown {
                        what: "endpoint",
                        id: ep.0,
                    }),
                };
                let _ = reply.send(result);
            }
            Command::SendTag {
                ep,
                tag,
                parts,
                reply,
            } => {
                let endpoint = match self.endpoint("send_tag", ep) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                let mut iov: Vec<sys::ucp_dt_iov_t> = parts
                    .iter()
                    .filter(|p| !p.is_empty())
                    .map(|p| sys::ucp_dt_iov_t {
                        buffer: p.as_ptr().cast_mut().cast(),
                        length: p.len(),
                    })
                    .collect();
                if iov.is_empty() {
                    iov.push(sys::ucp_dt_iov_t {
                        buffer: std::ptr::NonNull::<u8>::dangling().as_ptr().cast(),
                        length: 0,
                    });
                }
                // SAFETY: every iov entry points into a `Bytes` of `parts` (immutable, heap
                // data that does not move when the Vec moves), and `parts` and `iov` are moved
                // into the Pending entry, dropped only after the request completes.
                let started = unsafe { endpoint.tag_send(&iov, tag) };
                match started {
                    Ok(started) => self.track(
                        started,
                        Some(ep),
                        Op::Send {
                            _parts: parts,
                            _iov: iov,
                            reply,
                        },
                    ),
                    Err(e) => {
                        let e = self.failure_of("send_tag", ep, e);
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::RecvTag {
                tag,
                mask,
                capacity,
                from,
                reply,
            } => {
                if let Some(ep) = from
                    && let Err(e) = self.endpoint("recv_tag", ep)
                {
                    let _ = reply.send(Err(e));
                    return;
                }
                let mut buffer = Vec::<u8>::with_capacity(capacity);
                // SAFETY: the Vec's heap allocation holds `capacity` writable bytes and moves
                // (with the Vec, without moving the allocation) into the Pending entry, which
                // is dropped only after the request completes.
                let started = unsafe {
                    self.worker
                        .tag_recv(buffer.as_mut_ptr(), capacity, tag, mask)
                };
                match started {
                    Ok(Started::Done(())) => {
                        // Not with UCP_OP_ATTR_FLAG_NO_IMM_CMPL; never guess a length.
                        let _ = reply.send(Err(UcxError::call(
                            "ucp_tag_recv_nbx",
                            sys::UCS_ERR_NO_MESSAGE,
                        )));
                    }
                    Ok(Started::Pending(request)) => self.pending.push(Pending {
                        request,
                        ep: from,
                        op: Op::Recv {
                            buffer,
                            capacity,
                            reply,
                        },
                        cancelled: false,
                        peer_failed: None,
                    }),
                    Err(UcxError::Call {
                        status: sys::UCS_ERR_MESSAGE_TRUNCATED,
                        ..
                    }) => {
                        let _ = reply.send(Err(UcxError::Truncated { capacity }));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Register { memory, reply } => {
                let (base, size) = (memory.base(), memory.size());
                // SAFETY: RegisterableMemory guarantees base..base+size stays mapped while the
                // value lives; the Arc is stored next to the handle and dropped after it.
                let result =
                    unsafe { MemHandle::map(&self.context, base, size) }.and_then(|handle| {
                        let rkey = handle.rkey()?;
                        let id = self.id();
                        self.registered.insert(id, (handle, memory));
                        Ok(Registered {
                            id: MemId(id),
                            base: base as u64,
                            size: size as u64,
                            rkey: Bytes::from(rkey),
                        })
                    });
                let _ = reply.send(result);
            }
            Command::Unregister { id, reply } => {
                let result = match self.registered.remove(&id.0) {
                    Some((handle, memory)) => {
                        drop(handle);
                        drop(memory);
                        Ok(())
                    }
                    None => Err(UcxError::Unknown {
                        what: "memory",
                        id: id.0,
                    }),
                };
                let _ = reply.send(result);
            }
            Command::AddRemote {
                ep,
                base,
                size,
                rkey,
                reply,
            } => {
                let result = self
                    .endpoint("add_remote_region", ep)
                    .and_then(|endpoint| {
                        if base.checked_add(size).is_none() {
                            return Err(UcxError::OutOfBounds {
                                offset: base,
                                len: 0,
                                size,
                            });
                        }
                        let key = endpoint.unpack_rkey(&rkey)?;
                        Ok((endpoint, key))
                    })
                    .map(|(endpoint, key)| {
                        let id = self.id();
                        self.remote.insert(
                            id,
                            RemoteRegion {
                                ep,
                                endpoint,
                                key,
                                base,
                                size,
                            },
                        );
                        RemoteRegionId(id)
                    });
                let _ = reply.send(result);
            }
            Command::Put {
                region,
                offset,
                data,
                reply,
            } => {
                let Some(r) = self.remote.get(&region.0) else {
                    let _ = reply.send(Err(UcxError::Unknown {
                        what: "remote region",
                        id: region.0,
                    }));
                    return;
                };
                let in_bounds = offset
                    .checked_add(data.len() as u64)
                    .is_some_and(|end| end <= r.size);
                if !in_bounds {
                    let _ = reply.send(Err(UcxError::OutOfBounds {
                        offset,
                        len: data.len(),
                        size: r.size,
                    }));
                    return;
                }
                let ep = r.ep;
                if let Err(e) = self.endpoint("put", ep) {
                    let _ = reply.send(Err(e));
                    return;
                }
                // SAFETY: `data` is immutable heap memory moved into the Pending entry (kept
                // until completion); base+offset..+len lies inside the region the peer
                // registered (checked above, base+size does not overflow: checked when added).
                let started = unsafe {
                    r.endpoint
                        .put(data.as_ptr(), data.len(), r.base + offset, &r.key)
                };
                match started {
                    Ok(started) => self.track(started, Some(ep), Op::Put { _data: data, reply }),
                    Err(e) => {
                        let e = self.failure_of("put", ep, e);
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Flush { ep, reply } => {
                let started = self
                    .endpoint("flush", ep)
                    .and_then(|endpoint| endpoint.flush());
                match started {
                    Ok(started) => self.track(started, Some(ep), Op::Flush { reply }),
                    Err(e) => {
                        let e = self.failure_of("flush", ep, e);
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::FailEndpoint { ep, reply } => {
                let result = match self.endpoints.get(&ep.0) {
                    Some(endpoint) => {
                        endpoint.set_failed(sys::UCS_ERR_CONNECTION_RESET);
                        self.reap_failed();
                        Ok(())
                    }
                    None if self.dead.contains_key(&ep.0) => Ok(()),
                    None => Err(UcxError::Unknown {
                        what: "endpoint",
                        id: ep.0,
                    }),
                };
                let _ = reply.send(result);
            }
            Command::Supervised { ep, reply } => {
                let result = self.endpoint("supervised", ep).map(|e| e.supervised());
                let _ = reply.send(result);
            }
            Command::Shutdown { .. } => {}
        }
    }

    fn progress_until_idle(&mut self, bound: Duration) {
        let deadline = Instant::now() + bound;
        while !self.pending.is_empty() && Instant::now() < deadline {
            self.worker.progress();
            self.sweep();
        }
    }

    /// Closes endpoints whose peer failed (UCX asks for that after an error) and remembers
    /// their status: their outstanding requests complete, later operations fail at once.
    fn reap_failed(&mut self) {
        let failed: Vec<(u64, sys::ucs_status_t)> = self
            .endpoints
            .iter()
            .filter_map(|(&id, e)| e.failure().map(|status| (id, status)))
            .collect();
        for (id, status) in failed {
            tracing::warn!(endpoint = id, error = %status_name(status), "UCX peer failed");
            self.remote.retain(|_, r| r.ep.0 != id);
            self.endpoints.remove(&id);
            self.dead.insert(id, status);
        }
    }

    /// Turns an immediate error of an operation on `ep` into a peer failure when it is one.
    fn failure_of(&self, op: &'static str, ep: EndpointId, e: UcxError) -> UcxError {
        match e {
            UcxError::Call { status, .. } => self.classify(op, Some(ep), status, None),
            other => other,
        }
    }

    /// Cancels everything, closes endpoints and waits (bounded) for UCX to give every buffer
    /// back. What UCX still holds after the bound is leaked, never freed.
    fn close(&mut self) {
        // Receives are cancelled by the sweep; sends and puts get 2 s to finish.
        self.shutting_down = true;
        self.progress_until_idle(Duration::from_secs(2));
        if !self.pending.is_empty() {
            // Their peers do not take them: force-close every endpoint (completes them).
            for endpoint in self.endpoints.values() {
                endpoint.set_failed(sys::UCS_ERR_CANCELED);
            }
        }
        self.remote.clear();
        self.endpoints.clear();
        self.progress_until_idle(Duration::from_secs(3));
        if !self.pending.is_empty() {
            tracing::error!(
                pending = self.pending.len(),
                "UCX still holds requests at shutdown; leaking them, their buffers and the worker"
            );
            let pending = std::mem::take(&mut self.pending);
            std::mem::forget(pending);
        }
        self.registered.clear();
    }
}

/// The failure recorded for `ep`: closed as dead, or its error handler ran.
fn failure(
    endpoints: &HashMap<u64, Rc<Endpoint>>,
    dead: &HashMap<u64, sys::ucs_status_t>,
    ep: EndpointId,
) -> Option<sys::ucs_status_t> {
    dead.get(&ep.0)
        .copied()
        .or_else(|| endpoints.get(&ep.0).and_then(|e| e.failure()))
}

enum RecvFail {
    Truncated,
    Status(sys::ucs_status_t),
}

/// A completed receive's buffer, cut to the received length.
fn recv_result(
    mut buffer: Vec<u8>,
    capacity: usize,
    status: sys::ucs_status_t,
    info: sys::ucp_tag_recv_info_t,
) -> Result<Received, RecvFail> {
    match status {
        sys::UCS_OK if info.length <= capacity => {
            // SAFETY: UCX completed the receive and wrote `info.length` bytes at the start of
            // the allocation, which holds `capacity >= info.length` bytes.
            unsafe { buffer.set_len(info.length) };
            Ok(Received {
                tag: info.sender_tag,
                data: Bytes::from(buffer),
            })
        }
        sys::UCS_OK | sys::UCS_ERR_MESSAGE_TRUNCATED => Err(RecvFail::Truncated),
        status => Err(RecvFail::Status(status)),
    }
}

/// Sleeps until the worker's event fd or the wakeup eventfd is readable, or `timeout_ms`.
fn sleep(efd: Option<i32>, wake: &OwnedFd, timeout_ms: i32) {
    let mut fds = [
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: efd.unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is a valid array of two pollfd (a negative fd is ignored by poll).
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    if n > 0 && fds[0].revents != 0 {
        let mut counter = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd (resets it).
        let _ = unsafe { libc::read(wake.as_raw_fd(), (&raw mut counter).cast(), 8) };
    }
}
