//! A decode's answer on its way to the client: passed through as it streams, whole events at a
//! time, its error events explained and a broken stream ended with one, the decode's lease held
//! until the answer ends; the continuation of a first token that went already rewrites the
//! decode's events (`first_token.rs`). Where the answer's KV came from (`kv.rs`) goes in the
//! `x-kvferry-kv` header when it is known before the answer goes: said by the route (one server
//! alone), or by the decode's whole answer when it is not streamed. A stream's headers go
//! before the decode knows: once its first event came (the decode's KV landed or was
//! recomputed by then), the decode is asked ([`Proxy::ask_room`]), and the answer goes in the
//! stream as an SSE comment line (`: x-kvferry-kv: landed`) between two events, at the latest
//! before `data: [DONE]`, which waits for it up to `--health-timeout-ms`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::json;

use super::backends::Lease;
use super::events::{self, Events};
use super::failure::{Failed, Server, causes};
use super::first_token::Continuation;
use super::kv::{KV_HEADER, Kv, Unsaid};
use super::redact::hide_addresses;
use super::refusal::Decoded;
use super::route::Proxy;

impl Proxy {
    /// The decode's answer as it streams, its lease held until the end; an error event in it
    /// is explained ([`Proxy::explain_errors`]), a broken stream ends with one. `kv`: where its
    /// KV came from, when the route knows (one server alone); else the decode's answer says it
    /// (a stream in the stream).
    pub(super) async fn pass_through(
        self: Arc<Self>,
        answer: Decoded,
        decode: Lease,
        started: Instant,
        failed: Failed,
        kv: Option<Kv>,
    ) -> Response {
        let status =
            StatusCode::from_u16(answer.status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = answer.content_type.clone();
        let named = HeaderValue::from(self.decode_server(&decode).place);
        let (answer, kv) = match kv {
            Some(kv) => (answer, Some(kv)),
            None if !answer.streamed() => {
                let status = answer.status;
                let content_type = answer.content_type.clone();
                // Read whole already ([`Decoded::judge`]).
                let bytes = answer.bytes().await;
                let kv = Kv::of_answer(&bytes);
                let body = futures_util::stream::once(async { Ok(bytes) }).boxed();
                let answer = Decoded {
                    status,
                    content_type,
                    body,
                };
                (answer, Some(kv))
            }
            None => (answer, None),
        };
        if let Some(kv) = kv {
            self.metrics.kv(kv);
        }
        let stream = self.passing(answer, decode, started, failed, None, kv.is_none());
        let mut response = Response::new(Body::from_stream(stream));
        *response.status_mut() = status;
        if let Some(ct) = content_type.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        response.headers_mut().insert(DECODE_HEADER, named);
        if let Some(kv) = kv {
            response.headers_mut().insert(KV_HEADER, kv.header());
        }
        response
    }

    /// The body of [`Proxy::pass_through`]; with a `continuation`, the decode's events continue a
    /// first token that went already (`first_token.rs`); with `ask`, a stream says where its KV
    /// came from once the decode answers the question its first event sends.
    pub(super) fn passing(
        self: Arc<Self>,
        answer: Decoded,
        decode: Lease,
        started: Instant,
        failed: Failed,
        continuation: Option<Continuation>,
        ask: bool,
    ) -> futures_util::stream::BoxStream<'static, reqwest::Result<Bytes>> {
        let streamed = answer.streamed();
        let server = self.decode_server(&decode);
        let passing = Passing {
            body: answer.body,
            streamed,
            first: streamed && continuation.is_none(),
            events: Events::default(),
            continuation,
            broken: false,
            kv: match streamed && ask {
                true => Said::ToAsk,
                false => Said::Nothing,
            },
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
    /// Where the answer's KV came from, as the stream says it.
    kv: Said,
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
            if matches!(self.kv, Said::ToAsk) && chunk.is_ok() {
                self.kv = Said::Asking(self.ask());
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
        let whole = proxy
            .explain_errors(whole, &self.server, &self.failed)
            .await;
        self.say_kv(whole).await
    }

    /// The question where the answer's KV came from, asked in a task of its own (counted when
    /// answered, whether the client stayed or not); its answer on the receiver.
    fn ask(&self) -> tokio::sync::oneshot::Receiver<Kv> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (proxy, server, failed) = (
            self.done.proxy.clone(),
            self.server.clone(),
            self.failed.clone(),
        );
        tokio::spawn(async move {
            let asked = proxy.ask_room(&server, &failed).await;
            let kv = asked.map_or(Kv::Unknown(Unsaid::NotKnown), |(kv, _)| kv);
            proxy.metrics.kv(kv);
            let _ = tx.send(kv);
        });
        rx
    }

    /// Whole events with the comment that says where the KV came from before them once the
    /// decode answered, or before their `data: [DONE]`, which waits for the answer.
    async fn say_kv(&mut self, whole: Bytes) -> Bytes {
        let Said::Asking(asking) = &mut self.kv else {
            return whole;
        };
        let text = String::from_utf8_lossy(&whole);
        let done = events::lines(&text).position(|l| l.as_str().trim_end() == "data: [DONE]");
        let kv = match done {
            Some(_) => {
                let bound = self.done.proxy.health_timeout;
                tokio::time::timeout(bound, asking)
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
            None => asking.try_recv().ok(),
        };
        if kv.is_none() && done.is_none() {
            return whole;
        }
        // Said now, or never (the stream ends).
        self.kv = Said::Nothing;
        let Some(kv) = kv else {
            return whole;
        };
        // Before the events, or before their `data: [DONE]`.
        let at = done.unwrap_or(0);
        let mut out = String::with_capacity(text.len() + 64);
        for (i, line) in events::lines(&text).enumerate() {
            if i == at {
                out += &kv.comment();
            }
            out += line.as_str();
        }
        Bytes::from(out)
    }
}

/// What a stream says of where its KV came from.
enum Said {
    /// Nothing (not a stream, or the header said it).
    Nothing,
    /// It asks the decode once its first event came.
    ToAsk,
    /// It asked: the answer comes on this.
    Asking(tokio::sync::oneshot::Receiver<Kv>),
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
    use axum::routing::{get, post};
    use serde_json::Value;

    /// A proxy with one decode server, and a lease of it: a local server that answers
    /// `/health`, and any completion as a decode's connector answers `kvferry_reason_of` for a
    /// room that failed its checksum and was recomputed.
    async fn proxy_with_a_decode() -> (Arc<Proxy>, Lease) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let said = json!({"choices": [], "kv_transfer_params": {"kvferry_room": "9",
                          "kvferry_kv": "recomputed", "kvferry_reason": "checksum: chunk 1"}});
        let decode = Router::new()
            .route("/health", get(|| async { StatusCode::OK }))
            .route(
                "/v1/completions",
                post(move || async move { axum::Json(said) }),
            );
        tokio::spawn(async move { axum::serve(listener, decode).await });
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
        let passed = proxy.passing(answer, decode, Instant::now(), failed, None, false);
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

    fn failed(room: Value) -> Failed {
        Failed {
            model: json!("m"),
            room,
            note: None,
            asking: Forwarded::default(),
        }
    }

    fn counted(proxy: &Proxy, outcome: &str, reason: &str) -> bool {
        let text = proxy.metrics.encode(&proxy.prefills, &proxy.decodes);
        text.contains(&format!(
            "kvferry_proxy_kv_total{{outcome=\"{outcome}\",reason=\"{reason}\"}} 1\n"
        ))
    }

    #[tokio::test]
    async fn a_stream_says_where_its_kv_came_from_before_its_end() {
        let (proxy, decode) = proxy_with_a_decode().await;
        let token = json!({"id": "cmpl-d", "choices": [{"index": 0, "text": "a"}]});
        let stream = format!("data: {token}\n\ndata: [DONE]\n\n");
        let answer = Decoded {
            status: reqwest::StatusCode::OK,
            content_type: Some(reqwest::header::HeaderValue::from_static(
                "text/event-stream",
            )),
            body: futures_util::stream::iter([Ok(Bytes::from(stream))]).boxed(),
        };
        let passed = (proxy.clone()).passing(
            answer,
            decode,
            Instant::now(),
            failed(json!("9")),
            None,
            true,
        );
        let chunks: Vec<Bytes> = passed.map(Result::unwrap).collect().await;
        let out = String::from_utf8(chunks.concat()).unwrap();
        let said = ": x-kvferry-kv: recomputed; reason=checksum\n\n";
        assert_eq!(out, format!("data: {token}\n\n{said}data: [DONE]\n\n"));
        assert!(counted(&proxy, "recomputed", "checksum"));
    }

    #[tokio::test]
    async fn a_whole_answer_says_it_in_its_header_and_a_route_that_knows_overrides() {
        let (proxy, decode) = proxy_with_a_decode().await;
        let whole = |params: Value| Decoded {
            status: reqwest::StatusCode::OK,
            content_type: Some(reqwest::header::HeaderValue::from_static(
                "application/json",
            )),
            body: futures_util::stream::iter([Ok(Bytes::from(
                json!({"choices": [], "kv_transfer_params": params}).to_string(),
            ))])
            .boxed(),
        };
        let landed = whole(json!({"kvferry_room": "9", "kvferry_kv": "landed"}));
        let p = proxy.clone();
        let r = p.pass_through(landed, decode, Instant::now(), failed(json!("9")), None);
        assert_eq!(r.await.headers()[KV_HEADER], "landed");
        assert!(counted(&proxy, "landed", "none"));
        // A short prompt's server answers without kvferry's params: it is the route's word.
        let decode = proxy.decodes.pick().unwrap();
        let alone = Some(Kv::Local(super::super::kv::Alone::ShortPrompt));
        let p = proxy.clone();
        let r = p.pass_through(
            whole(Value::Null),
            decode,
            Instant::now(),
            failed(Value::Null),
            alone,
        );
        assert_eq!(r.await.headers()[KV_HEADER], "local; reason=short_prompt");
        assert!(counted(&proxy, "local", "short_prompt"));
        assert!(!counted(&proxy, "recomputed", "no_connector"));
    }
}
