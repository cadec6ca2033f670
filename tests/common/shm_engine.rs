//! The engine side of the end-to-end format tests (`tests/processes/e2e_formats.rs`): `--pool shm:` files
//! the test owns as the engine, each holding one rank's KV tensors back to back in the format's
//! region order. Where an element lives comes from [`super::reference`] (the engines' documented
//! tensor shapes), never from kvferry's layout code. Every element is one little-endian u16, a
//! hash of what names it ([`value`]), never the poison the decode's file starts as; after the
//! rooms, [`expected_decode`] says what the decode's file must hold.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::owned;
use super::reference::{Dims, element_offsets, engine_regions};

/// The decode's file before any room: every byte.
pub const POISON: u8 = 0xDE;
/// Bytes of one element: the models here have 2-byte dtypes.
pub const ELEM: usize = 2;

/// An engine's KV memory format; the engine's tensor shapes are in `reference.rs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Kvferry,
    VllmCpuVec,
    VllmFlashNhd,
    VllmFlashHnd,
    FlashInfer,
    SglangMha,
    SglangMla,
}

impl Format {
    /// `--kv-format`, and the format's name in `reference.rs`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Kvferry => "kvferry",
            Format::VllmCpuVec => "vllm-cpu-vec",
            Format::VllmFlashNhd => "vllm-flash-nhd",
            Format::VllmFlashHnd => "vllm-flash-hnd",
            Format::FlashInfer => "flashinfer",
            Format::SglangMha => "sglang-mha",
            Format::SglangMla => "sglang-mla",
        }
    }

    /// Whether the engine never hands page 0 to a request: vLLM's block 0 is its null block,
    /// and SGLang's slot 0 (so its page 0) is the padding slot dummy tokens are written to.
    pub fn reserves_page0(self) -> bool {
        self != Format::Kvferry
    }

    /// vLLM CPU pages move as whole head slices: pieces start on page boundaries and a room's
    /// last page moves whole.
    pub fn whole_pages(self) -> bool {
        self == Format::VllmCpuVec
    }
}

/// The model's KV shape; always passed as explicit flags, so the agents hold what the test
/// computes whatever the preset.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub preset: &'static str,
    pub mla: bool,
    pub layers: usize,
    pub heads: usize,
    pub dim: usize,
    /// A 2-byte dtype: every element is one u16 of [`value`].
    pub dtype: &'static str,
}

impl Model {
    pub fn planes(&self) -> usize {
        if self.mla { 1 } else { 2 }
    }

    pub fn flags(&self) -> Vec<String> {
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
    pub fn bytes_per_token(&self) -> usize {
        self.layers * self.planes() * self.heads * self.dim * ELEM
    }
}

/// One rank's pool file, as the engine lays it out.
#[derive(Clone, Debug)]
pub struct Pool {
    pub format: Format,
    pub model: Model,
    /// Global KV heads this rank holds.
    pub heads: Range<usize>,
    pub page: usize,
    pub pages: usize,
    /// The rank's tensors in `reference.rs`'s terms.
    dims: Dims,
    /// `(regions, bytes of each)` of the engine's tensors.
    regions: (usize, usize),
}

/// Where an element is within a pool: (layer, plane (0 = K or latent, 1 = V), token slot in its
/// page, global head, dim).
pub type Coords = (usize, usize, usize, usize, usize);

impl Pool {
    pub fn new(
        format: Format,
        model: Model,
        heads: Range<usize>,
        page: usize,
        pages: usize,
    ) -> Pool {
        let dims = Dims {
            layers: model.layers,
            planes: model.planes(),
            pages,
            page_size: page,
            heads: heads.len(),
            head_bytes: model.dim * ELEM,
        };
        Pool {
            format,
            model,
            heads,
            page,
            pages,
            dims,
            regions: engine_regions(format.name(), dims),
        }
    }

    /// The file's size: every region of the engine's tensors.
    pub fn bytes(&self) -> usize {
        self.regions.0 * self.regions.1
    }

    /// Byte offsets in the file of every element (dim) of global head `head`, token slot `t`
    /// of page `page`, plane `plane`, layer `layer`: their places in the engine's tensors, the
    /// tensors back to back in the format's region order (SGLang MHA: a layer's K buffer, then
    /// its V buffer).
    pub fn head(
        &self,
        layer: usize,
        plane: usize,
        page: usize,
        t: usize,
        head: usize,
    ) -> Vec<usize> {
        assert!(
            self.heads.contains(&head),
            "head {head} outside {:?}",
            self.heads
        );
        let cell = (layer, plane, page, t, head - self.heads.start);
        let (region, offsets) = element_offsets(self.format.name(), self.dims, ELEM, cell);
        let base = region * self.regions.1;
        offsets.into_iter().map(|o| base + o).collect()
    }

    /// Every element of page `page`: its byte offset in the file and where it is.
    pub fn page_elems(&self, page: usize) -> impl Iterator<Item = (usize, Coords)> + '_ {
        let planes = self.model.planes();
        (0..self.model.layers).flat_map(move |layer| {
            (0..planes).flat_map(move |plane| {
                (0..self.page).flat_map(move |t| {
                    self.heads.clone().flat_map(move |head| {
                        let offsets = self.head(layer, plane, page, t, head);
                        (offsets.into_iter().enumerate())
                            .map(move |(d, e)| (e, (layer, plane, t, head, d)))
                    })
                })
            })
        })
    }

    /// The page and coordinates of every byte offset in `wanted` (a brute-force inverse of
    /// [`Pool::head`], for failure messages).
    pub fn locate(&self, wanted: &[usize]) -> Vec<(usize, (usize, String))> {
        (0..self.pages)
            .flat_map(|page| self.page_elems(page).map(move |found| (page, found)))
            .filter(|(_, (e, _))| wanted.contains(e))
            .map(|(page, (e, (layer, plane, t, head, d)))| {
                let at =
                    format!("layer {layer} plane {plane} page {page} slot {t} head {head} dim {d}");
                (e, (page, at))
            })
            .collect()
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
pub fn value(
    seed: u64,
    room: u64,
    layer: usize,
    plane: usize,
    head: usize,
    t: usize,
    d: usize,
) -> u16 {
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

/// What a prefill's file holds where no room wrote: noise, by element of the file.
pub fn noise(seed: u64, e: usize) -> u16 {
    mix(!seed ^ (e as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)) as u16
}

/// Writes the element at byte offset `at`.
pub fn put(image: &mut [u8], at: usize, v: u16) {
    image[at..at + ELEM].copy_from_slice(&v.to_le_bytes());
}

/// Reads the element at byte offset `at`.
pub fn get(image: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([image[at], image[at + 1]])
}

/// A piece the prefill engine announces.
#[derive(Clone, Debug)]
pub struct Piece {
    pub tokens: Range<usize>,
    pub layers: Range<usize>,
}

/// One room as the engines see it.
#[derive(Clone, Debug)]
pub struct RoomPlan {
    pub id: u64,
    pub tokens: usize,
    /// The decode's block table.
    pub decode_pages: Vec<u32>,
    /// Each prefill rank's block table.
    pub prefill_pages: Vec<Vec<u32>>,
    /// In announcement order; one whole piece for most rooms.
    pub pieces: Vec<Piece>,
    /// The prefill engine announces before the decode engine asks.
    pub ready_first: bool,
}

impl RoomPlan {
    pub fn pieced(&self) -> bool {
        self.pieces.len() > 1
    }
}

/// A pool file the test owns as the engine, with the test's copy of what it should hold.
pub struct EngineFile {
    pub pool: Pool,
    pub path: PathBuf,
    file: File,
    /// The prefill's: what the engine wrote. (The decode's expected image is built at the end.)
    pub image: Mutex<Vec<u8>>,
}

impl EngineFile {
    /// Creates `path` holding `image`.
    pub fn create(pool: Pool, path: PathBuf, image: Vec<u8>) -> EngineFile {
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

    /// A prefill rank's file: noise in every element.
    pub fn noisy(pool: Pool, path: PathBuf, seed: u64) -> EngineFile {
        let mut image = vec![0u8; pool.bytes()];
        for e in 0..image.len() / ELEM {
            put(&mut image, e * ELEM, noise(seed, e));
        }
        EngineFile::create(pool, path, image)
    }

    pub fn read_all(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; self.pool.bytes()];
        self.file
            .read_exact_at(&mut bytes, 0)
            .unwrap_or_else(|e| panic!("reading {}: {e}", self.path.display()));
        bytes
    }

    /// Writes one piece of a room into the file as the engine would: only the piece's elements
    /// change (each touched (layer, plane, page) block is written back from the image, whose
    /// other bytes equal the file's).
    pub fn write_piece(&self, seed: u64, room: u64, pages: &[u32], piece: &Piece) {
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
                        for (d, e) in p
                            .head(layer, plane, page, slot, head)
                            .into_iter()
                            .enumerate()
                        {
                            put(&mut image, e, value(seed, room, layer, plane, head, t, d));
                            span.0 = span.0.min(e);
                            span.1 = span.1.max(e + ELEM);
                        }
                    }
                }
                for (lo, hi) in spans.into_iter().filter(|s| s.0 < s.1) {
                    self.file
                        .write_all_at(&image[lo..hi], lo as u64)
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

/// The decode's file as it must be after `rooms` landed: poison, each room's elements (the value
/// the prefill wrote for that layer, plane, global head, token and dim), and for vllm-cpu the
/// rest of each room's last page.
pub fn expected_decode(
    seed: u64,
    decode: &Pool,
    prefills: &[Arc<EngineFile>],
    rooms: &[RoomPlan],
) -> Vec<u8> {
    let mut exp = vec![POISON; decode.bytes()];
    let b = decode.page;
    let images: Vec<_> = prefills
        .iter()
        .map(|f| f.image.lock().expect("image lock"))
        .collect();
    for room in rooms {
        for layer in 0..decode.model.layers {
            for plane in 0..decode.model.planes() {
                for t in 0..room.tokens {
                    let page = room.decode_pages[t / b] as usize;
                    for head in decode.heads.clone() {
                        let offsets = decode.head(layer, plane, page, t % b, head);
                        for (d, e) in offsets.into_iter().enumerate() {
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
                // (Between pages of other sizes the room's tokens are re-blocked: exactly they
                // land.)
                let same_pages = prefills.iter().all(|f| f.pool.page == b);
                if decode.format.whole_pages() && same_pages && room.tokens % b != 0 {
                    let last = room.tokens / b;
                    let page = room.decode_pages[last] as usize;
                    for t in room.tokens % b..b {
                        for head in decode.heads.clone() {
                            let rank = prefills
                                .iter()
                                .position(|f| f.pool.heads.contains(&head))
                                .expect("a prefill rank holds every head");
                            let src_page = room.prefill_pages[rank][last] as usize;
                            let from = prefills[rank].pool.head(layer, plane, src_page, t, head);
                            let to = decode.head(layer, plane, page, t, head);
                            for (s, e) in from.into_iter().zip(to) {
                                put(&mut exp, e, get(&images[rank], s));
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
pub fn compare(
    what: &str,
    pool: &Pool,
    got: &[u8],
    want: &[u8],
    owner: &dyn Fn(usize) -> String,
) -> Option<String> {
    if got == want {
        return None;
    }
    let diff: Vec<usize> = (0..got.len())
        .step_by(ELEM)
        .filter(|&e| got[e..e + ELEM] != want[e..e + ELEM])
        .collect();
    let poison = diff
        .iter()
        .filter(|&&e| got[e..e + ELEM] == [POISON; ELEM])
        .count();
    let shown: Vec<usize> = diff.iter().copied().take(8).collect();
    let mut lines = Vec::new();
    for (e, (page, at)) in pool.locate(&shown) {
        lines.push(format!(
            "  element {} (byte {e}): {at} ({}): got {:#06x}, want {:#06x}",
            e / ELEM,
            owner(page),
            get(got, e),
            get(want, e)
        ));
    }
    Some(format!(
        "{what}: {} of {} elements differ ({poison} of them poison); the first:\n{}",
        diff.len(),
        got.len() / ELEM,
        lines.join("\n")
    ))
}

/// Takes every element of pool page `page` as it is in `got` (a failed room's page).
pub fn mask_page(pool: &Pool, page: usize, want: &mut [u8], got: &[u8]) {
    for (e, _) in pool.page_elems(page) {
        put(want, e, get(got, e));
    }
}
