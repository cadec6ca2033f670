//! What a client is told when its request fails, and how servers are named to it: OpenAI error
//! objects (`{"error": {"message", "type", "param", "code"}}`) that name a server by its role
//! and place (`decode server 2 of 3`), every address in them hidden (the log has them whole).

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::backends::{Backends, Lease};
use super::metrics::Cause;
use super::redact::hide_addresses;

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
