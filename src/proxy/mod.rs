//! `kvferry proxy`: an OpenAI-compatible router for prefill/decode-disaggregated vLLM servers
//! that run `KvferryConnector` (docs/vllm.md).
//!
//! A request to `/v1/completions` or `/v1/chat/completions` goes to the prefill server with the
//! fewest requests outstanding (one generated token, `kv_transfer_params.do_remote_decode`) and
//! to the decode server with the fewest outstanding, which generates the answer from the
//! prompt's KV that kvferry moved. Three pairings:
//! - first-token (default): the prefill answers first with the token it sampled, which goes to
//!   the client at once; the decode continues from the prompt plus that token
//!   (`first_token.rs`), and requests one engine alone answers exactly go the sequential way;
//! - concurrent: the proxy chooses the room and names the prefill's kvferry group (learned at
//!   start with `kvferry_identify`), and sends both requests at once, so the decode allocates
//!   and waits while the prefill computes;
//! - sequential: the prefill answers first, and its `kv_transfer_params` go into the decode
//!   request.
//!
//! A prompt shorter than `--short-below-tokens` goes to one decode server alone
//! (`one_server.rs`).
//!
//! The decode's answer, streamed or not, is passed through as it comes. Servers that stop
//! answering `/health` are routed around until they answer again. With `--bootstrap`, servers
//! are also found in the registry, where their agents register (`discovery.rs`): found ones
//! join, those no rank names any more leave, a server whose agents say it drains gets no new
//! requests, and a prefill is paired only with decodes that can take its KV. A server that
//! refuses a request because it shuts down (vLLM's drain) or cannot be reached is replaced by
//! another of its role for that request: nothing was done for it there. A decode server lost
//! before its answer began (its connection broke) is replaced the same way, the request sent
//! again with its room, which waits on the prefill for another decode: the prompt is not
//! computed twice. A request that ends before a decode's answer began (the client left, the
//! decode failed) has its prefill server release the room (`unclaimed.rs`). Every error is an OpenAI
//! error object; what it tells the client names servers by role and place (`decode server 2 of
//! 3`) and hides every address (the log has them). With `--api-key`, a client must present the
//! key: a request without it is answered 401 and goes nowhere. Every answer says where its
//! prompt's KV came from (`kv.rs`): landed, or recomputed by the decode and why. Metrics
//! (`/metrics`, `prometheus-client`): requests by endpoint and outcome, answers by where their
//! KV came from, time to the first token of a streamed answer, request duration, errors by
//! cause, and each server's health and requests outstanding.

mod answer;
mod api;
mod backends;
mod discovery;
mod events;
mod failure;
mod first_token;
mod kv;
mod metrics;
mod one_server;
mod redact;
mod refusal;
mod route;
mod unclaimed;

pub use api::router;
pub use backends::{Backend, Backends};
pub use discovery::client as registry_client;
pub use metrics::ProxyMetrics;
pub use route::{Pairing, Proxy};
