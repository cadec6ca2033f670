//! The progress thread of a [`super::UcxWorker`]: owns a UCP context and worker (and every
//! endpoint, registration and request of them) and serves the handle's commands.
//!
//! The thread takes commands over a std channel (each wakes it through an eventfd) and
//! replies through tokio oneshots. While work is in flight it calls `ucp_worker_progress`;
//! as soon as a round finds nothing to do it arms the worker and sleeps in poll(2) on the
//! worker's event fd and the wakeup eventfd, with a 100 ms timeout so UCX's keepalive still
//! runs on a quiet worker. A rendezvous worker never spins: on a loaded machine, polling a
//! while before sleeping takes the cores the gather and scatter copies need, and costs more
//! than it saves (staged ucx-shm rooms ran slower with a short poll).
//! An eager worker (tcp) polls [`EAGER_SPIN`] first: its messages arrive as streams of
//! segments, and a sleep between two of them cost more than the poll. What an operation
//! in flight is (`Pending`, `Op`) is in `progress/op.rs`, and groups of runs answered together
//! in `progress/group.rs`; how operations end in `progress/pending.rs`; registrations, peers'
//! regions and puts (the one-sided side) in `progress/rma.rs`; placed runs in
//! `progress/runs.rs`.
//!
//! Invariants:
//! - the thread has no `unsafe`: an operation lends UCX buffers by moving their owners into
//!   its request ([`super::safe`]), filed in its `Pending` entry, and an entry is only
//!   dropped once UCX reports the request complete (the request then hands them back);
//! - a panic on the thread aborts the process before the engine's buffers drop
//!   (`AbortOnUnwind`);
//! - a caller that drops its future closes the oneshot; the thread then cancels the request
//!   (`ucp_request_cancel`) and keeps the buffers until the request completes;
//! - at shutdown, requests are cancelled and endpoints force-closed (which completes their
//!   requests) and the thread progresses until nothing is pending; only if UCX still holds a
//!   request after 5 s are the request, its buffers and the worker leaked, never freed;
//!   revoked receives (`progress/runs.rs`) are not waited for, and leaked likewise.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::command::{Command, EndpointId};
use super::config::{EAGER_SPIN, UcxConfig, Unexpected};
use super::memory_type::{MemoryType, MemoryTypes};
use super::region::RegisterableMemory;
use super::result::{UcxError, status_name};
use super::safe::{
    Context, Endpoint, MemHandle, Message, Parked, RecvBuffer, Started, Wakeup, Worker,
};
use super::sys;
use crate::memory::WriteRun;
use crate::transport::RecvBuffers;

mod group;
mod op;
mod pending;
mod rma;
mod runs;

use group::Group;
use op::{Op, Pending, PutSource};
use rma::RemoteRegion;

/// The thread's body: builds the engine, reports the address, runs until shutdown.
pub(super) fn run(
    config: UcxConfig,
    inbox: mpsc::Receiver<Command>,
    wake: Arc<Wakeup>,
    ready: oneshot::Sender<Result<(Bytes, MemoryTypes), UcxError>>,
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
            if ready
                .send(Ok((Bytes::from(address), engine.worker.memory_types())))
                .is_err()
            {
                return;
            }
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    }
    let done = engine.serve(&inbox, &wake);
    engine.close();
    drop(engine);
    if let Some(done) = done {
        let _ = done.send(());
    }
}

/// Aborts the process when dropped during a panic. The first field of [`Engine`], so it drops
/// first: a panic on the progress thread must not unwind through the engine, whose buffers
/// (receives UCX writes into, sends and puts it reads from, registered memory a peer may
/// write) would be freed while UCX, the NIC or a peer's cma still use them.
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let message = "kvferry: a UCX progress thread panicked; aborting the process rather than freeing memory UCX may still use";
            tracing::error!("{message}");
            // Also straight to stderr: tracing may not be set up, and nothing runs after this.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("{message}\n").as_bytes(),
            );
            std::process::abort();
        }
    }
}

/// Everything UCP of one worker, owned by its progress thread. Field order is drop order:
/// the abort guard, requests, remote keys, endpoints, registrations, then the worker and the
/// context.
struct Engine {
    _abort_on_unwind: AbortOnUnwind,
    /// Operations watched one by one for abandonment: sends, flushes, receives, puts with a
    /// reply. Keyed by [`Request::key`](super::safe::Request::key), like `bulk`.
    pending: HashMap<usize, Pending>,
    /// Runs (their group watches them) and puts without a reply (the flush after them
    /// answers): never looked at one by one while in flight, so thousands of them cost
    /// nothing per progress round.
    bulk: HashMap<usize, Pending>,
    /// Groups of runs with requests in flight.
    groups: Vec<Rc<Group>>,
    /// Revoked receives no message matched yet, with when to cancel them: until then they
    /// take (and drop) the runs their sender may still have on the way, which would otherwise
    /// wait unexpected at UCX for ever.
    draining: VecDeque<(Instant, usize)>,
    remote: HashMap<u64, RemoteRegion>,
    endpoints: HashMap<u64, Rc<Endpoint>>,
    /// Endpoints whose peer failed, closed, with the status operations on them report.
    dead: HashMap<u64, sys::ucs_status_t>,
    registered: HashMap<u64, MemHandle>,
    worker: Rc<Worker>,
    context: Rc<Context>,
    next_id: u64,
    shutting_down: bool,
    supervise: Option<bool>,
    /// [`UcxConfig::eager`].
    eager: bool,
    /// [`UcxConfig::unexpected`], and what was dropped since the last report.
    unexpected: Option<(Unexpected, Dropped)>,
    /// Messages under this agent's own prefix taken off UCX's queue ([`Unexpected::parked`]),
    /// oldest first, for the receive of their tag.
    parked: VecDeque<Parked>,
}

/// Messages held off UCX's unexpected queue at most ([`Unexpected::parked`]): device payloads
/// that came before their header was read, at most a prefill's granted slots each (a prefill
/// never has more chunks on the way than its decode posted receives for, so chunks come here
/// only from a peer that sends more than it was granted). Beyond this, or beyond
/// [`PARKED_BYTES`], the oldest are dropped.
pub(crate) const PARKED: usize = 256;

/// Bytes held at most, by the lengths the senders gave (a rendezvous message's bytes are still
/// at its sender, but count the same); one message is held whatever its length up to
/// [`Unexpected::max_len`].
pub(crate) const PARKED_BYTES: usize = 256 << 20;

/// Messages dropped by [`Engine::drop_unexpected`] since the last report.
#[derive(Default)]
struct Dropped {
    /// Messages and bytes under the `late` prefix (runs of cancelled chunks).
    late: (u64, u64),
    /// Every other one: (messages, bytes, last tag).
    foreign: (u64, u64, u64),
    /// When the last report was logged.
    reported: Option<Instant>,
}

/// The least time between two reports of dropped messages.
const DROP_REPORT: Duration = Duration::from_secs(10);

impl Engine {
    /// `Ok` when this context moves `memory` of its kind; a typed refusal otherwise.
    fn movable(
        &self,
        op: &'static str,
        memory: &dyn RegisterableMemory,
    ) -> Result<MemoryType, UcxError> {
        let kind = memory.memory_type();
        self.worker.moves(op, kind).map(|()| kind)
    }

    fn new(config: &UcxConfig) -> Result<Engine, UcxError> {
        let context = Context::new(config.vars(), config.rma)?;
        let worker = Worker::new(&context)?;
        Ok(Engine {
            _abort_on_unwind: AbortOnUnwind,
            pending: HashMap::new(),
            bulk: HashMap::new(),
            groups: Vec::new(),
            draining: VecDeque::new(),
            remote: HashMap::new(),
            endpoints: HashMap::new(),
            dead: HashMap::new(),
            registered: HashMap::new(),
            worker,
            context,
            next_id: 1,
            shutting_down: false,
            supervise: config.supervise,
            eager: config.eager,
            unexpected: config.unexpected.map(|u| (u, Dropped::default())),
            parked: VecDeque::new(),
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
        wake: &Wakeup,
    ) -> Option<oneshot::Sender<()>> {
        let efd = match self.worker.event_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, "no UCX event fd: the progress thread polls every ms");
                None
            }
        };
        let spin = match self.eager {
            true => EAGER_SPIN,
            false => Duration::ZERO,
        };
        let mut last_event = Instant::now();
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
            // Cancel abandoned receives before progress can match a new message into them.
            busy |= self.sweep() > 0;
            for _ in 0..64 {
                if self.worker.progress() == 0 {
                    break;
                }
                // Each round, so that a flood never queues more than one round's segments.
                self.drop_unexpected();
                busy = true;
            }
            busy |= self.sweep() > 0;
            if busy {
                last_event = Instant::now();
                continue;
            }
            if !spin.is_zero() && last_event.elapsed() < spin {
                continue;
            }
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
            wake.sleep(efd, timeout_ms);
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
                    // Puts still queued hold the endpoint through their keys: close it now.
                    Some(endpoint) => {
                        endpoint.close();
                        Ok(())
                    }
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
                from,
                reply,
            } => {
                let message = match from {
                    Some((source, runs)) => Message::new(parts, Some((source, &runs))),
                    None => Message::new(parts, None),
                };
                let checked =
                    message.and_then(|message| Ok((message, self.endpoint("send_tag", ep)?)));
                let (message, endpoint) = match checked {
                    Ok(checked) => checked,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                match endpoint.tag_send(message, tag) {
                    Ok(Started::Pending(request)) => {
                        self.insert(Pending::new(Some(ep), Op::Send { request, reply }))
                    }
                    Ok(Started::Done(_)) => {
                        let _ = reply.send(Ok(()));
                    }
                    Err((e, _)) => {
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
                into,
                reply,
            } => {
                if let Some(ep) = from
                    && let Err(e) = self.endpoint("recv_tag", ep)
                {
                    let _ = reply.send(Err(e));
                    return;
                }
                let buffer = match &into {
                    Some(owner) => owner.take(capacity),
                    None => Vec::<u8>::with_capacity(capacity),
                };
                // A buffer of `into` goes back there on every path that does not file it.
                let give_back = |buffer: Vec<u8>, into: Option<Arc<dyn RecvBuffers>>| {
                    if let Some(owner) = into {
                        drop(owner.freeze(buffer));
                    }
                };
                let buffer = match RecvBuffer::new(buffer, capacity) {
                    Ok(buffer) => buffer,
                    Err(buffer) => {
                        let _ = reply.send(Err(UcxError::Truncated {
                            capacity: buffer.capacity(),
                        }));
                        give_back(buffer, into);
                        return;
                    }
                };
                match self.recv_tag(buffer, tag, mask) {
                    Ok(Started::Pending(request)) => self.insert(Pending::new(
                        from,
                        Op::Recv {
                            request,
                            capacity,
                            into,
                            reply,
                        },
                    )),
                    Ok(Started::Done(buffer)) => {
                        // Not with UCP_OP_ATTR_FLAG_NO_IMM_CMPL; never guess a length.
                        let _ = reply.send(Err(UcxError::call(
                            "ucp_tag_recv_nbx",
                            sys::UCS_ERR_NO_MESSAGE,
                        )));
                        give_back(buffer.into_vec(), into);
                    }
                    Err((
                        UcxError::Call {
                            status: sys::UCS_ERR_MESSAGE_TRUNCATED,
                            ..
                        },
                        buffer,
                    )) => {
                        let _ = reply.send(Err(UcxError::Truncated { capacity }));
                        give_back(buffer.into_vec(), into);
                    }
                    Err((e, buffer)) => {
                        let _ = reply.send(Err(e));
                        give_back(buffer.into_vec(), into);
                    }
                }
            }
            Command::Register { memory, reply } => {
                let _ = reply.send(self.register(memory));
            }
            Command::Unregister { id, reply } => {
                let _ = reply.send(self.unregister(id));
            }
            Command::AddRemote {
                ep,
                base,
                size,
                rkey,
                reply,
            } => {
                let _ = reply.send(self.add_remote(ep, base, size, &rkey));
            }
            Command::Put {
                region,
                offset,
                data,
                reply,
            } => {
                let run = WriteRun {
                    src: 0,
                    dst: offset,
                    len: data.len() as u64,
                };
                let _ = self.start_puts(region, PutSource::Bytes(data), &[run], Some(reply));
            }
            Command::Flush { ep, reply } => {
                let started = self
                    .endpoint("flush", ep)
                    .and_then(|endpoint| endpoint.flush());
                match started {
                    Ok(Started::Pending(request)) => {
                        self.insert(Pending::new(Some(ep), Op::Flush { request, reply }))
                    }
                    Ok(Started::Done(())) => {
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => {
                        let e = self.failure_of("flush", ep, e);
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Write {
                region,
                source,
                runs,
                reply,
            } => match self.start_puts(region, PutSource::Memory(source), &runs, None) {
                Ok(ep) => self.handle(Command::Flush { ep, reply }),
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::SendRuns {
                ep,
                tag,
                source,
                runs,
                reply,
            } => self.send_runs(ep, tag, source, runs, reply),
            Command::RecvRuns {
                tag,
                memory,
                runs,
                posted,
                cancel,
                reply,
            } => self.recv_runs(tag, memory, runs, posted, cancel, reply),
            Command::Describe { ep, reply } => {
                let _ = reply.send(self.endpoint("describe", ep).and_then(|e| e.info()));
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
            Command::Ping { reply } => {
                let _ = reply.send(Ok(()));
            }
            Command::Shutdown { .. } => {}
        }
    }

    /// Receives the message whose tag matches `tag` under `mask` into `into`: the oldest taken
    /// off UCX's queue before this receive came ([`Engine::parked`]), or the next to arrive.
    fn recv_tag<L: super::safe::Incoming>(
        &mut self,
        into: L,
        tag: u64,
        mask: u64,
    ) -> Result<Started<L>, (UcxError, L)> {
        let parked = (self.parked.iter().position(|p| p.tag & mask == tag & mask))
            .and_then(|i| self.parked.remove(i));
        match parked {
            Some(p) => self.worker.receive_parked(into, p),
            None => self.worker.tag_recv(into, tag, mask),
        }
    }

    /// Drops the tagged messages that arrived with no receive posted and that
    /// [`UcxConfig::unexpected`] does not keep; reports them at most every [`DROP_REPORT`]: a
    /// warning for messages of a foreign tag, a debug line for late runs.
    fn drop_unexpected(&mut self) {
        let Some((unexpected, dropped)) = &mut self.unexpected else {
            return;
        };
        let late = unexpected.late;
        let mut n = self.worker.drop_unexpected(unexpected.keep, |tag, len| {
            if (tag >> 56) as u8 == late {
                dropped.late.0 += 1;
                dropped.late.1 += len as u64;
            } else {
                dropped.foreign.0 += 1;
                dropped.foreign.1 += len as u64;
                dropped.foreign.2 = tag;
            }
        });
        // Under this agent's own prefix: held for their receive, within the bounds.
        let (worker, parked) = (&self.worker, &mut self.parked);
        let before = parked.len();
        worker.park_unexpected(unexpected.keep, unexpected.parked, |p| parked.push_back(p));
        if parked.len() > before {
            let mut over = |p: Parked| {
                dropped.foreign.0 += 1;
                dropped.foreign.1 += p.len as u64;
                dropped.foreign.2 = p.tag;
                worker.discard(p);
                n += 1;
            };
            for p in std::mem::take(parked) {
                match p.len > unexpected.max_len {
                    true => over(p),
                    false => parked.push_back(p),
                }
            }
            let mut bytes: usize = parked.iter().map(|p| p.len).sum();
            while parked.len() > PARKED || (bytes > PARKED_BYTES && parked.len() > 1) {
                let Some(oldest) = parked.pop_front() else {
                    break;
                };
                bytes -= oldest.len;
                over(oldest);
            }
        }
        if n == 0 || dropped.reported.is_some_and(|t| t.elapsed() < DROP_REPORT) {
            return;
        }
        let (runs, run_bytes) = std::mem::take(&mut dropped.late);
        let (foreign, bytes, tag) = std::mem::take(&mut dropped.foreign);
        dropped.reported = Some(Instant::now());
        if runs > 0 {
            tracing::debug!(
                runs,
                bytes = run_bytes,
                "UCX: dropped late runs of cancelled chunks"
            );
        }
        if foreign > 0 {
            tracing::warn!(
                messages = foreign,
                bytes,
                last_tag = format_args!("{tag:#x}"),
                "UCX: dropped messages no receive was posted for, under tags no kvferry peer of \
                 this agent uses (a peer that is not a prefill of this cluster, or one sending \
                 too much); counted again at most every 10 s"
            );
        }
    }

    /// Whether nothing is in flight but revoked receives (which may never end, and write
    /// nothing any more).
    fn idle(&self) -> bool {
        self.pending.is_empty() && self.bulk.values().all(Pending::revoked)
    }

    fn progress_until_idle(&mut self, bound: Duration) {
        let deadline = Instant::now() + bound;
        while !self.idle() && Instant::now() < deadline {
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
            if let Some(endpoint) = self.endpoints.remove(&id) {
                // Forced (it failed): puts still holding its keys complete with an error.
                endpoint.close();
            }
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
        // Receives are cancelled by the sweep; sends and puts get 2 s to finish. Held messages
        // are dropped first (UCX no longer knows them: they would leak, and their rendezvous
        // senders would never hear).
        self.shutting_down = true;
        for parked in std::mem::take(&mut self.parked) {
            self.worker.discard(parked);
        }
        self.progress_until_idle(Duration::from_secs(2));
        if !self.idle() {
            // Their peers do not take them: force-close every endpoint (completes them).
            for endpoint in self.endpoints.values() {
                endpoint.set_failed(sys::UCS_ERR_CANCELED);
            }
        }
        self.remote.clear();
        for (_, endpoint) in self.endpoints.drain() {
            endpoint.close();
        }
        self.progress_until_idle(Duration::from_secs(3));
        if !self.idle() {
            tracing::error!(
                pending = self.pending.len() + self.bulk.len(),
                "UCX still holds requests at shutdown; leaking them, their buffers and the worker"
            );
        }
        // Revoked receives a dead sender left matched never end: they are leaked too (quietly,
        // as expected), never freed while UCX holds them.
        std::mem::forget(std::mem::take(&mut self.pending));
        std::mem::forget(std::mem::take(&mut self.bulk));
        self.registered.clear();
    }
}

#[cfg(test)]
mod tests;
