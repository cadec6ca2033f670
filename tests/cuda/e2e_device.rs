//! Sidecar agents on device pools. The test process is the engine: it allocates a prefill and a
//! decode pool in device memory, exports each by CUDA IPC handle, and starts a prefill and a
//! decode agent (`--pool cuda-ipc:0:<handle>`) that open them. Synthetic rooms move between
//! the pools through the transfer kernel on both sides (a gather on the device, one D2H, the
//! wire, one H2D, a scatter). The engine then reads both pools back with `cuMemcpyDtoH`: every
//! byte of a room's decode pages must be the prefill's, every other byte the poison it wrote.
//! Over UCX too, where the agents stage as UCX allows (pinned host memory with Debian's
//! libucx, which has no CUDA) and say so; `--staging device` where the transport cannot send
//! device memory is refused at start.
//!
//! Needs a CUDA driver and NVRTC. scripts/test runs it on the CUDA driver emulator (emu/cuda,
//! docs/gpu.md) with KVFERRY_REQUIRE_GPU=1, where a skip is a failure; without either it says
//! which is missing and passes.
#![allow(unsafe_code)]

use crate::common;
use crate::driver;

use std::ffi::c_void;

use common::*;
use driver::*;
use kvferry::layout::{KvLayout, ModelSpec};
use serde_json::json;

const PAGES: usize = 64;
const POISON: u8 = 0xDE;
const TOKENS: usize = 64;

/// Whether a CUDA driver and NVRTC are there; without them, a panic if KVFERRY_REQUIRE_GPU=1.
fn gpu_or_skip() -> bool {
    let driver = kvferry::kernel::cuda::driver_present();
    let nvrtc = kvferry::kernel::cuda::nvrtc_present();
    if driver && nvrtc {
        return true;
    }
    let why = format!("CUDA driver loadable: {driver}, NVRTC loadable: {nvrtc}");
    assert!(
        std::env::var("KVFERRY_REQUIRE_GPU").as_deref() != Ok("1"),
        "KVFERRY_REQUIRE_GPU=1 but {why}"
    );
    println!("skipped: {why}");
    false
}

/// This process as an engine: device 0's context and its allocations.
struct Engine(Driver);

impl Engine {
    fn new() -> Engine {
        let d = Driver::system();
        d.ready();
        Engine(d)
    }

    fn alloc(&self, len: usize) -> u64 {
        let alloc: Alloc = self.0.f("cuMemAlloc_v2");
        let mut p = 0;
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { alloc(&mut p, len) }, SUCCESS, "cuMemAlloc");
        p
    }

    fn fill(&self, addr: u64, byte: u8, len: usize) {
        let memset: unsafe extern "C" fn(u64, u8, usize) -> R = self.0.f("cuMemsetD8_v2");
        let sync: unsafe extern "C" fn() -> R = self.0.f("cuCtxSynchronize");
        // SAFETY: `len` bytes of an allocation of ours.
        unsafe {
            assert_eq!(memset(addr, byte, len), SUCCESS, "cuMemsetD8");
            assert_eq!(sync(), SUCCESS);
        }
    }

    fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let dtoh: DtoH = self.0.f("cuMemcpyDtoH_v2");
        let mut out = vec![0u8; len];
        // SAFETY: `out` holds `len` bytes; the copy is synchronous.
        let copied = unsafe { dtoh(out.as_mut_ptr().cast::<c_void>(), addr, len) };
        assert_eq!(copied, SUCCESS, "cuMemcpyDtoH");
        out
    }

    /// Whether device 0 is the CUDA driver emulator's.
    fn on_emulator(&self) -> bool {
        let name: unsafe extern "C" fn(*mut u8, i32, i32) -> R = self.0.f("cuDeviceGetName");
        let mut buf = [0u8; 128];
        // SAFETY: a buffer of the length given.
        assert_eq!(unsafe { name(buf.as_mut_ptr(), 128, 0) }, SUCCESS);
        String::from_utf8_lossy(&buf).contains("emulator")
    }

    /// The `--pool` value naming the allocation at `addr` by CUDA IPC handle.
    fn pool_flag(&self, addr: u64) -> String {
        let get: unsafe extern "C" fn(*mut [u8; 64], u64) -> R = self.0.f("cuIpcGetMemHandle");
        let mut handle = [0u8; 64];
        // SAFETY: a 64-byte out buffer.
        assert_eq!(
            unsafe { get(&mut handle, addr) },
            SUCCESS,
            "cuIpcGetMemHandle"
        );
        let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
        format!("cuda-ipc:0:{hex}")
    }
}

/// A registry and sidecar agents on device pools of this engine: each agent's extra flags
/// (role first) get `--pool` naming its own allocation of `bytes`, filled with `fill`.
struct DeviceCluster {
    agents: Vec<Process>,
    pools: Vec<u64>,
    _registry: Process,
}

impl DeviceCluster {
    fn start(
        engine: &Engine,
        tag: &str,
        opts: &AgentOpts,
        agents: &[(&[&str], usize, u8)],
    ) -> Self {
        let exe = release_binary();
        let logs = kvferry::cluster::log_dir(tag).expect("log dir");
        let args = owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]);
        let registry = common::spawn(&exe, &[], "registry", &args, &[], &logs);
        let url = registry.field("url").unwrap();
        let mut pools = Vec::new();
        let started = agents
            .iter()
            .enumerate()
            .map(|(i, (extra, bytes, fill))| {
                let pool = engine.alloc(*bytes);
                engine.fill(pool, *fill, *bytes);
                pools.push(pool);
                let mut args = owned(&[extra[0], "--bootstrap", &url]);
                args.extend(opts.args());
                args.extend(owned(&extra[1..]));
                args.extend(["--pool".to_owned(), engine.pool_flag(pool)]);
                common::spawn(&exe, &[], &format!("{}-{i}", extra[0]), &args, &[], &logs)
            })
            .collect();
        DeviceCluster {
            agents: started,
            pools,
            _registry: registry,
        }
    }

    fn api(&self, i: usize) -> String {
        self.agents[i].field("api").unwrap()
    }
}

/// Asks the decode at `decode` for each room on its pages and announces it at every prefill.
async fn ask_and_announce(decode: &str, prefills: &[String], rooms: &[(u64, Vec<u32>)]) {
    let http = http();
    for (room, pages) in rooms {
        let ask = json!({ "tokens": TOKENS, "pages": pages });
        let url = format!("{decode}/v1/rooms/{room}");
        expect(
            &http,
            reqwest::Method::POST,
            &url,
            Some(&ask),
            reqwest::StatusCode::CREATED,
        )
        .await;
        for prefill in prefills {
            let url = format!("{prefill}/v1/rooms/{room}/ready");
            let ready = json!({ "tokens": TOKENS });
            expect(
                &http,
                reqwest::Method::POST,
                &url,
                Some(&ready),
                reqwest::StatusCode::ACCEPTED,
            )
            .await;
        }
    }
}

/// Asserts every block of `pool` (`pool_pages` of `layout`) outside `pages` still holds the
/// poison; returns
/// the bytes checked.
fn untouched_outside(pool: &[u8], layout: &KvLayout, pool_pages: usize, pages: &[u32]) -> usize {
    let (stride, block) = (layout.page_stride().unwrap(), layout.block_bytes().unwrap());
    let mut checked = 0;
    for layer in 0..layout.num_layers() {
        for plane in 0..layout.planes() {
            let plane_at = layout.plane_offset(layer, plane, pool_pages).unwrap();
            for page in (0..pool_pages).filter(|p| !pages.contains(&(*p as u32))) {
                let got = &pool[plane_at + page * stride..][..block];
                assert!(
                    got.iter().all(|&b| b == POISON),
                    "layer {layer} plane {plane}: page {page} is outside every room but changed"
                );
                checked += block;
            }
        }
    }
    checked
}

#[test]
fn tp2_prefill_ranks_send_into_one_decode_device_pool() {
    if !gpu_or_skip() {
        return;
    }
    let engine = Engine::new();
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let bytes = layout.pool_bytes(PAGES).unwrap();
    let opts = AgentOpts {
        pool_pages: PAGES,
        ..AgentOpts::default()
    };
    // Each prefill rank holds half the heads: its allocation is larger than its pool needs.
    let c = DeviceCluster::start(
        &engine,
        "device-tp2",
        &opts,
        &[
            (&["prefill", "--tp-size", "2", "--tp-rank", "0"], bytes, 0),
            (&["prefill", "--tp-size", "2", "--tp-rank", "1"], bytes, 0),
            (&["decode"], bytes, POISON),
        ],
    );
    let rooms = vec![(21, vec![7, 3, 50, 12]), (22, vec![60, 61, 62, 63])];
    runtime().block_on(async {
        ask_and_announce(&c.api(2), &[c.api(0), c.api(1)], &rooms).await;
        // The decode checks every landed byte against the pattern, which encodes the global
        // head and layer: a head slice in the wrong place fails it.
        for (room, _) in &rooms {
            take_verified(&http(), &c.api(2), *room).await;
        }
    });
    let all: Vec<u32> = rooms.iter().flat_map(|(_, p)| p.clone()).collect();
    let checked = untouched_outside(&engine.read(c.pools[2], bytes), &layout, PAGES, &all);
    println!("TP2 -> TP1 on device pools: rooms verified, {checked} bytes outside them unchanged");
}

#[test]
fn a_prefill_killed_mid_transfer_fails_the_room_and_nothing_lands_after() {
    if !gpu_or_skip() {
        return;
    }
    let engine = Engine::new();
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let bytes = layout.pool_bytes(PAGES).unwrap();
    // Only the room's first half is announced: the kill comes mid-room. Only a closed
    // connection can end the room within the test's bounds.
    let opts = AgentOpts {
        pool_pages: PAGES,
        peer_dead_ms: 60_000,
        ..AgentOpts::default()
    };
    let c = DeviceCluster::start(
        &engine,
        "device-kill",
        &opts,
        &[(&["prefill"], bytes, 0), (&["decode"], bytes, POISON)],
    );
    let pages = vec![4, 9, 33, 20];
    let decode = c.api(1);
    runtime().block_on(async {
        let http = http();
        request(
            &http,
            &decode,
            31,
            json!({ "tokens": TOKENS, "pages": pages }),
        )
        .await;
        ready_piece(&http, &c.api(0), 31, TOKENS, 0..TOKENS / 2, false).await;
        wait_state(&http, &decode, 31, &["transferring"], BOUND).await;
        c.agents[0].signal("KILL").unwrap();
        let killed = std::time::Instant::now();
        let v = wait_final(&http, &decode, 31).await;
        assert_eq!(
            (v["state"].as_str(), v["reason"]["code"].as_str()),
            (Some("failed"), Some("peer_dead")),
            "{v}"
        );
        println!(
            "killed mid-transfer: peer_dead after {:.0} ms",
            ms(killed.elapsed())
        );
        wait_safe(&http, &decode, 31).await;
        let at_failure = engine.read(c.pools[1], bytes);
        let checked = untouched_outside(&at_failure, &layout, PAGES, &pages);
        // The room is given up; the decode pool must not change any more.
        let url = format!("{decode}/v1/rooms/31/take");
        let (_, taken) = call(&http, reqwest::Method::POST, &url, None).await;
        assert_eq!(taken["state"], "failed", "{taken}");
        healthy(&http, &decode).await;
        let later = engine.read(c.pools[1], bytes);
        assert!(
            later == at_failure,
            "the decode pool changed after the room failed"
        );
        println!("{checked} bytes outside the room unchanged; nothing landed after the failure");
    });
}

/// One prefill and one decode sidecar on two pools of `PAGES` tiny pages this test's engine
/// allocated (the prefill's zeroed, the decode's poison), opened by CUDA IPC handle.
struct IpcPools {
    engine: Engine,
    layout: KvLayout,
    bytes: usize,
    prefill_pool: u64,
    decode_pool: u64,
    c: FaultCluster,
}

impl IpcPools {
    fn start(tag: &str, opts: AgentOpts, env: &Env) -> IpcPools {
        let engine = Engine::new();
        let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
        let bytes = layout.pool_bytes(PAGES).unwrap();
        let (prefill_pool, decode_pool) = (engine.alloc(bytes), engine.alloc(bytes));
        engine.fill(prefill_pool, 0, bytes);
        engine.fill(decode_pool, POISON, bytes);
        let opts = AgentOpts {
            pool_pages: PAGES,
            ..opts
        };
        let (prefill_flag, decode_flag) = (
            engine.pool_flag(prefill_pool),
            engine.pool_flag(decode_pool),
        );
        let c = FaultCluster::start_env(
            tag,
            &opts.args(),
            &["--pool", &prefill_flag],
            &["--pool", &decode_flag],
            &[],
            env,
        );
        IpcPools {
            engine,
            layout,
            bytes,
            prefill_pool,
            decode_pool,
            c,
        }
    }
}

#[test]
fn sidecar_agents_move_rooms_between_device_pools_opened_by_ipc_handle() {
    if !gpu_or_skip() {
        return;
    }
    let IpcPools {
        engine,
        layout,
        bytes,
        prefill_pool,
        decode_pool,
        c,
    } = IpcPools::start(
        "device-ipc",
        AgentOpts {
            ..AgentOpts::default()
        },
        &[],
    );
    // (room, prefill pages, decode pages): four pages each, out of order and apart.
    let rooms: [(u64, [u32; 4], [u32; 4]); 3] = [
        (11, [0, 1, 2, 3], [10, 11, 12, 13]),
        (12, [20, 5, 40, 9], [30, 31, 32, 33]),
        (13, [63, 62, 61, 60], [5, 40, 2, 63]),
    ];
    runtime().block_on(async {
        let http = http();
        for (room, prefill_pages, decode_pages) in &rooms {
            let ask = json!({ "tokens": TOKENS, "pages": decode_pages });
            let url = format!("{}/v1/rooms/{room}", c.decode_api);
            expect(
                &http,
                reqwest::Method::POST,
                &url,
                Some(&ask),
                reqwest::StatusCode::CREATED,
            )
            .await;
            let ready = json!({ "tokens": TOKENS, "pages": prefill_pages });
            let url = format!("{}/v1/rooms/{room}/ready", c.prefill_api);
            expect(
                &http,
                reqwest::Method::POST,
                &url,
                Some(&ready),
                reqwest::StatusCode::ACCEPTED,
            )
            .await;
        }
        for (room, _, _) in &rooms {
            take_verified(&http, &c.decode_api, *room).await;
        }
    });
    // Every byte of the decode pool, block by block.
    let (src, dst) = (
        engine.read(prefill_pool, bytes),
        engine.read(decode_pool, bytes),
    );
    let (stride, block) = (layout.page_stride().unwrap(), layout.block_bytes().unwrap());
    let (mut landed, mut untouched) = (0, 0);
    for layer in 0..layout.num_layers() {
        for plane in 0..layout.planes() {
            let plane_at = layout.plane_offset(layer, plane, PAGES).unwrap();
            for page in 0..PAGES {
                let at = plane_at + page * stride;
                let got = &dst[at..at + block];
                let from = rooms.iter().find_map(|(_, p, d)| {
                    d.iter()
                        .position(|&x| x as usize == page)
                        .map(|i| p[i] as usize)
                });
                match from {
                    Some(source) => {
                        let want = &src[plane_at + source * stride..][..block];
                        assert!(
                            want.iter().any(|&b| b != 0),
                            "the prefill filled page {source}"
                        );
                        assert!(
                            got == want,
                            "layer {layer} plane {plane}: decode page {page} is not prefill page {source}"
                        );
                        landed += block;
                    }
                    None => {
                        assert!(
                            got.iter().all(|&b| b == POISON),
                            "layer {layer} plane {plane}: page {page} is outside every room but changed"
                        );
                        untouched += block;
                    }
                }
            }
        }
    }
    println!("{landed} bytes landed in the rooms' pages, {untouched} bytes outside them unchanged");
    assert_eq!(
        landed,
        3 * 4 * layout.num_layers() * layout.planes() * block
    );
    let log = std::fs::read_to_string(&c.decode.log).unwrap();
    assert!(
        log.contains("memory=\"device\" ordinal=0 staging=\"pinned_host\""),
        "the decode agent says its pool is device memory and how it stages:\n{log}"
    );
    // ZeroMQ: the decode receives into libzmq's own (pageable) buffers, and says so.
    assert!(
        log.contains("receive_buffers=\"transport\""),
        "the decode agent says where chunks land:\n{log}"
    );
    for (role, api) in [("prefill", &c.prefill_api), ("decode", &c.decode_api)] {
        let text = metrics_of(api);
        let info = format!(
            "kvferry_pool_info{{role=\"{role}\",memory=\"device\",staging=\"pinned_host\"}} 1"
        );
        assert!(
            text.contains(&info),
            "{role} /metrics lacks {info}:\n{text}"
        );
    }
    let pinned = pinned_bytes(&metrics_of(&c.prefill_api), "prefill");
    assert!(pinned > 0, "the prefill's chunk buffers are pinned");
}

/// `/metrics` of the agent at `api`.
fn metrics_of(api: &str) -> String {
    runtime().block_on(async {
        let url = format!("{api}/metrics");
        http().get(url).send().await.unwrap().text().await.unwrap()
    })
}

/// `kvferry_staging_pinned_bytes` of `role` in `text`.
fn pinned_bytes(text: &str, role: &str) -> u64 {
    let name = format!("kvferry_staging_pinned_bytes{{role=\"{role}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{role} /metrics lacks {name}:\n{text}"))
}

/// Environment variables added to an agent's.
type Env = [(&'static str, &'static str)];

/// UCX over tcp on loopback, as e2e_ucx runs it.
const UCX_TCP: [(&str, &str); 2] = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")];

/// The emulator names each IPC handle a process opens (a real driver ignores this).
const TRACE_IPC: (&str, &str) = ("KVFERRY_CUDA_EMU_TRACE", "ipc");

/// Whether this run has a UCX built with CUDA (`KVFERRY_UCX_CUDA=1`: UCX 1.22 first on the
/// library path, on a GPU or on the emulator; docs/gpu.md). Then the agents get the
/// environment's `UCX_*` settings (which must let UCX use its CUDA transports), else UCX over
/// tcp on loopback.
fn ucx_with_cuda() -> bool {
    std::env::var("KVFERRY_UCX_CUDA").as_deref() == Ok("1")
}

fn ucx_env() -> &'static Env {
    match ucx_with_cuda() {
        true => &[TRACE_IPC],
        false => &[UCX_TCP[0], UCX_TCP[1], TRACE_IPC],
    }
}

/// The line the emulator logs in `log` when that process opened an IPC handle of process
/// `exporter`.
fn opened_ipc_of(log: &str, exporter: u32) -> bool {
    log.contains(&format!("opened an IPC handle of process {exporter} "))
}

/// Device pools over UCX: here (Debian's libucx, no CUDA) both agents stage in pinned host
/// memory, say why, and the decode lands chunks in pinned buffers; with `KVFERRY_UCX_CUDA=1`
/// both stage on the device and the decode lands chunks in device staging. Every byte is
/// checked either way.
#[test]
fn device_pools_over_ucx_stage_where_ucx_can_send_from() {
    if !gpu_or_skip() {
        return;
    }
    let IpcPools {
        engine,
        layout,
        bytes,
        decode_pool,
        c,
        ..
    } = IpcPools::start(
        "device-ucx",
        AgentOpts {
            transport: "ucx",
            ..AgentOpts::default()
        },
        ucx_env(),
    );
    let rooms = vec![(41, vec![5, 17, 2, 40]), (42, vec![60, 61, 62, 63])];
    runtime().block_on(async {
        ask_and_announce(&c.decode_api, std::slice::from_ref(&c.prefill_api), &rooms).await;
        for (room, _) in &rooms {
            take_verified(&http(), &c.decode_api, *room).await;
        }
    });
    let all: Vec<u32> = rooms.iter().flat_map(|(_, p)| p.clone()).collect();
    let checked = untouched_outside(&engine.read(decode_pool, bytes), &layout, PAGES, &all);
    // Both agents say how they stage and why, none of their pins refused.
    let (staging, why, lands) = match ucx_with_cuda() {
        true => ("device", "ucx sends device memory", "device"),
        false => (
            "pinned_host",
            "UCX has no CUDA memory support",
            "pinned_host",
        ),
    };
    for (role, spawned, api) in [
        ("prefill", &c.prefill, &c.prefill_api),
        ("decode", &c.decode, &c.decode_api),
    ] {
        let log = std::fs::read_to_string(&spawned.log).unwrap();
        assert!(
            log.contains(&format!("staging=\"{staging}\" reason={why}")),
            "the {role} says how it stages and why:\n{log}"
        );
        assert!(
            !log.contains("stays pageable"),
            "the {role} pinned every buffer:\n{log}"
        );
        let text = metrics_of(api);
        let info = format!(
            "kvferry_pool_info{{role=\"{role}\",memory=\"device\",staging=\"{staging}\"}} 1"
        );
        assert!(
            text.contains(&info),
            "{role} /metrics lacks {info}:\n{text}"
        );
        // Device staging pins nothing; pinned host staging pins every buffer it uses.
        assert_eq!(
            pinned_bytes(&text, role) > 0,
            staging == "pinned_host",
            "the {role}'s pinned buffers"
        );
    }
    let log = std::fs::read_to_string(&c.decode.log).unwrap();
    assert!(
        log.contains(&format!("receive_buffers=\"{lands}\"")),
        "the decode says where chunks land:\n{log}"
    );
    // On the emulator (which names the engine's pool the decode opened), with UCX's CUDA
    // transports: cuda_ipc moved the payloads, mapping one agent's device staging in the
    // other (a payload that went through host bounce buffers over tcp would not).
    let prefill_log = std::fs::read_to_string(&c.prefill.log).unwrap();
    let emulated = opened_ipc_of(&log, std::process::id());
    let peer_mapped =
        opened_ipc_of(&log, c.prefill.pid()) || opened_ipc_of(&prefill_log, c.decode.pid());
    if emulated {
        assert_eq!(
            peer_mapped,
            ucx_with_cuda(),
            "an agent mapped its peer's device memory (cuda_ipc):\n{prefill_log}\n{log}"
        );
    }
    println!(
        "device pools over UCX: rooms verified, {checked} bytes outside them unchanged; cuda_ipc seen: {peer_mapped}"
    );
}

#[test]
fn forcing_device_staging_where_the_transport_cannot_send_device_memory_is_refused() {
    if !gpu_or_skip() {
        return;
    }
    let engine = Engine::new();
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let pool = engine.alloc(layout.pool_bytes(PAGES).unwrap());
    let mut cases: Vec<(&str, &Env, &str)> =
        vec![("zmq-tcp", &[], "zmq-tcp sends host memory only")];
    // A UCX with CUDA would start (the device path, in the test above).
    if !ucx_with_cuda() {
        cases.push(("ucx", &UCX_TCP, "UCX has no CUDA memory support"));
    }
    for (transport, env, why) in cases {
        let opts = AgentOpts {
            pool_pages: PAGES,
            transport,
            ..AgentOpts::default()
        };
        let out = std::process::Command::new(release_binary())
            .args(["decode", "--bootstrap", "http://127.0.0.1:9"])
            .args(opts.args())
            .args(["--staging", "device", "--pool", &engine.pool_flag(pool)])
            .envs(env.iter().copied())
            .output()
            .expect("running kvferry decode");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let refusal =
            format!("--staging device: the {transport} transport cannot send device memory: {why}");
        assert!(
            !out.status.success() && stderr.contains(&refusal),
            "{transport}: {:?}\n{stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn the_demo_runs_on_device_pools_and_says_which() {
    if !gpu_or_skip() {
        return;
    }
    let out = std::process::Command::new(release_binary())
        .args([
            "demo",
            "--pool",
            "device",
            "--model",
            "tiny",
            "--tokens",
            "16,700,64",
        ])
        .output()
        .expect("running kvferry demo");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "kvferry demo --pool device failed:\n{stdout}\n{stderr}"
    );
    let summary = stdout.lines().last().unwrap_or_default();
    println!("{summary}");
    assert!(
        summary.starts_with("3 rooms")
            && summary.contains("between device pools on")
            && summary.contains("3 verified"),
        "{stdout}"
    );
}

/// A pool in VMM memory of this engine: 2 MiB pieces mapped back to back, each exported as a
/// POSIX fd, and a socket thread that sends them to the agent that connects (`--pool
/// cuda-vmm:0:<socket>`).
fn vmm_pool(
    engine: &Engine,
    len: usize,
    fill: u8,
    socket: &std::path::Path,
) -> (u64, std::thread::JoinHandle<()>) {
    let d = &engine.0;
    let (create, reserve, map): (Create, Reserve, Map) = (
        d.f("cuMemCreate"),
        d.f("cuMemAddressReserve"),
        d.f("cuMemMap"),
    );
    let (set_access, export): (SetAccess, Export) =
        (d.f("cuMemSetAccess"), d.f("cuMemExportToShareableHandle"));
    let piece = 2 << 20;
    let len = len.div_ceil(piece) * piece;
    let mut va = 0;
    let mut pieces = Vec::new();
    // SAFETY: valid out-pointers; every piece mapped inside the reservation.
    unsafe {
        assert_eq!(reserve(&mut va, len, 0, 0, 0), SUCCESS);
        for at in (0..len).step_by(piece) {
            let (mut h, mut fd) = (0u64, -1i32);
            assert_eq!(create(&mut h, piece, &prop(true), 0), SUCCESS);
            assert_eq!(map(va + at as u64, piece, 0, h, 0), SUCCESS);
            assert_eq!(export((&raw mut fd).cast(), h, POSIX_FD, 0), SUCCESS);
            pieces.push((at as u64, piece as u64, fd));
        }
        assert_eq!(set_access(va, len, &READ_WRITE, 1), SUCCESS);
    }
    engine.fill(va, fill, len);
    let listener =
        std::os::unix::net::UnixListener::bind(socket).expect("binding the engine's socket");
    let serve = std::thread::spawn(move || {
        let (agent, _) = listener.accept().expect("an agent connects");
        kvferry::kernel::cuda::vmm::send_pieces(&agent, &pieces).expect("sending the pieces");
    });
    (va, serve)
}

#[test]
fn sidecar_agents_import_vmm_pieces_sent_over_the_engines_socket() {
    if !gpu_or_skip() {
        return;
    }
    let engine = Engine::new();
    let pages = 2 * PAGES;
    let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
    let bytes = layout.pool_bytes(pages).unwrap();
    let dir = kvferry::cluster::log_dir("device-vmm").expect("log dir");
    let (prefill_socket, decode_socket) =
        (dir.join("prefill-pool.sock"), dir.join("decode-pool.sock"));
    let (prefill_va, served_prefill) = vmm_pool(&engine, bytes, 0, &prefill_socket);
    let (decode_va, served_decode) = vmm_pool(&engine, bytes, POISON, &decode_socket);
    let opts = AgentOpts {
        pool_pages: pages,
        ..AgentOpts::default()
    };
    let exe = release_binary();
    let registry = common::spawn(
        &exe,
        &[],
        "registry",
        &owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]),
        &[],
        &dir,
    );
    let agent = |role: &str, socket: &std::path::Path| {
        let mut args = owned(&[role, "--bootstrap", &registry.field("url").unwrap()]);
        args.extend(opts.args());
        args.extend([
            "--pool".to_owned(),
            format!("cuda-vmm:0:{}", socket.display()),
        ]);
        common::spawn(&exe, &[], role, &args, &[], &dir)
    };
    let (prefill, decode) = (
        agent("prefill", &prefill_socket),
        agent("decode", &decode_socket),
    );
    served_prefill
        .join()
        .expect("the prefill's pieces were sent");
    served_decode.join().expect("the decode's pieces were sent");
    // Every room spans all layers: its chunks read and write both 2 MiB pieces.
    let rooms = vec![(41, vec![60, 61, 62, 63]), (42, vec![64, 65, 127, 0])];
    runtime().block_on(async {
        ask_and_announce(
            &decode.field("api").unwrap(),
            &[prefill.field("api").unwrap()],
            &rooms,
        )
        .await;
        for (room, _) in &rooms {
            take_verified(&http(), &decode.field("api").unwrap(), *room).await;
        }
    });
    let all: Vec<u32> = rooms.iter().flat_map(|(_, p)| p.clone()).collect();
    let checked = untouched_outside(&engine.read(decode_va, bytes), &layout, pages, &all);
    assert!(
        engine.read(prefill_va, bytes).iter().any(|&b| b != 0),
        "the prefill filled its pool"
    );
    println!("VMM pools in 2 MiB pieces: rooms verified, {checked} bytes outside them unchanged");
}

/// The engine's side of an interprocess event: a stream of its own that it holds
/// (`cuStreamWaitValue32` on a pinned word), writes queued behind the hold, and an event
/// created with `CU_EVENT_INTERPROCESS` recorded after them.
struct HeldWrites<'a> {
    engine: &'a Engine,
    stream: Ptr,
    event: Ptr,
    flag: *mut u32,
}

impl<'a> HeldWrites<'a> {
    fn new(engine: &'a Engine) -> Self {
        let d = &engine.0;
        let stream_create: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuStreamCreate");
        let event_create: unsafe extern "C" fn(*mut Ptr, u32) -> R = d.f("cuEventCreate");
        let host_alloc: unsafe extern "C" fn(*mut Ptr, usize, u32) -> R = d.f("cuMemHostAlloc");
        let (mut stream, mut event, mut flag) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        // SAFETY: valid out-pointers; the flag is 4 bytes of pinned memory kept to the end.
        unsafe {
            // Non-blocking: the engine's synchronous reads on the null stream do not wait for it.
            assert_eq!(stream_create(&mut stream, 1), SUCCESS);
            // CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING.
            assert_eq!(event_create(&mut event, 4 | 2), SUCCESS);
            assert_eq!(host_alloc(&mut flag, 4, 0), SUCCESS);
            flag.cast::<u32>().write_volatile(0);
        }
        HeldWrites {
            engine,
            stream,
            event,
            flag: flag.cast(),
        }
    }

    /// Holds the stream until the flag reaches `release`, queues the upload of `data` to
    /// `addr` behind the hold, records the event after it; returns the event's IPC handle in
    /// hex.
    fn write_after_hold(&self, release: u32, addr: u64, data: &[u8]) -> String {
        let d = &self.engine.0;
        let wait_value: unsafe extern "C" fn(Ptr, u64, u32, u32) -> R =
            d.f("cuStreamWaitValue32_v2");
        let htod: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> R =
            d.f("cuMemcpyHtoDAsync_v2");
        let record: unsafe extern "C" fn(Ptr, Ptr) -> R = d.f("cuEventRecord");
        let get: unsafe extern "C" fn(*mut [u8; 64], Ptr) -> R = d.f("cuIpcGetEventHandle");
        let mut handle = [0u8; 64];
        // SAFETY: the flag is live pinned memory; a copy from pageable memory takes its bytes
        // before it returns; the event and stream are ours.
        unsafe {
            assert_eq!(
                wait_value(self.stream, self.flag as u64, release, 0),
                SUCCESS
            );
            assert_eq!(
                htod(addr, data.as_ptr().cast(), data.len(), self.stream),
                SUCCESS
            );
            assert_eq!(record(self.event, self.stream), SUCCESS);
            assert_eq!(get(&mut handle, self.event), SUCCESS);
        }
        handle.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn release(&self, value: u32) {
        // SAFETY: live pinned memory that the stream's worker polls.
        unsafe { self.flag.write_volatile(value) };
    }
}

/// Every byte of the decode pool: each room's pages hold its write (the engine's data at the
/// room's prefill pages), the rest the poison. The bytes that landed.
fn assert_rooms_landed(
    engine: &Engine,
    decode_pool: u64,
    layout: &KvLayout,
    rooms: &[Room<'_>],
) -> usize {
    let dst_bytes = engine.read(decode_pool, layout.pool_bytes(PAGES).unwrap());
    let (stride, block) = (layout.page_stride().unwrap(), layout.block_bytes().unwrap());
    let mut landed = 0;
    for layer in 0..layout.num_layers() {
        for plane in 0..layout.planes() {
            let plane_at = layout.plane_offset(layer, plane, PAGES).unwrap();
            for page in 0..PAGES {
                let got = &dst_bytes[plane_at + page * stride..][..block];
                let from = rooms.iter().find_map(|(_, src, dst, data)| {
                    dst.iter()
                        .position(|&x| x as usize == page)
                        .map(|i| (src[i] as usize, *data))
                });
                match from {
                    Some((source, data)) => {
                        let want = &data[plane_at + source * stride..][..block];
                        assert!(
                            got == want,
                            "layer {layer} plane {plane}: decode page {page} is not the engine's write to prefill page {source}"
                        );
                        landed += block;
                    }
                    None => assert!(
                        got.iter().all(|&b| b == POISON),
                        "layer {layer} plane {plane}: page {page} is outside every room but changed"
                    ),
                }
            }
        }
    }
    landed
}

#[test]
fn a_cuda_event_that_never_completes_fails_its_own_room_and_no_other() {
    if !gpu_or_skip() {
        return;
    }
    // The prefill gives up on an engine event after 5 s; nothing else here is that slow.
    let IpcPools {
        engine,
        layout,
        bytes,
        prefill_pool,
        decode_pool,
        c,
    } = IpcPools::start(
        "device-event-never",
        AgentOpts {
            synthetic: false,
            timeout_ready_ms: 5_000,
            ..AgentOpts::default()
        },
        &[],
    );
    // Two engine streams, each with its own event: the first is held to the end of the test.
    let (stuck, live) = (HeldWrites::new(&engine), HeldWrites::new(&engine));
    let never: Vec<u8> = (0..bytes).map(|i| (i * 3 + 2) as u8 | 1).collect();
    let data: Vec<u8> = (0..bytes).map(|i| (i * 11 + 7) as u8 | 1).collect();
    let (stuck_room, live_room): (Room<'_>, Room<'_>) = (
        (91, [4, 18, 10, 41], [51, 3, 34, 9], &never),
        (92, [61, 2, 23, 6], [11, 12, 62, 1], &data),
    );
    runtime().block_on(async {
        let http = http();
        let started = std::time::Instant::now();
        for (room, held) in [(&stuck_room, &stuck), (&live_room, &live)] {
            ask_behind_held_write(&http, &c, held, 1, prefill_pool, room).await;
        }
        // The second room's writes run; the first's never do.
        live.release(1);
        let v = wait_final(&http, &c.decode_api, live_room.0).await;
        assert_eq!(
            v["state"], "success",
            "a room behind a live event waited for a stuck one: {v}"
        );
        take(&http, &c.decode_api, live_room.0).await;
        println!(
            "the live room landed {:.2} s after its announcement",
            started.elapsed().as_secs_f64()
        );
        let v = wait_final(&http, &c.decode_api, stuck_room.0).await;
        assert_eq!(v["state"], "failed", "{v}");
        assert_eq!(v["reason"]["code"], "timeout_ready", "{v}");
        let v = wait_final(&http, &c.prefill_api, stuck_room.0).await;
        assert!(
            v.to_string().contains("CUDA event"),
            "the prefill says which wait gave up: {v}"
        );
        println!(
            "the stuck room failed timeout_ready {:.2} s after its announcement",
            started.elapsed().as_secs_f64()
        );
    });
    stuck.release(1);
    let landed = assert_rooms_landed(&engine, decode_pool, &layout, &[live_room]);
    assert_eq!(
        landed,
        4 * layout.num_layers() * layout.planes() * layout.block_bytes().unwrap()
    );
}

/// Asks the decode for `room` and announces it at the prefill behind `held`'s write of the
/// room's data into the prefill pool at `prefill_pool` (queued behind a hold released at
/// `release`), with the event's IPC handle.
async fn ask_behind_held_write(
    http: &reqwest::Client,
    c: &FaultCluster,
    held: &HeldWrites<'_>,
    release: u32,
    prefill_pool: u64,
    (room, src, dst, data): &Room<'_>,
) {
    let handle = held.write_after_hold(release, prefill_pool, data);
    let ask = json!({ "tokens": TOKENS, "pages": dst });
    let url = format!("{}/v1/rooms/{room}", c.decode_api);
    let created = reqwest::StatusCode::CREATED;
    expect(http, reqwest::Method::POST, &url, Some(&ask), created).await;
    let ready = json!({ "tokens": TOKENS, "pages": src, "cuda_ipc_event": handle });
    let url = format!("{}/v1/rooms/{room}/ready", c.prefill_api);
    let accepted = reqwest::StatusCode::ACCEPTED;
    expect(http, reqwest::Method::POST, &url, Some(&ready), accepted).await;
}

/// Takes a landed `room` at the decode.
async fn take(http: &reqwest::Client, decode: &str, room: u64) {
    let url = format!("{decode}/v1/rooms/{room}/take");
    expect(
        http,
        reqwest::Method::POST,
        &url,
        None,
        reqwest::StatusCode::OK,
    )
    .await;
}

/// Asserts `room` at the decode is not `success` over three long polls of a second each.
async fn still_not_landed(http: &reqwest::Client, decode: &str, room: u64) {
    for _ in 0..3 {
        let url = format!("{decode}/v1/rooms/{room}?wait_ms=1000");
        let v = expect(
            http,
            reqwest::Method::GET,
            &url,
            None,
            reqwest::StatusCode::OK,
        )
        .await;
        assert_ne!(
            v["state"], "success",
            "room {room} landed before the engine's writes ran: {v}"
        );
    }
}

/// A room: its id, prefill pages, decode pages, and what the engine writes to the prefill pool.
type Room<'a> = (u64, [u32; 4], [u32; 4], &'a [u8]);

#[test]
fn a_sidecar_room_behind_the_engines_ipc_event_lands_only_after_its_writes() {
    if !gpu_or_skip() {
        return;
    }
    // Not synthetic: the KV is what the engine writes.
    let IpcPools {
        engine,
        layout,
        bytes,
        prefill_pool,
        decode_pool,
        c,
    } = IpcPools::start(
        "device-ipc-event",
        AgentOpts {
            synthetic: false,
            ..AgentOpts::default()
        },
        &[],
    );
    let held = HeldWrites::new(&engine);
    // Two rooms, each behind a record of the same event (one handle, opened once by the
    // agent): the second is followed at its latest record, not the first.
    let first: Vec<u8> = (0..bytes).map(|i| (i * 7 + 1) as u8 | 1).collect();
    let second: Vec<u8> = (0..bytes).map(|i| (i * 13 + 5) as u8 | 1).collect();
    let rooms: [Room<'_>; 2] = [
        (81, [3, 17, 9, 40], [50, 2, 33, 8], &first),
        (82, [60, 1, 22, 5], [10, 11, 61, 0], &second),
    ];
    runtime().block_on(async {
        let http = http();
        // Refused with the driver's error: bytes that are no event handle.
        let (status, v) = call(
            &http,
            reqwest::Method::POST,
            &format!("{}/v1/rooms/80/ready", c.prefill_api),
            Some(&json!({ "tokens": TOKENS, "pages": [0], "cuda_ipc_event": "5a".repeat(64) })),
        )
        .await;
        assert_eq!(status, reqwest::StatusCode::BAD_REQUEST, "{v}");
        let said = v.to_string();
        assert!(
            said.contains("cuda_ipc_event") && said.contains("CUDA_ERROR_INVALID_HANDLE"),
            "the refusal names the field and the driver's error: {v}"
        );
        for (i, room) in rooms.iter().enumerate() {
            let release = i as u32 + 1;
            ask_behind_held_write(&http, &c, &held, release, prefill_pool, room).await;
            let room = room.0;
            // Held: nothing behind the event has run, so nothing can land.
            still_not_landed(&http, &c.decode_api, room).await;
            held.release(release);
            let v = wait_final(&http, &c.decode_api, room).await;
            assert_eq!(v["state"], "success", "{v}");
            take(&http, &c.decode_api, room).await;
        }
    });
    let landed = assert_rooms_landed(&engine, decode_pool, &layout, &rooms);
    assert_eq!(
        landed,
        2 * 4 * layout.num_layers() * layout.planes() * layout.block_bytes().unwrap()
    );
    println!("two rooms behind the engine's IPC event: {landed} bytes landed after its writes");
}

/// The role of a test process re-run as an engine by
/// `engine_device_pools_send_and_place_runs_over_ucx`, with the registry, the file the
/// prefill writes its API URL to, and its log (in these variables).
const ENGINE_ROLE: &str = "KVFERRY_TEST_ENGINE_ROLE";
const ENGINE_REGISTRY: &str = "KVFERRY_TEST_ENGINE_REGISTRY";
const ENGINE_PREFILL_API: &str = "KVFERRY_TEST_ENGINE_PREFILL_API";
const ENGINE_LOG: &str = "KVFERRY_TEST_ENGINE_LOG";

/// An engine process embedding an agent on a device pool it allocated itself (one
/// allocation, the layout's regions back to back), as an engine that registers its KV memory
/// does. The prefill's serves until it is killed; the decode's asks for rooms, checks every
/// byte of its pool and which way the chunks went, and returns.
fn engine_process(role: &str) {
    use kvferry::agent::decode::DecodeAgent;
    use kvferry::agent::prefill::PrefillAgent;
    use kvferry::kernel::cuda::{CudaKernel, DevicePool};
    use kvferry::pool::EngineRegion;
    let var = |name| std::env::var(name).unwrap_or_else(|_| panic!("{name} unset"));
    let file = std::fs::File::create(var(ENGINE_LOG)).unwrap();
    tracing_subscriber::fmt()
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .with_env_filter("kvferry=debug")
        .init();
    let (rt, engine) = (runtime(), Engine::new());
    // Tiny pages make short runs, which are placed only below the default floor.
    let flags = ["--transport", "ucx", "--placed-min-run-bytes", "1"];
    let cfg = in_process_config(&var(ENGINE_REGISTRY), &flags);
    let (layout, pages) = (cfg.layout.clone(), cfg.pool_pages);
    let bytes = layout.pool_bytes(pages).unwrap();
    let region = layout.region_bytes(pages).unwrap();
    let addr = engine.alloc(bytes);
    engine.fill(addr, if role == "prefill" { 0 } else { POISON }, bytes);
    let regions: Vec<EngineRegion> = (0..layout.num_regions())
        .map(|i| EngineRegion {
            addr: addr as usize + i * region,
            len: region,
        })
        .collect();
    let kernel = CudaKernel::shared(0).expect("the CUDA kernel");
    // SAFETY: the allocation lives until this process ends, after the agent.
    let pool = unsafe { DevicePool::engine(&kernel, layout.clone(), pages, &regions) }.unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let prefill_api = std::path::PathBuf::from(var(ENGINE_PREFILL_API));
    if role == "prefill" {
        rt.block_on(async {
            let agent = PrefillAgent::start_with_pool(cfg, pool, shutdown)
                .await
                .unwrap();
            std::fs::write(&prefill_api, &agent.api_url).unwrap();
            tokio::time::sleep(std::time::Duration::from_secs(600)).await;
        });
        return;
    }
    let agent = rt
        .block_on(DecodeAgent::start_with_pool(cfg, pool, shutdown))
        .unwrap();
    let api = agent.api_url.clone();
    let waited = std::time::Instant::now();
    let prefill = loop {
        match std::fs::read_to_string(&prefill_api) {
            Ok(api) if !api.is_empty() => break api,
            _ => {
                assert!(
                    waited.elapsed().as_secs() < 120,
                    "the prefill engine never started"
                );
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    };
    let rooms = vec![(51, vec![5, 17, 2, 40]), (52, vec![60, 61, 62, 63])];
    rt.block_on(async {
        ask_and_announce(&api, std::slice::from_ref(&prefill), &rooms).await;
        for (room, _) in &rooms {
            take_verified(&http(), &api, *room).await;
        }
    });
    let all: Vec<u32> = rooms.iter().flat_map(|(_, p)| p.clone()).collect();
    let checked = untouched_outside(&engine.read(addr, bytes), &layout, pages, &all);
    let (placed, staged) = (
        decode_chunks("engine", &api, "placed"),
        decode_chunks("engine", &api, "staged"),
    );
    println!(
        "engine device pools over UCX: rooms verified, {checked} bytes outside them \
         unchanged; chunks placed {placed}, staged {staged}"
    );
    // With CUDA, every chunk goes from pool to pool; without, every chunk is staged.
    assert_eq!(
        (placed > 0.0, staged > 0.0),
        (ucx_with_cuda(), !ucx_with_cuda()),
        "chunks placed {placed}, staged {staged}"
    );
}

/// Engines that embed their agents on device pools they allocated (the in-engine case) send
/// runs straight from the prefill's pool into places the decode posted in its own, over UCX
/// with CUDA (`KVFERRY_UCX_CUDA=1`): both pools registered with UCX as CUDA memory, every
/// chunk placed, none gathered into staging. With a UCX without CUDA, both stage in pinned
/// host memory as before. Two engine processes (this test run again, as each role); the
/// decode's checks every room's bytes and every byte outside them.
#[test]
fn engine_device_pools_send_and_place_runs_over_ucx() {
    if let Ok(role) = std::env::var(ENGINE_ROLE) {
        return engine_process(&role);
    }
    if !gpu_or_skip() {
        return;
    }
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir("engine-device-ucx").expect("log dir");
    let args = owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]);
    let registry = common::spawn(&exe, &[], "registry", &args, &[], &logs);
    let url = registry.field("url").unwrap();
    let prefill_api = logs.join("prefill-api");
    let stderr = |role: &str| logs.join(format!("{role}.stderr"));
    let engine = |role: &str| {
        let err = std::fs::File::create(stderr(role)).unwrap();
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "e2e_device::engine_device_pools_send_and_place_runs_over_ucx",
                "--exact",
                "--nocapture",
            ])
            .env(ENGINE_ROLE, role)
            .env(ENGINE_REGISTRY, &url)
            .env(ENGINE_PREFILL_API, &prefill_api)
            .env(ENGINE_LOG, logs.join(format!("{role}.log")))
            .envs(ucx_env().iter().copied())
            .stderr(err)
            .spawn()
            .expect("the test binary, again")
    };
    let mut prefill = engine("prefill");
    let decode = engine("decode");
    let (decode_pid, ended) = (decode.id(), decode.wait_with_output().unwrap().status);
    let _ = prefill.kill();
    let _ = prefill.wait();
    let [pf_err, d_err] =
        ["prefill", "decode"].map(|r| std::fs::read_to_string(stderr(r)).unwrap());
    assert!(
        ended.success(),
        "the decode engine failed: {ended} (logs in {}):\n{d_err}",
        logs.display()
    );
    // On the emulator, with UCX's CUDA transports: one engine mapped the other's whole pool
    // (cuda_ipc), not device staging.
    let pool = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16)
        .unwrap()
        .pool_bytes(PAGES)
        .unwrap();
    if ucx_with_cuda() && Engine::new().on_emulator() {
        let mapped = |log: &str, of: u32| log.contains(&format!("process {of} ({pool} bytes)"));
        assert!(
            mapped(&d_err, prefill.id()) || mapped(&pf_err, decode_pid),
            "no engine mapped the other's pool of {pool} bytes:\n{pf_err}\n{d_err}"
        );
        println!("on the emulator: an engine mapped the other's pool by cuda_ipc");
    }
}
