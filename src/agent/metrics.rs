//! An agent's Prometheus metrics, on the `prometheus-client` library (`GET /metrics`,
//! OpenMetrics text). Names follow Prometheus conventions (`kvferry_` prefix, `_total` on
//! counters, which the library appends, `_seconds` and `_bytes` units) and every series but
//! `kvferry_build_info` (the same on every role: `kvferry_wire::build_info`) carries the
//! agent's `role` (the registry's constant label, first). Every label value of a
//! closed set is exposed from the start (at 0 until it happens), so a scrape after a run has a
//! stable shape.
//!
//! Counters and histograms live as long as the agent; what only the agent knows at scrape
//! time ([`Gauges`]) goes into gauges made for that scrape.

use std::borrow::Cow;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use super::room::RoomState;
use crate::reason::FailureCode;

/// Upper bounds (seconds) of the histograms' buckets: 100 µs to 60 s.
const BUCKETS: [f64; 14] = [
    1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0, 10.0, 60.0,
];

/// A histogram of durations, in seconds.
#[derive(Debug, Clone)]
pub struct Seconds(Histogram);

impl Default for Seconds {
    fn default() -> Self {
        Seconds(Histogram::new(BUCKETS))
    }
}

impl Seconds {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// What only the agent knows at scrape time.
#[derive(Debug, Default)]
pub struct Gauges {
    /// Agent-owned pool pages.
    pub pool_total: usize,
    /// Of which free.
    pub pool_free: usize,
    /// Rooms held now, by state (indexed like [`RoomState::ALL`]).
    pub rooms: [usize; 7],
    /// Staging slots in use (prefill: chunks in flight; decode: scatters running).
    pub slots_in_use: usize,
    /// Where the pool's memory is (`host`, `device`) and where its chunks are staged for the
    /// transport (`host`, `pinned_host`, `device`).
    pub pool: (&'static str, &'static str),
    /// Bytes of host buffers pinned for the device's copies (prefill: chunk buffers; decode:
    /// receive buffers).
    pub pinned_bytes: usize,
}

impl Gauges {
    /// Counts a room in `state`.
    pub fn room(&mut self, state: RoomState) {
        if let Some(i) = RoomState::ALL.iter().position(|s| *s == state) {
            self.rooms[i] += 1;
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Code {
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Path {
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Direction {
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolInfo {
    memory: &'static str,
    staging: &'static str,
}

/// A family whose every label value in `values` is exposed from the start.
fn family<L: Clone + std::hash::Hash + Eq, M: Default>(
    values: impl IntoIterator<Item = L>,
) -> Family<L, M>
where
    Family<L, M>: Default,
{
    let f = Family::<L, M>::default();
    for v in values {
        let _ = f.get_or_create(&v);
    }
    f
}

/// The metrics of one agent.
#[derive(Debug)]
pub struct Metrics {
    role: &'static str,
    rooms_final: Family<State, Counter>,
    failures: Family<Code, Counter>,
    direction: &'static str,
    /// KV bytes sent (prefill) or landed (decode).
    pub bytes: Counter,
    /// Chunks moved by staged sends (gathered into staging, sent, scattered).
    pub chunks_staged: Counter,
    /// Staged chunks a prefill sent straight from its pool, without a gather.
    pub chunks_from_pool: Counter,
    /// Chunks written straight into the decode pool (one-sided writes, no staging).
    pub chunks_direct: Counter,
    /// Direct chunks a prefill wrote in one pass over its pool with another decode rank's
    /// (heterogeneous TP, mapped writes).
    pub chunks_one_pass: Counter,
    /// Chunks whose runs were sent as placed messages, received straight into the pages.
    pub chunks_placed: Counter,
    /// Rooms that expired untaken.
    pub expired: Counter,
    /// Rooms refused at admission (429).
    pub rejected: Counter,
    /// Heartbeat periods a peer stayed silent.
    pub heartbeat_misses: Counter,
    /// Peers declared dead.
    pub peers_dead: Counter,
    /// Prefill: rooms whose decode died before they were delivered, put back to wait for
    /// another decode.
    pub requeued: Counter,
    /// Landed rooms whose bytes failed the synthetic check on take (counted apart: they are
    /// also in `kvferry_rooms_total` as landed).
    pub verify_failures: Counter,
    protocol_errors: Family<Kind, Counter>,
    rma: bool,
    /// Decode: room request -> Hello done and requests sent.
    pub bootstrap: Seconds,
    /// Prefill: request -> the engine's first ready piece; decode: request sent -> first chunk.
    pub ready_wait: Seconds,
    /// Decode: request sent -> success; prefill: first piece sent -> Done.
    pub transfer: Seconds,
    /// Prefill: one chunk's gather.
    pub gather: Seconds,
    /// Decode: one chunk's scatter.
    pub scatter: Seconds,
}

/// Kinds of protocol errors, exposed even before they happen.
const PROTOCOL_ERRORS: [&str; 13] = [
    "bad_magic",
    "unsupported_version",
    "unknown_kind",
    "bad_flags",
    "truncated",
    "trailing_bytes",
    "too_large",
    "bad_tag",
    "bad_range",
    "bad_utf8",
    "bad_frames",
    "unexpected",
    "inconsistent",
];

/// The final states a room is counted in.
const FINAL: [&str; 3] = ["success", "failed", "aborted"];

impl Metrics {
    /// Zeroed metrics of a `role` agent; `rma`: whether its transport lets peers read and
    /// write its memory ([`crate::transport::Transport::remote_memory_access`]).
    pub fn new(role: &'static str, rma: bool) -> Self {
        Metrics {
            role,
            rma,
            rooms_final: family(FINAL.map(|state| State { state })),
            failures: family(FailureCode::ALL.iter().map(|c| Code { code: c.name() })),
            direction: if role == "prefill" {
                "sent"
            } else {
                "received"
            },
            bytes: Counter::default(),
            chunks_staged: Counter::default(),
            chunks_from_pool: Counter::default(),
            chunks_direct: Counter::default(),
            chunks_one_pass: Counter::default(),
            chunks_placed: Counter::default(),
            expired: Counter::default(),
            rejected: Counter::default(),
            heartbeat_misses: Counter::default(),
            peers_dead: Counter::default(),
            requeued: Counter::default(),
            verify_failures: Counter::default(),
            protocol_errors: family(PROTOCOL_ERRORS.map(|kind| Kind { kind })),
            bootstrap: Seconds::default(),
            ready_wait: Seconds::default(),
            transfer: Seconds::default(),
            gather: Seconds::default(),
            scatter: Seconds::default(),
        }
    }

    /// Counts a room reaching a final state (and its failure code).
    pub fn room_final(&self, state: RoomState, code: Option<FailureCode>) {
        let state = match state {
            RoomState::Success => "success",
            RoomState::Failed => "failed",
            RoomState::Aborted => "aborted",
            _ => return,
        };
        self.rooms_final.get_or_create(&State { state }).inc();
        if let Some(code) = code {
            self.failures
                .get_or_create(&Code { code: code.name() })
                .inc();
        }
    }

    /// Counts a refused message by kind (a [`crate::protocol::DecodeError::kind`], or
    /// `bad_frames`, `unexpected`, `inconsistent`).
    pub fn protocol_error(&self, kind: &'static str) {
        self.protocol_errors.get_or_create(&Kind { kind }).inc();
    }

    /// The OpenMetrics text of these metrics and the agent's gauges.
    pub fn render(&self, g: &Gauges) -> String {
        let role = [(Cow::Borrowed("role"), Cow::Borrowed(self.role))];
        let mut r = Registry::with_prefix_and_labels("kvferry", role.into_iter());
        let gauge = |v: usize| {
            let g = Gauge::<i64>::default();
            g.set(v as i64);
            g
        };
        r.register(
            "rooms",
            "Rooms that reached a final state",
            self.rooms_final.clone(),
        );
        r.register(
            "room_failures",
            "Failed or aborted rooms by code",
            self.failures.clone(),
        );
        let held = family::<State, Gauge>(RoomState::ALL.iter().map(|s| State { state: s.name() }));
        for (s, n) in RoomState::ALL.iter().zip(g.rooms) {
            held.get_or_create(&State { state: s.name() }).set(n as i64);
        }
        r.register("rooms_held", "Rooms held now, by state", held);
        let (memory, staging) = g.pool;
        r.register(
            "pool",
            "The pool's memory and where its chunks are staged for the transport",
            Info::new(PoolInfo { memory, staging }),
        );
        r.register(
            "transport_rma",
            "1 when this agent's transport lets connected peers read and write its memory by \
             remote memory access (UCX RMA: only a prefill writing over RDMA), else 0",
            gauge(usize::from(self.rma)),
        );
        r.register(
            "staging_pinned_bytes",
            "Bytes of host buffers pinned for the device's copies (chunk or receive buffers)",
            gauge(g.pinned_bytes),
        );
        let bytes = family::<Direction, Counter>([Direction {
            direction: self.direction,
        }]);
        bytes
            .get_or_create(&Direction {
                direction: self.direction,
            })
            .inc_by(self.bytes.get());
        r.register("kv_bytes", "KV bytes moved by this agent", bytes);
        let chunks = Family::<Path, Counter>::default();
        for (path, c) in [
            ("staged", &self.chunks_staged),
            ("from_pool", &self.chunks_from_pool),
            ("direct", &self.chunks_direct),
            ("one_pass", &self.chunks_one_pass),
            ("placed", &self.chunks_placed),
        ] {
            chunks.get_or_create(&Path { path }).inc_by(c.get());
        }
        r.register("chunks", "Chunks moved, by data path", chunks);
        for (name, help, c) in [
            (
                "rooms_expired",
                "Rooms that expired without being taken",
                &self.expired,
            ),
            (
                "admission_rejections",
                "Rooms refused at admission (429)",
                &self.rejected,
            ),
            (
                "heartbeat_misses",
                "Heartbeat periods a peer stayed silent",
                &self.heartbeat_misses,
            ),
            ("peers_dead", "Peers declared dead", &self.peers_dead),
            (
                "rooms_requeued",
                "Rooms whose decode died before they were delivered, put back to wait for another decode",
                &self.requeued,
            ),
            (
                "verify_failures",
                "Landed rooms whose bytes failed the synthetic check on take",
                &self.verify_failures,
            ),
        ] {
            r.register(name, help, c.clone());
        }
        r.register(
            "protocol_errors",
            "Messages refused, by kind",
            self.protocol_errors.clone(),
        );
        for (h, name, help) in [
            (
                &self.bootstrap,
                "room_bootstrap_seconds",
                "Room request to peers resolved and asked",
            ),
            (
                &self.ready_wait,
                "room_ready_wait_seconds",
                "Waiting for the prefill engine's first ready piece",
            ),
            (
                &self.transfer,
                "room_transfer_seconds",
                "A room's transfer, start to success",
            ),
            (
                &self.gather,
                "gather_seconds",
                "Gather of one chunk into staging",
            ),
            (
                &self.scatter,
                "scatter_seconds",
                "Scatter of one chunk into the pool",
            ),
        ] {
            r.register(name, help, h.0.clone());
        }
        r.register(
            "staging_slots_in_use",
            "Staging slots in use",
            gauge(g.slots_in_use),
        );
        let pages = Family::<State, Gauge>::default();
        pages
            .get_or_create(&State { state: "free" })
            .set(g.pool_free as i64);
        let used = g.pool_total - g.pool_free.min(g.pool_total);
        pages
            .get_or_create(&State { state: "used" })
            .set(used as i64);
        r.register("pool_pages", "Agent-owned pool pages", pages);
        crate::cli::BUILD.encode(&r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_every_series_is_typed() {
        let m = Metrics::new("decode", false);
        m.scatter.observe(Duration::from_micros(50));
        m.scatter.observe(Duration::from_millis(3));
        m.room_final(RoomState::Failed, Some(FailureCode::PeerDead));
        m.protocol_error("truncated");
        m.protocol_error("forged");
        m.chunks_direct.inc();
        m.bytes.inc_by(4096);
        let mut g = Gauges {
            pool_total: 10,
            pool_free: 4,
            pinned_bytes: 1 << 20,
            pool: ("host", "host"),
            ..Gauges::default()
        };
        g.room(RoomState::Transferring);
        let text = m.render(&g);
        println!("{text}");
        let build = crate::cli::BUILD;
        let build = format!(
            r#"kvferry_build_info{{version="{}",revision="{}",protocol="{}"}} 1"#,
            build.version, build.revision, build.protocol
        );
        assert!(text.lines().any(|l| l == build), "{build}");
        for line in [
            r#"kvferry_scatter_seconds_bucket{role="decode",le="0.0001"} 1"#,
            r#"kvferry_scatter_seconds_bucket{role="decode",le="0.005"} 2"#,
            r#"kvferry_scatter_seconds_count{role="decode"} 2"#,
            r#"kvferry_rooms_total{role="decode",state="failed"} 1"#,
            r#"kvferry_rooms_total{role="decode",state="success"} 0"#,
            r#"kvferry_room_failures_total{role="decode",code="peer_dead"} 1"#,
            r#"kvferry_room_failures_total{role="decode",code="checksum"} 0"#,
            r#"kvferry_protocol_errors_total{role="decode",kind="truncated"} 1"#,
            r#"kvferry_protocol_errors_total{role="decode",kind="forged"} 1"#,
            r#"kvferry_protocol_errors_total{role="decode",kind="bad_magic"} 0"#,
            r#"kvferry_rooms_held{role="decode",state="transferring"} 1"#,
            r#"kvferry_rooms_held{role="decode",state="success"} 0"#,
            r#"kvferry_pool_pages{role="decode",state="used"} 6"#,
            r#"kvferry_pool_info{role="decode",memory="host",staging="host"} 1"#,
            r#"kvferry_transport_rma{role="decode"} 0"#,
            r#"kvferry_staging_pinned_bytes{role="decode"} 1048576"#,
            r#"kvferry_kv_bytes_total{role="decode",direction="received"} 4096"#,
            r#"kvferry_chunks_total{role="decode",path="direct"} 1"#,
            r#"kvferry_chunks_total{role="decode",path="staged"} 0"#,
            r#"kvferry_peers_dead_total{role="decode"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // Every sample's family is declared before it, and the text ends as OpenMetrics does.
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap().to_owned());
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                let family = ["_bucket", "_sum", "_count", "_total", "_info"]
                    .iter()
                    .fold(name, |n, sfx| n.strip_suffix(sfx).unwrap_or(n));
                assert!(typed.contains(name) || typed.contains(family), "{line}");
            }
        }
        assert_eq!(text.lines().last(), Some("# EOF"));
    }
}
