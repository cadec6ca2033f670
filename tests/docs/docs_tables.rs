//! Every table in README.md and docs/*.md renders on GitHub with all of its cells: the delimiter
//! row and every row have as many cells as the header, no line of text runs on into a table, and
//! no row stands apart from its table (a blank line or a paragraph above it ends the table, and
//! the row shows as text).
//!
//! Rows are cut as GitHub's parser (cmark-gfm) cuts them, before any inline parsing: at every
//! `|` that no backslash escapes, inside a code span too (`a|b` in backticks is two cells there;
//! write `a\|b`). A row's leading and trailing pipes are optional.

use crate::common;

/// The cells of a table row.
fn cells(line: &str) -> usize {
    let row = line.trim();
    let mut pipes = Vec::new();
    let mut bytes = row.bytes().enumerate();
    while let Some((i, b)) = bytes.next() {
        match b {
            // A backslash escapes the ASCII punctuation after it, a pipe included.
            b'\\'
                if row
                    .as_bytes()
                    .get(i + 1)
                    .is_some_and(u8::is_ascii_punctuation) =>
            {
                bytes.next();
            }
            b'|' => pipes.push(i),
            _ => {}
        }
    }
    let mut n = pipes.len() + 1;
    if pipes.first() == Some(&0) {
        n -= 1;
    }
    if row.len() > 1 && pipes.last() == Some(&(row.len() - 1)) {
        n -= 1;
    }
    n
}

/// Whether `line` holds an unescaped pipe (a table's header must).
fn has_pipe(line: &str) -> bool {
    cells(line) > 1 || line.trim().starts_with('|') || line.trim().ends_with('|')
}

/// A delimiter row: cells of dashes, each with an optional colon at either end.
fn is_delimiter(line: &str) -> bool {
    let row = line.trim();
    let row = row.strip_prefix('|').unwrap_or(row);
    let row = row.strip_suffix('|').unwrap_or(row);
    !row.trim().is_empty()
        && row.split('|').all(|cell| {
            let cell = cell.trim();
            let cell = cell.strip_prefix(':').unwrap_or(cell);
            let cell = cell.strip_suffix(':').unwrap_or(cell);
            !cell.is_empty() && cell.bytes().all(|b| b == b'-')
        })
}

/// The opening of a code fence: its character and length.
fn fence(line: &str) -> Option<(u8, usize)> {
    let line = line.trim_start();
    let c = *line.as_bytes().first()?;
    let n = line.bytes().take_while(|&b| b == c).count();
    ((c == b'`' || c == b'~') && n >= 3).then_some((c, n))
}

/// A line that starts another block and so ends a table without joining it.
fn starts_block(line: &str) -> bool {
    let l = line.trim_start();
    let list = l.starts_with("- ") || l.starts_with("* ") || l.starts_with("+ ") || {
        let digits = l.bytes().take_while(u8::is_ascii_digit).count();
        digits > 0 && (l[digits..].starts_with(". ") || l[digits..].starts_with(") "))
    };
    list || l.starts_with('#') || l.starts_with('>') || l.starts_with('<') || fence(l).is_some()
}

/// What GitHub renders wrong in one markdown file, each as `name:line: why`.
fn check(name: &str, text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut problems = Vec::new();
    let mut say = |i: usize, why: String| problems.push(format!("{name}:{}: {why}", i + 1));
    let mut open_fence: Option<(u8, usize)> = None;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if let Some((c, n)) = open_fence {
            if fence(line).is_some_and(|(d, m)| d == c && m >= n)
                && line.trim().bytes().all(|b| b == c)
            {
                open_fence = None;
            }
            i += 1;
            continue;
        }
        if let Some(f) = fence(line) {
            open_fence = Some(f);
            i += 1;
            continue;
        }
        if has_pipe(line) && lines.get(i + 1).is_some_and(|d| is_delimiter(d)) {
            let header = cells(line);
            let widths = cells(lines[i + 1]);
            if widths != header {
                say(
                    i + 1,
                    format!(
                        "the delimiter row has {widths} cells, the header {header}: GitHub draws no table"
                    ),
                );
            }
            i += 2;
            // Text that runs on into the table is said once, at its first line.
            let mut ran_on = false;
            while i < lines.len() && !lines[i].trim().is_empty() && !starts_block(lines[i]) {
                let n = cells(lines[i]);
                if !has_pipe(lines[i]) {
                    if !ran_on && n != header {
                        say(
                            i,
                            format!(
                                "text runs on into the table above: GitHub makes each of its lines a row of 1 cell, not {header} (a blank line missing?)"
                            ),
                        );
                    }
                    ran_on = true;
                } else if n != header {
                    say(
                        i,
                        format!(
                            "{n} cells, the header {header} (a `|` to escape as `\\|`, in code spans too?)"
                        ),
                    );
                }
                i += 1;
            }
            continue;
        }
        if line.trim_start().starts_with('|') && cells(line) > 1 {
            say(
                i,
                "a row outside any table: a blank line or text above cut it from its table (or it lacks a delimiter row), so it shows as text".to_owned(),
            );
        }
        i += 1;
    }
    problems
}

#[test]
fn every_table_row_has_as_many_cells_as_its_header() {
    let files = common::docs::markdown();
    assert!(files.len() > 1, "no docs/*.md found: {files:?}");
    let mut problems = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(common::docs::root().join(path))
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let name = path.display().to_string();
        problems.extend(check(&name, &text));
    }
    assert!(
        problems.is_empty(),
        "{} places where GitHub renders a table wrong:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_check_finds_what_github_renders_wrong() {
    let good = "\
| a | b `x \\| y` |
|---|:-:|
| 1 | 2 |
3 | 4

| a | b |
| --- | --- |
";
    assert_eq!(check("good.md", good), Vec::<String>::new());
    // A pipe in a code span is a cell's end on GitHub.
    let code_pipe = "| a | b |\n|---|---|\n| `x|y` | 2 |\n";
    assert_eq!(check("t.md", code_pipe).len(), 1, "{code_pipe}");
    assert!(check("t.md", code_pipe)[0].starts_with("t.md:3: 3 cells"));
    // A backslash before a backslash escapes that one, not the pipe.
    assert_eq!(
        check("t.md", "| a | b |\n|---|---|\n| x \\\\| y | z |\n").len(),
        1
    );
    // Rows below a paragraph that cut the table: rows no more.
    let cut = "| a | b |\n|---|---|\n| 1 | 2 |\n\nText.\n| 3 | 4 |\n";
    let found = check("t.md", cut);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("t.md:6: a row outside any table"),
        "{found:?}"
    );
    // Text right below a table joins it.
    let run_on = "| a | b |\n|---|---|\n| 1 | 2 |\nText\nrunning on.\n";
    let found = check("t.md", run_on);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("t.md:4: text runs on"), "{found:?}");
    // A delimiter row of another width: no table at all.
    assert!(check("t.md", "| a | b |\n|---|\n")[0].starts_with("t.md:2: the delimiter row"));
    // Too few cells, too.
    assert_eq!(check("t.md", "| a | b |\n|---|---|\n| 1 |\n").len(), 1);
    // Fenced code is no table.
    assert!(check("t.md", "```\n| a |\n| 1 | 2 |\n```\n").is_empty());
    assert!(check("t.md", "~~~~\n```\n| 1 | 2 |\n~~~~\n").is_empty());
}
