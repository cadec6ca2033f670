//! Sets `GIT_REVISION` for `kvferry --version`: `git rev-parse --short HEAD` of the
//! repository this crate is the root of, with `-dirty` when a tracked file differs from it, or
//! `unknown` when built outside that repository (from an sdist or a crates.io download).
//!
//! It reruns when HEAD moves (`.git/HEAD`, the ref it names, or `packed-refs` where the ref is
//! packed) and when `src/` changes, which recompiles the crate anyway; other edits keep the
//! build as it is, so `-dirty` is what the tree was at the last of those.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success()).then(|| text.trim().to_owned())
}

fn main() {
    println!("cargo::rerun-if-changed=src");
    let here = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let ours = git(&["rev-parse", "--show-toplevel"])
        .is_some_and(|top| Path::new(&top).canonicalize().ok() == here.canonicalize().ok());
    let revision = match ours
        .then(|| git(&["rev-parse", "--short", "HEAD"]))
        .flatten()
    {
        Some(rev) => {
            for path in ["HEAD", "packed-refs"]
                .into_iter()
                .map(str::to_owned)
                .chain(git(&["symbolic-ref", "-q", "HEAD"]))
            {
                if let Some(file) = git(&["rev-parse", "--git-path", &path])
                    && here.join(&file).exists()
                {
                    println!("cargo::rerun-if-changed={}", here.join(file).display());
                }
            }
            // Without optional locks: never rewrite the index others may be using.
            let dirty = git(&["--no-optional-locks", "status", "--porcelain", "-uno"])
                .is_some_and(|s| !s.is_empty());
            format!("{rev}{}", if dirty { "-dirty" } else { "" })
        }
        None => "unknown".to_owned(),
    };
    println!("cargo::rustc-env=GIT_REVISION={revision}");
}
