//! `--help` says only what works, per role: `prefill --help` and `decode --help` each list the
//! flags their role reads (the other role's are hidden, yet accepted), no pool kind that every
//! build refuses is advertised, and `--transport` names the transports of this build.

mod common;

use std::process::Command;

fn help(args: &[&str]) -> String {
    let out = Command::new(common::release_binary())
        .args(args)
        .arg("--help")
        .env_remove("KVFERRY_CONFIG")
        .output()
        .expect("running kvferry --help");
    assert!(out.status.success(), "{args:?} --help: {}", out.status);
    String::from_utf8(out.stdout).expect("utf-8 help")
}

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
        assert!(
            !text.contains("cuda-ipc"),
            "{role} --help advertises cuda-ipc pools"
        );
        assert!(text.contains("shm:<path>"), "{role} --help");
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
