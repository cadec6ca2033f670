//! The agents' room operations in Rust and their HTTP API are one API: in one process, a real
//! registry and a prefill and a decode agent (synthetic engine, ZeroMQ over loopback) play the
//! same scenarios twice, once through the handles (`PrefillAgent`, `DecodeAgent`) and once
//! through HTTP with the same request structs as JSON bodies. Every result is asserted, and
//! the two runs must agree result by result: the same views (states, reasons, bytes, chunks,
//! sources, transfers), the same refusals (kind and message), the same bytes landed and
//! verified on take, the same pool counts.
//!
//! Room ids differ between the runs (a room exists once per agent); they are replaced by
//! `ROOM` before comparing, timestamps by the names of the timings, and agent-allocated page
//! numbers by their count. Transient states (an abort's answer, `aborting` until the prefill
//! acknowledged) are compared only where they cannot race.

use crate::common;

use std::time::{Duration, Instant};

use kvferry::agent::RoomError;
use kvferry::agent::decode::{DecodeAgent, RoomRequest};
use kvferry::agent::prefill::{PrefillAgent, ReadyRequest};
use kvferry::agent::{EngineApi, Operation};
use kvferry::protocol::Secret;
use reqwest::StatusCode;
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The generous bound on every wait; waits print how long they took.
const BOUND: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Rust,
    Http,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Prefill,
    Decode,
}

struct Cluster {
    prefill: PrefillAgent,
    decode: DecodeAgent,
    http: reqwest::Client,
}

/// An operation's result as JSON: the result serialized, or `{"error": kind, "message": ...}`.
fn ok<T: Serialize>(r: Result<T, RoomError>) -> Value {
    match r {
        Ok(v) => serde_json::to_value(v).expect("a view serializes"),
        Err(e) => {
            let kind = match e {
                RoomError::BadRequest(_) => "bad_request",
                RoomError::UnknownRoom(_) => "unknown_room",
                RoomError::Conflict(_) => "conflict",
                RoomError::Exhausted(_) => "exhausted",
                RoomError::Unavailable(_) => "unavailable",
                RoomError::Forbidden(_) => "forbidden",
            };
            json!({ "error": kind, "message": e.to_string() })
        }
    }
}

impl Cluster {
    fn api(&self, side: Side) -> &str {
        match side {
            Side::Prefill => &self.prefill.api_url,
            Side::Decode => &self.decode.api_url,
        }
    }

    /// One HTTP exchange; a success must come with `created`'s status, an error as the
    /// status of its kind.
    async fn http<B: Serialize>(
        &self,
        method: reqwest::Method,
        url: String,
        body: Option<&B>,
        success: StatusCode,
    ) -> Value {
        let mut req = self.http.request(method.clone(), &url);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
        let status = resp.status();
        let body: Value = resp
            .json()
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {status} without JSON: {e}"));
        if status.is_success() {
            assert_eq!(status, success, "{method} {url}: {body}");
            return body;
        }
        let kind = match status.as_u16() {
            400 => "bad_request",
            404 => "unknown_room",
            409 => "conflict",
            403 => "forbidden",
            429 => "exhausted",
            503 => "unavailable",
            other => panic!("{method} {url}: unexpected status {other}: {body}"),
        };
        let message = body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {url}: no error in {body}"));
        json!({ "error": kind, "message": message })
    }

    async fn ready(&self, via: Via, room: u64, req: ReadyRequest) -> Value {
        match via {
            Via::Rust => ok(self.prefill.ready(room, req).await),
            Via::Http => {
                let url = format!("{}/v1/rooms/{room}/ready", self.prefill.api_url);
                self.http(reqwest::Method::POST, url, Some(&req), StatusCode::ACCEPTED)
                    .await
            }
        }
    }

    async fn request(&self, via: Via, room: u64, req: RoomRequest) -> Value {
        match via {
            Via::Rust => ok(self.decode.request(room, req).await),
            Via::Http => {
                let url = format!("{}/v1/rooms/{room}", self.decode.api_url);
                self.http(reqwest::Method::POST, url, Some(&req), StatusCode::CREATED)
                    .await
            }
        }
    }

    async fn view(&self, via: Via, side: Side, room: u64) -> Value {
        match (via, side) {
            (Via::Rust, Side::Prefill) => ok(self.prefill.view(room)),
            (Via::Rust, Side::Decode) => ok(self.decode.view(room)),
            (Via::Http, _) => {
                let url = format!("{}/v1/rooms/{room}", self.api(side));
                self.http::<()>(reqwest::Method::GET, url, None, StatusCode::OK)
                    .await
            }
        }
    }

    async fn wait(&self, via: Via, side: Side, room: u64, timeout: Duration) -> Value {
        match (via, side) {
            (Via::Rust, Side::Prefill) => ok(self.prefill.wait(room, timeout).await),
            (Via::Rust, Side::Decode) => ok(self.decode.wait(room, timeout).await),
            (Via::Http, _) => {
                let ms = timeout.as_millis();
                let url = format!("{}/v1/rooms/{room}?wait_ms={ms}", self.api(side));
                self.http::<()>(reqwest::Method::GET, url, None, StatusCode::OK)
                    .await
            }
        }
    }

    async fn take(&self, via: Via, room: u64) -> Value {
        match via {
            Via::Rust => ok(self.decode.take(room).await),
            Via::Http => {
                let url = format!("{}/v1/rooms/{room}/take", self.decode.api_url);
                self.http::<()>(reqwest::Method::POST, url, None, StatusCode::OK)
                    .await
            }
        }
    }

    async fn abort(&self, via: Via, side: Side, room: u64) -> Value {
        match (via, side) {
            (Via::Rust, Side::Prefill) => ok(self.prefill.abort(room).await),
            (Via::Rust, Side::Decode) => ok(self.decode.abort(room).await),
            (Via::Http, _) => {
                let url = format!("{}/v1/rooms/{room}", self.api(side));
                self.http::<()>(reqwest::Method::DELETE, url, None, StatusCode::OK)
                    .await
            }
        }
    }

    async fn pool(&self, via: Via, side: Side) -> Value {
        match (via, side) {
            (Via::Rust, Side::Prefill) => ok(Ok(self.prefill.pool())),
            (Via::Rust, Side::Decode) => ok(Ok(self.decode.pool())),
            (Via::Http, _) => {
                let url = format!("{}/v1/pool", self.api(side));
                self.http::<()>(reqwest::Method::GET, url, None, StatusCode::OK)
                    .await
            }
        }
    }

    /// Waits (each wait up to 5 s, all within [`BOUND`]) until the room is final and safe to
    /// reuse; returns its view.
    async fn settle(&self, via: Via, side: Side, room: u64) -> Value {
        let start = Instant::now();
        loop {
            let v = self.wait(via, side, room, Duration::from_secs(5)).await;
            assert!(
                v.get("error").is_none(),
                "{via:?} {side:?} room {room}: {v}"
            );
            let fin = ["success", "failed", "aborted"].contains(&v["state"].as_str().unwrap());
            if fin && v["safe_to_reuse"] == true {
                println!(
                    "{via:?} {side:?} room {room}: {} after {:?}",
                    v["state"],
                    start.elapsed()
                );
                return v;
            }
            assert!(
                start.elapsed() < BOUND,
                "{via:?} {side:?} room {room} not settled after {BOUND:?}: {v}"
            );
        }
    }

    /// Waits until the room exists and is in `state`; returns its view.
    async fn until_state(&self, via: Via, side: Side, room: u64, state: &str) -> Value {
        let start = Instant::now();
        loop {
            let v = self.view(via, side, room).await;
            if v["state"] == state {
                println!(
                    "{via:?} {side:?} room {room}: {state} after {:?}",
                    start.elapsed()
                );
                return v;
            }
            assert!(
                start.elapsed() < BOUND,
                "{via:?} {side:?} room {room} not {state} after {BOUND:?}: {v}"
            );
            match v.get("error") {
                // Not there yet (a prefill learns of a room from the decode's request).
                Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                None => {
                    self.wait(via, side, room, Duration::from_secs(1)).await;
                }
            }
        }
    }
}

/// Results of one run, normalized for comparison with the other run.
struct Record {
    via: Via,
    entries: Vec<(String, Value)>,
}

impl Record {
    /// Records `v` (the result of an operation on `room`) under `label`.
    fn push(&mut self, label: &str, room: u64, v: &Value) {
        let mut v = v.clone();
        normalize(&mut v);
        let text = serde_json::to_string(&v)
            .unwrap()
            .replace(&room.to_string(), "ROOM");
        self.push_as_is(label, serde_json::from_str(&text).unwrap());
    }

    /// Records `v` as it is.
    fn push_as_is(&mut self, label: &str, v: Value) {
        println!("{:?} {label}: {v}", self.via);
        self.entries.push((label.to_owned(), v));
    }
}

/// Timings by name only; agent-allocated pages by count.
fn normalize(v: &mut Value) {
    if let Some(timings) = v.get_mut("timings") {
        let names: Vec<Value> = timings
            .as_object()
            .expect("timings is an object")
            .keys()
            .map(|k| json!(k))
            .collect();
        *timings = Value::Array(names);
    }
    if v["page_owner"] == "agent" {
        let n = v["pages"].as_array().expect("pages").len();
        v["pages"] = json!(format!("{n} agent pages"));
    }
}

fn assert_error(v: &Value, kind: &str, says: &str) {
    assert_eq!(v["error"], kind, "{v}");
    let message = v["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{v} should say {says:?}");
}

/// An abort's answer: the room is `aborting` until its prefill acknowledges, which may
/// already have happened; only the reason is stable.
fn abort_answer(v: &Value, code: &str) -> Value {
    let state = v["state"].as_str().unwrap_or_default();
    assert!(["aborting", "aborted"].contains(&state), "{v}");
    assert_eq!(v["reason"]["code"], code, "{v}");
    json!({ "reason": v["reason"], "state": "aborting or aborted" })
}

/// Every scenario, through `via`, on rooms `base + 1 ..`.
async fn scenarios(c: &Cluster, via: Via, base: u64) -> Vec<(String, Value)> {
    let mut rec = Record {
        via,
        entries: Vec::new(),
    };
    let key = Secret::random().expect("random");
    let tokens = 300;
    let prefill_instance = c.prefill.instance.to_string();
    let decode_instance = c.decode.instance.to_string();

    // 1. A room announced in pieces (a token chunk, then two layer ranges of the rest, aux
    //    with the last), with a room key; an overlapping piece is refused. Then requested,
    //    landed, taken and verified.
    let room = base + 1;
    let piece = |range: [usize; 2], layers: Option<[usize; 2]>, last: bool| ReadyRequest {
        tokens,
        token_range: Some(range),
        layer_range: layers,
        last: Some(last),
        ..ReadyRequest::default()
    };
    let first = ReadyRequest {
        room_key: Some(key),
        ..piece([0, 160], None, false)
    };
    let v = c.ready(via, room, first).await;
    assert_eq!(v["state"], "bootstrapping", "{v}");
    assert_eq!(
        (v["tokens"].as_u64(), v["bytes"].as_u64()),
        (Some(300), Some(0))
    );
    assert_eq!(v["transfers"], json!([]), "{v}");
    rec.push("pieces: first", room, &v);
    let v = c.ready(via, room, piece([100, 200], None, false)).await;
    assert_error(&v, "conflict", "overlap a piece announced before");
    rec.push("pieces: overlap", room, &v);
    let v = c
        .ready(via, room, piece([160, 300], Some([0, 2]), false))
        .await;
    assert_eq!(v["state"], "bootstrapping", "{v}");
    rec.push("pieces: layers 0..2", room, &v);
    let last = ReadyRequest {
        aux: Some(b"first token: 42".to_vec()),
        ..piece([160, 300], Some([2, 4]), true)
    };
    let v = c.ready(via, room, last).await;
    assert_eq!(v["state"], "bootstrapping", "{v}");
    rec.push("pieces: layers 2..4, last", room, &v);
    let v = c
        .ready(via, room, piece([0, 16], Some([0, 1]), false))
        .await;
    assert_error(&v, "conflict", "the last piece was already announced");
    rec.push("pieces: after the last", room, &v);
    let req = RoomRequest {
        tokens,
        room_key: Some(key),
        ..RoomRequest::default()
    };
    let v = c.request(via, room, req).await;
    assert_eq!(v["state"], "bootstrapping", "{v}");
    assert_eq!(
        (v["bytes"].as_u64(), v["chunks"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(v["page_owner"], "agent", "{v}");
    let expected = v["expected_bytes"].as_u64().expect("expected_bytes");
    assert!(expected > 0, "{v}");
    rec.push("pieces: request", room, &v);
    let v = c.settle(via, Side::Decode, room).await;
    assert_eq!(v["state"], "success", "{v}");
    assert_eq!(v["bytes"].as_u64(), Some(expected), "{v}");
    assert_eq!(
        v["sources"][0]["prefill_instance"],
        prefill_instance.as_str()
    );
    assert_eq!(v["sources"][0]["done"], true, "{v}");
    rec.push("pieces: landed", room, &v);
    let v = c.settle(via, Side::Prefill, room).await;
    assert_eq!(v["state"], "success", "{v}");
    assert_eq!(v["bytes"].as_u64(), Some(expected), "{v}");
    assert_eq!(
        v["transfers"][0]["decode_instance"],
        decode_instance.as_str()
    );
    assert_eq!(v["transfers"][0]["state"], "success", "{v}");
    rec.push("pieces: sent", room, &v);
    let v = c.take(via, room).await;
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["bytes"].as_u64(), Some(expected), "{v}");
    assert_eq!(v["aux"], "Zmlyc3QgdG9rZW46IDQy", "{v}");
    rec.push("pieces: take", room, &v);
    let v = c.take(via, room).await;
    assert_error(&v, "unknown_room", "unknown room");
    rec.push("pieces: take again", room, &v);

    // 2. The whole room in one piece, the request first, into engine-named decode pages.
    let room = base + 2;
    let pages: Vec<u32> = (40..59).collect();
    let req = RoomRequest {
        tokens,
        pages: Some(pages.clone()),
        ..RoomRequest::default()
    };
    let v = c.request(via, room, req).await;
    assert_eq!(
        (v["page_owner"].as_str(), v["pages"].clone()),
        (Some("engine"), json!(pages))
    );
    rec.push("whole: request", room, &v);
    let v = c
        .until_state(via, Side::Decode, room, "waiting_for_input")
        .await;
    rec.push("whole: waiting", room, &v);
    let v = c.take(via, room).await;
    assert_error(&v, "conflict", "is waiting_for_input; take it once");
    rec.push("whole: take too early", room, &v);
    let ready = ReadyRequest {
        tokens,
        ..ReadyRequest::default()
    };
    let v = c.ready(via, room, ready).await;
    assert!(v.get("error").is_none(), "{v}");
    let v = c.settle(via, Side::Decode, room).await;
    assert_eq!(v["state"], "success", "{v}");
    rec.push("whole: landed", room, &v);
    let v = c.take(via, room).await;
    assert_eq!(
        (v["verified"].clone(), v["aux"].clone()),
        (json!(true), Value::Null)
    );
    rec.push("whole: take", room, &v);
    let v = c.settle(via, Side::Prefill, room).await;
    assert_eq!(v["state"], "success", "{v}");
    rec.push("whole: sent", room, &v);

    // 3. The decode engine aborts a requested room the prefill has not announced.
    let room = base + 3;
    let req = RoomRequest {
        tokens: 64,
        ..RoomRequest::default()
    };
    let v = c.request(via, room, req).await;
    assert!(v.get("error").is_none(), "{v}");
    c.until_state(via, Side::Prefill, room, "waiting_for_input")
        .await;
    let v = c.abort(via, Side::Decode, room).await;
    rec.push("decode abort: answer", room, &abort_answer(&v, "aborted"));
    let v = c.settle(via, Side::Decode, room).await;
    assert_eq!(v["state"], "aborted", "{v}");
    rec.push("decode abort: decode", room, &v);
    let v = c.settle(via, Side::Prefill, room).await;
    assert_eq!(v["state"], "aborted", "{v}");
    assert_eq!(v["reason"]["code"], "aborted", "{v}");
    rec.push("decode abort: prefill", room, &v);
    let v = c.abort(via, Side::Decode, room).await;
    assert_eq!(
        v["state"], "aborted",
        "aborting a final room changes nothing: {v}"
    );
    rec.push("decode abort: again", room, &v);
    let v = c.take(via, room).await;
    assert_eq!(
        (v["verified"].clone(), v["bytes"].clone()),
        (Value::Null, json!(0))
    );
    rec.push("decode abort: take", room, &v);

    // 4. The prefill engine aborts an announced room; the decode's later request fails.
    let room = base + 4;
    let ready = ReadyRequest {
        tokens: 64,
        token_range: Some([0, 32]),
        ..ReadyRequest::default()
    };
    let v = c.ready(via, room, ready).await;
    assert!(v.get("error").is_none(), "{v}");
    let v = c.abort(via, Side::Prefill, room).await;
    assert_eq!(v["state"], "aborted", "{v}");
    assert_eq!(
        v["reason"]["message"], "aborted by the prefill engine",
        "{v}"
    );
    rec.push("prefill abort: answer", room, &v);
    let req = RoomRequest {
        tokens: 64,
        ..RoomRequest::default()
    };
    let v = c.request(via, room, req).await;
    assert!(v.get("error").is_none(), "{v}");
    let v = c.settle(via, Side::Decode, room).await;
    assert_eq!(v["reason"]["code"], "aborted", "{v}");
    rec.push("prefill abort: decode", room, &v);
    let v = c.take(via, room).await;
    assert_eq!(v["verified"], Value::Null, "{v}");
    rec.push("prefill abort: take", room, &v);

    // 5. A request without the room's key fails `unauthorized`.
    let room = base + 5;
    let ready = ReadyRequest {
        tokens: 64,
        room_key: Some(key),
        ..ReadyRequest::default()
    };
    let v = c.ready(via, room, ready).await;
    assert!(v.get("error").is_none(), "{v}");
    let req = RoomRequest {
        tokens: 64,
        room_key: Some(Secret::from_bytes([7; 16])),
        ..RoomRequest::default()
    };
    let v = c.request(via, room, req).await;
    assert!(v.get("error").is_none(), "{v}");
    let v = c.settle(via, Side::Decode, room).await;
    assert_eq!(
        (v["state"].as_str(), v["reason"]["code"].as_str()),
        (Some("failed"), Some("unauthorized"))
    );
    rec.push("room key: decode", room, &v);
    let v = c.take(via, room).await;
    assert_eq!(v["state"], "failed", "{v}");
    rec.push("room key: take", room, &v);
    let v = c.abort(via, Side::Prefill, room).await;
    assert_eq!(v["state"], "aborted", "{v}");
    rec.push("room key: prefill abort", room, &v);

    // 6. Refusals: a duplicate request, pages out of range, no tokens, a prefix that leaves
    //    nothing to move, unknown rooms.
    let room = base + 6;
    let req = |pages: Vec<u32>| RoomRequest {
        tokens: 16,
        pages: Some(pages),
        ..RoomRequest::default()
    };
    let v = c.request(via, room, req(vec![1])).await;
    assert!(v.get("error").is_none(), "{v}");
    let v = c.request(via, room, req(vec![2])).await;
    assert_error(&v, "conflict", "already exists");
    rec.push("refusals: duplicate", room, &v);
    c.until_state(via, Side::Prefill, room, "waiting_for_input")
        .await;
    let v = c.abort(via, Side::Decode, room).await;
    rec.push("refusals: abort", room, &abort_answer(&v, "aborted"));
    let v = c.settle(via, Side::Decode, room).await;
    rec.push("refusals: aborted", room, &v);
    let v = c.take(via, room).await;
    assert!(v.get("error").is_none(), "{v}");

    let room = base + 7;
    let v = c.request(via, room, req(vec![64])).await;
    assert_error(
        &v,
        "bad_request",
        "page 64 is out of range: the pool has 64 pages",
    );
    rec.push("refusals: decode page out of range", room, &v);
    let v = c.request(via, room, req(vec![3, 3])).await;
    assert_error(&v, "bad_request", "page 3 is listed twice");
    rec.push("refusals: decode page twice", room, &v);
    let v = c.request(via, room, RoomRequest::default()).await;
    assert_error(&v, "bad_request", "tokens must be > 0");
    rec.push("refusals: decode no tokens", room, &v);
    let prefix = RoomRequest {
        tokens: 16,
        start_token: 16,
        ..RoomRequest::default()
    };
    let v = c.request(via, room, prefix).await;
    assert_error(&v, "bad_request", "start_token 16 must be < tokens 16");
    rec.push("refusals: decode nothing to move", room, &v);
    let ready = ReadyRequest {
        tokens: 16,
        pages: Some(vec![64]),
        ..ReadyRequest::default()
    };
    let v = c.ready(via, room, ready).await;
    assert_error(&v, "bad_request", "page 64 is out of range");
    rec.push("refusals: prefill page out of range", room, &v);
    let ready = ReadyRequest {
        tokens: 16,
        layer_range: Some([2, 9]),
        ..ReadyRequest::default()
    };
    let v = c.ready(via, room, ready).await;
    assert_error(&v, "bad_request", "layer_range 2..9");
    rec.push("refusals: prefill layers out of range", room, &v);
    let v = c.ready(via, room, ReadyRequest::default()).await;
    assert_error(&v, "bad_request", "tokens must be > 0");
    rec.push("refusals: prefill no tokens", room, &v);
    for side in [Side::Decode, Side::Prefill] {
        let v = c.view(via, side, room).await;
        assert_error(&v, "unknown_room", "unknown room");
        rec.push(&format!("refusals: {side:?} view unknown"), room, &v);
        let v = c.wait(via, side, room, Duration::from_millis(10)).await;
        assert_error(&v, "unknown_room", "unknown room");
        rec.push(&format!("refusals: {side:?} wait unknown"), room, &v);
        let v = c.abort(via, side, room).await;
        assert_error(&v, "unknown_room", "unknown room");
        rec.push(&format!("refusals: {side:?} abort unknown"), room, &v);
    }
    let v = c.take(via, room).await;
    assert_error(&v, "unknown_room", "unknown room");
    rec.push("refusals: take unknown", room, &v);
    let untrusted = RoomRequest {
        tokens: 16,
        bootstrap: Some("http://127.0.0.1:9".into()),
        ..RoomRequest::default()
    };
    let v = c.request(via, room, untrusted).await;
    assert_error(&v, "forbidden", "is not trusted");
    rec.push("refusals: a registry the decode does not trust", room, &v);

    // Every agent-owned page is back.
    for side in [Side::Decode, Side::Prefill] {
        let v = c.pool(via, side).await;
        assert_eq!(
            v,
            json!({ "free_pages": 64, "total_pages": 64 }),
            "{side:?}"
        );
        rec.push_as_is(&format!("{side:?} pool"), v);
    }
    rec.entries
}

/// Every operation the engine API lists (`OPERATIONS`) answers on its route at each role that
/// serves it, and no other role's route does: a route missing from one role, or one role
/// serving another's, fails here. `faults` is served only with `--fault-injection`, which these
/// agents do not have.
async fn every_listed_route_is_served(c: &Cluster) {
    for (side, role) in [(Side::Prefill, "prefill"), (Side::Decode, "decode")] {
        let mut served = 0;
        for op in kvferry::agent::OPERATIONS {
            let Some((method, path)) = op.http else {
                continue;
            };
            let listed = Operation::of(role).any(|o| o.http == op.http);
            let path = path.replace("{room}", "1").replace("{dp_rank}", "0");
            let url = format!("{}{path}", c.api(side));
            let method = reqwest::Method::from_bytes(method.as_str().as_bytes()).unwrap();
            let mut req = c.http.request(method.clone(), &url);
            if method == reqwest::Method::POST {
                req = req.json(&json!({}));
            }
            let resp = req
                .send()
                .await
                .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            let unrouted = (status == StatusCode::NOT_FOUND && body.contains("no route"))
                || status == StatusCode::METHOD_NOT_ALLOWED;
            let expect_served = listed && op.name != "faults";
            assert_eq!(
                !unrouted, expect_served,
                "{role} {method} {path} ({}): {status} {body}",
                op.name
            );
            served += usize::from(!unrouted);
        }
        println!("{role}: {served} listed routes served, every other one refused");
    }
}

#[test]
fn the_rust_handles_and_the_http_api_give_the_same_results() {
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let (registry, served) = common::registry_in_process(&shutdown).await;
        // Small chunks: several per room.
        let config = common::in_process_config(&registry, &["--chunk-bytes", "65536"]);
        let prefill = PrefillAgent::start(config.clone(), shutdown.clone())
            .await
            .expect("prefill agent");
        let decode = DecodeAgent::start(config, shutdown.clone())
            .await
            .expect("decode agent");
        let http = kvferry_wire::http::client()
            .timeout(Duration::from_secs(90))
            .build()
            .unwrap();
        let c = Cluster {
            prefill,
            decode,
            http,
        };
        let started = Instant::now();
        let rust = scenarios(&c, Via::Rust, 7_000_000).await;
        println!("through the handles: {:?}", started.elapsed());
        let started = Instant::now();
        let http = scenarios(&c, Via::Http, 9_000_000).await;
        println!("through HTTP: {:?}", started.elapsed());
        assert_eq!(rust.len(), http.len());
        for ((label, r), (_, h)) in rust.iter().zip(&http) {
            assert_eq!(r, h, "{label}: the handles and HTTP differ");
        }
        println!("{} results agree", rust.len());
        every_listed_route_is_served(&c).await;

        shutdown.cancel();
        c.prefill.join().await;
        c.decode.join().await;
        served.await.unwrap().unwrap();
    });
}
