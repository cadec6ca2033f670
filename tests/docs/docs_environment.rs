//! docs/environment.md lists the `KVFERRY_*` environment variables kvferry reads, all of them and
//! no others, each flag's variable in that flag's row.
//!
//! What counts as a variable: a word `KVFERRY_` followed by capitals, digits and underscores, not
//! preceded by a letter, digit or `_`. A word ending in `_` is a prefix in prose
//! (`KVFERRY_BENCH_*`), not a variable.
//!
//! What counts as the code: every file under src/, bootstrap/src/, wire/src/, python/src/ (the
//! binary, the registry crate, what they share, the Python extension), python/kvferry/ (the
//! Python package) and scripts/ (what the docs tell users to run), less its test code: files
//! named `tests.rs` or `test_*.py`, files under a folder named `tests`, and `#[cfg(test)] mod
//! NAME { ... }` blocks. Test code and the test suites (tests/, python/tests/) are "the tests".
//!
//! The checks:
//! 1. every variable the code names is in the page (a variable only the tests name, such as the
//!    markers a test sets for the child processes it starts, need not be);
//! 2. every variable in the page is named by the code or by the tests (the page lists the test
//!    suites' knobs too): no stale entry;
//! 3. every `[env: KVFERRY_X...]` that the release binary's `kvferry [SUBCOMMAND] --help` prints is
//!    in a row of the page whose first cell is `` `KVFERRY_X` `` and whose second is the flag it
//!    backs (`` `--flag` ``).

use crate::common;

use common::docs::root;

use common::help;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::CommandFactory as _;

const PAGE: &str = "docs/environment.md";

/// The folders whose files are the code (less their test code).
const CODE: [&str; 6] = [
    "src",
    "bootstrap/src",
    "wire/src",
    "python/src",
    "python/kvferry",
    "scripts",
];

/// The folders of the test suites.
const TESTS: [&str; 2] = ["tests", "python/tests"];

/// Folders that name variables today: finding none there means the scan broke.
const MUST_NAME: [&str; 3] = ["src", "python/kvferry", "scripts"];

/// The `KVFERRY_*` variables `text` names.
fn variables(text: &str) -> BTreeSet<String> {
    const PREFIX: &str = "KVFERRY_";
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = BTreeSet::new();
    for (at, _) in text.match_indices(PREFIX) {
        if text[..at].chars().next_back().is_some_and(word) {
            continue;
        }
        let rest = &text[at + PREFIX.len()..];
        let len = rest
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len());
        let name = &rest[..len];
        if !name.is_empty() && !name.ends_with('_') {
            out.insert(format!("{PREFIX}{name}"));
        }
    }
    out
}

/// Whether the file at `path` (relative to the repository) is test code as a whole.
fn is_test_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "tests.rs"
        || (name.starts_with("test_") && name.ends_with(".py"))
        || path
            .parent()
            .is_some_and(|dir| dir.iter().any(|c| c == "tests"))
}

/// Rust source split into (code, test code): the `#[cfg(test)] mod NAME { ... }` blocks are test
/// code. Braces are counted per line, which the modules of this repository allow.
fn split_test_modules(text: &str) -> (String, String) {
    let (mut code, mut test) = (String::new(), String::new());
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let module = line.trim() == "#[cfg(test)]"
            && lines.peek().is_some_and(|next| {
                next.trim_start().starts_with("mod ") && next.trim_end().ends_with('{')
            });
        if !module {
            code.push_str(line);
            code.push('\n');
            continue;
        }
        let mut depth = 0i64;
        for line in lines.by_ref() {
            test.push_str(line);
            test.push('\n');
            depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
            if depth <= 0 {
                break;
            }
        }
    }
    (code, test)
}

/// Every file under `dir` (relative to the repository), skipping caches.
fn files(dir: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![root().join(dir)];
    while let Some(dir) = todo.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "__pycache__") {
                    todo.push(path);
                }
            } else {
                out.push(
                    path.strip_prefix(root())
                        .expect("under the root")
                        .to_path_buf(),
                );
            }
        }
    }
    out.sort();
    out
}

/// The variables the code and the tests name, each with the files that name it.
struct Named {
    code: BTreeMap<String, BTreeSet<PathBuf>>,
    tests: BTreeMap<String, BTreeSet<PathBuf>>,
}

fn named() -> Named {
    let mut named = Named {
        code: BTreeMap::new(),
        tests: BTreeMap::new(),
    };
    let mut add = |to_tests: bool, text: &str, path: &Path| {
        let into = if to_tests {
            &mut named.tests
        } else {
            &mut named.code
        };
        for name in variables(text) {
            into.entry(name).or_default().insert(path.to_path_buf());
        }
    };
    for (dirs, in_tests) in [(&CODE[..], false), (&TESTS[..], true)] {
        for dir in dirs {
            for path in files(dir) {
                if path == Path::new(file!()) {
                    continue; // this file's own examples
                }
                let bytes = std::fs::read(root().join(&path)).expect("reading a file");
                let text = String::from_utf8_lossy(&bytes);
                if in_tests || is_test_file(&path) {
                    add(true, &text, &path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let (code, test) = split_test_modules(&text);
                    add(false, &code, &path);
                    add(true, &test, &path);
                } else {
                    add(false, &text, &path);
                }
            }
        }
    }
    for dir in MUST_NAME {
        assert!(
            named.code.values().flatten().any(|p| p.starts_with(dir)),
            "no KVFERRY_* variable found under {dir}/: the scan is broken"
        );
    }
    named
}

fn page() -> String {
    std::fs::read_to_string(root().join(PAGE)).unwrap_or_else(|e| panic!("{PAGE}: {e}"))
}

fn listing(names: &BTreeMap<String, BTreeSet<PathBuf>>, which: &BTreeSet<&String>) -> String {
    which
        .iter()
        .map(|name| {
            let paths: Vec<String> = names
                .get(*name)
                .map(|ps| ps.iter().map(|p| p.display().to_string()).collect())
                .unwrap_or_default();
            format!("  {name} ({})", paths.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_variable_the_code_names_is_documented() {
    let named = named();
    let page = variables(&page());
    let missing: BTreeSet<&String> = named.code.keys().filter(|n| !page.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "{PAGE} lacks {} variable(s) the code names (add a row for each):\n{}",
        missing.len(),
        listing(&named.code, &missing)
    );
}

#[test]
fn every_documented_variable_is_named_by_the_code() {
    let named = named();
    let page = variables(&page());
    assert!(page.len() > 20, "{PAGE} names only {page:?}");
    let stale: Vec<&String> = page
        .iter()
        .filter(|n| !named.code.contains_key(*n) && !named.tests.contains_key(*n))
        .collect();
    assert!(
        stale.is_empty(),
        "{PAGE} lists variable(s) that neither the code nor the tests name (stale rows?): {stale:?}"
    );
}

/// The (flag, variable) pairs of a help text: each `[env: NAME...]` belongs to the option line
/// above it (an option line starts with `-`, indented less than the help text under it).
fn help_variables(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut flag: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if line.len() - trimmed.len() < 10 && trimmed.starts_with('-') {
            flag = trimmed
                .split([' ', ',', '='])
                .find(|w| w.starts_with("--"))
                .map(str::to_owned);
        }
        for (at, _) in line.match_indices("[env: ") {
            let rest = &line[at + "[env: ".len()..];
            let len = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let flag = flag
                .clone()
                .unwrap_or_else(|| panic!("[env: {}] under no option line", &rest[..len]));
            out.push((flag, rest[..len].to_owned()));
        }
    }
    out
}

/// The page's table rows as cells (without the outer pipes), trimmed.
fn rows(page: &str) -> Vec<Vec<String>> {
    page.lines()
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect()
}

#[test]
fn every_variable_in_help_is_documented_with_its_flag() {
    let page = page();
    let rows = rows(&page);
    let names: Vec<String> = kvferry::cli::Cli::command()
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    let mut subcommands: Vec<Vec<&str>> = vec![vec![]];
    subcommands.extend(names.iter().map(|n| vec![n.as_str()]));
    let mut wrong = Vec::new();
    let mut seen = BTreeSet::new();
    for args in &subcommands {
        let pairs = help_variables(&help(args));
        assert!(
            !pairs.is_empty(),
            "kvferry {args:?} --help shows no [env: ...]"
        );
        for (flag, var) in pairs {
            seen.insert(var.clone());
            let (name, backs) = (format!("`{var}`"), format!("`{flag}`"));
            let ok = rows
                .iter()
                .any(|r| r.first() == Some(&name) && r.get(1) == Some(&backs));
            if !ok {
                wrong.push(format!(
                    "  kvferry {} --help: {flag} [env: {var}]",
                    args.join(" ")
                ));
            }
        }
    }
    assert!(seen.len() > 20, "--help shows only {seen:?}");
    assert!(
        wrong.is_empty(),
        "{PAGE} has no row `VARIABLE` | `--flag` for:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_scanner_reads_names_and_skips_prefixes_and_test_modules() {
    let text = "a KVFERRY_A_B=1, $KVFERRY_C; KVFERRY_BENCH_* MY_KVFERRY_D xKVFERRY_E KVFERRY_";
    let found: Vec<String> = variables(text).into_iter().collect();
    assert_eq!(found, ["KVFERRY_A_B", "KVFERRY_C"]);
    let source = "const A: &str = \"KVFERRY_X\";\n#[cfg(test)]\nmod tests {\n    fn f() {\n        let _ = \"KVFERRY_Y\";\n    }\n}\nconst B: u8 = 0;\n";
    let (code, test) = split_test_modules(source);
    assert_eq!(
        variables(&code).into_iter().collect::<Vec<_>>(),
        ["KVFERRY_X"]
    );
    assert_eq!(
        variables(&test).into_iter().collect::<Vec<_>>(),
        ["KVFERRY_Y"]
    );
    assert!(code.contains("const B"), "{code}");
    assert!(is_test_file(Path::new(
        "src/transport/ucx/progress/tests.rs"
    )));
    assert!(is_test_file(Path::new("python/tests/conftest.py")));
    assert!(!is_test_file(Path::new("src/agent/options.rs")));
}
