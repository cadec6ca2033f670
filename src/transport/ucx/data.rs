//! `--transport ucx`: the data plane over UCX tagged messages (rendezvous for large chunks).
//!
//! UCX picks its transports from the environment (`UCX_TLS`, `UCX_NET_DEVICES`): RDMA in
//! production, tcp or shared memory here. One [`UcxWorker`] (one progress thread) serves the
//! agent's sends or receives. A receiver's endpoint is its worker address, hex-encoded after
//! `ucx:` and the receiver's tag prefix, which the decode advertises in Hello; a sender
//! connects an endpoint to it.
//!
//! A chunk is one tagged message under the receiver's tag prefix ([`Tags`]): its frame ([`Frame`]: the header's length, the header, the
//! payload), contiguous where the prefill built it. Chunks go to the receiver's workers in
//! turn, each of which keeps receives posted for them (`Posting`); the receiver splits the
//! message it got into header and payload without copying.
//!
//! A chunk whose payload is in device memory ([`DataSender::send_device`], where the worker's
//! context moves CUDA memory) is two messages to the same worker: its header under
//! [`Tags::device_chunk`] (the frame, the payload's length and a random key), then the payload
//! straight from the sender's device staging under a tag of the key. The receiver takes the
//! header from its posted receives, then receives the payload into device staging of the
//! agent's ([`DataReceiver::land_on_device`]); a receiver without that refuses the header at
//! once (it never waits for a payload it cannot take). Where the agent lends its own buffers ([`DataReceiver::receive_into`]: a device pool's pinned ones),
//! the posted receives land in them.
//!
//! Placed runs (the agents' default direct path): a sender sends each run of its pool (host
//! memory, or device memory where the context moves it) as a tagged message straight from
//! the pool ([`UcxWorker::send_runs`]), under tags derived from
//! the chunk's key (`placed_tag`); the receiver, which posted a receive at each run's place in
//! its own pool first ([`UcxWorker::recv_runs`]), gets it by rendezvous in one copy (a cma read
//! here, an RDMA read elsewhere) or, over tcp, eagerly: copied out of UCX's segments straight
//! into place by a callback that a cancelled run revokes (`placed_runs`).
//!
//! One-sided writes (the other direct path): a receiver registers its pool with
//! [`UcxWorker::register`] and hands the packed rkey to senders (in Hello); a sender attaches
//! it to its endpoint and writes runs of its own pool straight into the receiver's with
//! `ucp_put_nbx`, then flushes the endpoint before it sends the chunk's header, so the header
//! never overtakes the bytes. Which transport carries the puts is read off the endpoint's lanes
//! (`ucp_ep_print_info`): UCX 1.13 emulates puts over tcp, far slower than tagged sends
//! (staged chunks), and over shared memory through the receiver's FIFO, where UCX cannot see
//! a peer die; both are reported not fast (`fast_writes`), and the
//! agents keep to tagged sends (placed runs or staged chunks) there unless told
//! `--direct-writes always`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::OnceCell;

use super::region::OnDevice;
use super::settings::{eager, insecure_rma, rma, shared_memory_only, ucx_env_sets, worker_vars};
use super::version::{Family, UcxVersion};
use super::{EndpointId, RemoteRegionId, UcxConfig, UcxWorker};
use crate::pool::HostPool;
use crate::transport::{
    BoxFuture, DataReceiver, DataSender, DeviceBytes, DeviceMemory, Frame, Listening, PoolMemory,
    RemoteMemory, Span, Transport, TransportError, TransportErrorKind, TransportKind, WritePath,
    WriteRun,
};

mod receive;
use receive::{Posted, Posting, RECEIVES_AHEAD, UcxReceiver};

/// A receiver's tags. Every message a sender addresses to a receiver's workers but placed runs
/// carries the receiver's `prefix` in its top 32 bits: a random number with the top bit set,
/// drawn per agent and given to prefills in the decode's endpoint (which only Hello carries).
/// The workers drop every message that arrives with no receive posted for it unless its tag
/// has the prefix ([`super::Unexpected`]): a peer that never saw a Hello cannot queue bytes at
/// a receiver, nor take the receives it keeps posted for chunks. Placed runs go under
/// [`placed_tag`], whose top bit is clear: a run arriving unasked (its chunk was cancelled) is
/// dropped too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tags {
    prefix: u32,
}

impl Tags {
    fn random() -> Tags {
        let (high, _) = uuid::Uuid::new_v4().as_u64_pair();
        Tags {
            prefix: 0x8000_0000 | (high as u32),
        }
    }

    /// Parses the prefix part of an endpoint (8 hex digits, top bit set).
    fn parse(hex: &str) -> Option<Tags> {
        let prefix = u32::from_str_radix(hex, 16).ok()?;
        (hex.len() == 8 && prefix & 0x8000_0000 != 0).then_some(Tags { prefix })
    }

    fn base(self) -> u64 {
        u64::from(self.prefix) << 32
    }

    /// A chunk: one message, its frame.
    fn chunk(self) -> u64 {
        self.base() | 1
    }

    /// The header message of a chunk whose payload is in device memory
    /// ([`DataSender::send_device`]): the frame of the header, then the payload's length and
    /// its key (u64 LE each). The payload follows as its own message under
    /// [`Tags::device_payload`], from device staging to device staging.
    fn device_chunk(self) -> u64 {
        self.base() | 2
    }

    /// The device payload of the chunk `key` (senders draw keys at random, at least 4: a
    /// payload's tag never matches the receives posted for chunks).
    fn device_payload(self, key: u32) -> u64 {
        self.base() | u64::from(key)
    }
}

/// The tag mask of the receives a receiver keeps posted: [`Tags::chunk`] and
/// [`Tags::device_chunk`] both match.
const CHUNK_MASK: u64 = !0x3;

/// The top byte of [`placed_tag`]s: late runs of cancelled chunks are dropped quietly.
const PLACED_PREFIX: u8 = 0x50;

/// How long a receiver waits for a device payload once its header arrived (both were queued
/// together by the sender): past this the chunk fails and the receives go on.
const DEVICE_PAYLOAD_WAIT: Duration = Duration::from_secs(30);

/// The tag of run 0 of the placed chunk `key`: a prefix no chunk tag has, 40 bits of the key,
/// and 16 bits for the run's index (`protocol::MAX_RUNS`). Tagged receives match any sender,
/// so keys must not collide among a receiver's chunks in flight: senders draw them at random.
fn placed_tag(key: u64) -> u64 {
    (u64::from(PLACED_PREFIX) << 56) | ((key & 0xff_ffff_ffff) << 16)
}
/// Room a chunk's header may take beyond its payload.
const HEADER_ROOM: usize = 4096;

/// The UCX data plane of one agent.
pub struct UcxData {
    inner: Arc<Inner>,
}

struct Inner {
    /// Largest payload a receiver accepts.
    max_chunk: usize,
    /// The address the agent serves on (`--host`): UCX's network device is its interface.
    host: String,
    /// Whether the workers' contexts have RMA ([`rma`]).
    rma: bool,
    /// This agent's receiving tags: its workers keep no other unexpected message.
    tags: Tags,
    worker: OnceCell<UcxWorker>,
}

impl UcxData {
    /// A UCX data plane for chunks of at most `max_chunk` payload bytes, serving on `host`;
    /// `writes`: whether this agent writes one-sided into its peers' memory (a prefill). The
    /// worker starts at first use, configured from the environment.
    pub fn new(max_chunk: usize, host: &str, writes: bool) -> Self {
        let tls = std::env::var("UCX_TLS").ok();
        UcxData {
            inner: Arc::new(Inner {
                max_chunk,
                host: host.to_owned(),
                rma: rma(writes, tls.as_deref(), insecure_rma()),
                tags: Tags::random(),
                worker: OnceCell::new(),
            }),
        }
    }
}

impl Inner {
    /// The workers' config: the `UCX_*` environment plus [`worker_vars`], eager
    /// ([`UcxConfig::eager`]) where chunks are, RMA where [`rma`] says, unexpected messages
    /// kept only under this agent's [`Tags`], and the network devices
    /// of [`super::devices::for_host`] unless the environment sets `UCX_NET_DEVICES`.
    fn worker_config(&self) -> Result<UcxConfig, TransportError> {
        let tls = std::env::var("UCX_TLS").ok();
        let mut config = UcxConfig::new()
            .eager(eager())
            .rma(self.rma)
            .unexpected(super::Unexpected {
                keep: self.tags.prefix,
                late: PLACED_PREFIX,
                // Every message under the prefix: chunks, and device payloads (keys from 4).
                parked: !0,
                max_len: self.max_chunk + HEADER_ROOM,
            })
            .supervise(shared_memory_only(tls.as_deref()).then_some(false));
        if !ucx_env_sets("NET_DEVICES") {
            let devices = super::devices::for_host(&self.host)
                .map_err(|e| TransportError::new("start", "ucx worker", e))?;
            if let Some(devices) = devices {
                config = config.var("NET_DEVICES", &devices);
            }
        }
        Ok(
            worker_vars(tls.as_deref(), ucx_env_sets, super::version::family())
                .into_iter()
                .fold(config, |config, (name, value)| config.var(name, value)),
        )
    }

    async fn spawn(&self) -> Result<UcxWorker, TransportError> {
        UcxWorker::spawn(self.worker_config()?)
            .await
            .map_err(|e| TransportError::new("start", "ucx worker", e))
    }

    async fn worker(&self) -> Result<UcxWorker, TransportError> {
        self.worker
            .get_or_try_init(|| async {
                let config = self.worker_config()?;
                let devices = config
                    .vars()
                    .iter()
                    .find(|(name, _)| name == "NET_DEVICES")
                    .map(|(_, value)| value.clone())
                    .or_else(|| std::env::var("UCX_NET_DEVICES").ok());
                let worker = UcxWorker::spawn(config)
                    .await
                    .map_err(|e| TransportError::new("start", "ucx worker", e))?;
                tracing::info!(
                    rma = worker.has_rma(),
                    net_devices = devices.as_deref().unwrap_or("all"),
                    tls = std::env::var("UCX_TLS").as_deref().unwrap_or("(UCX's default)"),
                    "ucx worker started (rma: peers' one-sided reads and writes run in this process only when true)"
                );
                Ok(worker)
            })
            .await
            .cloned()
    }
}

/// A receiver's endpoint: `ucx:`, its tag prefix ([`Tags`], 8 hex digits), `/`, and the hex
/// address of each of its workers, comma-separated (chunks go to them in turn, runs are shared
/// out over them, see [`PULLERS`]; the first one exposes the pool); on a UCX other than 1.13,
/// `/` and its release (`version`). An endpoint that names no release is 1.13's, as every one
/// of a kvferry that ran on 1.13 only.
fn encode_endpoint(tags: Tags, addresses: &[Bytes], version: UcxVersion) -> String {
    let hex: Vec<String> = addresses
        .iter()
        .map(|a| a.iter().map(|b| format!("{b:02x}")).collect())
        .collect();
    let release = match version.family() {
        Ok(Family::V1_13) => String::new(),
        _ => format!("/{version}"),
    };
    format!("ucx:{:08x}/{}{release}", tags.prefix, hex.join(","))
}

/// The tags, worker addresses and UCX release of an endpoint of [`encode_endpoint`] (None:
/// 1.13); `None` for anything else (an endpoint of a build before tag prefixes has no `/`).
type Endpoint = (Tags, Vec<Vec<u8>>, Option<UcxVersion>);

fn decode_endpoint(endpoint: &str) -> Option<Endpoint> {
    let (prefix, rest) = endpoint.strip_prefix("ucx:")?.split_once('/')?;
    let (list, version) = match rest.split_once('/') {
        Some((list, version)) => (list, Some(UcxVersion::parse(version)?)),
        None => (rest, None),
    };
    Some((Tags::parse(prefix)?, decode_addresses(list)?, version))
}

/// Refuses a receiver whose UCX release (`theirs`, from its endpoint; None: 1.13) cannot
/// exchange data with this process's: peers of UCX 1.13 and 1.22 do not interoperate.
fn check_release(theirs: Option<UcxVersion>, shown: &str) -> Result<(), TransportError> {
    let ours = UcxVersion::loaded();
    let (peer, named) = match theirs {
        Some(v) => (v, v.to_string()),
        None => (
            UcxVersion {
                major: 1,
                minor: 13,
                release: 0,
            },
            "1.13 (its endpoint names no release)".to_owned(),
        ),
    };
    if ours.interoperates(peer) {
        return Ok(());
    }
    Err(TransportError::new(
        "connect",
        shown,
        format!(
            "the receiver runs UCX {named} and this process UCX {ours}: workers of UCX 1.13 and 1.22 do not exchange data; run both on one release"
        ),
    )
    .with_kind(TransportErrorKind::Incompatible))
}

fn decode_addresses(list: &str) -> Option<Vec<Vec<u8>>> {
    list.split(',')
        .map(|hex| {
            if hex.is_empty() || hex.len() % 2 != 0 {
                return None;
            }
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                .collect()
        })
        .collect()
}

/// Workers of a receiver, each on its own progress thread, that pull placed runs and take
/// chunks in turn: over shared memory two workers pull placed runs faster than one, since each
/// pull is one thread's cma copy and the sender's side does no work meanwhile.
const PULLERS: usize = 2;

/// Which runs of a placed chunk go to which of `parts` receiving workers: consecutive
/// shares, the first ones one run larger. Sender and receiver compute the same.
fn shares(runs: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.max(1);
    let (base, extra) = (runs / parts, runs % parts);
    let mut start = 0;
    (0..parts)
        .map(|k| {
            let len = base + usize::from(k < extra);
            start += len;
            start - len..start
        })
        .filter(|r| !r.is_empty())
        .collect()
}

/// A UCX error as a transport's: [`TransportErrorKind::Malformed`] for a peer's malformed
/// address or key.
///
/// [`TransportErrorKind::Malformed`]: crate::transport::TransportErrorKind::Malformed
fn transport_error(op: &'static str, endpoint: &str, e: super::UcxError) -> TransportError {
    match e {
        super::UcxError::Malformed(m) => TransportError::malformed(op, endpoint, m),
        e => TransportError::new(op, endpoint, e),
    }
}

impl Transport for UcxData {
    fn kind(&self) -> TransportKind {
        TransportKind::Ucx
    }

    /// Asks UCX (`ucp_context_query`) at the worker's start whether it moves CUDA memory.
    fn device_memory(&self) -> BoxFuture<'static, Result<DeviceMemory, TransportError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let worker = inner.worker().await?;
            Ok(match worker.sends_device_memory() {
                true => DeviceMemory::Sends,
                false => DeviceMemory::HostOnly(format!(
                    "UCX has no CUDA memory support (ucp_context_query: memory types {:#x}; a \
                     libucx built without CUDA, or its CUDA transports found no driver)",
                    worker.memory_types().0
                )),
            })
        })
    }

    fn remote_memory_access(&self) -> bool {
        self.inner.rma
    }

    /// A well-framed key of host or CUDA memory; whether this context moves its kind is
    /// checked as it is unpacked (`add_remote_region`).
    fn check_memory(&self, memory: &RemoteMemory) -> Result<(), TransportError> {
        super::packed::rkey_memory_type(&memory.key)
            .map(|_| ())
            .map_err(|e| TransportError::malformed("attach", "decode pool", e))
    }

    /// UCX listens on the interface of the agent's host (given at construction) unless
    /// `UCX_NET_DEVICES` says otherwise, on ports `UCX_TCP_PORT_RANGE` allows; `port` does not
    /// apply (the worker address carries UCX's own interface addresses).
    fn listen(
        &self,
        _host: &str,
        _port: u16,
        _check: crate::transport::ProofCheck,
    ) -> BoxFuture<'static, Result<Listening, TransportError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let worker = inner.worker().await?;
            let mut workers = vec![worker.clone()];
            for _ in 1..PULLERS {
                workers.push(inner.spawn().await?);
            }
            let addresses: Vec<Bytes> = workers.iter().map(UcxWorker::address).collect();
            let endpoint = encode_endpoint(inner.tags, &addresses, UcxVersion::loaded());
            let (landed, arrivals) = tokio::sync::mpsc::unbounded_channel();
            let receiver: Box<dyn DataReceiver> = Box::new(UcxReceiver {
                posting: Arc::new(Posting {
                    tags: inner.tags,
                    capacity: inner.max_chunk + HEADER_ROOM,
                    state: Mutex::new(Posted {
                        wanted: RECEIVES_AHEAD,
                        open: vec![0; workers.len()],
                        generation: 0,
                        tasks: tokio::task::JoinSet::new(),
                    }),
                    landed,
                    workers,
                    buffers: Mutex::new(None),
                }),
                arrivals,
                device: None,
                max_chunk: inner.max_chunk,
            });
            Ok((endpoint, receiver))
        })
    }

    fn connect(
        &self,
        endpoint: &str,
        timeout: Duration,
        _credentials: crate::transport::Credentials,
    ) -> BoxFuture<'static, Result<Box<dyn DataSender>, TransportError>> {
        let inner = self.inner.clone();
        let endpoint = endpoint.to_owned();
        Box::pin(async move {
            let shown: String = endpoint.chars().take(24).collect();
            let (tags, addresses, release) = decode_endpoint(&endpoint).ok_or_else(|| {
                TransportError::malformed(
                    "connect",
                    &shown,
                    "not ucx:PREFIX/, a worker address list and optionally /UCX-RELEASE (a decode \
                     of an earlier kvferry gives no tag prefix: upgrade it)",
                )
            })?;
            check_release(release, &shown)?;
            // Checked before any reaches UCX (the progress thread checks again).
            for address in &addresses {
                super::packed::check_worker_address(address)
                    .map_err(|e| TransportError::malformed("connect", &shown, e))?;
            }
            let worker = inner.worker().await?;
            let mut eps = Vec::with_capacity(addresses.len());
            for address in addresses {
                let ep = tokio::time::timeout(timeout, worker.connect(address.into()))
                    .await
                    .map_err(|_| {
                        let m = format!("no answer within {timeout:?}");
                        TransportError::new("connect", &shown, m)
                    })?
                    .map_err(|e| transport_error("connect", &shown, e))?;
                eps.push(ep);
            }
            let sender: Box<dyn DataSender> = Box::new(UcxSender {
                worker,
                tags,
                ep: eps[0],
                eps,
                sent: 0,
                endpoint: shown,
                region: None,
            });
            Ok(sender)
        })
    }
}

struct UcxSender {
    worker: UcxWorker,
    /// The receiver's.
    tags: Tags,
    /// To the receiver's first worker: chunks, one-sided writes.
    ep: EndpointId,
    /// To each of the receiver's workers (the first is `ep`): chunks in turn, placed runs
    /// shared out.
    eps: Vec<EndpointId>,
    /// Chunks sent, to pick the next one's worker.
    sent: usize,
    endpoint: String,
    /// The receiver's exposed memory, once attached.
    region: Option<RemoteRegionId>,
}

/// Whether runs may be placed ([`Placer`]): where the receiver can stop a run's writes into
/// its pool whatever the sender does. Two cases:
/// - eager messages (`settings::eager_chunks`, tcp here): the receiver lands each run through its own
///   unpack callback ([`UcxConfig::eager`]), revoked when the run is cancelled. Seen here
///   before that: an eager run whose sender was killed mid-run left the receive it matched
///   hanging, uncancellable, its pages never safe to reuse;
/// - rendezvous with reads the receiver makes itself on a native one-sided lane (`via`: cma
///   here, RDMA elsewhere): it pulls each run into its posted receive in one step, which
///   fails, never hangs, when the sender is dead. Not tcp with rendezvous, whose reads UCX
///   emulates with messages: it aborted the decode inside UCX when the prefill died mid-room
///   (`ucp_request_send_state_ff` assertion under `uct_tcp_ep_pending_purge`, e2e_ucx). This
///   relies on UCX's default `get_zcopy` scheme: `UCX_RNDV_SCHEME=put_zcopy` makes the sender
///   write instead (a little faster), and a receive then completes only on a message
///   from the sender, which a sender dying mid-write never sends; leave it unset.
fn placed_runs(eager: bool, via: &[String]) -> bool {
    eager || (!via.is_empty() && !via.iter().any(|t| t == "tcp"))
}

/// Whether one-sided writes carried by `via` are the fast, safe way to a peer: native writes
/// (RDMA) on an endpoint whose peer's death UCX detects. UCX 1.13 has no native put over tcp
/// or shared memory: it emulates puts with messages that the receiver's `ucp_put_handler`
/// copies into place. Seen here with a prefill killed mid-write: over shared memory the
/// decode's FIFO was wedged for every later sender (CI), and over tcp the decode's UCX aborted
/// the process ("Fatal: unexpected error: Endpoint timeout" in `ucp_put_handler`). Hence
/// `auto` never writes directly over them; `--direct-writes always` does, at that risk.
fn fast_writes(via: &[String], supervised: bool) -> bool {
    supervised && !via.is_empty() && !via.iter().any(|t| t == "tcp")
}

/// The transports carrying an endpoint's bulk one-sided writes (its `rma_bw` lanes), from
/// UCX's description of it: lines like `lane[1]:  2:cma/memory.0 md[2] -> ... rma_bw#0`.
fn rma_transports(info: &str) -> Vec<String> {
    let mut out: Vec<String> = info
        .lines()
        .filter(|l| l.contains("lane[") && l.contains("rma_bw"))
        .filter_map(|l| {
            let lane = l.split_once("]:")?.1.split_whitespace().next()?;
            let tl = lane.split_once(':')?.1.split('/').next()?;
            Some(tl.to_owned())
        })
        .collect();
    out.dedup();
    out
}

impl UcxSender {
    /// The receiver's worker for the next chunk: each in turn, so that its progress threads
    /// take them in turn.
    fn next_ep(&mut self) -> EndpointId {
        let ep = self.eps[self.sent % self.eps.len()];
        self.sent = self.sent.wrapping_add(1);
        ep
    }

    fn sent(
        &self,
        op: &'static str,
        sent: impl std::future::Future<Output = Result<(), super::UcxError>> + Send + 'static,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let endpoint = self.endpoint.clone();
        Box::pin(async move {
            sent.await
                .map_err(|e| TransportError::new(op, &endpoint, e))
        })
    }
}

impl DataSender for UcxSender {
    fn close(&mut self) {
        self.disconnect(self.eps.clone());
    }

    fn send(&mut self, frame: Frame) -> BoxFuture<'static, Result<(), TransportError>> {
        // One contiguous message: where chunks go by rendezvous (shared memory, RDMA) the
        // receiver reads it in one copy; a message of parts (an io-vector) would go through
        // UCX 1.13's shared-memory FIFO, two copies in fragments (TP2 -> TP1 rooms ran much
        // slower as three parts than as one).
        let ep = self.next_ep();
        let sent = self
            .worker
            .send_tag(ep, self.tags.chunk(), frame.bytes().clone());
        self.sent("send", sent)
    }

    fn send_device(
        &mut self,
        header: Frame,
        payload: Arc<dyn DeviceBytes>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        // The header (host memory) and the payload (device memory) are two messages: one UCX
        // request has one memory type. Both go to the same worker of the receiver, in order.
        let ep = self.next_ep();
        let key = (uuid::Uuid::new_v4().as_u64_pair().0 as u32).max(4);
        let mut trailer = Vec::with_capacity(16);
        trailer.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        trailer.extend_from_slice(&u64::from(key).to_le_bytes());
        let parts = vec![header.bytes().clone(), Bytes::from(trailer)];
        let head = self
            .worker
            .send_tag_parts(ep, self.tags.device_chunk(), parts);
        let len = payload.len() as u64;
        let body = self.worker.send_runs(
            ep,
            self.tags.device_payload(key),
            Arc::new(OnDevice(payload)),
            vec![Span { offset: 0, len }],
        );
        self.sent("send_device", async move {
            head.await?;
            body.await
        })
    }

    fn sends_from_pool(&self) -> bool {
        // Eager chunks go by the kernel's copy out of whatever pieces they are in: over tcp a
        // message of a prefix and a few ranges goes as fast as one contiguous buffer (raw UCX,
        // 1 MiB messages, a 64-byte prefix and one range against one buffer, alternated).
        eager()
    }

    fn send_from(
        &mut self,
        prefix: Frame,
        source: Arc<HostPool>,
        runs: Vec<Span>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let ep = self.next_ep();
        let bytes = prefix.bytes().clone();
        let sent = self
            .worker
            .send_tag_from(ep, self.tags.chunk(), bytes, source, runs);
        self.sent("send_from", sent)
    }

    fn attach(
        &mut self,
        memory: RemoteMemory,
    ) -> BoxFuture<'_, Result<Option<WritePath>, TransportError>> {
        Box::pin(async move {
            let fail = |e: super::UcxError| transport_error("attach", &self.endpoint, e);
            let writes = self.worker.has_rma();
            if writes {
                let region = self
                    .worker
                    .add_remote_region(self.ep, memory.base, memory.size, memory.key.into())
                    .await
                    .map_err(fail)?;
                self.region = Some(region);
            }
            let info = self.worker.describe(self.ep).await.map_err(fail)?;
            let supervised = self.worker.is_supervised(self.ep).await.map_err(fail)?;
            let via = rma_transports(&info);
            // A rendezvous threshold of this process's own makes UCX send every message below
            // it eagerly, in fragments that only a revocable receive survives if this process
            // dies mid-message: runs then count as eager, whatever the transports.
            let eager_runs = eager() || ucx_env_sets("RNDV_THRESH");
            Ok(Some(WritePath {
                placed: placed_runs(eager_runs, &via),
                eager: eager_runs,
                writes,
                fast: writes && fast_writes(&via, supervised),
                via: match via.is_empty() {
                    true => "none".to_owned(),
                    false => via.join(","),
                } + if supervised { "" } else { " (unsupervised)" },
            }))
        })
    }

    fn write(
        &mut self,
        source: Arc<HostPool>,
        runs: Vec<WriteRun>,
    ) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let region = self.region.ok_or_else(|| {
                TransportError::new("write", &self.endpoint, "no memory attached")
            })?;
            self.worker
                .write(region, source, runs)
                .await
                .map_err(|e| TransportError::new("write", &self.endpoint, e))
        })
    }

    fn send_runs(
        &mut self,
        source: PoolMemory,
        key: u64,
        runs: Vec<Span>,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let source = super::region::of_pool(source);
        // Queued now, in order, one share per receiving worker.
        let sends: Vec<_> = shares(runs.len(), self.eps.len())
            .into_iter()
            .zip(&self.eps)
            .map(|(share, &ep)| {
                let tag = placed_tag(key) + share.start as u64;
                let runs = runs[share].to_vec();
                self.worker.send_runs(ep, tag, source.clone(), runs)
            })
            .collect();
        let endpoint = self.endpoint.clone();
        Box::pin(async move {
            for taken in sends {
                taken
                    .await
                    .map_err(|e| TransportError::new("send_runs", &endpoint, e))?;
            }
            Ok(())
        })
    }
}

impl Drop for UcxSender {
    fn drop(&mut self) {
        let eps = std::mem::take(&mut self.eps);
        self.disconnect(eps);
    }
}

impl UcxSender {
    /// Closes `eps` (by force where UCX supervises them: requests in flight end with an
    /// error); later operations on them fail (the worker knows them no more).
    fn disconnect(&self, eps: Vec<EndpointId>) {
        let worker = self.worker.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                for ep in eps {
                    let _ = worker.disconnect(ep).await;
                }
            });
        }
    }
}

#[cfg(test)]
mod tests;
