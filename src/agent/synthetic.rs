//! The synthetic engine built into the agents (`--synthetic`): the prefill fills a room's pages
//! with a deterministic pattern and the decode checks the landed bytes against it on take.
//!
//! The unit of the pattern is a *head slice*: the `head_bytes` bytes of one token, layer,
//! plane and head ([`Element`]), which every kernel and transport moves whole. Each is a stamp
//! and a body:
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
//! its piece in place. Only the fill writes a prefill's pool, so a marked page keeps its body for
//! the pool's life. A device pool is written through the kernel: each fill writes its piece's
//! bytes whole, bodies included.
//!
//! Verify ([`Verify`], the decode): `full` gathers each layer and compares every byte; `stamp`
//! reads every stamp and one body word of one head slice in [`SAMPLE_EVERY`], in place on a
//! host pool (gathered on a device pool).

use std::ops::Range;
use std::sync::Mutex;

use super::pool::AgentPool;
use crate::kernel::{KernelError, Selection};
use crate::layout::{KvLayout, PageOrder};
use crate::pool::{HostPool, PoolError};

/// Bytes of the stamp at the start of every head slice (a shorter head is all stamp).
pub const STAMP_BYTES: usize = 8;

/// `stamp` verification also reads one body word of every this-many head slices of a layer's
/// plane (spread over heads and tokens, the word rotating).
pub const SAMPLE_EVERY: usize = 16;

/// How a synthetic decode checks a landed room on take (`--synthetic-verify`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Verify {
    /// Every stamp and a sample of the other bytes: catches another room's bytes, bytes that
    /// never landed, and a head slice on the wrong page, layer or head, for a fraction of the
    /// memory reads of `full` (kvferry bench's default).
    Stamp,
    /// Every byte (kvferry demo's).
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
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Found::Element(e) => write!(f, "the stamp of {e} of this room"),
            Found::Foreign => f.write_str(
                "no stamp of this room (another room's bytes, bytes that never landed, or a \
                 damaged stamp)",
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

/// The stamps of tokens `t0..t1` x every local head of one block (local `layer`, `plane`) of a
/// room keyed `key`, token-major, [`stamp_len`] bytes each, into `out`.
fn block_stamps(
    l: &KvLayout,
    key: u64,
    (layer, plane): (usize, usize),
    tokens: Range<usize>,
    out: &mut Vec<u8>,
) {
    let sb = stamp_len(l);
    out.clear();
    for token in tokens {
        for h in 0..l.num_heads() {
            let s = keyed_stamp(key, element(l, layer, plane, token, h)).to_le_bytes();
            match sb {
                STAMP_BYTES => out.extend_from_slice(&s),
                _ => out.extend_from_slice(&s[..sb]),
            }
        }
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
}

impl Filler {
    /// The fill of a pool of `num_pages` pages, none holding the body yet.
    pub(crate) fn new(num_pages: usize) -> Self {
        Filler {
            bodies: Mutex::new(vec![false; num_pages]),
        }
    }

    /// Fills `tokens` x local `layers` of `room`, held in `pages`, every head the pool holds:
    /// the body of pages that lack it, then the piece's stamps.
    pub(crate) fn fill(
        &self,
        pool: &AgentPool,
        room: u64,
        pages: &[u32],
        tokens: Range<usize>,
        layers: Range<usize>,
    ) -> Result<(), SyntheticError> {
        let Some(host) = pool.host() else {
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
        write_stamps(host, room, pages, tokens, layers)
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

/// Offsets of a block's head slices from the block's start, token-major: `[slot][local head]`.
fn slice_offsets(l: &KvLayout) -> Vec<usize> {
    (0..l.page_size * l.num_heads())
        .map(|i| l.element_offset(i / l.num_heads(), i % l.num_heads()))
        .collect()
}

/// The pages `tokens` cover: `(page index in the room, first token, end token)`, a page's
/// tokens at a time.
fn page_runs(ps: usize, tokens: &Range<usize>) -> impl Iterator<Item = (usize, usize, usize)> {
    let (start, end) = (tokens.start, tokens.end);
    (start / ps..end.div_ceil(ps)).map(move |p| (p, (p * ps).max(start), ((p + 1) * ps).min(end)))
}

/// Writes the stamps of `tokens` x local `layers`, in place: one write per block.
fn write_stamps(
    host: &HostPool,
    room: u64,
    pages: &[u32],
    tokens: Range<usize>,
    layers: Range<usize>,
) -> Result<(), SyntheticError> {
    let l = host.layout();
    let (ps, nh, key) = (l.page_size, l.num_heads(), room_key(room));
    let at = slice_offsets(l);
    let mut buf = Vec::with_capacity(ps * nh * STAMP_BYTES);
    for local in layers {
        for plane in 0..l.planes() {
            for (p, t0, t1) in page_runs(ps, &tokens) {
                block_stamps(l, key, (local, plane), t0..t1, &mut buf);
                let block = host.block_offset(local, plane, pages[p] as usize)?;
                let slots = t0 - p * ps..t1 - p * ps;
                host.write_pieces(block, &at[slots.start * nh..slots.end * nh], &buf)?;
            }
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

/// Checks `tokens` of `room`, held in `pages`, against the pattern, as `mode` says. The first
/// difference is reported, in (layer, plane, token, head) order.
pub(crate) fn verify(
    pool: &AgentPool,
    room: u64,
    pages: &[u32],
    tokens: Range<usize>,
    mode: Verify,
) -> Result<(), SyntheticError> {
    let l = pool.layout();
    covers(l, pages, &tokens)?;
    if let (Verify::Stamp, Some(host)) = (mode, pool.host()) {
        return verify_in_place(host, room, pages, tokens);
    }
    let mut got = Vec::new();
    for local in 0..l.num_layers() {
        let sel = layer_selection(l, pages, &tokens, local);
        got.resize(sel.bytes_in(l)?, 0);
        pool.gather(&sel, PageOrder::TokenMajor, &mut got, None)?;
        check_gathered(l, room, local, &tokens, mode, &got)?;
    }
    Ok(())
}

/// `stamp` verification of a host pool, in place: the stamps one read per block, the sampled
/// body words one read each.
fn verify_in_place(
    host: &HostPool,
    room: u64,
    pages: &[u32],
    tokens: Range<usize>,
) -> Result<(), SyntheticError> {
    let l = host.layout();
    let (ps, nh, hb, sb) = (l.page_size, l.num_heads(), l.head_bytes(), stamp_len(l));
    let at = slice_offsets(l);
    let key = room_key(room);
    let (mut held, mut want) = (vec![0; ps * nh * sb], Vec::with_capacity(ps * nh * sb));
    let mut word = [0; 8];
    for local in 0..l.num_layers() {
        let rows = body_rows(l, l.layers.start + local);
        for plane in 0..l.planes() {
            for (p, t0, t1) in page_runs(ps, &tokens) {
                let block = host.block_offset(local, plane, pages[p] as usize)?;
                let slots = t0 - p * ps..t1 - p * ps;
                let held = &mut held[..(t1 - t0) * nh * sb];
                host.read_pieces(block, &at[slots.start * nh..slots.end * nh], held)?;
                block_stamps(l, key, (local, plane), t0..t1, &mut want);
                if *held != *want {
                    // Locate the first wrong one.
                    for (i, stamp) in held.chunks_exact(sb).enumerate() {
                        let e = element(l, local, plane, t0 + i / nh, i % nh);
                        check_stamp(l, room, e, stamp, tokens.end)?;
                    }
                }
                // One head slice in SAMPLE_EVERY: (token + h) % SAMPLE_EVERY == 0.
                for token in t0..t1 {
                    let first = (SAMPLE_EVERY - token % SAMPLE_EVERY) % SAMPLE_EVERY;
                    for h in (first..nh).step_by(SAMPLE_EVERY) {
                        let Some(body) = sampled(hb, local, plane, token, h) else {
                            continue;
                        };
                        let word = &mut word[..body.len()];
                        host.read_into(block + at[(token - p * ps) * nh + h] + body.start, word)?;
                        let row = &rows[(plane * nh + h) * hb..][..hb];
                        let e = element(l, local, plane, token, h);
                        check_body(e, word, &row[body.clone()], body.start)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks one local layer gathered token-major (`[plane][token][local head][head bytes]`).
fn check_gathered(
    l: &KvLayout,
    room: u64,
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
                let e = element(l, local, plane, token, h);
                check_stamp(l, room, e, &slice[..sb], tokens.end)?;
                let body = match mode {
                    Verify::Full => sb..hb,
                    Verify::Stamp => match sampled(hb, local, plane, token, h) {
                        Some(body) => body,
                        None => continue,
                    },
                };
                let row = &rows[(plane * nh + h) * hb..][..hb];
                check_body(e, &slice[body.clone()], &row[body.clone()], body.start)?;
            }
        }
    }
    Ok(())
}

/// The body bytes `stamp` verification reads of a head slice, if any: one word of one head
/// slice in [`SAMPLE_EVERY`] (spread over heads and tokens), the word rotating with the token,
/// layer and plane.
fn sampled(hb: usize, local: usize, plane: usize, token: usize, h: usize) -> Option<Range<usize>> {
    let body_words = hb.div_ceil(8).saturating_sub(1);
    if body_words == 0 || (token + h) % SAMPLE_EVERY != 0 {
        return None;
    }
    let w = 1 + (token / SAMPLE_EVERY + local + plane) % body_words;
    Some(w * 8..(w * 8 + 8).min(hb))
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
    let found = if ours {
        Found::Element(from)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::EnginePool;
    use crate::layout::ModelSpec;

    fn host_pool(layout: KvLayout, pages: usize) -> AgentPool {
        AgentPool::new(
            EnginePool::Host(HostPool::anonymous(layout, pages).unwrap()),
            1,
        )
        .unwrap()
    }

    fn tiny() -> KvLayout {
        KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap()
    }

    /// Byte offset of a head slice (local layer, plane, page, slot, local head) in a pool.
    fn at(
        pool: &AgentPool,
        layer: usize,
        plane: usize,
        page: usize,
        slot: usize,
        h: usize,
    ) -> usize {
        let host = pool.host().unwrap();
        host.block_offset(layer, plane, page).unwrap() + host.layout().element_offset(slot, h)
    }

    /// Copies one whole block (local layer, plane, page) over another.
    fn copy_block(pool: &AgentPool, from: (usize, usize, usize), to: (usize, usize, usize)) {
        let host = pool.host().unwrap();
        let n = host.layout().block_bytes().unwrap();
        let bytes = host
            .read(host.block_offset(from.0, from.1, from.2).unwrap(), n)
            .unwrap();
        host.write(host.block_offset(to.0, to.1, to.2).unwrap(), &bytes)
            .unwrap();
    }

    fn stamp_error(r: Result<(), SyntheticError>) -> (Element, Found) {
        match r {
            Err(SyntheticError::Stamp { element, found }) => (element, found),
            other => panic!("expected a stamp error, got {other:?}"),
        }
    }

    #[test]
    fn mix_is_inverted_and_stamps_decode() {
        let mut x = 0x0123_4567_89AB_CDEFu64;
        for _ in 0..1000 {
            assert_eq!(unmix(mix(x)), x);
            x = x.wrapping_mul(GOLDEN).wrapping_add(1);
        }
        let e = Element {
            token: 4095,
            layer: 31,
            plane: 1,
            head: 7,
        };
        assert_eq!(read_stamp(42, stamp(42, e)), e);
        assert_ne!(read_stamp(43, stamp(42, e)), e);
    }

    #[test]
    fn stamps_and_bodies_separate_every_coordinate() {
        let e = Element {
            token: 2,
            layer: 3,
            plane: 1,
            head: 5,
        };
        let base = stamp(1, e);
        for other in [
            stamp(2, e),
            stamp(1, Element { token: 3, ..e }),
            stamp(1, Element { layer: 4, ..e }),
            stamp(1, Element { plane: 0, ..e }),
            stamp(1, Element { head: 6, ..e }),
        ] {
            assert_ne!(base, other);
        }
        let body = body_word(3, 1, 5, 6);
        for other in [
            body_word(4, 1, 5, 6),
            body_word(3, 0, 5, 6),
            body_word(3, 1, 6, 6),
            body_word(3, 1, 5, 7),
        ] {
            assert_ne!(body, other);
        }
    }

    #[test]
    fn a_room_verifies_in_both_modes_and_a_flipped_body_byte_fails_full() {
        // A slice of heads and layers, as a TP/PP rank holds.
        let layout = tiny().with_slice(1..3, 1..4).unwrap();
        let pool = host_pool(layout.clone(), 8);
        let filler = Filler::new(8);
        let pages = [5, 2, 7];
        filler.fill(&pool, 42, &pages, 0..40, 0..3).unwrap();
        for mode in [Verify::Stamp, Verify::Full] {
            verify(&pool, 42, &pages, 0..40, mode).unwrap();
            // A decode's start_token mid-page.
            verify(&pool, 42, &pages, 19..40, mode).unwrap();
        }
        // Flip byte 43 of layer 2 (local 1), V plane, token 17 (page 2 at slot 1), head 2
        // (local 1): a body byte that `stamp` does not sample (token + local head is 18).
        let host = pool.host().unwrap();
        let off = at(&pool, 1, 1, 2, 1, 1) + 43;
        let b = host.read(off, 1).unwrap()[0];
        host.write(off, &[!b]).unwrap();
        verify(&pool, 42, &pages, 0..40, Verify::Stamp).unwrap();
        let e = Element {
            token: 17,
            layer: 2,
            plane: 1,
            head: 2,
        };
        match verify(&pool, 42, &pages, 0..40, Verify::Full) {
            Err(SyntheticError::Mismatch { element, byte }) => assert_eq!((element, byte), (e, 43)),
            other => panic!("{other:?}"),
        }
        let msg = verify(&pool, 42, &pages, 0..40, Verify::Full)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "byte 43 of head 2, plane 1, token 17, layer 2 differs from the pattern"
        );
    }

    #[test]
    fn another_rooms_stamps_fail_stamp_verification() {
        let pool = host_pool(tiny(), 8);
        let filler = Filler::new(8);
        filler.fill(&pool, 42, &[3, 4], 0..20, 0..4).unwrap();
        let (e, found) = stamp_error(verify(&pool, 43, &[3, 4], 0..20, Verify::Stamp));
        assert_eq!((e.token, e.layer, e.plane, e.head), (0, 0, 0, 0));
        assert_eq!(found, Found::Foreign);
        // The room's own bytes after another room filled the same pages.
        filler.fill(&pool, 43, &[4, 3], 0..20, 0..4).unwrap();
        stamp_error(verify(&pool, 42, &[3, 4], 0..20, Verify::Stamp));
        verify(&pool, 43, &[4, 3], 0..20, Verify::Full).unwrap();
    }

    #[test]
    fn a_block_on_the_wrong_page_layer_or_head_fails_stamp_verification() {
        let layout = tiny();
        let hb = layout.head_bytes();
        let pages = [1, 6, 3];
        // Each case on a fresh pool holding room 7.
        let filled = || {
            let pool = host_pool(layout.clone(), 8);
            Filler::new(8).fill(&pool, 7, &pages, 0..48, 0..4).unwrap();
            verify(&pool, 7, &pages, 0..48, Verify::Full).unwrap();
            pool
        };
        let check = |pool: &AgentPool| stamp_error(verify(pool, 7, &pages, 0..48, Verify::Stamp));
        let want = |token, layer, plane, head| Element {
            token,
            layer,
            plane,
            head,
        };
        // Page: the room's first page (tokens 0..16) of layer 2's K landed on its third.
        let pool = filled();
        copy_block(&pool, (2, 0, 1), (2, 0, 3));
        assert_eq!(
            check(&pool),
            (want(32, 2, 0, 0), Found::Element(want(0, 2, 0, 0)))
        );
        assert_eq!(
            verify(&pool, 7, &pages, 0..48, Verify::Stamp)
                .unwrap_err()
                .to_string(),
            "the stamp of head 0, plane 0, token 32, layer 2 is wrong: it holds the stamp of \
             head 0, plane 0, token 0, layer 2 of this room"
        );
        // Layer: layer 1's V of the second page landed as layer 3's.
        let pool = filled();
        copy_block(&pool, (1, 1, 6), (3, 1, 6));
        assert_eq!(
            check(&pool),
            (want(16, 3, 1, 0), Found::Element(want(16, 1, 1, 0)))
        );
        // Head: head 1's slice of token 20 landed as head 2's.
        let pool = filled();
        let host = pool.host().unwrap();
        let bytes = host.read(at(&pool, 0, 1, 6, 4, 1), hb).unwrap();
        host.write(at(&pool, 0, 1, 6, 4, 2), &bytes).unwrap();
        assert_eq!(
            check(&pool),
            (want(20, 0, 1, 2), Found::Element(want(20, 0, 1, 1)))
        );
        // Never landed: a zeroed head slice.
        let pool = filled();
        let host = pool.host().unwrap();
        host.write(at(&pool, 3, 0, 3, 15, 3), &vec![0; hb]).unwrap();
        assert_eq!(check(&pool), (want(47, 3, 0, 3), Found::Foreign));
    }

    /// `stamp` verification of a gathered layer (a device pool's way), for comparison with
    /// the in-place one of a host pool.
    fn verify_gathered(pool: &AgentPool, room: u64, pages: &[u32], tokens: Range<usize>) -> String {
        let l = pool.layout();
        for local in 0..l.num_layers() {
            let sel = layer_selection(l, pages, &tokens, local);
            let mut got = vec![0; sel.bytes_in(l).unwrap()];
            pool.gather(&sel, PageOrder::TokenMajor, &mut got, None)
                .unwrap();
            if let Err(e) = check_gathered(l, room, local, &tokens, Verify::Stamp, &got) {
                return e.to_string();
            }
        }
        "ok".into()
    }

    #[test]
    fn stamp_checks_in_place_and_gathered_agree_and_sample_the_body() {
        let layout = tiny();
        let pages = [2, 0, 5];
        let pool = host_pool(layout.clone(), 8);
        Filler::new(8).fill(&pool, 3, &pages, 0..40, 0..4).unwrap();
        let both = |pool: &AgentPool| {
            let in_place = verify(pool, 3, &pages, 0..40, Verify::Stamp)
                .map_or_else(|e| e.to_string(), |()| "ok".into());
            assert_eq!(in_place, verify_gathered(pool, 3, &pages, 0..40));
            in_place
        };
        assert_eq!(both(&pool), "ok");
        // A sampled body byte: token 16 (page 0 at slot 0), head 0 of layer 0's K, whose
        // sampled word is 1 + (16 / 16 + 0 + 0) % 7 = 2 (bytes 16..24 of 64).
        let host = pool.host().unwrap();
        let off = at(&pool, 0, 0, 0, 0, 0) + 17;
        host.write(off, &[!host.read(off, 1).unwrap()[0]]).unwrap();
        assert_eq!(
            both(&pool),
            "byte 17 of head 0, plane 0, token 16, layer 0 differs from the pattern"
        );
        // A head slice of layer 1 on another head: found in both ways.
        host.write(off, &[!host.read(off, 1).unwrap()[0]]).unwrap();
        let hb = layout.head_bytes();
        let bytes = host.read(at(&pool, 1, 1, 5, 3, 0), hb).unwrap();
        host.write(at(&pool, 1, 1, 5, 3, 3), &bytes).unwrap();
        assert!(
            both(&pool).starts_with(
                "the stamp of head 3, plane 1, token 35, layer 1 is wrong: it holds the stamp of \
                 head 0, plane 1, token 35, layer 1"
            ),
            "{}",
            both(&pool)
        );
    }

    #[test]
    fn bodies_are_written_once_per_page() {
        let pool = host_pool(tiny(), 8);
        let filler = Filler::new(8);
        filler.fill(&pool, 1, &[2, 5], 0..32, 0..4).unwrap();
        // Damage a body byte of page 5: the next room on the page rewrites its stamps only.
        let host = pool.host().unwrap();
        let off = at(&pool, 0, 0, 5, 3, 0) + 20;
        host.write(off, &[!host.read(off, 1).unwrap()[0]]).unwrap();
        filler.fill(&pool, 2, &[5, 2], 0..32, 0..4).unwrap();
        verify(&pool, 2, &[5, 2], 0..32, Verify::Stamp).unwrap();
        match verify(&pool, 2, &[5, 2], 0..32, Verify::Full) {
            Err(SyntheticError::Mismatch { element, byte }) => {
                assert_eq!((element.token, element.layer, byte), (3, 0, 20));
            }
            other => panic!("{other:?}"),
        }
        // A page not filled before gets its body: pieces by layer and by token range (one
        // starting mid-page, sharing page 6 with the piece before).
        filler.fill(&pool, 3, &[6, 7], 0..20, 0..1).unwrap();
        filler.fill(&pool, 3, &[6, 7], 0..20, 1..4).unwrap();
        filler.fill(&pool, 3, &[6, 7], 20..32, 0..4).unwrap();
        verify(&pool, 3, &[6, 7], 0..32, Verify::Full).unwrap();
    }

    #[test]
    fn rooms_verify_across_layouts_head_slices_and_page_sizes() {
        // A prefill of every head, token-major pages of 16, sends heads 2..4 from token 5 to a
        // decode of heads 2..4, head-major pages of 8 (token-major staging between them, as
        // pools of different page sizes exchange it).
        let prefill = host_pool(tiny(), 8);
        let filler = Filler::new(8);
        let (src_pages, tokens) = ([4u32, 1, 6], 0..40);
        filler
            .fill(&prefill, 9, &src_pages, tokens.clone(), 0..4)
            .unwrap();
        let decode_layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 8)
            .unwrap()
            .with_order(PageOrder::HeadMajor, crate::layout::KvPlacement::Planes)
            .unwrap()
            .with_slice(2..4, 0..4)
            .unwrap();
        let decode = host_pool(decode_layout, 16);
        decode.host().unwrap().fill(0xDE);
        let dst_pages = [9u32, 3, 12, 0, 7];
        let moved = 5..40;
        let src = Selection {
            pages: &src_pages,
            tokens: moved.clone(),
            layers: 0..4,
            heads: 2..4,
        };
        let mut staging = vec![0; src.bytes_in(prefill.layout()).unwrap()];
        prefill
            .gather(&src, PageOrder::TokenMajor, &mut staging, None)
            .unwrap();
        let dst = Selection {
            pages: &dst_pages,
            tokens: moved.clone(),
            layers: 0..4,
            heads: 0..2,
        };
        decode
            .scatter(&staging, PageOrder::TokenMajor, &dst)
            .unwrap();
        for mode in [Verify::Stamp, Verify::Full] {
            verify(&decode, 9, &dst_pages, moved.clone(), mode).unwrap();
        }
        // Token 4 never moved: it holds the poison.
        let (e, found) = stamp_error(verify(&decode, 9, &dst_pages, 4..40, Verify::Stamp));
        assert_eq!((e.token, e.head, found), (4, 2, Found::Foreign));
    }
}
