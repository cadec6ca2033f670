//! The synthetic engine built into the agents (`--synthetic`): the prefill fills a room's pages
//! with a deterministic pattern and the decode checks the landed bytes against it on take.
//!
//! The unit of the pattern is a *head slice*: the `head_bytes` bytes of one token, layer,
//! plane and head ([`Element`]), which every kernel and transport moves whole. Each is a body
//! and, in a stamped token ([`Stamped`]), a stamp over the body's start:
//! - the *stamp*, its first [`STAMP_BYTES`] bytes (all of a shorter head), encodes the room,
//!   the token's position in the room, the global layer, the plane and the global head
//!   ([`stamp`]). Bytes of another room, page, layer or head carry another stamp, and a stamp
//!   of the expected room decodes to the element it was written for ([`read_stamp`]), so a
//!   misrouted landing is reported with where it came from.
//! - the *body*, the rest, depends on (global layer, plane, global head, word) only
//!   ([`body_word`]). Not on the room: a pool page's body is written once and serves every room
//!   the page holds later. Not on the token either: a pool page holds other tokens in other
//!   rooms, and pools of different page sizes exchange KV. A byte shifted inside a head slice
//!   meets another word's pattern, a shifted head slice brings another stamp.
//!
//! Global coordinates make every pairing verify element by element, whatever the two pools'
//! layouts: heterogeneous TP (a decode rank holds a slice of a prefill's heads), PP layer
//! ranges, layer-wise and token-range pieces, and a decode's `start_token`. Stamps are KV bytes
//! like any other: no data path can move a head slice without its stamp.
//!
//! Fill ([`Filler`], the prefill): the first fill of a page writes the body of the whole page
//! (every token slot, layer, plane and head) and marks the page; every fill writes the stamps of
//! its piece's stamped tokens in place. Only the fill writes a prefill's pool, so a marked page keeps its body for
//! the pool's life. A device pool is written through the kernel: each fill writes its piece's
//! bytes whole, bodies included.
//!
//! Verify ([`Verify`], the decode): `full` gathers each layer and compares every byte; `stamp`
//! reads each stamp and, per stamped token of a layer's plane, one body word of one head slice,
//! in place on a host pool (gathered on a device pool).
//!
//! Which tokens carry stamps ([`Stamped`]) follows the same mode, set on both agents (`kvferry
//! bench` does): `full` stamps every token; `stamp` one token in [`STAMP_EVERY`] (which one
//! rotating with the room) and the room's last token, so that any range a decode takes, down
//! to one token, holds a stamp of every layer, plane and head. Writing and reading a stamp
//! touches its head slice's cache line, a quarter of the room's lines when every token is
//! stamped: as much memory traffic as the transfer itself when rooms run in parallel on a
//! small machine. A decode in `full` mode behind a prefill in `stamp` mode finds the body
//! where a stamp belongs and says so ([`Found::Body`]).

use std::ops::Range;
use std::sync::Mutex;

use super::agent_pool::AgentPool;
use crate::kernel::{KernelError, Selection};
use crate::layout::{KvLayout, PageOrder};
use crate::pool::{HostPool, PoolError};

/// Bytes of the stamp at the start of every head slice (a shorter head is all stamp).
pub const STAMP_BYTES: usize = 8;

/// In `stamp` mode, one token in this many carries stamps (besides the room's last).
pub const STAMP_EVERY: usize = 16;

/// Which tokens a synthetic prefill stamps and how a synthetic decode checks a landed room on
/// take (`--synthetic-verify`, set alike on both agents).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Verify {
    /// A prefill stamps one token in [`STAMP_EVERY`] and the room's last; a decode reads those
    /// stamps and one body word per stamped token, layer and plane: catches another room's
    /// bytes, bytes that never landed, and a head slice on the wrong page, layer or head, for
    /// a sixteenth of the memory traffic (kvferry bench's default).
    Stamp,
    /// A prefill stamps every token; a decode checks every byte (kvferry demo's).
    #[default]
    Full,
}

impl Verify {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Verify::Stamp => "stamp",
            Verify::Full => "full",
        }
    }
}

/// One head slice of a room: a token position, a global layer, a plane, a global head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Element {
    /// Token position in the room.
    pub token: usize,
    /// Global layer.
    pub layer: usize,
    /// Plane (0 = K or latent, 1 = V).
    pub plane: usize,
    /// Global head.
    pub head: usize,
}

impl std::fmt::Display for Element {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Element {
            token,
            layer,
            plane,
            head,
        } = self;
        write!(
            f,
            "head {head}, plane {plane}, token {token}, layer {layer}"
        )
    }
}

/// What a wrong stamp holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// The stamp of another head slice of the same room: a misrouted landing.
    Element(Element),
    /// No stamp of this room: another room's bytes, bytes that never landed, or a damaged
    /// stamp.
    Foreign,
    /// The body's first word, which a stamp covers: a head slice its prefill did not stamp.
    Body,
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Found::Element(e) => write!(f, "the stamp of {e} of this room"),
            Found::Foreign => f.write_str(
                "no stamp of this room (another room's bytes, bytes that never landed, or a \
                 damaged stamp)",
            ),
            Found::Body => f.write_str(
                "the pattern's body, no stamp (a prefill with --synthetic-verify stamp stamps one \
                 token in 16; set the mode alike on both agents)",
            ),
        }
    }
}

/// Errors of the synthetic engine: landed bytes that differ from the pattern, located, or a
/// copy that failed.
#[derive(Debug, thiserror::Error)]
pub enum SyntheticError {
    /// A head slice's stamp is not the one expected.
    #[error("the stamp of {element} is wrong: it holds {found}")]
    Stamp {
        /// Where.
        element: Element,
        /// What it holds instead.
        found: Found,
    },
    /// A body byte differs.
    #[error("byte {byte} of {element} differs from the pattern")]
    Mismatch {
        /// Where.
        element: Element,
        /// Byte within the head slice.
        byte: usize,
    },
    /// The pool could not be read or written in place.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The kernel could not gather or scatter the selection.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser: a bijection of u64 whose every output bit depends on every input
/// bit.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The inverse of [`mix`] (the multipliers' inverses modulo 2^64, the shifts undone).
fn unmix(mut x: u64) -> u64 {
    x ^= (x >> 31) ^ (x >> 62);
    x = x.wrapping_mul(0x3196_42B2_D24D_8EC3);
    x ^= (x >> 27) ^ (x >> 54);
    x = x.wrapping_mul(0x96DE_1B17_3F11_9089);
    x ^ (x >> 30) ^ (x >> 60)
}

/// A room's key: what its stamps are encrypted with.
fn room_key(room: u64) -> u64 {
    mix(room.wrapping_add(GOLDEN))
}

/// The element packed in 64 bits: token (32 bits), layer (16), plane (1), head (15). Larger
/// coordinates alias (a room of 2^32 tokens, a model of 65536 layers or 32768 KV heads).
fn pack(e: Element) -> u64 {
    ((e.token as u64 & 0xFFFF_FFFF) << 32)
        | ((e.layer as u64 & 0xFFFF) << 16)
        | ((e.plane as u64 & 1) << 15)
        | (e.head as u64 & 0x7FFF)
}

fn unpack(x: u64) -> Element {
    Element {
        token: (x >> 32) as usize,
        layer: ((x >> 16) & 0xFFFF) as usize,
        plane: ((x >> 15) & 1) as usize,
        head: (x & 0x7FFF) as usize,
    }
}

/// The stamp of one head slice of `room` (little-endian in memory, cut to the head's bytes).
pub fn stamp(room: u64, e: Element) -> u64 {
    keyed_stamp(room_key(room), e)
}

/// [`stamp`] with the room's key computed once.
fn keyed_stamp(key: u64, e: Element) -> u64 {
    mix(pack(e) ^ key)
}

/// The stamps of `tokens` x every local head of one block (local `layer`, `plane`) of a room
/// keyed `key`, token-major, [`stamp_len`] bytes each, into `out`.
fn block_stamps(
    l: &KvLayout,
    key: u64,
    (layer, plane): (usize, usize),
    tokens: &[usize],
    out: &mut Vec<u8>,
) {
    let sb = stamp_len(l);
    out.clear();
    for &token in tokens {
        for h in 0..l.num_heads() {
            let s = keyed_stamp(key, element(l, layer, plane, token, h)).to_le_bytes();
            match sb {
                STAMP_BYTES => out.extend_from_slice(&s),
                _ => out.extend_from_slice(&s[..sb]),
            }
        }
    }
}

/// Which tokens of a room carry stamps (see the module's doc).
#[derive(Clone, Copy, Debug)]
pub struct Stamped {
    /// `Some(r)`: tokens `t` with `t % STAMP_EVERY == r`, and `last`; `None`: every token.
    every: Option<usize>,
    last: usize,
}

impl Stamped {
    /// The stamped tokens of `room`, of `room_tokens` tokens, in `mode`.
    pub fn new(room: u64, room_tokens: usize, mode: Verify) -> Self {
        Stamped {
            every: (mode == Verify::Stamp).then_some((room % STAMP_EVERY as u64) as usize),
            last: room_tokens.saturating_sub(1),
        }
    }

    /// Whether `token` carries stamps.
    pub fn holds(&self, token: usize) -> bool {
        self.every
            .is_none_or(|r| token % STAMP_EVERY == r || token == self.last)
    }
}

/// The stamped head slices of `tokens` of a room in a pool, token-major (`[token][local
/// head]`), for reading or writing a layer's plane of them at once.
struct StampedSlices {
    /// The stamped tokens, in order.
    tokens: Vec<usize>,
    /// Per head slice: the page's index in the room and the slice's offset from the block's
    /// start.
    at: Vec<(usize, usize)>,
}

impl StampedSlices {
    fn new(l: &KvLayout, tokens: &Range<usize>, stamped: Stamped) -> Self {
        let (ps, nh) = (l.page_size, l.num_heads());
        let tokens: Vec<usize> = tokens.clone().filter(|&t| stamped.holds(t)).collect();
        let at = tokens
            .iter()
            .flat_map(|&t| (0..nh).map(move |h| (t / ps, l.element_offset(t % ps, h))))
            .collect();
        StampedSlices { tokens, at }
    }

    /// The slices' offsets in `host` for local `layer` and `plane` of a room held in `pages`,
    /// into `out`.
    fn offsets(
        &self,
        host: &HostPool,
        (layer, plane): (usize, usize),
        pages: &[u32],
        out: &mut Vec<usize>,
    ) -> Result<(), PoolError> {
        out.clear();
        let mut block = None;
        for &(p, at) in &self.at {
            let base = match block {
                Some((bp, base)) if bp == p => base,
                _ => host.block_offset(layer, plane, pages[p] as usize)?,
            };
            block = Some((p, base));
            out.push(base + at);
        }
        Ok(())
    }
}

/// The element a stamp of `room` was written for (meaningless for another room's stamp).
pub fn read_stamp(room: u64, stamp: u64) -> Element {
    unpack(unmix(stamp) ^ room_key(room))
}

/// Word `word` of the body of a head slice of (global) `layer`, `plane` and `head`; word 0 is
/// under the stamp.
pub fn body_word(layer: usize, plane: usize, head: usize, word: usize) -> u64 {
    let x = ((layer as u64) << 44) ^ ((plane as u64) << 43) ^ ((head as u64) << 24) ^ word as u64;
    mix(x.wrapping_mul(GOLDEN) ^ 0xB0D1_B0D1_B0D1_B0D1)
}

/// The body of every head slice of one (global) layer: `[plane][local head][head bytes]`.
fn body_rows(l: &KvLayout, layer: usize) -> Vec<u8> {
    let hb = l.head_bytes();
    let mut rows = vec![0; l.planes() * l.num_heads() * hb];
    for (i, row) in rows.chunks_mut(hb).enumerate() {
        let (plane, head) = (i / l.num_heads(), l.heads.start + i % l.num_heads());
        for (w, bytes) in row.chunks_mut(8).enumerate() {
            let word = body_word(layer, plane, head, w).to_le_bytes();
            bytes.copy_from_slice(&word[..bytes.len()]);
        }
    }
    rows
}

/// Bytes of the stamp in a head slice of `l`.
fn stamp_len(l: &KvLayout) -> usize {
    l.head_bytes().min(STAMP_BYTES)
}

/// The element of (local) `layer`, `plane`, `token` and local head `h` of a pool of `l`.
fn element(l: &KvLayout, layer: usize, plane: usize, token: usize, h: usize) -> Element {
    Element {
        token,
        layer: l.layers.start + layer,
        plane,
        head: l.heads.start + h,
    }
}

fn layer_selection<'a>(
    l: &KvLayout,
    pages: &'a [u32],
    tokens: &Range<usize>,
    local: usize,
) -> Selection<'a> {
    Selection {
        pages,
        tokens: tokens.clone(),
        layers: local..local + 1,
        heads: 0..l.num_heads(),
    }
}

/// Refuses a page list too short for `tokens` (before anything indexes it).
fn covers(l: &KvLayout, pages: &[u32], tokens: &Range<usize>) -> Result<(), KernelError> {
    let needed = l.pages_for(tokens.end);
    if pages.len() < needed {
        return Err(KernelError::TooFewPages {
            start: tokens.start,
            end: tokens.end,
            needed,
            listed: pages.len(),
        });
    }
    Ok(())
}

/// The prefill's synthetic fill, with which pool pages hold the body already.
#[derive(Debug)]
pub(crate) struct Filler {
    /// `bodies[p]`: page `p` holds the body in every slot, layer, plane and head.
    bodies: Mutex<Vec<bool>>,
    /// Which tokens get stamps ([`Stamped`]).
    mode: Verify,
}

impl Filler {
    /// The fill of a pool of `num_pages` pages, none holding the body yet, stamping the
    /// tokens `mode` says.
    pub(crate) fn new(num_pages: usize, mode: Verify) -> Self {
        Filler {
            bodies: Mutex::new(vec![false; num_pages]),
            mode,
        }
    }

    /// Fills `tokens` x local `layers` of `room` (of `room_tokens` tokens), held in `pages`,
    /// every head the pool holds: the body of pages that lack it, then the piece's stamps.
    pub(crate) fn fill(
        &self,
        pool: &AgentPool,
        (room, room_tokens): (u64, usize),
        pages: &[u32],
        tokens: Range<usize>,
        layers: Range<usize>,
    ) -> Result<(), SyntheticError> {
        let Some(host) = pool.host() else {
            // Every byte, so every stamp.
            return fill_whole(pool, room, pages, tokens, layers);
        };
        let l = pool.layout();
        covers(l, pages, &tokens)?;
        let touched = &pages[tokens.start / l.page_size..l.pages_for(tokens.end)];
        {
            // Held while the bodies are written, so that each page gets its body once: a fill
            // of another piece on the same page finds it marked instead of writing the body
            // again over this piece's stamps.
            let mut bodies = self.bodies.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(&page) = touched.iter().find(|&&p| p as usize >= bodies.len()) {
                return Err(KernelError::PageOutOfRange {
                    page,
                    num_pages: bodies.len(),
                }
                .into());
            }
            let mut fresh: Vec<u32> = touched
                .iter()
                .copied()
                .filter(|&p| !bodies[p as usize])
                .collect();
            fresh.sort_unstable();
            fresh.dedup();
            if !fresh.is_empty() {
                write_bodies(pool, &fresh)?;
                for p in fresh {
                    bodies[p as usize] = true;
                }
            }
        }
        let stamped = Stamped::new(room, room_tokens, self.mode);
        write_stamps(host, room, pages, (tokens, stamped), layers)
    }
}

/// Writes the body into every slot, layer, plane and head of `pages`.
fn write_bodies(pool: &AgentPool, pages: &[u32]) -> Result<(), SyntheticError> {
    let l = pool.layout();
    let tokens = 0..pages.len() * l.page_size;
    let plane_row = l.num_heads() * l.head_bytes();
    let mut buf = Vec::new();
    for local in 0..l.num_layers() {
        let rows = body_rows(l, l.layers.start + local);
        buf.clear();
        for row in rows.chunks(plane_row) {
            for _ in tokens.clone() {
                buf.extend_from_slice(row);
            }
        }
        let sel = layer_selection(l, pages, &tokens, local);
        pool.scatter(&buf, PageOrder::TokenMajor, &sel)?;
    }
    Ok(())
}

/// Writes the stamps of the stamped ones of `tokens` x local `layers`, in place: one write
/// per layer's plane.
fn write_stamps(
    host: &HostPool,
    room: u64,
    pages: &[u32],
    (tokens, stamped): (Range<usize>, Stamped),
    layers: Range<usize>,
) -> Result<(), SyntheticError> {
    let l = host.layout();
    let key = room_key(room);
    let slices = StampedSlices::new(l, &tokens, stamped);
    let (mut buf, mut at) = (Vec::new(), Vec::new());
    for local in layers {
        for plane in 0..l.planes() {
            block_stamps(l, key, (local, plane), &slices.tokens, &mut buf);
            slices.offsets(host, (local, plane), pages, &mut at)?;
            host.write_pieces(0, &at, &buf)?;
        }
    }
    Ok(())
}

/// Fills a piece through the kernel, every byte of it (a pool with no access in place).
fn fill_whole(
    pool: &AgentPool,
    room: u64,
    pages: &[u32],
    tokens: Range<usize>,
    layers: Range<usize>,
) -> Result<(), SyntheticError> {
    let l = pool.layout();
    let (hb, sb) = (l.head_bytes(), stamp_len(l));
    let mut buf = Vec::new();
    for local in layers {
        let rows = body_rows(l, l.layers.start + local);
        buf.clear();
        for plane in 0..l.planes() {
            for token in tokens.clone() {
                for h in 0..l.num_heads() {
                    let at = buf.len();
                    buf.extend_from_slice(&rows[(plane * l.num_heads() + h) * hb..][..hb]);
                    let s = stamp(room, element(l, local, plane, token, h)).to_le_bytes();
                    buf[at..at + sb].copy_from_slice(&s[..sb]);
                }
            }
        }
        pool.scatter(
            &buf,
            PageOrder::TokenMajor,
            &layer_selection(l, pages, &tokens, local),
        )?;
    }
    Ok(())
}

/// Checks `tokens` of `room`, held in `pages`, against the pattern, as `mode` says; the room
/// ends at `tokens.end`. The first difference is reported, in (layer, plane, token, head)
/// order (in `stamp` mode on a host pool, a layer's plane's stamps before its body words).
pub(crate) fn verify(
    pool: &AgentPool,
    room: u64,
    pages: &[u32],
    tokens: Range<usize>,
    mode: Verify,
) -> Result<(), SyntheticError> {
    let l = pool.layout();
    covers(l, pages, &tokens)?;
    let stamped = Stamped::new(room, tokens.end, mode);
    if let (Verify::Stamp, Some(host)) = (mode, pool.host()) {
        return verify_in_place(host, room, pages, (tokens, stamped));
    }
    let mut got = Vec::new();
    for local in 0..l.num_layers() {
        let sel = layer_selection(l, pages, &tokens, local);
        got.resize(sel.bytes_in(l, PageOrder::TokenMajor)?, 0);
        pool.gather(&sel, PageOrder::TokenMajor, &mut got)?;
        check_gathered(l, (room, stamped), local, &tokens, mode, &got)?;
    }
    Ok(())
}

/// `stamp` verification of a host pool, in place: the stamps of a layer's plane in one read,
/// then its sampled body words one read each.
fn verify_in_place(
    host: &HostPool,
    room: u64,
    pages: &[u32],
    (tokens, stamped): (Range<usize>, Stamped),
) -> Result<(), SyntheticError> {
    let l = host.layout();
    let (nh, hb, sb) = (l.num_heads(), l.head_bytes(), stamp_len(l));
    let key = room_key(room);
    let slices = StampedSlices::new(l, &tokens, stamped);
    let (mut at, mut want) = (Vec::new(), Vec::new());
    let mut held = vec![0; slices.at.len() * sb];
    let mut word = [0; 8];
    for local in 0..l.num_layers() {
        let rows = body_rows(l, l.layers.start + local);
        for plane in 0..l.planes() {
            slices.offsets(host, (local, plane), pages, &mut at)?;
            host.read_pieces(0, &at, &mut held)?;
            block_stamps(l, key, (local, plane), &slices.tokens, &mut want);
            if held != want {
                // Locate the first wrong one.
                for (i, stamp) in held.chunks_exact(sb).enumerate() {
                    let e = element(l, local, plane, slices.tokens[i / nh], i % nh);
                    check_stamp(l, room, e, stamp, tokens.end)?;
                }
            }
            for (i, &token) in slices.tokens.iter().enumerate() {
                let Some((h, body)) = sampled(l, local, plane, token) else {
                    continue;
                };
                let word = &mut word[..body.len()];
                host.read_into(at[i * nh + h] + body.start, word)?;
                let row = &rows[(plane * nh + h) * hb..][..hb];
                let e = element(l, local, plane, token, h);
                check_body(e, word, &row[body.clone()], body.start)?;
            }
        }
    }
    Ok(())
}

/// Checks one local layer gathered token-major (`[plane][token][local head][head bytes]`): the
/// head slices of the `stamped` tokens, their body bytes as `mode` says.
fn check_gathered(
    l: &KvLayout,
    (room, stamped): (u64, Stamped),
    local: usize,
    tokens: &Range<usize>,
    mode: Verify,
    got: &[u8],
) -> Result<(), SyntheticError> {
    let (nh, hb, sb) = (l.num_heads(), l.head_bytes(), stamp_len(l));
    let rows = body_rows(l, l.layers.start + local);
    let mut slices = got.chunks_exact(hb);
    for plane in 0..l.planes() {
        for token in tokens.clone() {
            for h in 0..nh {
                let Some(slice) = slices.next() else {
                    return Ok(());
                };
                if !stamped.holds(token) {
                    continue;
                }
                let e = element(l, local, plane, token, h);
                check_stamp(l, room, e, &slice[..sb], tokens.end)?;
                let body = match mode {
                    Verify::Full => sb..hb,
                    Verify::Stamp => match sampled(l, local, plane, token) {
                        Some((sh, body)) if sh == h => body,
                        _ => continue,
                    },
                };
                let row = &rows[(plane * nh + h) * hb..][..hb];
                check_body(e, &slice[body.clone()], &row[body.clone()], body.start)?;
            }
        }
    }
    Ok(())
}

/// The body bytes `stamp` verification reads of a stamped token (local `layer`, `plane`), if
/// its head slices have a body: one word of one local head, the head and the word rotating.
/// Few, beside the stamps the check reads anyway: the bodies are the same in every room, so
/// they catch bytes moved within a head slice or never written, which a few samples of a room
/// find.
fn sampled(
    l: &KvLayout,
    layer: usize,
    plane: usize,
    token: usize,
) -> Option<(usize, Range<usize>)> {
    let (hb, turn) = (l.head_bytes(), token / STAMP_EVERY + layer);
    let body_words = hb.div_ceil(8).saturating_sub(1);
    if body_words == 0 {
        return None;
    }
    let w = 1 + turn % body_words;
    Some(((turn + plane) % l.num_heads(), w * 8..(w * 8 + 8).min(hb)))
}

/// Checks the stamp `held` of element `e` of `room` (a room of `room_tokens` tokens); a wrong
/// one says whose it is when it is another of the room's.
fn check_stamp(
    l: &KvLayout,
    room: u64,
    e: Element,
    held: &[u8],
    room_tokens: usize,
) -> Result<(), SyntheticError> {
    let want = stamp(room, e).to_le_bytes();
    if held == &want[..held.len()] {
        return Ok(());
    }
    let mut bytes = [0; 8];
    bytes[..held.len()].copy_from_slice(held);
    let from = read_stamp(room, u64::from_le_bytes(bytes));
    let ours = held.len() == STAMP_BYTES
        && from.token < room_tokens
        && from.layer < l.model.num_layers
        && from.plane < l.planes()
        && from.head < l.model.num_kv_heads;
    let body = body_word(e.layer, e.plane, e.head, 0).to_le_bytes();
    let found = if ours {
        Found::Element(from)
    } else if held == &body[..held.len()] {
        Found::Body
    } else {
        Found::Foreign
    };
    Err(SyntheticError::Stamp { element: e, found })
}

/// Compares body bytes of `e` starting at byte `first` of the head slice.
fn check_body(e: Element, got: &[u8], want: &[u8], first: usize) -> Result<(), SyntheticError> {
    if got == want {
        return Ok(());
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(SyntheticError::Mismatch {
            element: e,
            byte: first + i,
        }),
    }
}

/// The synthetic engine as the agents call it, and only where it is configured
/// (`--synthetic`, as tests, `kvferry demo` and `kvferry bench` run the agents): a prefill has
/// it fill the pages the agent allocated for a room, and announce a whole room layer by layer
/// when `--synthetic-layer-ms` is set; a decode has it check a landed room's bytes on take.
/// Without it an agent serves only an engine's own pages and checks nothing.
pub(crate) struct SyntheticEngine {
    filler: Filler,
    mode: Verify,
    layer_delay: std::time::Duration,
}

impl SyntheticEngine {
    /// The engine `cfg` configures for a pool of `num_pages` pages, if any.
    pub(crate) fn configured(
        cfg: &super::AgentConfig,
        num_pages: usize,
    ) -> Option<std::sync::Arc<Self>> {
        cfg.synthetic.then(|| {
            std::sync::Arc::new(SyntheticEngine {
                filler: Filler::new(num_pages, cfg.synthetic_verify),
                mode: cfg.synthetic_verify,
                layer_delay: cfg.synthetic_layer_delay,
            })
        })
    }

    /// The pause before each layer of a whole room, when rooms are announced layer by layer.
    pub(crate) fn layer_pacing(&self) -> Option<std::time::Duration> {
        (!self.layer_delay.is_zero()).then_some(self.layer_delay)
    }

    /// Fills `tokens` x local `layers` of `room` (id, tokens), held in `pages`, on the
    /// blocking pool; `keep` (the pages' lease) travels with the fill, so that an abort
    /// meanwhile cannot hand the pages out.
    pub(crate) async fn fill(
        self: &std::sync::Arc<Self>,
        pool: &AgentPool,
        room: (u64, usize),
        (pages, keep): (std::sync::Arc<[u32]>, impl Send + 'static),
        tokens: Range<usize>,
        layers: Range<usize>,
    ) -> Result<(), super::RoomError> {
        let (engine, pool) = (self.clone(), pool.clone());
        tokio::task::spawn_blocking(move || {
            let _keep = keep;
            engine.filler.fill(&pool, room, &pages, tokens, layers)
        })
        .await
        .map_err(|e| super::RoomError::Unavailable(e.to_string()))?
        .map_err(|e| super::RoomError::BadRequest(e.to_string()))
    }

    /// Checks the landed `tokens` of `room`, held in `pages`, on the blocking pool; the
    /// difference found, if any.
    pub(crate) async fn check(
        &self,
        pool: &AgentPool,
        room: u64,
        pages: std::sync::Arc<[u32]>,
        tokens: Range<usize>,
    ) -> Result<(), String> {
        let (pool, mode) = (pool.clone(), self.mode);
        tokio::task::spawn_blocking(move || verify(&pool, room, &pages, tokens, mode))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
    }
}

#[cfg(test)]
mod tests;
