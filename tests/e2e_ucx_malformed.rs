//! A decode's Hello whose UCX data endpoint or pool key is malformed (truncated, crafted
//! lengths) is refused by the prefill with `bad_message`, before any byte of it reaches
//! libucx; an endpoint that is well formed but leads nowhere stays `unreachable`; and the
//! prefill keeps serving (a normal room between the same agents verifies afterwards). A device
//! chunk's header with no payload behind it, sent to a decode that stages on the host, is
//! refused at once and the decode keeps landing rooms. Real processes over UCX's tcp transport
//! on loopback.
#![cfg(feature = "ucx")]

mod common;

use common::rogue::{answers, hello};
use common::{AgentOpts, release_binary, runtime};
use kvferry::cli::demo::{Apis, LocalCluster, Shape, drive_rooms};
use kvferry::memory::RemoteMemory;
use kvferry::protocol::Message;
use kvferry::transport::ucx::{UcxConfig, UcxWorker};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A registry, a prefill and a decode agent over UCX's tcp transport on loopback.
fn ucx_cluster(tag: &str) -> LocalCluster {
    let env: Vec<(String, String)> = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .to_vec();
    let opts = AgentOpts {
        transport: "ucx",
        ..AgentOpts::default()
    };
    let (exe, args) = (release_binary(), opts.args());
    LocalCluster::start_shaped_env(&exe, tag, &args, Shape::ONE, Shape::ONE, &env).expect("cluster")
}

#[test]
fn malformed_ucx_addresses_and_keys_in_hello_are_bad_messages_and_the_prefill_keeps_serving() {
    let cluster = ucx_cluster("ucx-malformed");
    let prefill = cluster.prefill().field("api").expect("prefill api");
    let decode = cluster.decode().field("api").expect("decode api");
    let control = cluster
        .prefill()
        .field("control")
        .expect("control endpoint");
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
        let good = format!("ucx:80000001/{}", hex(&address));
        let memory = |key: Vec<u8>| RemoteMemory {
            base: registered.base,
            size: registered.size,
            key,
        };
        let mut inflated = address.clone();
        inflated[10] = 0x80 | 0x3f; // the device address runs past the end
        let mut big_key = rkey.clone();
        big_key[9] = 0xff; // the first transport key runs past the end
        let cases: Vec<(&str, Message, &str)> = vec![
            (
                "3-byte address",
                hello(format!("ucx:80000001/{}", hex(&address[..3])), None, None),
                "bad_message",
            ),
            (
                "truncated address",
                hello(
                    format!("ucx:80000001/{}", hex(&address[..address.len() - 1])),
                    None,
                    None,
                ),
                "bad_message",
            ),
            (
                "inflated device length",
                hello(format!("ucx:80000001/{}", hex(&inflated)), None, None),
                "bad_message",
            ),
            (
                "not hex",
                hello("ucx:80000001/zz".into(), None, None),
                "bad_message",
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
        ];
        let (whats, messages): (Vec<_>, Vec<_>) =
            cases.into_iter().map(|(w, m, c)| ((w, c), m)).unzip();
        for ((what, code), answer) in whats.into_iter().zip(answers(&control, messages)) {
            match answer {
                Message::Error(e) => {
                    assert_eq!(e.code.to_string(), code, "{what}: {}", e.message);
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
