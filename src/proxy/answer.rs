//! A decode's answer on its way to the client: passed through as it streams, whole events at a
//! time, its error events explained and a broken stream ended with one, the decode's lease held
//! until the answer ends; the continuation of a first token that went already rewrites the
//! decode's events (`first_token.rs`).

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::json;

use super::backends::Lease;
use super::events::Events;
use super::failure::{Failed, Server, causes};
use super::first_token::Continuation;
use super::redact::hide_addresses;
use super::refusal::Decoded;
use super::route::Proxy;

impl Proxy {
    /// The decode's answer as it streams, its lease held until the end; an error event in it
    /// is explained ([`Proxy::explain_errors`]), a broken stream ends with one.
    pub(super) fn pass_through(
        self: Arc<Self>,
        answer: Decoded,
        decode: Lease,
        started: Instant,
        failed: Failed,
    ) -> Response {
        let status =
            StatusCode::from_u16(answer.status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = answer.content_type.clone();
        let named = HeaderValue::from(self.decode_server(&decode).place);
        let stream = self.passing(answer, decode, started, failed, None);
        let mut response = Response::new(Body::from_stream(stream));
        *response.status_mut() = status;
        if let Some(ct) = content_type.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        response.headers_mut().insert(DECODE_HEADER, named);
        response
    }

    /// The body of [`Proxy::pass_through`]; with a `continuation`, the decode's events continue a
    /// first token that went already (`first_token.rs`).
    pub(super) fn passing(
        self: Arc<Self>,
        answer: Decoded,
        decode: Lease,
        started: Instant,
        failed: Failed,
        continuation: Option<Continuation>,
    ) -> futures_util::stream::BoxStream<'static, reqwest::Result<Bytes>> {
        let streamed = (answer.content_type.as_ref())
            .is_some_and(|ct| ct.as_bytes().starts_with(b"text/event-stream"));
        let server = self.decode_server(&decode);
        let passing = Passing {
            body: answer.body,
            streamed,
            first: streamed && continuation.is_none(),
            events: Events::default(),
            continuation,
            broken: false,
            server,
            failed,
            done: Done {
                proxy: self,
                started,
                _decode: decode,
            },
        };
        let next = |mut p: Passing| async move { p.next().await.map(|chunk| (chunk, p)) };
        futures_util::stream::unfold(passing, next).boxed()
    }
}

/// An answer that is an event stream (`text/event-stream`).
pub(super) fn event_stream(body: Body) -> Response {
    let mut response = Response::new(body);
    (response.headers_mut()).insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
}

/// The header of an answer that names the decode server that gave it: its place in `--decode`,
/// from 1 (not its address).
pub(super) const DECODE_HEADER: &str = "x-kvferry-decode";

/// A decode's answer on its way to the client.
struct Passing {
    body: futures_util::stream::BoxStream<'static, reqwest::Result<Bytes>>,
    /// An event stream (`text/event-stream`).
    streamed: bool,
    /// No chunk went yet (the time to the first is observed for a stream).
    first: bool,
    /// A stream's events put back together: one may end in a later chunk than it began in.
    events: Events,
    /// The decode's events continue a first token that went already.
    continuation: Option<Continuation>,
    /// The stream broke: its error event went, nothing follows.
    broken: bool,
    server: Server,
    failed: Failed,
    done: Done,
}

impl Passing {
    /// What goes to the client next: a stream's whole events as [`Passing::relay`] has them
    /// (an event that a chunk ends inside waits for the rest of it), another answer's chunks as
    /// they come.
    async fn next(&mut self) -> Option<reqwest::Result<Bytes>> {
        if self.broken {
            return None;
        }
        loop {
            let Some(chunk) = self.body.next().await else {
                // What a stream held back of an unfinished event.
                let rest = self.events.rest()?;
                self.broken = true;
                return Some(Ok(self.relay(rest).await));
            };
            if std::mem::take(&mut self.first) {
                let elapsed = self.done.started.elapsed().as_secs_f64();
                self.done.proxy.metrics.first_token(elapsed);
            }
            return Some(match chunk {
                // A stream that breaks ends with an error event the client can read (an OpenAI
                // error object, as vLLM sends one mid-stream), not with a cut connection. An
                // event it broke inside is dropped: it can never end.
                Err(e) if self.streamed => {
                    self.broken = true;
                    let why = causes(&e);
                    tracing::warn!(server = %self.server.url, name = %self.server.name, error = %why, "a decode server's stream broke");
                    let message = format!(
                        "{} failed mid-answer: {}",
                        self.server.name,
                        hide_addresses(&why)
                    );
                    let event = json!({"error": {"message": message, "type": "upstream_error",
                                                 "param": null, "code": 502}});
                    Ok(Bytes::from(format!("data: {event}\n\n")))
                }
                Ok(bytes) if self.streamed => match self.events.feed(bytes) {
                    Some(whole) => Ok(self.relay(whole).await),
                    None => continue,
                },
                chunk => chunk,
            });
        }
    }

    /// A stream's whole events as the client gets them: the continuation of a first token that
    /// went already (`first_token.rs`), each error event explained ([`Proxy::explain_errors`]).
    /// (`&mut`: the stream's future that holds it across an await must be `Send`, and the body
    /// is not `Sync`.)
    async fn relay(&mut self, whole: Bytes) -> Bytes {
        let whole = match &self.continuation {
            Some(c) => c.rewrite_events(&whole),
            None => whole,
        };
        let proxy = &self.done.proxy;
        proxy
            .explain_errors(whole, &self.server, &self.failed)
            .await
    }
}

/// Held by an answer's stream: when it ends (or the client leaves), the decode's request
/// stops counting and the request's duration is observed.
struct Done {
    proxy: Arc<Proxy>,
    started: Instant,
    _decode: Lease,
}

impl Drop for Done {
    fn drop(&mut self) {
        self.proxy
            .metrics
            .duration(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::backends::Backends;
    use crate::proxy::metrics::ProxyMetrics;
    use crate::proxy::route::{Forwarded, Pairing};
    use axum::Router;
    use axum::routing::get;
    use serde_json::Value;

    /// A proxy with one decode server, and a lease of it: a local server that answers
    /// `/health`, and nothing else.
    async fn proxy_with_a_decode() -> (Arc<Proxy>, Lease) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let health = Router::new().route("/health", get(|| async { StatusCode::OK }));
        tokio::spawn(async move { axum::serve(listener, health).await });
        let proxy = Arc::new(Proxy {
            prefills: Arc::new(Backends::new(&[], false, None)),
            decodes: Arc::new(Backends::new(&[url], false, None)),
            pairing: Pairing::Sequential,
            http: kvferry_wire::http::client().build().unwrap(),
            metrics: ProxyMetrics::default(),
            api_key: None,
            registry: None,
            health_timeout: std::time::Duration::from_secs(10),
            short_below: 0,
        });
        proxy.first_round().await;
        let decode = proxy.decodes.pick().expect("the decode server is healthy");
        (proxy, decode)
    }

    #[tokio::test]
    async fn an_error_event_split_across_chunks_is_explained() {
        let (proxy, decode) = proxy_with_a_decode().await;
        let token = json!({"id": "cmpl-d", "choices": [{"index": 0, "text": "a"}]});
        let error = json!({"error": {"message": "Internal server error", "type": "InternalServerError",
                                     "param": null, "code": 500}});
        let stream = format!("data: {token}\n\ndata: {error}\n\ndata: [DONE]\n\n");
        // Neither chunk has `"error":` whole, nor the error event.
        let at = stream.find("\"error\":").unwrap() + 4;
        let chunks =
            [&stream[..at], &stream[at..]].map(|c| Ok(Bytes::copy_from_slice(c.as_bytes())));
        let answer = Decoded {
            status: reqwest::StatusCode::OK,
            content_type: Some(reqwest::header::HeaderValue::from_static(
                "text/event-stream",
            )),
            body: futures_util::stream::iter(chunks).boxed(),
        };
        let failed = Failed {
            model: json!("m"),
            room: Value::Null,
            note: Some("the prefill's note".into()),
            asking: Forwarded::default(),
        };
        let passed = proxy.passing(answer, decode, Instant::now(), failed, None);
        let chunks: Vec<Bytes> = passed.map(Result::unwrap).collect().await;
        let out = String::from_utf8(chunks.concat()).unwrap();
        let events: Vec<&str> = out.split("\n\n").filter(|e| !e.is_empty()).collect();
        let parse =
            |e: &str| serde_json::from_str::<Value>(e.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(events.len(), 3, "{out}");
        assert_eq!(parse(events[0]), token);
        assert_eq!(
            parse(events[1])["error"]["message"],
            "Internal server error (decode server 1 of 1; the prefill's note)"
        );
        assert_eq!(events[2], "data: [DONE]");
    }
}
