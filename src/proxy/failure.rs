//! What a client is told when its request fails, and how servers are named to it: OpenAI error
//! objects (`{"error": {"message", "type", "param", "code"}}`) that name a server by its role
//! and place (`decode server 2 of 3`), every address in them hidden (the log has them whole).
//! A decode's failure is explained: its error answer, or an error event of its stream, names
//! the server, the kvferry room and why the room failed there ([`Failed`]), as the decode's
//! connector answers `kvferry_reason_of` ([`Proxy::ask_room`]: the question that also says
//! where a streamed answer's KV came from, `kv.rs`).

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::backends::{Backends, Lease};
use super::events;
use super::kv::{KV_HEADER, Kv, Unsaid};
use super::metrics::Cause;
use super::redact::hide_addresses;
use super::refusal::Decoded;
use super::route::{Forwarded, Posted, Proxy};

/// A server as the log and a client's answer name it: the log by its URL, a client's answer by
/// its role and its place in `--prefill` or `--decode` (`decode server 2 of 3`), never by an
/// address.
#[derive(Clone, Debug)]
pub(super) struct Server {
    /// Its base URL, for the log and for requests.
    pub(super) url: String,
    /// `decode server 2 of 3`.
    pub(super) name: String,
    /// Its place in its list, from 1 (the `x-kvferry-decode` header of an answer).
    pub(super) place: usize,
}

impl Server {
    pub(super) fn of(role: &str, lease: &Lease, all: &Backends) -> Server {
        let b = lease.backend();
        let name = if b.discovered() {
            format!("{role} server {} (found in the registry)", b.place())
        } else {
            format!("{role} server {} of {}", b.place(), all.listed())
        };
        Server {
            url: b.url.clone(),
            name,
            place: b.place(),
        }
    }
}

/// A request that ends with an error: why, and what the client gets.
pub(super) struct Failure {
    pub(super) cause: Cause,
    pub(super) response: Response,
}

/// An OpenAI error object.
pub(super) fn error(status: StatusCode, kind: &str, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

pub(super) fn bad(message: String) -> Failure {
    Failure {
        cause: Cause::BadRequest,
        response: error(StatusCode::BAD_REQUEST, "invalid_request_error", message),
    }
}

/// No usable prefill server has a usable decode server that can take its KV.
pub(super) fn unpaired(why: &str) -> Failure {
    Failure {
        cause: Cause::NoServer,
        response: error(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!(
                "no healthy decode server can take the KV of a healthy prefill server: {}",
                hide_addresses(why)
            ),
        ),
    }
}

pub(super) fn unavailable(role: &str) -> Failure {
    Failure {
        cause: Cause::NoServer,
        response: error(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("no healthy {role} server"),
        ),
    }
}

/// A server that could not be reached, or whose answer was unusable: 502 naming the server by
/// its role and place, and why, addresses hidden ([`hide_addresses`]); the log has its URL and
/// the whole message.
pub(super) fn unreachable(cause: Cause, server: &Server, why: impl std::fmt::Display) -> Failure {
    let body = upstream(server, why);
    Failure {
        cause,
        response: (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response(),
    }
}

/// The error object of [`unreachable`], logged (an event of a stream that already began).
pub(super) fn upstream(server: &Server, why: impl std::fmt::Display) -> Value {
    let why = why.to_string();
    tracing::warn!(server = %server.url, name = %server.name, error = %why, "upstream request failed");
    let message = format!("{}: {}", server.name, hide_addresses(&why));
    json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": 502}})
}

/// A server's error answer as the client gets it: an OpenAI error object (a body that is not
/// JSON becomes one's message) with every address in its strings hidden. The log has the answer
/// whole when it named an address.
pub(super) fn scrubbed(status: reqwest::StatusCode, bytes: &[u8], server: &Server) -> Value {
    let mut body: Value = serde_json::from_slice(bytes).unwrap_or_else(|_| {
        json!({"error": {"message": String::from_utf8_lossy(bytes), "type": "upstream_error",
                         "param": null, "code": status.as_u16()}})
    });
    scrub(&mut body, server);
    body
}

/// `value` with every address in its strings hidden; the log has it whole if it named one.
pub(super) fn scrub(value: &mut Value, server: &Server) {
    let whole = value.to_string();
    if hide_in_strings(value) {
        tracing::warn!(server = %server.url, name = %server.name, answer = %whole, "an error named addresses: the client's copy has them hidden");
    }
}

/// Hides the addresses in every string of `value`; whether there was one.
fn hide_in_strings(value: &mut Value) -> bool {
    match value {
        Value::String(s) => {
            let hidden = hide_addresses(s);
            let changed = hidden != *s;
            *s = hidden;
            changed
        }
        Value::Array(a) => a.iter_mut().fold(false, |any, v| hide_in_strings(v) | any),
        Value::Object(m) => m
            .values_mut()
            .fold(false, |any, v| hide_in_strings(v) | any),
        _ => false,
    }
}

/// An error and its sources, `: `-separated (reqwest's own message leaves out why a request
/// failed: "connection closed before message completed" is a source).
pub(super) fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text += &format!(": {s}");
        source = s.source();
    }
    text
}

/// An upstream answer copied as it is (status, JSON body).
pub(super) fn copy_answer(status: reqwest::StatusCode, body: Bytes) -> Response {
    let status = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut r = (status, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// What explains a decode's failure of a request: its model (for the question to the decode),
/// its kvferry room, the note on its prefill's side (addresses hidden), and the client's
/// headers the question goes with.
#[derive(Clone)]
pub(super) struct Failed {
    pub(super) model: Value,
    pub(super) room: Value,
    pub(super) note: Option<String>,
    /// The client's `Authorization` ([`Forwarded::authorization`]).
    pub(super) asking: Forwarded,
}

impl Proxy {
    /// The decode's error answer, addresses hidden, its message extended with the decode server,
    /// the kvferry room, why the room failed (asked with `kvferry_reason_of`: vLLM's own message
    /// for a failed KV load is a bare "Internal server error") and what the proxy saw of the
    /// prefill's side.
    pub(super) async fn decode_error(
        &self,
        answer: Decoded,
        decode: &Server,
        failed: &Failed,
    ) -> Response {
        let status = answer.status;
        let (body, kv) = self.decode_error_body(answer, decode, failed).await;
        let mut response = copy_answer(status, Bytes::from(body.to_string()));
        if let Some(kv) = kv {
            response.headers_mut().insert(KV_HEADER, kv.header());
        }
        response
    }

    /// The error object of [`Proxy::decode_error`], and where the request's KV came from when
    /// the decode's connector knows its room (counted).
    pub(super) async fn decode_error_body(
        &self,
        answer: Decoded,
        decode: &Server,
        failed: &Failed,
    ) -> (Value, Option<Kv>) {
        let status = answer.status;
        let bytes = answer.bytes().await;
        let mut body = scrubbed(status, &bytes, decode);
        let (context, kv) = self.context(decode, failed).await;
        if let Some(Value::String(message)) = body.pointer_mut("/error/message") {
            *message = format!("{message} ({context})");
        }
        let kv = kv.filter(|kv| !matches!(kv, Kv::Unknown(_)));
        if let Some(kv) = kv {
            self.metrics.kv(kv);
        }
        (body, kv)
    }

    /// What the decode server's connector says of the request's room (`kvferry_reason_of`,
    /// asked with the client's `Authorization`, waited for up to `--health-timeout-ms`): where
    /// its KV came from, and why the room failed there (`code: message`); `None`: the request
    /// has no room (one server answered it alone).
    pub(super) async fn ask_room(
        &self,
        decode: &Server,
        failed: &Failed,
    ) -> Option<(Kv, Option<String>)> {
        let room = failed.room.as_str()?;
        let ask = json!({"model": failed.model, "prompt": [1], "max_tokens": 1,
                         "kv_transfer_params": {"kvferry_reason_of": room}});
        let asked = self.post(decode, "/v1/completions", &ask, &failed.asking);
        let Ok(Posted::Answered(a)) = tokio::time::timeout(self.health_timeout, asked).await else {
            return Some((Kv::Unknown(Unsaid::Unanswered), None));
        };
        let params = a.get("kv_transfer_params");
        let reason = params.and_then(|p| p.get("kvferry_reason"));
        Some((
            Kv::of_params(params),
            reason.and_then(Value::as_str).map(str::to_owned),
        ))
    }

    /// What the proxy can tell a client about a decode's failure: the decode server (its role
    /// and place), the kvferry room and why it failed there ([`Proxy::ask_room`]), and the note
    /// on the prefill's side, addresses hidden (the log has it whole); and where the request's
    /// KV came from, when it was asked.
    async fn context(&self, decode: &Server, failed: &Failed) -> (String, Option<Kv>) {
        let mut context = decode.name.clone();
        let mut reason = None;
        let mut kv = None;
        if let Some(room) = failed.room.as_str() {
            context += &format!(", kvferry room {room}");
            if let Some((said_kv, said)) = self.ask_room(decode, failed).await {
                kv = Some(said_kv);
                if let Some(said) = said {
                    context += &format!(" failed: {}", hide_addresses(&said));
                    reason = Some(said);
                }
            }
        }
        if let Some(note) = &failed.note {
            context += &format!("; {note}");
        }
        tracing::warn!(
            server = %decode.url,
            name = %decode.name,
            room = %failed.room,
            reason = reason.as_deref().unwrap_or("not known"),
            "a decode server failed a request"
        );
        (context, kv)
    }

    /// Whole events of a decode's stream ([`events::Events`]) with each error event's addresses
    /// hidden and its message extended as [`Proxy::context`] says (vLLM ends a stream whose KV
    /// load failed with a bare "Internal server error" event); other events as they are.
    pub(super) async fn explain_errors(
        &self,
        whole: Bytes,
        decode: &Server,
        failed: &Failed,
    ) -> Bytes {
        // The events are whole, so an error event among them has its `"error":` whole too.
        if !whole.windows(8).any(|w| w == b"\"error\":") {
            return whole;
        }
        let text = String::from_utf8_lossy(&whole);
        let mut out = String::with_capacity(text.len());
        for line in events::lines(&text) {
            match line.event() {
                Some(mut event)
                    if event
                        .pointer("/error/message")
                        .is_some_and(Value::is_string) =>
                {
                    scrub(&mut event, decode);
                    // Where the KV came from goes in the stream once (`answer.rs`).
                    let (context, _) = self.context(decode, failed).await;
                    if let Some(Value::String(message)) = event.pointer_mut("/error/message") {
                        *message = format!("{message} ({context})");
                    }
                    out += &line.with(&event);
                }
                _ => out += line.as_str(),
            }
        }
        Bytes::from(out)
    }
}
