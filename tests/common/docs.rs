//! Where the repository's documentation is, for the tests that check it against the code.

use std::path::{Path, PathBuf};

/// The repository's root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and docs/*.md, by path from the root: README first, then the docs sorted.
pub fn markdown() -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("reading docs/")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| p.strip_prefix(root()).expect("under the root").to_owned())
        .collect();
    docs.sort();
    docs.insert(0, PathBuf::from("README.md"));
    docs
}
