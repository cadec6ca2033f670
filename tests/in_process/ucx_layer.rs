//! The UCX layer on its own (issue 9): FFI struct layouts against the installed headers, and two
//! workers of this process over UCX's tcp (`TLS=tcp`, always `NET_DEVICES=lo`) and shared
//! memory (`TLS=posix,cma,self`) transports:
//! - 100 tagged messages of random sizes up to 4 MiB (half as header + payload iovs), every
//!   byte compared;
//! - 64 MiB put into a registered remote region in 1 MiB pieces, flushed, every byte compared,
//!   and a put past the region refused;
//! - a peer that dies mid-stream fails the survivor's pending operations with
//!   `UcxError::PeerFailed` within 30 s (printed): a worker shut down in this process (tcp),
//!   and a child process killed with SIGKILL (tcp and shm; UCX's shared-memory keepalive
//!   checks the peer *process*, so only a dead process is detectable there).
//!
//! UCX config is set per context (`ucp_config_modify`), never through the process
//! environment, so the tests run in parallel. Seeds are printed; `KVFERRY_SEED` replays one.
//! Run: `cargo test --features ucx --test in_process ucx_layer::`.
#![cfg(feature = "ucx")]

use std::io::{BufRead, BufReader, Write};
use std::mem::{offset_of, size_of};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvferry::transport::ucx::sys;
use kvferry::transport::ucx::version::Family;
use kvferry::transport::ucx::{
    EndpointId, MemoryType, Region, RegisterableMemory, Span, UcxConfig, UcxError, UcxWorker,
};
use kvferry::transport::{DeviceMemory, RecvBuffers, Transport};
use tokio_util::sync::CancellationToken;

const MIB: usize = 1 << 20;
const ALL: u64 = u64::MAX;

// ---------------------------------------------------------------------------------------------
// Layouts

/// (name, value) pairs as `src/transport/ucx/layout_probe.c` prints them, from the Rust
/// declarations.
fn rust_layout() -> Vec<(&'static str, usize)> {
    macro_rules! size {
        ($t:ident) => {
            (concat!(stringify!($t), ".size"), size_of::<sys::$t>())
        };
    }
    macro_rules! off {
        ($t:ident, $f:ident) => {
            (
                concat!(stringify!($t), ".", stringify!($f)),
                offset_of!(sys::$t, $f),
            )
        };
    }
    vec![
        size!(ucs_status_t),
        size!(ucp_params_t),
        off!(ucp_params_t, field_mask),
        off!(ucp_params_t, features),
        off!(ucp_params_t, request_size),
        off!(ucp_params_t, request_init),
        off!(ucp_params_t, request_cleanup),
        off!(ucp_params_t, tag_sender_mask),
        off!(ucp_params_t, mt_workers_shared),
        off!(ucp_params_t, estimated_num_eps),
        off!(ucp_params_t, estimated_num_ppn),
        off!(ucp_params_t, name),
        size!(ucp_context_attr_t),
        off!(ucp_context_attr_t, field_mask),
        off!(ucp_context_attr_t, request_size),
        off!(ucp_context_attr_t, thread_mode),
        off!(ucp_context_attr_t, memory_types),
        off!(ucp_context_attr_t, name),
        size!(ucp_worker_params_t),
        off!(ucp_worker_params_t, field_mask),
        off!(ucp_worker_params_t, thread_mode),
        off!(ucp_worker_params_t, cpu_mask),
        off!(ucp_worker_params_t, events),
        off!(ucp_worker_params_t, user_data),
        off!(ucp_worker_params_t, event_fd),
        off!(ucp_worker_params_t, flags),
        off!(ucp_worker_params_t, name),
        off!(ucp_worker_params_t, am_alignment),
        off!(ucp_worker_params_t, client_id),
        size!(ucp_err_handler_t),
        off!(ucp_err_handler_t, cb),
        off!(ucp_err_handler_t, arg),
        size!(ucs_sock_addr_t),
        off!(ucs_sock_addr_t, addr),
        off!(ucs_sock_addr_t, addrlen),
        size!(ucp_ep_params_t),
        off!(ucp_ep_params_t, field_mask),
        off!(ucp_ep_params_t, address),
        off!(ucp_ep_params_t, err_mode),
        off!(ucp_ep_params_t, err_handler),
        off!(ucp_ep_params_t, user_data),
        off!(ucp_ep_params_t, flags),
        off!(ucp_ep_params_t, sockaddr),
        off!(ucp_ep_params_t, conn_request),
        off!(ucp_ep_params_t, name),
        off!(ucp_ep_params_t, local_sockaddr),
        size!(ucp_mem_map_params_t),
        off!(ucp_mem_map_params_t, field_mask),
        off!(ucp_mem_map_params_t, address),
        off!(ucp_mem_map_params_t, length),
        off!(ucp_mem_map_params_t, flags),
        off!(ucp_mem_map_params_t, prot),
        off!(ucp_mem_map_params_t, memory_type),
        size!(ucp_request_param_t),
        off!(ucp_request_param_t, op_attr_mask),
        off!(ucp_request_param_t, flags),
        off!(ucp_request_param_t, request),
        off!(ucp_request_param_t, cb),
        off!(ucp_request_param_t, datatype),
        off!(ucp_request_param_t, user_data),
        off!(ucp_request_param_t, reply_buffer),
        off!(ucp_request_param_t, memory_type),
        off!(ucp_request_param_t, recv_info),
        off!(ucp_request_param_t, memh),
        size!(ucp_tag_recv_info_t),
        off!(ucp_tag_recv_info_t, sender_tag),
        off!(ucp_tag_recv_info_t, length),
        size!(ucp_dt_iov_t),
        off!(ucp_dt_iov_t, buffer),
        off!(ucp_dt_iov_t, length),
        size!(ucp_generic_dt_ops_t),
        off!(ucp_generic_dt_ops_t, start_pack),
        off!(ucp_generic_dt_ops_t, start_unpack),
        off!(ucp_generic_dt_ops_t, packed_size),
        off!(ucp_generic_dt_ops_t, pack),
        off!(ucp_generic_dt_ops_t, unpack),
        off!(ucp_generic_dt_ops_t, finish),
    ]
}

/// What gcc printed for Debian's libucx-dev 1.13.1 headers on x86_64 (layout_probe.c).
const GCC_LAYOUT_UCX_1_13_X86_64: &str = "\
ucs_status_t.size 1;ucp_params_t.size 80;ucp_params_t.field_mask 0;ucp_params_t.features 8;\
ucp_params_t.request_size 16;ucp_params_t.request_init 24;ucp_params_t.request_cleanup 32;\
ucp_params_t.tag_sender_mask 40;ucp_params_t.mt_workers_shared 48;\
ucp_params_t.estimated_num_eps 56;ucp_params_t.estimated_num_ppn 64;ucp_params_t.name 72;\
ucp_context_attr_t.size 64;ucp_context_attr_t.field_mask 0;ucp_context_attr_t.request_size 8;\
ucp_context_attr_t.thread_mode 16;ucp_context_attr_t.memory_types 24;ucp_context_attr_t.name 32;\
ucp_worker_params_t.size 200;ucp_worker_params_t.field_mask 0;\
ucp_worker_params_t.thread_mode 8;ucp_worker_params_t.cpu_mask 16;\
ucp_worker_params_t.events 144;ucp_worker_params_t.user_data 152;\
ucp_worker_params_t.event_fd 160;ucp_worker_params_t.flags 168;ucp_worker_params_t.name 176;\
ucp_worker_params_t.am_alignment 184;ucp_worker_params_t.client_id 192;\
ucp_err_handler_t.size 16;ucp_err_handler_t.cb 0;ucp_err_handler_t.arg 8;\
ucs_sock_addr_t.size 16;ucs_sock_addr_t.addr 0;ucs_sock_addr_t.addrlen 8;\
ucp_ep_params_t.size 104;ucp_ep_params_t.field_mask 0;ucp_ep_params_t.address 8;\
ucp_ep_params_t.err_mode 16;ucp_ep_params_t.err_handler 24;ucp_ep_params_t.user_data 40;\
ucp_ep_params_t.flags 48;ucp_ep_params_t.sockaddr 56;ucp_ep_params_t.conn_request 72;\
ucp_ep_params_t.name 80;ucp_ep_params_t.local_sockaddr 88;ucp_mem_map_params_t.size 40;\
ucp_mem_map_params_t.field_mask 0;ucp_mem_map_params_t.address 8;\
ucp_mem_map_params_t.length 16;ucp_mem_map_params_t.flags 24;ucp_mem_map_params_t.prot 28;\
ucp_mem_map_params_t.memory_type 32;ucp_request_param_t.size 72;\
ucp_request_param_t.op_attr_mask 0;ucp_request_param_t.flags 4;\
ucp_request_param_t.request 8;ucp_request_param_t.cb 16;ucp_request_param_t.datatype 24;\
ucp_request_param_t.user_data 32;ucp_request_param_t.reply_buffer 40;\
ucp_request_param_t.memory_type 48;ucp_request_param_t.recv_info 56;\
ucp_request_param_t.memh 64;ucp_tag_recv_info_t.size 16;ucp_tag_recv_info_t.sender_tag 0;\
ucp_tag_recv_info_t.length 8;ucp_dt_iov_t.size 16;ucp_dt_iov_t.buffer 0;\
ucp_dt_iov_t.length 8;ucp_generic_dt_ops_t.size 48;\
ucp_generic_dt_ops_t.start_pack 0;ucp_generic_dt_ops_t.start_unpack 8;\
ucp_generic_dt_ops_t.packed_size 16;ucp_generic_dt_ops_t.pack 24;\
ucp_generic_dt_ops_t.unpack 32;ucp_generic_dt_ops_t.finish 40;";

fn parse_layout(text: &str) -> Vec<(String, usize)> {
    text.split([';', '\n'])
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (name, value) = l.trim().split_once(' ').expect("`name value`");
            (name.to_owned(), value.parse().expect("a number"))
        })
        .collect()
}

fn assert_layout(expected: &[(String, usize)], source: &str) {
    let rust = rust_layout();
    assert_eq!(rust.len(), expected.len(), "{source} lists other fields");
    for ((name, value), (want_name, want)) in rust.iter().zip(expected) {
        assert_eq!(name, want_name, "{source}: field order");
        assert_eq!(
            value, want,
            "{name}: Rust says {value}, {source} says {want}"
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn ffi_layouts_match_the_recorded_ucx_1_13_headers() {
    assert_layout(
        &parse_layout(GCC_LAYOUT_UCX_1_13_X86_64),
        "recorded gcc output",
    );
}

#[test]
fn ffi_layouts_match_the_installed_headers() {
    let probe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/transport/ucx/layout_probe.c"
    );
    let exe = std::env::temp_dir().join(format!("kvferry-ucx-layout-{}", std::process::id()));
    let built = Command::new("gcc")
        .args(["-o"])
        .arg(&exe)
        .arg(probe)
        .output();
    let built = match built {
        Ok(out) if out.status.success() => out,
        Ok(out) => panic!(
            "gcc could not compile the layout probe against the UCX headers: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => {
            println!("SKIP: no gcc ({e}); the recorded layout test still ran");
            return;
        }
    };
    drop(built);
    let out = Command::new(&exe)
        .output()
        .expect("running the layout probe");
    let _ = std::fs::remove_file(&exe);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert_layout(&parse_layout(&text), "gcc on the installed headers");
}

#[test]
fn runtime_library_is_a_release_we_run_on() {
    let loaded = kvferry::transport::ucx::UcxVersion::loaded();
    println!("libucp {loaded}");
    // sys.rs mirrors the 1.13 headers; 1.22 only appends fields (each behind a field_mask
    // bit kvferry never sets) and keeps every 1.13 prototype.
    assert!(loaded.family().is_ok(), "{loaded}");
}

// ---------------------------------------------------------------------------------------------
// Helpers

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tls {
    Tcp,
    /// tcp as the agents set it up for eager chunks and runs (`transport/ucx/data.rs`):
    /// no rendezvous, large segments, revocable placed receives, a short poll.
    TcpEager,
    Shm,
}

impl Tls {
    fn name(self) -> &'static str {
        match self {
            Tls::Tcp => "tcp",
            Tls::TcpEager => "tcp-eager",
            Tls::Shm => "shm",
        }
    }

    /// The config of one test worker. NET_DEVICES=lo always: no other interface is ever used.
    fn config(self) -> UcxConfig {
        let config = match self {
            Tls::Tcp => UcxConfig::tcp_loopback(),
            Tls::TcpEager => kvferry::transport::ucx::settings::worker_vars(
                Some("tcp"),
                |_| false,
                kvferry::transport::ucx::version::family(),
            )
            .iter()
            .fold(UcxConfig::tcp_loopback().eager(true), |c, (name, value)| {
                c.var(name, value)
            }),
            Tls::Shm => UcxConfig::shared_memory().var("NET_DEVICES", "lo"),
        };
        // Dead peers: UCX checks endpoints every KEEPALIVE_INTERVAL (default 20 s).
        config.var("KEEPALIVE_INTERVAL", "1s")
    }
}

fn seed() -> u64 {
    let seed = std::env::var("KVFERRY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("seed {seed} (KVFERRY_SEED={seed} replays it)");
    seed
}

/// splitmix64: fast enough in debug builds for hundreds of MiB.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// Two workers connected both ways: (a, b, endpoint a->b, endpoint b->a).
async fn pair(tls: Tls) -> (UcxWorker, UcxWorker, EndpointId, EndpointId) {
    pair_of(tls.config()).await
}

/// Two workers of `config`, each connected to the other.
async fn pair_of(config: UcxConfig) -> (UcxWorker, UcxWorker, EndpointId, EndpointId) {
    let a = UcxWorker::spawn(config.clone()).await.expect("worker a");
    let b = UcxWorker::spawn(config).await.expect("worker b");
    let ab = a.connect(b.address()).await.expect("connect a->b");
    let ba = b.connect(a.address()).await.expect("connect b->a");
    (a, b, ab, ba)
}

async fn bounded<T>(what: &str, secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within {secs} s"))
}

fn same_bytes(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if got != want {
        let first = got.iter().zip(want).position(|(g, w)| g != w).unwrap_or(0);
        panic!(
            "{what}: first difference at byte {first}: got {:#04x}, want {:#04x}",
            got[first], want[first]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Tagged messages

async fn tagged_messages(tls: Tls) {
    let (a, b, ab, _ba) = pair(tls).await;
    let mut rng = Rng(seed());
    let messages: Vec<Vec<u8>> = (0..100)
        .map(|i| {
            let len = match i {
                0 => 0,
                1 => 1,
                2 => 4 * MIB,
                _ => rng.below(4 * MIB as u64 + 1) as usize,
            };
            rng.bytes(len)
        })
        .collect();
    let total: usize = messages.iter().map(Vec::len).sum();
    let want: Vec<Bytes> = messages.into_iter().map(Bytes::from).collect();
    let receiver = {
        let b = b.clone();
        let n = want.len() as u64;
        tokio::spawn(async move {
            let mut got = Vec::new();
            for i in 0..n {
                got.push(b.recv_tag(1000 + i, ALL, 4 * MIB).await);
            }
            got
        })
    };
    let t = Instant::now();
    for (i, data) in want.iter().enumerate() {
        let tag = 1000 + i as u64;
        let sent = if i % 2 == 1 && data.len() >= 16 {
            // Header + payload as two parts of one message.
            let split = (data.len() / 7).max(1);
            a.send_tag_parts(ab, tag, vec![data.slice(..split), data.slice(split..)])
                .await
        } else {
            a.send_tag(ab, tag, data.clone()).await
        };
        sent.unwrap_or_else(|e| panic!("send {i} ({} bytes): {e}", data.len()));
    }
    let got = bounded("receiving", 120, receiver)
        .await
        .expect("receiver task");
    let secs = t.elapsed().as_secs_f64();
    println!(
        "{}: 100 tagged messages, {total} bytes in {secs:.3} s ({:.2} GB/s, debug build, one at a time)",
        tls.name(),
        total as f64 / secs / 1e9
    );
    for (i, (got, want)) in got.into_iter().zip(&want).enumerate() {
        let got = got.unwrap_or_else(|e| panic!("recv {i}: {e}"));
        assert_eq!(got.tag, 1000 + i as u64, "message {i}: tag");
        same_bytes(&format!("message {i}"), &got.data, want);
    }
    // A message longer than the receive buffer is a typed error, and the worker goes on.
    a.send_tag(ab, 7, Bytes::from(vec![1u8; 4096])).await.ok();
    let short = bounded("truncated recv", 30, b.recv_tag(7, ALL, 100)).await;
    assert!(
        matches!(short, Err(UcxError::Truncated { capacity: 100 })),
        "{short:?}"
    );
    a.send_tag(ab, 8, Bytes::from_static(b"after"))
        .await
        .expect("send after truncation");
    let after = bounded("recv after truncation", 30, b.recv_tag(8, ALL, 100)).await;
    assert_eq!(
        after.expect("recv after truncation").data,
        Bytes::from_static(b"after")
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tagged_messages_tcp() {
    tagged_messages(Tls::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tagged_messages_shm() {
    tagged_messages(Tls::Shm).await;
}

/// A message sent from memory (`send_tag_from`: a prefix, then ranges of a registered-able
/// region in order, as a chunk goes straight from the pool) arrives as their concatenation;
/// a range outside the region is refused before anything is sent.
async fn messages_from_memory(tls: Tls) {
    const SIZE: usize = 16 * MIB;
    let (a, b, ab, _ba) = pair(tls).await;
    let mut rng = Rng(seed());
    let src = Arc::new(Region::new(SIZE).expect("source"));
    let fill = rng.bytes(SIZE);
    src.write(0, &fill).expect("fill");
    for i in 0..20u64 {
        let prefix_len = 1 + rng.below(200) as usize;
        let prefix = Bytes::from(rng.bytes(prefix_len));
        let runs: Vec<Span> = (0..1 + rng.below(4))
            .map(|_| {
                let long = rng.below(2 * MIB as u64) + 1;
                let len = [1, 4096, long][rng.below(3) as usize];
                Span {
                    offset: rng.below((SIZE as u64) - len + 1),
                    len,
                }
            })
            .collect();
        let mut want = prefix.to_vec();
        for r in &runs {
            want.extend_from_slice(&fill[r.offset as usize..(r.offset + r.len) as usize]);
        }
        let got = b.recv_tag(500 + i, ALL, want.len());
        let sent = a.send_tag_from(ab, 500 + i, prefix, src.clone(), runs);
        let (got, sent) =
            bounded("message from memory", 60, async { tokio::join!(got, sent) }).await;
        sent.unwrap_or_else(|e| panic!("send {i}: {e}"));
        let got = got.unwrap_or_else(|e| panic!("recv {i}: {e}"));
        same_bytes(&format!("message {i} from memory"), &got.data, &want);
    }
    let outside = Span {
        offset: SIZE as u64 - 10,
        len: 11,
    };
    let refused = a
        .send_tag_from(ab, 9, Bytes::from_static(b"p"), src.clone(), vec![outside])
        .await;
    assert!(
        matches!(refused, Err(UcxError::OutOfBounds { len: 11, .. })),
        "{refused:?}"
    );
    println!("{}: 20 messages from memory arrived whole", tls.name());
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_from_memory_tcp() {
    messages_from_memory(Tls::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_from_memory_shm() {
    messages_from_memory(Tls::Shm).await;
}

/// A receive whose future is dropped is cancelled: the next message with its tag goes to the
/// next receive, not into the abandoned buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_receive_is_cancelled() {
    let (a, b, ab, _ba) = pair(Tls::Tcp).await;
    let early = tokio::time::timeout(Duration::from_millis(200), b.recv_tag(5, ALL, 1024)).await;
    assert!(early.is_err(), "nothing was sent yet");
    a.send_tag(ab, 5, Bytes::from_static(b"second"))
        .await
        .expect("send");
    let got = bounded("recv", 30, b.recv_tag(5, ALL, 1024))
        .await
        .expect("recv");
    assert_eq!(got.data, Bytes::from_static(b"second"));
    a.shutdown().await;
    b.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Placed runs

/// 48 MiB in runs of random sizes, sent straight from one region and received straight into
/// another at shuffled offsets (`recv_runs` posted first, then `send_runs`): every byte
/// compared, bytes outside the runs untouched. Then: a run of the wrong length fails its
/// group, places outside the memory are refused, and cancelled receives that nothing matched
/// return without a byte written.
async fn placed_runs(tls: Tls) {
    const SIZE: usize = 48 * MIB;
    let (a, b, ab, _ba) = pair(tls).await;
    let mut rng = Rng(seed());
    let src = Arc::new(Region::new(SIZE).expect("source"));
    src.write(0, &rng.bytes(SIZE)).expect("fill");
    let dst = Arc::new(Region::new(SIZE + MIB).expect("destination"));
    dst.fill(0xEE);
    // Cut the source into runs, then place them at the destination in another order.
    let mut cuts = vec![0usize];
    while *cuts.last().unwrap() < SIZE {
        let len = [1, 4096, 1 + rng.below(3 * MIB as u64) as usize][rng.below(3) as usize];
        cuts.push((cuts.last().unwrap() + len).min(SIZE));
    }
    let sends: Vec<Span> = cuts
        .windows(2)
        .map(|w| Span {
            offset: w[0] as u64,
            len: (w[1] - w[0]) as u64,
        })
        .collect();
    let mut order: Vec<usize> = (0..sends.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut at = vec![0u64; sends.len()];
    let mut next = MIB as u64; // the first MiB stays untouched
    for &i in &order {
        at[i] = next;
        next += sends[i].len;
    }
    let places: Vec<Vec<Span>> = sends
        .iter()
        .zip(&at)
        .map(|(s, &offset)| vec![Span { offset, len: s.len }])
        .collect();
    let cancel = CancellationToken::new();
    let t = Instant::now();
    // Posted first, as the agents do: a run never waits unexpected at the receiver.
    let landing = b
        .recv_runs(1 << 32, dst.clone(), places.clone(), cancel.clone())
        .await
        .expect("post the receives");
    let (sent, placed) = bounded("placed runs", 120, async {
        tokio::join!(
            a.send_runs(ab, 1 << 32, src.clone(), sends.clone()),
            landing
        )
    })
    .await;
    let secs = t.elapsed().as_secs_f64();
    sent.expect("send runs");
    placed.expect("receive runs");
    println!(
        "{}: {} runs, {SIZE} bytes placed in {secs:.3} s ({:.2} GB/s, debug build)",
        tls.name(),
        sends.len(),
        SIZE as f64 / secs / 1e9
    );
    let got = dst.read(0, SIZE + MIB).expect("read");
    assert!(
        got[..MIB].iter().all(|&b| b == 0xEE),
        "bytes before the runs"
    );
    let want = src.read(0, SIZE).expect("read");
    for (i, (s, p)) in sends.iter().zip(&places).enumerate() {
        let (s, p) = (s.offset as usize, p[0].offset as usize);
        let len = sends[i].len as usize;
        same_bytes(&format!("run {i}"), &got[p..p + len], &want[s..s + len]);
    }
    // A message of another length than its place fails the group with the lengths.
    let one = |len: u64| vec![Span { offset: 0, len }];
    let landing = b
        .recv_runs(7 << 32, dst.clone(), vec![one(200)], cancel.clone())
        .await
        .expect("post");
    let (sent, placed) = bounded("mismatched run", 60, async {
        tokio::join!(a.send_runs(ab, 7 << 32, src.clone(), one(100)), landing)
    })
    .await;
    sent.expect("send the short run");
    assert!(
        matches!(
            placed,
            Err(UcxError::Length {
                expected: 200,
                got: Some(100)
            })
        ),
        "{placed:?}"
    );
    // Places outside the memory are refused before UCX sees them.
    let outside = vec![vec![Span {
        offset: (SIZE + MIB - 10) as u64,
        len: 11,
    }]];
    match b
        .recv_runs(9 << 32, dst.clone(), outside, cancel.clone())
        .await
    {
        Err(UcxError::OutOfBounds { .. }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("receives posted outside the memory"),
    }
    // Cancelled receives return (after UCX let go of them) and land nothing, not even from
    // a run sent afterwards (it waits unmatched, never placed).
    dst.fill(0x11);
    let cancel = CancellationToken::new();
    let landing = b
        .recv_runs(
            11 << 32,
            dst.clone(),
            vec![one(MIB as u64); 4],
            cancel.clone(),
        )
        .await
        .expect("post");
    let waiting = tokio::spawn(landing);
    tokio::time::sleep(Duration::from_millis(100)).await;
    cancel.cancel();
    let cancelled = bounded("cancelled receives", 30, waiting)
        .await
        .expect("task");
    assert!(cancelled.is_err(), "{cancelled:?}");
    let late = a.send_runs(ab, 11 << 32, src.clone(), one(MIB as u64));
    let _ = tokio::time::timeout(Duration::from_millis(300), late).await;
    assert!(
        dst.read(0, MIB).expect("read").iter().all(|&b| b == 0x11),
        "a cancelled receive landed bytes"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_runs_tcp() {
    placed_runs(Tls::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_runs_tcp_eager() {
    placed_runs(Tls::TcpEager).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_runs_shm() {
    placed_runs(Tls::Shm).await;
}

/// 16 MiB sent in runs of random sizes, each landing in pieces of the destination: the
/// stream's `k`-th KiB at `MIB + k * 2 KiB` (a decode's half of each token row, its heads of a
/// prefill with fewer), so a run covers many pieces and may begin or end inside one. Over
/// eager tcp every byte lands where its piece says and the KiB between them stay untouched.
/// Workers that receive runs straight into one buffer refuse runs of several pieces.
async fn scattered_runs(tls: Tls) {
    const SIZE: usize = 16 * MIB;
    const PIECE: usize = 1024;
    let (a, b, ab, _ba) = pair(tls).await;
    let mut rng = Rng(seed());
    let src = Arc::new(Region::new(SIZE).expect("source"));
    src.write(0, &rng.bytes(SIZE)).expect("fill");
    let dst = Arc::new(Region::new(MIB + 2 * SIZE).expect("destination"));
    dst.fill(0xEE);
    let mut sends = Vec::new();
    let mut at = 0;
    while at < SIZE {
        let len = [1, 700, 4096, 1 + rng.below(MIB as u64) as usize][rng.below(4) as usize];
        let len = len.min(SIZE - at);
        sends.push(Span {
            offset: at as u64,
            len: len as u64,
        });
        at += len;
    }
    // The pieces of stream bytes `start..end`, in order.
    let pieces = |start: usize, end: usize| {
        let mut out = Vec::new();
        let mut k = start;
        while k < end {
            let n = (PIECE - k % PIECE).min(end - k);
            let offset = MIB + (k / PIECE) * 2 * PIECE + k % PIECE;
            out.push(Span {
                offset: offset as u64,
                len: n as u64,
            });
            k += n;
        }
        out
    };
    let places: Vec<Vec<Span>> = sends
        .iter()
        .map(|s| pieces(s.offset as usize, (s.offset + s.len) as usize))
        .collect();
    let cancel = CancellationToken::new();
    let posted = b
        .recv_runs(3 << 32, dst.clone(), places, cancel.clone())
        .await;
    if tls != Tls::TcpEager {
        match posted {
            Err(UcxError::Call { op, .. }) => println!("{}: refused ({op})", tls.name()),
            Err(e) => panic!("{}: {e}", tls.name()),
            Ok(_) => panic!("{}: runs of several pieces posted", tls.name()),
        }
        a.shutdown().await;
        b.shutdown().await;
        return;
    }
    let landing = posted.expect("post the receives");
    let t = Instant::now();
    let (sent, placed) = bounded("scattered runs", 120, async {
        tokio::join!(
            a.send_runs(ab, 3 << 32, src.clone(), sends.clone()),
            landing
        )
    })
    .await;
    sent.expect("send runs");
    placed.expect("receive runs");
    println!(
        "{}: {} runs in pieces of 1 KiB, {SIZE} bytes in {:.3} s",
        tls.name(),
        sends.len(),
        t.elapsed().as_secs_f64()
    );
    let mut want = vec![0xEEu8; MIB + 2 * SIZE];
    let bytes = src.read(0, SIZE).expect("read");
    for (k, chunk) in bytes.chunks(PIECE).enumerate() {
        let at = MIB + k * 2 * PIECE;
        want[at..at + chunk.len()].copy_from_slice(chunk);
    }
    same_bytes(
        "the destination",
        &dst.read(0, want.len()).expect("read"),
        &want,
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_runs_land_over_eager_tcp_and_are_refused_elsewhere() {
    for tls in [Tls::TcpEager, Tls::Tcp, Tls::Shm] {
        scattered_runs(tls).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Revoked runs (eager tcp)

/// Polls `dst` until a byte of the 4 KiB at `at` is no longer `fill` (a message is landing
/// there). A window, not one byte: a random source holds `fill` at any one place 1 time in
/// 256.
async fn first_bytes_landed(dst: &Region, at: usize, fill: u8) {
    bounded("the first bytes of the run", 60, async {
        while dst.read(at, 4096).expect("read").iter().all(|&b| b == fill) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
}

/// Cancels a run's landing and checks it answers, with an error, within 10 s (printed).
async fn cancel_landing(
    what: &str,
    cancel: &CancellationToken,
    landing: tokio::task::JoinHandle<Result<(), UcxError>>,
) {
    cancel.cancel();
    let t = Instant::now();
    let answered = bounded(what, 10, landing).await.expect("task");
    println!(
        "{what}: answered {:.1} ms after the cancel: {answered:?}",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert!(
        answered.is_err(),
        "{what}: a cancelled run reported success"
    );
}

/// A run cancelled while its message is landing (sender alive) answers at once and writes
/// nothing more: the rest of the message is taken and dropped. Every byte that did land is the
/// source's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cancelled_mid_message_writes_nothing_more() {
    const SIZE: usize = 256 * MIB;
    let (a, b, ab, _ba) = pair(Tls::TcpEager).await;
    let mut rng = Rng(seed());
    let src = Arc::new(Region::new(SIZE).expect("source"));
    src.write(0, &rng.bytes(SIZE)).expect("fill");
    let dst = Arc::new(Region::new(SIZE).expect("destination"));
    dst.fill(0xEE);
    let run = vec![Span {
        offset: 0,
        len: SIZE as u64,
    }];
    let cancel = CancellationToken::new();
    let landing = b
        .recv_runs(5 << 32, dst.clone(), vec![run.clone()], cancel.clone())
        .await
        .expect("post");
    let landing = tokio::spawn(landing);
    let sent = tokio::spawn({
        let (a, src, run) = (a.clone(), src.clone(), run.clone());
        async move { a.send_runs(ab, 5 << 32, src, run).await }
    });
    first_bytes_landed(&dst, MIB, 0xEE).await;
    cancel_landing("cancelled mid-message", &cancel, landing).await;
    let at_cancel = dst.read(0, SIZE).expect("read");
    // The sender finishes its message into the revoked receive; a later message on the same
    // endpoint lands only after all of it was taken.
    bounded("the rest of the message", 60, sent)
        .await
        .expect("task")
        .expect("send");
    let (done, got) = tokio::join!(
        a.send_tag(ab, 6, Bytes::from_static(b"after")),
        b.recv_tag(6, ALL, 64)
    );
    done.expect("send after");
    assert_eq!(&got.expect("recv after").data[..], b"after");
    let after = dst.read(0, SIZE).expect("read");
    let landed = at_cancel.iter().filter(|&&b| b != 0xEE).count();
    println!("{landed} of {SIZE} bytes had landed at the cancel");
    assert!(landed > 0, "nothing landed before the cancel");
    same_bytes("the destination after the cancel", &after, &at_cancel);
    let want = src.read(0, SIZE).expect("read");
    let wrong = (0..SIZE)
        .filter(|&i| at_cancel[i] != 0xEE && at_cancel[i] != want[i])
        .count();
    assert_eq!(wrong, 0, "bytes that landed are not the source's");
    a.shutdown().await;
    b.shutdown().await;
}

/// The helper process's run mode (`ucx_child_peer` with `KVFERRY_UCX_CHILD_RUN` set): one
/// placed run of that many bytes of 0xC7, tag 9, then nothing.
const CHILD_RUN_ENV: &str = "KVFERRY_UCX_CHILD_RUN";

/// A run whose sender is killed mid-message: UCX 1.13 never ends the receive it matched
/// (printed); cancelled, it answers at once, and the worker still shuts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_sender_is_killed_mid_message_is_revoked() {
    const SIZE: usize = 256 * MIB;
    let (mut child, address) = child_peer(Tls::TcpEager, Some(SIZE)).await;
    let w = UcxWorker::spawn(Tls::TcpEager.config())
        .await
        .expect("parent worker");
    let _ep = w.connect(Bytes::from(address)).await.expect("connect");
    let dst = Arc::new(Region::new(SIZE).expect("destination"));
    dst.fill(0xEE);
    let cancel = CancellationToken::new();
    let run = vec![Span {
        offset: 0,
        len: SIZE as u64,
    }];
    let landing = w
        .recv_runs(9, dst.clone(), vec![run], cancel.clone())
        .await
        .expect("post");
    let mut landing = tokio::spawn(landing);
    // Posted first: now the child may connect and send.
    let mut stdin = child.0.stdin.take().expect("child stdin");
    writeln!(stdin, "{}", hex(&w.address())).expect("send our address");
    first_bytes_landed(&dst, MIB, 0xEE).await;
    child.0.kill().expect("kill the child");
    child.0.wait().expect("reap the child");
    let after_kill = tokio::time::timeout(Duration::from_secs(2), &mut landing).await;
    match &after_kill {
        Err(_) => println!("2 s after the kill the receive has not ended (UCX 1.13)"),
        Ok(r) => println!("the receive ended after the kill: {r:?}"),
    }
    match after_kill {
        Ok(ended) => assert!(
            ended.expect("task").is_err(),
            "a killed sender's run succeeded"
        ),
        Err(_) => cancel_landing("revoked after the kill", &cancel, landing).await,
    }
    let landed = dst.read(0, SIZE).expect("read");
    assert!(
        landed.iter().all(|&b| b == 0xEE || b == 0xC7),
        "foreign bytes in the destination"
    );
    bounded("shutdown with a revoked receive", 30, w.shutdown()).await;
}

// ---------------------------------------------------------------------------------------------
// Put

/// `registered` (a peer's registration) as a remote region of `a`'s endpoint `ab`.
async fn remote_of(
    a: &UcxWorker,
    ab: EndpointId,
    registered: &kvferry::transport::ucx::Registered,
) -> Result<kvferry::transport::ucx::RemoteRegionId, UcxError> {
    a.add_remote_region(
        ab,
        registered.base,
        registered.size,
        registered.rkey.clone(),
    )
    .await
}

async fn put_64_mib(tls: Tls) {
    const SIZE: usize = 64 * MIB;
    // Without RMA (the default, and every decode's worker) a peer's key is refused before UCX
    // sees it: no one-sided write can start.
    let (a, b, ab, _ba) = pair(tls).await;
    assert!(!a.has_rma());
    let region = Arc::new(Region::new(MIB).expect("region"));
    let registered = b.register(region.clone()).await.expect("register");
    let refused = remote_of(&a, ab, &registered).await;
    assert!(matches!(refused, Err(UcxError::NoRma)), "{refused:?}");
    a.shutdown().await;
    b.shutdown().await;

    // With RMA on both workers (two workers of this test: they trust each other).
    let (a, b, ab, _ba) = pair_of(tls.config().rma(true)).await;
    assert!(a.has_rma());
    let region = Arc::new(Region::new(SIZE).expect("region"));
    region.fill(0xDE);
    let registered = b.register(region.clone()).await.expect("register");
    assert_eq!(registered.size, SIZE as u64);
    let remote = remote_of(&a, ab, &registered)
        .await
        .expect("unpack the remote key");
    let source = Bytes::from(Rng(seed()).bytes(SIZE));
    let t = Instant::now();
    let mut puts = tokio::task::JoinSet::new();
    for piece in 0..SIZE / MIB {
        let (a, data) = (a.clone(), source.slice(piece * MIB..(piece + 1) * MIB));
        puts.spawn(async move { a.put(remote, (piece * MIB) as u64, data).await });
    }
    while let Some(done) = bounded("puts", 120, puts.join_next()).await {
        done.expect("put task").expect("put");
    }
    bounded("flush", 120, a.flush(ab)).await.expect("flush");
    let secs = t.elapsed().as_secs_f64();
    println!(
        "{}: put 64 MiB in 1 MiB pieces + flush in {secs:.3} s ({:.2} GB/s)",
        tls.name(),
        SIZE as f64 / secs / 1e9
    );
    same_bytes(
        "remote region",
        &region.read(0, SIZE).expect("read"),
        &source,
    );
    // Writes outside what the peer registered are refused before reaching UCX.
    let past = a
        .put(remote, (SIZE - 10) as u64, Bytes::from_static(&[0u8; 11]))
        .await;
    assert!(
        matches!(past, Err(UcxError::OutOfBounds { .. })),
        "{past:?}"
    );
    b.unregister(registered.id).await.expect("unregister");
    assert!(matches!(
        b.unregister(registered.id).await,
        Err(UcxError::Unknown { .. })
    ));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_64_mib_tcp() {
    put_64_mib(Tls::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_64_mib_shm() {
    put_64_mib(Tls::Shm).await;
}

// ---------------------------------------------------------------------------------------------
// Dead peers

fn assert_peer_failed(what: &str, result: Result<impl std::fmt::Debug, UcxError>) {
    match result {
        Err(e) if e.is_peer_failure() => println!("{what}: {e}"),
        other => panic!("{what}: expected a peer failure, got {other:?}"),
    }
}

/// Worker b (same process, tcp) is shut down while a streams to it: a's pending send and its
/// receive from b fail with PeerFailed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_worker_fails_pending_operations_tcp() {
    let (a, b, ab, _ba) = pair(Tls::Tcp).await;
    let payload = Bytes::from(vec![0x5Au8; 4 * MIB]);
    for i in 0..4u64 {
        let (sent, got) = tokio::join!(
            a.send_tag(ab, i, payload.clone()),
            b.recv_tag(i, ALL, 4 * MIB)
        );
        sent.expect("send before the drop");
        assert_eq!(got.expect("recv before the drop").data.len(), 4 * MIB);
    }
    // A receive from b and a send that b never receives are pending when b goes.
    let recv = tokio::spawn({
        let a = a.clone();
        async move { a.recv_tag_from(ab, 99, ALL, 1024).await }
    });
    let send = tokio::spawn({
        let a = a.clone();
        let payload = payload.clone();
        async move { a.send_tag(ab, 100, payload).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    b.shutdown().await;
    drop(b);
    let send = bounded("pending send", 30, send).await.expect("task");
    println!("send failed after {:.3} s", t.elapsed().as_secs_f64());
    assert_peer_failed("pending send", send);
    let recv = bounded("pending recv", 30, recv).await.expect("task");
    println!("recv failed after {:.3} s", t.elapsed().as_secs_f64());
    assert_peer_failed("pending recv", recv);
    // Later operations on the dead endpoint fail at once.
    assert_peer_failed(
        "later send",
        bounded("later send", 5, a.send_tag(ab, 1, Bytes::from_static(b"x"))).await,
    );
    a.shutdown().await;
}

const CHILD_ENV: &str = "KVFERRY_UCX_CHILD_TLS";

/// Not a test of its own: the peer process of `killed_peer_process_*` and
/// `a_run_whose_sender_is_killed_mid_message_is_revoked`, started by them with
/// `KVFERRY_UCX_CHILD_TLS` set. It prints its address, reads the parent's, connects and sends
/// 1 MiB messages (tag 7) until it is killed, or with `KVFERRY_UCX_CHILD_RUN` one placed run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process of the killed-peer tests"]
async fn ucx_child_peer() {
    let tls = match std::env::var(CHILD_ENV).as_deref() {
        Ok("tcp") => Tls::Tcp,
        Ok("tcp-eager") => Tls::TcpEager,
        Ok("shm") => Tls::Shm,
        _ => return,
    };
    let w = UcxWorker::spawn(tls.config()).await.expect("child worker");
    println!("UCX-ADDRESS {}", hex(&w.address()));
    std::io::stdout().flush().ok();
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .expect("parent address");
    let parent = unhex(line.trim());
    let ep = w
        .connect(Bytes::from(parent))
        .await
        .expect("connect to parent");
    if let Some(size) = std::env::var(CHILD_RUN_ENV)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let src = Arc::new(Region::new(size).expect("run"));
        src.fill(0xC7);
        let run = vec![Span {
            offset: 0,
            len: size as u64,
        }];
        let _ = w.send_runs(ep, 9, src, run).await;
        std::future::pending::<()>().await;
    }
    let data = Bytes::from(vec![0xC7u8; MIB]);
    loop {
        if w.send_tag(ep, 7, data.clone()).await.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Starts the helper process (`ucx_child_peer`; a run of `run` bytes if given) and reads its
/// worker address. It connects once the parent writes its own address to its stdin.
async fn child_peer(tls: Tls, run: Option<usize>) -> (Reaper, Vec<u8>) {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args([
            "ucx_layer::ucx_child_peer",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .args(["--test-threads=1"])
        .env(CHILD_ENV, tls.name())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(size) = run {
        command.env(CHILD_RUN_ENV, size.to_string());
    }
    let mut child = Reaper(command.spawn().expect("spawn the child peer"));
    let stdout = child.0.stdout.take().expect("child stdout");
    let address = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.split_once("UCX-ADDRESS ").map(|(_, a)| unhex(a.trim())))
    });
    let address = bounded("child address", 60, address)
        .await
        .expect("reader task")
        .expect("the child printed no address");
    (child, address)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

/// Kills the child when dropped (a failing test never leaves it running).
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn killed_peer_process(tls: Tls) {
    let (mut child, address) = child_peer(tls, None).await;
    let w = UcxWorker::spawn(tls.config()).await.expect("parent worker");
    let ep = w.connect(Bytes::from(address)).await.expect("connect");
    let mut stdin = child.0.stdin.take().expect("child stdin");
    writeln!(stdin, "{}", hex(&w.address())).expect("send our address");
    for i in 0..20 {
        let got = bounded(
            "message from the child",
            60,
            w.recv_tag_from(ep, 7, ALL, MIB),
        )
        .await
        .unwrap_or_else(|e| panic!("message {i}: {e}"));
        assert!(got.data.iter().all(|&b| b == 0xC7));
    }
    let supervised = w.is_supervised(ep).await.expect("endpoint");
    child.0.kill().expect("kill the child");
    let t = Instant::now();
    if !supervised {
        // UCX 1.13's shared-memory transports cannot detect a dead peer (no PEER error
        // mode): the agents learn it from their control-plane heartbeat and report it. Here
        // the child's exit stands in for the missed heartbeat.
        println!(
            "{}: unsupervised endpoint; reporting the death as a heartbeat would",
            tls.name()
        );
        child.0.wait().expect("reap the child");
        w.fail_endpoint(ep).await.expect("fail the endpoint");
    }
    // Messages already in flight may still arrive; then the receive must fail.
    let recv = bounded("receives from the dead child", 30, async {
        loop {
            match w.recv_tag_from(ep, 7, ALL, MIB).await {
                Ok(_) => continue,
                Err(e) => return Err::<(), _>(e),
            }
        }
    })
    .await;
    println!(
        "{}: receive from the killed child failed after {:.3} s",
        tls.name(),
        t.elapsed().as_secs_f64()
    );
    assert_peer_failed("receive from the killed child", recv);
    let send = bounded(
        "send to the dead child",
        30,
        w.send_tag(ep, 1, Bytes::from(vec![1u8; MIB])),
    )
    .await;
    assert_peer_failed("send to the killed child", send);
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_process_tcp() {
    killed_peer_process(Tls::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_peer_process_shm() {
    killed_peer_process(Tls::Shm).await;
}

#[tokio::test]
async fn a_config_ucx_refuses_is_a_typed_error() {
    // UCX only warns about unknown names (it keeps them for its transports), but refuses
    // values it cannot parse.
    let refused = UcxWorker::spawn(UcxConfig::new().var("RNDV_THRESH", "not-a-size")).await;
    match refused {
        Err(UcxError::Config { name, .. }) => assert_eq!(name, "RNDV_THRESH"),
        other => panic!("expected a config error, got {other:?}"),
    }
    let no_device = UcxWorker::spawn(
        UcxConfig::new()
            .var("TLS", "tcp")
            .var("NET_DEVICES", "kvferry-no-such-device"),
    )
    .await;
    match no_device {
        Err(e) => println!("no device: {e}"),
        Ok(_) => panic!("a worker without any usable device"),
    }
}

/// The eager end of `tag_send` in an endpoint's description (`ucp_ep_print_info`):
/// `tag_send: 0..<egr/short>..8185..<egr/zcopy>..(inf)` gives 8185.
fn eager_short_end(info: &str) -> Option<u64> {
    if let Some(line) = info.lines().find(|l| l.contains(" tag_send:")) {
        let after = line.split("<egr/short>..").nth(1)?;
        return after.split("..").next()?.trim().parse().ok();
    }
    // UCX 1.22 describes its protocols as tables, a row per range: `|   0..1048568 | eager
    // short | tcp/lo |`; the widest eager short range of any tagged send.
    info.lines()
        .filter(|l| l.contains("| eager short "))
        .filter_map(|l| l.split('|').nth(1)?.trim().split("..").nth(1)?.parse().ok())
        .max()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_tcp_workers_get_the_segments_they_ask_for() {
    let described = |config: UcxConfig| async move {
        let a = UcxWorker::spawn(config).await.expect("worker");
        let b = UcxWorker::spawn(Tls::Tcp.config()).await.expect("peer");
        let ep = a.connect(b.address()).await.expect("connect");
        let info = a.describe(ep).await.expect("describe");
        // Stopped and waited for: a progress thread still tearing UCX down while the process
        // exits corrupts the heap UCX's exit handlers free.
        a.shutdown().await;
        b.shutdown().await;
        eager_short_end(&info).unwrap_or_else(|| panic!("no tag_send line in:\n{info}"))
    };
    // What the agents set for tcp-only UCX, with an environment that sets nothing.
    let segments = described(Tls::TcpEager.config()).await;
    println!("eager tcp worker: inline sends up to {segments} bytes");
    assert!(
        segments >= 1 << 19,
        "the agents' segments did not take: UCX still sends {segments}-byte segments"
    );
    // Why the agents name the setting as they do: UCX 1.13 accepts the environment's name
    // through ucp_config_modify and ignores it; UCX 1.22 refuses the field's own name.
    match kvferry::transport::ucx::version::family() {
        Family::V1_13 => {
            let prefixed = described(Tls::Tcp.config().var("TCP_TX_SEG_SIZE", "1m")).await;
            println!("TCP_TX_SEG_SIZE=1m through ucp_config_modify: {prefixed} bytes");
            assert!(
                prefixed < 1 << 16,
                "UCX now applies TCP_TX_SEG_SIZE: {prefixed}"
            );
        }
        Family::V1_22 => {
            let bare = UcxWorker::spawn(Tls::Tcp.config().var("TX_SEG_SIZE", "1m")).await;
            let e = bare.expect_err("UCX 1.22 took TX_SEG_SIZE");
            println!("TX_SEG_SIZE=1m through ucp_config_modify: {e}");
            assert!(e.to_string().contains("Invalid parameter"), "{e}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory types: what this libucx moves, found at run time

/// A host region that claims to be CUDA memory: what a worker whose context moves no CUDA
/// memory must refuse before UCX sees the pointer. Never handed to a worker that moves CUDA
/// memory (UCX would treat host memory as device memory).
struct ClaimsCuda(Region);

// SAFETY: the region's mapping is fixed until drop and never referenced (Region's contract);
// the claim is refused before UCX reads or writes it (the test checks that).
#[allow(unsafe_code)]
unsafe impl RegisterableMemory for ClaimsCuda {
    fn base(&self) -> *mut u8 {
        self.0.base()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn memory_type(&self) -> MemoryType {
        MemoryType::Cuda
    }
}

/// Whether this run expects a libucx built with CUDA (`KVFERRY_UCX_CUDA=1`, set with UCX 1.22
/// first on the library path and a CUDA driver, the emulator's included: docs/gpu.md);
/// Debian's libucx-dev 1.13 has none.
fn ucx_with_cuda() -> bool {
    std::env::var("KVFERRY_UCX_CUDA").as_deref() == Ok("1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_says_whether_ucx_moves_cuda_memory() {
    // UCX's own choice of transports, networks on loopback only: with `UCX_TLS=tcp` a UCX
    // built with CUDA reports host memory only (its cuda_copy transport is left out).
    let worker = UcxWorker::spawn(UcxConfig::new().var("NET_DEVICES", "lo"))
        .await
        .expect("worker");
    let types = worker.memory_types();
    println!(
        "UCX {:?}: memory types {:#x}",
        kvferry::transport::ucx::result::version(),
        types.0
    );
    assert!(types.has(MemoryType::Host), "{types:?}");
    assert_eq!(
        worker.sends_device_memory(),
        ucx_with_cuda(),
        "memory types {types:?}: Debian's libucx has no CUDA (KVFERRY_UCX_CUDA=1 says this one has)"
    );
    // The transport says it the same way, with the reason the agent logs.
    let data = kvferry::transport::ucx::data::UcxData::new(MIB, "127.0.0.1", false);
    let said = bounded("device_memory", 30, data.device_memory())
        .await
        .expect("device_memory");
    match (said, ucx_with_cuda()) {
        (DeviceMemory::Sends, true) => {}
        (DeviceMemory::HostOnly(reason), false) => assert!(
            reason.contains("UCX has no CUDA memory support"),
            "{reason}"
        ),
        (said, cuda) => panic!("the transport says {said:?}, KVFERRY_UCX_CUDA=1 is {cuda}"),
    }
    // ZeroMQ sends host memory, always.
    let zmq = kvferry::transport::for_kind(
        kvferry::transport::TransportKind::ZmqTcp,
        MIB,
        &kvferry::transport::zmq::Auth::default(),
        "127.0.0.1",
        false,
    );
    assert_eq!(
        zmq.device_memory().await.expect("zmq"),
        DeviceMemory::HostOnly("zmq-tcp sends host memory only".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_is_refused_typed_where_ucx_has_no_cuda() {
    let (a, b, ab, _) = pair(Tls::Tcp).await;
    if a.sends_device_memory() {
        assert!(ucx_with_cuda(), "this libucx moves CUDA memory");
        println!(
            "skipped: this libucx moves CUDA memory; a host region claiming CUDA would be read as device memory"
        );
        return;
    }
    let claims: Arc<dyn RegisterableMemory> = Arc::new(ClaimsCuda(Region::new(MIB).unwrap()));
    let refused = |e: UcxError, op: &str| match e {
        UcxError::MemoryType {
            op: got,
            memory: MemoryType::Cuda,
            ..
        } => assert_eq!(got, op),
        other => panic!("{op}: {other:?}"),
    };
    refused(a.register(claims.clone()).await.unwrap_err(), "register");
    let one = vec![Span {
        offset: 0,
        len: 4096,
    }];
    let sent = bounded(
        "send_runs",
        10,
        a.send_runs(ab, 0x44, claims.clone(), one.clone()),
    )
    .await;
    refused(sent.unwrap_err(), "send_run");
    let cancel = CancellationToken::new();
    let posted = bounded(
        "recv_runs",
        10,
        b.recv_runs(0x44, claims.clone(), vec![one.clone()], cancel),
    )
    .await;
    match posted {
        Ok(_) => panic!("receives into claimed CUDA memory were posted"),
        Err(e) => refused(e, "recv_run"),
    }
    let from = a.send_tag_from(ab, 0x45, Bytes::from_static(b"prefix"), claims, one);
    refused(
        bounded("send_tag_from", 10, from).await.unwrap_err(),
        "send_tag",
    );
    // The worker serves on: a host message still goes through.
    let got = b.post_recv_tag(0x46, ALL, 64);
    bounded(
        "send",
        10,
        a.send_tag(ab, 0x46, Bytes::from_static(b"still here")),
    )
    .await
    .expect("send");
    assert_eq!(
        &bounded("recv", 10, got).await.expect("recv").data[..],
        b"still here"
    );
}

/// Receive buffers of the test's own, as a decode's pinned buffers are lent to the transport:
/// counts what is lent and what came back.
#[derive(Default)]
struct Lent {
    out: std::sync::Mutex<Vec<usize>>,
    back: std::sync::Mutex<Vec<usize>>,
}

struct Back(Vec<u8>, Arc<Lent>);

impl AsRef<[u8]> for Back {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Back {
    fn drop(&mut self) {
        self.1.back.lock().unwrap().push(self.0.as_ptr() as usize);
    }
}

impl RecvBuffers for Lent {
    fn take(&self, len: usize) -> Vec<u8> {
        let buf = vec![0xDE; len];
        self.out.lock().unwrap().push(buf.as_ptr() as usize);
        buf
    }
    fn freeze(self: Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Back(buf, self))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_land_in_the_receivers_own_buffers_and_go_back_to_it() {
    use kvferry::transport::{Frame, Transport};
    let data = kvferry::transport::ucx::data::UcxData::new(MIB, "127.0.0.1", false);
    let (endpoint, mut receiver) = bounded(
        "listen",
        30,
        data.listen("127.0.0.1", 0, std::sync::Arc::new(|_: &[u8]| true)),
    )
    .await
    .expect("listen");
    let lent = Arc::new(Lent::default());
    assert!(
        receiver.receive_into(lent.clone()),
        "UCX takes the agent's buffers"
    );
    let mut sender = bounded(
        "connect",
        30,
        data.connect(&endpoint, Duration::from_secs(10), Default::default()),
    )
    .await
    .expect("connect");
    let payload = vec![0x5A; 100_000];
    let mut buf = vec![0; kvferry::transport::FRAME_ROOM];
    buf.extend_from_slice(&payload);
    let frame = Frame::in_place(b"header", buf, Bytes::from).expect("frame");
    let received = receiver.recv();
    let sent = sender.send(frame);
    let (received, sent) = tokio::join!(bounded("recv", 30, received), sent);
    sent.expect("send");
    let (header, got) = received.expect("recv");
    assert_eq!(&header[..], b"header");
    same_bytes("payload", &got, &payload);
    let out = lent.out.lock().unwrap().clone();
    let at = got.as_ptr() as usize;
    assert!(
        out.iter().any(|&b| at > b && at < b + MIB + 8192),
        "the payload landed in a lent buffer"
    );
    drop((header, got));
    assert_eq!(lent.back.lock().unwrap().len(), 1, "the buffer went back");
    drop(receiver);
}

// ---------------------------------------------------------------------------------------------
// Messages that come before their receive

/// A message under the receiver's own prefix that comes before its receive (a device payload
/// ahead of its header, a chunk beyond the receives posted) is taken off UCX's queue and held
/// (`Unexpected::parked`), and the receive posted for its tag afterwards still gets it, every
/// byte. The sender's next message,
/// to a receive posted before, comes after it on the same endpoint: once that one landed, the
/// first had arrived and was held, before the late receive was posted.
async fn a_message_ahead_of_its_receive_still_lands(tls: Tls) {
    const PREFIX: u64 = 0x8123_4567;
    let config = tls
        .config()
        .unexpected(kvferry::transport::ucx::Unexpected {
            keep: PREFIX as u32,
            late: 0x50,
            parked: !0,
            max_len: MIB,
        });
    let (a, b, ab, _ba) = pair_of(config).await;
    let mut rng = Rng(seed());
    let payload = Bytes::from(rng.bytes(4096));
    let ahead = PREFIX << 32 | 0x1234;
    let marker = b.post_recv_tag(PREFIX << 32 | 1, u64::MAX, 64);
    b.ping().await.expect("the marker's receive posted");
    let sent = a.send_tag(ab, ahead, payload.clone());
    // And one no receive was posted for yet, under a chunk's tag.
    let beyond = a.send_tag(ab, PREFIX << 32 | 2, Bytes::from_static(b"beyond"));
    a.send_tag(ab, PREFIX << 32 | 1, Bytes::from_static(b"after"))
        .await
        .expect("the marker sent");
    let got = bounded("the marker", 30, marker).await.expect("the marker");
    assert_eq!(&got.data[..], b"after");
    let dst = Arc::new(Region::new(2 * 4096).expect("destination"));
    dst.fill(0xEE);
    let cancel = CancellationToken::new();
    let run = vec![vec![Span {
        offset: 4096,
        len: 4096,
    }]];
    let landing = b
        .recv_runs(ahead, dst.clone(), run, cancel)
        .await
        .expect("post the late receive");
    bounded("the message held for its receive", 30, landing)
        .await
        .expect("landed");
    bounded("the send", 30, sent).await.expect("sent");
    let all = dst.read(0, 2 * 4096).expect("read");
    assert!(
        all[..4096].iter().all(|&x| x == 0xEE),
        "bytes before the run"
    );
    same_bytes("the held message", &all[4096..], &payload);
    let late = b.recv_tag(PREFIX << 32 | 2, u64::MAX, 64);
    let late = bounded("the other held message", 30, late).await;
    assert_eq!(&late.expect("received").data[..], b"beyond");
    bounded("the other send", 30, beyond).await.expect("sent");
    println!(
        "{}: a message ahead of its receive was held and landed",
        tls.name()
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_ahead_of_its_receive_still_lands_tcp() {
    a_message_ahead_of_its_receive_still_lands(Tls::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_ahead_of_its_receive_still_lands_shm() {
    a_message_ahead_of_its_receive_still_lands(Tls::Shm).await;
}
