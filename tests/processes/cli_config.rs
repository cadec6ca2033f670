//! The config file and the environment as an operator uses them, through the `kvferry` binary:
//! a `--config FILE` (or `KVFERRY_CONFIG`) sets a registry's and an agent's flags, the command
//! line beats the environment which beats the file, an unknown key or a bad value is refused
//! with a message naming the key and the file, `--log-format json` writes JSON lines on stderr,
//! and `--version` answers.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(30);

/// The debug binary with no KVFERRY_* variable of the test's environment.
fn kvferry() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("KVFERRY_") {
            cmd.env_remove(name);
        }
    }
    cmd.env("RUST_LOG", "info").stdin(Stdio::null());
    cmd
}

/// A folder for this test process's files.
fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvferry-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(name: &str, text: &str) -> PathBuf {
    let path = dir().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A running kvferry process, stopped (SIGTERM, then SIGKILL) when dropped.
struct Running {
    child: Child,
    listening: Value,
    stderr: PathBuf,
}

impl Running {
    /// Starts `cmd` with stderr to a file and waits for its listening line.
    fn start(mut cmd: Command, name: &str) -> Running {
        let stderr = dir().join(format!("{name}.log"));
        cmd.stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            for _ in lines {}
        });
        let line = match rx.recv_timeout(BOUND) {
            Ok(Some(Ok(line))) => line,
            _ => {
                let _ = child.kill();
                let log = std::fs::read_to_string(&stderr).unwrap_or_default();
                panic!("{name} printed no listening line within {BOUND:?}:\n{log}");
            }
        };
        let listening: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{name}: {line:?}: {e}"));
        assert_eq!(listening["event"], "listening", "{line}");
        Running {
            child,
            listening,
            stderr,
        }
    }

    fn field(&self, key: &str) -> String {
        self.listening[key]
            .as_str()
            .unwrap_or_else(|| panic!("no {key}: {}", self.listening))
            .to_owned()
    }

    /// SIGTERM; waits for the exit and returns stderr.
    fn stop(mut self) -> String {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let start = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                start.elapsed() < BOUND,
                "no exit within {BOUND:?} of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 request to `url` (`http://host:port`); returns the status and the JSON body.
fn http(method: &str, url: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let addr = url.strip_prefix("http://").unwrap();
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(BOUND)).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let text = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (
        status,
        serde_json::from_str(text).unwrap_or(Value::String(text.to_owned())),
    )
}

/// The lease TTL a registry grants: registers a made-up prefill rank and reads the lease.
fn lease_ttl_ms(registry: &Running) -> u64 {
    let rank = json!({
        "instance_id": uuid(),
        "role": "prefill",
        "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
        "layout": { "kind": "mha", "num_layers": 4, "num_kv_heads": 4, "head_dim": 32, "dtype": "fp16", "page_size": 16 },
        "slice": { "heads": { "start": 0, "end": 4 }, "layers": { "start": 0, "end": 4 } },
        "control_endpoint": "tcp://127.0.0.1:1",
    });
    let (status, v) = http("POST", &registry.field("url"), "/v1/ranks", Some(&rank));
    assert_eq!(status, 201, "{v}");
    v["lease_ttl_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("no lease_ttl_ms: {v}"))
}

fn uuid() -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("6f0b7c1e-3d2a-4e5f-8a9b-{:012x}", n & 0xffff_ffff_ffff)
}

fn registry(args: &[&str], env: &[(&str, &str)], name: &str) -> Running {
    let mut cmd = kvferry();
    cmd.args(args).envs(env.iter().copied());
    Running::start(cmd, name)
}

/// How a registry is started: a name, its arguments, its extra environment, the lease TTL
/// it must grant.
type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>, u64);

#[test]
fn config_file_sets_the_registry_flags_and_loses_to_env_and_command_line() {
    let file = write(
        "registry.toml",
        "host = \"127.0.0.1\"\nport = 0\nlease-ttl-ms = 1111\n",
    );
    let f = file.to_str().unwrap();
    let cases: [Case<'_>; 5] = [
        ("file", vec!["--config", f, "bootstrap"], vec![], 1111),
        (
            "file after the subcommand",
            vec!["bootstrap", "--config", f],
            vec![],
            1111,
        ),
        (
            "KVFERRY_CONFIG",
            vec!["bootstrap"],
            vec![("KVFERRY_CONFIG", f)],
            1111,
        ),
        (
            "env beats file",
            vec!["--config", f, "bootstrap"],
            vec![("KVFERRY_LEASE_TTL_MS", "2222")],
            2222,
        ),
        (
            "command line beats env and file",
            vec!["--config", f, "bootstrap", "--lease-ttl-ms", "3333"],
            vec![("KVFERRY_LEASE_TTL_MS", "2222")],
            3333,
        ),
    ];
    for (how, args, env, want) in cases {
        let r = registry(&args, &env, "registry");
        let url = r.field("url");
        assert!(
            url.starts_with("http://127.0.0.1:"),
            "{how}: the file's host: {url}"
        );
        assert!(!url.ends_with(":8998"), "{how}: the file's port 0: {url}");
        let got = lease_ttl_ms(&r);
        println!("{how}: {url}, lease_ttl_ms {got}");
        assert_eq!(got, want, "{how}");
        r.stop();
    }
}

#[test]
fn config_file_configures_an_agent() {
    let reg = registry(
        &["bootstrap", "--host", "127.0.0.1", "--port", "0"],
        &[],
        "agent-registry",
    );
    let url = reg.field("url");
    let file = write(
        "decode.toml",
        &format!(
            "# a decode rank\nbootstrap = \"{url}\"\nmodel = \"tiny\"\ntp-size = 2\ntp-rank = 1\npool-pages = 16\n\
             host = \"127.0.0.1\"\napi-port = 0\nchecksum = true\nsynthetic = false\ncopy-threads = 1\n\
             log-format = \"json\"\n"
        ),
    );
    let mut cmd = kvferry();
    cmd.args(["decode", "--config", file.to_str().unwrap()]);
    let decode = Running::start(cmd, "decode");
    assert_eq!(decode.listening["model"], "tiny", "{}", decode.listening);
    let (status, v) = http("GET", &url, "/v1/ranks", None);
    assert_eq!(status, 200, "{v}");
    let ranks = v["ranks"].as_array().unwrap_or_else(|| panic!("{v}"));
    let rank = ranks
        .iter()
        .find(|r| r["role"] == "decode")
        .unwrap_or_else(|| panic!("the decode did not register: {v}"));
    println!("registered: {rank}");
    assert_eq!(
        (rank["tp_rank"].as_u64(), rank["tp_size"].as_u64()),
        (Some(1), Some(2)),
        "{rank}"
    );
    let stderr = decode.stop();
    // log-format = "json" from the file: every stderr line is a JSON object with a level.
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "no logs");
    for line in &lines {
        let v: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
    }
    assert!(
        lines.iter().any(|l| l.contains("decode agent listening")),
        "{stderr}"
    );
    reg.stop();
}

#[test]
fn unknown_keys_and_bad_values_are_refused_naming_key_and_file() {
    let cases = [
        ("typo.toml", "port = 0\nlease-ttl = 5\n", "lease-ttl"),
        (
            "bad-value.toml",
            "port = 0\nlease-ttl-ms = \"soon\"\n",
            "lease-ttl-ms",
        ),
        ("snake-case.toml", "lease_ttl_ms = 5\n", "lease-ttl-ms"),
    ];
    for (name, text, key) in cases {
        let file = write(name, text);
        let out = kvferry()
            .args(["--config", file.to_str().unwrap(), "bootstrap"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("{name}: {} {stderr}", out.status);
        assert_eq!(out.status.code(), Some(2), "{name}");
        assert!(
            stderr.contains(&format!("`{key}`")),
            "{name}: names the key: {stderr}"
        );
        assert!(
            stderr.contains(file.to_str().unwrap()),
            "{name}: names the file: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{name}: nothing on stdout");
    }
    let out = kvferry()
        .args(["bootstrap", "--port", "0"])
        .env("KVFERRY_CONFIG", "/nonexistent/kvferry.toml")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("/nonexistent/kvferry.toml"), "{stderr}");
}

#[test]
fn version_and_json_logs_from_the_environment() {
    // Its parts are cli_version's; here, that the binary answers it.
    let out = kvferry().arg("-V").output().unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with(&format!("kvferry {} (git ", env!("CARGO_PKG_VERSION"))),
        "{stdout}"
    );

    let r = registry(
        &["bootstrap", "--host", "127.0.0.1", "--port", "0"],
        &[("KVFERRY_LOG_FORMAT", "json")],
        "json-registry",
    );
    let (status, _) = http("GET", &r.field("url"), "/healthz", None);
    assert_eq!(status, 200);
    let stderr = r.stop();
    let events: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let listening = events
        .iter()
        .find(|e| e["message"] == "bootstrap registry listening")
        .unwrap_or_else(|| panic!("{stderr}"));
    // Structured fields stay fields.
    assert!(
        listening["url"]
            .as_str()
            .is_some_and(|u| u.starts_with("http://")),
        "{listening}"
    );
    assert_eq!(listening["level"], "INFO");
}
