//! The proxy's metrics, on the `prometheus-client` library (`GET /metrics`, OpenMetrics text):
//! counters and histograms of its requests, and gauges of each server as the proxy sees it at
//! the scrape (`kvferry_proxy_backend_*{role, backend}`, `backend` its place in its role's list,
//! from 1, as `x-kvferry-decode` and `/v1/servers` name it: never its address).

use std::fmt;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::backends::Backends;
use super::kv::Kv;

/// Which API a request came to.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`
    Completions,
    /// `/v1/chat/completions`
    ChatCompletions,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// The decode's answer was passed on (whatever its status).
    Answered,
    /// The proxy answered an error of its own or a prefill server's.
    Error,
}

/// Why a request failed.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Cause {
    /// A malformed request body.
    BadRequest,
    /// No usable server of a role.
    NoServer,
    /// The prefill server refused the request or could not be reached (sequential pairing).
    Prefill,
    /// The decode server could not be reached or answered an error status.
    Decode,
}

/// The label value each variant is exported as.
trait LabelName {
    fn name(&self) -> &'static str;
}

impl LabelName for Endpoint {
    fn name(&self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
        }
    }
}

impl LabelName for Outcome {
    fn name(&self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Error => "error",
        }
    }
}

impl LabelName for Cause {
    fn name(&self) -> &'static str {
        match self {
            Cause::BadRequest => "bad_request",
            Cause::NoServer => "no_server",
            Cause::Prefill => "prefill",
            Cause::Decode => "decode",
        }
    }
}

macro_rules! label_value {
    ($($t:ty),*) => {$(
        impl EncodeLabelValue for $t {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), fmt::Error> {
                self.name().encode(encoder)
            }
        }
    )*};
}
label_value!(Endpoint, Outcome, Cause, Refuser, SampledBy);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: Endpoint,
    outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    cause: Cause,
}

/// The role of a server that refused a request the proxy then sent elsewhere.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Refuser {
    /// A prefill server (it shuts down, or could not be reached).
    Prefill,
    /// A decode server (it shuts down, could not be reached, or was lost before it answered).
    Decode,
}

impl LabelName for Refuser {
    fn name(&self) -> &'static str {
        match self {
            Refuser::Prefill => "prefill",
            Refuser::Decode => "decode",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RerouteLabels {
    role: Refuser,
}

/// Which server sampled a request's first token.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum SampledBy {
    /// The prefill server (`--pairing first-token`).
    Prefill,
    /// The decode server (`sequential`, `concurrent`, or a request first-token pairing sends
    /// the sequential way).
    Decode,
    /// One decode server computed the prompt and answered alone (a short prompt).
    OneServer,
}

impl LabelName for SampledBy {
    fn name(&self) -> &'static str {
        match self {
            SampledBy::Prefill => "prefill",
            SampledBy::Decode => "decode",
            SampledBy::OneServer => "one_server",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SampledLabels {
    sampled_by: SampledBy,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvLabels {
    outcome: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    role: &'static str,
    backend: String,
}

/// Every metric of the proxy and the registry that exposes them.
pub struct ProxyMetrics {
    registry: Registry,
    kv: Family<KvLabels, Counter>,
    requests: Family<RequestLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    rerouted: Family<RerouteLabels, Counter>,
    released: Counter,
    sampled: Family<SampledLabels, Counter>,
    first_token: Histogram,
    duration: Histogram,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvferry_proxy");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by endpoint and outcome",
            requests.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register("errors", "Requests that failed, by cause", errors.clone());
        let rerouted = Family::<RerouteLabels, Counter>::default();
        for role in [Refuser::Prefill, Refuser::Decode] {
            drop(rerouted.get_or_create(&RerouteLabels { role }));
        }
        registry.register(
            "rerouted",
            "Requests sent to another server of a role after the first refused them (it shuts down, or could not be reached) or was lost before it answered",
            rerouted.clone(),
        );
        let released = Counter::default();
        registry.register(
            "rooms_released",
            "Rooms a prefill server was asked to release: their request ended before a decode's answer began (the client left, or the decode failed it)",
            released.clone(),
        );
        let sampled = Family::<SampledLabels, Counter>::default();
        for sampled_by in [SampledBy::Prefill, SampledBy::Decode, SampledBy::OneServer] {
            drop(sampled.get_or_create(&SampledLabels { sampled_by }));
        }
        registry.register(
            "first_tokens",
            "Requests sent on, by the server that samples their first token",
            sampled.clone(),
        );
        let first_token = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        registry.register(
            "time_to_first_token_seconds",
            "Streamed requests: from arrival to the first chunk of the answer",
            first_token.clone(),
        );
        let duration = Histogram::new(exponential_buckets(0.005, 2.0, 16));
        registry.register(
            "request_duration_seconds",
            "From a request's arrival to the end of its answer",
            duration.clone(),
        );
        let kv = Family::<KvLabels, Counter>::default();
        for k in Kv::all() {
            drop(kv.get_or_create(&KvLabels {
                outcome: k.outcome(),
                reason: k.reason(),
            }));
        }
        registry.register(
            "kv",
            "Answers by where their prompt's KV came from (landed, cached, recomputed, failed, local, unknown) and why it did not land",
            kv.clone(),
        );
        ProxyMetrics {
            registry,
            kv,
            requests,
            errors,
            rerouted,
            released,
            sampled,
            first_token,
            duration,
        }
    }
}

impl ProxyMetrics {
    /// Counts a request by how it ended, and its cause when it failed.
    pub fn request(&self, endpoint: Endpoint, outcome: Outcome, cause: Option<Cause>) {
        self.requests
            .get_or_create(&RequestLabels { endpoint, outcome })
            .inc();
        if let Some(cause) = cause {
            self.errors.get_or_create(&ErrorLabels { cause }).inc();
        }
    }

    /// Counts a request sent to another server of `role` after one refused it.
    pub fn rerouted(&self, role: Refuser) {
        self.rerouted.get_or_create(&RerouteLabels { role }).inc();
    }

    /// Counts a room a prefill server was asked to release.
    pub fn released(&self) {
        self.released.inc();
    }

    /// Counts a request by the server that samples its first token.
    pub fn sampled(&self, by: SampledBy) {
        self.sampled
            .get_or_create(&SampledLabels { sampled_by: by })
            .inc();
    }

    /// Observes a streamed answer's time to its first chunk.
    pub fn first_token(&self, seconds: f64) {
        self.first_token.observe(seconds);
    }

    /// Observes a request's time to the end of its answer.
    pub fn duration(&self, seconds: f64) {
        self.duration.observe(seconds);
    }

    /// Counts an answer by where its prompt's KV came from.
    pub(super) fn kv(&self, kv: Kv) {
        let labels = KvLabels {
            outcome: kv.outcome(),
            reason: kv.reason(),
        };
        self.kv.get_or_create(&labels).inc();
    }

    /// The text exposition, with the gauges of the servers of each role now.
    pub fn encode(&self, prefills: &Backends, decodes: &Backends) -> String {
        let mut now = Registry::with_prefix("kvferry_proxy");
        let up = Family::<BackendLabels, Gauge>::default();
        let in_flight = Family::<BackendLabels, Gauge>::default();
        for (role, backends) in [("prefill", prefills), ("decode", decodes)] {
            for b in backends.all() {
                let labels = BackendLabels {
                    role,
                    backend: b.place().to_string(),
                };
                up.get_or_create(&labels).set(i64::from(b.healthy()));
                in_flight
                    .get_or_create(&labels)
                    .set(i64::try_from(b.outstanding()).unwrap_or(i64::MAX));
            }
        }
        now.register(
            "backend_up",
            "1 while a server answers its health checks, else 0, by role and place",
            up,
        );
        now.register(
            "backend_in_flight",
            "Requests sent to a server and not answered yet, by role and place",
            in_flight,
        );
        crate::cli::BUILD.encode_all(&[&self.registry, &now])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_snake_case_and_every_metric_is_exposed() {
        let m = ProxyMetrics::default();
        m.request(
            Endpoint::ChatCompletions,
            Outcome::Error,
            Some(Cause::NoServer),
        );
        m.first_token(0.1);
        m.duration(0.2);
        m.rerouted(Refuser::Decode);
        m.released();
        m.kv(Kv::Landed);
        let decodes = Backends::new(&["http://d1".into(), "http://d2".into()], false, None);
        let busy = decodes.all()[1].clone();
        busy.set_healthy(true);
        let _lease = decodes.pick().expect("d2 is healthy");
        let text = m.encode(&Backends::new(&[], false, None), &decodes);
        assert!(text.contains(
            r#"kvferry_proxy_requests_total{endpoint="chat_completions",outcome="error"} 1"#
        ));
        assert!(text.contains(r#"kvferry_proxy_errors_total{cause="no_server"} 1"#));
        assert!(text.contains(r#"kvferry_proxy_rerouted_total{role="decode"} 1"#));
        assert!(text.contains("kvferry_proxy_rooms_released_total 1"));
        assert!(text.contains("kvferry_proxy_time_to_first_token_seconds_count 1"));
        assert!(text.contains("kvferry_proxy_request_duration_seconds_count 1"));
        assert!(text.contains(r#"kvferry_proxy_kv_total{outcome="landed",reason="none"} 1"#));
        // Every outcome and reason is there from the start.
        assert!(
            text.contains(r#"kvferry_proxy_kv_total{outcome="recomputed",reason="peer_dead"} 0"#)
        );
        assert!(
            text.contains(r#"kvferry_proxy_kv_total{outcome="local",reason="short_prompt"} 0"#)
        );
        assert_eq!(
            text.matches("kvferry_proxy_kv_total{").count(),
            Kv::all().count()
        );
        assert!(text.contains(r#"kvferry_proxy_backend_up{role="decode",backend="1"} 0"#));
        assert!(text.contains(r#"kvferry_proxy_backend_up{role="decode",backend="2"} 1"#));
        assert!(text.contains(r#"kvferry_proxy_backend_in_flight{role="decode",backend="1"} 0"#));
        assert!(text.contains(r#"kvferry_proxy_backend_in_flight{role="decode",backend="2"} 1"#));
        assert_eq!(text.matches("# EOF").count(), 1);
        assert!(text.ends_with("# EOF\n"));
    }
}
