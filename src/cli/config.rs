//! The config file: `--config FILE` (or `KVFERRY_CONFIG`), a TOML table whose keys are the long
//! flag names of the subcommand being run, e.g. for `kvferry decode`:
//!
//! ```toml
//! bootstrap = "http://10.0.0.1:8998"
//! tp-size = 2
//! checksum = true
//! log-format = "json"   # global flags may be set too
//! ```
//!
//! Precedence: command line > environment (`KVFERRY_*`) > config file > default. The file is
//! read before clap parses: each key that neither the command line nor the environment sets
//! becomes a `--key=value` argument inserted right after the subcommand name, so clap validates
//! a file's value exactly as it validates a flag. A key that names no flag of the subcommand,
//! and a value clap refuses, are errors naming the key and the file.
//!
//! Values: strings, integers and floats as the flag's value; `true` sets a switch (`false`
//! leaves it off); an array for a comma-separated list flag (`tokens = [16, 4096]`).

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::builder::ArgAction;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Arg, CommandFactory as _, FromArgMatches as _};

use super::Cli;
use crate::env::CONFIG_ENV;

/// Keys a config file cannot set.
const NOT_IN_FILE: [&str; 3] = ["config", "help", "version"];

/// Parses the command line (`argv[0]` is the program), applying the config file if one is
/// named. Errors are clap errors: `.exit()` prints them and exits 2 (0 for help and version).
pub fn parse<I, T>(argv: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    parse_with_env(argv, &|name| std::env::var_os(name))
}

/// [`parse`] with the environment lookup given (tests); clap itself still reads the process
/// environment for the flags' `env` values.
fn parse_with_env<I, T>(argv: I, env: &dyn Fn(&str) -> Option<OsString>) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let mut cmd = Cli::command();
    cmd.build();
    let scan = scan(&cmd, &argv);
    let path = scan
        .config
        .clone()
        .or_else(|| env(CONFIG_ENV).filter(|v| !v.is_empty()))
        .map(PathBuf::from);
    let (Some(path), Some((sub_at, sub)), false) = (path, scan.subcommand.clone(), scan.help)
    else {
        // No file, no subcommand (clap says what is missing) or help/version: parse as is.
        return parse_built(cmd, argv);
    };
    let table = read(&path)?;
    let Some(sub_cmd) = cmd.find_subcommand(&sub) else {
        return parse_built(cmd, argv);
    };
    let items = file_args(sub_cmd, &sub, &table, &path, &scan.given, env)?;
    let inserted: Vec<String> = items.iter().map(|(key, _)| key.clone()).collect();
    let mut merged = argv;
    merged.splice(
        sub_at + 1..sub_at + 1,
        items.into_iter().flat_map(|(_, v)| v),
    );
    parse_built(cmd, merged).map_err(|e| blame_file(e, &inserted, &path))
}

/// What the command line says before clap parses it.
#[derive(Debug, Default)]
struct Scan {
    /// `--config FILE`.
    config: Option<OsString>,
    /// The subcommand and its index in argv.
    subcommand: Option<(usize, String)>,
    /// Long names of the flags given (short ones mapped to their long names).
    given: HashSet<String>,
    /// `--help`, `-h`, `--version`, `-V` or the `help` subcommand.
    help: bool,
}

/// Walks argv as clap will: options (with their values), then the subcommand, up to `--`.
fn scan(root: &clap::Command, argv: &[OsString]) -> Scan {
    let mut out = Scan::default();
    let mut current = root;
    let mut i = 1;
    while i < argv.len() {
        let Some(token) = argv[i].to_str() else {
            i += 1;
            continue;
        };
        if token == "--" {
            break;
        }
        let found = if let Some(long) = token.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, _)) => (n, true),
                None => (long, false),
            };
            current
                .get_arguments()
                .find(|a| {
                    a.get_long() == Some(name)
                        || a.get_all_aliases().is_some_and(|al| al.contains(&name))
                })
                .map(|a| (a, inline))
        } else if let Some(shorts) = token.strip_prefix('-').filter(|s| !s.is_empty()) {
            let mut chars = shorts.chars();
            let first = chars.next();
            current
                .get_arguments()
                .find(|a| a.get_short().is_some() && a.get_short() == first)
                .map(|a| (a, chars.next().is_some()))
        } else {
            if out.subcommand.is_none()
                && let Some(sub) = current
                    .get_subcommands()
                    .find(|s| s.get_name() == token || s.get_all_aliases().any(|a| a == token))
            {
                out.help |= sub.get_name() == "help";
                out.subcommand = Some((i, sub.get_name().to_owned()));
                current = sub;
            }
            None
        };
        if let Some((arg, inline)) = found {
            let id = arg.get_id().as_str();
            out.help |= matches!(
                arg.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            );
            let value = if takes_value(arg) && !inline {
                i += 1;
                argv.get(i).cloned()
            } else {
                token.split_once('=').map(|(_, v)| v.into())
            };
            if id == "config" {
                out.config = value;
            }
            if let Some(long) = arg.get_long() {
                out.given.insert(long.to_owned());
            }
        }
        i += 1;
    }
    out
}

fn takes_value(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Set | ArgAction::Append)
}

/// Reads and parses the config file.
fn read(path: &Path) -> Result<toml::Table, clap::Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        error(
            ErrorKind::Io,
            format!("cannot read config file {}: {e}", path.display()),
        )
    })?;
    text.parse::<toml::Table>().map_err(|e| {
        let detail = e.to_string();
        error(
            ErrorKind::ValueValidation,
            format!(
                "config file {} is not valid TOML: {}",
                path.display(),
                detail.trim_end()
            ),
        )
    })
}

/// The arguments the file adds for `sub`: per key, `--key=value` items (none for a key the
/// command line or the environment already sets, or a switch set to false).
fn file_args(
    sub_cmd: &clap::Command,
    sub: &str,
    table: &toml::Table,
    path: &Path,
    given: &HashSet<String>,
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Vec<(String, Vec<OsString>)>, clap::Error> {
    let file = path.display();
    let mut out = Vec::new();
    for (key, value) in table {
        if NOT_IN_FILE.contains(&key.as_str()) {
            return Err(error(
                ErrorKind::UnknownArgument,
                format!("key `{key}` in config file {file} cannot be set in a config file"),
            ));
        }
        let Some(arg) = sub_cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()))
        else {
            let hint = if key.contains('_') {
                format!(
                    " (keys are flag names in kebab-case: `{}`)",
                    key.replace('_', "-")
                )
            } else {
                String::new()
            };
            return Err(error(
                ErrorKind::UnknownArgument,
                format!(
                    "unknown key `{key}` in config file {file}: `kvferry {sub}` has no --{key} flag{hint}; \
                     see `kvferry {sub} --help`"
                ),
            ));
        };
        let from_env = arg
            .get_env()
            .and_then(|name| name.to_str())
            .is_some_and(|name| env(name).is_some());
        if given.contains(key) || from_env {
            continue;
        }
        let bad = |what: &str| {
            error(
                ErrorKind::InvalidValue,
                format!(
                    "key `{key}` in config file {file}: {what}, not {}",
                    kind_of(value)
                ),
            )
        };
        let items: Vec<OsString> = match arg.get_action() {
            ArgAction::SetTrue => match value {
                toml::Value::Boolean(true) => vec![format!("--{key}").into()],
                toml::Value::Boolean(false) => Vec::new(),
                _ => return Err(bad("a switch takes true or false")),
            },
            ArgAction::Set | ArgAction::Append => match value {
                toml::Value::Array(values) => {
                    let scalars: Vec<String> = values
                        .iter()
                        .map(scalar)
                        .collect::<Option<_>>()
                        .ok_or_else(|| bad("a list holds strings or numbers"))?;
                    if let Some(delimiter) = arg.get_value_delimiter() {
                        vec![format!("--{key}={}", scalars.join(&delimiter.to_string())).into()]
                    } else if matches!(arg.get_action(), ArgAction::Append) {
                        scalars
                            .iter()
                            .map(|v| format!("--{key}={v}").into())
                            .collect()
                    } else {
                        return Err(bad("this flag takes one value"));
                    }
                }
                other => match scalar(other) {
                    Some(v) => vec![format!("--{key}={v}").into()],
                    None => return Err(bad("this flag takes a string or a number")),
                },
            },
            _ => return Err(bad("this flag cannot be set in a config file")),
        };
        out.push((key.clone(), items));
    }
    Ok(out)
}

/// A scalar TOML value as a flag value.
fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Datetime(d) => Some(d.to_string()),
        toml::Value::Array(_) | toml::Value::Table(_) => None,
    }
}

fn kind_of(value: &toml::Value) -> &'static str {
    match value {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a datetime",
        toml::Value::Array(_) => "an array",
        toml::Value::Table(_) => "a table",
    }
}

/// A clap error about a value that came from the file names the key and the file.
fn blame_file(e: clap::Error, inserted: &[String], path: &Path) -> clap::Error {
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let Some(key) = inserted.iter().find(|k| {
        let flag = format!("--{k}");
        arg == &flag || arg.starts_with(&format!("{flag} ")) || arg.starts_with(&format!("{flag}="))
    }) else {
        return e;
    };
    let rendered = e.to_string();
    let first = rendered.lines().next().unwrap_or_default();
    let first = first.strip_prefix("error: ").unwrap_or(first);
    error(
        e.kind(),
        format!("key `{key}` in config file {}: {first}", path.display()),
    )
}

/// A clap error formatted like clap's own.
fn error(kind: ErrorKind, message: String) -> clap::Error {
    clap::Error::raw(kind, message).format(&mut Cli::command())
}

/// `Cli::try_parse_from` with an already built command.
fn parse_built(cmd: clap::Command, argv: Vec<OsString>) -> Result<Cli, clap::Error> {
    let mut matches = cmd.try_get_matches_from(argv)?;
    Cli::from_arg_matches_mut(&mut matches)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;
    use crate::cli::Command;

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvferry-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn no_env(_: &str) -> Option<OsString> {
        None
    }

    fn parse(argv: &[&str], env: &dyn Fn(&str) -> Option<OsString>) -> Result<Cli, clap::Error> {
        parse_with_env(std::iter::once("kvferry").chain(argv.iter().copied()), env)
    }

    fn agent(cli: Cli) -> crate::agent::AgentOptions {
        match cli.command {
            Command::Prefill(a) | Command::Decode(a) => a,
            other => panic!("not an agent: {other:?}"),
        }
    }

    // These tests assume no KVFERRY_* agent variable is set in the test environment (clap
    // reads them itself); `scripts/test` and CI set none.

    #[test]
    fn file_values_fill_flags_the_command_line_leaves_out() {
        let path = temp_file(
            "agent.toml",
            "bootstrap = \"http://10.0.0.1:8998\"\ntp-size = 2\ntp-rank = 1\nchecksum = true\n\
             synthetic = false\nsynthetic-layer-ms = 0.5\nlog-format = \"json\"\n",
        );
        let p = path.to_str().unwrap();
        let cli = parse(&["--config", p, "decode", "--tp-rank", "0"], &no_env).unwrap();
        assert_eq!(cli.log_format, crate::cli::LogFormat::Json);
        let a = agent(cli);
        assert_eq!(a.bootstrap, "http://10.0.0.1:8998");
        assert_eq!(
            (a.tp_rank, a.tp_size),
            (0, 2),
            "the command line beats the file"
        );
        assert!(a.checksum);
        assert!(!a.synthetic);
        assert_eq!(a.synthetic_layer_ms, 0.5);
        assert_eq!(a.pool_pages, 1024, "unset keys keep their defaults");
        // --config after the subcommand, and `--flag=value` on the command line.
        let a = agent(parse(&["prefill", "--tp-size=4", "--config", p], &no_env).unwrap());
        assert_eq!((a.tp_rank, a.tp_size), (1, 4));
        // KVFERRY_CONFIG names the file when --config is absent.
        let env = |name: &str| (name == CONFIG_ENV).then(|| OsString::from(p));
        let a = agent(parse(&["decode"], &env).unwrap());
        assert_eq!((a.tp_rank, a.tp_size, a.checksum), (1, 2, true));
    }

    #[test]
    fn the_environment_beats_the_file() {
        let path = temp_file("env.toml", "tp-size = 2\npool-pages = 64\n");
        let mut cmd = Cli::command();
        cmd.build();
        let decode = cmd.find_subcommand("decode").unwrap();
        let table = read(&path).unwrap();
        let env = |name: &str| (name == "KVFERRY_TP_SIZE").then(|| OsString::from("8"));
        let items = file_args(decode, "decode", &table, &path, &HashSet::new(), &env).unwrap();
        let keys: Vec<&str> = items.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["pool-pages"], "tp-size is left to the environment");
        assert_eq!(items[0].1, [OsString::from("--pool-pages=64")]);
    }

    #[test]
    fn lists_and_bench_flags() {
        let path = temp_file(
            "bench.toml",
            "tokens = [16, 4096]\ntransport = [\"zmq-tcp\", \"zmq-ipc\"]\njson = true\n",
        );
        let cli = parse(&["bench", "--config", path.to_str().unwrap()], &no_env).unwrap();
        let Command::Bench(b) = cli.command else {
            panic!("not bench")
        };
        let text = format!("{b:?}");
        assert!(text.contains("tokens: [16, 4096]"), "{text}");
        assert!(text.contains("json: true"), "{text}");
        assert!(
            text.contains("label: \"zmq-tcp\"") && text.contains("label: \"zmq-ipc\""),
            "{text}"
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key_and_the_file() {
        let cases = [
            ("typo.toml", "lease-ttl = 5\n", "unknown key `lease-ttl`"),
            ("snake.toml", "lease_ttl_ms = 5\n", "`lease-ttl-ms`"),
            (
                "value.toml",
                "lease-ttl-ms = \"soon\"\n",
                "key `lease-ttl-ms`",
            ),
            ("negative.toml", "port = -1\n", "key `port`"),
            (
                "table.toml",
                "[bootstrap]\nport = 1\n",
                "unknown key `bootstrap`",
            ),
            ("switch.toml", "host = true\nport = [1, 2]\n", "key `port`"),
            ("config.toml", "config = \"x.toml\"\n", "key `config`"),
            ("syntax.toml", "port = \n", "not valid TOML"),
        ];
        for (name, text, want) in cases {
            let path = temp_file(name, text);
            let p = path.to_str().unwrap();
            let err = parse(&["--config", p, "bootstrap"], &no_env).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(want), "{name}: {msg}");
            assert!(msg.contains(p), "{name} names the file: {msg}");
            assert_ne!(err.exit_code(), 0, "{name}");
        }
        let missing = parse(
            &["--config", "/nonexistent/kvferry.toml", "bootstrap"],
            &no_env,
        )
        .unwrap_err();
        assert!(
            missing.to_string().contains("/nonexistent/kvferry.toml"),
            "{missing}"
        );
        // A bad value on the command line is clap's own error, not blamed on the file.
        let path = temp_file("fine.toml", "port = 1\n");
        let err = parse(
            &[
                "--config",
                path.to_str().unwrap(),
                "bootstrap",
                "--lease-ttl-ms",
                "x",
            ],
            &no_env,
        )
        .unwrap_err();
        assert!(!err.to_string().contains("config file"), "{err}");
    }

    #[test]
    fn help_and_version_ignore_a_broken_file() {
        let path = temp_file("broken.toml", "nonsense = 1\n");
        let p = path.to_str().unwrap();
        for argv in [
            vec!["--config", p, "bootstrap", "--help"],
            vec!["--config", p, "--version"],
        ] {
            let err = parse(&argv, &no_env).unwrap_err();
            assert!(
                matches!(
                    err.kind(),
                    ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
                ),
                "{argv:?}: {err}"
            );
        }
    }

    #[test]
    fn values_after_double_dash_and_flag_values_are_not_subcommands() {
        let mut cmd = Cli::command();
        cmd.build();
        let argv: Vec<OsString> = [
            "kvferry",
            "--log-format",
            "json",
            "decode",
            "--model",
            "bench",
            "--config=x.toml",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let s = scan(&cmd, &argv);
        assert_eq!(s.subcommand, Some((3, "decode".to_owned())));
        assert_eq!(s.config, Some(OsString::from("x.toml")));
        assert!(s.given.contains("model") && s.given.contains("log-format"));
        assert!(!s.help);
    }

    #[test]
    fn every_flag_has_its_own_kvferry_env() {
        let mut cmd = Cli::command();
        cmd.build();
        let mut checked = 0;
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            let mut seen = HashSet::new();
            for arg in sub.get_arguments() {
                if matches!(
                    arg.get_action(),
                    ArgAction::Help
                        | ArgAction::HelpShort
                        | ArgAction::HelpLong
                        | ArgAction::Version
                ) {
                    continue;
                }
                let env = arg.get_env().and_then(OsStr::to_str).unwrap_or_else(|| {
                    panic!("`kvferry {} --{}` has no env", sub.get_name(), arg.get_id())
                });
                assert!(env.starts_with("KVFERRY_"), "{env}");
                assert!(
                    seen.insert(env.to_owned()),
                    "{env} used twice in `kvferry {}`",
                    sub.get_name()
                );
                checked += 1;
            }
        }
        assert!(checked > 50, "only {checked} flags");
    }
}
