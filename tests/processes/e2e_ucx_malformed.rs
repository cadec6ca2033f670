//! A decode's Hello whose UCX data endpoint or pool key is malformed (truncated, crafted
//! lengths) is refused by the prefill with `bad_message`, before any byte of it reaches
//! libucx; one of a receiver on the other UCX release (1.13 or 1.22) with
//! `incompatible_version`, naming both; an endpoint that is well formed but leads nowhere stays `unreachable`; and the
//! prefill keeps serving (a normal room between the same agents verifies afterwards). A device
//! chunk's header with no payload behind it, sent to a decode that stages on the host, is
//! refused at once and the decode keeps landing rooms. Real processes over UCX's tcp transport
//! on loopback.
#![cfg(feature = "ucx")]

use crate::common;

use common::rogue::{answers, hello};
use common::{AgentOpts, release_binary, runtime};
use kvferry::cluster::{Apis, LocalCluster, Shape, drive_rooms};
use kvferry::memory::RemoteMemory;
use kvferry::protocol::Message;
use kvferry::transport::ucx::version::Family;
use kvferry::transport::ucx::{UcxConfig, UcxVersion, UcxWorker};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A data endpoint of tag prefix `80000001` and the hex worker address `address`, as a
/// receiver on this process's UCX gives it (its release after the addresses, but on 1.13).
fn endpoint(address: &str) -> String {
    let ours = UcxVersion::loaded();
    match ours.family() {
        Ok(Family::V1_13) => format!("ucx:80000001/{address}"),
        _ => format!("ucx:80000001/{address}/{ours}"),
    }
}

/// A registry, a prefill and a decode agent over UCX's tcp transport on loopback.
fn ucx_cluster(tag: &str) -> LocalCluster {
    ucx_cluster_env(tag, &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")])
}

/// A registry, a prefill and a decode agent over UCX, every process with `env`.
fn ucx_cluster_env(tag: &str, env: &[(&str, &str)]) -> LocalCluster {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let opts = AgentOpts {
        transport: "ucx",
        ..AgentOpts::default()
    };
    let (exe, args) = (release_binary(), opts.args());
    LocalCluster::start_shaped_env(&exe, tag, &args, Shape::ONE, Shape::ONE, &env).expect("cluster")
}

/// The prefill's and the decode's APIs and the prefill's control endpoint.
fn endpoints(cluster: &LocalCluster) -> (String, String, String) {
    let field = |p: &kvferry::cluster::Process, key: &str| {
        p.field(key)
            .unwrap_or_else(|e| panic!("{}: {key}: {e}", p.name))
    };
    (
        field(cluster.prefill(), "api"),
        field(cluster.decode(), "api"),
        field(cluster.prefill(), "control"),
    )
}

#[test]
fn malformed_ucx_addresses_and_keys_in_hello_are_bad_messages_and_the_prefill_keeps_serving() {
    let cluster = ucx_cluster("ucx-malformed");
    let (prefill, decode, control) = endpoints(&cluster);
    runtime().block_on(async {
        // A real worker address and rkey from this machine, to craft from.
        let worker = UcxWorker::spawn(UcxConfig::tcp_loopback())
            .await
            .expect("worker");
        let address = worker.address().to_vec();
        let region = kvferry::transport::ucx::Region::new(1 << 20).expect("a region");
        let registered = worker
            .register(std::sync::Arc::new(region))
            .await
            .expect("register");
        let rkey = registered.rkey.to_vec();
        let good = endpoint(&hex(&address));
        // The same address, named by a receiver of the other release (1.13 names none).
        let other_release = match UcxVersion::loaded().family() {
            Ok(Family::V1_13) => format!("{good}/1.22.0"),
            _ => format!("ucx:80000001/{}", hex(&address)),
        };
        let memory = |key: Vec<u8>| RemoteMemory {
            base: registered.base,
            size: registered.size,
            key,
        };
        let mut inflated = address.clone();
        inflated[10] = 0x80 | 0x3f; // the device address runs past the end
        // One transport's key, whose length runs past the end.
        let mut big_key = 1u64.to_le_bytes().to_vec();
        big_key.extend_from_slice(&[0, 0xff, 1, 2]);
        // The real key, naming another kind of memory (2: CUDA managed, in every release).
        let mut managed = rkey.clone();
        managed[8] = 2;
        let cases: Vec<(&str, Message, &str)> = vec![
            (
                "3-byte address",
                hello(endpoint(&hex(&address[..3])), None, None),
                "bad_message",
            ),
            (
                "truncated address",
                hello(endpoint(&hex(&address[..address.len() - 1])), None, None),
                "bad_message",
            ),
            (
                "inflated device length",
                hello(endpoint(&hex(&inflated)), None, None),
                "bad_message",
            ),
            (
                "not hex",
                hello("ucx:80000001/zz".into(), None, None),
                "bad_message",
            ),
            (
                "a receiver of the other UCX release",
                hello(other_release.clone(), None, None),
                "incompatible_version",
            ),
            (
                "no tag prefix (an earlier build's endpoint)",
                hello(format!("ucx:{}", hex(&address)), None, None),
                "bad_message",
            ),
            (
                "2-byte pool key",
                hello(good.clone(), Some(memory(rkey[..2].to_vec())), None),
                "bad_message",
            ),
            (
                "inflated key length",
                hello(good.clone(), Some(memory(big_key)), None),
                "bad_message",
            ),
            (
                "over-long key",
                hello(good.clone(), Some(memory(vec![0; 5000])), None),
                "bad_message",
            ),
            (
                "a key of managed memory",
                hello(good.clone(), Some(memory(managed)), None),
                "bad_message",
            ),
        ];
        let (whats, messages): (Vec<_>, Vec<_>) =
            cases.into_iter().map(|(w, m, c)| ((w, c), m)).unzip();
        for ((what, code), answer) in whats.into_iter().zip(answers(&control, messages)) {
            match answer {
                Message::Error(e) => {
                    assert_eq!(e.code.to_string(), code, "{what}: {}", e.message);
                    if code == "incompatible_version" {
                        let ours = UcxVersion::loaded().to_string();
                        assert!(e.message.contains(&ours), "{what}: {}", e.message);
                        assert!(
                            e.message.contains("UCX 1.13") || e.message.contains("UCX 1.22.0"),
                            "{}",
                            e.message
                        );
                    }
                    println!("[ucx-malformed] {what}: {} {}", e.code, e.message);
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        // The prefill keeps serving: a room from the real decode verifies.
        let apis = Apis::pair(&prefill, &decode);
        let results = drive_rooms(&apis, vec![(1, 100)], 1).await.expect("a room");
        assert!(results.iter().all(|r| r.verified), "{results:?}");
    });
}

/// The header of a chunk whose payload is in device memory (`Tags::device_chunk` in
/// transport/ucx/data.rs, under the decode's tag prefix), sent by a worker that never said
/// Hello to a decode that stages on the host, with no payload behind it: the decode refuses it
/// at once (it never waits for the payload, which would hold every peer's chunks), and keeps
/// landing rooms.
#[test]
fn a_device_chunk_header_to_a_host_staging_decode_is_refused_at_once() {
    let cluster = ucx_cluster("ucx-device-header");
    let prefill = cluster.prefill().field("api").expect("prefill api");
    let decode = cluster.decode().field("api").expect("decode api");
    let data = cluster
        .decode()
        .field("data")
        .expect("decode data endpoint");
    // `ucx:PREFIX/ADDRESS,...`: the header goes under the decode's tag prefix, as from a
    // prefill that got its Hello.
    let (prefix, list) = data
        .strip_prefix("ucx:")
        .and_then(|a| a.split_once('/'))
        .expect("a ucx data endpoint");
    let device_chunk_tag = (u64::from_str_radix(prefix, 16).expect("hex prefix") << 32) | 2;
    let address = list
        .split(',')
        .next()
        .map(|h| {
            (0..h.len() / 2)
                .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).expect("hex"))
                .collect::<Vec<u8>>()
        })
        .expect("a ucx data endpoint");
    let log = cluster.logs.join(format!("{}.log", cluster.decode().name));
    runtime().block_on(async {
        let worker = UcxWorker::spawn(UcxConfig::tcp_loopback())
            .await
            .expect("worker");
        let ep = worker.connect(address.into()).await.expect("connect");
        // A frame (u32 LE header length, a header of garbage) and the trailer: a 64-byte
        // payload under key 7 that never comes.
        let mut frame = 5u32.to_le_bytes().to_vec();
        frame.extend_from_slice(b"hello");
        frame.extend_from_slice(&64u64.to_le_bytes());
        frame.extend_from_slice(&7u64.to_le_bytes());
        let sent = std::time::Instant::now();
        worker
            .send_tag(ep, device_chunk_tag, frame.into())
            .await
            .expect("send");
        common::poll_until("the decode refuses the header", common::BOUND, || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.contains("to a receiver that stages on the host")
                .then_some(())
        })
        .await;
        println!(
            "[ucx-device-header] refused {:.1} ms after the send",
            sent.elapsed().as_secs_f64() * 1e3
        );
        let apis = Apis::pair(&prefill, &decode);
        let results = drive_rooms(&apis, vec![(1, 100)], 1).await.expect("a room");
        assert!(results.iter().all(|r| r.verified), "{results:?}");
        worker.shutdown().await;
    });
}

/// Whether the prefill of a cluster over UCX's posix and tcp transports (with `env` added)
/// maps a file named by a Hello's pool key. The key is a well-framed posix rkey (UCX 1.13 and
/// 1.22, `uct_posix_packed_rkey_t`: a segment id in procfs mode naming `/proc/PID/fd/N` of this test,
/// an address, a length) under the memory domain UCX orders after tcp's in a `posix,tcp`
/// context (1): unpacking it makes UCX open that file and map it at the key's length, in the
/// unpacking process, whatever the file is.
fn posix_rkey_mapped(tag: &str, env: &[(&str, &str)]) -> bool {
    use std::os::fd::AsRawFd as _;
    let mut env = env.to_vec();
    env.extend([("UCX_TLS", "posix,tcp"), ("UCX_NET_DEVICES", "lo")]);
    let cluster = ucx_cluster_env(tag, &env);
    let (prefill, decode, control) = endpoints(&cluster);
    let pid = cluster.prefill().pid();
    let name = format!("/dev/shm/kvferry-rogue-rkey-{}-{tag}", std::process::id());
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&name)
        .expect("a file in /dev/shm");
    let length: u64 = 64 << 20;
    file.set_len(length).expect("its length");
    let seg_id = (1u64 << 63) | u64::from(std::process::id()) | ((file.as_raw_fd() as u64) << 30);
    let mut key = 2u64.to_le_bytes().to_vec(); // md map: md 1
    key.push(0); // host memory
    key.push(24);
    key.extend_from_slice(&seg_id.to_le_bytes());
    key.extend_from_slice(&0u64.to_le_bytes());
    key.extend_from_slice(&length.to_le_bytes());
    if UcxVersion::loaded().family() != Ok(Family::V1_13) {
        key.push(0xff); // UCX 1.22: the key's system device, none (host memory)
    }
    let in_maps = || {
        std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .expect("the prefill's maps")
            .contains(&name)
    };
    let mapped = runtime().block_on(async {
        let worker = UcxWorker::spawn(
            UcxConfig::new()
                .var("TLS", "posix,tcp")
                .var("NET_DEVICES", "lo"),
        )
        .await
        .expect("worker");
        let endpoint = endpoint(&hex(&worker.address()));
        let memory = RemoteMemory {
            base: 0,
            size: length,
            key,
        };
        let answer = answers(&control, vec![hello(endpoint, Some(memory), None)]);
        println!("[{tag}] the prefill answered the Hello: {answer:?}");
        // Mapped before the answer, if at all (the pool is attached while the Hello is handled);
        // a room between the real agents runs meanwhile.
        let apis = Apis::pair(&prefill, &decode);
        let results = drive_rooms(&apis, vec![(1, 100)], 1).await.expect("a room");
        assert!(results.iter().all(|r| r.verified), "{results:?}");
        let mapped = in_maps();
        worker.shutdown().await;
        mapped
    });
    drop(file);
    let _ = std::fs::remove_file(&name);
    mapped
}

/// A decode's Hello whose pool key is a posix rkey naming a file of its choice (64 MiB): a
/// prefill whose UCX context has no RMA never unpacks a peer's key, so nothing of the file is
/// mapped in it, and it keeps serving. Control: a prefill given RMA anyway
/// (`KVFERRY_INSECURE_UCX_RMA=1`) maps the file, as every prefill did while every context had
/// RMA; only keys checked by RDMA hardware are unpacked without it (docs/reliability.md).
#[test]
fn a_posix_rkey_in_hello_maps_nothing_in_a_prefill_without_rma() {
    assert!(
        !posix_rkey_mapped("ucx-posix-rkey", &[]),
        "the prefill mapped a file a Hello's key named"
    );
    assert!(
        posix_rkey_mapped(
            "ucx-posix-rkey-insecure",
            &[(kvferry::transport::ucx::settings::INSECURE_RMA_VAR, "1")]
        ),
        "control: with RMA the prefill unpacks the key and maps the file"
    );
}
