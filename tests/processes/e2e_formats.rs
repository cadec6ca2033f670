//! End to end over engine memory formats (`--kv-format`): a real registry, prefill and decode
//! agents (release binary, loopback, zmq-tcp unless said) over `--pool shm:` files that this test owns as
//! the engine (`common/shm_engine.rs`). It writes each room's KV into the prefill's file where
//! the engine's tensors put it, announces it ready (whole, or in layer and token pieces), and
//! after the rooms reads the decode's file back.
//!
//! The expected bytes never come from kvferry's layout code: every format's place for an element
//! comes from the engines' documented tensor shapes (`common/reference.rs`), and every element's
//! value is a hash of (seed, room, layer, plane, global head, token, dim). The decode's file is
//! poisoned (0xDE) before; after, every element a room landed must hold the prefill's value and
//! every other byte must still be poison.
//!
//! Configurations (100 rooms each, 10 for the refused pair; 8 in flight; random lengths with
//! partial and exact last pages, random block tables on both sides, a third of the rooms
//! announced in pieces; three pairs with small chunks, so a layer's tokens go in several chunks):
//! - vllm-cpu-vec -> vllm-cpu-vec (page 16), TP1 -> TP1 and TP2 -> TP1 (each prefill rank half
//!   the heads); pages of 16 into pages of 32 (TP2 -> TP1) and 32 into 16, re-blocked
//!   (`vllm_cpu_vec_span`: exactly the room's tokens land, K transposed in each block);
//! - sglang-mha -> sglang-mha, page 1 and page 16;
//! - sglang-mla -> sglang-mla (an MLA shape);
//! - vllm-flash-nhd -> sglang-mha and flashinfer -> vllm-flash-hnd (token-granular formats
//!   exchange KV whatever their order and placement), and sglang-mha with one-token pages ->
//!   vllm-flash-hnd with 16 (and whatever their page sizes);
//! - vllm-cpu-vec -> kvferry, refused at Hello: every room fails `incompatible_layout`, naming
//!   the page orders, and the decode's file stays poison;
//! - over `zmq-ipc`, whose prefills write only into a decode's own sealed memory file, never
//!   into an engine's file (every chunk staged): sglang-mha TP2 -> TP1 and vllm-flash-nhd ->
//!   sglang-mha.
//!
//! Needs `cargo build --release --bin kvferry` first. Times are printed, bounds are generous.
//! `KVFERRY_TEST_SEED=<n>` repeats a run.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use common::shm_engine::{
    EngineFile, Format, Model, POISON, Piece, Pool, RoomPlan, compare, expected_decode, mask_page,
};
use common::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use reqwest::{Client, Method, StatusCode};
use serde_json::{Value, json};

/// Rooms in flight at once.
const IN_FLIGHT: usize = 8;
/// `--chunk-bytes` that cuts every room of more than a page or two into several chunks per
/// layer (on page boundaries), so chunks start mid-room in every format.
const SMALL_CHUNKS: usize = 12 << 10;
/// The agents' default `--chunk-bytes`.
const DEFAULT_CHUNKS: usize = 1 << 20;
/// Pages of each pool no room uses (they must stay poison on the decode).
const SPARE_PAGES: usize = 7;

const TINY: Model = Model {
    preset: "tiny",
    mla: false,
    layers: 4,
    heads: 4,
    dim: 32,
    dtype: "fp16",
};

/// A second MHA shape: other layer and head counts, wider heads, bf16.
const SMALL_BF16: Model = Model {
    preset: "tiny",
    mla: false,
    layers: 3,
    heads: 2,
    dim: 64,
    dtype: "bf16",
};

const TINY_MLA: Model = Model {
    preset: "tiny-mla",
    mla: true,
    layers: 3,
    heads: 1,
    dim: 72,
    dtype: "fp16",
};

/// One format pair.
#[derive(Clone, Copy, Debug)]
struct Config {
    tag: &'static str,
    model: Model,
    /// Tokens per page of the prefill's pool.
    page: usize,
    /// Tokens per page of the decode's pool (token-granular pools of other page sizes
    /// exchange KV in token rows).
    decode_page: usize,
    prefill: Format,
    prefill_tp: usize,
    decode: Format,
    rooms: usize,
    max_tokens: usize,
    /// Hello refuses the pair: every room fails `incompatible_layout`.
    refused: bool,
    /// `--chunk-bytes` of both agents: the default (1 MiB) sends a room's layers in one
    /// chunk; [`SMALL_CHUNKS`] cuts them into page runs.
    chunk_bytes: usize,
    /// `--transport` of every agent. Over `zmq-ipc` every chunk must be staged: a decode's
    /// engine file on /dev/shm cannot be sealed against shrinking, so no prefill maps it.
    transport: &'static str,
}

/// Draws the rooms: lengths (1 token, exactly one page, one page and a token, then a quarter
/// of exact multiples of the page and the rest uniform), block tables from a shuffled pool
/// (distinct in a room and across rooms; never page 0 where the engine reserves it), pieces.
/// Returns the rooms and the page counts of the decode's and the prefill's pools.
fn plan_rooms(cfg: &Config, rng: &mut StdRng) -> (Vec<RoomPlan>, usize, usize) {
    let b = cfg.page;
    let max_pages = cfg.max_tokens / b;
    let tokens: Vec<usize> = (0..cfg.rooms)
        .map(|i| match i {
            0 => 1,
            1 => b,
            2 => b + 1,
            _ if i % 4 == 0 => b * rng.random_range(1..=max_pages),
            _ => rng.random_range(1..=cfg.max_tokens),
        })
        .collect();
    let needed = |page: usize| -> usize { tokens.iter().map(|t| t.div_ceil(page)).sum() };
    let table = |format: Format, page: usize, rng: &mut StdRng| {
        let first = usize::from(format.reserves_page0());
        let pages = needed(page) + first + SPARE_PAGES;
        let mut free: Vec<u32> = (first as u32..pages as u32).collect();
        free.shuffle(rng);
        (pages, free)
    };
    let (decode_pages, mut decode_free) = table(cfg.decode, cfg.decode_page, rng);
    let mut prefill_pages = 0;
    let mut prefill_free: Vec<Vec<u32>> = (0..cfg.prefill_tp)
        .map(|_| {
            let (n, free) = table(cfg.prefill, b, rng);
            prefill_pages = n;
            free
        })
        .collect();
    let layers = cfg.model.layers;
    let rooms = tokens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let pages = n.div_ceil(b);
            let decode = decode_free.split_off(decode_free.len() - n.div_ceil(cfg.decode_page));
            let prefill = prefill_free
                .iter_mut()
                .map(|f| f.split_off(f.len() - pages))
                .collect();
            let pieces = if i % 3 == 0 && !cfg.refused {
                // Layer pieces (one to all layer boundaries), and a token cut for half of them
                // (anywhere for token-granular formats, on a page boundary for vllm-cpu).
                let mut cuts: Vec<usize> = (1..layers).filter(|_| rng.random_bool(0.6)).collect();
                if cuts.is_empty() {
                    cuts.push(rng.random_range(1..layers));
                }
                let mut bounds = vec![0];
                bounds.extend(cuts);
                bounds.push(layers);
                let token_cut = if !rng.random_bool(0.5) || n < 2 {
                    None
                } else if cfg.prefill.whole_pages() {
                    (pages > 1).then(|| b * rng.random_range(1..pages))
                } else {
                    Some(rng.random_range(1..n))
                };
                let token_bounds = match token_cut {
                    Some(c) => vec![0, c, n],
                    None => vec![0, n],
                };
                let mut pieces = Vec::new();
                for tw in token_bounds.windows(2) {
                    for w in bounds.windows(2) {
                        pieces.push(Piece {
                            tokens: tw[0]..tw[1],
                            layers: w[0]..w[1],
                        });
                    }
                }
                pieces
            } else {
                vec![Piece {
                    tokens: 0..n,
                    layers: 0..layers,
                }]
            };
            RoomPlan {
                id: 1000 + i as u64,
                tokens: n,
                decode_pages: decode,
                prefill_pages: prefill,
                pieces,
                ready_first: i % 2 == 1,
            }
        })
        .collect();
    (rooms, decode_pages, prefill_pages)
}

/// A pool file the test owns as the engine, with the test's copy of what it should hold.
/// The processes of one configuration; fields drop in order: agents before the registry.
struct Cluster {
    decode: Process,
    prefills: Vec<Process>,
    /// Kept until the agents have stopped.
    _registry: Process,
    logs: PathBuf,
}

fn start_cluster(cfg: &Config, decode: &EngineFile, prefills: &[Arc<EngineFile>]) -> Cluster {
    let exe = release_binary();
    let logs = kvferry::cluster::log_dir(&format!("e2e-formats-{}", cfg.tag)).expect("log dir");
    let registry = common::spawn(
        &exe,
        &[],
        "registry",
        &owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]),
        &[],
        &logs,
    );
    let url = registry.field("url").unwrap();
    let agent = |role: &str, name: &str, file: &EngineFile, format: Format, tp: (usize, usize)| {
        let page = match role {
            "decode" => cfg.decode_page,
            _ => cfg.page,
        };
        let opts = AgentOpts {
            model: cfg.model.preset,
            pool_pages: file.pool.pages,
            synthetic: false,
            transport: cfg.transport,
            ..AgentOpts::default()
        };
        let mut args = owned(&[role, "--bootstrap", &url]);
        args.extend(opts.args());
        set_flag(&mut args, "--page-size", &page.to_string());
        set_flag(&mut args, "--chunk-bytes", &cfg.chunk_bytes.to_string());
        args.extend(cfg.model.flags());
        args.extend(owned(&[
            "--kv-format",
            format.name(),
            "--pool",
            &format!("shm:{}", file.path.display()),
            "--tp-rank",
            &tp.0.to_string(),
            "--tp-size",
            &tp.1.to_string(),
        ]));
        common::spawn(&exe, &[], name, &args, &[], &logs)
    };
    let prefill_procs = prefills
        .iter()
        .enumerate()
        .map(|(r, f)| {
            agent(
                "prefill",
                &format!("prefill-tp{r}"),
                f,
                cfg.prefill,
                (r, cfg.prefill_tp),
            )
        })
        .collect();
    let decode = agent("decode", "decode", decode, cfg.decode, (0, 1));
    Cluster {
        decode,
        prefills: prefill_procs,
        _registry: registry,
        logs,
    }
}

/// What one room's driver needs.
struct Ctx {
    http: Client,
    seed: u64,
    cfg: Config,
    decode_api: String,
    prefill_apis: Vec<String>,
    prefills: Vec<Arc<EngineFile>>,
}

/// One room: ask, announce its pieces (writing each into the prefill files first), wait for
/// the end, check the decode's view, take it. `Err` names what went wrong.
async fn drive_room(ctx: Arc<Ctx>, room: RoomPlan) -> Result<Value, String> {
    let http = &ctx.http;
    let id = room.id;
    let decode_url = format!("{}/v1/rooms/{id}", ctx.decode_api);
    let request = json!({ "tokens": room.tokens, "pages": room.decode_pages });
    let ask = || async {
        let (status, v) = call(http, Method::POST, &decode_url, Some(&request)).await;
        if status != StatusCode::CREATED {
            return Err(format!(
                "room {id}: the decode answered {status} to {request}: {v}"
            ));
        }
        Ok(())
    };
    if !room.ready_first {
        ask().await?;
    }
    let last = room.pieces.len() - 1;
    for (i, piece) in room.pieces.iter().enumerate() {
        for (rank, file) in ctx.prefills.iter().enumerate() {
            file.write_piece(ctx.seed, id, &room.prefill_pages[rank], piece);
            let mut body = json!({ "tokens": room.tokens });
            if i == 0 {
                body["pages"] = json!(room.prefill_pages[rank]);
            }
            if room.pieced() {
                body["token_range"] = json!([piece.tokens.start, piece.tokens.end]);
                body["layer_range"] = json!([piece.layers.start, piece.layers.end]);
                body["last"] = json!(i == last);
            }
            let url = format!("{}/v1/rooms/{id}/ready", ctx.prefill_apis[rank]);
            let (status, v) = call(http, Method::POST, &url, Some(&body)).await;
            if status != StatusCode::ACCEPTED {
                return Err(format!(
                    "room {id}: prefill rank {rank} answered {status} to {body}: {v}"
                ));
            }
        }
    }
    if room.ready_first {
        ask().await?;
    }
    let v = wait_final(http, &ctx.decode_api, id).await;
    let (state, code) = (v["state"].as_str(), v["reason"]["code"].as_str());
    if ctx.cfg.refused {
        let message = v["reason"]["message"].as_str().unwrap_or_default();
        if state != Some("failed")
            || code != Some("incompatible_layout")
            || !message.contains("vllm_cpu_vec")
            || !message.contains("token_major")
        {
            return Err(format!(
                "room {id}: expected failed with incompatible_layout naming the page orders \
                 vllm_cpu_vec and token_major, got {v}"
            ));
        }
        // The prefill engine gives up on the room (nothing asked for it).
        for api in &ctx.prefill_apis {
            let url = format!("{api}/v1/rooms/{id}");
            let (status, pv) = call(http, Method::DELETE, &url, None).await;
            if status != StatusCode::OK {
                return Err(format!("room {id}: prefill abort answered {status}: {pv}"));
            }
        }
    } else {
        if state != Some("success") {
            return Err(format!(
                "room {id} ({} tokens, pieces {:?}): {v}",
                room.tokens, room.pieces
            ));
        }
        // Every prefill rank's view ends in success too.
        for api in &ctx.prefill_apis {
            let pv = wait_final(http, api, id).await;
            if pv["state"] != "success" {
                return Err(format!("room {id}: the prefill at {api} ended {pv}"));
            }
        }
    }
    let (v, _) = wait_safe(http, &ctx.decode_api, id).await;
    let (status, taken) = call(http, Method::POST, &format!("{decode_url}/take"), None).await;
    if status != StatusCode::OK {
        return Err(format!("room {id}: take answered {status}: {taken}"));
    }
    Ok(v)
}

/// Runs one configuration end to end.
fn run(cfg: Config) {
    let t0 = Instant::now();
    let seed = test_seed();
    println!(
        "[{}] {} (TP{}) -> {} (TP1), pages of {} and {} tokens, chunks of {} KiB, {:?}; seed {seed} \
         (KVFERRY_TEST_SEED repeats it)",
        cfg.tag,
        cfg.prefill.name(),
        cfg.prefill_tp,
        cfg.decode.name(),
        cfg.page,
        cfg.decode_page,
        cfg.chunk_bytes >> 10,
        cfg.model
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let (rooms, decode_pages, prefill_pages) = plan_rooms(&cfg, &mut rng);
    let shm = |role: &str| {
        PathBuf::from("/dev/shm").join(format!(
            "kvferry-e2e-formats-{}-{}-{role}",
            std::process::id(),
            cfg.tag
        ))
    };
    let per_rank = cfg.model.heads / cfg.prefill_tp;
    let prefills: Vec<Arc<EngineFile>> = (0..cfg.prefill_tp)
        .map(|r| {
            let heads = if cfg.model.mla {
                0..1
            } else {
                r * per_rank..(r + 1) * per_rank
            };
            let pool = Pool::new(cfg.prefill, cfg.model, heads, cfg.page, prefill_pages);
            let path = shm(&format!("prefill-tp{r}"));
            Arc::new(EngineFile::noisy(pool, path, seed ^ r as u64))
        })
        .collect();
    let decode_pool = Pool::new(
        cfg.decode,
        cfg.model,
        0..cfg.model.heads,
        cfg.decode_page,
        decode_pages,
    );
    let decode = EngineFile::create(
        decode_pool.clone(),
        shm("decode"),
        vec![POISON; decode_pool.bytes()],
    );
    let cluster = start_cluster(&cfg, &decode, &prefills);
    let setup = t0.elapsed();
    let ctx = Arc::new(Ctx {
        http: http(),
        seed,
        cfg,
        decode_api: cluster.decode.field("api").unwrap(),
        prefill_apis: cluster
            .prefills
            .iter()
            .map(|p| p.field("api").unwrap())
            .collect(),
        prefills: prefills.clone(),
    });
    let t1 = Instant::now();
    let results: Vec<(RoomPlan, Result<Value, String>)> = runtime().block_on(async {
        let mut set = tokio::task::JoinSet::new();
        let mut queue = rooms.iter().cloned();
        let spawn = |set: &mut tokio::task::JoinSet<(RoomPlan, Result<Value, String>)>,
                     room: RoomPlan| {
            let ctx = ctx.clone();
            set.spawn(async move {
                let r = drive_room(ctx, room.clone()).await;
                (room, r)
            });
        };
        for room in queue.by_ref().take(IN_FLIGHT) {
            spawn(&mut set, room);
        }
        let mut out = Vec::new();
        while let Some(done) = set.join_next().await {
            out.push(done.unwrap_or_else(|e| panic!("a room's driver panicked: {e}")));
            if let Some(room) = queue.next() {
                spawn(&mut set, room);
            }
        }
        out
    });
    let moved = t1.elapsed();
    let paths = ["direct", "staged"].map(|p| decode_chunks(cfg.tag, &ctx.decode_api, p));
    if cfg.transport == "zmq-ipc" && !cfg.refused {
        assert!(
            paths[0] == 0.0 && paths[1] > 0.0,
            "[{}] an engine's file mapped by a prefill: direct {} and staged {}",
            cfg.tag,
            paths[0],
            paths[1]
        );
    }
    // Rooms that went wrong are reported at the end, after the files were checked for the
    // others (their pages may hold anything and are left out of the comparison).
    let mut problems: Vec<String> = Vec::new();
    let failed: Vec<(&RoomPlan, &String)> = results
        .iter()
        .filter_map(|(room, r)| r.as_ref().err().map(|e| (room, e)))
        .collect();
    if !failed.is_empty() {
        let partial = failed
            .iter()
            .filter(|(r, _)| r.tokens % cfg.page != 0)
            .count();
        let partial_all = rooms.iter().filter(|r| r.tokens % cfg.page != 0).count();
        let pieced = failed.iter().filter(|(r, _)| r.pieced()).count();
        problems.push(format!(
            "{} of {} rooms went wrong ({partial} of them with a partial last page, of \
             {partial_all} such rooms; {pieced} announced in pieces; logs in {}):\n{}",
            failed.len(),
            results.len(),
            cluster.logs.display(),
            failed
                .iter()
                .map(|(_, e)| e.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }
    // Bytes landed, as the decode counts them (docs/engines.md, `bytes`): the room's tokens
    // for token-granular formats and vllm-cpu pages re-blocked between page sizes; for vllm-cpu
    // pages of one size, which move whole, every token slot of the pages the room touches.
    // Always what the decode expected.
    let bpt = cfg.model.bytes_per_token();
    for (room, r) in &results {
        let Ok(v) = r else { continue };
        let bytes = v["bytes"].as_u64().unwrap_or(u64::MAX) as usize;
        let tokens = room.tokens * bpt;
        let whole = room.tokens.div_ceil(cfg.decode_page) * cfg.decode_page * bpt;
        let want = if cfg.refused {
            0
        } else if cfg.decode.whole_pages() && cfg.page == cfg.decode_page {
            whole
        } else {
            tokens
        };
        let ok =
            bytes == want && (cfg.refused || v["expected_bytes"].as_u64() == Some(bytes as u64));
        if !ok {
            problems.push(format!(
                "room {} ({} tokens) counts {bytes} bytes landed, {want} expected: {v}",
                room.id, room.tokens
            ));
        }
    }

    // The files: the decode's as computed from the engines' shapes, the prefill's untouched by
    // its agent.
    let t2 = Instant::now();
    // A refused pair lands nothing: the decode's file stays all poison.
    let gone: Vec<u64> = failed.iter().map(|(r, _)| r.id).collect();
    let landed_rooms: Vec<RoomPlan> = rooms
        .iter()
        .filter(|r| !cfg.refused && !gone.contains(&r.id))
        .cloned()
        .collect();
    let mut want = expected_decode(seed, &decode_pool, &prefills, &landed_rooms);
    let got = decode.read_all();
    for (room, _) in &failed {
        for &page in &room.decode_pages {
            mask_page(&decode_pool, page as usize, &mut want, &got);
        }
    }
    let owner = |page: usize| {
        rooms
            .iter()
            .find_map(|r| {
                r.decode_pages
                    .iter()
                    .position(|&p| p as usize == page)
                    .map(|i| format!("room {} ({} tokens) page #{i}", r.id, r.tokens))
            })
            .unwrap_or_else(|| "a page no room used".to_owned())
    };
    let before = problems.len();
    problems.extend(compare(
        &format!("the decode's file {}", decode.path.display()),
        &decode_pool,
        &got,
        &want,
        &owner,
    ));
    for (r, f) in prefills.iter().enumerate() {
        let image = f.image.lock().expect("image lock").clone();
        problems.extend(compare(
            &format!("prefill rank {r}'s file (its agent must only read it)"),
            &f.pool,
            &f.read_all(),
            &image,
            &|_| String::new(),
        ));
    }
    let verify = t2.elapsed();
    let files = if problems.len() == before {
        "match"
    } else {
        "DIFFER"
    };
    let landed: usize = rooms.iter().map(|r| r.tokens).sum::<usize>() * bpt;
    let pieced = rooms.iter().filter(|r| r.pieced()).count();
    let most_chunks = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok()?["chunks"].as_u64())
        .max()
        .unwrap_or(0);
    println!(
        "[{}] {} rooms ({pieced} in pieces, {:.1} MiB of KV) {} in {:.0} ms over {} ({} chunks direct, {} staged); \
         up to {most_chunks} chunks a room; files {} ({:.0} ms); setup {:.0} ms, total {:.0} ms",
        cfg.tag,
        rooms.len(),
        landed as f64 / (1u64 << 20) as f64,
        if cfg.refused {
            "refused".to_owned()
        } else if failed.is_empty() {
            "landed".to_owned()
        } else {
            format!("ran, {} of them FAILED,", failed.len())
        },
        ms(moved),
        cfg.transport,
        paths[0],
        paths[1],
        files,
        ms(verify),
        ms(setup),
        ms(t0.elapsed())
    );
    assert!(
        problems.is_empty(),
        "[{}] {}",
        cfg.tag,
        problems.join("\n\n")
    );
    drop(cluster);
}

#[test]
fn vllm_cpu_to_vllm_cpu() {
    run(Config {
        tag: "vllm-cpu",
        model: TINY,
        page: 16,
        decode_page: 16,
        prefill: Format::VllmCpuVec,
        prefill_tp: 1,
        decode: Format::VllmCpuVec,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
        transport: "zmq-tcp",
    });
}

/// Two prefill ranks each holding half the heads (in their own files), one decode holding all.
#[test]
fn vllm_cpu_tp2_to_vllm_cpu_tp1() {
    run(Config {
        tag: "vllm-cpu-tp2",
        model: TINY,
        page: 16,
        decode_page: 16,
        prefill: Format::VllmCpuVec,
        prefill_tp: 2,
        decode: Format::VllmCpuVec,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: SMALL_CHUNKS,
        transport: "zmq-tcp",
    });
}

#[test]
fn sglang_mha_page_1() {
    run(Config {
        tag: "sglang-mha-p1",
        model: SMALL_BF16,
        page: 1,
        decode_page: 1,
        prefill: Format::SglangMha,
        prefill_tp: 1,
        decode: Format::SglangMha,
        rooms: 100,
        max_tokens: 120,
        refused: false,
        chunk_bytes: SMALL_CHUNKS,
        transport: "zmq-tcp",
    });
}

#[test]
fn sglang_mha_page_16() {
    run(SGLANG_MHA_P16);
}

/// sglang-mha to sglang-mha, one-page blocks of 16 tokens, over zmq-tcp.
const SGLANG_MHA_P16: Config = Config {
    tag: "sglang-mha-p16",
    model: TINY,
    page: 16,
    decode_page: 16,
    prefill: Format::SglangMha,
    prefill_tp: 1,
    decode: Format::SglangMha,
    rooms: 100,
    max_tokens: 160,
    refused: false,
    chunk_bytes: DEFAULT_CHUNKS,
    transport: "zmq-tcp",
};

#[test]
fn sglang_mla_to_sglang_mla() {
    run(Config {
        tag: "sglang-mla",
        model: TINY_MLA,
        page: 1,
        decode_page: 1,
        prefill: Format::SglangMla,
        prefill_tp: 1,
        decode: Format::SglangMla,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
        transport: "zmq-tcp",
    });
}

/// Token-granular formats exchange KV whatever their order, placement and regions.
#[test]
fn vllm_flash_nhd_to_sglang_mha() {
    run(NHD_TO_SGLANG);
}

/// vllm-flash-nhd to sglang-mha in small chunks, over zmq-tcp.
const NHD_TO_SGLANG: Config = Config {
    tag: "nhd-to-sglang",
    model: TINY,
    page: 16,
    decode_page: 16,
    prefill: Format::VllmFlashNhd,
    prefill_tp: 1,
    decode: Format::SglangMha,
    rooms: 100,
    max_tokens: 160,
    refused: false,
    chunk_bytes: SMALL_CHUNKS,
    transport: "zmq-tcp",
};

#[test]
fn flashinfer_to_vllm_flash_hnd() {
    run(Config {
        tag: "flashinfer-to-hnd",
        model: TINY,
        page: 16,
        decode_page: 16,
        prefill: Format::FlashInfer,
        prefill_tp: 1,
        decode: Format::VllmFlashHnd,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
        transport: "zmq-tcp",
    });
}

/// vLLM CPU pages cannot be cut into tokens: a token-major decode is refused at Hello, every
/// room fails `incompatible_layout` naming both page orders, and nothing lands.
#[test]
fn vllm_cpu_to_token_major_is_refused() {
    run(Config {
        tag: "vllm-cpu-refused",
        model: TINY,
        page: 16,
        decode_page: 16,
        prefill: Format::VllmCpuVec,
        prefill_tp: 1,
        decode: Format::Kvferry,
        rooms: 10,
        max_tokens: 160,
        refused: true,
        chunk_bytes: DEFAULT_CHUNKS,
        transport: "zmq-tcp",
    });
}

/// vLLM CPU vec pages of 16 tokens into pages of 32, from two prefill ranks, re-blocked.
#[test]
fn vllm_cpu_page_16_tp2_to_page_32() {
    run(Config {
        tag: "vllm-cpu-p16-to-p32",
        model: TINY,
        page: 16,
        decode_page: 32,
        prefill: Format::VllmCpuVec,
        prefill_tp: 2,
        decode: Format::VllmCpuVec,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: SMALL_CHUNKS,
        transport: "zmq-tcp",
    });
}

/// vLLM CPU vec pages of 32 tokens into pages of 16, re-blocked.
#[test]
fn vllm_cpu_page_32_to_page_16() {
    run(Config {
        tag: "vllm-cpu-p32-to-p16",
        model: TINY,
        page: 32,
        decode_page: 16,
        prefill: Format::VllmCpuVec,
        prefill_tp: 1,
        decode: Format::VllmCpuVec,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
        transport: "zmq-tcp",
    });
}

/// Token-granular pools of other page sizes exchange KV in token rows: SGLang's one-slot pages
/// into vLLM HND blocks of 16 (whose own order cannot meet one-slot page blocks).
#[test]
fn sglang_mha_page_1_to_vllm_flash_hnd_page_16() {
    run(Config {
        tag: "sglang-p1-to-hnd-p16",
        model: TINY,
        page: 1,
        decode_page: 16,
        prefill: Format::SglangMha,
        prefill_tp: 1,
        decode: Format::VllmFlashHnd,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: SMALL_CHUNKS,
        transport: "zmq-tcp",
    });
}

/// Two sglang-mha prefill ranks, each half the heads, into one decode over `zmq-ipc`, whose
/// engine file the prefills may not map: staged.
#[test]
fn sglang_mha_tp2_to_tp1_over_zmq_ipc() {
    run(Config {
        tag: "sglang-mha-tp2-ipc",
        prefill_tp: 2,
        transport: "zmq-ipc",
        ..SGLANG_MHA_P16
    });
}

/// vllm-flash-nhd into sglang-mha over `zmq-ipc`, into an engine file: staged.
#[test]
fn vllm_flash_nhd_to_sglang_mha_over_zmq_ipc() {
    run(Config {
        tag: "nhd-to-sglang-ipc",
        transport: "zmq-ipc",
        ..NHD_TO_SGLANG
    });
}
