//! An agent's Prometheus metrics: counters, histograms and gauges, rendered in the text
//! exposition format (`GET /metrics`). Names follow Prometheus conventions (`kvferry_`
//! prefix, `_total` counters, `_seconds` and `_bytes` units) and every series carries the
//! agent's `role`. Every label value is always exposed (at 0 until it happens), so a scrape
//! after a run has a stable shape.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::room::RoomState;
use crate::reason::FailureCode;

/// Upper bounds (seconds) of the histograms' buckets: 100 µs to 60 s.
const BUCKETS: [f64; 14] = [
    1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0, 10.0, 60.0,
];

/// A histogram of durations with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    /// Sum in nanoseconds.
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str, role: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, n) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += n.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{role=\"{role}\",le=\"{b}\"}} {cumulative}"
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{role=\"{role}\",le=\"+Inf\"}} {count}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{role=\"{role}\"}} {sum}");
        let _ = writeln!(out, "{name}_count{{role=\"{role}\"}} {count}");
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

/// The metrics of one agent.
#[derive(Debug)]
pub struct Metrics {
    role: &'static str,
    rooms_final: [AtomicU64; 3],
    failures: Vec<AtomicU64>,
    /// KV bytes sent (prefill) or landed (decode).
    pub bytes: AtomicU64,
    /// Chunks moved by staged sends (gathered into staging, sent, scattered).
    pub chunks_staged: AtomicU64,
    /// Staged chunks a prefill sent straight from its pool, without a gather.
    pub chunks_from_pool: AtomicU64,
    /// Chunks written straight into the decode pool (one-sided writes, no staging).
    pub chunks_direct: AtomicU64,
    /// Chunks whose runs were sent as placed messages, received straight into the pages.
    pub chunks_placed: AtomicU64,
    /// Rooms that expired untaken.
    pub expired: AtomicU64,
    /// Rooms refused at admission (429).
    pub rejected: AtomicU64,
    /// Heartbeat periods a peer stayed silent.
    pub heartbeat_misses: AtomicU64,
    /// Peers declared dead.
    pub peers_dead: AtomicU64,
    /// Landed rooms whose bytes failed the synthetic check on take (counted apart: they are
    /// also in `kvferry_rooms_total` as landed).
    pub verify_failures: AtomicU64,
    protocol_errors: Mutex<BTreeMap<&'static str, u64>>,
    /// Decode: room request -> Hello done and requests sent.
    pub bootstrap: Histogram,
    /// Prefill: request -> the engine's first ready piece; decode: request sent -> first chunk.
    pub ready_wait: Histogram,
    /// Decode: request sent -> success; prefill: first piece sent -> Done.
    pub transfer: Histogram,
    /// Prefill: one chunk's gather.
    pub gather: Histogram,
    /// Decode: one chunk's scatter.
    pub scatter: Histogram,
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

impl Metrics {
    /// Zeroed metrics of a `role` agent.
    pub fn new(role: &'static str) -> Self {
        Metrics {
            role,
            rooms_final: Default::default(),
            failures: FailureCode::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            bytes: AtomicU64::new(0),
            chunks_staged: AtomicU64::new(0),
            chunks_from_pool: AtomicU64::new(0),
            chunks_direct: AtomicU64::new(0),
            chunks_placed: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            heartbeat_misses: AtomicU64::new(0),
            peers_dead: AtomicU64::new(0),
            verify_failures: AtomicU64::new(0),
            protocol_errors: Mutex::new(PROTOCOL_ERRORS.iter().map(|k| (*k, 0)).collect()),
            bootstrap: Histogram::default(),
            ready_wait: Histogram::default(),
            transfer: Histogram::default(),
            gather: Histogram::default(),
            scatter: Histogram::default(),
        }
    }

    /// Counts a room reaching a final state (and its failure code).
    pub fn room_final(&self, state: RoomState, code: Option<FailureCode>) {
        let i = match state {
            RoomState::Success => 0,
            RoomState::Failed => 1,
            RoomState::Aborted => 2,
            _ => return,
        };
        self.rooms_final[i].fetch_add(1, Ordering::Relaxed);
        if let Some(pos) = code.and_then(|code| FailureCode::ALL.iter().position(|c| *c == code)) {
            self.failures[pos].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a refused message by kind (a [`crate::protocol::DecodeError::kind`], or
    /// `bad_frames`, `unexpected`, `inconsistent`).
    pub fn protocol_error(&self, kind: &'static str) {
        let mut m = self
            .protocol_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *m.entry(kind).or_insert(0) += 1;
    }

    /// Messages refused, all kinds.
    pub fn protocol_errors_total(&self) -> u64 {
        self.protocol_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum()
    }

    /// The Prometheus text of these metrics and the agent's gauges.
    pub fn render(&self, g: &Gauges) -> String {
        let role = self.role;
        let mut s = String::new();
        let counter = |s: &mut String, name: &str, help: &str, series: &[(String, u64)]| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter");
            for (labels, v) in series {
                let _ = writeln!(s, "{name}{{role=\"{role}\"{labels}}} {v}");
            }
        };
        let gauge = |s: &mut String, name: &str, help: &str, series: &[(String, u64)]| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (labels, v) in series {
                let _ = writeln!(s, "{name}{{role=\"{role}\"{labels}}} {v}");
            }
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let finals: Vec<(String, u64)> = ["success", "failed", "aborted"]
            .iter()
            .zip(&self.rooms_final)
            .map(|(st, v)| (format!(",state=\"{st}\""), load(v)))
            .collect();
        counter(
            &mut s,
            "kvferry_rooms_total",
            "Rooms that reached a final state.",
            &finals,
        );
        let codes: Vec<(String, u64)> = FailureCode::ALL
            .iter()
            .zip(&self.failures)
            .map(|(c, v)| (format!(",code=\"{c}\""), load(v)))
            .collect();
        counter(
            &mut s,
            "kvferry_room_failures_total",
            "Failed or aborted rooms by code.",
            &codes,
        );
        let states: Vec<(String, u64)> = RoomState::ALL
            .iter()
            .zip(g.rooms)
            .map(|(st, n)| (format!(",state=\"{}\"", st.name()), n as u64))
            .collect();
        gauge(
            &mut s,
            "kvferry_rooms",
            "Rooms held now, by state.",
            &states,
        );
        let one = |v: u64| vec![(String::new(), v)];
        let (memory, staging) = g.pool;
        gauge(
            &mut s,
            "kvferry_pool_info",
            "The pool's memory and where its chunks are staged for the transport (always 1).",
            &[(format!(",memory=\"{memory}\",staging=\"{staging}\""), 1)],
        );
        gauge(
            &mut s,
            "kvferry_staging_pinned_bytes",
            "Bytes of host buffers pinned for the device's copies (chunk or receive buffers).",
            &one(g.pinned_bytes as u64),
        );
        let direction = if role == "prefill" {
            "sent"
        } else {
            "received"
        };
        counter(
            &mut s,
            "kvferry_kv_bytes_total",
            "KV bytes moved by this agent.",
            &[(format!(",direction=\"{direction}\""), load(&self.bytes))],
        );
        let paths = [
            ("staged", load(&self.chunks_staged)),
            ("from_pool", load(&self.chunks_from_pool)),
            ("direct", load(&self.chunks_direct)),
            ("placed", load(&self.chunks_placed)),
        ];
        let paths: Vec<(String, u64)> = paths
            .iter()
            .map(|(p, v)| (format!(",path=\"{p}\""), *v))
            .collect();
        counter(
            &mut s,
            "kvferry_chunks_total",
            "Chunks moved, by data path.",
            &paths,
        );
        counter(
            &mut s,
            "kvferry_rooms_expired_total",
            "Rooms that expired without being taken.",
            &one(load(&self.expired)),
        );
        counter(
            &mut s,
            "kvferry_admission_rejections_total",
            "Rooms refused at admission (429).",
            &one(load(&self.rejected)),
        );
        counter(
            &mut s,
            "kvferry_heartbeat_misses_total",
            "Heartbeat periods a peer stayed silent.",
            &one(load(&self.heartbeat_misses)),
        );
        counter(
            &mut s,
            "kvferry_peers_dead_total",
            "Peers declared dead.",
            &one(load(&self.peers_dead)),
        );
        counter(
            &mut s,
            "kvferry_verify_failures_total",
            "Landed rooms whose bytes failed the synthetic check on take.",
            &one(load(&self.verify_failures)),
        );
        let kinds: Vec<(String, u64)> = self
            .protocol_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (format!(",kind=\"{k}\""), *v))
            .collect();
        counter(
            &mut s,
            "kvferry_protocol_errors_total",
            "Messages refused, by kind.",
            &kinds,
        );
        let hists = [
            (
                &self.bootstrap,
                "kvferry_room_bootstrap_seconds",
                "Room request to peers resolved and asked.",
            ),
            (
                &self.ready_wait,
                "kvferry_room_ready_wait_seconds",
                "Waiting for the prefill engine's first ready piece.",
            ),
            (
                &self.transfer,
                "kvferry_room_transfer_seconds",
                "A room's transfer, start to success.",
            ),
            (
                &self.gather,
                "kvferry_gather_seconds",
                "Gather of one chunk into staging.",
            ),
            (
                &self.scatter,
                "kvferry_scatter_seconds",
                "Scatter of one chunk into the pool.",
            ),
        ];
        for (h, name, help) in hists {
            h.render(&mut s, name, help, role);
        }
        gauge(
            &mut s,
            "kvferry_staging_slots_in_use",
            "Staging slots in use.",
            &one(g.slots_in_use as u64),
        );
        let pages = [
            (",state=\"free\"".to_owned(), g.pool_free as u64),
            (
                ",state=\"used\"".to_owned(),
                (g.pool_total - g.pool_free.min(g.pool_total)) as u64,
            ),
        ];
        gauge(
            &mut s,
            "kvferry_pool_pages",
            "Agent-owned pool pages.",
            &pages,
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_every_series_is_typed() {
        let m = Metrics::new("decode");
        m.scatter.observe(Duration::from_micros(50));
        m.scatter.observe(Duration::from_millis(3));
        m.room_final(RoomState::Failed, Some(FailureCode::PeerDead));
        m.protocol_error("truncated");
        let mut g = Gauges {
            pool_total: 10,
            pool_free: 4,
            ..Gauges::default()
        };
        g.room(RoomState::Transferring);
        let text = m.render(&g);
        assert!(text.contains("kvferry_scatter_seconds_bucket{role=\"decode\",le=\"0.0001\"} 1"));
        assert!(text.contains("kvferry_scatter_seconds_bucket{role=\"decode\",le=\"0.005\"} 2"));
        assert!(text.contains("kvferry_scatter_seconds_count{role=\"decode\"} 2"));
        assert!(text.contains("kvferry_room_failures_total{role=\"decode\",code=\"peer_dead\"} 1"));
        assert!(
            text.contains("kvferry_protocol_errors_total{role=\"decode\",kind=\"truncated\"} 1")
        );
        assert!(text.contains("kvferry_rooms{role=\"decode\",state=\"transferring\"} 1"));
        assert!(text.contains("kvferry_pool_pages{role=\"decode\",state=\"used\"} 6"));
        // Every sample's family is declared before it.
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap().to_owned());
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .fold(name, |n, sfx| n.strip_suffix(sfx).unwrap_or(n));
                assert!(typed.contains(name) || typed.contains(family), "{line}");
            }
        }
    }
}
