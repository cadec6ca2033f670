//! The client's first token from the prefill (`--pairing first-token`). The prefill computes
//! the prompt and samples the first token as a single engine would, and the proxy sends it to
//! the client at once; a decode then continues from the prompt plus that token, its KV from
//! the room (it computes only the new token: `kvferry_continues`), so every later token is the
//! one a single engine would produce next and the prefill computes with no decode stepping
//! beside it for the request. The pieces of one answer come from two servers: this file joins
//! them into what one engine would have answered (one id, the prompt's own token count, text
//! offsets of the whole answer). The proxy's steps after such a prefill answered are here too
//! ([`Proxy::first_token`]): the answer the first token ends, the decode's request, the stream
//! whose first event goes at once, the whole answer joined.
//!
//! What the join cannot make exact goes the sequential way instead ([`unsupported`]): stop
//! strings and bad words (one may span the first two tokens), presence and frequency
//! penalties (they count the first token as output, the decode as prompt), guided decoding
//! (the grammar would start again at the second token), `echo`, `suffix`, prompt logprobs,
//! several prompts or choices, and chat completions.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Map, Value, json};

use super::answer::{DECODE_HEADER, event_stream};
use super::backends::{Backend, Lease};
use super::events;
use super::failure::{Failed, causes, copy_answer, upstream};
use super::kv::{Alone, KV_HEADER, Kv};
use super::metrics::{Endpoint, SampledBy};
use super::refusal::Decoded;
use super::route::{Attempt, Proxy, Routed};
use super::unclaimed::Unclaimed;

/// The decode request's `kv_transfer_params` field that says its prompt is the room's plus
/// the first token the prefill sampled.
pub(super) const CONTINUES: &str = "kvferry_continues";

/// Why `request` cannot take its first token from the prefill (it goes the sequential way),
/// or `None`.
pub(super) fn unsupported(endpoint: Endpoint, request: &Map<String, Value>) -> Option<String> {
    if endpoint == Endpoint::ChatCompletions {
        return Some("a chat completion".into());
    }
    let set = |v: &Value| match v {
        Value::Null | Value::Bool(false) => false,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::Bool(true) => true,
    };
    const EXACT_ONLY_ON_ONE_ENGINE: [&str; 15] = [
        "echo",
        "suffix",
        "prompt_logprobs",
        "stop",
        "bad_words",
        "presence_penalty",
        "frequency_penalty",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "response_format",
        "truncate_prompt_tokens",
        "prompt_embeds",
    ];
    if let Some(field) = EXACT_ONLY_ON_ONE_ENGINE
        .iter()
        .find(|f| request.get(**f).is_some_and(set))
    {
        return Some(format!("`{field}`"));
    }
    // `n` above 1 never gets here: the proxy refuses it first (a prefill per choice).
    if request.get("best_of").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return Some("`best_of` above 1".into());
    }
    if request.get("max_tokens").and_then(Value::as_u64) == Some(0) {
        return Some("`max_tokens` 0".into());
    }
    match request.get("prompt") {
        Some(Value::String(_)) => None,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|t| t.is_u64()) => None,
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(_) => None,
            Value::Array(t) if !t.is_empty() && t.iter().all(Value::is_u64) => None,
            _ => Some("a prompt that is neither text nor token ids".into()),
        },
        _ => Some("several prompts, or a prompt that is neither text nor token ids".into()),
    }
}

/// The prefill's answer with the first token (asked for with `return_token_ids`).
pub(super) struct First {
    /// The prefill's answer (`text_completion`, one choice).
    answer: Value,
    /// The first token's id.
    token: Value,
    /// The prompt's token ids, as the prefill's engine read it.
    prompt: Vec<Value>,
    /// Where the text offsets of the decode's logprobs start: after the first token's text.
    shift: u64,
    /// The client asked for token ids (`return_token_ids`).
    ids: bool,
}

impl First {
    /// The prefill's answer read; an error says what it lacks.
    pub(super) fn read(answer: Value, request: &Map<String, Value>) -> Result<First, String> {
        let choice = match answer.pointer("/choices").and_then(Value::as_array) {
            Some(choices) if choices.len() == 1 => &choices[0],
            _ => return Err("its answer has not exactly one choice".into()),
        };
        let token = match choice.get("token_ids").and_then(Value::as_array) {
            Some(ids) if ids.len() == 1 && ids[0].is_u64() => ids[0].clone(),
            _ => return Err("its answer has not one token id (return_token_ids)".into()),
        };
        let prompt = match choice.get("prompt_token_ids").and_then(Value::as_array) {
            Some(ids) if !ids.is_empty() && ids.iter().all(Value::is_u64) => ids.clone(),
            _ => return Err("its answer has no prompt token ids (return_token_ids)".into()),
        };
        let shift = match choice
            .pointer("/logprobs/text_offset")
            .and_then(Value::as_array)
        {
            Some(offsets) => {
                let last = offsets.last().and_then(Value::as_u64).unwrap_or(0);
                let token = choice.pointer("/logprobs/tokens/0").and_then(Value::as_str);
                last + token.map_or(0, |t| t.chars().count() as u64)
            }
            None => 0,
        };
        Ok(First {
            ids: request.get("return_token_ids") == Some(&json!(true)),
            answer,
            token,
            prompt,
            shift,
        })
    }

    fn choice(&self) -> &Value {
        &self.answer["choices"][0]
    }

    /// Whether the first token ends the answer: the client asked for one token, or the prefill
    /// stopped at it (end of sequence, a stop token).
    pub(super) fn ends(&self, request: &Map<String, Value>) -> bool {
        self.choice()["finish_reason"] == "stop"
            || request.get("max_tokens").and_then(Value::as_u64) == Some(1)
    }

    /// Whether the first token, going on, is no text yet: the first bytes of a UTF-8 character
    /// a later token completes (vLLM writes such a token as no text). The decode cannot continue
    /// from it: vLLM's detokenizer, given a prompt that ends inside a character, writes the whole
    /// prompt's text into the next token's.
    pub(super) fn no_text_yet(&self, request: &Map<String, Value>) -> bool {
        !self.ends(request) && self.choice()["text"] == ""
    }

    /// The decode's request: the client's, continuing from the prompt plus the first token with
    /// the prefill's `params` (one token fewer to generate, and to wait for before a stop).
    pub(super) fn decode_request(
        &self,
        request: &Map<String, Value>,
        mut params: Map<String, Value>,
    ) -> Map<String, Value> {
        let mut decode = request.clone();
        let mut prompt = self.prompt.clone();
        prompt.push(self.token.clone());
        decode.insert("prompt".into(), Value::Array(prompt));
        for field in ["max_tokens", "min_tokens"] {
            if let Some(n) = decode.get(field).and_then(Value::as_u64) {
                decode.insert(field.into(), json!(n.saturating_sub(1)));
            }
        }
        params.insert(CONTINUES.into(), json!(true));
        decode.insert("kv_transfer_params".into(), Value::Object(params));
        decode
    }

    /// The prefill's answer as the client's whole answer (the first token ended it).
    pub(super) fn whole(&self) -> Value {
        let mut answer = self.answer.clone();
        answer["kv_transfer_params"] = Value::Null;
        if !self.ids {
            answer["choices"][0]["token_ids"] = Value::Null;
            answer["choices"][0]["prompt_token_ids"] = Value::Null;
        }
        answer
    }

    /// The first token as the first event of the client's stream; with `ends`, the whole
    /// stream (its usage event too when asked for, and `[DONE]`).
    pub(super) fn events(&self, request: &Map<String, Value>, ends: bool) -> String {
        let c = self.choice();
        let mut choice = json!({
            "index": 0, "text": c["text"], "logprobs": c["logprobs"],
            "finish_reason": Value::Null, "stop_reason": Value::Null,
            "prompt_token_ids": Value::Null, "token_ids": Value::Null,
        });
        if self.ids {
            choice["prompt_token_ids"] = Value::Array(self.prompt.clone());
            choice["token_ids"] = json!([self.token]);
        }
        if ends {
            choice["finish_reason"] = c["finish_reason"].clone();
            choice["stop_reason"] = c["stop_reason"].clone();
        }
        let a = &self.answer;
        let head = |choices: Value| {
            json!({"id": a["id"], "object": "text_completion", "created": a["created"],
                   "model": a["model"], "choices": choices})
        };
        let mut event = head(json!([choice]));
        let options = request.get("stream_options");
        let option = |name: &str| options.and_then(|o| o.get(name)) == Some(&json!(true));
        if option("continuous_usage_stats") {
            event["usage"] = a["usage"].clone();
        }
        let mut out = format!("data: {event}\n\n");
        if ends {
            if option("include_usage") {
                let mut usage = head(json!([]));
                usage["usage"] = a["usage"].clone();
                out += &format!("data: {usage}\n\n");
            }
            out += "data: [DONE]\n\n";
        }
        out
    }

    /// The decode's whole answer joined to the first token.
    pub(super) fn joined(&self, mut decode: Value) -> Value {
        Continuation::of(self).rewrite(&mut decode);
        let first = self.choice();
        if let Some(choice) = decode.pointer_mut("/choices/0") {
            let text = choice["text"].as_str().unwrap_or_default();
            choice["text"] = json!(format!(
                "{}{text}",
                first["text"].as_str().unwrap_or_default()
            ));
            if let Some(ids) = choice["token_ids"].as_array_mut() {
                ids.insert(0, self.token.clone());
            }
            if self.ids {
                choice["prompt_token_ids"] = Value::Array(self.prompt.clone());
            }
            if let (Some(head), Some(rest)) = (
                first["logprobs"].as_object(),
                choice["logprobs"].as_object_mut(),
            ) {
                for (field, values) in rest.iter_mut() {
                    if let (Some(head), Some(values)) = (
                        head.get(field).and_then(Value::as_array),
                        values.as_array_mut(),
                    ) {
                        values.splice(0..0, head.iter().cloned());
                    }
                }
            }
        }
        decode
    }
}

/// The decode's stream, its events rewritten as the continuation of the first token's: the
/// first event's id, no second prompt (the decode's is one token longer), text offsets after
/// the first token's text, and the usage of the whole answer (the first token is the prompt's
/// at the decode, the answer's for the client). It takes events whole (they may come split
/// across chunks: `events.rs` puts them back together).
pub(super) struct Continuation {
    id: Value,
    shift: u64,
}

impl Continuation {
    pub(super) fn of(first: &First) -> Continuation {
        Continuation {
            id: first.answer["id"].clone(),
            shift: first.shift,
        }
    }

    /// Whole events of the decode's stream, rewritten; an error event as it is (the decode's
    /// own).
    pub(super) fn rewrite_events(&self, whole: &[u8]) -> Bytes {
        let text = String::from_utf8_lossy(whole);
        let mut out = String::with_capacity(text.len());
        for line in events::lines(&text) {
            match line.event() {
                Some(mut event) if event.get("error").is_none() => {
                    self.rewrite(&mut event);
                    out += &line.with(&event);
                }
                _ => out += line.as_str(),
            }
        }
        Bytes::from(out)
    }

    /// One answer or event of the decode as part of the whole answer.
    fn rewrite(&self, event: &mut Value) {
        if event.get("id").is_some() {
            event["id"] = self.id.clone();
        }
        if let Some(choices) = event.get_mut("choices").and_then(Value::as_array_mut) {
            for choice in choices {
                if choice.get("prompt_token_ids").is_some() {
                    choice["prompt_token_ids"] = Value::Null;
                }
                let offsets = choice.pointer_mut("/logprobs/text_offset");
                for offset in offsets.and_then(Value::as_array_mut).into_iter().flatten() {
                    if let Some(n) = offset.as_u64() {
                        *offset = json!(n + self.shift);
                    }
                }
            }
        }
        if let Some(usage) = event.get_mut("usage").and_then(Value::as_object_mut) {
            let count = |usage: &Map<String, Value>, k: &str| usage.get(k).and_then(Value::as_u64);
            if let (Some(prompt), Some(completion)) = (
                count(usage, "prompt_tokens"),
                count(usage, "completion_tokens"),
            ) {
                usage.insert("prompt_tokens".into(), json!(prompt.saturating_sub(1)));
                usage.insert("completion_tokens".into(), json!(completion + 1));
            }
        }
    }
}

impl Proxy {
    /// The rest of a request whose prefill answered with the first token it sampled (`params`:
    /// its `kv_transfer_params`, naming `room`): the first token alone when it ends the answer,
    /// else the decode's request continuing from it, sent to `decode` (or another decode
    /// server that can take the KV of `paired_with`), and the decode's answer joined to it: a
    /// stream's first event goes at once, the decode's events follow.
    pub(super) async fn first_token(
        self: Arc<Self>,
        routed: Routed<'_>,
        first: First,
        params: Value,
        room: Value,
        (decode, paired_with): (Lease, Arc<Backend>),
    ) -> Attempt {
        self.metrics.sampled(SampledBy::Prefill);
        let request = &routed.request;
        let streamed = request.get("stream") == Some(&json!(true));
        if first.ends(request) {
            // The first token is the whole answer: the room goes unused (released as
            // `unclaimed` drops).
            let mut response = match streamed {
                true => event_stream(Body::from(first.events(request, true))),
                false => axum::Json(first.whole()).into_response(),
            };
            let kv = Kv::Local(Alone::FirstToken);
            self.metrics.kv(kv);
            response.headers_mut().insert(KV_HEADER, kv.header());
            self.metrics
                .first_token(routed.started.elapsed().as_secs_f64());
            return Attempt::Done(Ok((response, None)));
        }
        let params = params.as_object().cloned().unwrap_or_default();
        let continued = first.decode_request(request, params);
        // A stream names the decode chosen first (another takes over only if that one is lost
        // before it answers).
        let place = HeaderValue::from(self.decode_server(&decode).place);
        let sending = self.clone().send_decode(
            routed.path,
            continued,
            routed.forwarded.clone(),
            decode,
            paired_with,
        );
        let failed = Failed {
            model: routed.model,
            room,
            note: None,
            asking: routed.forwarded.authorization(),
        };
        if streamed {
            // The first token's event goes now; the decode's events follow it.
            self.metrics
                .first_token(routed.started.elapsed().as_secs_f64());
            let head = first.events(&routed.request, false);
            let rest =
                self.clone()
                    .continued(sending, first, failed, routed.unclaimed, routed.started);
            let body = futures_util::stream::once(async move { Ok(Bytes::from(head)) }).chain(rest);
            let mut response = event_stream(Body::from_stream(body));
            response.headers_mut().insert(DECODE_HEADER, place);
            return Attempt::Done(Ok((response, None)));
        }
        let (answer, decode) = sending.await;
        match self.began(answer, &decode, &failed, routed.unclaimed).await {
            Ok(answer) => Attempt::Done(Ok((self.joined(&first, answer, &decode).await, None))),
            Err(end) => end,
        }
    }

    /// The decode's whole answer to a request that continues from the prefill's first token,
    /// joined to it.
    async fn joined(&self, first: &First, answer: Decoded, decode: &Lease) -> Response {
        let status = answer.status;
        let bytes = answer.bytes().await;
        let kv = Kv::of_answer(&bytes);
        self.metrics.kv(kv);
        let mut response = match serde_json::from_slice::<Value>(&bytes) {
            Ok(whole) => copy_answer(status, Bytes::from(first.joined(whole).to_string())),
            Err(_) => copy_answer(status, bytes),
        };
        let place = HeaderValue::from(self.decode_server(decode).place);
        response.headers_mut().insert(DECODE_HEADER, place);
        response.headers_mut().insert(KV_HEADER, kv.header());
        response
    }

    /// The rest of a stream whose first token's event went: the decode's events as its
    /// continuation, or an error event if the decode fails the request (the client has a
    /// token already: there is no other answer to give).
    fn continued(
        self: Arc<Self>,
        sending: impl std::future::Future<Output = (reqwest::Result<Decoded>, Lease)> + Send + 'static,
        first: First,
        failed: Failed,
        unclaimed: Unclaimed,
        started: Instant,
    ) -> futures_util::stream::BoxStream<'static, reqwest::Result<Bytes>> {
        let rest = async move {
            let (answer, decode) = sending.await;
            let server = self.decode_server(&decode);
            let (error, kv) = match answer {
                Ok(answer) if answer.status.is_success() => {
                    unclaimed.claimed();
                    let continuation = Some(Continuation::of(&first));
                    return self.passing(answer, decode, started, failed, continuation, true);
                }
                Ok(answer) => self.decode_error_body(answer, &server, &failed).await,
                Err(e) => (upstream(&server, causes(&e)), None),
            };
            let said = kv.map(Kv::comment).unwrap_or_default();
            let events = format!("{said}data: {error}\n\ndata: [DONE]\n\n");
            futures_util::stream::once(async move { Ok(Bytes::from(events)) }).boxed()
        };
        futures_util::stream::once(rest).flatten().boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::events::Events;

    fn request(fields: Value) -> Map<String, Value> {
        let mut r = json!({"model": "m", "prompt": [5, 6, 7], "max_tokens": 4});
        r.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        r.as_object().unwrap().clone()
    }

    fn prefill_answer(logprobs: bool) -> Value {
        let lp = json!({"text_offset": [0], "token_logprobs": [-0.5], "tokens": ["ab"],
                        "top_logprobs": [{"ab": -0.5}]});
        json!({"id": "cmpl-p", "object": "text_completion", "created": 7, "model": "m",
               "choices": [{"index": 0, "text": "ab", "logprobs": if logprobs { lp } else { Value::Null },
                            "finish_reason": "length", "stop_reason": null, "token_ids": [42],
                            "prompt_token_ids": [5, 6, 7]}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
               "kv_transfer_params": {"do_remote_prefill": true, "kvferry_room": "9", "kvferry_tokens": 3}})
    }

    #[test]
    fn what_one_engine_alone_answers_exactly_goes_the_sequential_way() {
        let e = Endpoint::Completions;
        assert_eq!(unsupported(e, &request(json!({}))), None);
        assert_eq!(
            unsupported(
                e,
                &request(json!({"prompt": "hi", "stop": [], "presence_penalty": 0.0,
                                                    "repetition_penalty": 1.2, "logprobs": 2, "n": 1}))
            ),
            None
        );
        assert_eq!(unsupported(e, &request(json!({"prompt": [[1, 2]]}))), None);
        for (fields, why) in [
            (json!({"stop": ["x"]}), "`stop`"),
            (json!({"stop": "x"}), "`stop`"),
            (json!({"presence_penalty": 0.5}), "`presence_penalty`"),
            (json!({"echo": true}), "`echo`"),
            (json!({"guided_json": {"type": "object"}}), "`guided_json`"),
            (json!({"best_of": 2}), "`best_of` above 1"),
            (json!({"max_tokens": 0}), "`max_tokens` 0"),
            (json!({"prompt": ["a", "b"]}), "several prompts"),
            (json!({"prompt": []}), "several prompts"),
        ] {
            let got = unsupported(e, &request(fields.clone())).unwrap_or_default();
            assert!(got.starts_with(why), "{fields}: {got}");
        }
        assert!(unsupported(Endpoint::ChatCompletions, &request(json!({}))).is_some());
    }

    #[test]
    fn the_decode_continues_from_the_prompt_and_the_first_token() {
        let r = request(json!({"min_tokens": 2, "stream": true}));
        let first = First::read(prefill_answer(false), &r).unwrap();
        assert!(!first.ends(&r));
        assert!(first.ends(&request(json!({"max_tokens": 1}))));
        let params = prefill_answer(false)["kv_transfer_params"]
            .as_object()
            .unwrap()
            .clone();
        let d = first.decode_request(&r, params);
        assert_eq!(d["prompt"], json!([5, 6, 7, 42]));
        assert_eq!(
            (d["max_tokens"].clone(), d["min_tokens"].clone()),
            (json!(3), json!(1))
        );
        assert_eq!(d["kv_transfer_params"][CONTINUES], json!(true));
        assert_eq!(d["kv_transfer_params"]["kvferry_room"], "9");
        assert_eq!(d["stream"], json!(true));
        let mut stop = prefill_answer(false);
        stop["choices"][0]["finish_reason"] = json!("stop");
        assert!(First::read(stop, &r).unwrap().ends(&r));
        let mut bare = prefill_answer(false);
        bare["choices"][0]["token_ids"] = Value::Null;
        assert!(First::read(bare, &r).is_err());
    }

    #[test]
    fn a_first_token_that_is_no_text_yet_is_left_to_the_decode() {
        let r = request(json!({}));
        assert!(
            !First::read(prefill_answer(false), &r)
                .unwrap()
                .no_text_yet(&r)
        );
        // The first byte of a character: vLLM writes no text for it.
        let mut partial = prefill_answer(false);
        partial["choices"][0]["text"] = json!("");
        let first = First::read(partial, &r).unwrap();
        assert!(first.no_text_yet(&r));
        // The whole answer all the same when it ends there.
        assert!(!first.no_text_yet(&request(json!({"max_tokens": 1}))));
    }

    #[test]
    fn a_joined_answer_reads_as_one_engines() {
        let r = request(json!({"logprobs": 1, "return_token_ids": true}));
        let first = First::read(prefill_answer(true), &r).unwrap();
        let decode = json!({"id": "cmpl-d", "object": "text_completion", "created": 8, "model": "m",
            "choices": [{"index": 0, "text": "cde", "finish_reason": "length", "token_ids": [43, 44],
                         "prompt_token_ids": [5, 6, 7, 42],
                         "logprobs": {"text_offset": [0, 1], "token_logprobs": [-1.0, -2.0],
                                      "tokens": ["c", "de"], "top_logprobs": [{"c": -1.0}, {"de": -2.0}]}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            "kv_transfer_params": {"kvferry_room": "9"}});
        let joined = first.joined(decode);
        let c = &joined["choices"][0];
        assert_eq!(joined["id"], "cmpl-p");
        assert_eq!(c["text"], "abcde");
        assert_eq!(c["token_ids"], json!([42, 43, 44]));
        assert_eq!(c["prompt_token_ids"], json!([5, 6, 7]));
        assert_eq!(c["logprobs"]["text_offset"], json!([0, 2, 3]));
        assert_eq!(c["logprobs"]["tokens"], json!(["ab", "c", "de"]));
        assert_eq!(c["logprobs"]["token_logprobs"], json!([-0.5, -1.0, -2.0]));
        assert_eq!(
            joined["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
        );
    }

    #[test]
    fn the_decodes_events_continue_the_first_ones_even_split_across_chunks() {
        let r = request(
            json!({"stream": true, "stream_options": {"include_usage": true},
                               "logprobs": 0}),
        );
        let first = First::read(prefill_answer(true), &r).unwrap();
        let head = first.events(&r, false);
        let event: Value =
            serde_json::from_str(head.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(event["choices"][0]["text"], "ab");
        assert_eq!(event["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(
            event["choices"][0]["token_ids"],
            Value::Null,
            "not asked for"
        );
        let c = Continuation::of(&first);
        let one = json!({"id": "cmpl-d", "choices": [{"index": 0, "text": "c", "prompt_token_ids": [5, 6, 7, 42],
                                                      "logprobs": {"text_offset": [0], "tokens": ["c"]}}]});
        let usage = json!({"id": "cmpl-d", "choices": [],
                           "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}});
        let error = json!({"error": {"message": "boom"}});
        let stream = format!("data: {one}\n\ndata: {usage}\n\ndata: {error}\n\ndata: [DONE]\n\n");
        let (a, b) = stream.as_bytes().split_at(17);
        let mut events = Events::default();
        assert_eq!(
            events.feed(Bytes::copy_from_slice(a)),
            None,
            "no whole event yet"
        );
        let whole = events.feed(Bytes::copy_from_slice(b)).unwrap();
        assert_eq!(events.rest(), None);
        let out = String::from_utf8(c.rewrite_events(&whole).to_vec()).unwrap();
        let events: Vec<&str> = out.split("\n\n").filter(|e| !e.is_empty()).collect();
        let parse =
            |e: &str| serde_json::from_str::<Value>(e.strip_prefix("data: ").unwrap()).unwrap();
        let one = parse(events[0]);
        assert_eq!(one["id"], "cmpl-p");
        assert_eq!(one["choices"][0]["prompt_token_ids"], Value::Null);
        assert_eq!(one["choices"][0]["logprobs"]["text_offset"], json!([2]));
        assert_eq!(
            parse(events[1])["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
        );
        assert_eq!(parse(events[2]), error, "errors are the decode's own");
        assert_eq!(events[3], "data: [DONE]");
        // The first token alone: the whole stream.
        let whole = first.events(
            &request(json!({"max_tokens": 1, "stream": true,
                                                  "stream_options": {"include_usage": true}})),
            true,
        );
        let events: Vec<&str> = whole.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(parse(events[0])["choices"][0]["finish_reason"], "length");
        assert_eq!(parse(events[1])["usage"]["completion_tokens"], 1);
        assert_eq!(events[2], "data: [DONE]");
    }
}
