//! What a server says when it refuses a request because it shuts down, and a decode's answer
//! read far enough to tell. vLLM started with `--shutdown-timeout` drains on SIGTERM: the
//! requests it has finish, and a new one ends at once, aborted, without a token (a stream:
//! `[DONE]` before any event). Nothing was done for such a request, so the proxy sends it to
//! another server of the role (`route.rs`). A decode's answer that is an error before any
//! token is told apart too: the request failed there, or the server was lost meanwhile (vLLM
//! answers a request its API server took as its engine stopped with "EngineCore encountered
//! an issue"), which its health then says (`route.rs`).

use axum::body::Bytes;
use futures_util::StreamExt;
use serde_json::Value;

/// Whether an answer is vLLM's refusal of a request it got while it shuts down (`vllm serve
/// --shutdown-timeout`: the requests it has finish, new ones end at once, aborted, with no
/// token): a request to send to another server, as nothing was done for it.
pub(super) fn refused_for_shutdown(answer: &Value) -> bool {
    let Some(choices) = answer.get("choices").and_then(Value::as_array) else {
        return false;
    };
    let nothing = |c: &Value| {
        ["text", "content"].iter().all(|k| {
            c.get(k)
                .or_else(|| c.pointer(&format!("/message/{k}")))
                .or_else(|| c.pointer(&format!("/delta/{k}")))
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
        })
    };
    !choices.is_empty()
        && choices
            .iter()
            .all(|c| c.get("finish_reason").and_then(Value::as_str) == Some("abort") && nothing(c))
        && answer
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
            .is_none_or(|n| n == 0)
}

/// Whether the first chunk of an event stream is vLLM's refusal for its shutdown: `[DONE]`
/// before any event, or a first event that is such a refusal ([`refused_for_shutdown`]).
pub(super) fn stream_refused(first: &[u8]) -> bool {
    let text = String::from_utf8_lossy(first);
    let Some(data) = text.lines().find_map(|l| l.strip_prefix("data: ")) else {
        return false;
    };
    data.trim() == "[DONE]"
        || serde_json::from_str::<Value>(data.trim()).is_ok_and(|e| refused_for_shutdown(&e))
}

/// Whether the first chunk of an event stream is an error event, before any token.
fn stream_failed(first: &[u8]) -> bool {
    let text = String::from_utf8_lossy(first);
    let Some(data) = text.lines().find_map(|l| l.strip_prefix("data: ")) else {
        return false;
    };
    serde_json::from_str::<Value>(data.trim()).is_ok_and(|e| e.get("error").is_some())
}

/// What a decode's answer is, read far enough to tell ([`Decoded::judge`]).
pub(super) enum Judged {
    /// An answer for the client: tokens, or an error the decode gave for the request itself.
    Answer(Decoded),
    /// vLLM's refusal for its shutdown: nothing was done; another decode server may take it.
    Refused(Decoded),
    /// An error before any token (a 5xx answer, or a stream whose first event is an error):
    /// the request failed there, or the server was lost meanwhile.
    Failed(Decoded),
}

impl Judged {
    /// The answer, whatever it is.
    pub(super) fn answer(self) -> Decoded {
        match self {
            Judged::Answer(a) | Judged::Refused(a) | Judged::Failed(a) => a,
        }
    }
}

/// A decode's answer, its head read: its status and content type, and its body (what was read
/// of it to judge it first, then the rest).
pub(super) struct Decoded {
    pub(super) status: reqwest::StatusCode,
    pub(super) content_type: Option<reqwest::header::HeaderValue>,
    pub(super) body: futures_util::stream::BoxStream<'static, reqwest::Result<Bytes>>,
}

impl Decoded {
    /// Reads a decode's answer far enough to tell what it is ([`Judged`]): all of a JSON
    /// answer, the first chunk of a stream. An error: the connection broke before that much
    /// came (the server was lost before it answered).
    pub(super) async fn judge(r: reqwest::Response) -> reqwest::Result<Judged> {
        let status = r.status();
        let content_type = r.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        let streamed = content_type
            .as_ref()
            .is_some_and(|ct| ct.as_bytes().starts_with(b"text/event-stream"));
        let once = |chunk: reqwest::Result<Bytes>| futures_util::stream::once(async { chunk });
        let answer = |body| Decoded {
            status,
            content_type: content_type.clone(),
            body,
        };
        if !status.is_success() {
            let decoded = answer(r.bytes_stream().boxed());
            return Ok(match status.is_server_error() {
                true => Judged::Failed(decoded),
                false => Judged::Answer(decoded),
            });
        }
        if streamed {
            let mut rest = r.bytes_stream();
            return Ok(match rest.next().await {
                None => Judged::Answer(answer(futures_util::stream::empty().boxed())),
                Some(Ok(first)) => {
                    let refused = stream_refused(&first);
                    let failed = stream_failed(&first);
                    let decoded = answer(once(Ok(first)).chain(rest).boxed());
                    match (refused, failed) {
                        (true, _) => Judged::Refused(decoded),
                        (_, true) => Judged::Failed(decoded),
                        _ => Judged::Answer(decoded),
                    }
                }
                // Lost before its first event: no token of its own went anywhere.
                Some(Err(e)) => return Err(e),
            });
        }
        let bytes = r.bytes().await?;
        let refused =
            serde_json::from_slice::<Value>(&bytes).is_ok_and(|a| refused_for_shutdown(&a));
        let decoded = answer(once(Ok(bytes)).boxed());
        Ok(match refused {
            true => Judged::Refused(decoded),
            false => Judged::Answer(decoded),
        })
    }

    /// Whether the answer is an event stream (`text/event-stream`).
    pub(super) fn streamed(&self) -> bool {
        (self.content_type.as_ref())
            .is_some_and(|ct| ct.as_bytes().starts_with(b"text/event-stream"))
    }

    /// The whole body (an error answer's).
    pub(super) async fn bytes(self) -> Bytes {
        let chunks: Vec<reqwest::Result<Bytes>> = self.body.collect().await;
        let mut out = Vec::new();
        for chunk in chunks.into_iter().map_while(Result::ok) {
            out.extend_from_slice(&chunk);
        }
        Bytes::from(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_vllms_answer_to_a_request_it_got_while_draining_counts_as_refused() {
        // vLLM 0.32's answer to a new request during `--shutdown-timeout`'s drain.
        let aborted = json!({"choices": [{"index": 0, "text": "", "finish_reason": "abort"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
                             "kv_transfer_params": null});
        assert!(refused_for_shutdown(&aborted));
        let chat = json!({"choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "abort"}]});
        assert!(refused_for_shutdown(&chat));
        // A request aborted after it produced something is an answer, however short.
        let mut some = aborted.clone();
        some["choices"][0]["text"] = json!("a");
        assert!(!refused_for_shutdown(&some));
        let mut counted = aborted.clone();
        counted["usage"]["completion_tokens"] = json!(1);
        assert!(!refused_for_shutdown(&counted));
        let finished = json!({"choices": [{"text": "", "finish_reason": "length"}]});
        assert!(!refused_for_shutdown(&finished));
        assert!(!refused_for_shutdown(&json!({"choices": []})));
        assert!(!refused_for_shutdown(&json!({"error": {"message": "x"}})));
    }

    #[test]
    fn a_stream_is_refused_when_it_ends_before_its_first_event() {
        assert!(stream_refused(b"data: [DONE]\n\n"));
        let aborted =
            json!({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "abort"}]});
        assert!(stream_refused(
            format!("data: {aborted}\n\ndata: [DONE]\n\n").as_bytes()
        ));
        let token = json!({"choices": [{"index": 0, "text": "hi", "finish_reason": null}]});
        assert!(!stream_refused(format!("data: {token}\n\n").as_bytes()));
        assert!(!stream_refused(b": keep-alive\n\n"));
    }

    #[test]
    fn a_stream_failed_when_its_first_event_is_an_error() {
        let dead = json!({"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}});
        assert!(stream_failed(
            format!("data: {dead}\n\ndata: [DONE]\n\n").as_bytes()
        ));
        let token = json!({"choices": [{"index": 0, "text": "hi", "finish_reason": null}]});
        assert!(!stream_failed(format!("data: {token}\n\n").as_bytes()));
        assert!(!stream_failed(b"data: [DONE]\n\n"));
        assert!(!stream_failed(b": keep-alive\n\n"));
    }
}
