//! Reads: a decode names the pages of a prefill's pool itself, for rooms no engine announced
//! (`RoomRequest::source_pages`), from a prefill that serves reads (`--serve-reads`): a byte
//! arena any decode with the token may read, as LMCache's transfer channel needs. In one
//! process, a real registry and agents on engine memory (one buffer each: pages of bytes).
//! Every byte a read landed is compared with its source page, every other byte of the decode's
//! buffer keeps its poison, the prefill's buffer is unchanged; reads the prefill cannot serve
//! fail with their reason (a page out of its pool, a decode of another page size, a prefill that
//! serves no reads) and land nothing; a prefill that serves reads serves nothing else.

// Registering engine memory is `unsafe` by contract (the engine vouches for its buffers).
#![allow(unsafe_code)]

use crate::common;

use std::time::Instant;

use kvferry::agent::decode::{DecodeAgent, RoomRequest};
use kvferry::agent::prefill::{PrefillAgent, ReadyRequest};
use kvferry::agent::{AgentConfig, AgentOptions, RoomError};
use kvferry::pool::{EngineRegion, HostPool};
use kvferry::reason::FailureCode;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use tokio_util::sync::CancellationToken;

const PAGES: usize = 40;
/// Tokens a page; a token is `TOKEN` bytes (one head of an MLA layer of one-byte elements).
const PAGE: usize = 4;
const TOKEN: usize = 256;
const POISON: u8 = 0xDE;

/// An arena of `PAGES` pages of `PAGE * TOKEN` bytes.
fn config(registry: &str, page: usize, extra: &[&str]) -> AgentConfig {
    let (page, pages, token) = (page.to_string(), PAGES.to_string(), TOKEN.to_string());
    let mut flags = vec![
        "--bootstrap",
        registry,
        "--model",
        "tiny",
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        &token,
        "--dtype",
        "fp8_e4m3",
        "--attention",
        "mla",
        "--kv-format",
        "kvferry",
        "--page-size",
        &page,
        "--pool-pages",
        &pages,
        "--host",
        "127.0.0.1",
        "--api-host",
        "127.0.0.1",
        "--allowed-registries",
        "127.0.0.1:*",
    ];
    flags.extend_from_slice(extra);
    AgentOptions::from_flags(flags)
        .expect("flags")
        .config()
        .expect("config")
}

fn pool(cfg: &AgentConfig, buffer: &mut [u8]) -> HostPool {
    let regions = [EngineRegion {
        addr: buffer.as_mut_ptr() as usize,
        len: buffer.len(),
    }];
    // SAFETY: the buffer stays allocated and unmoved until the agents are joined, at the end of
    // the test.
    unsafe { HostPool::engine(cfg.layout.clone(), cfg.pool_pages, &regions) }
        .expect("the arena fits the layout")
}

/// A read of `src` into `dst` that must fail with `code`, its message saying `says`.
async fn refused(decode: &DecodeAgent, room: u64, req: RoomRequest, code: FailureCode, says: &str) {
    decode
        .request(room, req)
        .await
        .expect("the request is accepted here");
    let view = common::final_view(decode, room).await;
    let reason = view
        .reason
        .clone()
        .unwrap_or_else(|| panic!("room {room} failed without a reason: {view:?}"));
    assert_eq!(
        (view.state.name(), reason.code),
        ("failed", code),
        "room {room}: {reason:?}"
    );
    assert!(
        reason.message.contains(says),
        "room {room}: {}",
        reason.message
    );
    println!("room {room}: {} {}", reason.code.name(), reason.message);
    let taken = decode.take(room).await.expect("a failed room is taken too");
    assert_eq!(taken.room.bytes, 0, "room {room} landed nothing");
}

#[test]
fn a_decode_reads_the_pages_it_names_from_a_prefill_that_serves_reads() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let (registry, served) = common::registry_in_process(&shutdown).await;
        let (plain_registry, plain_served) = common::registry_in_process(&shutdown).await;
        // At most one room in flight, which reads do not count against: each decode bounds
        // its own.
        let p_cfg = config(&registry, PAGE, &["--serve-reads", "--max-rooms", "1"]);
        let d_cfg = config(&registry, PAGE, &[]);
        let bytes = p_cfg.layout.region_bytes(PAGES).expect("region bytes");
        let page_bytes = bytes / PAGES;
        let mut source = vec![0u8; bytes];
        rng.fill_bytes(&mut source);
        let original = source.clone();
        let mut landing = vec![POISON; bytes];
        let mut plain_source = vec![0x5Au8; bytes];
        let prefill = PrefillAgent::start_with_pool(
            p_cfg.clone(),
            pool(&p_cfg, &mut source),
            shutdown.clone(),
        )
        .await
        .expect("prefill agent");
        let decode = DecodeAgent::start_with_pool(
            d_cfg.clone(),
            pool(&d_cfg, &mut landing),
            shutdown.clone(),
        )
        .await
        .expect("decode agent");
        // A prefill that serves no reads, in a registry of its own.
        let plain_cfg = config(&plain_registry, PAGE, &[]);
        let plain = PrefillAgent::start_with_pool(
            plain_cfg.clone(),
            pool(&plain_cfg, &mut plain_source),
            shutdown.clone(),
        )
        .await
        .expect("plain prefill agent");

        // Reads of random pages into random pages, never a destination page twice.
        let mut dst_free: Vec<u32> = (0..PAGES as u32).collect();
        dst_free.shuffle(&mut rng);
        let mut reads = Vec::new();
        let t = Instant::now();
        for room in 1..=6u64 {
            let n = rng.random_range(1..=5);
            let mut src: Vec<u32> = (0..PAGES as u32).collect();
            src.shuffle(&mut rng);
            src.truncate(n);
            let dst = dst_free.split_off(dst_free.len() - n);
            let req = RoomRequest {
                tokens: n * PAGE,
                pages: Some(dst.clone()),
                source_pages: Some(src.clone()),
                ..RoomRequest::default()
            };
            decode
                .request(room, req)
                .await
                .unwrap_or_else(|e| panic!("room {room}: {e}"));
            reads.push((room, src, dst));
        }
        for (room, src, _) in &reads {
            let view = common::final_view(&decode, *room).await;
            assert_eq!(
                view.state.name(),
                "success",
                "room {room} of pages {src:?}: {:?}",
                view.reason
            );
            assert_eq!(view.bytes, src.len() * page_bytes, "room {room}");
            decode.take(*room).await.expect("take");
        }
        println!(
            "{} reads landed and taken in {:?}",
            reads.len(),
            t.elapsed()
        );
        // The decode refuses a read of no pages itself.
        let empty = RoomRequest {
            tokens: PAGE,
            source_pages: Some(vec![]),
            ..RoomRequest::default()
        };
        let e = decode
            .request(90, empty)
            .await
            .expect_err("a read of no pages");
        assert!(
            matches!(&e, RoomError::BadRequest(m) if m.contains("source pages")),
            "{e}"
        );
        // The prefill refuses a page out of its pool, and a prefill that serves no reads
        // refuses every read.
        let dst = dst_free.split_off(dst_free.len() - 2);
        let read = |src: Vec<u32>, bootstrap: Option<String>| RoomRequest {
            tokens: 2 * PAGE,
            pages: Some(dst.clone()),
            source_pages: Some(src),
            bootstrap,
            ..RoomRequest::default()
        };
        refused(
            &decode,
            91,
            read(vec![1, PAGES as u32 + 3], None),
            FailureCode::BadMessage,
            "out of range",
        )
        .await;
        // A prefill that serves reads serves nothing else: its engine announces no room, and a
        // request that names none of its pages is refused.
        let announced = ReadyRequest {
            tokens: 2 * PAGE,
            pages: Some(vec![7, 8]),
            ..ReadyRequest::default()
        };
        let e = prefill
            .ready(92, announced)
            .await
            .expect_err("no engine room on a prefill that serves reads");
        assert!(
            matches!(&e, RoomError::BadRequest(m) if m.contains("--serve-reads")),
            "{e}"
        );
        let engine_room = RoomRequest {
            tokens: 2 * PAGE,
            pages: Some(dst.clone()),
            ..RoomRequest::default()
        };
        refused(
            &decode,
            92,
            engine_room,
            FailureCode::BadMessage,
            "serves only reads",
        )
        .await;
        // A decode of another page size: its pages are not the prefill's.
        let other_cfg = config(&registry, 2 * PAGE, &[]);
        let mut other_landing =
            vec![POISON; other_cfg.layout.region_bytes(PAGES).expect("region bytes")];
        let other = DecodeAgent::start_with_pool(
            other_cfg.clone(),
            pool(&other_cfg, &mut other_landing),
            shutdown.clone(),
        )
        .await
        .expect("decode agent of 8-token pages");
        let halves = RoomRequest {
            tokens: 8,
            pages: Some(vec![0]),
            source_pages: Some(vec![0, 1]),
            ..RoomRequest::default()
        };
        refused(
            &other,
            94,
            halves,
            FailureCode::IncompatibleLayout,
            "pages of 4 tokens here",
        )
        .await;
        refused(
            &decode,
            93,
            read(vec![3, 4], Some(plain_registry.clone())),
            FailureCode::Unauthorized,
            "serves no reads",
        )
        .await;

        shutdown.cancel();
        prefill.join().await;
        decode.join().await;
        plain.join().await;
        other.join().await;
        served.await.unwrap().unwrap();
        plain_served.await.unwrap().unwrap();

        // Every landed page equals its source page; every other byte keeps its poison; the
        // prefill's arena is as it was.
        let mut expected = vec![POISON; bytes];
        for (room, src, dst) in &reads {
            for (s, d) in src.iter().zip(dst) {
                let (s, d) = (*s as usize * page_bytes, *d as usize * page_bytes);
                assert_eq!(
                    landing[d..d + page_bytes],
                    original[s..s + page_bytes],
                    "room {room}: page {d} of the decode"
                );
                expected[d..d + page_bytes].copy_from_slice(&original[s..s + page_bytes]);
            }
        }
        if let Some(i) = landing.iter().zip(&expected).position(|(a, b)| a != b) {
            panic!(
                "decode byte {i} is {:#x}, {:#x} expected: a byte outside every read changed",
                landing[i], expected[i]
            );
        }
        assert!(source == original, "the prefill's arena changed");
        assert!(
            other_landing.iter().all(|&b| b == POISON),
            "the refused read landed nothing"
        );
    });
}

/// A prefill that serves reads refuses the synthetic engine at start: its fill would write the
/// pattern into pages a read names.
#[test]
fn a_prefill_that_serves_reads_has_no_synthetic_engine() {
    let e = AgentOptions::from_flags([
        "--bootstrap",
        "http://127.0.0.1:1",
        "--serve-reads",
        "--synthetic",
    ])
    .expect("flags")
    .config()
    .expect_err("--serve-reads with --synthetic");
    assert!(
        e.to_string().contains("--serve-reads with --synthetic"),
        "{e}"
    );
}
