//! The registry's guarantees through the real binary (release build, loopback, port 0):
//!
//! - credentials are not optional off loopback: `bootstrap`, `prefill` and `decode` refuse a
//!   non-loopback listening address without `--token`, unless `--insecure` (which warns); an
//!   engine API beyond loopback needs the token whatever `--insecure` says, and its listening
//!   line names an address a client can use, never the wildcard it binds; a token checked or
//!   sent beyond loopback needs HTTPS (`--tls-cert`, `--tls-key`; an `https://` registry), or
//!   `--insecure`, and the ports then serve HTTPS only;
//! - a live rank is never replaced: a second agent started with the same ranks gets 409s and
//!   exits non-zero naming the holder while the first keeps serving; a prefill restarted while
//!   its killed predecessor's lease is live waits, then registers, and rooms succeed; an agent
//!   whose lease lapsed and whose slot another instance took exits non-zero on its next renewal.
//!
//! Needs `cargo build --release --all-features --bin kvferry` first.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;
use reqwest::{Client, Method, StatusCode};
use serde_json::{Value, json};

/// Every `KVFERRY_*` variable a test run might inherit and that would change these processes.
const CLEARED_ENV: [&str; 6] = [
    "KVFERRY_INSECURE",
    "KVFERRY_TOKEN",
    "KVFERRY_BOOTSTRAP_TOKEN",
    "KVFERRY_HOST",
    "KVFERRY_API_HOST",
    "KVFERRY_BOOTSTRAP_HOST",
];

/// Runs `kvferry args` with `env` to its exit (bounded); its status and stderr.
fn run_to_exit(exe: &Path, args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String) {
    let mut cmd = Command::new(exe);
    for var in CLEARED_ENV {
        cmd.env_remove(var);
    }
    let mut child = cmd
        .args(args)
        .env_remove("KVFERRY_CONFIG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kvferry");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        if start.elapsed() > BOUND {
            let _ = child.kill();
            panic!("kvferry {args:?} did not exit within {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn log_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn non_loopback_addresses_need_a_token_or_insecure() {
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir("registry-exposure").expect("log dir");
    let in_clear = "is not loopback and its port checks a bearer token, which plain HTTP \
                    carries in clear: give --tls-cert and --tls-key (HTTPS), or --insecure";
    let host_in_clear = format!("--host 0.0.0.0 {in_clear}");
    let api_in_clear = format!("--api-host 0.0.0.0 {in_clear}");
    // Refused at start, naming the flag and the address, exit 1.
    for (args, says) in [
        (
            vec![
                "bootstrap",
                "--host",
                "0.0.0.0",
                "--port",
                "0",
                "--token",
                "t0k",
            ],
            host_in_clear.as_str(),
        ),
        (
            vec![
                "decode",
                "--api-host",
                "0.0.0.0",
                "--token",
                "t0k",
                "--synthetic",
            ],
            api_in_clear.as_str(),
        ),
        (
            vec![
                "decode",
                "--bootstrap",
                "http://10.0.0.5:8998",
                "--token",
                "t0k",
                "--synthetic",
            ],
            "--bootstrap http://10.0.0.5:8998 is plain HTTP beyond loopback and the token would \
             travel in clear: serve it over HTTPS and give its https:// URL, or --insecure",
        ),
        (
            vec![
                "proxy",
                "--host",
                "0.0.0.0",
                "--api-key",
                "k3y",
                "--prefill",
                "http://127.0.0.1:9",
                "--decode",
                "http://127.0.0.1:9",
            ],
            host_in_clear.as_str(),
        ),
        (
            vec!["bootstrap", "--host", "0.0.0.0", "--port", "0"],
            "--host 0.0.0.0 is not loopback: give --token or --insecure",
        ),
        (
            vec!["bootstrap", "--host", "::", "--port", "0"],
            "--host :: is not loopback: give --token or --insecure",
        ),
        (
            vec!["prefill", "--host", "0.0.0.0", "--synthetic"],
            "--host 0.0.0.0 is not loopback: give --token or --insecure",
        ),
        (
            vec!["decode", "--api-host", "0.0.0.0", "--synthetic"],
            "--api-host 0.0.0.0 is not loopback: the engine API reads and changes rooms and the pool, so it needs --token (--insecure does not lift this)",
        ),
        (
            vec![
                "prefill",
                "--api-host",
                "0.0.0.0",
                "--insecure",
                "--synthetic",
            ],
            "--api-host 0.0.0.0 is not loopback: the engine API reads and changes rooms and the pool, so it needs --token",
        ),
    ] {
        let (status, stderr) = run_to_exit(&exe, &args, &[]);
        println!("{args:?} -> {status}: {}", stderr.trim());
        assert_eq!(status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(says),
            "{args:?} should say {says:?}: {stderr}"
        );
    }
    // --insecure starts and warns; a token starts without the warning.
    let insecure = common::spawn(
        &exe,
        &[],
        "registry-insecure",
        &owned(&[
            "bootstrap",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--insecure",
        ]),
        &[],
        &logs,
    );
    let url = insecure.field("url").unwrap();
    // Bound to every address, named where a client can reach it.
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let port = url.rsplit(':').next().unwrap().to_owned();
    let local = format!("http://127.0.0.1:{port}");
    // With a token beyond loopback: HTTPS, with a certificate of the test's CA.
    let certs = common::tls::certificates_in(&logs, &["127.0.0.1"]);
    kvferry_wire::tls::trust(&certs.ca).expect("trust the test's CA");
    let (cert, key, ca) = (
        certs.cert.display().to_string(),
        certs.key.display().to_string(),
        certs.ca.display().to_string(),
    );
    let tls = ["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca];
    let mut registry_args = vec!["bootstrap", "--host", "0.0.0.0", "--port", "0"];
    registry_args.extend(["--token", "t0k"]);
    registry_args.extend(&tls[..4]);
    let with_token = common::spawn(
        &exe,
        &[],
        "registry-token",
        &owned(&registry_args),
        &[],
        &logs,
    );
    let registry_tls = with_token.field("url").unwrap();
    assert!(
        registry_tls.starts_with("https://127.0.0.1:"),
        "{registry_tls}"
    );
    // The agent's own switch, by environment this time.
    let decode = common::spawn(
        &exe,
        &[],
        "decode-insecure",
        &owned(&[
            "decode",
            "--bootstrap",
            &local,
            "--host",
            "0.0.0.0",
            "--advertise-host",
            "127.0.0.1",
            "--synthetic",
        ]),
        &[("KVFERRY_INSECURE", "1")],
        &logs,
    );
    assert_eq!(decode.listening["role"], "decode");
    // An engine API on every address, with the token: the listening line names the
    // advertised address (here the bound --host's), and only /healthz and /metrics answer
    // without the token.
    // It serves HTTPS and registers with the HTTPS registry.
    let mut exposed_args = vec![
        "decode",
        "--bootstrap",
        &registry_tls,
        "--api-host",
        "0.0.0.0",
    ];
    exposed_args.extend(["--token", "t0k", "--synthetic"]);
    exposed_args.extend(tls);
    // An agent that cannot register exits (docs/operations.md); on a loaded machine the
    // registry's first HTTPS answer has missed the agent's one 5 s attempt. Registry latency is
    // not what this test checks: such a start is tried again, and said.
    let exposed = (1..=3)
        .find_map(|attempt| {
            let name = format!("decode-exposed-api-{attempt}");
            let started = Process::spawn_with(
                &[],
                &exe,
                &name,
                &owned(&exposed_args),
                &[("", ""); 0],
                &logs,
                BOUND,
            );
            match started {
                Ok(p) => Some(p),
                Err(e) if attempt < 3 && format!("{e:#}").contains("unreachable") => {
                    println!("{name}: the registry did not answer in time, starting again: {e:#}");
                    None
                }
                Err(e) => panic!("{e:#}"),
            }
        })
        .expect("a decode started");
    let api = exposed.field("api").unwrap();
    println!("decode with --api-host 0.0.0.0 listens at {api}");
    assert!(api.starts_with("https://127.0.0.1:"), "{api}");
    runtime().block_on(async {
        let (open, with) = (http(), http_with_token("t0k"));
        // Plain HTTP to the HTTPS port is never served.
        let plain = api.replacen("https://", "http://", 1);
        let answer = http().get(format!("{plain}/healthz")).send().await;
        assert!(
            answer.as_ref().map_or(true, |a| !a.status().is_success()),
            "plain HTTP was served on an HTTPS port: {answer:?}"
        );
        let ranks = format!("{registry_tls}/v1/ranks");
        assert_eq!(
            call(&with, Method::GET, &ranks, None).await.0,
            StatusCode::OK
        );
        let pool = format!("{api}/v1/pool");
        assert_eq!(
            call(&open, Method::GET, &pool, None).await.0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            call(&with, Method::GET, &pool, None).await.0,
            StatusCode::OK
        );
        let health = format!("{api}/healthz");
        assert_eq!(
            call(&open, Method::GET, &health, None).await.0,
            StatusCode::OK
        );
    });
    let warning = "--insecure: serving without a token on a non-loopback address";
    for (process, warns) in [(&insecure, true), (&with_token, false), (&decode, true)] {
        let text = log_text(&process.log);
        let warned = text
            .lines()
            .any(|l| l.contains("WARN") && l.contains(warning));
        assert_eq!(warned, warns, "{}: {text}", process.name);
    }
}

/// A registry with short leases, and a decode, on loopback.
struct Cluster {
    exe: PathBuf,
    logs: PathBuf,
    registry: Process,
    url: String,
    args: Vec<String>,
}

impl Cluster {
    fn start(tag: &str, lease_ttl_ms: u64) -> Cluster {
        let exe = release_binary();
        let logs = kvferry::cluster::log_dir(tag).expect("log dir");
        let registry = common::spawn(
            &exe,
            &[],
            "registry",
            &owned(&[
                "bootstrap",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--lease-ttl-ms",
                &lease_ttl_ms.to_string(),
            ]),
            &[],
            &logs,
        );
        let url = registry.field("url").unwrap();
        let opts = AgentOpts {
            heartbeat_ms: 100,
            peer_dead_ms: 1_000,
            ..AgentOpts::default()
        };
        println!("[{tag}] registry {url}; logs in {}", logs.display());
        Cluster {
            exe,
            logs,
            registry,
            url,
            args: opts.args(),
        }
    }

    fn agent_args(&self, role: &str) -> Vec<String> {
        let mut args = owned(&[role, "--bootstrap", &self.url]);
        args.extend(self.args.iter().cloned());
        args
    }

    fn agent(&self, role: &str, name: &str) -> Process {
        common::spawn(
            &self.exe,
            &[],
            name,
            &self.agent_args(role),
            &[],
            &self.logs,
        )
    }
}

/// Rooms `rooms` through `decode` and `prefill`, each verified on take.
async fn rooms_verify(http: &Client, decode: &str, prefill: &str, rooms: std::ops::Range<u64>) {
    for room in rooms {
        request_and_ready(http, decode, prefill, room, &json!({ "tokens": 64 })).await;
        take_verified(http, decode, room).await;
    }
}

#[test]
fn a_second_agent_with_the_same_rank_exits_non_zero_and_the_first_keeps_serving() {
    let c = Cluster::start("registry-same-rank", 1_000);
    let first = c.agent("prefill", "prefill-1");
    let decode = c.agent("decode", "decode");
    let holder = first.field("instance").unwrap();
    // The second one never listens: it waits for the slot, sees the holder renew for more than
    // 3 leases, and gives up with 1.
    let args = c.agent_args("prefill");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let t = Instant::now();
    let (status, stderr) = run_to_exit(&c.exe, &args, &[]);
    println!("second prefill: {status} after {:.0} ms", ms(t.elapsed()));
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&holder),
        "the error names the holder {holder}: {stderr}"
    );
    assert!(stderr.contains("kept renewing its lease"), "{stderr}");
    let waited = stderr
        .lines()
        .any(|l| l.contains("WARN") && l.contains("slot held by another live instance"));
    assert!(waited, "the 409s are logged at WARN: {stderr}");
    let registry_log = log_text(&c.registry.log);
    assert!(
        registry_log
            .lines()
            .any(|l| l.contains("WARN") && l.contains("registration refused")),
        "{registry_log}"
    );
    runtime().block_on(async {
        let http = http();
        assert_eq!(
            registered(&http, &c.url)
                .await
                .iter()
                .filter(|i| **i == holder)
                .count(),
            1
        );
        rooms_verify(
            &http,
            &decode.field("api").unwrap(),
            &first.field("api").unwrap(),
            1..3,
        )
        .await;
    });
}

#[test]
fn an_agent_stopped_while_it_waits_for_a_held_slot_exits_0() {
    let c = Cluster::start("registry-stop-waiting", 10_000);
    let _first = c.agent("prefill", "prefill-1");
    // Stopped while it waits for the slot, it exits 0 at once (it would give up only after 3
    // leases, 30 s, with 1).
    let log = c.logs.join("prefill-stopped.log");
    let mut waiting = Command::new(&c.exe)
        .args(c.agent_args("prefill"))
        .env_remove("KVFERRY_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawning a waiting prefill");
    runtime().block_on(poll_until(
        "a second prefill waits for the slot",
        BOUND,
        || async {
            log_text(&log)
                .contains("slot held by another live instance")
                .then_some(())
        },
    ));
    let killed = Command::new("kill")
        .args(["-TERM", &waiting.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = waiting.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > BOUND {
            let _ = waiting.kill();
            panic!("the waiting prefill did not stop within {BOUND:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = log_text(&log);
    assert_eq!(status.code(), Some(0), "{text}");
    assert!(text.contains("stopped before the agent started"), "{text}");
}

#[test]
fn a_prefill_restarted_while_its_old_lease_is_live_waits_then_serves() {
    // Leases of 4 s: the restart below meets a live lease unless starting it takes longer.
    let c = Cluster::start("registry-restart", 4_000);
    let mut old = c.agent("prefill", "prefill-old");
    let decode = c.agent("decode", "decode");
    let (old_id, d) = (old.field("instance").unwrap(), decode.field("api").unwrap());
    let rt = runtime();
    let http = http();
    rt.block_on(rooms_verify(&http, &d, &old.field("api").unwrap(), 1..2));
    old.signal("KILL").unwrap();
    old.wait_exit(BOUND).expect("kill -9");
    let new = c.agent("prefill", "prefill-new");
    let (new_id, p) = (new.field("instance").unwrap(), new.field("api").unwrap());
    let log = log_text(&new.log);
    let waited = log.contains("slot held by another live instance");
    println!("restarted prefill registered (waited out the old lease: {waited})");
    if waited {
        assert!(
            log.contains(&old_id),
            "the wait names the old instance: {log}"
        );
    }
    rt.block_on(async {
        let ids = registered(&http, &c.url).await;
        assert!(ids.contains(&new_id) && !ids.contains(&old_id), "{ids:?}");
        // The decode notices the new instance: rooms to it succeed (the first ones may still
        // go to the dead one's endpoint and fail with a reason).
        let mut room = 100u64;
        poll_until("a room through the restarted prefill", BOUND, || {
            room += 1;
            let (http, d, p) = (http.clone(), d.clone(), p.clone());
            async move {
                let url = format!("{d}/v1/rooms/{room}");
                expect(
                    &http,
                    Method::POST,
                    &url,
                    Some(&json!({ "tokens": 64 })),
                    StatusCode::CREATED,
                )
                .await;
                let ready = format!("{p}/v1/rooms/{room}/ready");
                let _ = call(&http, Method::POST, &ready, Some(&json!({ "tokens": 64 }))).await;
                let v = wait_final(&http, &d, room).await;
                let (safe, _) = wait_safe(&http, &d, room).await;
                let _ = call(&http, Method::POST, &format!("{url}/take"), None).await;
                (v["state"] == "success" && safe["state"] == "success").then_some(())
            }
        })
        .await;
        rooms_verify(&http, &d, &p, 200..203).await;
    });
}

#[test]
fn an_agent_whose_slot_was_taken_after_its_lease_lapsed_exits_non_zero() {
    let c = Cluster::start("registry-replaced", 1_000);
    let mut old = c.agent("prefill", "prefill-old");
    let old_id = old.field("instance").unwrap();
    let rt = runtime();
    let http = http();
    // Stopped, it cannot renew: its lease lapses and another instance takes the slot.
    old.signal("STOP").unwrap();
    rt.block_on(poll_until("old lease lapsed", BOUND, || async {
        (!registered(&http, &c.url).await.contains(&old_id)).then_some(())
    }));
    let new = c.agent("prefill", "prefill-new");
    let new_id = new.field("instance").unwrap();
    old.signal("CONT").unwrap();
    let status = old
        .wait_exit(BOUND)
        .expect("the replaced prefill did not exit");
    let log = log_text(&old.log);
    println!("replaced prefill exited {status}");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains(&format!("was replaced by instance {new_id}")),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("replaced")),
        "logged at ERROR: {log}"
    );
    // The new one keeps the slot.
    rt.block_on(async {
        let ids = registered(&http, &c.url).await;
        assert_eq!(ids, vec![new_id.clone()]);
        let v: Value = expect(
            &http,
            Method::GET,
            &format!("{}/healthz", new.field("api").unwrap()),
            None,
            StatusCode::OK,
        )
        .await;
        assert_eq!(v["status"], "ok");
    });
}

/// Agents bind every address (`--host 0.0.0.0`, with a token) on pinned ports and advertise
/// a second loopback address (127.0.0.2): the registry and the listening lines carry the
/// advertised address and the pinned ports, peers connect there, rooms verify. A wildcard is
/// never advertised: without `--advertise-host` such an agent refuses to start.
#[test]
fn agents_advertise_another_address_than_they_bind_on_pinned_ports() {
    let c = Cluster::start("registry-advertise", 10_000);
    let (control, data, prefill_api, decode_api) =
        (closed_port(), closed_port(), closed_port(), closed_port());
    let pinned = |role: &str, port: (&str, u16), api_port: u16| {
        let mut args = c.agent_args(role);
        for (flag, value) in [
            ("--host", "0.0.0.0".to_owned()),
            ("--advertise-host", "127.0.0.2".to_owned()),
            ("--token", "t0k".to_owned()),
            (port.0, port.1.to_string()),
            ("--api-port", api_port.to_string()),
        ] {
            set_flag(&mut args, flag, &value);
        }
        common::spawn(&c.exe, &[], role, &args, &[], &c.logs)
    };
    let prefill = pinned("prefill", ("--control-port", control), prefill_api);
    let decode = pinned("decode", ("--data-port", data), decode_api);
    assert_eq!(
        prefill.field("control").unwrap(),
        format!("tcp://127.0.0.2:{control}")
    );
    assert_eq!(
        decode.field("data").unwrap(),
        format!("tcp://127.0.0.2:{data}")
    );
    let (p, d) = (prefill.field("api").unwrap(), decode.field("api").unwrap());
    assert!(p.ends_with(&format!(":{prefill_api}")), "{p}");
    assert!(d.ends_with(&format!(":{decode_api}")), "{d}");
    runtime().block_on(async {
        let http = http_with_token("t0k");
        let ranks = call(&http, Method::GET, &format!("{}/v1/ranks", c.url), None)
            .await
            .1;
        let listed = ranks.to_string();
        assert!(
            listed.contains(&format!("tcp://127.0.0.2:{control}")),
            "{listed}"
        );
        assert!(
            listed.contains(&format!("tcp://127.0.0.2:{data}")),
            "{listed}"
        );
        rooms_verify(&http, &d, &p, 1..4).await;
    });
    println!(
        "[registry-advertise] bound 0.0.0.0, advertised 127.0.0.2: control :{control}, data :{data}; 3 rooms verified"
    );
    // A wildcard bind with nothing to advertise is refused, naming the flag to give.
    let (status, stderr) = run_to_exit(
        &c.exe,
        &[
            "prefill",
            "--host",
            "0.0.0.0",
            "--token",
            "t0k",
            "--synthetic",
        ],
        &[],
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--host 0.0.0.0 is a wildcard") && stderr.contains("--advertise-host"),
        "{stderr}"
    );
}

#[test]
fn decodes_started_with_identical_ranks_all_register_and_all_land_rooms() {
    let c = Cluster::start("registry-twin-decodes", 1_000);
    let prefill = c.agent("prefill", "prefill");
    // The same flags, hence the same ranks: decodes are never looked up by rank, so the
    // registry gives each instance a slot of its own.
    let decodes = [c.agent("decode", "decode-a"), c.agent("decode", "decode-b")];
    runtime().block_on(async {
        let http = http();
        let ranks: Value = http
            .get(format!("{}/v1/ranks", c.url))
            .send()
            .await
            .expect("ranks")
            .json()
            .await
            .expect("JSON");
        let listed = ranks.to_string();
        for d in &decodes {
            let id = d.field("instance").unwrap();
            assert!(listed.contains(&id), "{id} is listed: {ranks}");
        }
        for (i, d) in decodes.iter().enumerate() {
            let first = 1 + 2 * i as u64;
            rooms_verify(
                &http,
                &d.field("api").unwrap(),
                &prefill.field("api").unwrap(),
                first..first + 2,
            )
            .await;
        }
    });
}
