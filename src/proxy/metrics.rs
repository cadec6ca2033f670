//! The proxy's metrics, on the `prometheus-client` library.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Which API a request came to.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Outcome {
    Ok,
    Error,
}

/// Why a request failed.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Cause {
    /// A malformed request body.
    BadRequest,
    /// No healthy server of a role.
    NoServer,
    /// The prefill server failed or answered an error.
    Prefill,
    /// The decode server failed or answered an error.
    Decode,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: Endpoint,
    outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    cause: Cause,
}

/// Every metric of the proxy and the registry that exposes them.
pub struct ProxyMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    first_byte: Histogram,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvferry_proxy");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("requests", "Requests by endpoint and outcome", requests.clone());
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register("errors", "Failed requests by cause", errors.clone());
        let first_byte = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        registry.register(
            "time_to_first_byte_seconds",
            "From a request's arrival to the first byte of the decode's answer (streamed: the first token)",
            first_byte.clone(),
        );
        ProxyMetrics {
            registry,
            requests,
            errors,
            first_byte,
        }
    }
}

impl ProxyMetrics {
    pub fn request(&self, endpoint: Endpoint, outcome: Outcome) {
        self.requests
            .get_or_create(&RequestLabels { endpoint, outcome })
            .inc();
    }

    pub fn error(&self, cause: Cause) {
        self.errors.get_or_create(&ErrorLabels { cause }).inc();
    }

    /// Observes a time to first byte, from a task of its own (an answer's stream).
    pub fn first_byte_observer(&self) -> impl Fn(f64) + Send + Sync + 'static {
        let h = self.first_byte.clone();
        move |seconds| h.observe(seconds)
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
