//! Every pointer into the docs lands: a citation of a section (`docs/operations.md, "Room
//! JSON"`, `operations.md ("Room JSON"`, several quoted headings joined by `and`), in the docs,
//! the code's comments, the scripts and the tests, names a heading of that file; a markdown link
//! of README.md or docs/*.md names an existing file, and its `#anchor` (or a bare `(#anchor)`)
//! a heading of the file it points at.
//!
//! Headings are compared by their GitHub anchors: lowercased, every character but letters,
//! digits, spaces, `-` and `_` dropped, spaces turned to `-`; a repeated heading's anchor gets
//! `-1`, `-2`... Headings and links inside fenced code blocks do not count. A citation may run
//! over several comment lines: each line's comment marker (`//!`, `///`, `//`, `#`, `*`) is cut
//! and the lines joined by a space before the search.

use crate::common;

use common::docs::root;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Whether `line` opens or closes a fenced code block.
fn is_fence(line: &str) -> bool {
    let t = line.trim_start();
    t.starts_with("```") || t.starts_with("~~~")
}

/// The anchors of a markdown file's headings, outside code blocks.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut code = false;
    for line in text.lines() {
        if is_fence(line) {
            code = !code;
            continue;
        }
        let Some(rest) = line.strip_prefix('#') else {
            continue;
        };
        let rest = rest.trim_start_matches('#');
        if code || !(rest.is_empty() || rest.starts_with(' ')) {
            continue;
        }
        let base = slug(rest.trim().trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(match *n {
            0 => base.clone(),
            k => format!("{base}-{k}"),
        });
        *n += 1;
    }
    out
}

/// The markdown files that citations and links may name, by path from the repository root.
fn markdown() -> BTreeMap<String, BTreeSet<String>> {
    let files = common::docs::markdown();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(root().join(&p)).expect("reading a doc");
            (p.to_string_lossy().into_owned(), anchors(&text))
        })
        .collect()
}

/// Every file under `dir` (recursively) whose name passes `keep`, skipping build and cache
/// folders.
fn walk(dir: &Path, keep: &dyn Fn(&Path) -> bool, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if path.is_dir() {
            if !(name.starts_with('.')
                || ["target", "__pycache__", "node_modules", "img"].contains(&name.as_ref()))
            {
                walk(&path, keep, out);
            }
        } else if keep(&path) {
            out.push(path);
        }
    }
}

/// The files searched for citations (this one aside: its own docs show the forms).
fn sources() -> Vec<PathBuf> {
    let ext = |e: &'static str| move |p: &Path| p.extension().is_some_and(|x| x == e);
    let any = |_: &Path| true;
    let mut files = vec![root().join("README.md")];
    for (dir, keep) in [
        ("docs", &ext("md") as &dyn Fn(&Path) -> bool),
        ("src", &ext("rs")),
        ("python", &ext("py")),
        ("scripts", &any),
        ("tests", &ext("rs")),
        ("benches", &ext("rs")),
    ] {
        walk(&root().join(dir), keep, &mut files);
    }
    files.retain(|p| p.file_name().is_none_or(|n| n != "docs_links.rs"));
    files.sort();
    files
}

/// The file a citation's `NAME.md` means, by path from the root: `docs/NAME.md` if it exists,
/// else `NAME.md` at the root.
fn cited_file(
    docs: &BTreeMap<String, BTreeSet<String>>,
    prefix: bool,
    name: &str,
) -> Option<String> {
    let in_docs = format!("docs/{name}.md");
    let at_root = format!("{name}.md");
    if docs.contains_key(&in_docs) {
        Some(in_docs)
    } else if !prefix && docs.contains_key(&at_root) {
        Some(at_root)
    } else {
        None
    }
}

/// A file's lines with their comment markers cut, joined by spaces, and where each line starts.
fn joined(text: &str) -> (String, Vec<usize>) {
    let mut out = String::new();
    let mut starts = Vec::new();
    for line in text.lines() {
        let mut t = line.trim_start();
        for marker in ["//!", "///", "//", "* "] {
            if let Some(rest) = t.strip_prefix(marker) {
                t = rest;
                break;
            }
        }
        t = t.trim_start_matches('#');
        starts.push(out.len());
        out.push_str(t.trim());
        out.push(' ');
    }
    (out, starts)
}

/// The quoted text at the start of `s` (after spaces) and what follows it; at most 200 bytes,
/// so that an unbalanced quote is not taken for a heading.
fn quoted(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start().strip_prefix('"')?;
    let end = s.find('"').filter(|&e| e <= 200)?;
    Some((&s[..end], &s[end + 1..]))
}

/// The broken citations and `NAME.md#anchor` references of one file, as `file:line: why`.
fn check_citations(
    docs: &BTreeMap<String, BTreeSet<String>>,
    name: &str,
    text: &str,
) -> Vec<String> {
    let (all, starts) = joined(text);
    let line_of = |at: usize| starts.partition_point(|&s| s <= at);
    let mut bad = Vec::new();
    let bytes = all.as_bytes();
    for (at, _) in all.match_indices(".md") {
        let stem = all[..at]
            .char_indices()
            .rev()
            .take_while(|(_, c)| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
            .last()
            .map_or(at, |(i, _)| i);
        if stem == at || bytes.get(at + 3).is_some_and(u8::is_ascii_alphanumeric) {
            continue;
        }
        let stem_name = &all[stem..at];
        let prefix = all[..stem].ends_with("docs/");
        // Only names of this repository's docs; `../x.md` and `other/x.md` are not ours.
        if !prefix && all[..stem].ends_with('/') {
            continue;
        }
        let rest = &all[at + 3..];
        let mut headings = Vec::new();
        let mut anchor = None;
        if let Some(a) = rest.strip_prefix('#') {
            let end = a
                .find(|c: char| !(c.is_alphanumeric() || matches!(c, '-' | '_')))
                .unwrap_or(a.len());
            anchor = Some(&a[..end]);
        } else if rest.starts_with([' ', ',', '(']) {
            // `"x.md", "y"` is two strings of code, not a citation.
            let after = rest.trim_start();
            let after = after
                .strip_prefix(',')
                .or_else(|| after.strip_prefix('('))
                .unwrap_or(after);
            let mut next = quoted(after);
            while let Some((heading, tail)) = next {
                headings.push(heading);
                let tail = tail.trim_start();
                next = ["and ", ", ", "; "]
                    .iter()
                    .find_map(|sep| tail.strip_prefix(sep))
                    .and_then(quoted);
            }
        }
        if headings.is_empty() && anchor.is_none() {
            continue;
        }
        let line = line_of(at);
        let Some(file) = cited_file(docs, prefix, stem_name) else {
            bad.push(format!(
                "{name}:{line}: {stem_name}.md is not a doc of this repository"
            ));
            continue;
        };
        let have = &docs[&file];
        for heading in headings {
            if !have.contains(&slug(heading)) {
                bad.push(format!(
                    "{name}:{line}: {file} has no heading \"{heading}\""
                ));
            }
        }
        if let Some(anchor) = anchor.filter(|a| !have.contains(*a)) {
            bad.push(format!("{name}:{line}: {file} has no anchor #{anchor}"));
        }
    }
    bad
}

/// `dir/target` with `.` and `..` resolved, by path from the root; `None` above the root.
fn resolve(dir: &Path, target: &str) -> Option<String> {
    let mut parts: Vec<String> = Vec::new();
    for c in dir.join(target).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop()?;
            }
            _ => {}
        }
    }
    Some(parts.join("/"))
}

/// The broken links of one markdown file (by path from the root), as `file:line: why`.
fn check_links(docs: &BTreeMap<String, BTreeSet<String>>, name: &str, text: &str) -> Vec<String> {
    let dir = Path::new(name).parent().unwrap_or(Path::new(""));
    let mut bad = Vec::new();
    let mut code = false;
    for (n, line) in text.lines().enumerate() {
        if is_fence(line) {
            code = !code;
        }
        if code {
            continue;
        }
        for (at, _) in line.match_indices("](") {
            let rest = &line[at + 2..];
            let Some(end) = rest.find(')') else {
                continue;
            };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
            let file = if path.is_empty() {
                Some(name.to_owned())
            } else {
                resolve(dir, path)
            };
            let Some(file) = file.filter(|f| root().join(f).exists()) else {
                bad.push(format!("{name}:{}: {target} is not a file", n + 1));
                continue;
            };
            if anchor.is_empty() || !file.ends_with(".md") {
                continue;
            }
            if !docs.get(&file).is_some_and(|a| a.contains(anchor)) {
                bad.push(format!("{name}:{}: {file} has no anchor #{anchor}", n + 1));
            }
        }
    }
    bad
}

#[test]
fn every_cited_section_and_linked_file_exists() {
    let docs = markdown();
    let mut bad = Vec::new();
    let mut citations = 0;
    for path in sources() {
        // Scripts include binaries and other encodings: only text is searched.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let name = path
            .strip_prefix(root())
            .expect("under the root")
            .to_string_lossy()
            .into_owned();
        citations += text.matches(".md").count();
        bad.extend(check_citations(&docs, &name, &text));
        if name.ends_with(".md") {
            bad.extend(check_links(&docs, &name, &text));
        }
    }
    // A markdown link `x.md#a` is both a link and a citation's anchor: report it once.
    let mut seen = BTreeSet::new();
    bad.retain(|b| seen.insert(b.clone()));
    assert!(
        citations > 100,
        "only {citations} mentions of .md files found: the search is broken"
    );
    assert!(
        bad.is_empty(),
        "{} citations or links name no heading or file:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn anchors_follow_github() {
    assert_eq!(
        slug("vLLM prefill/decode against NixlConnector"),
        "vllm-prefilldecode-against-nixlconnector"
    );
    assert_eq!(
        slug("The byte layout of an `shm:` pool"),
        "the-byte-layout-of-an-shm-pool"
    );
    assert_eq!(slug("Where a room's time goes"), "where-a-rooms-time-goes");
    let a = anchors("# A\n```\n# not a heading\n```\n## A\n#tag\n### B_c-d\n");
    assert_eq!(
        a,
        ["a", "a-1", "b_c-d"]
            .map(str::to_owned)
            .into_iter()
            .collect()
    );
}

#[test]
fn a_broken_citation_or_link_is_reported() {
    let docs = markdown();
    let ok = "see docs/engines.md, \"Room\n/// JSON\" and docs/operations.md (\"Logs\").";
    assert_eq!(check_citations(&docs, "x.rs", ok), Vec::<String>::new());
    let broken = "a\n// (docs/operations.md, \"Logs\" and \"No such\n// section\")";
    assert_eq!(
        check_citations(&docs, "x.rs", broken),
        ["x.rs:2: docs/operations.md has no heading \"No such section\""]
    );
    assert_eq!(
        check_citations(&docs, "x.rs", "nosuch.md, \"Logs\""),
        ["x.rs:1: nosuch.md is not a doc of this repository"]
    );
    let md = "[a](operations.md#logs) [b](reliability.md#nope) [c](gone.md) [d](#nope)";
    assert_eq!(
        check_links(&docs, "docs/operations.md", md),
        [
            "docs/operations.md:1: docs/reliability.md has no anchor #nope",
            "docs/operations.md:1: gone.md is not a file",
            "docs/operations.md:1: docs/operations.md has no anchor #nope",
        ]
    );
}
