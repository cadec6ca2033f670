//! How a worker is built and run ([`UcxConfig`]): the UCX variables of its context, whether
//! its endpoints are supervised, eager or rendezvous messages, RMA, and which unexpected
//! messages it keeps ([`Unexpected`]).

/// How to build a worker's context: UCX config variables applied on top of the defaults and
/// the `UCX_*` environment (through `ucp_config_modify`, so two workers of one process can use
/// different transports).
#[derive(Clone, Debug, Default)]
pub struct UcxConfig {
    vars: Vec<(String, String)>,
    pub(super) supervise: Option<bool>,
    pub(super) eager: bool,
    pub(super) rma: bool,
    pub(super) unexpected: Option<Unexpected>,
}

/// Which tagged messages that arrive with no receive posted for them a worker keeps
/// ([`UcxConfig::unexpected`]): those whose tag's top 32 bits are `keep`. Every other one is
/// dropped as it arrives, so no peer can fill the worker's memory with messages nobody
/// receives (UCX queues them without bound, and cannot name their sender). Under `keep`,
/// those with any of the bits `parked` set in their low 32 bits (every one when `parked` has
/// every bit) are taken off UCX's queue and held, at most 256 of them and 256 MiB, none
/// longer than `max_len` bytes, for a receive of their tag to take them; the oldest beyond are
/// dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unexpected {
    /// The prefix of the tags kept.
    pub keep: u32,
    /// The top byte of tags whose messages may arrive late in normal operation (runs of a
    /// chunk cancelled meanwhile): dropped quietly, where any other drop is logged as a
    /// warning.
    pub late: u8,
    /// The low bits of the tags parked under `keep` (a message that came before its receive:
    /// a device payload ahead of its header, a chunk beyond the receives posted).
    pub parked: u32,
    /// The longest message parked.
    pub max_len: usize,
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
    /// [`UcxWorker::fail_endpoint`](super::UcxWorker::fail_endpoint)).
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

    /// Whether messages go eagerly (the caller also sets `RNDV_THRESH=inf`), as over tcp,
    /// where a message arrives as a stream of segments that the receiver copies out of UCX's
    /// buffers. Then the progress thread
    /// - receives placed runs ([`UcxWorker::recv_runs`](super::UcxWorker::recv_runs)) through
    ///   a [`super::safe::Revocable`]: UCX 1.13 never ends a receive whose sender died
    ///   mid-message, and a cancelled run must stop writing into its place even so;
    /// - polls `EAGER_SPIN` before it sleeps, since the next segment is usually that close.
    pub fn eager(mut self, eager: bool) -> Self {
        self.eager = eager;
        self
    }

    /// Whether the worker's context asks for RMA (default: no). Only a worker that writes
    /// one-sided into peers over transports whose hardware checks remote keys (RDMA) should:
    /// with RMA, libucx runs any connected peer's puts and gets in this process over tcp and
    /// shared memory ([`super::safe::Context`]). Without it, remote regions
    /// ([`UcxWorker::add_remote_region`](super::UcxWorker::add_remote_region)) are refused.
    pub fn rma(mut self, rma: bool) -> Self {
        self.rma = rma;
        self
    }

    /// Drops tagged messages that arrive with no receive posted for them, but those
    /// `unexpected` keeps (default: UCX keeps every one until a receive takes it). Counts are
    /// logged at most every 10 s.
    pub fn unexpected(mut self, unexpected: Unexpected) -> Self {
        self.unexpected = Some(unexpected);
        self
    }

    /// Sets a UCX variable, named with or without the `UCX_` prefix (`TLS`, `UCX_TLS`). A
    /// transport's setting goes by its field's own name, without the transport's prefix
    /// (`TX_SEG_SIZE` for `UCX_TCP_TX_SEG_SIZE`): UCX 1.13 accepts `TCP_TX_SEG_SIZE` here,
    /// warns "invalid configuration" and ignores it.
    pub fn var(mut self, name: &str, value: &str) -> Self {
        let name = name.strip_prefix("UCX_").unwrap_or(name);
        self.vars.retain(|(n, _)| n != name);
        self.vars.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The variables set so far.
    pub fn vars(&self) -> &[(String, String)] {
        &self.vars
    }
}

/// How long an eager worker's progress thread keeps polling after its last event before it
/// sleeps. Over tcp a message arrives as a stream of segments, and a thread that sleeps
/// whenever a round finds nothing loses a wake-up per segment: a short poll pays, a long one
/// costs more than it saves (on a loaded machine the spinning threads take the copies' time).
/// Over shared memory, where the receiver pulls a whole run in one copy, polling only costs,
/// so rendezvous workers sleep at once (placed ucx-tcp rooms ran faster with this poll than
/// sleeping at once; staged ucx-shm rooms slower).
pub(super) const EAGER_SPIN: std::time::Duration = std::time::Duration::from_micros(50);
