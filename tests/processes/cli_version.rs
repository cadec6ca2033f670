//! `kvferry --version` names what a bug report needs: the crate's version, the git revision the
//! binary was built from (a commit of this repository when built in it), the control protocol's
//! version and the oldest it speaks, and the cargo features built in; `-V` the first line only.

use std::path::Path;
use std::process::Command;

use crate::common::release_binary;

fn version(flag: &str) -> String {
    let out = Command::new(release_binary())
        .arg(flag)
        .output()
        .expect("running kvferry");
    assert!(out.status.success(), "kvferry {flag}: {}", out.status);
    String::from_utf8(out.stdout).expect("utf-8 version")
}

#[test]
fn version_names_the_build_the_revision_the_protocols_and_the_features() {
    let text = version("--version");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");

    let rest = lines[0]
        .strip_prefix(&format!("kvferry {} (git ", env!("CARGO_PKG_VERSION")))
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("first line: {text}"));
    let rev = rest.strip_suffix("-dirty").unwrap_or(rest);
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let in_git = Command::new("git")
        .args(["rev-parse", "--show-toplevel"])
        .current_dir(repo)
        .output()
        .is_ok_and(|o| o.status.success());
    if in_git {
        // A commit of this repository, as build.rs found it (not `unknown`).
        assert!(
            rev.len() >= 7 && rev.chars().all(|c| c.is_ascii_hexdigit()),
            "{text}"
        );
        let known = Command::new("git")
            .args(["cat-file", "-e", &format!("{rev}^{{commit}}")])
            .current_dir(repo)
            .status()
            .expect("running git");
        assert!(known.success(), "{rev} is no commit of {}", repo.display());
    } else {
        assert_eq!(rev, "unknown", "{text}");
    }

    let (now, oldest) = (kvferry::protocol::VERSION, kvferry::protocol::MIN_VERSION);
    assert!(oldest < now);
    assert_eq!(
        lines[1],
        format!("protocol {now} (speaks {oldest} to {now})")
    );

    // Every feature of Cargo.toml is named, and the binary has those of this test build
    // (`--all-features` in CI).
    let manifest: toml::Table = std::fs::read_to_string(repo.join("Cargo.toml"))
        .expect("reading Cargo.toml")
        .parse()
        .expect("Cargo.toml parses");
    let mut declared: Vec<&str> = manifest["features"]
        .as_table()
        .expect("[features]")
        .keys()
        .map(String::as_str)
        .filter(|name| *name != "default")
        .collect();
    let mut named: Vec<&str> = kvferry::cli::FEATURES
        .iter()
        .map(|(name, _)| *name)
        .collect();
    declared.sort_unstable();
    named.sort_unstable();
    assert_eq!(
        named, declared,
        "kvferry::cli::FEATURES against Cargo.toml's [features]"
    );
    let built: Vec<&str> = kvferry::cli::FEATURES
        .iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| *name)
        .collect();
    assert_eq!(cfg!(feature = "ucx"), built.contains(&"ucx"));
    let expected = if built.is_empty() {
        "none".to_owned()
    } else {
        built.join(", ")
    };
    assert_eq!(lines[2], format!("features: {expected}"), "{text}");

    assert_eq!(version("-V"), format!("{}\n", lines[0]));
}
