//! The registry's Prometheus metrics, on the `prometheus-client` library: the counters that
//! live outside the registry state (lookups, rejections) and, at each scrape, the registry
//! state's figures, as OpenMetrics text for `GET /metrics`.
//!
//! Every label value of a closed set is always present (0 until it happens), so dashboards and
//! metrics parsers see a stable shape.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use kvferry_wire::BuildInfo;

use crate::error::RejectReason;
use crate::registry::RegistryStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Result {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Role {
    role: &'static str,
}

/// Counters updated lock-free by the request handlers, and the build `/metrics` names.
#[derive(Debug)]
pub struct Metrics {
    lookups: Family<Result, Counter>,
    rejected: Family<Reason, Counter>,
    build: Option<BuildInfo>,
}

impl Default for Metrics {
    /// Zeroed counters, without `kvferry_build_info`.
    fn default() -> Self {
        Metrics::new(None)
    }
}

impl Metrics {
    /// Zeroed counters; `/metrics` says `kvferry_build_info` of `build` when known.
    pub fn new(build: Option<BuildInfo>) -> Self {
        let lookups = Family::default();
        for result in ["complete", "incomplete"] {
            let _ = lookups.get_or_create(&Result { result });
        }
        let rejected = Family::default();
        for r in RejectReason::ALL {
            let _ = rejected.get_or_create(&Reason { reason: r.as_str() });
        }
        Metrics {
            lookups,
            rejected,
            build,
        }
    }

    /// Counts one prefill lookup; `complete` is false when it answered 503.
    pub fn lookup(&self, complete: bool) {
        let result = if complete { "complete" } else { "incomplete" };
        self.lookups.get_or_create(&Result { result }).inc();
    }

    /// Counts one rejected request.
    pub fn reject(&self, reason: RejectReason) {
        self.rejected
            .get_or_create(&Reason {
                reason: reason.as_str(),
            })
            .inc();
    }

    /// The OpenMetrics text ([`kvferry_wire::http::OPENMETRICS_CONTENT_TYPE`]) of these counters and
    /// the store's `stats`, or `None` while the store cannot answer: then
    /// `kvferry_bootstrap_store_up` is 0 and the store's own figures are left out, so a scrape
    /// still succeeds (the process is up) and says what is wrong.
    pub fn render(&self, stats: Option<&RegistryStats>) -> String {
        let mut r = Registry::with_prefix("kvferry_bootstrap");
        let store_up = Gauge::<i64>::default();
        store_up.set(i64::from(stats.is_some()));
        r.register(
            "store_up",
            "1 while the registry's store (memory, or etcd) answers, else 0",
            store_up,
        );
        if let Some(stats) = stats {
            let ranks = Family::<Role, Gauge>::default();
            for (role, n) in [
                ("prefill", stats.prefill_ranks),
                ("decode", stats.decode_ranks),
            ] {
                ranks.get_or_create(&Role { role }).set(n as i64);
            }
            r.register(
                "ranks",
                "Live registrations (lease not expired), by role",
                ranks,
            );
            let groups = Gauge::<i64>::default();
            groups.set(stats.groups as i64);
            r.register(
                "groups",
                "Prefill DP groups with at least one live rank",
                groups,
            );
            // The registry state counts these; a counter made for the scrape carries its figure.
            let counted = |n: u64| {
                let c = Counter::<u64>::default();
                c.inc_by(n);
                c
            };
            r.register(
                "registrations",
                "Accepted registrations (new, or the same instance refreshing)",
                counted(stats.registrations_total),
            );
            r.register(
                "lease_expiries",
                "Registrations dropped because their lease was not renewed in time",
                counted(stats.lease_expiries_total),
            );
        }
        r.register(
            "lookups",
            "Prefill group lookups, by whether the group was complete",
            self.lookups.clone(),
        );
        r.register(
            "rejected_requests",
            "Requests answered with a 4xx, by reason",
            self.rejected.clone(),
        );
        kvferry_wire::build_info::encode(self.build.as_ref(), &[&r])
    }
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
        let text = m.render(Some(&RegistryStats {
            prefill_ranks: 3,
            decode_ranks: 1,
            groups: 1,
            registrations_total: 5,
            lease_expiries_total: 2,
        }));
        for line in [
            "kvferry_bootstrap_store_up 1",
            "# TYPE kvferry_bootstrap_ranks gauge",
            "kvferry_bootstrap_ranks{role=\"prefill\"} 3",
            "kvferry_bootstrap_ranks{role=\"decode\"} 1",
            "kvferry_bootstrap_groups 1",
            "# TYPE kvferry_bootstrap_registrations counter",
            "kvferry_bootstrap_registrations_total 5",
            "kvferry_bootstrap_lookups_total{result=\"complete\"} 1",
            "kvferry_bootstrap_lookups_total{result=\"incomplete\"} 2",
            "kvferry_bootstrap_lease_expiries_total 2",
            "kvferry_bootstrap_rejected_requests_total{reason=\"too_large\"} 1",
            "kvferry_bootstrap_rejected_requests_total{reason=\"conflict\"} 0",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        let helps = text.lines().filter(|l| l.starts_with("# HELP")).count();
        let types = text.lines().filter(|l| l.starts_with("# TYPE")).count();
        assert_eq!((helps, types), (7, 7));
        assert!(!text.contains("build_info"), "{text}");
        // A store that cannot answer: still a scrape, saying so, without the store's figures.
        let down = m.render(None);
        assert!(
            down.lines().any(|l| l == "kvferry_bootstrap_store_up 0"),
            "{down}"
        );
        assert!(!down.contains("kvferry_bootstrap_ranks"), "{down}");
        assert!(
            down.contains("kvferry_bootstrap_lookups_total{result=\"incomplete\"} 2"),
            "{down}"
        );
    }

    #[test]
    fn the_build_is_named_when_the_caller_knows_it() {
        let build = BuildInfo {
            version: "0.1.0",
            revision: "abc1234",
            protocol: 13,
        };
        let text = Metrics::new(Some(build)).render(Some(&RegistryStats::default()));
        let line = "kvferry_build_info{version=\"0.1.0\",revision=\"abc1234\",protocol=\"13\"} 1";
        assert!(text.lines().any(|l| l == line), "{text}");
        assert!(text.contains("kvferry_bootstrap_groups 0"), "{text}");
    }
}
