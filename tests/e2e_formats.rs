//! End to end over engine memory formats (`--kv-format`): a real registry, prefill and decode
//! agents (release binary, loopback, zmq-tcp) over `--pool shm:` files that this test owns as
//! the engine. It writes each room's KV into the prefill's file where the engine's tensors put
//! it, announces it ready (whole, or in layer and token pieces), and after the rooms reads the
//! decode's file back.
//!
//! The expected bytes never come from kvferry's layout code: every format's place for an element
//! is written out below from the engine's documented tensor shape ([`Format::elem`]), and every
//! element's value is a hash of (seed, room, layer, plane, global head, token, dim) ([`value`]).
//! The decode's file is poisoned (0xDE) before; after, every element a room landed must hold the
//! prefill's value and every other byte must still be poison.
//!
//! Configurations (100 rooms each, 8 in flight; random lengths with partial and exact last pages,
//! random block tables on both sides, a third of the rooms announced in pieces; three pairs with
//! small chunks, so a layer's tokens go in several chunks):
//! - vllm-cpu -> vllm-cpu (page 16), TP1 -> TP1 and TP2 -> TP1 (each prefill rank half the heads);
//! - sglang-mha -> sglang-mha, page 1 and page 16;
//! - sglang-mla -> sglang-mla (an MLA shape);
//! - vllm-flash-nhd -> sglang-mha and flashinfer -> vllm-flash-hnd (token-granular formats
//!   exchange KV whatever their order and placement);
//! - vllm-cpu -> kvferry, refused at Hello: every room fails `incompatible_layout`, naming the
//!   page orders, and the decode's file stays poison.
//!
//! Needs `cargo build --release --bin kvferry` first. Times are printed, bounds are generous.
//! `KVFERRY_TEST_SEED=<n>` repeats a run.

mod common;

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};
use reqwest::{Client, Method, StatusCode};
use serde_json::{Value, json};

/// The decode's file before any room: every byte.
const POISON: u8 = 0xDE;
/// Rooms in flight at once.
const IN_FLIGHT: usize = 8;
/// `--chunk-bytes` that cuts every room of more than a page or two into several chunks per
/// layer (on page boundaries), so chunks start mid-room in every format.
const SMALL_CHUNKS: usize = 12 << 10;
/// The agents' default `--chunk-bytes`.
const DEFAULT_CHUNKS: usize = 1 << 20;
/// Pages of each pool no room uses (they must stay poison on the decode).
const SPARE_PAGES: usize = 7;

/// An engine's KV memory format, as the engine documents its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    /// kvferry's own pools: `[layer][plane][page][token][head][dim]`.
    Kvferry,
    /// vLLM's CPU backend: one buffer, per layer `[num_blocks, kv_heads, block_size, 2 *
    /// head_size]`, where the `(block, head)` slab is K transposed (`[head_size][block_size]`)
    /// then V (`[block_size][head_size]`).
    VllmCpu,
    /// vLLM flash-attention NHD: per layer `[2, num_blocks, block_size, kv_heads, head_size]`.
    VllmFlashNhd,
    /// vLLM flash-attention HND: per layer `[2, num_blocks, kv_heads, block_size, head_size]`.
    VllmFlashHnd,
    /// vLLM FlashInfer: per layer `[num_blocks, 2, block_size, kv_heads, head_size]`.
    FlashInfer,
    /// SGLang MHA: per layer a K buffer `[slots, kv_heads, head_dim]` and a V buffer the same,
    /// slot = page * page_size + offset.
    SglangMha,
    /// SGLang MLA: per layer `[slots, 1, kv_lora_rank + qk_rope_head_dim]`.
    SglangMla,
}

impl Format {
    /// `--kv-format`.
    fn name(self) -> &'static str {
        match self {
            Format::Kvferry => "kvferry",
            Format::VllmCpu => "vllm-cpu",
            Format::VllmFlashNhd => "vllm-flash-nhd",
            Format::VllmFlashHnd => "vllm-flash-hnd",
            Format::FlashInfer => "flashinfer",
            Format::SglangMha => "sglang-mha",
            Format::SglangMla => "sglang-mla",
        }
    }

    /// Whether the engine never hands page 0 to a request: vLLM's block 0 is its null block,
    /// and SGLang's slot 0 (so its page 0) is the padding slot dummy tokens are written to.
    fn reserves_page0(self) -> bool {
        self != Format::Kvferry
    }

    /// vLLM CPU pages move as whole head slices: pieces start on page boundaries and a room's
    /// last page moves whole.
    fn whole_pages(self) -> bool {
        self == Format::VllmCpu
    }
}

/// The model's KV shape; always passed as explicit flags, so the agents hold what the test
/// computes whatever the preset.
#[derive(Clone, Copy, Debug)]
struct Model {
    preset: &'static str,
    mla: bool,
    layers: usize,
    heads: usize,
    dim: usize,
    /// A 2-byte dtype: every element is one u16 of [`value`].
    dtype: &'static str,
}

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

impl Model {
    fn planes(&self) -> usize {
        if self.mla { 1 } else { 2 }
    }

    fn flags(&self) -> Vec<String> {
        owned(&[
            "--layers",
            &self.layers.to_string(),
            "--kv-heads",
            &self.heads.to_string(),
            "--head-dim",
            &self.dim.to_string(),
            "--dtype",
            self.dtype,
            "--attention",
            if self.mla { "mla" } else { "mha" },
        ])
    }

    /// KV bytes of one token over every layer, plane and head.
    fn bytes_per_token(&self) -> usize {
        self.layers * self.planes() * self.heads * self.dim * 2
    }
}

/// One rank's pool file, as the engine lays it out.
#[derive(Clone, Debug)]
struct Pool {
    format: Format,
    model: Model,
    /// Global KV heads this rank holds.
    heads: Range<usize>,
    page: usize,
    pages: usize,
}

impl Pool {
    fn elems(&self) -> usize {
        self.model.layers
            * self.model.planes()
            * self.heads.len()
            * self.page
            * self.pages
            * self.model.dim
    }

    fn bytes(&self) -> usize {
        self.elems() * 2
    }

    /// Index (in elements) in the file of element `d` of global head `head`, token slot `t` of
    /// page `page`, plane `plane` (0 = K or latent, 1 = V), layer `layer`: numpy-style strides of
    /// the engine's tensors, the tensors (regions) back to back in layer order (SGLang MHA: a
    /// layer's K buffer, then its V buffer).
    fn elem(
        &self,
        layer: usize,
        plane: usize,
        page: usize,
        t: usize,
        head: usize,
        d: usize,
    ) -> usize {
        let (n, b, dim) = (self.pages, self.page, self.model.dim);
        let nh = self.heads.len();
        let h = head - self.heads.start;
        debug_assert!(layer < self.model.layers && plane < self.model.planes());
        debug_assert!(page < n && t < b && h < nh && d < dim);
        match self.format {
            // [layer][plane][page][token][head][dim]
            Format::Kvferry => {
                ((((layer * self.model.planes() + plane) * n + page) * b + t) * nh + h) * dim + d
            }
            // per layer [num_blocks, kv_heads, 2 * block_size * head_size]: K^T then V.
            Format::VllmCpu => {
                let slab = (layer * n + page) * nh + h;
                let within = if plane == 0 {
                    d * b + t
                } else {
                    b * dim + t * dim + d
                };
                slab * 2 * b * dim + within
            }
            // per layer [2, num_blocks, block_size, kv_heads, head_size]
            Format::VllmFlashNhd => ((((layer * 2 + plane) * n + page) * b + t) * nh + h) * dim + d,
            // per layer [2, num_blocks, kv_heads, block_size, head_size]
            Format::VllmFlashHnd => ((((layer * 2 + plane) * n + page) * nh + h) * b + t) * dim + d,
            // per layer [num_blocks, 2, block_size, kv_heads, head_size]
            Format::FlashInfer => ((((layer * n + page) * 2 + plane) * b + t) * nh + h) * dim + d,
            // per layer: K [slots, kv_heads, head_dim], then V the same
            Format::SglangMha => {
                let slot = page * b + t;
                ((layer * 2 + plane) * (n * b) + slot) * nh * dim + h * dim + d
            }
            // per layer [slots, 1, latent]
            Format::SglangMla => {
                let slot = page * b + t;
                (layer * n * b + slot) * dim + d
            }
        }
    }

    /// The coordinates of every element index in `wanted` (a brute-force inverse of
    /// [`Pool::elem`], for failure messages).
    fn locate(&self, wanted: &[usize]) -> Vec<(usize, (usize, String))> {
        let mut found = Vec::new();
        for layer in 0..self.model.layers {
            for plane in 0..self.model.planes() {
                for page in 0..self.pages {
                    for t in 0..self.page {
                        for head in self.heads.clone() {
                            for d in 0..self.model.dim {
                                let e = self.elem(layer, plane, page, t, head, d);
                                if wanted.contains(&e) {
                                    found.push((
                                        e,
                                        (
                                            page,
                                            format!(
                                                "layer {layer} plane {plane} page {page} slot {t} head {head} dim {d}"
                                            ),
                                        ),
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
        found
    }
}

/// splitmix64's finalizer.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The value the engine writes for one KV element: a hash of everything that names it, never
/// the poison pattern.
fn value(seed: u64, room: u64, layer: usize, plane: usize, head: usize, t: usize, d: usize) -> u16 {
    assert!(layer < 64 && plane < 2 && head < 64 && t < 1 << 14 && d < 1 << 10);
    let key = ((((room << 6 | layer as u64) << 1 | plane as u64) << 6 | head as u64) << 14
        | t as u64)
        << 10
        | d as u64;
    let v = mix(seed ^ mix(key)) as u16;
    if v == u16::from_le_bytes([POISON, POISON]) {
        v ^ 1
    } else {
        v
    }
}

/// What the prefill's file holds where no room wrote: noise, by byte position.
fn noise(seed: u64, e: usize) -> u16 {
    mix(!seed ^ (e as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)) as u16
}

fn put(image: &mut [u8], e: usize, v: u16) {
    image[2 * e..2 * e + 2].copy_from_slice(&v.to_le_bytes());
}

fn get(image: &[u8], e: usize) -> u16 {
    u16::from_le_bytes([image[2 * e], image[2 * e + 1]])
}

/// One format pair.
#[derive(Clone, Copy, Debug)]
struct Config {
    tag: &'static str,
    model: Model,
    page: usize,
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
}

/// A piece the prefill engine announces.
#[derive(Clone, Debug)]
struct Piece {
    tokens: Range<usize>,
    layers: Range<usize>,
}

#[derive(Clone, Debug)]
struct RoomPlan {
    id: u64,
    tokens: usize,
    /// The decode's block table.
    decode_pages: Vec<u32>,
    /// Each prefill rank's block table.
    prefill_pages: Vec<Vec<u32>>,
    /// In announcement order; one whole piece for most rooms.
    pieces: Vec<Piece>,
    /// The prefill engine announces before the decode engine asks.
    ready_first: bool,
}

impl RoomPlan {
    fn pieced(&self) -> bool {
        self.pieces.len() > 1
    }
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
    let needed: usize = tokens.iter().map(|t| t.div_ceil(b)).sum();
    let table = |format: Format, rng: &mut StdRng| {
        let first = usize::from(format.reserves_page0());
        let pages = needed + first + SPARE_PAGES;
        let mut free: Vec<u32> = (first as u32..pages as u32).collect();
        free.shuffle(rng);
        (pages, free)
    };
    let (decode_pages, mut decode_free) = table(cfg.decode, rng);
    let mut prefill_pages = 0;
    let mut prefill_free: Vec<Vec<u32>> = (0..cfg.prefill_tp)
        .map(|_| {
            let (n, free) = table(cfg.prefill, rng);
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
            let decode = decode_free.split_off(decode_free.len() - pages);
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
struct EngineFile {
    pool: Pool,
    path: PathBuf,
    file: File,
    /// The prefill's: what the engine wrote. (The decode's expected image is built at the end.)
    image: Mutex<Vec<u8>>,
}

impl EngineFile {
    /// Creates `path` holding `image`.
    fn create(pool: Pool, path: PathBuf, image: Vec<u8>) -> EngineFile {
        assert_eq!(image.len(), pool.bytes());
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, &image).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        let file = File::options()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        EngineFile {
            pool,
            path,
            file,
            image: Mutex::new(image),
        }
    }

    fn read_all(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; self.pool.bytes()];
        self.file
            .read_exact_at(&mut bytes, 0)
            .unwrap_or_else(|e| panic!("reading {}: {e}", self.path.display()));
        bytes
    }

    /// Writes one piece of a room into the file as the engine would: only the piece's elements
    /// change (each touched (layer, plane, page) block is written back from the image, whose
    /// other bytes equal the file's).
    fn write_piece(&self, seed: u64, room: u64, pages: &[u32], piece: &Piece) {
        let p = &self.pool;
        let b = p.page;
        let first_page = piece.tokens.start / b;
        let n_pages = piece.tokens.end.div_ceil(b) - first_page;
        let mut image = self.image.lock().expect("image lock");
        for layer in piece.layers.clone() {
            for plane in 0..p.model.planes() {
                let mut spans = vec![(usize::MAX, 0usize); n_pages];
                for t in piece.tokens.clone() {
                    let (pi, slot) = (t / b, t % b);
                    let page = pages[pi] as usize;
                    let span = &mut spans[pi - first_page];
                    for head in p.heads.clone() {
                        for d in 0..p.model.dim {
                            let e = p.elem(layer, plane, page, slot, head, d);
                            put(&mut image, e, value(seed, room, layer, plane, head, t, d));
                            span.0 = span.0.min(e);
                            span.1 = span.1.max(e + 1);
                        }
                    }
                }
                for (lo, hi) in spans.into_iter().filter(|s| s.0 < s.1) {
                    self.file
                        .write_all_at(&image[2 * lo..2 * hi], 2 * lo as u64)
                        .unwrap_or_else(|e| panic!("writing {}: {e}", self.path.display()));
                }
            }
        }
    }
}

impl Drop for EngineFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The processes of one configuration; fields drop in order: agents before the registry.
struct Cluster {
    decode: Spawned,
    prefills: Vec<Spawned>,
    /// Kept until the agents have stopped.
    _registry: Spawned,
    logs: PathBuf,
}

fn start_cluster(cfg: &Config, decode: &EngineFile, prefills: &[Arc<EngineFile>]) -> Cluster {
    let exe = release_binary();
    let logs =
        kvferry::cli::cluster::log_dir(&format!("e2e-formats-{}", cfg.tag)).expect("log dir");
    let registry = Spawned::start(
        &exe,
        &[],
        "registry",
        &owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]),
        &[],
        &logs,
    );
    let url = registry.field("url");
    let agent = |role: &str, name: &str, file: &EngineFile, format: Format, tp: (usize, usize)| {
        let opts = AgentOpts {
            model: cfg.model.preset,
            pool_pages: file.pool.pages,
            synthetic: false,
            ..AgentOpts::default()
        };
        let mut args = owned(&[role, "--bootstrap", &url]);
        args.extend(opts.args());
        set_flag(&mut args, "--page-size", &cfg.page.to_string());
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
        Spawned::start(&exe, &[], name, &args, &[], &logs)
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

/// The decode's file as it must be after the rooms: poison, each room's elements (the value
/// the prefill wrote for that layer, plane, global head, token and dim), and for vllm-cpu the
/// rest of each room's last page.
fn expected_decode(
    cfg: &Config,
    seed: u64,
    decode: &Pool,
    prefills: &[Arc<EngineFile>],
    rooms: &[RoomPlan],
) -> Vec<u8> {
    let mut exp = vec![POISON; decode.bytes()];
    if cfg.refused {
        return exp;
    }
    let b = cfg.page;
    let images: Vec<_> = prefills
        .iter()
        .map(|f| f.image.lock().expect("image lock"))
        .collect();
    for room in rooms {
        for layer in 0..cfg.model.layers {
            for plane in 0..cfg.model.planes() {
                for t in 0..room.tokens {
                    let page = room.decode_pages[t / b] as usize;
                    for head in decode.heads.clone() {
                        for d in 0..cfg.model.dim {
                            let e = decode.elem(layer, plane, page, t % b, head, d);
                            put(&mut exp, e, value(seed, room.id, layer, plane, head, t, d));
                        }
                    }
                }
                // vLLM CPU pages move as whole (page, head) slices: a head's K block is K
                // transposed, [head_size][block_size], so the unused token slots of a room's
                // last page are interleaved with used ones and are not left out; kvferry moves
                // the whole K block and the whole V block (format.rs, Granularity::Head: "the
                // last page of a room moves whole"). So in the decode's last page, slots
                // tokens % B.. of K and of V hold what the prefill's last page holds there (here,
                // the prefill file's noise), for every head the decode holds, and nothing else
                // of the page or of any other page changes.
                if decode.format.whole_pages() && room.tokens % b != 0 {
                    let last = room.tokens / b;
                    let page = room.decode_pages[last] as usize;
                    for t in room.tokens % b..b {
                        for head in decode.heads.clone() {
                            let rank = prefills
                                .iter()
                                .position(|f| f.pool.heads.contains(&head))
                                .expect("a prefill rank holds every head");
                            let src = &prefills[rank].pool;
                            let src_page = room.prefill_pages[rank][last] as usize;
                            for d in 0..cfg.model.dim {
                                let v = get(
                                    &images[rank],
                                    src.elem(layer, plane, src_page, t, head, d),
                                );
                                put(&mut exp, decode.elem(layer, plane, page, t, head, d), v);
                            }
                        }
                    }
                }
            }
        }
    }
    exp
}

/// Names the first differing elements (with their coordinates and the room whose page they
/// are in) unless `got == want`.
fn compare(
    what: &str,
    pool: &Pool,
    got: &[u8],
    want: &[u8],
    owner: &dyn Fn(usize) -> String,
) -> Option<String> {
    if got == want {
        return None;
    }
    let diff: Vec<usize> = (0..got.len() / 2)
        .filter(|&e| got[2 * e..2 * e + 2] != want[2 * e..2 * e + 2])
        .collect();
    let poison = diff
        .iter()
        .filter(|&&e| got[2 * e..2 * e + 2] == [POISON, POISON])
        .count();
    let shown: Vec<usize> = diff.iter().copied().take(8).collect();
    let mut lines = Vec::new();
    for (e, (page, at)) in pool.locate(&shown) {
        lines.push(format!(
            "  element {e} (byte {}): {at} ({}): got {:#06x}, want {:#06x}",
            2 * e,
            owner(page),
            get(got, e),
            get(want, e)
        ));
    }
    Some(format!(
        "{what}: {} of {} elements differ ({poison} of them poison); the first:\n{}",
        diff.len(),
        got.len() / 2,
        lines.join("\n")
    ))
}

/// Takes every element of decode page `page` as it is in `got` (a failed room's page).
fn mask_page(pool: &Pool, page: usize, want: &mut [u8], got: &[u8]) {
    for layer in 0..pool.model.layers {
        for plane in 0..pool.model.planes() {
            for t in 0..pool.page {
                for head in pool.heads.clone() {
                    for d in 0..pool.model.dim {
                        let e = pool.elem(layer, plane, page, t, head, d);
                        put(want, e, get(got, e));
                    }
                }
            }
        }
    }
}

/// Runs one configuration end to end.
fn run(cfg: Config) {
    let t0 = Instant::now();
    let seed = test_seed();
    println!(
        "[{}] {} (TP{}) -> {} (TP1), page {}, chunks of {} KiB, {:?}; seed {seed} \
         (KVFERRY_TEST_SEED repeats it)",
        cfg.tag,
        cfg.prefill.name(),
        cfg.prefill_tp,
        cfg.decode.name(),
        cfg.page,
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
            let pool = Pool {
                format: cfg.prefill,
                model: cfg.model,
                heads,
                page: cfg.page,
                pages: prefill_pages,
            };
            let mut image = vec![0u8; pool.bytes()];
            for e in 0..pool.elems() {
                put(&mut image, e, noise(seed ^ r as u64, e));
            }
            Arc::new(EngineFile::create(
                pool,
                shm(&format!("prefill-tp{r}")),
                image,
            ))
        })
        .collect();
    let decode_pool = Pool {
        format: cfg.decode,
        model: cfg.model,
        heads: 0..cfg.model.heads,
        page: cfg.page,
        pages: decode_pages,
    };
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
        decode_api: cluster.decode.field("api"),
        prefill_apis: cluster.prefills.iter().map(|p| p.field("api")).collect(),
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
    // Bytes landed, as the decode counts them: the room's tokens for token-granular formats;
    // for vllm-cpu, whose last page moves whole, docs/operations.md does not say whether its
    // unused slots count, so either, and always what the decode expected.
    let bpt = cfg.model.bytes_per_token();
    for (room, r) in &results {
        let Ok(v) = r else { continue };
        let bytes = v["bytes"].as_u64().unwrap_or(u64::MAX) as usize;
        let tokens = room.tokens * bpt;
        let whole = room.tokens.div_ceil(cfg.page) * cfg.page * bpt;
        let ok = if cfg.refused {
            bytes == 0
        } else if cfg.decode.whole_pages() {
            (bytes == tokens || bytes == whole)
                && v["expected_bytes"].as_u64() == Some(bytes as u64)
        } else {
            bytes == tokens && v["expected_bytes"].as_u64() == Some(bytes as u64)
        };
        if !ok {
            problems.push(format!(
                "room {} ({} tokens) counts {bytes} bytes landed: {v}",
                room.id, room.tokens
            ));
        }
    }

    // The files: the decode's as computed from the engines' shapes, the prefill's untouched by
    // its agent.
    let t2 = Instant::now();
    let gone: Vec<u64> = failed.iter().map(|(r, _)| r.id).collect();
    let landed_rooms: Vec<RoomPlan> = rooms
        .iter()
        .filter(|r| !gone.contains(&r.id))
        .cloned()
        .collect();
    let mut want = expected_decode(&cfg, seed, &decode_pool, &prefills, &landed_rooms);
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
        "[{}] {} rooms ({pieced} in pieces, {:.1} MiB of KV) {} in {:.0} ms; up to {most_chunks} chunks a room; files {} ({:.0} ms); \
         setup {:.0} ms, total {:.0} ms",
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
        prefill: Format::VllmCpu,
        prefill_tp: 1,
        decode: Format::VllmCpu,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
    });
}

/// Two prefill ranks each holding half the heads (in their own files), one decode holding all.
#[test]
fn vllm_cpu_tp2_to_vllm_cpu_tp1() {
    run(Config {
        tag: "vllm-cpu-tp2",
        model: TINY,
        page: 16,
        prefill: Format::VllmCpu,
        prefill_tp: 2,
        decode: Format::VllmCpu,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: SMALL_CHUNKS,
    });
}

#[test]
fn sglang_mha_page_1() {
    run(Config {
        tag: "sglang-mha-p1",
        model: SMALL_BF16,
        page: 1,
        prefill: Format::SglangMha,
        prefill_tp: 1,
        decode: Format::SglangMha,
        rooms: 100,
        max_tokens: 120,
        refused: false,
        chunk_bytes: SMALL_CHUNKS,
    });
}

#[test]
fn sglang_mha_page_16() {
    run(Config {
        tag: "sglang-mha-p16",
        model: TINY,
        page: 16,
        prefill: Format::SglangMha,
        prefill_tp: 1,
        decode: Format::SglangMha,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
    });
}

#[test]
fn sglang_mla_to_sglang_mla() {
    run(Config {
        tag: "sglang-mla",
        model: TINY_MLA,
        page: 1,
        prefill: Format::SglangMla,
        prefill_tp: 1,
        decode: Format::SglangMla,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
    });
}

/// Token-granular formats exchange KV whatever their order, placement and regions.
#[test]
fn vllm_flash_nhd_to_sglang_mha() {
    run(Config {
        tag: "nhd-to-sglang",
        model: TINY,
        page: 16,
        prefill: Format::VllmFlashNhd,
        prefill_tp: 1,
        decode: Format::SglangMha,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: SMALL_CHUNKS,
    });
}

#[test]
fn flashinfer_to_vllm_flash_hnd() {
    run(Config {
        tag: "flashinfer-to-hnd",
        model: TINY,
        page: 16,
        prefill: Format::FlashInfer,
        prefill_tp: 1,
        decode: Format::VllmFlashHnd,
        rooms: 100,
        max_tokens: 160,
        refused: false,
        chunk_bytes: DEFAULT_CHUNKS,
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
        prefill: Format::VllmCpu,
        prefill_tp: 1,
        decode: Format::Kvferry,
        rooms: 10,
        max_tokens: 160,
        refused: true,
        chunk_bytes: DEFAULT_CHUNKS,
    });
}
