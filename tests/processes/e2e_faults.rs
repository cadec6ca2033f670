//! Fault injection across real processes (release binary, one test at a time, every
//! timeout explicit, generous bounds, measured times printed):
//!
//! - kill -9 of the prefill before ready, mid-transfer and after Done but before take;
//! - kill -9 of a decode the prefill is blocked sending to: its room waits for another decode,
//!   which takes it;
//! - abort mid-transfer, then reuse the same engine pages for a new room at once (SGLang #24527);
//! - 1,000 rooms with random aborts from both sides, exact page and counter accounting;
//! - a corrupted chunk caught by the per-chunk checksum (`KVFERRY_FAULT_CORRUPT_CHUNK`);
//! - a decode the prefill found dead while it was alive: told so, it greets again at once;
//! - admission control (`--max-rooms`: 429 at once, nothing lost);
//! - SIGTERM drain of a decode and of a prefill (503, in-flight rooms finish, deregister, exit 0).
//!
//! A cut link between hosts is in e2e_hosts.rs.
//!
//! Needs `cargo build --release --bin kvferry` first. Run one at a time:
//! `cargo test --test processes e2e_faults:: -- --test-threads=1 --nocapture`.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvferry::cluster::{Apis, drive_rooms};
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use reqwest::{Client, Method, StatusCode};
use serde_json::{Value, json};

/// KV bytes per token of the `tiny` preset: 4 layers x 4 heads x 32 x fp16 x (K, V).
const TINY_BYTES_PER_TOKEN: u64 = 4 * 4 * 32 * 2 * 2;
/// KV bytes per token of `llama3-8b`: 32 layers x 8 heads x 128 x bf16 x (K, V).
const LLAMA_BYTES_PER_TOKEN: u64 = 32 * 8 * 128 * 2 * 2;

/// Every agent flag including all timeouts (ready 60 s, stall 30 s unless a test says).
trait ArgsAll {
    fn args_all(&self) -> Vec<String>;
}

impl ArgsAll for AgentOpts {
    fn args_all(&self) -> Vec<String> {
        all_timeouts(self, 60_000, 30_000)
    }
}

/// Fast liveness: heartbeats every 100 ms, a peer silent for 1 s is dead.
fn fast(opts: AgentOpts) -> AgentOpts {
    AgentOpts {
        heartbeat_ms: 100,
        peer_dead_ms: 1000,
        ..opts
    }
}

// ---------------------------------------------------------------------------------------------
// kill -9 of the prefill at each phase
// ---------------------------------------------------------------------------------------------

/// (a) Rooms requested but never ready (`waiting_for_input`) when the prefill is killed: each
/// fails `peer_dead` within seconds, is safe to reuse, and its agent-owned pages return on take.
#[test]
fn kill9_prefill_before_ready_fails_waiting_rooms_with_peer_dead() {
    let c = FaultCluster::start(
        "faults-kill-early",
        &fast(AgentOpts::default()).args_all(),
        &[],
        &[],
        &[],
    );
    runtime().block_on(async {
        let (http, d) = (http(), c.decode_api.clone());
        let (total, _) = pool(&http, &d).await;
        let rooms: Vec<(u64, usize)> = vec![(1, 16), (2, 100), (3, 64), (4, 500)];
        for &(room, tokens) in &rooms {
            request(&http, &d, room, json!({ "tokens": tokens })).await;
            wait_state(&http, &d, room, &["waiting_for_input"], BOUND).await;
        }
        let held: u64 = rooms.iter().map(|(_, t)| t.div_ceil(16) as u64).sum();
        assert_eq!(pool(&http, &d).await, (total, total - held));

        c.prefill.signal("KILL").unwrap();
        let (killed, killed_ms) = (Instant::now(), now_ms());
        let mut worst = 0.0f64;
        for &(room, _) in &rooms {
            let v = wait_final(&http, &d, room).await;
            assert_eq!(v["state"], "failed", "{v}");
            assert_reason(&v, "peer_dead");
            assert_eq!(v["safe_to_reuse"], true, "{v}");
            assert_eq!(v["bytes"], 0, "{v}");
            worst = worst.max(at(&v, "failed").unwrap_or(f64::NAN) - killed_ms);
        }
        let seen = killed.elapsed();
        println!(
            "[faults-kill-early] kill -9 -> 4 waiting rooms failed peer_dead: last failure {worst:.0} ms after the kill (agent clock), all seen in {:.0} ms (heartbeat 100 ms, peer-dead 1000 ms); reason: {}",
            ms(seen),
            wait_final(&http, &d, 1).await["reason"]["message"]
        );
        assert!(seen < BOUND, "detection took {seen:?}");
        for &(room, _) in &rooms {
            let t = take(&http, &d, room).await;
            assert_eq!(t["state"], "failed", "{t}");
        }
        assert_eq!(pool(&http, &d).await, (total, total), "decode pages after the takes");
        let dead = metric(&http, &d, "kvferry_room_failures_total{role=\"decode\",code=\"peer_dead\"}").await;
        assert_eq!(dead, Some(4.0));
        healthy(&http, &d).await;
    });
}

/// (b) A llama3-8b 4096-token room (512 MiB) killed while `transferring` (held there: only its
/// first half is announced): it fails `peer_dead` with part of its bytes landed, becomes safe to
/// reuse, and its pages return on take.
#[test]
fn kill9_prefill_mid_transfer_fails_the_room_with_peer_dead() {
    let opts = fast(AgentOpts {
        model: "llama3-8b",
        pool_pages: 272,
        ..AgentOpts::default()
    });
    let room_bytes = 4096 * LLAMA_BYTES_PER_TOKEN;
    let c = FaultCluster::start("faults-kill-mid", &opts.args_all(), &[], &[], &[]);
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        let room = 1;
        request(&http, &d, room, json!({ "tokens": 4096 })).await;
        ready_piece(&http, &p, room, 4096, 0..2048, false).await;
        wait_state(&http, &d, room, &["transferring"], BOUND).await;
        c.prefill.signal("KILL").unwrap();
        let (killed, killed_ms) = (Instant::now(), now_ms());
        let v = wait_final(&http, &d, room).await;
        let final_in = killed.elapsed();
        let (v2, unsafe_for) = wait_safe(&http, &d, room).await;
        let landed = v2["bytes"].as_u64().unwrap_or(0);
        println!(
            "[faults-kill-mid] kill -9 mid-transfer -> {} in {:.0} ms (agent clock {:.0} ms), safe_to_reuse {:.1} ms later; {landed} of {room_bytes} bytes landed",
            v["state"],
            ms(final_in),
            at(&v, "failed").map_or(f64::NAN, |t| t - killed_ms),
            ms(unsafe_for)
        );
        assert_eq!(v["state"], "failed", "{v}");
        assert_reason(&v, "peer_dead");
        assert!(landed > 0 && landed <= room_bytes / 2, "{v2}");
        assert!(final_in < BOUND);
        let t = take(&http, &d, room).await;
        assert_eq!(t["verified"], Value::Null, "a failed room is not verified: {t}");
        assert_eq!(pool(&http, &d).await, (272, 272), "decode pages after take");
        healthy(&http, &d).await;
    });
}

/// A decode killed with -9 while the prefill's sends to it are blocked (the decode was stopped
/// first, so its socket filled): the prefill notices from the closed control connection (heart
/// beats and send timeouts are 10 minutes: nothing else can end it) and puts the room it had
/// not delivered back to waiting (`waiting_for_input`, the lost transfer `failed`
/// `peer_dead`); another decode with the same ranks asks for the same room and gets every byte
/// of it, verified, with no second announcement from the engine; and a room of the dead decode
/// that no other decode asks for fails `peer_dead` after `--requeue-ms`, every page of the
/// prefill back. Another room is served meanwhile.
#[test]
fn kill9_of_a_decode_the_prefill_is_blocked_sending_to_requeues_its_room_for_another_decode() {
    let opts = AgentOpts {
        model: "llama3-8b",
        pool_pages: 320,
        heartbeat_ms: 100,
        peer_dead_ms: 600_000,
        timeout_send_ms: 600_000,
        ..AgentOpts::default()
    };
    let mut args = opts.args_all();
    set_flag(&mut args, "--requeue-ms", "3000");
    let c = FaultCluster::start("faults-kill-decode", &args, &[], &[], &[]);
    let mut victim_args = owned(&["decode", "--bootstrap", &c.registry_url]);
    victim_args.extend_from_slice(&args);
    let victim = common::spawn(&release_binary(), &[], "victim", &victim_args, &[], &c.logs);
    let v = victim.field("api").unwrap();
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        let (total, _) = pool(&http, &p).await;
        let requeued = metric(&http, &p, r#"kvferry_rooms_requeued_total{role="prefill"}"#).await;
        request(&http, &v, 1, json!({ "tokens": 4096 })).await;
        request(&http, &v, 3, json!({ "tokens": 64 })).await;
        wait_state(&http, &v, 1, &["waiting_for_input"], BOUND).await;
        wait_state(&http, &v, 3, &["waiting_for_input"], BOUND).await;
        // 512 MiB for a decode that reads nothing: the prefill's sends to it block.
        victim.signal("STOP").unwrap();
        ready(&http, &p, 1, 4096).await;
        wait_state(&http, &p, 1, &["transferring"], BOUND).await;
        victim.signal("KILL").unwrap();
        let killed = Instant::now();

        let back = wait_state(&http, &p, 1, &["waiting_for_input"], BOUND).await;
        let waiting = killed.elapsed();
        let lost = &back["transfers"][0];
        assert_eq!(lost["state"], "failed", "{back}");
        assert_eq!(lost["reason"]["code"], "peer_dead", "{back}");
        assert!(back["timings"]["requeued"].is_number(), "{back}");
        request_and_ready(&http, &d, &p, 2, &json!({ "tokens": 512 })).await;
        take_verified(&http, &d, 2).await;
        let served = killed.elapsed();
        // The same room, asked by the survivor: every byte lands, no second ready.
        request(&http, &d, 1, json!({ "tokens": 4096 })).await;
        let taken = take_verified(&http, &d, 1).await;
        let room = wait_final(&http, &p, 1).await;
        assert_eq!(room["state"], "success", "{room}");
        let kept = killed.elapsed();
        // Nobody asks for room 3: it fails with the decode's death once --requeue-ms passed.
        let unclaimed = wait_final(&http, &p, 3).await;
        assert_eq!(unclaimed["state"], "failed", "{unclaimed}");
        assert_reason(&unclaimed, "peer_dead");
        let said = unclaimed["reason"]["message"].as_str().unwrap_or_default();
        assert!(said.contains("no other decode asked for the room within 3000 ms (--requeue-ms)"), "{said}");
        assert_eq!(
            metric(&http, &p, r#"kvferry_rooms_requeued_total{role="prefill"}"#).await,
            requeued.map(|n| n + 2.0),
            "rooms 1 and 3 requeued"
        );
        poll_until("the prefill's pages back", BOUND, || async {
            (pool(&http, &p).await == (total, total)).then_some(())
        })
        .await;
        println!(
            "[faults-kill-decode] after the kill: the prefill's room waiting again in {:.0} ms, another room served in {:.0} ms, the requeued room taken by the other decode ({} bytes verified) in {:.0} ms; the unclaimed one: {}",
            ms(waiting),
            ms(served),
            taken["bytes"],
            ms(kept),
            said
        );
        healthy(&http, &d).await;
    });
    drop(victim);
}

/// (c) Rooms that landed (success, untaken) when the prefill is killed stay `success` and
/// verify on take; a room still waiting on the same prefill fails `peer_dead` (so the death was
/// noticed while the landed rooms sat there).
#[test]
fn kill9_prefill_after_done_before_take_leaves_landed_rooms_intact() {
    let c = FaultCluster::start(
        "faults-kill-late",
        &fast(AgentOpts::default()).args_all(),
        &[],
        &[],
        &[],
    );
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        let (total, _) = pool(&http, &d).await;
        for (room, tokens) in [(1u64, 300usize), (2, 77)] {
            request(&http, &d, room, json!({ "tokens": tokens })).await;
            ready(&http, &p, room, tokens).await;
            let v = wait_final(&http, &d, room).await;
            assert_eq!(v["state"], "success", "{v}");
        }
        request(&http, &d, 3, json!({ "tokens": 32 })).await;
        wait_state(&http, &d, 3, &["waiting_for_input"], BOUND).await;

        c.prefill.signal("KILL").unwrap();
        let killed = Instant::now();
        let witness = wait_final(&http, &d, 3).await;
        assert_eq!(witness["state"], "failed", "{witness}");
        assert_reason(&witness, "peer_dead");
        println!(
            "[faults-kill-late] the waiting room failed peer_dead {:.0} ms after the kill",
            ms(killed.elapsed())
        );
        // Twice the peer-dead time more: nothing changes for the landed rooms.
        tokio::time::sleep(Duration::from_millis(2000)).await;
        for (room, tokens) in [(1u64, 300u64), (2, 77)] {
            let v = expect(
                &http,
                Method::GET,
                &format!("{d}/v1/rooms/{room}"),
                None,
                StatusCode::OK,
            )
            .await;
            assert_eq!(
                (v["state"].as_str(), v["safe_to_reuse"].as_bool()),
                (Some("success"), Some(true)),
                "{v}"
            );
            assert_eq!(v["reason"], Value::Null, "{v}");
            let t = take(&http, &d, room).await;
            assert_eq!(t["verified"], true, "{t}");
            assert_eq!(
                t["bytes"].as_u64(),
                Some(tokens * TINY_BYTES_PER_TOKEN),
                "{t}"
            );
        }
        take(&http, &d, 3).await;
        assert_eq!(pool(&http, &d).await, (total, total));
        println!(
            "[faults-kill-late] 2 landed rooms still success and verified {:.0} ms after the kill",
            ms(killed.elapsed())
        );
    });
}

// ---------------------------------------------------------------------------------------------
// abort, then reuse the same pages at once
// ---------------------------------------------------------------------------------------------

/// The engine names its pages; room A (llama3-8b, 1024 tokens = 128 MiB) is aborted at a random
/// moment of its transfer; once A is `safe_to_reuse` the same pages go to room B at once, and
/// after a random pause every byte of B verifies: no late write of A lands in B (the corruption
/// of SGLang #24527). 20 rounds, seeded jitter; over ZeroMQ (staged) and, with the `ucx`
/// feature, over UCX shared memory and tcp (placed runs: receives the decode posted into A's
/// pages must be cancelled, revoked or have completed before A is safe).
#[test]
fn abort_mid_transfer_then_reuse_the_same_pages_at_once_never_corrupts() {
    // No death to detect here: a peer is dead only after a minute, so that frames a loaded
    // machine holds up never fail room B `peer_dead`.
    let opts = AgentOpts {
        model: "llama3-8b",
        pool_pages: 272,
        heartbeat_ms: 100,
        peer_dead_ms: 60_000,
        ..AgentOpts::default()
    };
    abort_then_reuse("faults-reuse", &opts.args_all(), &[], "staged");
    #[cfg(feature = "ucx")]
    {
        let mut args = opts.args_all();
        set_flag(&mut args, "--transport", "ucx");
        // Layers ready 2 ms apart: the fast path is still caught mid-transfer.
        args.extend(["--synthetic-layer-ms".to_owned(), "2".to_owned()]);
        // The rooms' pages are shuffled: runs of one 32 KiB page block, below the default
        // floor of placed runs (which would stage them). Placed here, so that their cancel
        // before reuse is what the rounds test.
        set_flag(&mut args, "--placed-min-run-bytes", "32768");
        // Not mapped: over shared memory the prefill would copy into the decode's pool file
        // itself (e2e_mapped aborts such rooms).
        set_flag(&mut args, "--mapped-writes", "never");
        abort_then_reuse(
            "faults-reuse-ucx-shm",
            &args,
            &[("UCX_TLS", "posix,cma,self")],
            "placed",
        );
        // Over tcp the runs come eagerly, copied into A's pages by the decode's own callback:
        // A is safe once its runs are revoked, even those still arriving.
        abort_then_reuse(
            "faults-reuse-ucx-tcp",
            &args,
            &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")],
            "placed",
        );
    }
}

/// One run of the test above; `path`: the data path the chunks must have taken.
fn abort_then_reuse(tag: &str, args: &[String], env: &[(&str, &str)], path: &str) {
    let c = FaultCluster::start_env(tag, args, &[], &[], &[], env);
    let seed = test_seed();
    println!("[{tag}] seed {seed} (KVFERRY_TEST_SEED={seed} replays it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let tokens = 1024usize;
    let room_bytes = tokens as u64 * LLAMA_BYTES_PER_TOKEN;
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        let (mut to_final, mut to_safe) = (Vec::new(), Vec::new());
        for round in 0..20u64 {
            let (a, b) = (1000 + 2 * round, 1001 + 2 * round);
            let mut all: Vec<u32> = (0..272).collect();
            all.shuffle(&mut rng);
            let pages: Vec<u32> = all[..tokens / 16].to_vec();
            let v = request(&http, &d, a, json!({ "tokens": tokens, "pages": pages })).await;
            assert_eq!(v["page_owner"], "engine", "{v}");
            wait_state(&http, &d, a, &["waiting_for_input"], BOUND).await;
            let ready_a = {
                let (http, p) = (http.clone(), p.clone());
                tokio::spawn(async move {
                    let url = format!("{p}/v1/rooms/{a}/ready");
                    call(&http, Method::POST, &url, Some(&json!({ "tokens": tokens }))).await
                })
            };
            let seen = wait_state(&http, &d, a, &["transferring", "success", "failed", "aborted"], BOUND).await;
            let jitter = rng.random_range(0..=30u64);
            tokio::time::sleep(Duration::from_millis(jitter)).await;
            let t = Instant::now();
            expect(&http, Method::DELETE, &format!("{d}/v1/rooms/{a}"), None, StatusCode::OK).await;
            let fin = wait_final(&http, &d, a).await;
            to_final.push(ms(t.elapsed()));
            let (va, unsafe_for) = wait_safe(&http, &d, a).await;
            to_safe.push(ms(unsafe_for));
            let state = va["state"].as_str().unwrap_or_default().to_owned();
            let landed = va["bytes"].as_u64().unwrap_or(0);
            assert!(["aborted", "success"].contains(&state.as_str()), "room A ended {state}: {va}");
            if state == "aborted" {
                assert_reason(&fin, "aborted");
            }
            let key = match (seen["state"].as_str(), state.as_str()) {
                (_, "success") => "success before the abort",
                (Some("transferring"), _) if landed < room_bytes => "aborted mid-transfer",
                _ => "aborted otherwise",
            };
            *outcomes.entry(key.to_owned()).or_default() += 1;
            // A is done with: take it (a success verifies: its bytes are still its own) and
            // hand the very same pages to B straight away.
            let ta = take(&http, &d, a).await;
            if state == "success" {
                assert_eq!(ta["verified"], true, "{ta}");
            }
            request(&http, &d, b, json!({ "tokens": tokens, "pages": pages })).await;
            let (status, body) = ready_a.await.expect("ready task");
            assert!(
                status == StatusCode::ACCEPTED || status == StatusCode::CONFLICT,
                "ready of A: {status} {body}"
            );
            ready(&http, &p, b, tokens).await;
            let vb = wait_final(&http, &d, b).await;
            assert_eq!(vb["state"], "success", "room B: {vb}");
            // A late write of A would land now and spoil B.
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..=100u64))).await;
            let tb = take(&http, &d, b).await;
            assert_eq!(tb["verified"], true, "round {round}: room B's bytes differ: {tb}");
            assert_eq!(tb["bytes"].as_u64(), Some(room_bytes), "{tb}");
            println!(
                "[{tag}] round {round:2}: A seen {} + {jitter:2} ms -> DELETE -> {state} ({landed} B landed), B verified",
                seen["state"]
            );
        }
        assert_eq!(pool(&http, &d).await, (272, 272), "engine pages are never counted");
        poll_until("prefill pages back", BOUND, || async { (pool(&http, &p).await == (272, 272)).then_some(()) }).await;
        to_final.sort_by(f64::total_cmp);
        to_safe.sort_by(f64::total_cmp);
        println!(
            "[{tag}] 20 rounds {outcomes:?}; DELETE -> final p50 {:.1} ms max {:.1} ms; final -> safe_to_reuse p50 {:.1} ms max {:.1} ms; every B verified",
            to_final[10], to_final[19], to_safe[10], to_safe[19]
        );
        assert!(outcomes.get("aborted mid-transfer").copied().unwrap_or(0) > 0, "no round aborted mid-transfer: {outcomes:?}");
        let series = format!("kvferry_chunks_total{{role=\"decode\",path=\"{path}\"}}");
        let chunks = metric(&http, &d, &series).await.unwrap_or(0.0);
        assert!(chunks > 0.0, "[{tag}] no chunk took the {path} path");
        healthy(&http, &d).await;
        healthy(&http, &p).await;
    });
}

// ---------------------------------------------------------------------------------------------
// 1,000 rooms, random aborts on both sides
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Plan {
    NoAbort,
    Decode,
    Prefill,
    Both,
}

#[derive(Debug)]
struct Outcome {
    plan: Plan,
    state: String,
    code: Option<String>,
    verified: Option<bool>,
    ready: StatusCode,
    prefill_delete: Option<StatusCode>,
}

async fn abort_later(http: Client, url: String, after: Duration) -> StatusCode {
    tokio::time::sleep(after).await;
    call(&http, Method::DELETE, &url, None).await.0
}

/// One room of the random-abort run: request at the decode, ready at the prefill (either
/// first), aborts at random moments, then wait until final and safe, and take.
#[allow(clippy::too_many_arguments)] // one room's random script, spelled out at the call
async fn random_room(
    http: Client,
    p: String,
    d: String,
    room: u64,
    tokens: usize,
    plan: Plan,
    delays: [u64; 3],
    ready_first: bool,
) -> Outcome {
    let d_url = format!("{d}/v1/rooms/{room}");
    let p_url = format!("{p}/v1/rooms/{room}");
    let ready_url = format!("{p_url}/ready");
    let body = json!({ "tokens": tokens });
    let ms_ = Duration::from_millis;
    let mut aborts = Vec::new();
    if ready_first {
        let (status, v) = call(&http, Method::POST, &ready_url, Some(&body)).await;
        assert_eq!(status, StatusCode::ACCEPTED, "room {room} ready: {v}");
    }
    let (status, v) = call(&http, Method::POST, &d_url, Some(&body)).await;
    assert_eq!(status, StatusCode::CREATED, "room {room} request: {v}");
    if matches!(plan, Plan::Decode | Plan::Both) {
        aborts.push((
            false,
            tokio::spawn(abort_later(http.clone(), d_url.clone(), ms_(delays[0]))),
        ));
    }
    if matches!(plan, Plan::Prefill | Plan::Both) {
        aborts.push((
            true,
            tokio::spawn(abort_later(http.clone(), p_url.clone(), ms_(delays[1]))),
        ));
    }
    let mut ready = StatusCode::ACCEPTED;
    if !ready_first {
        tokio::time::sleep(ms_(delays[2])).await;
        let (status, v) = call(&http, Method::POST, &ready_url, Some(&body)).await;
        // A ready after an abort of the room is refused; nothing else is.
        let refused_late = status == StatusCode::CONFLICT && plan != Plan::NoAbort;
        assert!(
            status == StatusCode::ACCEPTED || refused_late,
            "room {room} ({plan:?}) ready: {status} {v}"
        );
        ready = status;
    }
    let mut prefill_delete = None;
    for (prefill, task) in aborts {
        let status = task.await.expect("abort task");
        if prefill {
            // 404: the prefill had not heard of the room yet (nothing to abort there).
            assert!(
                [StatusCode::OK, StatusCode::NOT_FOUND, StatusCode::CONFLICT].contains(&status),
                "room {room}: prefill DELETE answered {status}"
            );
            prefill_delete = Some(status);
        } else {
            assert_eq!(status, StatusCode::OK, "room {room}: decode DELETE");
        }
    }
    let (_, _) = wait_safe(&http, &d, room).await;
    let t = expect(
        &http,
        Method::POST,
        &format!("{d_url}/take"),
        None,
        StatusCode::OK,
    )
    .await;
    Outcome {
        plan,
        state: t["state"].as_str().unwrap_or_default().to_owned(),
        code: t["reason"]["code"].as_str().map(str::to_owned),
        verified: t["verified"].as_bool(),
        ready,
        prefill_delete,
    }
}

/// 1,000 tiny rooms, 16 in flight; about 40% get an abort at a random moment from the decode
/// engine (`DELETE` at the decode), the prefill engine (`DELETE` at the prefill) or both. Every
/// room ends final (success verified, or aborted with code `aborted`); afterwards every
/// agent-owned page is back on both agents and the decode's counters add up to 1,000.
#[test]
fn thousand_rooms_with_random_aborts_on_both_sides_account_for_every_page() {
    let opts = fast(AgentOpts {
        pool_pages: 1024,
        room_ttl_ms: 5_000,
        ..AgentOpts::default()
    });
    let c = FaultCluster::start("faults-random-aborts", &opts.args_all(), &[], &[], &[]);
    let seed = test_seed();
    println!("[faults-random-aborts] seed {seed} (KVFERRY_TEST_SEED={seed} replays it)");
    let mut rng = StdRng::seed_from_u64(seed);
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        let (status, v) = call(&http, Method::DELETE, &format!("{p}/v1/rooms/424242"), None).await;
        assert!(
            status == StatusCode::NOT_FOUND || status == StatusCode::OK,
            "the prefill has no abort route (DELETE /v1/rooms/{{room}} answered {status}: {v}); this test needs it"
        );
        let gate = Arc::new(tokio::sync::Semaphore::new(16));
        let mut tasks = tokio::task::JoinSet::new();
        let t = Instant::now();
        for room in 1..=1000u64 {
            let plan = match rng.random_range(0..100) {
                0..60 => Plan::NoAbort,
                60..75 => Plan::Decode,
                75..90 => Plan::Prefill,
                _ => Plan::Both,
            };
            let tokens = rng.random_range(1..=400usize);
            let delays = [rng.random_range(0..=15u64), rng.random_range(0..=15u64), rng.random_range(0..=10u64)];
            let ready_first = rng.random_bool(0.25);
            let (http, p, d, gate) = (http.clone(), p.clone(), d.clone(), gate.clone());
            tasks.spawn(async move {
                let _permit = gate.acquire_owned().await.expect("gate");
                (room, random_room(http, p, d, room, tokens, plan, delays, ready_first).await)
            });
        }
        let mut outcomes = Vec::new();
        while let Some(r) = tasks.join_next().await {
            outcomes.push(r.expect("room task"));
        }
        let wall = t.elapsed();
        assert_eq!(outcomes.len(), 1000);
        let mut table: BTreeMap<(Plan, String, Option<String>), usize> = BTreeMap::new();
        let mut refused_ready = 0;
        let mut prefill_404 = 0;
        // Every anomaly is collected, so one run reports them all.
        let mut problems: Vec<String> = Vec::new();
        for (room, o) in &outcomes {
            *table.entry((o.plan, o.state.clone(), o.code.clone())).or_default() += 1;
            refused_ready += usize::from(o.ready == StatusCode::CONFLICT);
            prefill_404 += usize::from(o.prefill_delete == Some(StatusCode::NOT_FOUND));
            match o.state.as_str() {
                "success" if o.verified == Some(true) => {}
                "aborted" if o.plan != Plan::NoAbort && o.code.as_deref() == Some("aborted") => {}
                _ => problems.push(format!("room {room}: {o:?}")),
            }
        }
        for ((plan, state, code), n) in &table {
            println!("[faults-random-aborts]   {plan:?} -> {state} {code:?}: {n}");
        }
        println!(
            "[faults-random-aborts] 1000 rooms in {:.1} s: {refused_ready} late readies refused (409), {prefill_404} prefill DELETEs before the prefill knew the room (404)",
            wall.as_secs_f64()
        );
        let d_pool = pool(&http, &d).await;
        if d_pool != (1024, 1024) {
            problems.push(format!("decode pool after every take: {d_pool:?}"));
        }
        let t = Instant::now();
        let p_pool = loop {
            let got = pool(&http, &p).await;
            if got == (1024, 1024) || t.elapsed() > BOUND {
                break got;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        println!("[faults-random-aborts] prefill pool {p_pool:?} {:.0} ms after the last take", ms(t.elapsed()));
        if p_pool != (1024, 1024) {
            problems.push(format!("prefill pool {BOUND:?} after the last take: {p_pool:?}"));
        }
        let mut sum = 0.0;
        for state in ["success", "failed", "aborted"] {
            let n = metric(&http, &d, &format!("kvferry_rooms_total{{role=\"decode\",state=\"{state}\"}}")).await;
            let n = n.unwrap_or_else(|| panic!("no decode rooms_total {state}"));
            let want = outcomes.iter().filter(|(_, o)| o.state == state).count() as f64;
            if n != want {
                problems.push(format!("decode kvferry_rooms_total {state} = {n}, {want} rooms ended {state}"));
            }
            sum += n;
        }
        if sum != 1000.0 {
            problems.push(format!("decode success + failed + aborted = {sum}, not 1000"));
        }
        let p_counts: Vec<String> = prefill_counts(&http, &p).await;
        println!("[faults-random-aborts] prefill counters: {}", p_counts.join(", "));
        assert!(problems.is_empty(), "{} problems (seed {seed}):\n{}", problems.len(), problems.join("\n"));
        healthy(&http, &d).await;
        healthy(&http, &p).await;
    });
}

async fn prefill_counts(http: &Client, api: &str) -> Vec<String> {
    let mut out = Vec::new();
    for state in ["success", "failed", "aborted"] {
        let n = metric(
            http,
            api,
            &format!("kvferry_rooms_total{{role=\"prefill\",state=\"{state}\"}}"),
        )
        .await;
        out.push(format!("{state} {}", n.unwrap_or(f64::NAN)));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// checksums
// ---------------------------------------------------------------------------------------------

/// With `--checksum` on both agents and the prefill's fault hook flipping a byte of a chunk it
/// sends (after checksumming), that room fails with code `checksum` (never lands as success);
/// later rooms verify. The hook is armed while the prefill runs, after it sent rooms already
/// (`--fault-injection`: `POST /v1/faults` on its engine API, the 3rd chunk from then on);
/// without `--fault-injection` that route does not exist. Without the hook, rooms of many chunks
/// verify.
#[test]
fn a_corrupted_chunk_fails_its_room_with_checksum_and_clean_rooms_verify() {
    require_flags("prefill", &["--checksum"]);
    require_flags("decode", &["--checksum"]);
    let opts = fast(AgentOpts::default());
    let both = ["--checksum", "--chunk-bytes", "65536"];
    let c = FaultCluster::start(
        "faults-checksum",
        &opts.args_all(),
        &both,
        &both,
        &[("KVFERRY_FAULT_INJECTION", "1")],
    );
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        let (total, _) = pool(&http, &d).await;
        // Rooms before the fault is armed land intact.
        let before = drive_rooms(&Apis::pair(&p, &d), vec![(10, 100), (11, 300)], 2)
            .await
            .expect("rooms before the fault");
        assert!(before.iter().all(|r| r.verified), "{before:?}");
        let faults = format!("{p}/v1/faults");
        let arm = json!({ "corrupt_chunk": 3 });
        let armed = expect(&http, Method::POST, &faults, Some(&arm), StatusCode::OK).await;
        let sent = armed["chunks_sent"].as_u64().expect("chunks_sent");
        assert!(sent > 0, "{armed}");
        assert_eq!(armed["corrupt_chunk"], sent + 3, "{armed}");
        // 512 tiny tokens = 512 KiB = 8 chunks of 64 KiB: the 3rd chunk from now is in it.
        failing_room(
            &http,
            (&p, &d),
            (1, 512),
            "[faults-checksum] corrupted room",
            "checksum",
        )
        .await;
        let (v, _) = wait_safe(&http, &d, 1).await;
        let tk = take(&http, &d, 1).await;
        assert_eq!(tk["state"], "failed", "{tk} {v}");
        assert_eq!(pool(&http, &d).await, (total, total));
        let n = metric(
            &http,
            &d,
            "kvferry_room_failures_total{role=\"decode\",code=\"checksum\"}",
        )
        .await;
        assert_eq!(n, Some(1.0));
        let pv = wait_final(&http, &p, 1).await;
        println!(
            "[faults-checksum] the prefill's view of it: {} {}",
            pv["state"], pv["reason"]
        );
        // Small rooms (2 chunks each) after it land intact.
        let rooms: Vec<(u64, usize)> = (2..=6).map(|r| (r, 100)).collect();
        let results = drive_rooms(&Apis::pair(&p, &d), rooms, 4)
            .await
            .expect("rooms after the corruption");
        assert!(results.iter().all(|r| r.verified), "{results:?}");
        healthy(&http, &d).await;
    });
    drop(c);

    let c = FaultCluster::start("faults-checksum-clean", &opts.args_all(), &both, &both, &[]);
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        // Fault injection is off by default: the route does not exist.
        let arm = json!({ "corrupt_chunk": 1 });
        expect(&http, Method::POST, &format!("{p}/v1/faults"), Some(&arm), StatusCode::NOT_FOUND).await;
        let rooms: Vec<(u64, usize)> = (1..=20).map(|r| (r, 100 + (r as usize * 97) % 900)).collect();
        let t = Instant::now();
        let results = drive_rooms(&Apis::pair(&p, &d), rooms, 4).await.expect("clean rooms");
        assert!(results.iter().all(|r| r.verified && r.state == "success"), "{results:?}");
        let n = metric(&http, &d, "kvferry_room_failures_total{role=\"decode\",code=\"checksum\"}").await;
        assert_eq!(n, Some(0.0));
        println!("[faults-checksum-clean] 20 rooms (2..16 chunks each) checksummed and verified in {:.0} ms", ms(t.elapsed()));
    });
}

/// A decode the prefill found dead while it was alive (cut off, or starved of CPU; here the
/// prefill's `--peer-dead-ms` cut to 50 ms while the decode's heartbeats are 20 s or 100 ms
/// apart) is told so as soon as it speaks again on its connection, and greets again at once,
/// though its own `--peer-dead-ms` (60 s) never finds the prefill silent: a room it asks for
/// then fails `peer_dead` saying so (never `bad_message`, "before Hello"), or, when a heartbeat
/// spoke first, nothing fails; the rooms after land, every byte verified.
#[test]
fn a_decode_the_prefill_forgot_is_told_and_greets_again_at_once() {
    for (heartbeat_ms, tag) in [(20_000, "faults-forgot-room"), (100, "faults-forgot-beat")] {
        let opts = AgentOpts {
            heartbeat_ms,
            peer_dead_ms: 60_000,
            ..AgentOpts::default()
        };
        let c = FaultCluster::start_env(
            tag,
            &opts.args_all(),
            &[],
            &[],
            &[],
            &[("KVFERRY_FAULT_INJECTION", "1")],
        );
        runtime().block_on(async {
            let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
            let apis = Apis::pair(&p, &d);
            let first = drive_rooms(&apis, vec![(1, 100)], 1).await.expect("room 1");
            assert!(first.iter().all(|r| r.verified), "{first:?}");
            let faults = format!("{p}/v1/faults");
            let cut = json!({ "timeouts": { "heartbeat_ms": 20, "peer_dead_ms": 50 } });
            let was = expect(&http, Method::POST, &faults, Some(&cut), StatusCode::OK).await;
            let dead = |api: &str, role: &str| {
                let (http, api) = (http.clone(), api.to_owned());
                let series = format!("kvferry_peers_dead_total{{role=\"{role}\"}}");
                async move { metric(&http, &api, &series).await }
            };
            poll_until("the prefill finds the decode dead", BOUND, || async {
                (dead(&p, "prefill").await == Some(1.0)).then_some(())
            })
            .await;
            let back = json!({ "timeouts": was["timeouts_were"] });
            expect(&http, Method::POST, &faults, Some(&back), StatusCode::OK).await;
            let forgotten = Instant::now();
            if heartbeat_ms > 1000 {
                // No heartbeat before the room: its request is what the prefill answers.
                let what = format!("[{tag}] a room asked on the forgotten connection");
                let v = failing_room(&http, (&p, &d), (2, 100), &what, "peer_dead").await;
                let message = v["reason"]["message"].as_str().unwrap_or_default();
                assert!(message.contains("say Hello again"), "{message}");
                take(&http, &d, 2).await;
            }
            poll_until("the decode drops the forgotten connection", BOUND, || async {
                (dead(&d, "decode").await == Some(1.0)).then_some(())
            })
            .await;
            println!(
                "[{tag}] the decode dropped the connection {:.0} ms after the prefill forgot it (heartbeat {heartbeat_ms} ms, its peer-dead 60 s)",
                ms(forgotten.elapsed())
            );
            let after = drive_rooms(&apis, (3..=6).map(|r| (r, 100 + 37 * r as usize)).collect(), 2)
                .await
                .expect("rooms after");
            assert!(after.iter().all(|r| r.state == "success" && r.verified), "{after:?}");
            let before_hello = metric(&http, &p, "kvferry_protocol_errors_total{role=\"prefill\",kind=\"inconsistent\"}").await;
            assert!(before_hello.unwrap_or(0.0) == 0.0, "a request refused as sent before a Hello: {before_hello:?}");
            healthy(&http, &d).await;
        });
    }
}

/// Room `room` of `tokens` asked at the decode and announced at the prefill (`apis`), which
/// must end `failed` with `code`; printed with `what` and the time it took. Its view.
async fn failing_room(
    http: &Client,
    (p, d): (&str, &str),
    (room, tokens): (u64, usize),
    what: &str,
    code: &str,
) -> Value {
    request(http, d, room, json!({ "tokens": tokens })).await;
    let t = Instant::now();
    ready(http, p, room, tokens).await;
    let v = wait_final(http, d, room).await;
    println!(
        "{what}: {} {} after {:.0} ms",
        v["state"],
        v["reason"],
        ms(t.elapsed())
    );
    assert_eq!(v["state"], "failed", "{v}");
    assert_reason(&v, code);
    v
}

/// Both agents' timeouts change while they run (`--fault-injection`: `POST /v1/faults` with
/// `{"timeouts": ...}`), started 600 s long so that only the change can end a room within the
/// test: the decode's ready timeout cut to 300 ms fails a room the prefill never announces with
/// `timeout_ready`; the prefill's room TTL cut to 300 ms expires a ready room no decode asks
/// for. Each answer gives the timeouts before and after; the ones before set them back.
/// Refused with 400, changing nothing: values the flags' checks refuse together, an unknown
/// name, a chunk to corrupt on a decode.
#[test]
fn timeouts_changed_while_the_agents_run_end_rooms_by_their_new_values() {
    let opts = fast(AgentOpts {
        timeout_ready_ms: 600_000,
        room_ttl_ms: 600_000,
        ..AgentOpts::default()
    });
    let c = FaultCluster::start_env(
        "faults-timeouts",
        &opts.args_all(),
        &[],
        &[],
        &[],
        &[("KVFERRY_FAULT_INJECTION", "1")],
    );
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        let set = |api: &str, body: Value, status: StatusCode| {
            let (http, url) = (http.clone(), format!("{api}/v1/faults"));
            async move { expect(&http, Method::POST, &url, Some(&body), status).await }
        };
        let cut = set(
            &d,
            json!({ "timeouts": { "timeout_ready_ms": 300 } }),
            StatusCode::OK,
        )
        .await;
        assert_eq!(cut["timeouts_were"]["timeout_ready_ms"], 600_000, "{cut}");
        assert_eq!(cut["timeouts"]["timeout_ready_ms"], 300, "{cut}");
        assert_eq!(
            cut["timeouts"]["room_ttl_ms"], 600_000,
            "a timeout not named keeps its value: {cut}"
        );
        let t = Instant::now();
        request(&http, &d, 1, json!({ "tokens": 64 })).await;
        let v = wait_final(&http, &d, 1).await;
        println!(
            "[faults-timeouts] a room never announced: {} {} after {:.0} ms",
            v["state"],
            v["reason"],
            ms(t.elapsed())
        );
        assert_eq!(v["state"], "failed", "{v}");
        assert_reason(&v, "timeout_ready");
        let back = set(
            &d,
            json!({ "timeouts": cut["timeouts_were"] }),
            StatusCode::OK,
        )
        .await;
        assert_eq!(back["timeouts"], cut["timeouts_were"], "{back}");

        let cut = set(
            &p,
            json!({ "timeouts": { "room_ttl_ms": 300 } }),
            StatusCode::OK,
        )
        .await;
        assert_eq!(cut["timeouts_were"]["room_ttl_ms"], 600_000, "{cut}");
        let t = Instant::now();
        ready(&http, &p, 2, 64).await;
        let expired = "kvferry_rooms_expired_total{role=\"prefill\"}";
        poll_until(
            "the prefill expires the room nobody asked for",
            BOUND,
            || async { (metric(&http, &p, expired).await == Some(1.0)).then_some(()) },
        )
        .await;
        println!(
            "[faults-timeouts] a ready room nobody asked for expired after {:.0} ms",
            ms(t.elapsed())
        );

        let now = set(&d, json!({}), StatusCode::OK).await["timeouts"].clone();
        for (api, body, says) in [
            (
                &d,
                json!({ "timeouts": { "heartbeat_ms": 5000 } }),
                "--peer-dead-ms",
            ),
            (
                &p,
                json!({ "timeouts": { "room_max_ms": 100 } }),
                "--room-max-ms",
            ),
            (
                &d,
                json!({ "timeouts": { "room_ttl": 1 } }),
                "unknown field",
            ),
            (&d, json!({ "corrupt_chunk": 1 }), "sends no chunks"),
        ] {
            let refused = set(api, body.clone(), StatusCode::BAD_REQUEST).await;
            assert!(refused.to_string().contains(says), "{body}: {refused}");
        }
        assert_eq!(
            set(&d, json!({}), StatusCode::OK).await["timeouts"],
            now,
            "a refusal changed the decode's timeouts"
        );
        healthy(&http, &d).await;
    });
}

/// Without `--checksum`, a chunk the prefill's fault hook inverts lands and its room succeeds;
/// the synthetic check on take then fails the room with `verify_failed`, naming the first head
/// slice whose stamp is not the room's, in both `--synthetic-verify` modes (set on both
/// agents). A clean room after it verifies.
#[test]
fn a_corrupted_chunk_without_checksums_fails_the_synthetic_check_in_both_modes() {
    require_flags("decode", &["--synthetic-verify"]);
    let opts = fast(AgentOpts::default());
    for mode in ["stamp", "full"] {
        let tag = format!("faults-verify-{mode}");
        let both = ["--chunk-bytes", "65536", "--synthetic-verify", mode];
        let c = FaultCluster::start(
            &tag,
            &opts.args_all(),
            &both,
            &both,
            &[("KVFERRY_FAULT_CORRUPT_CHUNK", "3")],
        );
        runtime().block_on(async {
            let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
            // 512 tiny tokens = 512 KiB = 8 chunks of 64 KiB: the 3rd chunk is in it.
            request(&http, &d, 1, json!({ "tokens": 512 })).await;
            ready(&http, &p, 1, 512).await;
            let v = wait_final(&http, &d, 1).await;
            assert_eq!(
                v["state"], "success",
                "{tag}: nothing checks the chunk: {v}"
            );
            wait_safe(&http, &d, 1).await;
            let tk = take(&http, &d, 1).await;
            assert_eq!(
                (&tk["verified"], &tk["state"], &tk["reason"]["code"]),
                (&json!(false), &json!("failed"), &json!("verify_failed")),
                "{tag}: {tk}"
            );
            let message = tk["reason"]["message"].as_str().unwrap_or_default();
            assert!(
                message.starts_with("the stamp of head ")
                    && message.contains("no stamp of this room"),
                "{tag}: {message}"
            );
            println!("[{tag}] {message}");
            let n = metric(&http, &d, "kvferry_verify_failures_total{role=\"decode\"}").await;
            assert_eq!(n, Some(1.0), "{tag}");
            let results = drive_rooms(&Apis::pair(&p, &d), vec![(2, 300)], 1)
                .await
                .expect("a room after the corruption");
            assert!(results.iter().all(|r| r.verified), "{tag}: {results:?}");
        });
    }
}

// ---------------------------------------------------------------------------------------------
// admission
// ---------------------------------------------------------------------------------------------

/// `--max-rooms 4` and a 64-page pool: the 5th room in flight gets 429 at once with a JSON
/// error saying why, a refused room leaves no trace, a burst admits exactly what fits, the pool
/// also refuses what it cannot hold, and every admitted room verifies.
#[test]
fn max_rooms_admission_refuses_with_429_at_once_and_loses_nothing() {
    require_flags("decode", &["--max-rooms"]);
    let opts = fast(AgentOpts {
        pool_pages: 64,
        ..AgentOpts::default()
    });
    let c = FaultCluster::start(
        "faults-admission",
        &opts.args_all(),
        &[],
        &["--max-rooms", "4"],
        &[],
    );
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        for room in 1..=4u64 {
            request(&http, &d, room, json!({ "tokens": 32 })).await;
        }
        assert_eq!(pool(&http, &d).await, (64, 56));
        let t = Instant::now();
        let got = call(
            &http,
            Method::POST,
            &format!("{d}/v1/rooms/5"),
            Some(&json!({ "tokens": 32 })),
        )
        .await;
        let took = t.elapsed();
        let message = got.1["error"].as_str().unwrap_or_default().to_lowercase();
        assert_error(
            "5th room beyond --max-rooms 4",
            got,
            StatusCode::TOO_MANY_REQUESTS,
        );
        println!("[faults-admission] 429 in {:.1} ms", ms(took));
        assert!(took < Duration::from_secs(2), "the refusal took {took:?}");
        assert!(
            message.contains("room"),
            "the error does not say why: {message}"
        );
        assert_error(
            "refused room left no trace",
            call(&http, Method::GET, &format!("{d}/v1/rooms/5"), None).await,
            StatusCode::NOT_FOUND,
        );
        assert_eq!(
            pool(&http, &d).await,
            (64, 56),
            "a refused room holds no page"
        );

        // A burst while full: all refused.
        let burst = |rooms: std::ops::Range<u64>, tokens: usize| {
            let (http, d) = (http.clone(), d.clone());
            async move {
                let mut set = tokio::task::JoinSet::new();
                for room in rooms {
                    let (http, d) = (http.clone(), d.clone());
                    set.spawn(async move {
                        let url = format!("{d}/v1/rooms/{room}");
                        (
                            room,
                            call(
                                &http,
                                Method::POST,
                                &url,
                                Some(&json!({ "tokens": tokens })),
                            )
                            .await,
                        )
                    });
                }
                let mut out = Vec::new();
                while let Some(r) = set.join_next().await {
                    out.push(r.expect("burst task"));
                }
                out.sort_by_key(|(room, _)| *room);
                out
            }
        };
        for (room, (status, v)) in burst(10..18, 32).await {
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "room {room}: {v}");
        }
        for room in 1..=4u64 {
            ready(&http, &p, room, 32).await;
        }
        for room in 1..=4u64 {
            assert_eq!(wait_final(&http, &d, room).await["state"], "success");
            assert_eq!(take(&http, &d, room).await["verified"], true);
        }
        assert_eq!(pool(&http, &d).await, (64, 64));

        // Room for 4 again: a burst of 12 admits exactly 4.
        let got = burst(20..32, 32).await;
        let admitted: Vec<u64> = got
            .iter()
            .filter(|(_, (s, _))| *s == StatusCode::CREATED)
            .map(|(r, _)| *r)
            .collect();
        for (room, (status, v)) in &got {
            assert!(
                *status == StatusCode::CREATED
                    || (*status == StatusCode::TOO_MANY_REQUESTS && v["error"].is_string()),
                "room {room}: {status} {v}"
            );
        }
        println!("[faults-admission] burst of 12 with room for 4: admitted {admitted:?}");
        assert_eq!(admitted.len(), 4, "{got:?}");
        for &room in &admitted {
            ready(&http, &p, room, 32).await;
        }
        for &room in &admitted {
            assert_eq!(wait_final(&http, &d, room).await["state"], "success");
            assert_eq!(take(&http, &d, room).await["verified"], true);
        }

        // The pool refuses what it cannot hold, even under the room cap: 2 x 30 pages fit, a
        // 3rd does not.
        for room in 40..42u64 {
            request(&http, &d, room, json!({ "tokens": 480 })).await;
        }
        let got = call(
            &http,
            Method::POST,
            &format!("{d}/v1/rooms/42"),
            Some(&json!({ "tokens": 480 })),
        )
        .await;
        assert_error(
            "a room beyond the free pages",
            got,
            StatusCode::TOO_MANY_REQUESTS,
        );
        for room in 40..42u64 {
            ready(&http, &p, room, 480).await;
        }
        for room in 40..42u64 {
            assert_eq!(wait_final(&http, &d, room).await["state"], "success");
            assert_eq!(take(&http, &d, room).await["verified"], true);
        }
        assert_eq!(pool(&http, &d).await, (64, 64));
        let ok = metric(
            &http,
            &d,
            "kvferry_rooms_total{role=\"decode\",state=\"success\"}",
        )
        .await;
        assert_eq!(ok, Some(10.0), "every admitted room landed");
        healthy(&http, &d).await;
    });
}

// ---------------------------------------------------------------------------------------------
// drain
// ---------------------------------------------------------------------------------------------

/// Polls the decode's views of `rooms` until each is final (taking it once safe), or the decode
/// is gone; returns the last view of each and when it was first seen final.
async fn follow_rooms(
    http: &Client,
    d: &str,
    rooms: &[u64],
    take_them: bool,
    bound: Duration,
) -> BTreeMap<u64, (Value, Option<Duration>, Option<Value>)> {
    let start = Instant::now();
    let mut out: BTreeMap<u64, (Value, Option<Duration>, Option<Value>)> = rooms
        .iter()
        .map(|r| (*r, (Value::Null, None, None)))
        .collect();
    while start.elapsed() < bound {
        let mut pending = false;
        for (room, (view, final_at, taken)) in out.iter_mut() {
            if taken.is_some() || (!take_them && final_at.is_some()) {
                continue;
            }
            match try_call(http, Method::GET, &format!("{d}/v1/rooms/{room}"), None).await {
                Some((StatusCode::OK, v)) => {
                    let fin = FINAL.contains(&v["state"].as_str().unwrap_or(""));
                    if fin && final_at.is_none() {
                        *final_at = Some(start.elapsed());
                    }
                    if fin
                        && take_them
                        && v["safe_to_reuse"] == true
                        && let Some((StatusCode::OK, t)) = try_call(
                            http,
                            Method::POST,
                            &format!("{d}/v1/rooms/{room}/take"),
                            None,
                        )
                        .await
                    {
                        *taken = Some(t);
                    }
                    *view = v;
                    pending |= taken.is_none() && (take_them || !fin);
                }
                Some(_) => {}
                None => return out, // the agent is gone
            }
        }
        if !pending {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    out
}

/// SIGTERM to a decode with rooms in flight: new requests get 503 while it drains, the rooms
/// that can finish do (and are taken), the one whose prefill never gets ready is aborted with a
/// reason when `--drain-timeout-ms` runs out, the decode deregisters and exits 0.
#[test]
fn sigterm_drains_a_decode_finishes_in_flight_rooms_deregisters_and_exits_0() {
    require_flags("decode", &["--drain-timeout-ms"]);
    let drain_ms = 3000u64;
    let mut args = fast(AgentOpts::default()).args_all();
    set_flag(&mut args, "--drain-timeout-ms", &drain_ms.to_string());
    // 4 layers x 300 ms: a room takes ~1.2 s from ready to success.
    let mut c = FaultCluster::start(
        "faults-drain-decode",
        &args,
        &["--synthetic-layer-ms", "300"],
        &[],
        &[],
    );
    let instance = c.decode.field("instance").unwrap();
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        assert!(registered(&http, &c.registry_url).await.contains(&instance));
        for room in 1..=4u64 {
            request(&http, &d, room, json!({ "tokens": 64 })).await;
        }
        wait_state(&http, &d, 4, &["waiting_for_input"], BOUND).await;
        // Room 1 held mid-transfer (its first half announced) at the SIGTERM, and finished
        // during the drain; rooms 2 and 3 announced whole.
        ready_piece(&http, &p, 1, 64, 0..32, false).await;
        for room in 2..=3u64 {
            ready(&http, &p, room, 64).await;
        }
        wait_state(&http, &d, 1, &["transferring"], BOUND).await;
        c.decode.signal("TERM").unwrap();
        let t = Instant::now();
        tokio::time::sleep(Duration::from_millis(200)).await;
        ready_piece(&http, &p, 1, 64, 32..64, true).await;
        let got = try_call(&http, Method::POST, &format!("{d}/v1/rooms/99"), Some(&json!({ "tokens": 16 }))).await;
        let got = got.expect("the draining decode still answers its API");
        assert_error("a new room while draining", got, StatusCode::SERVICE_UNAVAILABLE);
        let rooms = follow_rooms(&http, &d, &[1, 2, 3, 4], true, BOUND).await;
        let mut problems = Vec::new();
        for (room, (v, final_at, taken)) in &rooms {
            println!(
                "[faults-drain-decode] room {room}: {} {} final {:?} after SIGTERM, taken: {}",
                v["state"],
                v["reason"],
                final_at.map(|d| format!("{:.0} ms", ms(d))),
                taken.as_ref().map_or("no".to_owned(), |t| format!("verified {}", t["verified"]))
            );
            let state = v["state"].as_str().unwrap_or_default();
            if !FINAL.contains(&state) {
                problems.push(format!("room {room} was never seen final (with a reason) before the decode exited: {v}"));
            } else if *room <= 3 {
                assert_eq!(state, "success", "an in-flight room that could finish did not: {v}");
                if let Some(t) = taken {
                    assert_eq!(t["verified"], true, "{t}");
                }
            } else {
                assert_ne!(state, "success", "{v}");
                assert!(v["reason"]["code"].is_string(), "room 4 ended without a reason: {v}");
                let fin = final_at.expect("room 4 final");
                assert!(fin <= Duration::from_millis(drain_ms + 2000), "room 4 aborted {fin:?} after SIGTERM");
            }
        }
        let status = tokio::task::block_in_place(|| c.decode.wait_exit(Duration::from_millis(drain_ms) + BOUND));
        let exited = t.elapsed();
        let status = status.expect("the decode did not exit");
        println!("[faults-drain-decode] exited {status} {:.0} ms after SIGTERM (drain timeout {drain_ms} ms)", ms(exited));
        assert!(status.success(), "exit status {status}; log {}", c.decode.log.display());
        assert!(!registered(&http, &c.registry_url).await.contains(&instance), "the drained decode is still registered");
        let pv = wait_final(&http, &p, 4).await;
        println!("[faults-drain-decode] the prefill's view of room 4: {} {}", pv["state"], pv["reason"]);
        healthy(&http, &p).await;
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    });
}

/// SIGTERM to a prefill with rooms in flight: new readies get 503 while it drains, the rooms in
/// flight land (verified at the decode), the one never ready ends with a reason at the decode,
/// and the prefill deregisters and exits 0.
#[test]
fn sigterm_drains_a_prefill_finishes_in_flight_rooms_deregisters_and_exits_0() {
    require_flags("prefill", &["--drain-timeout-ms"]);
    let drain_ms = 3000u64;
    let mut args = fast(AgentOpts::default()).args_all();
    set_flag(&mut args, "--drain-timeout-ms", &drain_ms.to_string());
    let mut c = FaultCluster::start(
        "faults-drain-prefill",
        &args,
        &["--synthetic-layer-ms", "300"],
        &[],
        &[],
    );
    let instance = c.prefill.field("instance").unwrap();
    runtime().block_on(async {
        let (http, d, p) = (http(), c.decode_api.clone(), c.prefill_api.clone());
        assert!(registered(&http, &c.registry_url).await.contains(&instance));
        for room in 1..=4u64 {
            request(&http, &d, room, json!({ "tokens": 64 })).await;
        }
        wait_state(&http, &d, 4, &["waiting_for_input"], BOUND).await;
        // Room 1 held mid-transfer (its first half announced) at the SIGTERM, and finished
        // during the drain; rooms 2 and 3 announced whole.
        ready_piece(&http, &p, 1, 64, 0..32, false).await;
        for room in 2..=3u64 {
            ready(&http, &p, room, 64).await;
        }
        wait_state(&http, &d, 1, &["transferring"], BOUND).await;
        c.prefill.signal("TERM").unwrap();
        let t = Instant::now();
        tokio::time::sleep(Duration::from_millis(200)).await;
        ready_piece(&http, &p, 1, 64, 32..64, true).await;
        let got = try_call(&http, Method::POST, &format!("{p}/v1/rooms/99/ready"), Some(&json!({ "tokens": 16 }))).await;
        let got = got.expect("the draining prefill still answers its API");
        assert_error("a new ready while draining", got, StatusCode::SERVICE_UNAVAILABLE);
        let rooms = follow_rooms(&http, &d, &[1, 2, 3, 4], true, BOUND).await;
        for (room, (v, final_at, taken)) in &rooms {
            println!(
                "[faults-drain-prefill] room {room}: {} {} final {:?} after SIGTERM, verified {}",
                v["state"],
                v["reason"],
                final_at.map(|d| format!("{:.0} ms", ms(d))),
                taken.as_ref().map_or(Value::Null, |t| t["verified"].clone())
            );
            let state = v["state"].as_str().unwrap_or_default();
            assert!(FINAL.contains(&state), "room {room} never became final: {v}");
            if *room <= 3 {
                assert_eq!(state, "success", "{v}");
                assert_eq!(taken.as_ref().map(|t| t["verified"].clone()), Some(json!(true)), "{v}");
            } else {
                assert_ne!(state, "success", "{v}");
                assert!(v["reason"]["code"].is_string(), "room 4 ended without a reason: {v}");
                let fin = final_at.expect("room 4 final");
                assert!(fin <= Duration::from_millis(drain_ms + 3000), "room 4 ended {fin:?} after SIGTERM");
            }
        }
        let status = tokio::task::block_in_place(|| c.prefill.wait_exit(Duration::from_millis(drain_ms) + BOUND));
        let exited = t.elapsed();
        let status = status.expect("the prefill did not exit");
        println!("[faults-drain-prefill] exited {status} {:.0} ms after SIGTERM (drain timeout {drain_ms} ms)", ms(exited));
        assert!(status.success(), "exit status {status}; log {}", c.prefill.log.display());
        assert!(!registered(&http, &c.registry_url).await.contains(&instance), "the drained prefill is still registered");
        assert_eq!(pool(&http, &d).await.1, pool(&http, &d).await.0, "decode pages after the takes");
        healthy(&http, &d).await;
    });
}
