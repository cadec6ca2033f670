//! The UCX port is a trust boundary. A rogue UCX peer (tests/processes/ucx_rogue.c, built here against
//! the system's libucx) that has no token and never says Hello connects to a decode's and a
//! prefill's UCX workers and asks for what libucx's software RMA would run on its behalf: a read
//! of the agent's ELF header, a write of 16 bytes into its writable memory, and a read at
//! address 0x10 (which crashed an agent whose UCX context had RMA). Every attempt gets no
//! answer; both agents live on, the written bytes are unchanged (read back through
//! `/proc/PID/mem`), both say `kvferry_transport_rma 0`, rooms land verified afterwards, and
//! neither agent's UCX listens beyond its `--host`.
//!
//! The prefill does not advertise its UCX address; an attacker who reaches its UCX port forges
//! one: a decode's address with the prefill's port and another worker uuid, as here.
//!
//! Needs libucx-dev (the `ucx` feature), a C compiler and
//! `cargo build --release --all-features --bin kvferry`.
#![cfg(feature = "ucx")]

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use common::{AgentOpts, release_binary, runtime};
use kvferry::cluster::Process;
use kvferry::cluster::{Apis, LocalCluster, Shape, drive_rooms};

const UCX_TCP: [(&str, &str); 2] = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")];

/// The rogue, built once per test process.
fn rogue() -> PathBuf {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ucx_rogue");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/processes/ucx_rogue.c");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .arg("-O1")
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .args(["-lucp", "-lucs"])
        // Linked against the installed libucx (its headers are those sys.rs mirrors); run on
        // whichever the library path gives, as kvferry's binary is.
        .env_remove("LD_LIBRARY_PATH")
        .status()
        .expect("running the C compiler");
    assert!(status.success(), "building {}", src.display());
    out
}

/// Runs the rogue as `cmd` says, over UCX's tcp on loopback; returns its status and data
/// (see tests/processes/ucx_rogue.c), printed with `what`.
fn run_rogue(mut cmd: Command, what: &str) -> (String, String) {
    let out = cmd.envs(UCX_TCP).output().expect("running the rogue");
    assert!(
        out.status.success(),
        "rogue: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("the rogue's JSON line");
    println!("rogue {what}: {line}");
    let field = |k: &str| line[k].as_str().unwrap_or_default().to_owned();
    (field("status"), field("data"))
}

/// What one attempt of the rogue got: its status (`ok`, `timeout` or UCX's error) and, for a
/// read, the bytes in hex.
fn attempt(rogue: &PathBuf, address: &str, op: &str, at: u64, len: usize) -> (String, String) {
    let mut cmd = Command::new(rogue);
    cmd.args([address, op, &format!("{at:x}"), &len.to_string(), "3000"]);
    run_rogue(cmd, &format!("{op} at {at:#x}"))
}

/// Floods `address` with `count` messages of `len` bytes under tags `tag`, `tag + 1`, ...
/// (eagerly where `eager`: every byte then reaches the victim unasked); returns the rogue's
/// status and how many left.
fn flood(
    rogue: &PathBuf,
    address: &str,
    tag: u64,
    len: usize,
    count: usize,
    eager: bool,
) -> (String, String) {
    let mut cmd = Command::new(rogue);
    let (tag_hex, len_text) = (format!("{tag:x}"), len.to_string());
    cmd.args([address, "flood", &tag_hex, &len_text, "20000"])
        .arg(count.to_string());
    if eager {
        cmd.env("UCX_RNDV_THRESH", "inf");
    }
    let what = format!("flood of {count} x {len} B under {tag:#x} (eager: {eager})");
    run_rogue(cmd, &what)
}

/// A field of /proc/PID/status in KiB (`VmRSS`, `VmHWM`).
fn memory_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// The start of the first mapping of the kvferry binary in `pid` (its ELF header), and the
/// last 16 bytes of its last writable mapping.
fn targets(pid: u32) -> (u64, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let ours: Vec<&str> = maps.lines().filter(|l| l.ends_with("/kvferry")).collect();
    let range = |line: &str| -> (u64, u64) {
        let (a, b) = line
            .split_whitespace()
            .next()
            .unwrap()
            .split_once('-')
            .unwrap();
        (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        )
    };
    let elf = range(ours.first().expect("the binary's mapping")).0;
    let writable = ours
        .iter()
        .rev()
        .find(|l| l.split_whitespace().nth(1) == Some("rw-p"))
        .expect("a writable mapping");
    (elf, range(writable).1 - 16)
}

fn read_mem(pid: u32, at: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt as _;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("/proc/PID/mem");
    let mut buf = vec![0u8; len];
    mem.read_exact_at(&mut buf, at)
        .expect("read the agent's memory");
    buf
}

/// Ports of the TCP sockets `pid` listens on (its descriptors' inodes in /proc/net/tcp{,6}).
fn listening(pid: u32) -> Vec<(String, u16)> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(str::to_owned)
        })
        .collect();
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address rem_address st ... inode (10th)
            if f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]) {
                let (addr, port) = f[1].split_once(':').unwrap();
                out.push((addr.to_owned(), u16::from_str_radix(port, 16).unwrap()));
            }
        }
    }
    out
}

/// The hex worker addresses of a decode's UCX endpoint (`ucx:` and comma-separated addresses,
/// after the receiver's tag prefix and `/`, before `/` and its UCX release where there is one).
fn worker_addresses(endpoint: &str) -> Vec<String> {
    let list = endpoint.strip_prefix("ucx:").expect("a ucx endpoint");
    let list = list.split('/').nth(1).unwrap_or(list);
    list.split(',').map(str::to_owned).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

/// The UCX ports of an agent: its listening ports but its API and control ports.
fn ucx_ports(agent: &Process) -> Vec<u16> {
    let known: Vec<u16> = ["api", "control", "data"]
        .iter()
        .filter_map(|k| agent.field(k).ok())
        .filter(|v| v.starts_with("http") || v.starts_with("tcp"))
        .map(|v| port_of(&v))
        .collect();
    let all = listening(agent.pid());
    for (addr, port) in &all {
        // 127.0.0.1 in /proc/net/tcp's little-endian hex: UCX listens on loopback only.
        assert!(
            addr == "0100007F" || known.contains(port),
            "{} listens on {addr}:{port}, beyond its --host: {all:?}",
            agent.name
        );
    }
    all.into_iter()
        .map(|(_, p)| p)
        .filter(|p| !known.contains(p))
        .collect()
}

/// The decode's first worker address with the prefill's UCX port in place of the decode
/// worker's and another uuid: an address of the prefill's worker, as an attacker forges one.
fn forged(decode_address: &[u8], decode_ports: &[u16], prefill_port: u16) -> String {
    let mut a = decode_address.to_vec();
    // The last place the port's bytes are (the tcp interface's address ends the worker's
    // entry): an earlier match is a coincidence of the fixed bytes before it.
    let at = decode_ports
        .iter()
        .find_map(|p| a.windows(2).rposition(|w| w == p.to_be_bytes()))
        .expect("the decode worker's port in its address");
    a[at..at + 2].copy_from_slice(&prefill_port.to_be_bytes());
    for b in &mut a[1..9] {
        *b ^= 0x5a;
    }
    hex(&a)
}

fn attack(rogue: &PathBuf, agent: &Process, address: &str) {
    let pid = agent.pid();
    let (elf, writable) = targets(pid);
    let (status, data) = attempt(rogue, address, "get", elf, 16);
    assert_eq!(
        status, "timeout",
        "{}: the rogue read its ELF header: {data}",
        agent.name
    );
    let before = read_mem(pid, writable, 16);
    let (status, _) = attempt(rogue, address, "put", writable, 16);
    let after = read_mem(pid, writable, 16);
    assert_eq!(before, after, "{}: the rogue wrote into it", agent.name);
    assert_eq!(status, "timeout", "{}: the put was applied", agent.name);
    let (status, _) = attempt(rogue, address, "get", 0x10, 16);
    assert_eq!(
        status, "timeout",
        "{}: a read at 0x10 was answered",
        agent.name
    );
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_alive(agent);
}

/// Fails the test when `agent` died.
fn assert_alive(agent: &Process) {
    // A dead child stays in /proc as a zombie (state Z) until the test reaps it.
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", agent.pid())).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .next();
    assert!(
        matches!(state, Some("R" | "S" | "D")),
        "{} died under the rogue ({state:?}): {}",
        agent.name,
        agent.log.display()
    );
}

/// A registry, a prefill and a decode over UCX's tcp on loopback.
fn ucx_pair(name: &str) -> LocalCluster {
    let env: Vec<(String, String)> = UCX_TCP.map(|(k, v)| (k.to_owned(), v.to_owned())).to_vec();
    let opts = AgentOpts {
        transport: "ucx",
        ..AgentOpts::default()
    };
    let (exe, args) = (release_binary(), opts.args());
    LocalCluster::start_shaped_env(&exe, name, &args, Shape::ONE, Shape::ONE, &env)
        .expect("cluster")
}

/// Runs `rooms` (id, tokens) two at a time and checks that each landed verified.
fn rooms_land(apis: &Apis, rooms: Vec<(u64, usize)>) {
    let results = runtime()
        .block_on(drive_rooms(apis, rooms, 2))
        .expect("rooms");
    assert!(results.iter().all(|r| r.verified), "{results:?}");
}

#[test]
fn a_rogue_ucx_peer_reads_writes_and_crashes_nothing() {
    let rogue = rogue();
    let c = ucx_pair("ucx-rogue");
    let (prefill, decode) = (c.prefill(), c.decode());
    let (p, d) = (prefill.field("api").unwrap(), decode.field("api").unwrap());
    let http = common::http();
    runtime().block_on(async {
        for (api, role) in [(&p, "prefill"), (&d, "decode")] {
            let v = common::metric(
                &http,
                api,
                &format!("kvferry_transport_rma{{role=\"{role}\"}}"),
            )
            .await;
            assert_eq!(v, Some(0.0), "{role}: RMA in its UCX context");
        }
    });
    let data = decode.field("data").unwrap();
    let decode_address = worker_addresses(&data)[0].clone();
    attack(&rogue, decode, &decode_address);

    // The prefill's UCX worker starts with its first decode peer.
    let apis = Apis::pair(&p, &d);
    rooms_land(&apis, vec![(1, 64)]);
    let decode_ports = ucx_ports(decode);
    let prefill_ports = ucx_ports(prefill);
    println!("UCX ports: decode {decode_ports:?}, prefill {prefill_ports:?}");
    assert_eq!(prefill_ports.len(), 1, "the prefill's one UCX worker");
    let forged = forged(&unhex(&decode_address), &decode_ports, prefill_ports[0]);
    attack(&rogue, prefill, &forged);

    rooms_land(&apis, vec![(2, 512), (3, 16), (4, 2048)]);
    println!("after the rogue: 3 rooms landed verified");
}

/// Tags a flood goes under: ones nobody receives, the tag chunks went under in earlier builds,
/// and the prefixes of placed runs and of device payloads.
const FLOOD_TAGS: [u64; 4] = [
    0x1234_0000_0000_0000,
    0x4b56_4659_0000_0001,
    0x5000_0000_0000_0000,
    0x4400_0000_0000_0000,
];

/// Runs `flood` against `agent` and checks that its peak memory grew by less than `bound`
/// MiB (`what` was sent) and that it lives.
fn grows_less_than(agent: &Process, what: &str, bound: u64, flood: impl FnOnce()) {
    let pid = agent.pid();
    let before = memory_kib(pid, "VmHWM");
    flood();
    // The last bytes may still be on their way through the socket.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let after = memory_kib(pid, "VmHWM");
    let grown = after.saturating_sub(before) / 1024;
    println!(
        "{}: peak memory {} MiB before {what}, {} MiB after (+{grown} MiB)",
        agent.name,
        before / 1024,
        after / 1024
    );
    assert!(
        grown < bound,
        "{}: {what} grew its peak memory by {grown} MiB",
        agent.name
    );
    assert_alive(agent);
}

/// Floods `agent` at `address` with 32 x 16 MiB eager messages (8 under each of
/// [`FLOOD_TAGS`]) and 4 x 16 MiB by rendezvous, and checks that its peak memory grew by
/// less than 64 MiB and that it lives.
fn flood_and_measure(rogue: &PathBuf, agent: &Process, address: &str) {
    const MIB: usize = 1 << 20;
    grows_less_than(agent, "a flood of 32 x 16 MiB", 64, || {
        for tag in FLOOD_TAGS {
            let (status, sent) = flood(rogue, address, tag, 16 * MIB, 8, true);
            println!("{}: {status}, {sent} sent", agent.name);
        }
        let (status, sent) = flood(rogue, address, 0x7777 << 48, 16 * MIB, 4, false);
        assert_eq!(
            status, "ok",
            "{}: a rendezvous send was left unanswered",
            agent.name
        );
        println!("{}: rendezvous flood {status}, {sent} sent", agent.name);
    });
}

/// A rogue UCX peer floods a decode and a prefill with messages nobody asked for (eagerly: all
/// their bytes reach the agent), under tags nobody receives and under the tags kvferry's own
/// messages use: each agent's peak memory grows by less than 64 MiB (32 x 16 MiB were sent),
/// and rooms land verified afterwards.
#[test]
fn a_rogue_ucx_flood_leaves_agents_memory_bounded() {
    let rogue = rogue();
    let c = ucx_pair("ucx-flood");
    let (prefill, decode) = (c.prefill(), c.decode());
    let (p, d) = (prefill.field("api").unwrap(), decode.field("api").unwrap());
    let apis = Apis::pair(&p, &d);
    rooms_land(&apis, vec![(1, 64)]);
    let data = decode.field("data").unwrap();
    let decode_address = worker_addresses(&data)[0].clone();
    flood_and_measure(&rogue, decode, &decode_address);
    flood_own_prefix(&rogue, decode, &decode_address, &data);
    let decode_ports = ucx_ports(decode);
    let prefill_ports = ucx_ports(prefill);
    let forged = forged(&unhex(&decode_address), &decode_ports, prefill_ports[0]);
    println!(
        "decode ports {decode_ports:?}, address {decode_address}; prefill ports {prefill_ports:?}, forged {forged}"
    );
    flood_and_measure(&rogue, prefill, &forged);
    rooms_land(&apis, vec![(2, 512), (3, 16), (4, 2048)]);
    println!("after the flood: 3 rooms landed verified");
}

/// Floods a decode at `address` under its own tag prefix (the 8 hex digits after `ucx:` in
/// its data endpoint, which its Hello gives every prefill it greets), under the tags of device
/// payloads no header announced, which no receive is posted for: 1024 x 512 KiB eagerly, and
/// 8 x 16 MiB (longer than any chunk). UCX would keep every one until a receive took it; the
/// decode holds at most 256 MiB of them, none longer than a chunk, so its peak memory grows by
/// less than 320 MiB (640 MiB were sent).
fn flood_own_prefix(rogue: &PathBuf, agent: &Process, address: &str, endpoint: &str) {
    const KIB: usize = 1 << 10;
    let hex = endpoint.strip_prefix("ucx:").expect("a ucx endpoint");
    let prefix = u64::from_str_radix(&hex[..8], 16).expect("the decode's tag prefix");
    grows_less_than(agent, "640 MiB under its own prefix", 320, || {
        for (key, len, count) in [(4u64, 512 * KIB, 1024), (0x10_0000, 16 << 20, 8)] {
            let (status, sent) = flood(rogue, address, prefix << 32 | key, len, count, true);
            println!("{}: own prefix: {status}, {sent} sent", agent.name);
        }
    });
}

/// `--direct-writes always` over UCX's tcp is refused at start, naming why: no context asks for
/// RMA there.
#[test]
fn one_sided_writes_over_ucx_tcp_are_refused_at_start() {
    let env: Vec<(String, String)> = UCX_TCP.map(|(k, v)| (k.to_owned(), v.to_owned())).to_vec();
    let opts = AgentOpts {
        transport: "ucx",
        ..AgentOpts::default()
    };
    let mut args = opts.args();
    common::set_flag(&mut args, "--direct-writes", "always");
    let started = LocalCluster::start_shaped_env(
        &release_binary(),
        "ucx-no-rma",
        &args,
        Shape::ONE,
        Shape::ONE,
        &env,
    );
    let Err(err) = started else {
        panic!("a prefill told to write one-sided over tcp must not start");
    };
    // The error quotes the process's log.
    let text = format!("{err:#}");
    println!("{text}");
    assert!(
        text.contains("--direct-writes always: one-sided writes over UCX need RMA"),
        "{text}"
    );
}

/// UCX told to listen beyond loopback (`UCX_NET_DEVICES`) needs a token, like every port.
#[test]
fn ucx_beyond_loopback_needs_a_token() {
    for role in ["prefill", "decode"] {
        let out = Command::new(release_binary())
            .args([
                role,
                "--transport",
                "ucx",
                "--bootstrap",
                "http://127.0.0.1:9",
            ])
            .env("UCX_NET_DEVICES", "eth0")
            .output()
            .expect("running kvferry");
        let err = String::from_utf8_lossy(&out.stderr);
        println!("{role}: {} {err}", out.status);
        assert!(!out.status.success(), "{role} started");
        assert!(
            err.contains(
                "UCX_NET_DEVICES=eth0 lets UCX listen beyond loopback: give --token or --insecure"
            ),
            "{role}: {err}"
        );
    }
}
