//! The registry's Prometheus metrics: the counters that live outside the registry state
//! (lookups, rejections) and the text exposition of all of them for `GET /metrics`.
//!
//! Every family is always exposed with `# HELP` and `# TYPE`, and every label value of a
//! closed set is always present (0 until it happens), so dashboards and `promtool check
//! metrics` see a stable shape.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::RejectReason;
use crate::registry::RegistryStats;

/// Counters updated lock-free by the request handlers.
#[derive(Debug, Default)]
pub struct Metrics {
    lookups_complete: AtomicU64,
    lookups_incomplete: AtomicU64,
    rejected: [AtomicU64; RejectReason::ALL.len()],
}

impl Metrics {
    /// Counts one prefill lookup; `complete` is false when it answered 503.
    pub fn lookup(&self, complete: bool) {
        let counter = if complete {
            &self.lookups_complete
        } else {
            &self.lookups_incomplete
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one rejected request.
    pub fn reject(&self, reason: RejectReason) {
        if let Some(i) = RejectReason::ALL.iter().position(|r| *r == reason) {
            self.rejected[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The Prometheus text exposition (format 0.0.4) of these counters and `stats`.
    pub fn render(&self, stats: &RegistryStats) -> String {
        let mut out = String::with_capacity(2048);
        family(
            &mut out,
            "kvferry_bootstrap_ranks",
            "gauge",
            "Live registrations (lease not expired), by role.",
        );
        sample(
            &mut out,
            "kvferry_bootstrap_ranks",
            r#"role="prefill""#,
            stats.prefill_ranks,
        );
        sample(
            &mut out,
            "kvferry_bootstrap_ranks",
            r#"role="decode""#,
            stats.decode_ranks,
        );
        family(
            &mut out,
            "kvferry_bootstrap_groups",
            "gauge",
            "Prefill DP groups with at least one live rank.",
        );
        sample(&mut out, "kvferry_bootstrap_groups", "", stats.groups);
        family(
            &mut out,
            "kvferry_bootstrap_registrations_total",
            "counter",
            "Accepted registrations (new, or the same instance refreshing).",
        );
        sample(
            &mut out,
            "kvferry_bootstrap_registrations_total",
            "",
            stats.registrations_total,
        );
        family(
            &mut out,
            "kvferry_bootstrap_lookups_total",
            "counter",
            "Prefill group lookups, by whether the group was complete.",
        );
        for (label, counter) in [
            (r#"result="complete""#, &self.lookups_complete),
            (r#"result="incomplete""#, &self.lookups_incomplete),
        ] {
            sample(
                &mut out,
                "kvferry_bootstrap_lookups_total",
                label,
                counter.load(Ordering::Relaxed),
            );
        }
        family(
            &mut out,
            "kvferry_bootstrap_lease_expiries_total",
            "counter",
            "Registrations dropped because their lease was not renewed in time.",
        );
        sample(
            &mut out,
            "kvferry_bootstrap_lease_expiries_total",
            "",
            stats.lease_expiries_total,
        );
        family(
            &mut out,
            "kvferry_bootstrap_rejected_requests_total",
            "counter",
            "Requests answered with a 4xx, by reason.",
        );
        for (reason, counter) in RejectReason::ALL.iter().zip(&self.rejected) {
            sample(
                &mut out,
                "kvferry_bootstrap_rejected_requests_total",
                &format!(r#"reason="{}""#, reason.as_str()),
                counter.load(Ordering::Relaxed),
            );
        }
        out
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, value: u64) {
    let _ = if labels.is_empty() {
        writeln!(out, "{name} {value}")
    } else {
        writeln!(out, "{name}{{{labels}}} {value}")
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_help_type_and_all_label_values() {
        let m = Metrics::default();
        m.lookup(true);
        m.lookup(false);
        m.lookup(false);
        m.reject(RejectReason::TooLarge);
        let text = m.render(&RegistryStats {
            prefill_ranks: 3,
            decode_ranks: 1,
            groups: 1,
            registrations_total: 5,
            lease_expiries_total: 2,
        });
        for line in [
            "# TYPE kvferry_bootstrap_ranks gauge",
            "kvferry_bootstrap_ranks{role=\"prefill\"} 3",
            "kvferry_bootstrap_ranks{role=\"decode\"} 1",
            "# TYPE kvferry_bootstrap_registrations_total counter",
            "kvferry_bootstrap_registrations_total 5",
            "kvferry_bootstrap_lookups_total{result=\"complete\"} 1",
            "kvferry_bootstrap_lookups_total{result=\"incomplete\"} 2",
            "kvferry_bootstrap_lease_expiries_total 2",
            "kvferry_bootstrap_rejected_requests_total{reason=\"too_large\"} 1",
            "kvferry_bootstrap_rejected_requests_total{reason=\"conflict\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        let helps = text.lines().filter(|l| l.starts_with("# HELP")).count();
        let types = text.lines().filter(|l| l.starts_with("# TYPE")).count();
        assert_eq!((helps, types), (6, 6));
    }
}
