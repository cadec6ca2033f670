//! Plays both engines over the agents' HTTP APIs ([`drive_rooms`]): asks the decode ranks for
//! each room, tells the prefill ranks it is ready, waits for the rooms to land, takes them and
//! reads their timings; and the summaries `kvferry demo` and `kvferry bench` print from the
//! results.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use crate::layout::KvLayout;

/// One room as the engines saw it.
#[derive(Clone, Debug)]
pub struct RoomResult {
    /// Room id.
    pub room: u64,
    /// Tokens.
    pub tokens: usize,
    /// KV bytes landed.
    pub bytes: u64,
    /// Final state at the decode.
    pub state: String,
    /// Failure code, if any.
    pub code: Option<String>,
    /// Whether the synthetic check passed on take.
    pub verified: bool,
    /// Prefill ready -> decode success, ms (measured inside the agents).
    pub latency_ms: f64,
    /// Engine request -> take returned, ms.
    pub take_ms: f64,
    /// Prefill ready time, ms since the epoch.
    pub ready_at: f64,
    /// Decode success time, ms since the epoch.
    pub success_at: f64,
    /// Where the room's time went ([`STAGES`], ms each; a stage the room's path skips, e.g.
    /// the gather of a direct write, is absent).
    pub stages: Vec<(&'static str, f64)>,
}

/// The stages of one room's time, in order, as `kvferry bench` reports them (`stages_ms`):
/// the engines' calls as the engine sees them, then the first chunk's way from the prefill's
/// ready to the decode's pool (the first prefill and decode rank's own timings), then the
/// rest of the room and the engine's notice of it.
pub const STAGES: [(&str, &str); 9] = [
    ("request_call", "the decode engine's request call"),
    ("ready_call", "the prefill engine's ready call"),
    (
        "ready_to_start",
        "ready -> the first piece's send starts (negative when layer-wise pieces went first)",
    ),
    (
        "gather",
        "-> first chunk gathered (credit and gather; one-sided writes: the writes)",
    ),
    ("post", "-> first chunk framed and handed to the transport"),
    ("wire", "-> first chunk arrives at the decode"),
    ("land", "-> first chunk in the decode pool"),
    ("rest", "-> the whole room landed (success)"),
    ("notice", "-> the engine's take returns"),
];

/// Milliseconds since the Unix epoch (the agents' clock for room timings).
fn epoch_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// [`STAGES`] of one room from the engine-side call times and the first prefill and decode
/// ranks' room views.
fn stages(
    calls: [f64; 2],
    prefill: &Value,
    decode: &Value,
    taken_at: f64,
) -> Vec<(&'static str, f64)> {
    let p = |k: &str| prefill["timings"][k].as_f64();
    let d = |k: &str| decode["timings"][k].as_f64();
    let points = [
        p("ready"),
        p("transfer_start"),
        p("first_gathered"),
        p("first_posted"),
        d("transferring"),
        d("first_landed"),
        d("success"),
        Some(taken_at),
    ];
    let mut out = vec![(STAGES[0].0, calls[0]), (STAGES[1].0, calls[1])];
    // Each stage runs from the last point reached before it: a skipped point (no gather on a
    // direct write) folds its stage into the next.
    let mut from = points[0];
    for (i, to) in points.iter().enumerate().skip(1) {
        if let (Some(a), Some(b)) = (from, *to) {
            out.push((STAGES[i + 1].0, b - a));
            from = Some(b);
        }
    }
    out
}

/// The engine-facing APIs of a cluster: prefill and decode ranks grouped by DP group.
#[derive(Clone, Debug)]
pub struct Apis {
    /// Prefill API URLs, one list per DP group (every TP/PP rank of the group).
    pub prefill: Vec<Vec<String>>,
    /// Decode API URLs, one list per DP group.
    pub decode: Vec<Vec<String>>,
    /// The agents' token (`--token`), sent as a bearer token on every call.
    pub token: Option<String>,
}

impl Apis {
    /// One prefill and one decode agent.
    pub fn pair(prefill: &str, decode: &str) -> Self {
        Apis {
            prefill: vec![vec![prefill.to_owned()]],
            decode: vec![vec![decode.to_owned()]],
            token: None,
        }
    }

    /// These APIs, called with `token`.
    pub fn with_token(self, token: Option<String>) -> Self {
        Apis { token, ..self }
    }

    /// The HTTP client of calls to these APIs: every call carries the token, if any.
    fn client(&self) -> anyhow::Result<reqwest::Client> {
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(token) = &self.token {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .context("the token is not a valid header value")?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        Ok(kvferry_wire::http::client()
            .default_headers(headers)
            .build()?)
    }
}

/// Plays both engines: for each `(room, tokens)`, asks every decode rank of the room's decode
/// DP group for the room and tells every prefill rank of the room's prefill DP group (room
/// modulo the DP size, as the decode agents pick it) that it is ready, waits until every decode
/// rank is final, takes the room from each, and reads the timings.
pub async fn drive_rooms(
    apis: &Apis,
    rooms: Vec<(u64, usize)>,
    concurrency: usize,
) -> anyhow::Result<Vec<RoomResult>> {
    let done = Arc::new(AtomicUsize::new(0));
    drive_rooms_counted(apis, rooms, concurrency, done).await
}

/// [`drive_rooms`], counting finished rooms in `done` as they finish (for a progress display).
pub async fn drive_rooms_counted(
    apis: &Apis,
    rooms: Vec<(u64, usize)>,
    concurrency: usize,
    done: Arc<AtomicUsize>,
) -> anyhow::Result<Vec<RoomResult>> {
    if apis.prefill.is_empty() || apis.decode.is_empty() {
        bail!("no prefill or no decode agent to drive");
    }
    let http = apis.client()?;
    let gate = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    for (room, tokens) in rooms {
        let (http, gate) = (http.clone(), gate.clone());
        let p = apis.prefill[(room % apis.prefill.len() as u64) as usize].clone();
        let d = apis.decode[(room % apis.decode.len() as u64) as usize].clone();
        let done = done.clone();
        tasks.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            let r = one_room(&http, &p, &d, room, tokens).await;
            done.fetch_add(1, Ordering::Relaxed);
            r
        });
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.push(r??);
    }
    out.sort_by_key(|r| r.room);
    Ok(out)
}

async fn json_ok(resp: reqwest::Response, what: &str) -> anyhow::Result<Value> {
    let status = resp.status();
    let body: Value = resp.json().await.with_context(|| format!("{what}: body"))?;
    if !status.is_success() {
        bail!("{what}: {status}: {body}");
    }
    Ok(body)
}

async fn one_room(
    http: &reqwest::Client,
    prefills: &[String],
    decodes: &[String],
    room: u64,
    tokens: usize,
) -> anyhow::Result<RoomResult> {
    let started = Instant::now();
    let body = json!({ "tokens": tokens });
    for d in decodes {
        let resp = http
            .post(format!("{d}/v1/rooms/{room}"))
            .json(&body)
            .send()
            .await?;
        json_ok(resp, "decode request").await?;
    }
    let request_call = started.elapsed().as_secs_f64() * 1e3;
    let ready_started = Instant::now();
    // Every prefill rank at once, as TP ranks finish a prefill together: one after the
    // other, the latency (from the first ready) would include the later ranks' fills.
    let mut ready = tokio::task::JoinSet::new();
    for p in prefills {
        let (http, url, body) = (
            http.clone(),
            format!("{p}/v1/rooms/{room}/ready"),
            body.clone(),
        );
        ready.spawn(async move {
            let resp = http.post(url).json(&body).send().await?;
            json_ok(resp, "prefill ready").await
        });
    }
    while let Some(done) = ready.join_next().await {
        done??;
    }
    let ready_call = ready_started.elapsed().as_secs_f64() * 1e3;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut result = RoomResult {
        room,
        tokens,
        bytes: 0,
        state: "success".to_owned(),
        code: None,
        verified: true,
        latency_ms: 0.0,
        take_ms: 0.0,
        ready_at: f64::INFINITY,
        success_at: 0.0,
        stages: Vec::new(),
    };
    let mut first_decode = Value::Null;
    let mut taken_at = 0.0;
    for d in decodes {
        let view = loop {
            let resp = http
                .get(format!("{d}/v1/rooms/{room}?wait_ms=5000"))
                .send()
                .await?;
            let v = json_ok(resp, "decode room").await?;
            let state = v["state"].as_str().unwrap_or_default();
            if ["success", "failed", "aborted"].contains(&state) && v["safe_to_reuse"] == true {
                break v;
            }
            if Instant::now() > deadline {
                bail!("room {room} still {state} at {d} after 120 s: {v}");
            }
        };
        let taken = json_ok(
            http.post(format!("{d}/v1/rooms/{room}/take"))
                .send()
                .await?,
            "take",
        )
        .await?;
        result.bytes += taken["bytes"].as_u64().unwrap_or(0);
        if taken["state"] != "success" {
            result.state = taken["state"].as_str().unwrap_or_default().to_owned();
            result.code = taken["reason"]["code"].as_str().map(str::to_owned);
        }
        result.verified &= taken["verified"].as_bool() == Some(true) && taken["state"] == "success";
        if first_decode.is_null() {
            taken_at = epoch_ms();
            first_decode = view.clone();
        }
        result.success_at = result
            .success_at
            .max(view["timings"]["success"].as_f64().unwrap_or(0.0));
    }
    result.take_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut first_prefill = Value::Null;
    for p in prefills {
        let resp = http.get(format!("{p}/v1/rooms/{room}")).send().await?;
        if let Ok(v) = json_ok(resp, "prefill room").await {
            if let Some(t) = v["timings"]["ready"].as_f64() {
                result.ready_at = result.ready_at.min(t);
            }
            if first_prefill.is_null() {
                first_prefill = v;
            }
        }
    }
    result.stages = stages(
        [request_call, ready_call],
        &first_prefill,
        &first_decode,
        taken_at,
    );
    if !result.ready_at.is_finite() {
        result.ready_at = 0.0;
    }
    result.latency_ms = result.success_at - result.ready_at;
    Ok(result)
}

/// The p-th percentile (0..=100) of `v`, nearest rank.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[i.min(s.len() - 1)]
}

/// GB/s (1e9 B/s) of a single-thread memcpy of `bytes` bytes, best of a few runs.
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![0x5Au8; bytes.max(1)];
    let mut dst = vec![0u8; bytes.max(1)];
    let best = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    bytes as f64 / best / 1e9
}

/// The bench JSON object of one configuration: rates in GB/s (1e9 B/s), times in ms, each
/// `stages_ms` entry the p50 over the verified rooms; `kvferry bench` adds its settings
/// (`chunk_bytes`, `verify`, `warmup_rooms`, `ucx_tls`) and the decode's `chunks_by_path`.
pub fn summary(
    results: &[RoomResult],
    transport: &str,
    model: &str,
    tokens: Value,
    page_size: usize,
    concurrency: usize,
    tp: (u32, u32),
) -> Value {
    let ok: Vec<&RoomResult> = results.iter().filter(|r| r.verified).collect();
    let lat: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
    let take: Vec<f64> = results.iter().map(|r| r.take_ms).collect();
    let bytes: u64 = ok.iter().map(|r| r.bytes).sum();
    let first = ok.iter().map(|r| r.ready_at).fold(f64::INFINITY, f64::min);
    let last = ok.iter().map(|r| r.success_at).fold(0.0, f64::max);
    let wall_s = ((last - first) / 1e3).max(1e-9);
    let largest = results.iter().map(|r| r.bytes).max().unwrap_or(0) as usize;
    let bytes_per_room = if results.is_empty() {
        0
    } else {
        results.iter().map(|r| r.bytes).sum::<u64>() / results.len() as u64
    };
    let p50 = percentile(&lat, 50.0);
    json!({
        "transport": transport,
        "model": model,
        "tokens": tokens,
        "page_size": page_size,
        "rooms": results.len(),
        "concurrency": concurrency,
        "prefill_tp": tp.0,
        "decode_tp": tp.1,
        "bytes_per_room": bytes_per_room,
        "throughput_gbps": if ok.is_empty() { 0.0 } else { bytes as f64 / wall_s / 1e9 },
        // One room alone: its bytes over its p50 latency (no gaps between rooms counted).
        "room_gbps_p50": if p50 > 0.0 { bytes_per_room as f64 / (p50 / 1e3) / 1e9 } else { 0.0 },
        "latency_ms": { "p50": p50, "p99": percentile(&lat, 99.0) },
        "take_latency_ms": { "p50": percentile(&take, 50.0), "p99": percentile(&take, 99.0) },
        "verified_rooms": ok.len(),
        "failed_rooms": results.len() - ok.len(),
        "failures": failures(results),
        "memcpy_gbps": memcpy_gbps(largest),
        "stages_ms": stage_p50s(&ok),
    })
}

/// Pages of a pool for rooms of up to `tokens` tokens, `concurrency` at a time: every room in
/// flight and as many again, since a prefill holds a room's pages until its last sends
/// resolved, which may be after the decode's success (Done goes first), when the next room
/// already starts; and a few spare for the warm-up.
pub fn pool_pages(layout: &KvLayout, tokens: usize, concurrency: usize) -> usize {
    layout.pages_for(tokens) * 2 * concurrency.max(1) + 8
}

/// The rooms that did not verify, counted by why: the failure code of a room a decode ended
/// with (`verify_failed` when the landed bytes were wrong), `unverified` when none was given.
fn failures(results: &[RoomResult]) -> Value {
    let mut counts = serde_json::Map::new();
    for r in results.iter().filter(|r| !r.verified) {
        let code = r.code.clone().unwrap_or_else(|| "unverified".to_owned());
        let n = counts.get(&code).and_then(Value::as_u64).unwrap_or(0);
        counts.insert(code, json!(n + 1));
    }
    Value::Object(counts)
}

/// The p50 of each of [`STAGES`] over `rooms` (the stages they reached).
fn stage_p50s(rooms: &[&RoomResult]) -> Value {
    let mut out = serde_json::Map::new();
    for (name, _) in STAGES {
        let v: Vec<f64> = rooms
            .iter()
            .filter_map(|r| r.stages.iter().find(|(n, _)| *n == name).map(|(_, ms)| *ms))
            .collect();
        if !v.is_empty() {
            out.insert(name.to_owned(), json!(percentile(&v, 50.0)));
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_that_did_not_verify_are_counted_by_why() {
        let room = |room, code: Option<&str>, verified| RoomResult {
            room,
            tokens: 16,
            bytes: 0,
            state: if verified { "success" } else { "failed" }.to_owned(),
            code: code.map(str::to_owned),
            verified,
            latency_ms: 1.0,
            take_ms: 1.0,
            ready_at: 0.0,
            success_at: 1.0,
            stages: Vec::new(),
        };
        let results = [
            room(1, None, true),
            room(2, Some("peer_dead"), false),
            room(3, Some("peer_dead"), false),
            room(4, Some("verify_failed"), false),
            room(5, None, false),
        ];
        let line = summary(&results, "zmq-tcp", "tiny", json!(16), 16, 1, (1, 1));
        assert_eq!(
            line["failures"],
            json!({"peer_dead": 2, "verify_failed": 1, "unverified": 1})
        );
        assert_eq!(
            (line["verified_rooms"].clone(), line["failed_rooms"].clone()),
            (json!(1), json!(4))
        );
        let none = summary(&results[..1], "zmq-tcp", "tiny", json!(16), 16, 1, (1, 1));
        assert_eq!(none["failures"], json!({}));
    }
}
