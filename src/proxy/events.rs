//! Server-sent events (`text/event-stream`) as a decode streams them: each event a `data: `
//! line and a blank line, and a chunk of the stream may end inside an event (even inside its
//! line). What reads or rewrites events (the first token's continuation, the explanation of an
//! error event) takes them whole from [`Events`], and reads them line by line ([`lines`]).

use axum::body::Bytes;
use serde_json::Value;

/// A stream's events put back together from its chunks: what came after the last whole event
/// waits for the chunk that ends it.
#[derive(Default)]
pub(super) struct Events {
    pending: Vec<u8>,
}

impl Events {
    /// The whole events of what came so far that did not go yet: up to the end of the last one
    /// that `chunk` ends (a chunk of whole events, nothing pending, is passed as it is); `None`
    /// until one ends.
    pub(super) fn feed(&mut self, chunk: Bytes) -> Option<Bytes> {
        if self.pending.is_empty() && chunk.ends_with(b"\n\n") {
            return Some(chunk);
        }
        // An end may begin with the pending's last byte.
        let from = self.pending.len().saturating_sub(1);
        self.pending.extend_from_slice(&chunk);
        let end = from
            + self.pending[from..]
                .windows(2)
                .rposition(|w| w == b"\n\n")?
            + 2;
        let after = self.pending.split_off(end);
        Some(Bytes::from(std::mem::replace(&mut self.pending, after)))
    }

    /// What is left of a stream that ended without its last blank line; `None`: nothing.
    pub(super) fn rest(&mut self) -> Option<Bytes> {
        (!self.pending.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.pending)))
    }
}

/// The lines of whole events, each with its line end.
pub(super) fn lines(events: &str) -> impl Iterator<Item = Line<'_>> {
    events.split_inclusive('\n').map(Line)
}

/// One line of an event stream, with its line end.
pub(super) struct Line<'a>(&'a str);

impl<'a> Line<'a> {
    /// The JSON value of a `data: ` line; `None` for any other line (a blank one, a comment)
    /// and for `data: [DONE]`.
    pub(super) fn event(&self) -> Option<Value> {
        let data = self.0.strip_prefix("data: ")?;
        serde_json::from_str(data.trim_end()).ok()
    }

    /// A `data: ` line of `event` in place of this one, ending as this one does.
    pub(super) fn with(&self, event: &Value) -> String {
        format!("data: {event}{}", &self.0[self.0.trim_end().len()..])
    }

    /// The line as it came.
    pub(super) fn as_str(&self) -> &'a str {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_split_across_chunks_come_out_whole() {
        let mut events = Events::default();
        let whole = Bytes::from_static(b"data: {\"a\": 1}\n\n");
        let passed = events.feed(whole.clone()).unwrap();
        assert_eq!(
            passed.as_ptr(),
            whole.as_ptr(),
            "whole events pass as they are"
        );
        let stream = "data: {\"a\": 2}\n\ndata: {\"b\": 3}\n\ndata: [DONE]\n\n";
        // Every split, the blank line's two ends on either side of one included.
        for at in 1..stream.len() {
            let (a, b) = stream.split_at(at);
            let mut got = String::new();
            for chunk in [a, b] {
                if let Some(whole) = events.feed(Bytes::copy_from_slice(chunk.as_bytes())) {
                    assert!(whole.ends_with(b"\n\n"), "{at}: {whole:?}");
                    got += std::str::from_utf8(&whole).unwrap();
                }
            }
            assert_eq!(got, stream, "split at {at}");
            assert_eq!(events.rest(), None);
        }
        assert_eq!(events.feed(Bytes::from_static(b"data: {\"b\"")), None);
        assert_eq!(events.feed(Bytes::from_static(b": 3}\n")), None);
        assert_eq!(
            events.rest(),
            Some(Bytes::from_static(b"data: {\"b\": 3}\n"))
        );
        assert_eq!(events.rest(), None, "taken");
    }

    #[test]
    fn a_data_line_is_rewritten_with_its_line_end() {
        let text = "data: {\"a\": 1}\r\n: a comment\ndata: [DONE]\n\n";
        let lines: Vec<Line<'_>> = lines(text).collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0].event(), Some(json!({"a": 1})));
        assert_eq!(lines[0].with(&json!({"a": 2})), "data: {\"a\":2}\r\n");
        assert_eq!(lines[1].event(), None);
        assert_eq!(lines[2].event(), None, "[DONE] is no JSON value");
        assert_eq!(lines[3].as_str(), "\n");
        let rebuilt: String = lines.iter().map(Line::as_str).collect();
        assert_eq!(rebuilt, text);
    }
}
