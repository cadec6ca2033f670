//! `--help` says only what works, per role: `prefill --help` and `decode --help` each list the
//! flags their role reads (the other role's are hidden, yet accepted), `--pool` names exactly
//! the pool kinds this build parses, and `--transport` names the transports of this build.

use crate::common;

use common::help;
use std::collections::BTreeSet;

use kvferry::pool::PoolDescriptor;

#[test]
fn prefill_and_decode_help_differ_by_role() {
    let prefill = help(&["prefill"]);
    let decode = help(&["decode"]);
    assert_ne!(prefill, decode);
    for (role, text, has, hides) in [
        (
            "prefill",
            &prefill,
            &[
                "--synthetic-layer-ms",
                "--placed-min-run-bytes",
                "--synthetic-verify",
                "--insecure",
            ][..],
            &[
                "--timeout-bootstrap-ms",
                "--timeout-stall-ms",
                "--staging-slots",
                "--drain-untaken-ms",
            ][..],
        ),
        (
            "decode",
            &decode,
            &[
                "--timeout-bootstrap-ms",
                "--timeout-stall-ms",
                "--staging-slots",
                "--drain-untaken-ms",
                "--synthetic-verify",
                "--insecure",
            ][..],
            &["--synthetic-layer-ms", "--placed-min-run-bytes"][..],
        ),
    ] {
        for flag in has {
            assert!(
                text.contains(&format!("{flag} ")) || text.contains(&format!("{flag}\n")),
                "{role} --help lacks {flag}"
            );
        }
        for flag in hides {
            assert!(
                !text.contains(flag),
                "{role} --help shows {flag}, which only the other role reads"
            );
        }
    }
    // The hidden flags are still accepted (one flag list or config file for both roles).
    for argv in [
        [
            "kvferry",
            "prefill",
            "--timeout-bootstrap-ms",
            "5",
            "--drain-untaken-ms",
            "5",
            "--data-port",
            "0",
        ],
        [
            "kvferry",
            "decode",
            "--synthetic-layer-ms",
            "5",
            "--placed-min-run-bytes",
            "5",
            "--control-port",
            "0",
        ],
    ] {
        kvferry::cli::config::parse(argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    }
}

#[test]
fn transport_help_names_this_builds_transports() {
    for args in [&["demo"][..], &["prefill"], &["decode"]] {
        let text = help(args);
        let line = text
            .lines()
            .skip_while(|l| !l.contains("--transport <TRANSPORT>"))
            .nth(1)
            .unwrap_or_else(|| panic!("{args:?} --help has no --transport"))
            .to_owned();
        assert!(
            line.contains("zmq-tcp") && line.contains("zmq-ipc"),
            "{args:?}: {line}"
        );
        if cfg!(feature = "ucx") {
            assert!(line.contains("zmq-ipc or ucx"), "{args:?}: {line}");
        } else {
            assert!(line.contains("ucx needs a build"), "{args:?}: {line}");
        }
    }
}

/// The text between two backticks, each span once.
fn code_spans(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The help of `flag` (`--pool <POOL>`): its lines up to the next flag.
fn flag_help(text: &str, flag: &str) -> String {
    let mut lines = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with(flag));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no {flag} in:\n{text}"));
    std::iter::once(first)
        .chain(lines.take_while(|l| !l.trim_start().starts_with('-')))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A value of each kind the help may name, as a user would write it.
fn example(kind: &str) -> String {
    match kind.split_once(':').map_or(kind, |(k, _)| k) {
        "anon" => "anon".to_owned(),
        "shm" => "shm:/dev/shm/kvferry-pool".to_owned(),
        "cuda-ipc" => format!("cuda-ipc:0:{}", "ab".repeat(64)),
        "cuda-vmm" => "cuda-vmm:0:/run/engine/pool.sock".to_owned(),
        other => panic!("no example of the pool kind {other:?}: add one here"),
    }
}

#[test]
fn pool_help_names_exactly_the_kinds_this_build_parses() {
    // The parser's own list of kinds, from its refusal of a value of none.
    let refused = "nonsense"
        .parse::<PoolDescriptor>()
        .expect_err("`nonsense` is no pool");
    let parsed = code_spans(&refused.to_string());
    assert!(
        parsed.contains("anon") && parsed.contains("shm:<path>"),
        "the parser's refusal lists no kinds: {refused}"
    );
    for kind in &parsed {
        let value = example(kind);
        if let Err(e) = value.parse::<PoolDescriptor>() {
            panic!("{kind}: the parser lists it yet refuses {value:?}: {e}");
        }
    }
    // Device pools need no feature: the CUDA driver is loaded at run time, so every build,
    // this one included, parses and opens them.
    for kind in ["cuda-ipc:<device>:<handle>", "cuda-vmm:<device>:<socket>"] {
        assert!(parsed.contains(kind), "{kind} missing from: {refused}");
    }
    for role in ["prefill", "decode"] {
        let text = help(&[role]);
        let pool = flag_help(&text, "--pool <POOL>");
        assert_eq!(
            code_spans(&pool),
            parsed,
            "{role} --pool names other kinds than the parser takes: {pool}"
        );
        // One phrase of meaning per kind: each is followed by its parenthesis.
        for kind in &parsed {
            assert!(
                pool.contains(&format!("`{kind}` (")),
                "{role} --pool gives {kind} no meaning: {pool}"
            );
        }
    }
}
