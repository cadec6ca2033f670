//! An engine embedding kvferry: in one process, a real registry, and a prefill and a decode
//! agent started on the engine's own KV memory (`start_with_pool` over `HostPool::engine`:
//! buffers the "engines" allocated, one per plane on the SGLang-style prefill, one per layer on
//! the vLLM-flash-style decode), driven through the Rust handles only. Rooms with random block
//! tables, lengths and layer-wise pieces land in place; every element the room moved is
//! compared with the engine tensors' strides (tests/common/reference.rs), every other byte of
//! the decode's buffers keeps its poison, and the engine's buffers are still its own afterwards.

// Registering engine memory is `unsafe` by contract (the engine vouches for its buffers).
#![allow(unsafe_code)]

use crate::common;

use std::time::Instant;

use common::reference::{Dims, engine_offset};
use kvferry::agent::AgentOptions;
use kvferry::agent::decode::{DecodeAgent, RoomRequest};
use kvferry::agent::prefill::{PrefillAgent, ReadyRequest};
use kvferry::agent::{AgentConfig, RoomError};
use kvferry::pool::HostPool;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use tokio_util::sync::CancellationToken;

const PAGES: usize = 48;
const PAGE: usize = 16;
const POISON: u8 = 0xDE;

/// One engine's KV buffers, allocated by the "engine", one per region of its format.
struct Engine {
    format: &'static str,
    buffers: Vec<Vec<u8>>,
}

impl Engine {
    fn pool(&mut self, cfg: &AgentConfig) -> HostPool {
        let regions = common::reference::regions(&mut self.buffers);
        // SAFETY: the buffers stay allocated and unmoved until the agents are joined, which
        // happens before the engines drop (see the end of the test).
        unsafe { HostPool::engine(cfg.layout.clone(), cfg.pool_pages, &regions) }
            .expect("the engine's regions fit the layout")
    }

    fn dims(&self, cfg: &AgentConfig) -> Dims {
        let l = &cfg.layout;
        Dims {
            layers: l.num_layers(),
            planes: l.planes(),
            pages: cfg.pool_pages,
            page_size: l.page_size,
            heads: l.num_heads(),
            head_bytes: l.head_bytes(),
        }
    }

    fn row(&self, cfg: &AgentConfig, cell: (usize, usize, usize, usize, usize)) -> &[u8] {
        let (region, offset) = engine_offset(self.format, self.dims(cfg), cell);
        &self.buffers[region][offset..offset + cfg.layout.head_bytes()]
    }
}

fn config(registry: &str, format: &str) -> AgentConfig {
    let (page, pages) = (PAGE.to_string(), PAGES.to_string());
    let flags = [
        "--bootstrap",
        registry,
        "--model",
        "tiny",
        "--page-size",
        &page,
        "--pool-pages",
        &pages,
        "--kv-format",
        format,
        "--host",
        "127.0.0.1",
        "--api-host",
        "127.0.0.1",
        "--chunk-bytes",
        "65536",
    ];
    AgentOptions::from_flags(flags)
        .expect("flags")
        .config()
        .expect("config")
}

fn engine(cfg: &AgentConfig, format: &'static str, fill: impl FnMut(&mut [u8])) -> Engine {
    let size = cfg
        .layout
        .region_bytes(cfg.pool_pages)
        .expect("region bytes");
    let mut fill = fill;
    let buffers = (0..cfg.layout.num_regions())
        .map(|_| {
            let mut b = vec![0u8; size];
            fill(&mut b);
            b
        })
        .collect();
    Engine { format, buffers }
}

#[test]
fn engines_in_different_formats_exchange_kv_in_place_through_the_handles() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    common::runtime().block_on(async {
        let shutdown = CancellationToken::new();
        let (registry, served) = common::registry_in_process(&shutdown).await;
        let (p_cfg, d_cfg) = (config(&registry, "sglang-mha"), config(&registry, "vllm-flash-hnd"));
        let mut p_engine = engine(&p_cfg, "sglang-mha", |b| rng.fill_bytes(b));
        let mut d_engine = engine(&d_cfg, "vllm-flash-hnd", |b| b.fill(POISON));
        let prefill = PrefillAgent::start_with_pool(p_cfg.clone(), p_engine.pool(&p_cfg), shutdown.clone())
            .await
            .expect("prefill agent");
        let decode = DecodeAgent::start_with_pool(d_cfg.clone(), d_engine.pool(&d_cfg), shutdown.clone())
            .await
            .expect("decode agent");
        // A pool that is not the configured one is refused, naming both.
        let mut other = engine(&p_cfg, "sglang-mha", |b| b.fill(0));
        let wrong = DecodeAgent::start_with_pool(d_cfg.clone(), other.pool(&p_cfg), shutdown.clone()).await;
        let e = wrong.err().expect("a pool of another layout is refused").to_string();
        assert!(e.contains("configured for"), "{e}");

        // Rooms: random lengths (partial last pages and whole ones), random block tables on
        // both sides that never share a page between rooms, some announced layer by layer.
        let mut src_free: Vec<u32> = (0..PAGES as u32).collect();
        let mut dst_free: Vec<u32> = (1..PAGES as u32).collect(); // vLLM's block 0 stays unused
        src_free.shuffle(&mut rng);
        dst_free.shuffle(&mut rng);
        let mut rooms = Vec::new();
        let t = Instant::now();
        for room in 1..=6u64 {
            let tokens = match room {
                1 => 3 * PAGE,
                _ => rng.random_range(1..=5 * PAGE),
            };
            let n = tokens.div_ceil(PAGE);
            let src: Vec<u32> = src_free.split_off(src_free.len() - n);
            let dst: Vec<u32> = dst_free.split_off(dst_free.len() - n);
            let requested = decode
                .request(
                    room,
                    RoomRequest {
                        tokens,
                        pages: Some(dst.clone()),
                        ..RoomRequest::default()
                    },
                )
                .await
                .expect("request");
            assert_eq!(requested.room, room);
            let layers = p_cfg.layout.num_layers();
            let pieces: Vec<(Option<[usize; 2]>, bool)> = match rng.random_bool(0.5) {
                true => (0..layers).map(|l| (Some([l, l + 1]), l + 1 == layers)).collect(),
                false => vec![(None, true)],
            };
            for (layer_range, last) in &pieces {
                prefill
                    .ready(
                        room,
                        ReadyRequest {
                            tokens,
                            pages: Some(src.clone()),
                            layer_range: *layer_range,
                            last: Some(*last),
                            ..ReadyRequest::default()
                        },
                    )
                    .await
                    .unwrap_or_else(|e| panic!("room {room} piece {layer_range:?}: {e}"));
            }
            rooms.push((room, tokens, src, dst, pieces.len()));
        }
        for (room, tokens, _, _, pieces) in &rooms {
            let view = common::final_view(&decode, *room).await;
            assert_eq!(
                view.state.name(),
                "success",
                "room {room} of {tokens} tokens in {pieces} piece(s): {:?}",
                view.reason
            );
            let taken = decode.take(*room).await.expect("take");
            assert_eq!(taken.verified, None, "engine memory: the engine verifies, not the agent");
        }
        println!("{} rooms requested, announced, landed and taken in {:?}", rooms.len(), t.elapsed());
        let e = decode.take(1).await.expect_err("a room is taken once");
        assert!(matches!(e, RoomError::UnknownRoom(1)), "{e}");

        shutdown.cancel();
        prefill.join().await;
        decode.join().await;
        served.await.unwrap().unwrap();

        // Every element of every room where the decode engine's tensors say, equal to the
        // prefill engine's; every other byte of the decode's buffers still poison.
        let l = &d_cfg.layout;
        let mut expected: Vec<Vec<u8>> = d_engine.buffers.iter().map(|b| vec![POISON; b.len()]).collect();
        for (room, tokens, src, dst, _) in &rooms {
            for layer in 0..l.num_layers() {
                for plane in 0..l.planes() {
                    for t in 0..*tokens {
                        for h in 0..l.num_heads() {
                            let from = (layer, plane, src[t / PAGE] as usize, t % PAGE, h);
                            let to = (layer, plane, dst[t / PAGE] as usize, t % PAGE, h);
                            let want = p_engine.row(&p_cfg, from);
                            assert_eq!(
                                d_engine.row(&d_cfg, to),
                                want,
                                "room {room}: layer {layer} plane {plane} token {t} head {h}"
                            );
                            let (region, offset) = engine_offset(d_engine.format, d_engine.dims(&d_cfg), to);
                            expected[region][offset..offset + want.len()].copy_from_slice(want);
                        }
                    }
                }
            }
        }
        for (r, (got, want)) in d_engine.buffers.iter().zip(&expected).enumerate() {
            if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                panic!("decode region {r} byte {i} is {:#x}, {:#x} expected: a byte outside every room changed", got[i], want[i]);
            }
        }
        drop(other);
    });
}
