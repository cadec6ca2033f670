//! Every command of README.md and docs/*.md runs as written: each `kvferry SUB ...` (also
//! `/path/to/kvferry`, `cargo run ... -- SUB`, `python -m kvferry SUB`) names a subcommand of
//! `kvferry --help`, and each long flag after it is one that subcommand's `--help` lists (its
//! own or a global one; `python -m kvferry` runs the same command line); a repository path a command names (`scripts/...`, `python/...`, `examples/...`, `emu/...`)
//! exists, and a flag given to a repository script appears in that script's text.
//!
//! Commands are the lines of shell code blocks (sh, bash, console or none; a `\` at the end of
//! a line continues it), the `ExecStart=` of ini blocks, the `args: [...]` of a YAML container
//! whose image is kvferry's, and every inline code span (`\|` in a table is `|`). Each is split
//! like shell: quotes group, `#` starts a comment, and `|`, `||`, `&&`, `;`, `&`, `(`, `)`, `$(`,
//! `` ` ``, `{`, `}` end one command and start the next; a `|` inside a word (`prefill|decode`,
//! `tcp|tcp,cma`) is the docs' notation for alternatives, each of which is checked. Only a
//! command word counts, after `VAR=value` assignments and `$`, `sudo`, `exec`, `nohup`, `env`,
//! `time`: `kvferry_rooms_total`, `kvferry::cli`, `kvferry-*.whl` or `kvferry room 42` inside
//! an error message are no invocations. A placeholder for the subcommand (`kvferry <role>
//! --help`, `ROLE`) stands for any of them: a flag after it must be some subcommand's.

use crate::common;

use common::docs::root;

use std::collections::{BTreeMap, BTreeSet};

use common::help;

/// The long flags of a `--help` text, each with whether it takes a value (`--pool <POOL>`).
fn flags(help: &str) -> BTreeMap<String, bool> {
    let mut out = BTreeMap::new();
    for line in help.lines().filter(|l| l.trim_start().starts_with('-')) {
        let takes_value = line.contains('<');
        for word in line.split_whitespace() {
            if !word.starts_with('-') {
                break;
            }
            if let Some(name) = word.trim_end_matches(',').strip_prefix("--")
                && !name.is_empty()
            {
                out.insert(format!("--{name}"), takes_value);
            }
        }
    }
    out
}

/// What the binary accepts, from its `--help` texts.
struct Cli {
    /// Global flags (`--config`, `--log-format`, `--help`, `--version`) and whether each takes a
    /// value.
    global: BTreeMap<String, bool>,
    /// Each subcommand's long flags, its own and the global ones it lists.
    subcommands: BTreeMap<String, BTreeSet<String>>,
}

impl Cli {
    fn load() -> Cli {
        let top = help(&[]);
        let global = flags(&top);
        let names: Vec<String> = top
            .lines()
            .skip_while(|l| l.trim() != "Commands:")
            .skip(1)
            .take_while(|l| !l.trim().is_empty())
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect();
        assert!(
            names.len() >= 6 && names.iter().any(|n| n == "prefill"),
            "no subcommands found in kvferry --help:\n{top}"
        );
        let subcommands = names
            .into_iter()
            .map(|name| {
                // `kvferry help SUB` has no `--help` of its own and no flags but the global ones.
                let mut own: BTreeSet<String> = match name.as_str() {
                    "help" => BTreeSet::new(),
                    _ => flags(&help(&[&name])).into_keys().collect(),
                };
                own.extend(global.keys().cloned());
                (name, own)
            })
            .collect();
        Cli {
            global,
            subcommands,
        }
    }
}

/// One command's text and the line of the markdown file it starts on.
struct Command {
    line: usize,
    text: String,
}

/// The commands of a markdown file (see the module doc).
fn commands(text: &str) -> Vec<Command> {
    let mut out = Vec::new();
    // Outside code blocks: the prose, with code blocks blanked so that spans stay per paragraph.
    let mut prose: Vec<&str> = Vec::new();
    let mut fence: Option<String> = None;
    let mut pending: Option<Command> = None;
    let mut kvferry_image = false;
    let mut yaml_args: Option<Command> = None;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = match fence {
                Some(_) => None,
                None => Some(trimmed[3..].trim().to_owned()),
            };
            out.extend(pending.take());
            prose.push("");
            continue;
        }
        let Some(lang) = &fence else {
            prose.push(line);
            continue;
        };
        prose.push("");
        match lang.as_str() {
            "" | "sh" | "bash" | "shell" | "console" => {
                let (body, continued) = match line.trim_end().strip_suffix('\\') {
                    Some(body) => (body, true),
                    None => (line, false),
                };
                let cmd = pending.get_or_insert_with(|| Command {
                    line: n + 1,
                    text: String::new(),
                });
                cmd.text.push_str(body);
                cmd.text.push(' ');
                if !continued {
                    out.extend(pending.take());
                }
            }
            "ini" => {
                if let Some((key, value)) = line.split_once('=')
                    && key.trim().starts_with("Exec")
                {
                    out.push(Command {
                        line: n + 1,
                        text: value.to_owned(),
                    });
                }
            }
            "yaml" | "yml" => {
                if let Some(image) = trimmed.strip_prefix("image:") {
                    kvferry_image = image.contains("kvferry");
                } else if trimmed.starts_with("- name:") {
                    kvferry_image = false;
                }
                if let Some(rest) = trimmed.strip_prefix("args:")
                    && rest.trim_start().starts_with('[')
                {
                    yaml_args = Some(Command {
                        line: n + 1,
                        text: String::new(),
                    });
                }
                if let Some(args) = &mut yaml_args {
                    args.text.push_str(line);
                    args.text.push(' ');
                    if line.contains(']') {
                        let list = args.text.trim().trim_start_matches("args:").trim();
                        let list = list.trim_start_matches('[').trim_end_matches(']');
                        // Each item one word: `$(POD_IP)` is Kubernetes' expansion, not the
                        // shell's.
                        let items: Vec<String> = list
                            .split(',')
                            .map(|item| format!("'{}'", item.trim().trim_matches('"')))
                            .collect();
                        if kvferry_image {
                            out.push(Command {
                                line: args.line,
                                text: format!("kvferry {}", items.join(" ")),
                            });
                        }
                        yaml_args = None;
                    }
                }
            }
            _ => {}
        }
    }
    out.extend(pending);
    // Inline code spans, one paragraph at a time (a span never crosses a blank line).
    let mut start = 0;
    while start < prose.len() {
        let end = (start..prose.len())
            .find(|&i| prose[i].trim().is_empty())
            .unwrap_or(prose.len());
        let mut in_span = false;
        let mut span: Option<Command> = None;
        for (i, line) in prose[start..end].iter().enumerate() {
            for (k, piece) in line.split('`').enumerate() {
                if k > 0 {
                    in_span = !in_span;
                    if in_span {
                        span = Some(Command {
                            line: start + i + 1,
                            text: String::new(),
                        });
                    } else {
                        out.extend(span.take());
                    }
                }
                if let Some(s) = &mut span {
                    s.text.push_str(&piece.replace("\\|", "|"));
                }
            }
            if let Some(s) = &mut span {
                s.text.push(' ');
            }
        }
        start = end + 1;
    }
    out.sort_by_key(|c| c.line);
    out
}

/// The simple commands of a command line, each as its words (see the module doc).
fn split_shell(text: &str) -> Vec<Vec<String>> {
    let mut cmds: Vec<Vec<String>> = vec![Vec::new()];
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = text.chars().peekable();
    let end_word = |cmds: &mut Vec<Vec<String>>, word: &mut String, in_word: &mut bool| {
        if *in_word {
            cmds.last_mut()
                .expect("one command")
                .push(std::mem::take(word));
            *in_word = false;
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                in_word = true;
                for q in chars.by_ref() {
                    if q == c {
                        break;
                    }
                    word.push(q);
                }
            }
            '\\' => {
                in_word = true;
                word.extend(chars.next());
            }
            '#' if !in_word => break,
            c if c.is_whitespace() => end_word(&mut cmds, &mut word, &mut in_word),
            '|' if in_word
                && chars
                    .peek()
                    .is_some_and(|n| !n.is_whitespace() && *n != '|') =>
            {
                word.push(c);
            }
            '$' if chars.peek() == Some(&'(') => {
                chars.next();
                end_word(&mut cmds, &mut word, &mut in_word);
                cmds.push(Vec::new());
            }
            '|' | '&' | ';' | '(' | ')' | '`' | '{' | '}' => {
                if matches!(c, '{' | '}')
                    && (in_word || chars.peek().is_some_and(|n| !n.is_whitespace()))
                {
                    in_word = true;
                    word.push(c);
                    continue;
                }
                end_word(&mut cmds, &mut word, &mut in_word);
                cmds.push(Vec::new());
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    end_word(&mut cmds, &mut word, &mut in_word);
    cmds.retain(|c| !c.is_empty());
    cmds
}

/// Whether `word` assigns a shell variable (`KVFERRY_TOKEN=...`).
fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit())
    })
}

/// A long flag as written (`[--recv-into]`, `--tls=tcp`, `--json,`), without its decoration;
/// `None` for a word that is no long flag.
fn long_flag(word: &str) -> Option<&str> {
    let w = word.trim_start_matches(['[', '(']);
    let w = w.split('=').next().unwrap_or(w);
    let w = w.trim_end_matches([']', ')', ',', '.', ':']);
    (w.starts_with("--") && w.len() > 2 && w[2..].starts_with(|c: char| c.is_ascii_alphanumeric()))
        .then_some(w)
}

/// The repository paths (`scripts/x`, `./python`, `$PWD/python/tests/y`) in a word, skipping
/// patterns (`kvferry-*.whl`) and placeholders.
fn repo_paths(word: &str) -> Vec<String> {
    let mut out = Vec::new();
    for top in ["scripts/", "python/", "examples/", "emu/"] {
        for (at, _) in word.match_indices(top) {
            let before = &word[..at];
            let starts = before.is_empty()
                || before.ends_with(['(', '=', ':', '[', '"', '\''])
                || before.ends_with("./") && !before.ends_with("../")
                || before.ends_with("$PWD/");
            if !starts {
                continue;
            }
            let rest = &word[at..];
            let len = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')))
                .unwrap_or(rest.len());
            if rest[len..].starts_with(['*', '<', '?', '[']) {
                continue;
            }
            out.push(rest[..len].trim_end_matches(['.', ',']).to_owned());
        }
    }
    out
}

/// What one markdown file's commands get wrong, as `file:line: why`; and how many kvferry
/// invocations it has.
fn check(cli: &Cli, name: &str, text: &str) -> (Vec<String>, usize) {
    let mut bad = Vec::new();
    let mut invocations = 0;
    for cmd in commands(text) {
        let at = format!("{name}:{}", cmd.line);
        for words in split_shell(&cmd.text) {
            for word in &words {
                for path in repo_paths(word) {
                    if !root().join(&path).exists() {
                        bad.push(format!("{at}: {path} does not exist"));
                    }
                }
            }
            let mut words = words.as_slice();
            while let Some((first, rest)) = words.split_first() {
                if is_assignment(first)
                    || ["$", "sudo", "exec", "nohup", "env", "time"].contains(&first.as_str())
                {
                    words = rest;
                } else {
                    break;
                }
            }
            let Some((program, args)) = words.split_first() else {
                continue;
            };
            // A repository script, or a python running one: its flags are in its text.
            let script = if repo_paths(program).first() == Some(program) {
                Some((program, args))
            } else {
                args.split_first()
                    .filter(|(s, _)| s.ends_with(".py") && repo_paths(s).first() == Some(*s))
            };
            if let Some((script, script_args)) = script
                && let Ok(source) = std::fs::read_to_string(root().join(script))
            {
                for flag in script_args.iter().filter_map(|w| long_flag(w)) {
                    if !source.contains(flag) {
                        bad.push(format!("{at}: {script} has no {flag}"));
                    }
                }
            }
            let (form, args) = if program == "kvferry" || program.ends_with("/kvferry") {
                ("kvferry", args)
            } else if program == "cargo" && args.first().is_some_and(|a| a == "run") {
                let Some(dash) = args.iter().position(|a| a == "--") else {
                    continue;
                };
                let cargo = &args[..dash];
                let other_bin = cargo.iter().any(|a| a == "--example")
                    || cargo
                        .windows(2)
                        .any(|w| w[0] == "--bin" && w[1] != "kvferry");
                if other_bin {
                    continue;
                }
                ("cargo run --", &args[dash + 1..])
            } else if let [m, module, rest @ ..] = args
                && m == "-m"
                && module == "kvferry"
                && (program
                    .rsplit('/')
                    .next()
                    .is_some_and(|p| p.starts_with("python"))
                    || program.starts_with('$'))
            {
                ("python -m kvferry", rest)
            } else {
                continue;
            };
            if args.is_empty() {
                continue;
            }
            invocations += 1;
            bad.extend(check_invocation(cli, &at, form, args));
        }
    }
    (bad, invocations)
}

/// What one invocation's arguments (after `kvferry`) get wrong.
fn check_invocation(cli: &Cli, at: &str, form: &str, args: &[String]) -> Vec<String> {
    let mut bad = Vec::new();
    let mut i = 0;
    // Global flags before the subcommand.
    while let Some(word) = args.get(i) {
        let Some(flag) = long_flag(word) else {
            if word.starts_with('-') {
                i += 1;
                continue;
            }
            break;
        };
        match cli.global.get(flag) {
            Some(&takes_value) => i += 1 + usize::from(takes_value && !word.contains('=')),
            None => {
                bad.push(format!("{at}: `{form}` has no global flag {flag}"));
                i += 1;
            }
        }
    }
    let Some(sub) = args.get(i) else {
        return bad;
    };
    // A placeholder (`<role>`, `ROLE`) stands for any subcommand: a flag after it must be one of
    // some subcommand.
    let any: BTreeSet<String> = cli.subcommands.values().flatten().cloned().collect();
    let placeholder = sub.starts_with('<')
        || sub
            .chars()
            .all(|c| c.is_ascii_uppercase() || c == '_' || c == '-');
    let mut known = Vec::new();
    if placeholder {
        known.push((sub.as_str(), &any));
    }
    // `prefill|decode`: each of them.
    for s in sub.split('|').filter(|_| !placeholder) {
        match cli.subcommands.get(s) {
            None => bad.push(format!("{at}: `{form} {s}`: kvferry has no subcommand {s}")),
            Some(flags) => known.push((s, flags)),
        }
    }
    for word in &args[i + 1..] {
        if word == "--" {
            break;
        }
        let Some(flag) = long_flag(word) else {
            continue;
        };
        for (s, flags) in &known {
            if !flags.contains(flag) {
                bad.push(format!("{at}: `kvferry {s}` has no flag {flag}"));
            }
        }
    }
    bad
}

#[test]
fn every_documented_command_runs_as_written() {
    let cli = Cli::load();
    let mut bad = Vec::new();
    let mut invocations = 0;
    for path in common::docs::markdown() {
        let name = path.to_string_lossy().into_owned();
        let text = std::fs::read_to_string(root().join(&path)).expect("reading a doc");
        let (b, n) = check(&cli, &name, &text);
        bad.extend(b);
        invocations += n;
    }
    let mut seen = BTreeSet::new();
    bad.retain(|b| seen.insert(b.clone()));
    assert!(
        invocations > 50,
        "only {invocations} kvferry invocations found in the docs: the scan is broken"
    );
    assert!(
        bad.is_empty(),
        "{} documented commands do not run as written:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn a_wrong_command_is_reported() {
    let cli = Cli::load();
    let text = "\
Start it with `kvferry prefill --model tiny --no-such-flag`, then the others:

```sh
KVFERRY_TOKEN=x kvferry --log-format json decode --model tiny \\
  --pool-pages 64 --synthetic-layer-ms 5 | grep listening  # --not-checked
scripts/no-such-script --out /tmp/x && cargo run --release -- demo --json
\"$PY\" scripts/vllm/tiny_model.py /tmp/m --seed 0 --no-seed
python -m kvferry bench --no-such-flag
```

| `kvferry prefill\\|decoder --tp-rank R` | `error (decode server, kvferry room 42 failed)` |
| `kvferry_rooms_total`, `kvferry::cli`, `kvferry-*.whl` | `target/release/kvferry --version` |
";
    let (bad, invocations) = check(&cli, "x.md", text);
    assert_eq!(
        bad,
        [
            "x.md:1: `kvferry prefill` has no flag --no-such-flag",
            "x.md:4: `kvferry decode` has no flag --synthetic-layer-ms",
            "x.md:6: scripts/no-such-script does not exist",
            "x.md:7: scripts/vllm/tiny_model.py has no --no-seed",
            "x.md:8: `kvferry bench` has no flag --no-such-flag",
            "x.md:11: `kvferry decoder`: kvferry has no subcommand decoder",
        ]
    );
    assert_eq!(invocations, 6);
}
