//! The proxy's HTTP surface: the OpenAI routes (behind [`authorize`] when `--api-key` is
//! given), `/v1/models` from a decode server, the health routes (`/health`, which vLLM's
//! clients probe, and `/healthz`), `/v1/servers`, `/metrics`, and what the metrics port asks
//! of the proxy. Each request's routing is in `route.rs`.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use super::backends::Backends;
use super::failure::{causes, copy_answer, error, scrubbed, unavailable, unreachable};
use super::metrics::{Cause, Endpoint};
use super::route::{Forwarded, Proxy};
use crate::protocol::constant_time_eq;

/// The proxy's routes: the API's behind [`authorize`], `/health` (which vLLM's clients probe),
/// `/healthz` (the same, by every role's name) and `/metrics` open.
pub fn router(proxy: Arc<Proxy>) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(
            proxy.clone(),
            authorize,
        ));
    Router::new()
        .merge(api)
        .route(
            "/v1/servers",
            get(servers).route_layer(axum::middleware::from_fn_with_state(
                proxy.clone(),
                authorize,
            )),
        )
        .route("/health", get(health))
        .route("/healthz", get(health))
        .route("/metrics", get(metrics))
        .with_state(proxy)
}

/// With `--api-key`, a request to the API must carry `Authorization: Bearer KEY` (the key
/// compared in constant time): any other is answered 401 before its body is read, so no server
/// hears of it, nor gets a call of the proxy's on its account.
async fn authorize(State(p): State<Arc<Proxy>>, request: Request, next: Next) -> Response {
    let Some(key) = p.api_key.as_deref() else {
        return next.run(request).await;
    };
    let presented = request.headers().get(header::AUTHORIZATION);
    let why = match presented.map(|v| v.as_bytes().strip_prefix(b"Bearer ")) {
        Some(Some(k)) if constant_time_eq(k, key.as_bytes()) => {
            return next.run(request).await;
        }
        Some(Some(_)) => "wrong API key",
        Some(None) => "the Authorization header is not of the form `Bearer <key>`",
        None => {
            "missing Authorization header: this proxy needs `Authorization: Bearer <key>` on \
             /v1/completions, /v1/chat/completions and /v1/models"
        }
    };
    tracing::debug!(
        path = request.uri().path(),
        why,
        "a request without the API key refused"
    );
    let mut r = error(StatusCode::UNAUTHORIZED, "authentication_error", why.into());
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

async fn completions(State(p): State<Arc<Proxy>>, headers: HeaderMap, body: Bytes) -> Response {
    let forwarded = Forwarded::of(&headers);
    p.route(Endpoint::Completions, "/v1/completions", forwarded, body)
        .await
}

async fn chat_completions(
    State(p): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let forwarded = Forwarded::of(&headers);
    p.route(
        Endpoint::ChatCompletions,
        "/v1/chat/completions",
        forwarded,
        body,
    )
    .await
}

/// A decode server's `/v1/models`, asked with the client's headers.
async fn models(State(p): State<Arc<Proxy>>, headers: HeaderMap) -> Response {
    let Some(decode) = p.decodes.pick() else {
        return unavailable("decode").response;
    };
    let server = p.decode_server(&decode);
    let url = format!("{}/v1/models", server.url);
    let asked = Forwarded::of(&headers).onto(p.http.get(&url)).send().await;
    match asked {
        Ok(r) => {
            let status = r.status();
            match r.bytes().await {
                Ok(bytes) if status.is_success() => copy_answer(status, bytes),
                Ok(bytes) => {
                    let body = scrubbed(status, &bytes, &server);
                    copy_answer(status, Bytes::from(body.to_string()))
                }
                Err(e) => unreachable(Cause::Decode, &server, causes(&e)).response,
            }
        }
        Err(e) => unreachable(Cause::Decode, &server, causes(&e)).response,
    }
}

impl Proxy {
    /// The role the proxy has no usable server of (`prefill` first), or `None` when it can
    /// answer a request: at least one prefill and one decode server are usable.
    pub fn lacks(&self) -> Option<&'static str> {
        match (self.prefills.any_usable(), self.decodes.any_usable()) {
            (true, true) => None,
            (false, _) => Some("prefill"),
            (_, false) => Some("decode"),
        }
    }
}

/// `/health` and `/healthz`: 200 while the proxy can answer a request ([`Proxy::lacks`]).
async fn health(State(p): State<Arc<Proxy>>) -> Response {
    match p.lacks() {
        None => StatusCode::OK.into_response(),
        Some(role) => unavailable(role).response,
    }
}

/// The proxy's metrics port: ready while it can answer a request, as `/health` says.
impl kvferry_wire::metrics_port::Watched for Proxy {
    async fn metrics(&self) -> Result<String, String> {
        Ok(self.metrics.encode(&self.prefills, &self.decodes))
    }

    async fn ready(&self) -> Result<(), String> {
        match self.lacks() {
            None => Ok(()),
            Some(role) => Err(format!("no usable {role} server")),
        }
    }
}

/// `GET /v1/servers`: every server of each role as the proxy sees it now: its place, URL,
/// whether it was found in the registry, is healthy, drains, its requests outstanding and
/// routed, its kvferry groups, and what its agents registered (engine, model, why it pairs
/// with nobody).
async fn servers(State(p): State<Arc<Proxy>>) -> axum::Json<Value> {
    let list = |backends: &Backends| -> Vec<Value> {
        backends
            .all()
            .iter()
            .map(|b| {
                let r = b.registration();
                json!({
                    "place": b.place(), "url": b.url, "discovered": b.discovered(),
                    "healthy": b.healthy(), "draining": b.draining(), "usable": backends.usable(b),
                    "outstanding": b.outstanding(), "routed": b.routed(), "groups": b.groups(),
                    "engine": r.as_ref().and_then(|r| r.about.engine.clone()),
                    "model": r.as_ref().and_then(|r| r.about.model.clone()),
                })
            })
            .collect()
    };
    axum::Json(json!({"prefill": list(&p.prefills), "decode": list(&p.decodes)}))
}

async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    let mut r = p.metrics.encode(&p.prefills, &p.decodes).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(kvferry_wire::http::OPENMETRICS_CONTENT_TYPE),
    );
    r
}
