//! An agent's configuration ([`AgentConfig`]), which the CLI (`kvferry prefill|decode`) and the
//! Python package build, its timeouts, and the choices that follow from it: how chunks may be
//! written into a decode's pool, ZeroMQ authentication, the control connections' options.

use std::time::Duration;

use super::{StagingChoice, synthetic};
use crate::layout::KvLayout;
use crate::protocol::Ranks;
use crate::transport::TransportKind;

/// Timeouts of an agent; every wait is bounded by one of these.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Waiting for the prefill group to register (decode).
    pub bootstrap: Duration,
    /// Connecting to a peer and its Hello answer.
    pub connect: Duration,
    /// A landed (decode) or finished (prefill) room not taken within this expires.
    pub room_ttl: Duration,
    /// Prefill: the longest a ready room is kept by the heartbeats of a decode that holds it
    /// for a queued request, from its announcement. Decode: the longest it holds one.
    pub room_max: Duration,
    /// One send of a chunk or control message.
    pub send: Duration,
    /// Waiting for the engine's ready pieces of a requested room (`timeout_ready`).
    pub ready: Duration,
    /// A transferring room with no progress (`timeout_stall`).
    pub stall: Duration,
    /// SIGTERM: how long in-flight rooms may take to finish before they are aborted.
    pub drain: Duration,
    /// SIGTERM (decode): how long landed rooms stay takeable after the last one landed (and
    /// after SIGTERM) when the engine has not taken them.
    pub drain_untaken: Duration,
    /// Period of heartbeats on every control connection.
    pub heartbeat: Duration,
    /// A peer silent (no message of any kind) this long is dead.
    pub dead_after: Duration,
    /// Prefill: a room whose decode died before the room was delivered waits this long for
    /// another decode to ask for it (renewed by the heartbeats of one that holds it for a
    /// queued request), then fails `peer_dead`; zero fails it at once.
    pub requeue: Duration,
}

impl Timeouts {
    /// Whether the timeouts agree with each other; the error names their flags.
    pub fn check(&self) -> Result<(), String> {
        if self.room_max < self.room_ttl {
            return Err(format!(
                "--room-max-ms ({}) must be at least --room-ttl-ms ({})",
                self.room_max.as_millis(),
                self.room_ttl.as_millis()
            ));
        }
        if self.heartbeat.is_zero() || self.dead_after <= self.heartbeat {
            return Err(format!(
                "--peer-dead-ms ({}) must exceed --heartbeat-ms ({}) > 0",
                self.dead_after.as_millis(),
                self.heartbeat.as_millis()
            ));
        }
        Ok(())
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            bootstrap: Duration::from_secs(30),
            connect: Duration::from_secs(5),
            room_ttl: Duration::from_secs(60),
            room_max: Duration::from_secs(600),
            send: Duration::from_secs(30),
            ready: Duration::from_secs(60),
            stall: Duration::from_secs(30),
            drain: Duration::from_secs(30),
            drain_untaken: Duration::from_secs(10),
            heartbeat: Duration::from_millis(500),
            dead_after: Duration::from_secs(5),
            requeue: Duration::from_secs(5),
        }
    }
}

/// What an agent needs to run.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// What the rank says it is beyond its layout (engine, served model, engine server), as
    /// registered; the registration adds the protocol versions and the release.
    pub about: kvferry_bootstrap::About,
    /// The registry's URL.
    pub bootstrap: String,
    /// The registries a decode sends its token to: `bootstrap`'s and `--allowed-registries`.
    pub registries: super::TrustedRegistries,
    /// This rank's parallel ranks.
    pub ranks: Ranks,
    /// This rank's pool layout (its slice of the model).
    pub layout: KvLayout,
    /// Pages in the pool.
    pub pool_pages: usize,
    /// Data-plane transport.
    pub transport: TransportKind,
    /// Address the control and data sockets bind.
    pub host: String,
    /// Address peers reach them at, in the registry and in Hello (`--advertise-host`; the bound
    /// address by default, never a wildcard).
    pub advertise_host: String,
    /// Port of the prefill's control socket (0 = any).
    pub control_port: u16,
    /// Port of the decode's data socket (`zmq-tcp`; 0 = any).
    pub data_port: u16,
    /// Address of the engine-facing HTTP API.
    pub api_host: String,
    /// Port of the engine-facing HTTP API (0 = any).
    pub api_port: u16,
    /// Port of the metrics port, on `metrics_host` (0 = any; `None`: no metrics port).
    pub metrics_port: Option<u16>,
    /// Address of the metrics port (`--metrics-host`, else `--api-host`).
    pub metrics_host: String,
    /// HTTPS on the engine API: its certificate and key (`None`: plain HTTP).
    pub api_tls: Option<kvferry_wire::tls::ServerTls>,
    /// Run the built-in synthetic engine.
    pub synthetic: bool,
    /// How the synthetic decode checks a landed room on take.
    pub synthetic_verify: synthetic::Verify,
    /// Shared secret for the registry and Hello.
    pub token: Option<String>,
    /// Serve non-loopback addresses without a token (the CLI refuses them otherwise; the agent
    /// itself only records the choice).
    pub insecure: bool,
    /// Largest chunk of staging bytes moved at once: the size of a staging slot.
    pub chunk_bytes: usize,
    /// Staging slots per peer pair: chunks in flight between two agents at once. The staging
    /// memory of a pair is bounded by `staging_slots x chunk_bytes` on each side, whatever the
    /// number of rooms in flight.
    pub staging_slots: usize,
    /// The pool: anonymous memory of the agent, or an engine's shared-memory pool.
    pub pool: crate::pool::PoolDescriptor,
    /// Synthetic engine pacing: announce a room one layer at a time, this long apart.
    pub synthetic_layer_delay: Duration,
    /// Checksum every chunk (xxh3-64) and verify it on landing.
    pub checksum: bool,
    /// Rooms in flight at most (not yet final); more are refused with 429. Not applied to
    /// reads (`serve_reads`): each decode bounds the reads it asks for by its own.
    pub max_rooms: usize,
    /// Prefill: requests that name this pool's pages for a room no engine announced (reads)
    /// are served.
    pub serve_reads: bool,
    /// Prefill: the pages of ready rooms one decode may hold for its engine's queued requests;
    /// a room past it is not held and expires at its TTL.
    pub max_held_pages: usize,
    /// Fault injection for tests: invert every byte of the N-th chunk sent (after checksumming).
    pub fault_corrupt_chunk: Option<u64>,
    /// Fault injection for tests: the engine API arms faults and changes timeouts while the
    /// agent runs (`POST /v1/faults`).
    pub fault_injection: bool,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Copy threads of the CPU kernel.
    pub copy_threads: usize,
    /// When the direct path (one-sided writes into the decode pool) is used.
    pub direct_writes: DirectWrites,
    /// Whether a decode's pool goes to the prefills of its host for mapped writes
    /// ([`MappedWrites`]).
    pub mapped_writes: MappedWrites,
    /// Shortest average run a piece sends placed ([`DirectMethod::Place`]); shorter ones are
    /// staged. None: [`placed_min_run`] of the path.
    pub placed_min_run_bytes: Option<u64>,
    /// Where a device pool's chunks are staged for the transport ([`StagingChoice`]).
    pub staging: StagingChoice,
}

/// When a segment goes by the direct path, with no gather and no scatter: the prefill's pool
/// runs go straight into the decode's pages, by one-sided writes or by placed sends
/// ([`DirectMethod`]), instead of through staging: on one host by mapped writes (the
/// prefill's copies into the decode's pool file, [`MappedWrites`]), else by the transport's
/// (`ucx`). The decode exposes its pool unless `never`, the prefill decides per piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DirectWrites {
    /// Mapped writes on one host; else the transport's one-sided writes where it reports them
    /// fast and safe (native RDMA writes on a supervised endpoint; not UCX 1.13's tcp or
    /// shared-memory emulations), else placed sends where the transport has them; each only
    /// when the piece's runs are long enough for it.
    #[default]
    Auto,
    /// The transport's one-sided writes whenever it has them (before mapped writes), however
    /// slow: for measurement and tests. UCX has them only over RDMA (its context asks for RMA
    /// nowhere else, see `transport/ucx/data.rs`); a prefill told `always` where they cannot go
    /// refuses to start.
    Always,
    /// Never: every chunk is staged.
    Never,
}

/// Whether mapped writes are used between agents of one host: the decode serves its pool's
/// memory file, the prefill maps it and copies into it (`transport/mapped.rs`). Only over a
/// same-host transport ([`crate::transport::maps_pools`]) and unless `--direct-writes never`;
/// both sides must allow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MappedWrites {
    /// The way a prefill takes first when its decode is on its host (with `--direct-writes
    /// auto`): one copy of each byte whatever the runs' lengths.
    #[default]
    Auto,
    /// Never: the decode keeps its memory to itself. Over UCX it then lands only placed runs it
    /// posted itself (pages safe at once when a prefill dies, where a mapped writer counts
    /// until `--peer-dead-ms` after its death) or staged chunks.
    Never,
}

impl MappedWrites {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            MappedWrites::Auto => "auto",
            MappedWrites::Never => "never",
        }
    }
}

/// How a direct segment's runs reach the decode's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectMethod {
    /// One-sided writes into the pool the decode exposed, flushed before the chunk's header
    /// (`Chunk.direct`); the decode counts the prefill a writer of its rooms until it is done.
    Write,
    /// The header first (`Chunk.placed`), then one message per run, which
    /// the decode receives straight into the places it computes itself: no write into its
    /// pages that it did not post and cannot cancel.
    Place,
}

/// The shortest average run placed rather than staged by default on `path`
/// (`--placed-min-run-bytes`). Each run is one message, so placing beats staging only from a
/// run length on: 128 KiB by rendezvous (a handshake, then the receiver reads: shared memory),
/// 16 KiB as an eager message (tcp), which needs no handshake. Both are where placing beat
/// staging with UCX 1.13 on llama3-8b rooms (docs/benchmarks.md, "Figures behind design
/// choices").
pub fn placed_min_run(path: &crate::transport::WritePath) -> u64 {
    match path.eager {
        true => 16 << 10,
        false => 128 << 10,
    }
}

impl DirectWrites {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            DirectWrites::Auto => "auto",
            DirectWrites::Always => "always",
            DirectWrites::Never => "never",
        }
    }

    /// How direct segments go to a decode reached by `path`, if at all; `revocable_runs` is
    /// the decode's word (Hello) that it lands eager runs through receives it can revoke.
    pub fn method(
        self,
        path: &crate::transport::WritePath,
        revocable_runs: bool,
    ) -> Option<DirectMethod> {
        let placeable = path.placed && (!path.eager || revocable_runs);
        match self {
            DirectWrites::Auto if path.fast => Some(DirectMethod::Write),
            DirectWrites::Auto if placeable => Some(DirectMethod::Place),
            DirectWrites::Always if path.writes => Some(DirectMethod::Write),
            DirectWrites::Auto | DirectWrites::Always | DirectWrites::Never => None,
        }
    }
}

/// Whether this agent takes part in mapped writes ([`MappedWrites`]): its transport carries
/// same-host traffic and neither flag turned them off.
pub(crate) fn maps_pools(cfg: &AgentConfig) -> bool {
    crate::transport::maps_pools(cfg.transport)
        && cfg.direct_writes != DirectWrites::Never
        && cfg.mapped_writes == MappedWrites::Auto
}

/// How this agent's ZeroMQ sockets authenticate: with its token, when it has one.
pub(crate) fn zmq_auth(cfg: &AgentConfig) -> crate::transport::zmq::Auth {
    crate::transport::zmq::Auth::new(cfg.token.as_deref()).insecure(cfg.insecure)
}

/// The bounds and credentials of this agent's control sockets.
pub(crate) fn control_options(cfg: &AgentConfig) -> crate::transport::zmq::control::ControlOptions {
    crate::transport::zmq::control::ControlOptions {
        max_frame: crate::protocol::MAX_FRAME,
        auth: zmq_auth(cfg),
        // A prefill's control connection proves itself with a decode's Hello.
        proof: Some(crate::protocol::is_hello),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_direct_method_follows_the_flag_the_write_path_and_the_decodes_receives() {
        use crate::transport::WritePath;
        let path = |writes, fast, placed, eager| WritePath {
            via: "x".to_owned(),
            placed,
            writes,
            fast,
            eager,
        };
        let (w, p) = (Some(DirectMethod::Write), Some(DirectMethod::Place));
        // (flag, one-sided writes, native writes, placeable, eager runs, decode revokes) -> method
        for (flag, writes, fast, placed, eager, revocable, want) in [
            (DirectWrites::Auto, true, true, true, false, false, w),
            (DirectWrites::Auto, false, false, true, false, false, p), // rendezvous: the decode pulls
            (DirectWrites::Auto, false, false, true, true, true, p),
            // Eager runs into receives the decode cannot revoke: a dead prefill would leave
            // them open for ever.
            (DirectWrites::Auto, false, false, true, true, false, None),
            (DirectWrites::Auto, false, false, false, false, true, None),
            (DirectWrites::Always, true, false, false, false, false, w),
            // No RMA in the transport's context: no one-sided writes, whatever the flag.
            (DirectWrites::Always, false, false, true, false, false, None),
            (DirectWrites::Never, true, true, true, false, true, None),
        ] {
            let got = flag.method(&path(writes, fast, placed, eager), revocable);
            assert_eq!(
                got, want,
                "{flag:?} fast={fast} placed={placed} eager={eager} revocable={revocable}"
            );
        }
    }
}
