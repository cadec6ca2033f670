//! Where an answer's prompt KV came from ([`Kv`]): landed from the prefill through kvferry,
//! held by the decode's own prefix cache, or computed by the decode (and why), said to the
//! client in the `x-kvferry-kv` header ([`KV_HEADER`]) or, where a stream's headers went before
//! the decode knew, in an SSE comment line of the stream ([`Kv::comment`]), and counted in
//! `kvferry_proxy_kv_total{outcome, reason}`.
//!
//! The decode's connector says it (`kvferry_kv` and `kvferry_reason` in its
//! `kv_transfer_params`): in the decode's answer when it is not streamed, or in its answer to
//! the question `kvferry_reason_of` otherwise (vLLM passes a request's params into no streamed
//! answer). A decode answer without kvferry's params comes from a server that runs no kvferry
//! connector: it computed the prompt. An answer no decode gave (one server alone) is `local`.

use axum::http::HeaderValue;
use serde_json::Value;

use crate::reason::FailureCode;

/// The header of an answer that says where its prompt KV came from.
pub(super) const KV_HEADER: &str = "x-kvferry-kv";

/// Where an answer's prompt KV came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Kv {
    /// The room's KV landed in the decode (part of it may have been its prefix cache's).
    Landed,
    /// The decode's own prefix cache held the whole room: nothing had to move.
    Cached,
    /// The decode computed the prompt itself (`kv_load_failure_policy` `recompute`, or no
    /// kvferry connector).
    Recomputed(Why),
    /// The room failed and so did the decode's request (`kv_load_failure_policy` `fail`).
    Failed(Why),
    /// One server answered alone: no KV had to move.
    Local(Alone),
    /// The decode's connector did not say.
    Unknown(Unsaid),
}

/// Why a decode computed a prompt (or failed its request) instead of landing its KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Why {
    /// The room failed with this code.
    Code(FailureCode),
    /// The room was gone before the decode's engine took it.
    Expired,
    /// The decode's agent refused to ask for the room.
    Refused,
    /// The room settled but could not be taken.
    NotTaken,
    /// The request's `kv_transfer_params` were unusable: no room was asked for.
    BadParams,
    /// The decode server runs no kvferry connector (its answer has none of its params).
    NoConnector,
    /// A code this proxy does not know (a newer connector's).
    Other,
}

/// Why one server answered alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Alone {
    /// A short prompt, sent to a decode server alone (`one_server.rs`).
    ShortPrompt,
    /// The prefill's first token was the whole answer (first-token pairing).
    FirstToken,
}

/// Why the decode's connector did not say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Unsaid {
    /// It does not know the room (forgotten, or asked on another data-parallel rank).
    NotKnown,
    /// The question got no answer in time.
    Unanswered,
}

/// The reasons of a room's failure a decode's connector names besides [`FailureCode`]s.
const WHYS: [(Why, &str); 6] = [
    (Why::Expired, "expired"),
    (Why::Refused, "refused"),
    (Why::NotTaken, "not_taken"),
    (Why::BadParams, "bad_params"),
    (Why::NoConnector, "no_connector"),
    (Why::Other, "other"),
];

impl Why {
    /// The code of a connector's reason (`"peer_dead: ..."`).
    fn of(reason: Option<&str>) -> Why {
        let code = reason
            .and_then(|r| r.split(':').next())
            .unwrap_or("")
            .trim();
        if let Some(c) = FailureCode::ALL.iter().find(|c| c.name() == code) {
            return Why::Code(*c);
        }
        (WHYS.iter().find(|(_, name)| *name == code)).map_or(Why::Other, |(why, _)| *why)
    }

    fn name(self) -> &'static str {
        match self {
            Why::Code(c) => c.name(),
            other => (WHYS.iter().find(|(w, _)| *w == other)).map_or("other", |(_, name)| name),
        }
    }

    /// Every reason, failure codes first.
    fn all() -> impl Iterator<Item = Why> {
        let codes = FailureCode::ALL.iter().map(|c| Why::Code(*c));
        codes.chain(WHYS.iter().map(|(w, _)| *w))
    }
}

impl Kv {
    /// What a decode's `kv_transfer_params` say (its answer's, or its answer to
    /// `kvferry_reason_of`).
    pub(super) fn of_params(params: Option<&Value>) -> Kv {
        let Some(p) = params.and_then(Value::as_object).filter(|p| {
            ["kvferry_kv", "kvferry_room", "kvferry_reason"]
                .iter()
                .any(|k| p.contains_key(*k))
        }) else {
            return Kv::Recomputed(Why::NoConnector);
        };
        let why = || Why::of(p.get("kvferry_reason").and_then(Value::as_str));
        match p.get("kvferry_kv").and_then(Value::as_str) {
            Some("landed") => Kv::Landed,
            Some("cached") => Kv::Cached,
            Some("recomputed") => Kv::Recomputed(why()),
            Some("failed") => Kv::Failed(why()),
            _ => Kv::Unknown(Unsaid::NotKnown),
        }
    }

    /// What a decode's whole answer (JSON, not streamed) says.
    pub(super) fn of_answer(body: &[u8]) -> Kv {
        let answer = serde_json::from_slice::<Value>(body).ok();
        Kv::of_params(answer.as_ref().and_then(|a| a.get("kv_transfer_params")))
    }

    /// The `outcome` label.
    pub(super) fn outcome(self) -> &'static str {
        match self {
            Kv::Landed => "landed",
            Kv::Cached => "cached",
            Kv::Recomputed(_) => "recomputed",
            Kv::Failed(_) => "failed",
            Kv::Local(_) => "local",
            Kv::Unknown(_) => "unknown",
        }
    }

    /// The `reason` label: `none` where the KV is where it should be.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Kv::Landed | Kv::Cached => "none",
            Kv::Recomputed(why) | Kv::Failed(why) => why.name(),
            Kv::Local(Alone::ShortPrompt) => "short_prompt",
            Kv::Local(Alone::FirstToken) => "first_token",
            Kv::Unknown(Unsaid::NotKnown) => "not_known",
            Kv::Unknown(Unsaid::Unanswered) => "unanswered",
        }
    }

    /// Every value, each once (a request can fail only for a reason of its room).
    pub(super) fn all() -> impl Iterator<Item = Kv> {
        let failed = Why::all()
            .filter(|w| *w != Why::NoConnector)
            .map(Kv::Failed);
        [Kv::Landed, Kv::Cached]
            .into_iter()
            .chain(Why::all().map(Kv::Recomputed))
            .chain(failed)
            .chain([Alone::ShortPrompt, Alone::FirstToken].map(Kv::Local))
            .chain([Unsaid::NotKnown, Unsaid::Unanswered].map(Kv::Unknown))
    }

    /// The text of the header and of the comment: `landed`, `recomputed; reason=peer_dead`.
    pub(super) fn said(self) -> String {
        match self.reason() {
            "none" => self.outcome().to_owned(),
            reason => format!("{}; reason={reason}", self.outcome()),
        }
    }

    /// The value of the `x-kvferry-kv` header.
    pub(super) fn header(self) -> HeaderValue {
        // Label values are ASCII names.
        HeaderValue::from_str(&self.said()).unwrap_or(HeaderValue::from_static("unknown"))
    }

    /// The same in an event stream: a comment line (which clients skip), then a blank line.
    pub(super) fn comment(self) -> String {
        format!(": {KV_HEADER}: {}\n\n", self.said())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_decodes_params_say_where_the_kv_came_from() {
        let of = |p: Value| Kv::of_params(Some(&p));
        assert_eq!(
            of(json!({"kvferry_room": "9", "kvferry_kv": "landed"})),
            Kv::Landed
        );
        assert_eq!(of(json!({"kvferry_kv": "cached"})), Kv::Cached);
        let failed = json!({"kvferry_room": "9", "kvferry_kv": "recomputed",
                            "kvferry_reason": "peer_dead: prefill 1: gone"});
        assert_eq!(of(failed), Kv::Recomputed(Why::Code(FailureCode::PeerDead)));
        let expired =
            json!({"kvferry_kv": "failed", "kvferry_reason": "expired: the room was gone"});
        assert_eq!(of(expired), Kv::Failed(Why::Expired));
        let newer = json!({"kvferry_kv": "recomputed", "kvferry_reason": "something_new: x"});
        assert_eq!(of(newer), Kv::Recomputed(Why::Other));
        // The connector does not know the room; a server without it says nothing of kvferry.
        let unknown = json!({"kvferry_room": "9", "kvferry_kv": null, "kvferry_reason": null});
        assert_eq!(of(unknown), Kv::Unknown(Unsaid::NotKnown));
        assert_eq!(Kv::of_params(None), Kv::Recomputed(Why::NoConnector));
        assert_eq!(of(json!({"other": 1})), Kv::Recomputed(Why::NoConnector));
        let answer = json!({"choices": [], "kv_transfer_params": {"kvferry_kv": "landed"}});
        assert_eq!(Kv::of_answer(answer.to_string().as_bytes()), Kv::Landed);
        assert_eq!(
            Kv::of_answer(b"{\"choices\": []}"),
            Kv::Recomputed(Why::NoConnector)
        );
    }

    #[test]
    fn the_header_and_the_comment_name_the_outcome_and_its_reason() {
        assert_eq!(Kv::Landed.header(), "landed");
        let failed = Kv::Recomputed(Why::Code(FailureCode::Checksum));
        assert_eq!(failed.header(), "recomputed; reason=checksum");
        assert_eq!(
            Kv::Local(Alone::ShortPrompt).comment(),
            ": x-kvferry-kv: local; reason=short_prompt\n\n"
        );
    }

    #[test]
    fn every_value_has_its_own_labels_and_reasons_round_trip() {
        let all: Vec<Kv> = Kv::all().collect();
        let labels: std::collections::HashSet<_> =
            all.iter().map(|k| (k.outcome(), k.reason())).collect();
        assert_eq!(labels.len(), all.len());
        // landed, cached; recomputed by 15 codes and 6 other reasons, failed by all but
        // no_connector; 2 local; 2 unknown.
        assert_eq!(all.len(), 2 + 21 + 20 + 2 + 2);
        for why in Why::all() {
            let said = format!("{}: message", why.name());
            assert_eq!(Why::of(Some(&said)), why);
        }
    }
}
