//! The proxy's metrics, on the `prometheus-client` library (`GET /metrics`, OpenMetrics text).

use std::fmt;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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

/// Every metric of the proxy and the registry that exposes them.
pub struct ProxyMetrics {
    registry: Registry,
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
        ProxyMetrics {
            registry,
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

    /// The text exposition.
    pub fn encode(&self) -> String {
        crate::cli::BUILD.encode(&self.registry)
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
        let text = m.encode();
        assert!(text.contains(
            r#"kvferry_proxy_requests_total{endpoint="chat_completions",outcome="error"} 1"#
        ));
        assert!(text.contains(r#"kvferry_proxy_errors_total{cause="no_server"} 1"#));
        assert!(text.contains(r#"kvferry_proxy_rerouted_total{role="decode"} 1"#));
        assert!(text.contains("kvferry_proxy_rooms_released_total 1"));
        assert!(text.contains("kvferry_proxy_time_to_first_token_seconds_count 1"));
        assert!(text.contains("kvferry_proxy_request_duration_seconds_count 1"));
    }
}
