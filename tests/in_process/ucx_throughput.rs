//! Throughput of the UCX layer between two workers of this process (issue 9, "Measure"):
//! tagged sends of 1 MiB and 4 MiB messages and 1 MiB puts + flush, over UCX's tcp
//! (`NET_DEVICES=lo`) and shared-memory transports, 8 operations in flight. Compare with
//! `scripts/baseline-ucx-perftest --tls tcp|posix,cma,self --msg-bytes N` (two processes).
//!
//! Ignored by default (timing, not behaviour). Run in release:
//! `cargo test --release --features ucx --test in_process ucx_throughput:: -- --ignored --nocapture --test-threads=1`
#![cfg(feature = "ucx")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use kvferry::transport::ucx::{Region, Span, UcxConfig, UcxWorker};

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;
const WINDOW: usize = 8;

fn config(tls: &str) -> UcxConfig {
    match tls {
        "tcp" => UcxConfig::tcp_loopback(),
        _ => UcxConfig::shared_memory().var("NET_DEVICES", "lo"),
    }
}

async fn tag_throughput(tls: &str, msg: usize, total: usize) -> f64 {
    let a = UcxWorker::spawn(config(tls)).await.expect("worker a");
    let b = UcxWorker::spawn(config(tls)).await.expect("worker b");
    let ab = a.connect(b.address()).await.expect("connect");
    let count = total / msg;
    let payload = Bytes::from(vec![0xABu8; msg]);
    // Warm-up: wire up, first rendezvous.
    for _ in 0..4 {
        let (s, r) = tokio::join!(
            a.send_tag(ab, 1, payload.clone()),
            b.recv_tag(1, u64::MAX, msg)
        );
        s.expect("warm-up send");
        assert_eq!(r.expect("warm-up recv").data.len(), msg);
    }
    let received = Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..WINDOW {
        let (b, received) = (b.clone(), received.clone());
        tasks.spawn(async move {
            while received.fetch_add(1, Ordering::Relaxed) < count {
                let got = b.recv_tag(2, u64::MAX, msg).await.expect("recv");
                assert_eq!(got.data.len(), msg);
            }
        });
        let (a, payload) = (a.clone(), payload.clone());
        let share = count / WINDOW + usize::from(w < count % WINDOW);
        tasks.spawn(async move {
            for _ in 0..share {
                a.send_tag(ab, 2, payload.clone()).await.expect("send");
            }
        });
    }
    while let Some(t) = tasks.join_next().await {
        t.expect("task");
    }
    let gbps = (count * msg) as f64 / t.elapsed().as_secs_f64() / 1e9;
    a.shutdown().await;
    b.shutdown().await;
    gbps
}

async fn put_throughput(tls: &str, rounds: usize) -> f64 {
    const SIZE: usize = 64 * MIB;
    let a = UcxWorker::spawn(config(tls)).await.expect("worker a");
    let b = UcxWorker::spawn(config(tls)).await.expect("worker b");
    let ab = a.connect(b.address()).await.expect("connect");
    let region = Arc::new(Region::new(SIZE).expect("region"));
    let reg = b.register(region.clone()).await.expect("register");
    let remote = a
        .add_remote_region(ab, reg.base, reg.size, reg.rkey.clone())
        .await
        .expect("remote region");
    let source = Bytes::from(vec![0x3Cu8; SIZE]);
    let t = Instant::now();
    for _ in 0..rounds {
        let mut puts = tokio::task::JoinSet::new();
        for w in 0..WINDOW {
            let (a, source) = (a.clone(), source.clone());
            puts.spawn(async move {
                for piece in (w..SIZE / MIB).step_by(WINDOW) {
                    let data = source.slice(piece * MIB..(piece + 1) * MIB);
                    a.put(remote, (piece * MIB) as u64, data)
                        .await
                        .expect("put");
                }
            });
        }
        while let Some(p) = puts.join_next().await {
            p.expect("task");
        }
        a.flush(ab).await.expect("flush");
    }
    let gbps = (rounds * SIZE) as f64 / t.elapsed().as_secs_f64() / 1e9;
    assert_eq!(region.read(SIZE - 4, 4).expect("read"), vec![0x3C; 4]);
    a.shutdown().await;
    b.shutdown().await;
    gbps
}

/// Runs of `run` bytes sent straight from one region into another (`send_runs` /
/// `recv_runs`, posted first: no staging on either side), 512 MiB per round as a decode room
/// would take it.
async fn placed_throughput(tls: &str, run: usize, rounds: usize) -> f64 {
    const SIZE: usize = 512 * MIB;
    let a = UcxWorker::spawn(config(tls)).await.expect("worker a");
    let b = UcxWorker::spawn(config(tls)).await.expect("worker b");
    let ab = a.connect(b.address()).await.expect("connect");
    let (src, dst) = (
        Arc::new(Region::new(SIZE).expect("source")),
        Arc::new(Region::new(SIZE).expect("destination")),
    );
    src.fill(0x5A);
    let runs: Vec<Span> = (0..SIZE / run)
        .map(|i| Span {
            offset: (i * run) as u64,
            len: run as u64,
        })
        .collect();
    let places: Vec<Vec<Span>> = runs.iter().map(|&r| vec![r]).collect();
    let never = tokio_util::sync::CancellationToken::new();
    let t = Instant::now();
    for round in 0..rounds {
        let tag = (round as u64 + 1) << 32;
        let landing = b
            .recv_runs(tag, dst.clone(), places.clone(), never.clone())
            .await
            .expect("post");
        let (s, r) = tokio::join!(a.send_runs(ab, tag, src.clone(), runs.clone()), landing);
        s.expect("send runs");
        r.expect("receive runs");
    }
    let gbps = (rounds * SIZE) as f64 / t.elapsed().as_secs_f64() / 1e9;
    assert_eq!(dst.read(SIZE - 4, 4).expect("read"), vec![0x5A; 4]);
    a.shutdown().await;
    b.shutdown().await;
    gbps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run in release with --ignored --nocapture"]
async fn ucx_throughput() {
    for tls in ["tcp", "shm"] {
        for msg in [MIB, 4 * MIB] {
            let gbps = tag_throughput(tls, msg, 2048 * MIB).await;
            println!(
                "{{\"ucx_tls\":\"{tls}\",\"op\":\"tag\",\"msg_bytes\":{msg},\"window\":{WINDOW},\"gbps\":{gbps:.3}}}"
            );
            assert!(gbps > 0.0);
        }
        // 16 KiB: a head slice of one page (llama3-8b, 4 of 8 heads, 16 tokens, head-major).
        let small = if tls == "shm" { &[16 * KIB][..] } else { &[] };
        for &run in small.iter().chain(&[MIB, 8 * MIB]) {
            let gbps = placed_throughput(tls, run, 4).await;
            println!(
                "{{\"ucx_tls\":\"{tls}\",\"op\":\"placed\",\"msg_bytes\":{run},\"gbps\":{gbps:.3}}}"
            );
            assert!(gbps > 0.0);
        }
        let rounds = if tls == "tcp" { 2 } else { 8 };
        let gbps = put_throughput(tls, rounds).await;
        println!(
            "{{\"ucx_tls\":\"{tls}\",\"op\":\"put\",\"msg_bytes\":{MIB},\"window\":{WINDOW},\"gbps\":{gbps:.3}}}"
        );
        assert!(gbps > 0.0);
    }
}
