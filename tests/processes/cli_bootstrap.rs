//! `kvferry bootstrap` as a process: prints exactly one JSON listening line on stdout, answers
//! `/healthz`, exits 0 on SIGTERM; refuses a zero lease TTL with a clear message.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BOUND: Duration = Duration::from_secs(30);

fn kvferry() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    for var in [
        "KVFERRY_BOOTSTRAP_HOST",
        "KVFERRY_BOOTSTRAP_PORT",
        "KVFERRY_LEASE_TTL_MS",
        "KVFERRY_BOOTSTRAP_TOKEN",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("RUST_LOG", "info");
    cmd
}

fn wait_with_bound(child: &mut Child, bound: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            println!("exited after {:?}: {status}", start.elapsed());
            return status;
        }
        if start.elapsed() > bound {
            let _ = child.kill();
            panic!("kvferry bootstrap did not exit within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A plain HTTP/1.1 GET; returns the whole response text.
fn http_get(addr: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(BOUND)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn serves_until_sigterm_and_exits_zero() {
    let mut child = kvferry()
        .args([
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--lease-ttl-ms",
            "5000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    // Read the listening line on a thread, so a silent child cannot hang the test.
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        tx.send(line).unwrap();
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).unwrap();
        rest
    });
    let line = match rx.recv_timeout(BOUND) {
        Ok(line) => line,
        Err(e) => {
            let _ = child.kill();
            panic!("no listening line within {BOUND:?}: {e}");
        }
    };
    println!("listening line: {line}");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["event"], "listening");
    assert_eq!(v["role"], "bootstrap");
    let url = v["url"].as_str().unwrap();
    let addr = url.strip_prefix("http://127.0.0.1:").unwrap();
    let port: u16 = addr.parse().unwrap();
    assert_ne!(port, 0);

    let response = http_get(&format!("127.0.0.1:{port}"), "/healthz");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains(r#""status":"ok""#), "{response}");

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = wait_with_bound(&mut child, BOUND);
    assert_eq!(status.code(), Some(0), "{status}");

    let rest = reader.join().unwrap();
    assert_eq!(rest, "", "stdout must hold only the listening line");
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("shutting down"), "stderr: {stderr}");
}

#[test]
fn zero_lease_ttl_is_refused() {
    for (how, mut cmd) in [
        ("flag", {
            let mut c = kvferry();
            c.args(["bootstrap", "--port", "0", "--lease-ttl-ms", "0"]);
            c
        }),
        ("env", {
            let mut c = kvferry();
            c.args(["bootstrap", "--port", "0"])
                .env("KVFERRY_LEASE_TTL_MS", "0");
            c
        }),
    ] {
        let out = cmd.stdin(Stdio::null()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("{how}: {} {stderr}", out.status);
        assert!(!out.status.success(), "{how}");
        assert!(
            stderr.contains("--lease-ttl-ms must be > 0"),
            "{how}: {stderr}"
        );
        assert!(
            out.stdout.is_empty(),
            "{how}: nothing on stdout when not listening"
        );
    }
}
