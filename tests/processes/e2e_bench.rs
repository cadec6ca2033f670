//! `kvferry bench` end to end (issue 7): the release binary starts its own registry and agents
//! on loopback for each transport, and its output follows the bench JSON (`cluster::summary`).
//!
//! - `--json`: stdout is JSON Lines only, one object per (transport, tokens) configuration,
//!   every field of the schema present with its type, every room verified;
//! - `--out DIR`: `bench.jsonl` holds the same lines, both plots are SVG documents;
//! - the table mode prints a table; a bad flag fails with a message before starting anything.
//!
//! Asserts no timing. Needs `cargo build --release --bin kvferry` first.

use crate::common;

use std::process::{Command, Output};

use common::release_binary;
use serde_json::Value;

fn bench(args: &[&str]) -> Output {
    let out = Command::new(release_binary())
        .arg("bench")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running kvferry bench");
    println!(
        "kvferry bench {}: {}\n--- stderr ---\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Panics unless `v[key]` exists and `ok` holds for it.
fn field<'a>(v: &'a Value, key: &str, what: &str, ok: fn(&Value) -> bool) -> &'a Value {
    let f = &v[key];
    assert!(ok(f), "`{key}` should be {what}, is {f} in {v}");
    f
}

fn non_negative(v: &Value) -> bool {
    v.as_f64().is_some_and(|x| x.is_finite() && x >= 0.0)
}

fn percentiles(v: &Value) -> bool {
    non_negative(&v["p50"])
        && non_negative(&v["p99"])
        && v.as_object().is_some_and(|o| o.len() == 2)
}

/// Checks one bench line against the bench JSON's schema (`cluster::summary` and `kvferry bench`).
fn check_line(v: &Value, transport: &str, tokens: u64, rooms: u64) {
    // Names and types of every field.
    field(v, "transport", "a string", Value::is_string);
    field(v, "model", "a string", Value::is_string);
    field(v, "tokens", "an integer", Value::is_u64);
    field(v, "page_size", "an integer", Value::is_u64);
    field(v, "rooms", "an integer", Value::is_u64);
    field(v, "concurrency", "an integer", Value::is_u64);
    field(v, "prefill_tp", "an integer", Value::is_u64);
    field(v, "decode_tp", "an integer", Value::is_u64);
    field(v, "bytes_per_room", "an integer", Value::is_u64);
    field(v, "throughput_gbps", "a number >= 0", non_negative);
    field(v, "latency_ms", "{p50, p99}", percentiles);
    field(v, "take_latency_ms", "{p50, p99}", percentiles);
    field(v, "verified_rooms", "an integer", Value::is_u64);
    field(v, "failed_rooms", "an integer", Value::is_u64);
    field(v, "memcpy_gbps", "a number >= 0", non_negative);
    // Where the rooms' time went: every stage of a staged room, in ms, none negative (each
    // runs between two causally ordered points).
    let stages = field(v, "stages_ms", "an object", Value::is_object);
    for (name, _) in kvferry::cluster::STAGES {
        assert!(non_negative(&stages[name]), "stage {name}: {stages}");
    }
    assert!(
        v.get("ucx_tls").is_none(),
        "`ucx_tls` belongs to UCX runs only: {v}"
    );
    // Values this run fixes.
    assert_eq!(v["transport"], transport, "{v}");
    assert_eq!(v["model"], "tiny", "{v}");
    assert_eq!(v["tokens"], tokens, "{v}");
    assert_eq!(v["page_size"], 16, "{v}");
    assert_eq!(v["rooms"], rooms, "{v}");
    assert_eq!(v["concurrency"], 2, "{v}");
    assert_eq!(v["prefill_tp"], 1, "{v}");
    assert_eq!(v["decode_tp"], 1, "{v}");
    // tiny: 4 layers x 4 heads x 32 dims x fp16 x (K, V) per token.
    assert_eq!(v["bytes_per_room"], tokens * 4 * 4 * 32 * 2 * 2, "{v}");
    assert_eq!(v["verified_rooms"], v["rooms"], "every room verified: {v}");
    // Checked by stamps (the bench's default); warmed up one room per slot in flight.
    assert_eq!(v["verify"], "stamp", "{v}");
    assert_eq!(v["warmup_rooms"], 2, "{v}");
    assert_eq!(v["failed_rooms"], 0, "{v}");
    assert_eq!(v["failures"], serde_json::json!({}), "no room failed: {v}");
    // Rooms landed, so time passed and bytes moved.
    assert!(v["throughput_gbps"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["latency_ms"]["p50"].as_f64().unwrap() > 0.0, "{v}");
    assert!(
        v["latency_ms"]["p99"].as_f64() >= v["latency_ms"]["p50"].as_f64(),
        "{v}"
    );
}

fn parse_lines(text: &str, what: &str) -> Vec<Value> {
    text.lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{what}: every line must be JSON ({e}): {l:?}"))
        })
        .collect()
}

#[test]
fn bench_json_lines_and_plots() {
    let dir = std::env::temp_dir().join(format!("kvferry-e2e-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = bench(&[
        "--model",
        "tiny",
        "--transport",
        "zmq-tcp,zmq-ipc",
        "--tokens",
        "64,200",
        "--rooms",
        "3",
        "--concurrency",
        "2",
        "--json",
        "--out",
        dir.to_str().expect("utf-8 temp dir"),
    ]);
    assert!(out.status.success(), "kvferry bench failed");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    let lines = parse_lines(&stdout, "stdout");
    assert_eq!(
        lines.len(),
        4,
        "one line per (transport, tokens):\n{stdout}"
    );
    let want = [
        ("zmq-tcp", 64),
        ("zmq-tcp", 200),
        ("zmq-ipc", 64),
        ("zmq-ipc", 200),
    ];
    for (v, (transport, tokens)) in lines.iter().zip(want) {
        check_line(v, transport, tokens, 3);
    }

    let jsonl = std::fs::read_to_string(dir.join("bench.jsonl")).expect("bench.jsonl");
    assert_eq!(
        parse_lines(&jsonl, "bench.jsonl"),
        lines,
        "bench.jsonl holds the lines printed"
    );
    for plot in ["throughput.svg", "latency.svg"] {
        let svg = std::fs::read_to_string(dir.join(plot)).unwrap_or_else(|e| panic!("{plot}: {e}"));
        assert!(svg.starts_with("<svg"), "{plot}: {svg:.80}");
        assert!(svg.trim_end().ends_with("</svg>"), "{plot} is cut short");
        assert_eq!(
            svg.matches('<').count(),
            svg.matches('>').count(),
            "{plot}: unbalanced tags"
        );
        // Legend entries: text elements holding just the name.
        let texts: Vec<&str> = svg
            .split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim()))
            .collect();
        for name in ["zmq-tcp", "zmq-ipc"] {
            assert!(
                texts.contains(&name),
                "{plot}: no legend entry {name}: {texts:?}"
            );
        }
        // The data lines are 2 pixels wide, axes and ticks 1.
        assert_eq!(
            svg.matches(r#"stroke-width="2" points"#).count(),
            2,
            "{plot}: one line per transport"
        );
        assert!(!svg.contains("NaN"), "{plot} has NaN coordinates");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_prints_a_table_without_json() {
    let out = bench(&["--model", "tiny", "--tokens", "32", "--rooms", "2"]);
    assert!(out.status.success(), "kvferry bench failed");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    println!("{stdout}");
    let mut rows = stdout.lines();
    let header = rows.next().expect("a header line");
    for column in ["transport", "tokens", "GB/s", "p50 ms", "verified"] {
        assert!(header.contains(column), "header without {column}: {header}");
    }
    let row = rows.next().expect("a row");
    assert!(
        row.split_whitespace().take(2).eq(["zmq-tcp", "32"]),
        "row: {row}"
    );
    assert!(
        serde_json::from_str::<Value>(row).is_err(),
        "the table is not JSON"
    );
}

#[test]
fn bench_rejects_bad_flags_before_starting() {
    for args in [
        &["--tokens", "0"][..],
        &["--rooms", "0"],
        &["--transport", "carrier-pigeon"],
        &["--model", "gpt-9"],
        &["--prefill-api", "http://127.0.0.1:1"],
    ] {
        let out = bench(args);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout");
        assert!(!out.stderr.is_empty(), "{args:?}: a message on stderr");
    }
}
