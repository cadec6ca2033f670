//! Connections that never authenticate, held on every port that accepts connections, never
//! take a real peer's place (wire/src/admission.rs; docs/reliability.md, "Threat
//! model"). Each test starts a cluster whose processes run with at most 1024 descriptors
//! (`prlimit`), the attacked process first: it holds such connections on one port before the
//! processes that connect to that port start, so that every real connection comes after the
//! attacker's. Then it drives rooms through the cluster and asserts every one verifies, and
//! that once the attacker leaves the process holds none of its connections:
//! - HTTP (registry, both engine APIs, the proxy): 1100 connections that never send a request,
//!   more than the process has descriptors (with `--token`, those to the registry and the
//!   engine APIs send one request without the token first);
//! - ZeroMQ (the prefill's control port, the decode's data port): without a token, 500
//!   connections that complete the NULL handshake and stay silent; with `--token`, 100 that
//!   send a PLAIN greeting and stall;
//! - the decode's pool socket (`zmq-ipc` mapped writes): 200 connections that never send the
//!   secret, and the rooms still land by mapped writes;
//! - a host whose 64 connections each sent a valid Hello, at the prefill's control port: the
//!   decode's connection is refused and its room names the limit; 64 that sent anything else
//!   prove nothing, are never answered, and the decode's rooms land;
//! - the decode's UCX tcp listener: 500 silent connections. That listener is libucx's, and
//!   nothing bounds what it holds: with about 1000 (the descriptor limit), rooms stop landing.
//!
//! Needs `cargo build --release --all-features --bin kvferry` first (the UCX test: the `ucx`
//! feature).

use crate::common;

use std::io::Write as _;
use std::net::TcpStream;
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};

use common::*;

/// What the processes may open: fewer than the connections held on an HTTP port.
const NOFILE: &str = "--nofile=1024:1024";

/// Which process of the cluster is attacked.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Registry,
    Prefill,
    Decode,
}

/// A cluster (registry, prefill, decode; tiny) of `transport`, every process under [`NOFILE`],
/// with a token on every process when given. The `target` starts first of the agents, and
/// `attack` runs on it as soon as it listens: what it holds, and how many descriptors the
/// target had before.
fn cluster_under_attack<H>(
    tag: &str,
    (transport, token, env): (&'static str, Option<&str>, &[(&str, &str)]),
    target: Target,
    attack: impl FnOnce(&Process) -> Vec<H>,
) -> (FaultCluster, Vec<H>, usize) {
    let opts = AgentOpts {
        pool_pages: 256,
        transport,
        ..AgentOpts::default()
    };
    let mut env = env.to_vec();
    if let Some(token) = token {
        env.extend([("KVFERRY_TOKEN", token), ("KVFERRY_BOOTSTRAP_TOKEN", token)]);
    }
    let (exe, prefix) = (release_binary(), owned(&["prlimit", NOFILE]));
    let logs = kvferry::cluster::log_dir(tag).expect("log dir");
    let registry_args = owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]);
    let registry = common::spawn(&exe, &prefix, "registry", &registry_args, &env, &logs);
    let registry_url = registry.field("url").unwrap();
    let agent = |role: &str| {
        let mut args = owned(&[role, "--bootstrap", &registry_url]);
        args.extend(opts.args());
        common::spawn(&exe, &prefix, role, &args, &env, &logs)
    };
    let mut held = None;
    let mut attack = Some(attack);
    let mut hit = |process: &Process, held: &mut Option<(Vec<H>, usize)>| {
        let before = fds(process.pid());
        let attack = attack.take().expect("one attack");
        *held = Some((attack(process), before));
    };
    if target == Target::Registry {
        hit(&registry, &mut held);
    }
    let (prefill, decode) = match target {
        Target::Decode => {
            let decode = agent("decode");
            hit(&decode, &mut held);
            (agent("prefill"), decode)
        }
        _ => {
            let prefill = agent("prefill");
            if target == Target::Prefill {
                hit(&prefill, &mut held);
            }
            (prefill, agent("decode"))
        }
    };
    let (held, before) = held.expect("attacked");
    (
        FaultCluster::of(registry, prefill, decode, logs),
        held,
        before,
    )
}

/// `host:port` of a `tcp://` endpoint or an `http://` URL.
fn addr(endpoint: &str) -> String {
    let rest = endpoint
        .trim_start_matches("tcp://")
        .trim_start_matches("http://");
    rest.split('/').next().unwrap_or(rest).to_owned()
}

/// `n` TCP connections to `endpoint`, each having sent `first`, then silent.
fn hold_tcp(endpoint: &str, n: usize, first: &[u8]) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| {
            let mut s = TcpStream::connect(addr(endpoint)).ok()?;
            let _ = s.write_all(first);
            Some(s)
        })
        .collect()
}

/// Descriptors `pid` holds.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The inodes of the sockets `pid` holds.
fn socket_inodes(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect()
}

/// The rows of `pid`'s TCP tables (`/proc/PID/net/tcp{,6}`) for sockets it holds, split.
fn tcp_rows(pid: u32) -> Vec<Vec<String>> {
    let inodes = socket_inodes(pid);
    let mut rows = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
            // sl local_address rem_address st ... inode (10th)
            if f.len() > 9 && inodes.contains(&f[9]) {
                rows.push(f);
            }
        }
    }
    rows
}

fn port_of(address: &str) -> u16 {
    let port = address.rsplit(':').next().expect("port");
    u16::from_str_radix(port, 16).expect("hex port")
}

/// What an attacker holds: a TCP connection (named by its ends' ports: the attacked server's,
/// the attacker's) or a Unix one.
trait Held {
    fn ports(&self) -> Option<(u16, u16)>;
}

impl Held for TcpStream {
    fn ports(&self) -> Option<(u16, u16)> {
        Some((
            self.peer_addr().ok()?.port(),
            self.local_addr().ok()?.port(),
        ))
    }
}

impl Held for UnixStream {
    fn ports(&self) -> Option<(u16, u16)> {
        None
    }
}

/// Waits until `pid` holds none of the attacker's TCP connections (`ports`: each one's ends),
/// and, for
/// Unix ones, at most `before` descriptors plus the few the rooms' peers keep open (far fewer
/// than the attacker held).
async fn released(tag: &str, pid: u32, before: usize, ports: &[(u16, u16)]) {
    let started = Instant::now();
    loop {
        let left: Vec<String> = tcp_rows(pid)
            .iter()
            .filter(|r| ports.contains(&(port_of(&r[1]), port_of(&r[2]))))
            .map(|r| format!("{} -> {} state {}", r[1], r[2], r[3]))
            .collect();
        let now = fds(pid);
        if left.is_empty() && (!ports.is_empty() || now <= before + 32) {
            println!("[{tag}] attacker gone: {now} descriptors (before the attack: {before})");
            return;
        }
        assert!(
            started.elapsed() < BOUND,
            "{tag}: {} of the attacker's connections still held after {BOUND:?} ({now} descriptors, {before} before the attack): {:?}",
            left.len(),
            &left[..left.len().min(8)]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Drives 8 rooms through `c` (whose agents have `token`), asserting each verified; how long
/// they took.
async fn rooms(tag: &str, c: &FaultCluster, first: u64, token: Option<&str>) -> Duration {
    let apis = kvferry::cluster::Apis::pair(&c.prefill_api, &c.decode_api)
        .with_token(token.map(str::to_owned));
    let t = Instant::now();
    let rooms: Vec<(u64, usize)> = (first..first + 8).map(|r| (r, 64)).collect();
    let results = tokio::time::timeout(BOUND, kvferry::cluster::drive_rooms(&apis, rooms, 4))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{tag}: rooms still running after {BOUND:?}; logs in {}",
                c.logs.display()
            )
        })
        .unwrap_or_else(|e| panic!("{tag}: {e:#}; logs in {}", c.logs.display()));
    for r in &results {
        assert!(
            r.verified && r.state == "success",
            "{tag}: room {} {} {:?}; logs in {}",
            r.room,
            r.state,
            r.code,
            c.logs.display()
        );
    }
    t.elapsed()
}

/// Whether `log` says a connection was dropped at a limit.
fn dropped_in_log(log: &std::path::Path) -> bool {
    std::fs::read_to_string(log).is_ok_and(|l| l.contains("connection dropped"))
}

/// A port under attack: its name, and which process of the cluster serves it.
struct Port {
    name: &'static str,
    target: Target,
}

impl Port {
    fn process<'c>(&self, c: &'c FaultCluster) -> &'c Process {
        match self.target {
            Target::Registry => &c.registry,
            Target::Prefill => &c.prefill,
            Target::Decode => &c.decode,
        }
    }
}

/// Holds what `attack` opens on `port` from before its peers start until 8 rooms ran, then
/// lets go and runs 8 more; `crowded`: whether more connections are held than the unproven
/// bound, so the port's log must say it dropped some. The cluster, for more checks.
fn held_while_rooms_run<H: Held>(
    tag: &str,
    cluster: (&'static str, Option<&str>, &[(&str, &str)]),
    port: Port,
    crowded: bool,
    attack: impl FnOnce(&Process) -> Vec<H>,
) -> FaultCluster {
    let (c, held, before) = cluster_under_attack(tag, cluster, port.target, attack);
    let process = port.process(&c);
    println!(
        "[{tag}] {} connections held on the {}",
        held.len(),
        port.name
    );
    assert!(
        !held.is_empty(),
        "{tag}: no connection to the {}",
        port.name
    );
    runtime().block_on(async {
        let under_attack = rooms(tag, &c, 1, cluster.1).await;
        if crowded {
            assert!(
                dropped_in_log(&process.log),
                "{tag}: the {} never logged a dropped connection ({})",
                port.name,
                process.log.display()
            );
        }
        let ports: Vec<(u16, u16)> = held.iter().filter_map(Held::ports).collect();
        drop(held);
        released(tag, process.pid(), before, &ports).await;
        let after = rooms(tag, &c, 100, cluster.1).await;
        println!(
            "[{tag}] 8 rooms verified in {:.0} ms with the attacker, {:.0} ms after it left",
            ms(under_attack),
            ms(after)
        );
    });
    c
}

/// The HTTP port of `which` (the registry, or the engine API of "prefill" or "decode"):
/// without a token, 1100 connections that never send a request; with one, the same, except
/// that each connection sends a request without the token first (answered 401, which proves
/// nothing).
fn http_port(tag: &str, target: Target) {
    for token in [None, Some("s3cret")] {
        let tag = format!("{tag}-{}", if token.is_some() { "token" } else { "open" });
        let (name, field) = match target {
            Target::Registry => ("registry", "url"),
            Target::Prefill => ("prefill's engine API", "api"),
            Target::Decode => ("decode's engine API", "api"),
        };
        let first: &[u8] = match (token, target) {
            (Some(_), Target::Registry) => b"GET /v1/ranks HTTP/1.1\r\nHost: registry\r\n\r\n",
            (Some(_), _) => b"GET /v1/pool HTTP/1.1\r\nHost: agent\r\n\r\n",
            (None, _) => b"",
        };
        let port = Port { name, target };
        held_while_rooms_run(&tag, ("zmq-tcp", token, &[]), port, true, |p| {
            hold_tcp(&p.field(field).unwrap(), 1100, first)
        });
    }
}

#[test]
fn silent_connections_on_the_registry_never_keep_a_room_out() {
    http_port("held-registry", Target::Registry);
}

#[test]
fn silent_connections_on_the_prefill_api_never_keep_a_room_out() {
    http_port("held-prefill-api", Target::Prefill);
}

#[test]
fn silent_connections_on_the_decode_api_never_keep_a_room_out() {
    http_port("held-decode-api", Target::Decode);
}

/// The ZeroMQ port `which` ("control" of the prefill, "data" of the decode), without a token
/// (500 connections that finish the NULL handshake) and with one (100 that send a PLAIN
/// greeting and stall).
fn zmq_port(tag: &str, which: &str) {
    for token in [None, Some("s3cret")] {
        let tag = format!("{tag}-{}", if token.is_some() { "token" } else { "null" });
        let (port, socket_type) = match which {
            "control" => (
                Port {
                    name: "prefill's control port",
                    target: Target::Prefill,
                },
                "DEALER",
            ),
            _ => (
                Port {
                    name: "decode's data port",
                    target: Target::Decode,
                },
                "PUSH",
            ),
        };
        let (first, n) = match token {
            None => (
                [zmtp_greeting("NULL"), zmtp_ready(socket_type)].concat(),
                500,
            ),
            Some(_) => (zmtp_greeting("PLAIN"), 100),
        };
        held_while_rooms_run(&tag, ("zmq-tcp", token, &[]), port, n > 128, |p| {
            hold_tcp(&p.field(which).unwrap(), n, &first)
        });
    }
}

#[test]
fn silent_connections_on_the_control_port_never_keep_a_room_out() {
    zmq_port("held-control", "control");
}

#[test]
fn silent_connections_on_the_data_port_never_keep_a_room_out() {
    zmq_port("held-data", "data");
}

/// The abstract names of the Unix sockets `pid` listens on whose name starts with `prefix`.
fn abstract_sockets(pid: u32, prefix: &str) -> Vec<String> {
    let inodes = socket_inodes(pid);
    let table = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // Num RefCount Protocol Flags Type St Inode Path
            let (inode, path) = (f.get(6)?, f.get(7)?);
            let name = path.strip_prefix('@')?;
            (inodes.iter().any(|i| i == inode) && name.starts_with(prefix)).then(|| name.to_owned())
        })
        .collect()
}

#[test]
fn silent_connections_on_the_pool_socket_never_keep_mapped_writes_out() {
    let tag = "held-pool-socket";
    let port = Port {
        name: "decode's pool socket",
        target: Target::Decode,
    };
    let c = held_while_rooms_run(tag, ("zmq-ipc", None, &[]), port, true, |decode| {
        let names = abstract_sockets(decode.pid(), "kvferry-pool-");
        assert_eq!(
            names.len(),
            1,
            "{tag}: the decode's pool sockets: {names:?}"
        );
        let address = SocketAddr::from_abstract_name(names[0].as_bytes()).expect("name");
        (0..200)
            .filter_map(|_| UnixStream::connect_addr(&address).ok())
            .collect::<Vec<_>>()
    });
    // Every room (8 with the attacker, 8 after it) landed by mapped writes.
    let direct = decode_chunks(tag, &c.decode_api, "direct");
    println!("[{tag}] {direct} chunks written straight into the decode's pool");
    assert!(
        direct >= 16.0,
        "{tag}: only {direct} chunks by mapped writes"
    );
    assert_eq!(decode_chunks(tag, &c.decode_api, "staged"), 0.0, "{tag}");
}

/// Ports of the TCP sockets `pid` listens on.
#[cfg(feature = "ucx")]
fn listening(pid: u32) -> Vec<u16> {
    let rows = tcp_rows(pid);
    rows.iter()
        .filter(|r| r[3] == "0A")
        .map(|r| port_of(&r[1]))
        .collect()
}

#[cfg(feature = "ucx")]
#[test]
fn silent_connections_on_the_ucx_listener_never_keep_a_room_out() {
    let tag = "held-ucx";
    let env = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")];
    let port = Port {
        name: "decode's UCX listener",
        target: Target::Decode,
    };
    held_while_rooms_run(tag, ("ucx", None, &env), port, false, |decode| {
        let api_port: u16 = decode
            .field("api")
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ucx: Vec<u16> = listening(decode.pid())
            .into_iter()
            .filter(|p| *p != api_port)
            .collect();
        assert!(!ucx.is_empty(), "{tag}: the decode listens on no UCX port");
        ucx.iter()
            .flat_map(|p| hold_tcp(&format!("127.0.0.1:{p}"), 500 / ucx.len(), b""))
            .collect()
    });
}

#[test]
fn silent_connections_on_the_proxy_never_keep_a_request_out() {
    let tag = "held-proxy";
    let logs = kvferry::cluster::log_dir(tag).expect("log dir");
    // Backends that are never reached: the proxy answers /metrics itself.
    let nowhere = format!("http://127.0.0.1:{}", closed_port());
    let args = owned(&[
        "proxy",
        "--prefill",
        &nowhere,
        "--decode",
        &nowhere,
        "--port",
        "0",
    ]);
    let prefix = owned(&["prlimit", NOFILE]);
    let proxy = common::spawn(&release_binary(), &prefix, "proxy", &args, &[], &logs);
    let url = proxy.field("url").unwrap();
    // A new connection for every request, as a new client's.
    let client = kvferry_wire::http::client()
        .pool_max_idle_per_host(0)
        .timeout(BOUND)
        .build()
        .expect("client");
    let answered = |url: String| {
        let client = client.clone();
        async move {
            let r = client.get(format!("{url}/metrics")).send().await;
            r.is_ok_and(|r| r.status() == reqwest::StatusCode::OK)
        }
    };
    runtime().block_on(async {
        let before = fds(proxy.pid());
        let held = hold_tcp(&url, 1100, b"");
        println!("[{tag}] {} connections held on the proxy", held.len());
        let t = Instant::now();
        for _ in 0..8 {
            assert!(answered(url.clone()).await, "{tag}: /metrics under attack");
        }
        println!(
            "[{tag}] 8 requests on new connections answered in {:.0} ms with the attacker",
            ms(t.elapsed())
        );
        assert!(
            dropped_in_log(&proxy.log),
            "{tag}: no dropped connection logged"
        );
        let ports: Vec<(u16, u16)> = held.iter().filter_map(Held::ports).collect();
        drop(held);
        released(tag, proxy.pid(), before, &ports).await;
        assert!(
            answered(url.clone()).await,
            "{tag}: /metrics after the attack"
        );
    });
}

/// 64 DEALERs of `ctx` connected to the prefill's control endpoint, each having sent `first`.
fn dealers(ctx: &zmq::Context, prefill: &Process, first: &[u8]) -> Vec<zmq::Socket> {
    let endpoint = prefill.field("control").unwrap();
    (0..64)
        .map(|_| {
            let s = ctx.socket(zmq::DEALER).expect("DEALER");
            s.set_linger(0).expect("linger");
            s.set_rcvtimeo(30_000).expect("timeout");
            // Once the prefill closes one, it stays closed.
            s.set_reconnect_ivl(-1).expect("no reconnection");
            s.connect(&endpoint).expect("connect");
            s.send(first, 0).expect("send");
            s
        })
        .collect()
}

/// A Hello the prefill refuses (its layout is not the prefill's): a valid proof of the
/// connection that sends it, answered with an Error.
fn refused_hello() -> Vec<u8> {
    let mut hello = rogue::hello("tcp://127.0.0.1:9".to_owned(), None, None);
    if let kvferry::protocol::Message::Hello(h) = &mut hello {
        h.layout.num_kv_heads += 1;
        h.layout.heads.end += 1;
    }
    hello.encode()
}

/// 64 connections from 127.0.0.1 that each sent a valid Hello (refused, answered) fill the
/// prefill control port's per-address bound: the decode's connection from the same address is
/// the 65th, refused, and its room says which limit (not a token mismatch). Once they close and
/// the prefill let them go, rooms land again.
#[test]
fn a_host_over_the_per_address_limit_is_told_which_limit() {
    let tag = "held-per-address";
    let ctx = zmq::Context::new();
    let (c, held, before) =
        cluster_under_attack(tag, ("zmq-tcp", None, &[]), Target::Prefill, |prefill| {
            let held = dealers(&ctx, prefill, &refused_hello());
            for s in &held {
                // The prefill answered: it read the Hello, the connection counts.
                s.recv_bytes(0).expect("the prefill's answer");
            }
            held
        });
    runtime().block_on(async {
        let http = http();
        request(&http, &c.decode_api, 1, serde_json::json!({"tokens": 64})).await;
        ready(&http, &c.prefill_api, 1, 64).await;
        let v = wait_final(&http, &c.decode_api, 1).await;
        println!(
            "[{tag}] the 65th connection's room: {} {}",
            v["state"], v["reason"]
        );
        assert_eq!(v["state"], "failed", "{v}");
        assert_reason(&v, "unreachable");
        let why = v["reason"]["message"].as_str().unwrap_or_default();
        assert!(
            why.contains("limit of 64 connections from one address"),
            "{v}"
        );
        drop(held);
        // Once the prefill has closed its ends (on a loaded machine that takes a while).
        released(tag, c.prefill.pid(), before, &[]).await;
        rooms(tag, &c, 100, None).await;
    });
}

/// 64 connections from 127.0.0.1 that each sent a message that is not a Hello prove nothing:
/// the prefill drops their messages unread (none is answered) and counts none of them against
/// the per-address bound, so the decode's connection from the same address is served and its
/// rooms land; the prefill shuts them down at the proof deadline. (Before, any first message
/// proved a connection, and 64 of them refused every decode of the host.)
#[test]
fn messages_that_are_not_a_hello_prove_no_control_connection() {
    let tag = "held-not-hello";
    let ctx = zmq::Context::new();
    let (c, held, before) =
        cluster_under_attack(tag, ("zmq-tcp", None, &[]), Target::Prefill, |prefill| {
            dealers(&ctx, prefill, b"not a message")
        });
    runtime().block_on(async {
        rooms(tag, &c, 1, None).await;
        // Unproven, they are shut down at the deadline, without a word.
        released(tag, c.prefill.pid(), before, &[]).await;
        for s in &held {
            s.set_rcvtimeo(0).expect("timeout");
            assert!(
                s.recv_bytes(0).is_err(),
                "the prefill answered a message before a Hello"
            );
        }
        rooms(tag, &c, 100, None).await;
    });
}
