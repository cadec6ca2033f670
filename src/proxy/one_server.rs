//! Short prompts on one server (`--short-below-tokens`): below some length, disaggregation
//! costs more than it saves (a second request, a room, the decode's wait for it), so the proxy
//! sends such a request to a decode server, which computes the prompt and answers it alone, as
//! any vLLM server does without `kv_transfer_params`. A prompt of token ids is measured exactly;
//! text by its UTF-8 bytes, never fewer than its tokens (a token is at least one byte), so a
//! text that may be long is never sent alone. A chat counts the text of its messages, not the
//! chat template's tokens.

use serde_json::{Map, Value};

use super::metrics::Endpoint;

/// Whether `request`'s prompt is surely shorter than `tokens`.
pub(super) fn shorter_than(
    endpoint: Endpoint,
    request: &Map<String, Value>,
    tokens: usize,
) -> bool {
    let length = match endpoint {
        Endpoint::Completions => request.get("prompt").and_then(prompt_length),
        Endpoint::ChatCompletions => request.get("messages").and_then(chat_length),
    };
    length.is_some_and(|n| n < tokens)
}

/// Token ids counted, text by its bytes; one prompt only.
fn prompt_length(prompt: &Value) -> Option<usize> {
    match prompt {
        Value::String(s) => Some(s.len()),
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => Some(a.len()),
        Value::Array(a) if a.len() == 1 => match &a[0] {
            Value::String(s) => Some(s.len()),
            Value::Array(t) if !t.is_empty() && t.iter().all(Value::is_u64) => Some(t.len()),
            _ => None,
        },
        _ => None,
    }
}

/// The bytes of every message's text (a string, or its parts' `text`); None for anything else
/// (an image, say).
fn chat_length(messages: &Value) -> Option<usize> {
    let mut bytes = 0;
    for message in messages.as_array()? {
        match message.get("content") {
            Some(Value::String(s)) => bytes += s.len(),
            Some(Value::Array(parts)) => {
                for part in parts {
                    bytes += part.get("text").and_then(Value::as_str)?.len();
                }
            }
            Some(Value::Null) | None => {}
            Some(_) => return None,
        }
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(fields: Value) -> Map<String, Value> {
        fields.as_object().unwrap().clone()
    }

    #[test]
    fn only_a_prompt_surely_shorter_goes_to_one_server() {
        let c = Endpoint::Completions;
        assert!(shorter_than(c, &request(json!({"prompt": [1, 2, 3]})), 4));
        assert!(!shorter_than(
            c,
            &request(json!({"prompt": [1, 2, 3, 4]})),
            4
        ));
        assert!(shorter_than(c, &request(json!({"prompt": [[1, 2]]})), 4));
        assert!(shorter_than(c, &request(json!({"prompt": "abc"})), 4));
        // "é€" is 5 bytes, perhaps 2 tokens: not surely under 4.
        assert!(!shorter_than(c, &request(json!({"prompt": "é€"})), 4));
        assert!(!shorter_than(
            c,
            &request(json!({"prompt": ["a", "b"]})),
            100
        ));
        assert!(!shorter_than(c, &request(json!({})), 100));
        let chat = Endpoint::ChatCompletions;
        let messages = json!({"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
        assert!(shorter_than(chat, &request(messages.clone()), 11));
        assert!(!shorter_than(chat, &request(messages), 10));
        let image = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]});
        assert!(!shorter_than(chat, &request(image), 1000));
    }
}
