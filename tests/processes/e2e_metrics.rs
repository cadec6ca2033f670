//! Observability over real processes: a registry, a prefill and a decode agent (release binary)
//! run rooms that succeed, one the decode engine aborts (DELETE), one whose prefill engine never
//! announces it (`timeout_ready`) and one whose registry cannot be reached
//! (`timeout_bootstrap`). Then `/metrics` of every process must count exactly those rooms, a
//! failed room's code must be the same in its room JSON and in the metrics, and every
//! endpoint's text must be OpenMetrics that a strict parser accepts.

use crate::common;

use std::collections::BTreeMap;

use common::*;
use kvferry::cluster::{Apis, drive_rooms};
use reqwest::{Method, StatusCode};
use serde_json::json;

/// The decode's ready timeout: the room the prefill engine never announces fails after it.
const DECODE_READY_MS: u64 = 3_000;

/// Every sample of a Prometheus text: `name{labels}` -> value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad sample line {l:?}"));
            let value: f64 = value
                .parse()
                .unwrap_or_else(|e| panic!("bad value in {l:?}: {e}"));
            (series.to_owned(), value)
        })
        .collect()
}

/// The labelled samples of `family` whose labels start with `prefix` (e.g. `role="decode",`),
/// keyed by the value of `label`.
fn by_label(
    s: &BTreeMap<String, f64>,
    family: &str,
    prefix: &str,
    label: &str,
) -> BTreeMap<String, f64> {
    let head = format!("{family}{{{prefix}");
    s.iter()
        .filter_map(|(series, v)| {
            let rest = series.strip_prefix(&head)?;
            let value = rest
                .split(&format!("{label}=\""))
                .nth(1)?
                .split('"')
                .next()?;
            Some((value.to_owned(), *v))
        })
        .collect()
}

/// The sum of every series of `family` for `role` (whatever other labels it carries).
fn role_sum(s: &BTreeMap<String, f64>, family: &str, role: &str) -> f64 {
    let label = format!("role=\"{role}\"");
    s.iter()
        .filter(|(series, _)| {
            series
                .strip_prefix(family)
                .and_then(|rest| rest.strip_prefix('{'))
                .is_some_and(|labels| labels.split(',').any(|l| l.trim_end_matches('}') == label))
        })
        .map(|(_, v)| v)
        .sum()
}

async fn metrics_text(http: &reqwest::Client, base: &str) -> String {
    let resp = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(resp.status(), StatusCode::OK, "{base}/metrics");
    let ctype = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert_eq!(
        ctype,
        kvferry_wire::http::OPENMETRICS_CONTENT_TYPE,
        "{base}/metrics content type"
    );
    resp.text().await.expect("metrics text")
}

/// Checks that `text` is OpenMetrics a strict parser accepts: every sample in a family
/// declared before it, names and types consistent, `# EOF` at the end.
fn openmetrics_check(what: &str, text: &str) {
    match openmetrics_parser::openmetrics::parse_openmetrics(text) {
        Ok(e) => println!("{what}: valid OpenMetrics, {} families", e.families.len()),
        Err(e) => panic!("the {what} metrics are not OpenMetrics: {e:?}\n--- the text:\n{text}"),
    }
}

#[test]
fn metrics_count_rooms_done_and_failed_and_are_valid_openmetrics() {
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir("e2e-metrics").expect("log dir");
    let registry = common::spawn(
        &exe,
        &[],
        "registry",
        &owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]),
        &[],
        &logs,
    );
    let url = registry.field("url").unwrap();
    let prefill_opts = AgentOpts {
        pool_pages: 256,
        ..AgentOpts::default()
    };
    let decode_opts = AgentOpts {
        timeout_ready_ms: DECODE_READY_MS,
        timeout_bootstrap_ms: 2_000,
        ..prefill_opts.clone()
    };
    // A registry nothing listens on, which the decode trusts: a room naming it fails
    // timeout_bootstrap.
    let dead_registry = format!("http://127.0.0.1:{}", closed_port());
    let agent = |role: &str, opts: &AgentOpts, extra: &[&str]| {
        let mut args = owned(&[role, "--bootstrap", &url]);
        args.extend(opts.args());
        args.extend(owned(extra));
        common::spawn(&exe, &[], role, &args, &[], &logs)
    };
    let prefill = agent("prefill", &prefill_opts, &[]);
    let decode = agent(
        "decode",
        &decode_opts,
        &["--allowed-registries", &dead_registry],
    );
    let (p, d) = (prefill.field("api").unwrap(), decode.field("api").unwrap());
    println!(
        "[e2e-metrics] registry {url}, prefill {p}, decode {d}; logs in {}",
        logs.display()
    );

    runtime().block_on(async {
        let http = http();
        let (total, _) = pool(&http, &d).await;
        let room_url = |api: &str, room: u64| format!("{api}/v1/rooms/{room}");
        // Rooms the decode engine asks for that must fail: the prefill engine never announces
        // 200 (timeout_ready); 300 names a registry nothing listens on (timeout_bootstrap).
        let (never_ready, no_registry, aborted) = (200u64, 300u64, 100u64);
        expect(
            &http,
            Method::POST,
            &room_url(&d, never_ready),
            Some(&json!({"tokens": 64})),
            StatusCode::CREATED,
        )
        .await;
        let body = json!({"tokens": 64, "bootstrap": dead_registry});
        expect(
            &http,
            Method::POST,
            &room_url(&d, no_registry),
            Some(&body),
            StatusCode::CREATED,
        )
        .await;

        // The decode engine aborts a room once its request reached the prefill.
        expect(
            &http,
            Method::POST,
            &room_url(&d, aborted),
            Some(&json!({"tokens": 48})),
            StatusCode::CREATED,
        )
        .await;
        poll_until(
            "the prefill sees the request of the room to abort",
            BOUND,
            || async {
                let (status, v) = call(&http, Method::GET, &room_url(&p, aborted), None).await;
                (status == StatusCode::OK && v["state"] == "waiting_for_input").then_some(())
            },
        )
        .await;
        expect(
            &http,
            Method::DELETE,
            &room_url(&d, aborted),
            None,
            StatusCode::OK,
        )
        .await;

        // Rooms that succeed, driven like an engine pair would.
        let ok_rooms: Vec<(u64, usize)> = [16, 100, 257, 1000, 33, 512]
            .iter()
            .enumerate()
            .map(|(i, t)| (i as u64 + 1, *t))
            .collect();
        let results = drive_rooms(&Apis::pair(&p, &d), ok_rooms.clone(), 3)
            .await
            .expect("driving the rooms");
        for r in &results {
            assert!(
                r.verified && r.state == "success",
                "room {} did not land intact: {r:?}",
                r.room
            );
        }
        let landed: u64 = results.iter().map(|r| r.bytes).sum();

        // The failed and aborted rooms at the decode: their codes, before they are taken.
        let mut decode_codes: BTreeMap<String, f64> = BTreeMap::new();
        let mut decode_states: BTreeMap<String, f64> =
            BTreeMap::from([("success".to_owned(), results.len() as f64)]);
        for (room, state, code) in [
            (aborted, "aborted", "aborted"),
            (never_ready, "failed", "timeout_ready"),
            (no_registry, "failed", "timeout_bootstrap"),
        ] {
            let (v, _) = wait_safe(&http, &d, room).await;
            println!(
                "[e2e-metrics] decode room {room}: {} {}",
                v["state"], v["reason"]
            );
            assert_eq!(v["state"], state, "room {room}: {v}");
            assert_eq!(v["reason"]["code"], code, "room {room}: {v}");
            let message = v["reason"]["message"].as_str().unwrap_or_default();
            assert!(!message.is_empty(), "{v}");
            if room == no_registry {
                // How long the decode kept asking, and why the last lookup failed.
                assert!(
                    message.contains(" lookups in ") && message.contains("Connection refused"),
                    "{v}"
                );
            }
            *decode_states.entry(state.to_owned()).or_default() += 1.0;
            *decode_codes.entry(code.to_owned()).or_default() += 1.0;
        }
        let m = samples(&metrics_text(&http, &d).await);
        let states = by_label(&m, "kvferry_rooms_total", "role=\"decode\",", "state");
        let codes = by_label(
            &m,
            "kvferry_room_failures_total",
            "role=\"decode\",",
            "code",
        );
        assert_eq!(
            states.keys().collect::<Vec<_>>(),
            ["aborted", "failed", "success"],
            "{m:?}"
        );
        for (state, n) in &states {
            assert_eq!(
                *n,
                decode_states.get(state).copied().unwrap_or(0.0),
                "decode rooms {state}: {m:?}"
            );
        }
        assert!(
            codes.len() >= 14,
            "every failure code is exposed: {codes:?}"
        );
        for (code, n) in &codes {
            assert_eq!(
                *n,
                decode_codes.get(code).copied().unwrap_or(0.0),
                "decode failures {code}: {codes:?}"
            );
        }
        assert_eq!(
            role_sum(&m, "kvferry_kv_bytes_total", "decode"),
            landed as f64,
            "bytes landed: {m:?}"
        );

        // Taking the failed rooms returns every agent-owned page.
        for room in [aborted, never_ready, no_registry] {
            let taken = expect(
                &http,
                Method::POST,
                &format!("{}/take", room_url(&d, room)),
                None,
                StatusCode::OK,
            )
            .await;
            assert_ne!(taken["state"], "success", "{taken}");
        }
        assert_eq!(pool(&http, &d).await, (total, total));
        let m = samples(&metrics_text(&http, &d).await);
        assert_eq!(
            m.get("kvferry_pool_pages{role=\"decode\",state=\"used\"}"),
            Some(&0.0)
        );
        assert_eq!(
            m.get("kvferry_pool_pages{role=\"decode\",state=\"free\"}"),
            Some(&(total as f64))
        );

        // The prefill: its rooms' final states and codes, as its room JSON says, and as
        // counted. Room 300 never reached it.
        let mut prefill_states: BTreeMap<String, f64> = BTreeMap::new();
        let mut prefill_codes: BTreeMap<String, f64> = BTreeMap::new();
        let all: Vec<u64> = ok_rooms
            .iter()
            .map(|(r, _)| *r)
            .chain([aborted, never_ready])
            .collect();
        for room in all {
            let v = wait_final(&http, &p, room).await;
            let state = v["state"].as_str().unwrap_or_default().to_owned();
            if let Some(code) = v["reason"]["code"].as_str() {
                *prefill_codes.entry(code.to_owned()).or_default() += 1.0;
            }
            if room == aborted || room == never_ready {
                println!("[e2e-metrics] prefill room {room}: {state} {}", v["reason"]);
                assert_ne!(state, "success", "{v}");
            } else {
                assert_eq!(state, "success", "{v}");
            }
            *prefill_states.entry(state).or_default() += 1.0;
        }
        let (status, _) = call(&http, Method::GET, &room_url(&p, no_registry), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let m = samples(&metrics_text(&http, &p).await);
        let states = by_label(&m, "kvferry_rooms_total", "role=\"prefill\",", "state");
        let codes = by_label(
            &m,
            "kvferry_room_failures_total",
            "role=\"prefill\",",
            "code",
        );
        assert_eq!(states.len(), 3, "{m:?}");
        for (state, n) in &states {
            assert_eq!(
                *n,
                prefill_states.get(state).copied().unwrap_or(0.0),
                "prefill rooms {state}: {m:?}"
            );
        }
        for (code, n) in &codes {
            assert_eq!(
                *n,
                prefill_codes.get(code).copied().unwrap_or(0.0),
                "prefill failures {code}: {codes:?}"
            );
        }
        assert_eq!(
            prefill_codes.values().sum::<f64>(),
            2.0,
            "the two rooms that did not succeed carry a code"
        );
        assert_eq!(
            role_sum(&m, "kvferry_kv_bytes_total", "prefill"),
            landed as f64,
            "bytes sent = landed: {m:?}"
        );
        // The prefill returns its synthetic pages once a room is final and no gather reads them.
        poll_until("the prefill's pages return", BOUND, || async {
            let s = samples(&metrics_text(&http, &p).await);
            (s.get("kvferry_pool_pages{role=\"prefill\",state=\"used\"}") == Some(&0.0))
                .then_some(())
        })
        .await;

        // The registry: one prefill and one decode rank, the decode's lookups answered.
        let m = samples(&metrics_text(&http, &url).await);
        assert_eq!(
            m.get("kvferry_bootstrap_ranks{role=\"prefill\"}"),
            Some(&1.0),
            "{m:?}"
        );
        assert_eq!(
            m.get("kvferry_bootstrap_ranks{role=\"decode\"}"),
            Some(&1.0),
            "{m:?}"
        );
        assert!(
            m.get("kvferry_bootstrap_registrations_total")
                .is_some_and(|n| *n >= 2.0),
            "{m:?}"
        );
        assert!(
            m.get("kvferry_bootstrap_lookups_total{result=\"complete\"}")
                .is_some_and(|n| *n >= 1.0),
            "{m:?}"
        );

        for (what, base) in [("registry", &url), ("prefill", &p), ("decode", &d)] {
            openmetrics_check(what, &metrics_text(&http, base).await);
        }
    });
    drop(decode);
    drop(prefill);
    drop(registry);
}
