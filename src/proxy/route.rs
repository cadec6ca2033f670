//! Routing one request: the prefill and decode servers picked, the prefill's request, the
//! decode's request (sent elsewhere when its server fails before answering). The decode's
//! answer goes to the client in `answer.rs`; the first-token pairing's steps after its prefill
//! answered are in `first_token.rs`; a stream's events are put back together from its chunks
//! in `events.rs`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use serde_json::{Map, Value, json};

use kvferry_bootstrap::RegistryClient;

use super::backends::{Backend, Backends, Lease};
use super::discovery::{self, paired};
use super::failure::{
    Failed, Failure, Server, bad, causes, copy_answer, error, scrubbed, unavailable, unpaired,
    unreachable,
};
use super::first_token::First;
use super::kv::{Alone, Kv};
use super::metrics::{Cause, Endpoint, Outcome, ProxyMetrics, Refuser, SampledBy};
use super::redact::hide_addresses;
use super::refusal::{Decoded, Judged, refused_for_shutdown};
use super::unclaimed::Unclaimed;

/// How a request is paired with its room (docs/vllm.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Pairing {
    /// The proxy names the room and the prefill's group; both requests go at once.
    Concurrent,
    /// The prefill answers first; its `kv_transfer_params` go into the decode request.
    Sequential,
    /// The prefill answers first and the first token it sampled goes to the client at once;
    /// the decode continues from the prompt plus that token (`first_token.rs`). A request that
    /// one engine alone answers exactly (stop strings, penalties on output, guided decoding,
    /// chat, ...) goes the sequential way.
    FirstToken,
}

/// The proxy's state.
pub struct Proxy {
    /// The prefill servers (`--prefill`).
    pub prefills: Arc<Backends>,
    /// The decode servers (`--decode`).
    pub decodes: Arc<Backends>,
    /// How requests are paired with rooms.
    pub pairing: Pairing,
    /// The client every upstream request goes through.
    pub http: reqwest::Client,
    /// What `/metrics` exposes.
    pub metrics: ProxyMetrics,
    /// The key a client must present (`Authorization: Bearer KEY`) on the API routes
    /// (`--api-key`); `None`: no key is checked.
    pub api_key: Option<String>,
    /// The registry the servers' agents register in (`--bootstrap`): each health round finds
    /// servers there, and which of them drain (`discovery.rs`); `None`: only the listed ones.
    pub registry: Option<Arc<RegistryClient>>,
    /// How long a server's health check may take (`--health-timeout-ms`).
    pub health_timeout: std::time::Duration,
    /// Prompts shorter than this many tokens go to one decode server (`one_server.rs`); 0:
    /// none.
    pub short_below: usize,
}

impl Proxy {
    /// The first round, before the proxy listens: the registry read (servers found, forgotten,
    /// draining), then every server's health checked, all at once, to the end.
    pub async fn first_round(&self) {
        let timeout = self.health_timeout;
        if let Some(registry) = &self.registry {
            discovery::look(registry, &self.prefills, &self.decodes).await;
        }
        tokio::join!(
            self.prefills.check_all(&self.http, timeout),
            self.decodes.check_all(&self.http, timeout)
        );
    }

    /// A round every `period`, forever (the first after `period`): the registry read, then a
    /// health check of each server whose last one has ended (`Backends::check_each`), so that
    /// a server slow to answer holds up neither the others nor the registry's word.
    pub async fn watch(self: Arc<Self>, period: std::time::Duration) {
        let timeout = self.health_timeout;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Some(registry) = &self.registry {
                discovery::look(registry, &self.prefills, &self.decodes).await;
            }
            self.prefills.check_each(&self.http, timeout);
            self.decodes.check_each(&self.http, timeout);
        }
    }
}

/// The client's headers that go on to the servers with its request: `Authorization` (servers
/// started with `--api-key` check it) and `X-Request-Id`.
#[derive(Clone, Default)]
pub(super) struct Forwarded(Vec<(header::HeaderName, HeaderValue)>);

impl Forwarded {
    const NAMES: [header::HeaderName; 2] = [
        header::AUTHORIZATION,
        header::HeaderName::from_static("x-request-id"),
    ];

    pub(super) fn of(headers: &HeaderMap) -> Self {
        Forwarded(
            Self::NAMES
                .iter()
                .filter_map(|n| Some((n.clone(), headers.get(n)?.clone())))
                .collect(),
        )
    }

    pub(super) fn onto(&self, mut request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        for (name, value) in &self.0 {
            request = request.header(name.as_str(), value.as_bytes());
        }
        request
    }

    /// The `Authorization` header alone: what a question the proxy asks on a client's
    /// behalf (`kvferry_reason_of`) carries. Not its `X-Request-Id`: vLLM would take it for the
    /// question's request id, the same as the request the question is about.
    pub(super) fn authorization(&self) -> Forwarded {
        let only = self.0.iter().filter(|(n, _)| *n == header::AUTHORIZATION);
        Forwarded(only.cloned().collect())
    }

    /// These headers, and vLLM's `X-data-parallel-rank` naming `dp` if given.
    fn to_rank(&self, dp: Option<usize>) -> Forwarded {
        let mut headers = self.0.clone();
        if let Some(dp) = dp {
            let name = header::HeaderName::from_static(super::backends::DP_RANK_HEADER);
            headers.push((name, HeaderValue::from(dp)));
        }
        Forwarded(headers)
    }
}

/// Fields of a client's request that the prefill's one-token copy must not get: vLLM refuses
/// `min_tokens` above `max_tokens`.
const NOT_FOR_THE_PREFILL: [&str; 1] = ["min_tokens"];

/// How a request to a server (a prefill's, or a question to a server) ended.
pub(super) enum Posted {
    /// Its answer (HTTP 2xx).
    Answered(Value),
    /// It answered an error: a prefill's is passed to the client, addresses hidden.
    Refused(Failure),
    /// Its connection was refused: the request never reached it.
    Unreached(String),
    /// Its connection broke, or its answer was unusable.
    Lost(String),
}

/// Why no prefill and decode server could be paired for a request.
enum NoPair {
    /// No usable server of the role.
    Role(&'static str),
    /// Usable servers of both roles, none of whose pairs can exchange KV: why the first could not.
    Unpaired(String),
}

impl NoPair {
    fn failure(self) -> Failure {
        match self {
            NoPair::Role(role) => unavailable(role),
            NoPair::Unpaired(why) => unpaired(&why),
        }
    }
}

/// How one pairing of a request ended: its answer (or failure), or the prefill server refused
/// it (it shuts down, or could not be reached) and another may take it: what the client gets
/// when none can.
pub(super) enum Attempt {
    Done(Result<(Response, Option<Cause>), Failure>),
    PrefillRefused(Arc<Backend>, Failure),
}

/// A request on its way to the prefill and decode servers of one pairing ([`Proxy::attempt`]):
/// what the steps of its pairing go by.
pub(super) struct Routed<'a> {
    pub(super) path: &'static str,
    /// The client's headers that go on with its request.
    pub(super) forwarded: &'a Forwarded,
    /// The client's request.
    pub(super) request: Map<String, Value>,
    /// Its model (for a question to the decode: [`Failed`]).
    pub(super) model: Value,
    /// The room the proxy named (`kvferry_room`).
    pub(super) room: String,
    pub(super) prefill_server: Server,
    /// The room, released on the prefill server unless a decode's answer began
    /// (`unclaimed.rs`).
    pub(super) unclaimed: Unclaimed,
    pub(super) started: Instant,
}

/// A spawned task aborted when this is dropped (the client went away).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Proxy {
    pub(super) async fn route(
        self: Arc<Self>,
        endpoint: Endpoint,
        path: &'static str,
        forwarded: Forwarded,
        body: Bytes,
    ) -> Response {
        let started = Instant::now();
        match self
            .clone()
            .dispatch(endpoint, path, &forwarded, &body, started)
            .await
        {
            Ok((response, None)) => {
                self.metrics.request(endpoint, Outcome::Answered, None);
                response
            }
            Ok((response, Some(cause))) | Err(Failure { cause, response }) => {
                self.metrics.request(endpoint, Outcome::Error, Some(cause));
                self.metrics.duration(started.elapsed().as_secs_f64());
                response
            }
        }
    }

    /// The decode's answer, and the cause when it is an error. A prefill server that refuses
    /// the request because it shuts down, or cannot be reached, is sent no more requests (until
    /// it restarts, or answers a health check) and the request is paired again without it.
    async fn dispatch(
        self: Arc<Self>,
        endpoint: Endpoint,
        path: &'static str,
        forwarded: &Forwarded,
        body: &[u8],
        started: Instant,
    ) -> Result<(Response, Option<Cause>), Failure> {
        let request: Map<String, Value> = match serde_json::from_slice(body) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(bad("the request body must be a JSON object".into())),
            Err(e) => return Err(bad(format!("the request body is not JSON: {e}"))),
        };
        if let Some(n) = request.get("n").filter(|n| **n != json!(1) && !n.is_null()) {
            return Err(bad(format!(
                "n = {n} is not supported: each choice would need a prefill of its own; send \
                 one request per choice"
            )));
        }
        if self.short_below > 0
            && super::one_server::shorter_than(endpoint, &request, self.short_below)
        {
            return self.alone(path, forwarded, request, started).await;
        }
        let mut refused: Vec<Arc<Backend>> = Vec::new();
        let mut last = None;
        loop {
            let (prefill, decode) = match self.pick_pair(&refused) {
                Ok(pair) => pair,
                // The last refusal says more than "no healthy prefill server".
                Err(none) => return Err(last.unwrap_or_else(|| none.failure())),
            };
            let attempt = self.clone().attempt(
                endpoint,
                path,
                forwarded,
                request.clone(),
                (prefill, decode),
                started,
            );
            match attempt.await {
                Attempt::Done(done) => return done,
                Attempt::PrefillRefused(server, failure) => {
                    self.metrics.rerouted(Refuser::Prefill);
                    refused.push(server);
                    last = Some(failure);
                }
            }
        }
    }

    /// A short prompt's request, answered by one decode server alone (`one_server.rs`).
    async fn alone(
        self: Arc<Self>,
        path: &'static str,
        forwarded: &Forwarded,
        request: Map<String, Value>,
        started: Instant,
    ) -> Result<(Response, Option<Cause>), Failure> {
        let decode = (self.decodes.pick_where(|_| true)).ok_or_else(|| unavailable("decode"))?;
        self.metrics.sampled(SampledBy::OneServer);
        let server = self.decode_server(&decode);
        let url = format!("{}{path}", server.url);
        let sent = forwarded.onto(self.http.post(&url)).json(&request).send();
        let answer = match sent.await {
            Ok(r) => Decoded::judge(r).await.map(Judged::answer),
            Err(e) => Err(e),
        };
        let answer = answer.map_err(|e| unreachable(Cause::Decode, &server, causes(&e)))?;
        let failed = Failed {
            model: request.get("model").cloned().unwrap_or(Value::Null),
            room: Value::Null,
            note: None,
            asking: forwarded.authorization(),
        };
        if !answer.status.is_success() {
            let response = self.decode_error(answer, &server, &failed).await;
            return Ok((response, Some(Cause::Decode)));
        }
        let alone = Some(Kv::Local(Alone::ShortPrompt));
        let response = self.pass_through(answer, decode, started, failed, alone);
        Ok((response.await, None))
    }

    /// A prefill server (not among `refused`) and a decode server that can take its KV
    /// (`discovery::paired`), each the one with the fewest requests outstanding.
    fn pick_pair(&self, refused: &[Arc<Backend>]) -> Result<(Lease, Lease), NoPair> {
        let decodes: Vec<Arc<Backend>> = (self.decodes.all().into_iter())
            .filter(|d| self.decodes.usable(d))
            .collect();
        if decodes.is_empty() {
            return Err(NoPair::Role("decode"));
        }
        let mut why = None;
        let prefill = self.prefills.pick_where(|p| {
            !refused.iter().any(|r| Arc::ptr_eq(r, p))
                && decodes.iter().any(|d| match paired(p, d) {
                    Ok(()) => true,
                    Err(e) => {
                        why.get_or_insert(e);
                        false
                    }
                })
        });
        let Some(prefill) = prefill else {
            return Err(why.map_or(NoPair::Role("prefill"), NoPair::Unpaired));
        };
        let decode = (self.decodes)
            .pick_where(|d| paired(prefill.backend(), d).is_ok())
            .ok_or(NoPair::Role("decode"))?;
        Ok((prefill, decode))
    }

    /// One pairing of a request: its prefill's request and its decode's, by `self.pairing`.
    async fn attempt(
        self: Arc<Self>,
        endpoint: Endpoint,
        path: &'static str,
        forwarded: &Forwarded,
        request: Map<String, Value>,
        (prefill, decode): (Lease, Lease),
        started: Instant,
    ) -> Attempt {
        let mut to_prefill = request.clone();
        to_prefill.insert("max_tokens".into(), json!(1));
        if endpoint == Endpoint::ChatCompletions {
            to_prefill.insert("max_completion_tokens".into(), json!(1));
        }
        to_prefill.insert("stream".into(), json!(false));
        to_prefill.remove("stream_options");
        for field in NOT_FOR_THE_PREFILL {
            to_prefill.remove(field);
        }
        // The first token from the prefill: it samples it as one engine would (no end of
        // sequence before `min_tokens`), and says which it is.
        let continues = self.pairing == Pairing::FirstToken
            && match super::first_token::unsupported(endpoint, &request) {
                None => true,
                Some(why) => {
                    tracing::debug!(%why, "the decode samples the first token");
                    false
                }
            };
        if continues {
            to_prefill.insert("return_token_ids".into(), json!(true));
            if request.get("min_tokens").and_then(Value::as_u64) > Some(0) {
                to_prefill.insert("min_tokens".into(), json!(1));
            }
        }
        let prefill_server = self.prefill_server(&prefill);
        let model = request.get("model").cloned().unwrap_or(Value::Null);
        // The proxy names the room in either pairing: it can have the prefill release it
        // whenever the request ends before a decode's answer began (`unclaimed.rs`).
        let room = match fresh_room() {
            Ok(room) => room.to_string(),
            Err(e) => {
                return Attempt::Done(Err(Failure {
                    cause: Cause::NoServer,
                    response: error(
                        StatusCode::BAD_GATEWAY,
                        "upstream_error",
                        format!("the proxy: no randomness: {e}"),
                    ),
                }));
            }
        };
        let unclaimed = Unclaimed::new(
            self.clone(),
            prefill_server.clone(),
            room.clone(),
            model.clone(),
            forwarded.authorization(),
        );
        let routed = Routed {
            path,
            forwarded,
            request,
            model,
            room,
            prefill_server,
            unclaimed,
            started,
        };
        match self.pairing {
            Pairing::Sequential | Pairing::FirstToken => {
                self.sequential(routed, to_prefill, (prefill, decode), continues)
                    .await
            }
            Pairing::Concurrent => self.concurrent(routed, to_prefill, (prefill, decode)).await,
        }
    }

    /// The sequential pairing, and the first-token one: the prefill answers `to_prefill` first,
    /// and its `kv_transfer_params` go into the decode request; with `continues`, the first
    /// token it sampled goes to the client at once ([`Proxy::first_token`]).
    async fn sequential(
        self: Arc<Self>,
        mut routed: Routed<'_>,
        mut to_prefill: Map<String, Value>,
        (prefill, decode): (Lease, Lease),
        continues: bool,
    ) -> Attempt {
        to_prefill.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "kvferry_room": routed.room}),
        );
        let prefill_server = &routed.prefill_server;
        let posted = self.post(prefill_server, routed.path, &to_prefill, routed.forwarded);
        let answer = match posted.await {
            Posted::Answered(a) if refused_for_shutdown(&a) => {
                routed.unclaimed.claimed();
                return self.prefill_refused(&prefill, prefill_server, "it shuts down", true);
            }
            Posted::Answered(answer) => answer,
            Posted::Refused(f) => {
                routed.unclaimed.claimed();
                return Attempt::Done(Err(f));
            }
            Posted::Unreached(e) => {
                routed.unclaimed.claimed();
                return self.prefill_refused(&prefill, prefill_server, &e, false);
            }
            // It may have computed the room: released when this returns.
            Posted::Lost(e) => {
                return Attempt::Done(Err(unreachable(Cause::Prefill, prefill_server, e)));
            }
        };
        let Some(params) = answer
            .get("kv_transfer_params")
            .cloned()
            .filter(Value::is_object)
        else {
            routed.unclaimed.claimed();
            return Attempt::Done(Err(unreachable(
                Cause::Prefill,
                prefill_server,
                "its answer has no kv_transfer_params: is it running KvferryConnector as kv_producer?",
            )));
        };
        let paired_with = prefill.backend().clone();
        drop(prefill);
        let room = params.get("kvferry_room").cloned().unwrap_or(Value::Null);
        let first = continues
            .then(|| First::read(answer, &routed.request))
            .and_then(|read| {
                read.map_err(|why| tracing::warn!(server = %prefill_server.url, %why, "no first token from the prefill: the decode samples it"))
                    .ok()
            })
            .filter(|first| {
                let partial = first.no_text_yet(&routed.request);
                if partial {
                    tracing::debug!("the prefill's token is no text yet: the decode samples the first token");
                }
                !partial
            });
        if let Some(first) = first {
            let decode = (decode, paired_with);
            return self.first_token(routed, first, params, room, decode).await;
        }
        self.metrics.sampled(SampledBy::Decode);
        routed.request.insert("kv_transfer_params".into(), params);
        let (answer, decode) = self
            .clone()
            .send_decode(
                routed.path,
                routed.request,
                routed.forwarded.clone(),
                decode,
                paired_with,
            )
            .await;
        let failed = Failed {
            model: routed.model,
            room,
            note: None,
            asking: routed.forwarded.authorization(),
        };
        self.pass_on(answer, decode, failed, routed.unclaimed, routed.started)
            .await
    }

    /// The concurrent pairing: the decode's request names the room and the prefill's group,
    /// and goes with `to_prefill`, at once.
    async fn concurrent(
        self: Arc<Self>,
        routed: Routed<'_>,
        mut to_prefill: Map<String, Value>,
        (prefill, decode): (Lease, Lease),
    ) -> Attempt {
        let Routed {
            path,
            forwarded,
            mut request,
            model,
            room,
            prefill_server,
            unclaimed,
            started,
        } = routed;
        // The prefill's engine: a data-parallel rank of the server, in turn.
        let Some(rank) = prefill.backend().next_rank() else {
            unclaimed.claimed();
            return Attempt::Done(Err(unavailable("prefill")));
        };
        let group = rank.group;
        to_prefill.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "kvferry_room": room}),
        );
        request.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_prefill": true, "kvferry_room": room, "kvferry_dp_rank": group}),
        );
        // The decode allocates and waits for the room while the prefill computes it.
        let first_decode = self.decode_server(&decode);
        let send = self.clone().send_decode(
            path,
            request,
            forwarded.clone(),
            decode,
            prefill.backend().clone(),
        );
        // The prefill's request ends with this block, before the decode's answer is read: one
        // still unanswered (the decode failed first) is dropped.
        let (answer, decode, note) = {
            let mut decoding = AbortOnDrop(tokio::spawn(send));
            let to_rank = forwarded.to_rank(rank.dp);
            let prefill_post = self.post(&prefill_server, path, &to_prefill, &to_rank);
            tokio::pin!(prefill_post);
            let mut decoded = None;
            let note = loop {
                tokio::select! {
                    posted = &mut prefill_post => break match posted {
                        Posted::Answered(a) if refused_for_shutdown(&a) => {
                            unclaimed.claimed();
                            return self.prefill_refused(&prefill, &prefill_server, "it shuts down", true);
                        }
                        Posted::Answered(_) => {
                            self.metrics.sampled(SampledBy::Decode);
                            None
                        }
                        Posted::Unreached(e) => {
                            unclaimed.claimed();
                            return self.prefill_refused(&prefill, &prefill_server, &e, false);
                        }
                        // Its room will never come: the decode request is dropped (vLLM
                        // aborts it and its room) and the client gets the prefill's answer.
                        Posted::Refused(f) => {
                            unclaimed.claimed();
                            return Attempt::Done(Err(f));
                        }
                        // Whether the room's KV still arrives is the decode's to find out;
                        // its kv_load_failure_policy decides the answer.
                        Posted::Lost(e) => {
                            tracing::warn!(server = %prefill_server.url, name = %prefill_server.name, room, error = %e, "prefill request lost");
                            Some(format!("the {} failed this request: {}", prefill_server.name, hide_addresses(&e)))
                        }
                    },
                    joined = &mut decoding.0, if decoded.is_none() => {
                        let answer = match joined {
                            Ok(answer) => answer,
                            Err(e) => return Attempt::Done(Err(unreachable(Cause::Decode, &first_decode, e))),
                        };
                        let failed = answer.0.as_ref().map_or(true, |r| !r.status.is_success());
                        decoded = Some(answer);
                        if failed {
                            // The decode will not take the room: the prefill's request is
                            // dropped (vLLM aborts it and its room).
                            break None;
                        }
                    }
                }
            };
            drop(prefill);
            let (answer, decode) = match decoded {
                Some(answer) => answer,
                None => match (&mut decoding.0).await {
                    Ok(answer) => answer,
                    Err(e) => {
                        return Attempt::Done(Err(unreachable(Cause::Decode, &first_decode, e)));
                    }
                },
            };
            (answer, decode, note)
        };
        let failed = Failed {
            model,
            room: Value::String(room),
            note,
            asking: forwarded.authorization(),
        };
        self.pass_on(answer, decode, failed, unclaimed, started)
            .await
    }

    /// The prefill of `lease` refused the request for its shutdown (`drains`), or was not
    /// reached: another may take it (a request in flight to the decode is dropped: vLLM aborts
    /// it and its room).
    fn prefill_refused(&self, lease: &Lease, server: &Server, why: &str, drains: bool) -> Attempt {
        let failure = if drains {
            self.prefills.drained(lease);
            Failure {
                cause: Cause::Prefill,
                response: error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    format!(
                        "the {} shuts down and no other can take the request",
                        server.name
                    ),
                ),
            }
        } else {
            self.prefills.route_around(lease, &why);
            unreachable(Cause::Prefill, server, why)
        };
        tracing::warn!(server = %lease.backend().url, %why, "a prefill server refused a request: paired again without it");
        Attempt::PrefillRefused(lease.backend().clone(), failure)
    }

    /// The decode's answer, once it began: it took the room (`unclaimed` is claimed). When there
    /// is none, or it is an error (explained: [`Proxy::decode_error`]), the attempt's end
    /// instead.
    pub(super) async fn began(
        &self,
        answer: reqwest::Result<Decoded>,
        decode: &Lease,
        failed: &Failed,
        unclaimed: Unclaimed,
    ) -> Result<Decoded, Attempt> {
        let decode_server = self.decode_server(decode);
        let answer = match answer {
            Ok(answer) => answer,
            Err(e) => {
                let failure = unreachable(Cause::Decode, &decode_server, causes(&e));
                return Err(Attempt::Done(Err(failure)));
            }
        };
        if !answer.status.is_success() {
            let response = self.decode_error(answer, &decode_server, failed).await;
            return Err(Attempt::Done(Ok((response, Some(Cause::Decode)))));
        }
        // The decode's answer began: it took the room.
        unclaimed.claimed();
        Ok(answer)
    }

    /// The decode's answer, once it began ([`Proxy::began`]), passed through to the client
    /// ([`Proxy::pass_through`]).
    async fn pass_on(
        self: Arc<Self>,
        answer: reqwest::Result<Decoded>,
        decode: Lease,
        failed: Failed,
        unclaimed: Unclaimed,
        started: Instant,
    ) -> Attempt {
        match self.began(answer, &decode, &failed, unclaimed).await {
            Ok(answer) => {
                let response = self
                    .pass_through(answer, decode, started, failed, None)
                    .await;
                Attempt::Done(Ok((response, None)))
            }
            Err(end) => end,
        }
    }

    /// The decode's request sent to `decode`, or to another decode server that can take the KV
    /// of `prefill` when `decode` refused it: its connection was refused (it is routed around
    /// until a health round finds it back), it answered that it shuts down (it gets no new
    /// requests until it restarts), or it was lost before its answer began: its connection
    /// broke, or it answered an error before any token and fails its health check now (routed
    /// around; once a request: a second lost decode's error is the answer).
    /// Nothing of its own reached the client in any case, and the room waits on the prefill for
    /// the decode that asks (a lost decode's for `--requeue-ms`). The answer, and the server
    /// that gave it.
    pub(super) async fn send_decode(
        self: Arc<Self>,
        path: &'static str,
        request: Map<String, Value>,
        forwarded: Forwarded,
        mut decode: Lease,
        prefill: Arc<Backend>,
    ) -> (reqwest::Result<Decoded>, Lease) {
        let mut tried: Vec<Arc<Backend>> = Vec::new();
        // Decode servers lost with this request: a second is not risked (a request that kills
        // the servers it reaches would take down one after another).
        let mut lost = 0;
        loop {
            let url = format!("{}{path}", decode.backend().url);
            let sent = forwarded
                .onto(self.http.post(&url))
                .json(&request)
                .send()
                .await;
            let refusal = match sent {
                Err(e) if e.is_connect() => {
                    self.decodes.route_around(&decode, &e);
                    Err(e)
                }
                // Its connection broke before an answer began: the server was lost (killed,
                // or its host). Nothing of its own reached the client, and the room waits on
                // the prefill for another decode (`--requeue-ms`).
                Err(e) if !e.is_timeout() && lost == 0 => {
                    lost += 1;
                    self.lost(&decode, &causes(&e));
                    Err(e)
                }
                Err(e) => return (Err(e), decode),
                Ok(r) => match Decoded::judge(r).await {
                    Err(e) if !e.is_timeout() && lost == 0 => {
                        lost += 1;
                        self.lost(&decode, &causes(&e));
                        Err(e)
                    }
                    Err(e) => return (Err(e), decode),
                    Ok(Judged::Answer(answer)) => return (Ok(answer), decode),
                    Ok(Judged::Refused(answer)) => {
                        self.decodes.drained(&decode);
                        Ok(answer)
                    }
                    // An error before any token from a server that fails its health check
                    // now: its engine was lost with the request (vLLM answers one its API
                    // server took as its engine stopped with "EngineCore encountered an
                    // issue"). An error from a healthy server is the request's own.
                    Ok(Judged::Failed(answer)) => {
                        let timeout = self.health_timeout;
                        if lost > 0 || self.decodes.recheck(&self.http, &decode, timeout).await {
                            return (Ok(answer), decode);
                        }
                        lost += 1;
                        self.lost(&decode, "its answer was an error before any token, and it fails its health check");
                        Ok(answer)
                    }
                },
            };
            tried.push(decode.backend().clone());
            let other = self.decodes.pick_where(|d| {
                !tried.iter().any(|t| Arc::ptr_eq(t, d)) && paired(&prefill, d).is_ok()
            });
            match other {
                Some(other) => {
                    tracing::warn!(refused = %decode.backend().url, to = %other.backend().url, "a decode server refused or lost a request: sent to another with its room");
                    self.metrics.rerouted(Refuser::Decode);
                    decode = other;
                }
                None => return (refusal, decode),
            }
        }
    }

    /// A decode server lost a request before its answer began: it is routed around until a
    /// health check finds it back.
    fn lost(&self, decode: &Lease, why: &str) {
        tracing::warn!(server = %decode.backend().url, error = %why, "a decode server was lost before it answered");
        self.decodes.route_around(decode, &why);
    }

    /// The prefill server of `lease`, as the log and a client's answer name it.
    fn prefill_server(&self, lease: &Lease) -> Server {
        Server::of("prefill", lease, &self.prefills)
    }

    /// The decode server of `lease`, as the log and a client's answer name it.
    pub(super) fn decode_server(&self, lease: &Lease) -> Server {
        Server::of("decode", lease, &self.decodes)
    }

    /// A POST of `body` to `path` of `server` with the client's headers (a client's request, or
    /// a question asked on its behalf): never with the proxy's own key.
    pub(super) async fn post(
        &self,
        server: &Server,
        path: &str,
        body: &impl serde::Serialize,
        forwarded: &Forwarded,
    ) -> Posted {
        let url = format!("{}{path}", server.url);
        let r = match forwarded.onto(self.http.post(url)).json(body).send().await {
            Ok(r) => r,
            Err(e) if e.is_connect() => return Posted::Unreached(causes(&e)),
            Err(e) => return Posted::Lost(causes(&e)),
        };
        let status = r.status();
        match r.bytes().await {
            Ok(bytes) if status.is_success() => match serde_json::from_slice(&bytes) {
                Ok(answer) => Posted::Answered(answer),
                Err(e) => Posted::Lost(format!("its answer is not JSON: {e}")),
            },
            Ok(bytes) => Posted::Refused(Failure {
                cause: Cause::Prefill,
                response: copy_answer(
                    status,
                    Bytes::from(scrubbed(status, &bytes, server).to_string()),
                ),
            }),
            Err(e) => Posted::Lost(causes(&e)),
        }
    }
}

/// A random u64 room: rooms of independent proxies collide with probability 2^-64 per pair.
fn fresh_room() -> Result<u64, getrandom::Error> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
