//! [`UcxWorker`]: an async, cloneable handle to one progress thread (`progress.rs`)
//! that owns a UCP context and worker, and every endpoint, registration and request of them.
//!
//! Each call sends a command over a std channel, wakes the thread through an eventfd, and
//! awaits the reply on a tokio oneshot. A dropped call future wakes the thread too, which then
//! cancels the abandoned operation; buffers are never owned by the future.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::command::{Command, EndpointId, MemId, Received, Registered, RemoteRegionId, Reply};
use super::config::UcxConfig;
use super::memory_type::MemoryTypes;
use super::region::RegisterableMemory;
use super::result::UcxError;
use super::safe::Wakeup;
use crate::memory::{Span, WriteRun};
use crate::transport::RecvBuffers;

struct Shared {
    commands: mpsc::Sender<Command>,
    wake: Arc<Wakeup>,
    address: Bytes,
    memory_types: MemoryTypes,
    rma: bool,
    /// The progress thread, joined when the last handle goes.
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Shared {
    fn send(&self, command: Command) -> Result<(), UcxError> {
        self.commands
            .send(command)
            .map_err(|_| UcxError::WorkerGone)?;
        self.wake.wake();
        Ok(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last handle is gone: stop the thread and wait for its cleanup (a few
        // milliseconds; its waits are bounded at 5 s), so that UCX is never torn down by the
        // thread while the process exits and UCX's own exit handlers free the same memory.
        if self
            .commands
            .send(Command::Shutdown { reply: None })
            .is_ok()
        {
            self.wake.wake();
        }
        if let Some(thread) = self.thread.take()
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

/// Wakes the progress thread when a caller's future is dropped before its reply, so the
/// abandoned operation is cancelled at once rather than at the next timeout.
struct WakeOnDrop<'a> {
    wake: &'a Wakeup,
    armed: bool,
}

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.wake.wake();
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
        let rma = config.rma;
        let wake = Arc::new(Wakeup::new()?);
        let (commands, inbox) = mpsc::channel();
        let (ready, started) = oneshot::channel();
        let thread_wake = wake.clone();
        let thread = std::thread::Builder::new()
            .name("ucx-progress".into())
            .spawn(move || {
                crate::cpus::on_agent_thread();
                super::progress::run(config, inbox, thread_wake, ready)
            })
            .map_err(|e| UcxError::Os {
                op: "spawn the UCX progress thread",
                message: e.to_string(),
            })?;
        let (address, memory_types) = started.await.map_err(|_| UcxError::WorkerGone)??;
        Ok(UcxWorker {
            shared: Arc::new(Shared {
                commands,
                wake,
                address,
                memory_types,
                rma,
                thread: Some(thread),
            }),
        })
    }

    /// This worker's address: the bytes a peer passes to [`UcxWorker::connect`].
    pub fn address(&self) -> Bytes {
        self.shared.address.clone()
    }

    /// Whether this worker's context has RMA ([`UcxConfig::rma`]).
    pub fn has_rma(&self) -> bool {
        self.shared.rma
    }

    /// The memory types this worker's context moves, as `ucp_context_query` reported them
    /// when the worker started.
    pub fn memory_types(&self) -> MemoryTypes {
        self.shared.memory_types
    }

    /// Whether this worker sends CUDA device memory and receives into it: a libucx built with
    /// CUDA, which found the driver at run time. Memory of a kind the worker cannot move is
    /// refused ([`UcxError::MemoryType`]) before UCX sees it.
    pub fn sends_device_memory(&self) -> bool {
        self.shared.memory_types.sends_device_memory()
    }

    async fn call<T: Send + 'static>(
        &self,
        command: impl FnOnce(Reply<T>) -> Command,
    ) -> Result<T, UcxError> {
        self.queued(command).await
    }

    /// Queues `command` at once (commands run in the order queued); the future waits for its
    /// reply. Dropping the future before the reply wakes the thread, so the abandoned
    /// operation is cancelled at once rather than at the next timeout.
    fn queued<T>(
        &self,
        command: impl FnOnce(Reply<T>) -> Command,
    ) -> impl std::future::Future<Output = Result<T, UcxError>> + Send + 'static
    where
        T: Send + 'static,
    {
        let (reply, result) = oneshot::channel();
        let queued = self.shared.send(command(reply));
        let wake = self.shared.wake.clone();
        async move {
            queued?;
            let mut guard = WakeOnDrop {
                wake: &wake,
                armed: true,
            };
            let result = result.await;
            guard.armed = false;
            result.map_err(|_| UcxError::WorkerGone)?
        }
    }

    /// Resolves once the progress thread has handled every command queued before this one:
    /// receives queued earlier ([`UcxWorker::post_recv_tag`]) are posted in UCX.
    pub async fn ping(&self) -> Result<(), UcxError> {
        self.call(|reply| Command::Ping { reply }).await
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

    /// Sends `data` as one tagged message, queued now (sends to an endpoint go in the order
    /// queued); resolves when UCX is done with the buffer.
    pub fn send_tag(
        &self,
        ep: EndpointId,
        tag: u64,
        data: Bytes,
    ) -> impl std::future::Future<Output = Result<(), UcxError>> + Send + 'static {
        self.send_tag_parts(ep, tag, vec![data])
    }

    /// Sends the concatenation of `parts` (e.g. header and payload) as one tagged message,
    /// without copying them together (a UCP iov); queued now, like [`UcxWorker::send_tag`].
    pub fn send_tag_parts(
        &self,
        ep: EndpointId,
        tag: u64,
        parts: Vec<Bytes>,
    ) -> impl std::future::Future<Output = Result<(), UcxError>> + Send + 'static {
        self.queued(move |reply| Command::SendTag {
            ep,
            tag,
            parts,
            from: None,
            reply,
        })
    }

    /// Sends `prefix` followed by the `runs` of `source`, in order, as one tagged message,
    /// without copying them together (a UCP iov); queued now, like [`UcxWorker::send_tag`].
    /// Resolves when UCX is done with the buffers: until then `source` must hold the bytes.
    pub fn send_tag_from(
        &self,
        ep: EndpointId,
        tag: u64,
        prefix: Bytes,
        source: Arc<dyn RegisterableMemory>,
        runs: Vec<Span>,
    ) -> impl std::future::Future<Output = Result<(), UcxError>> + Send + 'static {
        self.queued(move |reply| Command::SendTag {
            ep,
            tag,
            parts: vec![prefix],
            from: Some((source, runs)),
            reply,
        })
    }

    /// Receives one message whose tag matches `tag` under `mask` (bits set in `mask` must be
    /// equal), of at most `capacity` bytes (longer is [`UcxError::Truncated`]). Dropping the
    /// future cancels the receive; a message that matched it just before is lost with it.
    pub async fn recv_tag(
        &self,
        tag: u64,
        mask: u64,
        capacity: usize,
    ) -> Result<Received, UcxError> {
        self.post_recv_tag(tag, mask, capacity).await
    }

    /// As [`UcxWorker::recv_tag`], with the receive queued before this returns (posted in UCX
    /// once a later [`UcxWorker::ping`] resolves).
    pub fn post_recv_tag(
        &self,
        tag: u64,
        mask: u64,
        capacity: usize,
    ) -> impl std::future::Future<Output = Result<Received, UcxError>> + Send + 'static {
        self.post_recv_tag_into(tag, mask, capacity, None)
    }

    /// As [`UcxWorker::post_recv_tag`], landing in a buffer of `into` when given (it goes back
    /// there when the received bytes are dropped, or when the receive fails).
    pub fn post_recv_tag_into(
        &self,
        tag: u64,
        mask: u64,
        capacity: usize,
        into: Option<Arc<dyn RecvBuffers>>,
    ) -> impl std::future::Future<Output = Result<Received, UcxError>> + Send + 'static {
        self.queued(move |reply| Command::RecvTag {
            tag,
            mask,
            capacity,
            from: None,
            into,
            reply,
        })
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
            into: None,
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

    /// Writes every run from `source` (local memory, kept alive until UCX is done with it)
    /// into a remote region, then flushes the region's endpoint: resolves once every byte is
    /// in the peer's memory. Bounds are checked on both sides before anything starts.
    pub async fn write(
        &self,
        region: RemoteRegionId,
        source: Arc<dyn RegisterableMemory>,
        runs: Vec<WriteRun>,
    ) -> Result<(), UcxError> {
        self.call(|reply| Command::Write {
            region,
            source,
            runs,
            reply,
        })
        .await
    }

    /// Sends each run of `source` (local memory, kept alive until UCX is done with it) as one
    /// tagged message, run `i` under tag `tag + i`, straight from the memory. The sends are
    /// queued before this returns (so they go out in call order); the future resolves once
    /// every run is sent (with rendezvous: once the receiver has pulled it), with the first
    /// error. Bounds are checked before anything starts.
    pub fn send_runs(
        &self,
        ep: EndpointId,
        tag: u64,
        source: Arc<dyn RegisterableMemory>,
        runs: Vec<Span>,
    ) -> impl std::future::Future<Output = Result<(), UcxError>> + Send + 'static {
        let (reply, result) = oneshot::channel();
        let queued = self.shared.send(Command::SendRuns {
            ep,
            tag,
            source,
            runs,
            reply,
        });
        async move {
            queued?;
            result.await.map_err(|_| UcxError::WorkerGone)?
        }
    }

    /// Posts receives for the messages of [`UcxWorker::send_runs`] straight into `memory`:
    /// the message under tag `tag + i` lands in the pieces `runs[i]`, one after the other, and
    /// must be exactly as long as they are together (several pieces: eager workers only).
    /// Resolves once every receive is posted, with a future that resolves once every one has
    /// completed, with the first error. When `cancel` fires first, the receives still open are
    /// cancelled and that future still waits for them: once it returns, UCX writes nothing
    /// more into `memory` (a receive that already matched completes or fails first).
    /// Dropping it instead cancels them without that wait.
    pub async fn recv_runs(
        &self,
        tag: u64,
        memory: Arc<dyn RegisterableMemory>,
        runs: Vec<Vec<Span>>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<impl std::future::Future<Output = Result<(), UcxError>> + Send + 'static, UcxError>
    {
        let flag = Arc::new(AtomicBool::new(false));
        let (reply, mut result) = oneshot::channel();
        let (posted, on_posted) = oneshot::channel();
        self.shared.send(Command::RecvRuns {
            tag,
            memory,
            runs,
            posted,
            cancel: flag.clone(),
            reply,
        })?;
        if on_posted.await.is_err() {
            // Not posted: the reply says why.
            return Err(match (&mut result).await {
                Ok(Err(e)) => e,
                _ => UcxError::WorkerGone,
            });
        }
        let wake = self.shared.wake.clone();
        Ok(async move {
            let result = tokio::select! {
                r = &mut result => r,
                () = cancel.cancelled() => {
                    flag.store(true, Ordering::Release);
                    wake.wake();
                    result.await
                }
            };
            result.map_err(|_| UcxError::WorkerGone)?
        })
    }

    /// UCX's description of an endpoint's lanes (`ucp_ep_print_info`), e.g. to learn which
    /// transport carries its one-sided writes.
    pub async fn describe(&self, ep: EndpointId) -> Result<String, UcxError> {
        self.call(|reply| Command::Describe { ep, reply }).await
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
