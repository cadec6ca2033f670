//! Tests of the synthetic engine: rooms verify in both modes across layouts, `stamp` mode
//! stamps the tokens it says, misrouted and missing bytes fail `stamp` verification with their
//! place, bodies are written once per page.

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
fn at(pool: &AgentPool, layer: usize, plane: usize, page: usize, slot: usize, h: usize) -> usize {
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
    let filler = Filler::new(8, Verify::Full);
    let pages = [5, 2, 7];
    filler.fill(&pool, (42, 40), &pages, 0..40, 0..3).unwrap();
    for mode in [Verify::Stamp, Verify::Full] {
        verify(&pool, 42, &pages, 0..40, mode).unwrap();
        // A decode's start_token mid-page.
        verify(&pool, 42, &pages, 19..40, mode).unwrap();
    }
    // Flip byte 43 of layer 2 (local 1), V plane, token 17 (page 2 at slot 1), head 2
    // (local 1): a body byte that `stamp` does not read (room 42 stamps tokens 10, 26 and 39).
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

/// The head slice's first word (its stamp) of a token of a tiny pool, as stored.
fn word0(
    pool: &AgentPool,
    (layer, plane, page, slot, h): (usize, usize, usize, usize, usize),
) -> u64 {
    let bytes = pool
        .host()
        .unwrap()
        .read(at(pool, layer, plane, page, slot, h), 8)
        .unwrap();
    u64::from_le_bytes(bytes.try_into().unwrap())
}

#[test]
fn stamp_mode_stamps_one_token_in_16_rotating_with_the_room_and_the_last() {
    let pool = host_pool(tiny(), 8);
    let filler = Filler::new(8, Verify::Stamp);
    let pages = [6u32, 1, 4];
    // Room 21: tokens 5, 21 and 37 (21 % 16 = 5), and 39, the last.
    filler.fill(&pool, (21, 40), &pages, 0..40, 0..4).unwrap();
    let stamped = Stamped::new(21, 40, Verify::Stamp);
    for layer in 0..4 {
        for plane in 0..2 {
            for token in 0..40 {
                for head in 0..4 {
                    let e = Element {
                        token,
                        layer,
                        plane,
                        head,
                    };
                    let held = word0(
                        &pool,
                        (layer, plane, pages[token / 16] as usize, token % 16, head),
                    );
                    let want = match [5, 21, 37, 39].contains(&token) {
                        true => stamp(21, e),
                        false => body_word(layer, plane, head, 0),
                    };
                    assert_eq!(held, want, "{e}");
                    assert_eq!(stamped.holds(token), [5, 21, 37, 39].contains(&token));
                }
            }
        }
    }
    // Any range a decode takes, down to the last token alone, verifies and holds a stamp.
    for start in 0..40 {
        verify(&pool, 21, &pages, start..40, Verify::Stamp).unwrap();
    }
    // A decode checking every byte finds the unstamped tokens and names the likely cause.
    let msg = verify(&pool, 21, &pages, 0..40, Verify::Full)
        .unwrap_err()
        .to_string();
    assert_eq!(
        msg,
        "the stamp of head 0, plane 0, token 0, layer 0 is wrong: it holds the pattern's body, \
         no stamp (a prefill with --synthetic-verify stamp stamps one token in 16; set the mode \
         alike on both agents)"
    );
    // Every mode's stamps are a subset of `full`'s.
    let full = Stamped::new(21, 40, Verify::Full);
    assert!((0..40).all(|t| full.holds(t)));
}

#[test]
fn another_rooms_stamps_fail_stamp_verification() {
    let pool = host_pool(tiny(), 8);
    let filler = Filler::new(8, Verify::Stamp);
    filler.fill(&pool, (42, 20), &[3, 4], 0..20, 0..4).unwrap();
    // Room 43 stamps token 11 (43 % 16), which holds the body: room 42 stamped 10 and 19.
    let (e, found) = stamp_error(verify(&pool, 43, &[3, 4], 0..20, Verify::Stamp));
    assert_eq!((e.token, e.layer, e.plane, e.head), (11, 0, 0, 0));
    assert_eq!(found, Found::Body);
    // Room 58 stamps token 10 as room 42 does (58 % 16): its own stamps differ.
    let (e, found) = stamp_error(verify(&pool, 58, &[3, 4], 0..20, Verify::Stamp));
    assert_eq!((e.token, found), (10, Found::Foreign));
    // The room's own bytes after another room filled the same pages, and its pages swapped.
    filler.fill(&pool, (43, 20), &[4, 3], 0..20, 0..4).unwrap();
    verify(&pool, 43, &[4, 3], 0..20, Verify::Stamp).unwrap();
    let (e, found) = stamp_error(verify(&pool, 43, &[3, 4], 0..20, Verify::Stamp));
    assert_eq!((e.token, found), (11, Found::Body));
}

#[test]
fn a_block_on_the_wrong_page_layer_or_head_fails_stamp_verification() {
    let layout = tiny();
    let hb = layout.head_bytes();
    let pages = [1, 6, 3];
    // Each case on a fresh pool holding room 7, filled in `stamp` mode: tokens 7, 23, 39 and
    // 47 carry stamps.
    let filled = || {
        let pool = host_pool(layout.clone(), 8);
        let filler = Filler::new(8, Verify::Stamp);
        filler.fill(&pool, (7, 48), &pages, 0..48, 0..4).unwrap();
        verify(&pool, 7, &pages, 0..48, Verify::Stamp).unwrap();
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
        (want(39, 2, 0, 0), Found::Element(want(7, 2, 0, 0)))
    );
    assert_eq!(
        verify(&pool, 7, &pages, 0..48, Verify::Stamp)
            .unwrap_err()
            .to_string(),
        "the stamp of head 0, plane 0, token 39, layer 2 is wrong: it holds the stamp of \
         head 0, plane 0, token 7, layer 2 of this room"
    );
    // Layer: layer 1's V of the second page landed as layer 3's.
    let pool = filled();
    copy_block(&pool, (1, 1, 6), (3, 1, 6));
    assert_eq!(
        check(&pool),
        (want(23, 3, 1, 0), Found::Element(want(23, 1, 1, 0)))
    );
    // Head: head 1's slice of token 23 landed as head 2's.
    let pool = filled();
    let host = pool.host().unwrap();
    let bytes = host.read(at(&pool, 0, 1, 6, 7, 1), hb).unwrap();
    host.write(at(&pool, 0, 1, 6, 7, 2), &bytes).unwrap();
    assert_eq!(
        check(&pool),
        (want(23, 0, 1, 2), Found::Element(want(23, 0, 1, 1)))
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
        let mut got = vec![0; sel.bytes_in(l, PageOrder::TokenMajor).unwrap()];
        pool.gather(&sel, PageOrder::TokenMajor, &mut got).unwrap();
        let stamped = Stamped::new(room, tokens.end, Verify::Stamp);
        if let Err(e) = check_gathered(l, (room, stamped), local, &tokens, Verify::Stamp, &got) {
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
    let filler = Filler::new(8, Verify::Stamp);
    filler.fill(&pool, (3, 40), &pages, 0..40, 0..4).unwrap();
    let both = |pool: &AgentPool| {
        let in_place = verify(pool, 3, &pages, 0..40, Verify::Stamp)
            .map_or_else(|e| e.to_string(), |()| "ok".into());
        assert_eq!(in_place, verify_gathered(pool, 3, &pages, 0..40));
        in_place
    };
    assert_eq!(both(&pool), "ok");
    // Room 3 stamps tokens 3, 19, 35 and 39. Of token 19 (page 0 at slot 3) in layer 0's K,
    // the check reads one body word: of head (19 / 16 + 0 + 0) % 4 = 1, word 1 + (19 / 16 +
    // 0) % 7 = 2 (bytes 16..24 of 64). Another word of that head, or that word of another
    // head: unseen.
    let host = pool.host().unwrap();
    let flip = |off: usize| host.write(off, &[!host.read(off, 1).unwrap()[0]]).unwrap();
    for off in [at(&pool, 0, 0, 0, 3, 1) + 25, at(&pool, 0, 0, 0, 3, 2) + 17] {
        flip(off);
        assert_eq!(both(&pool), "ok");
        flip(off);
    }
    let off = at(&pool, 0, 0, 0, 3, 1) + 17;
    flip(off);
    assert_eq!(
        both(&pool),
        "byte 17 of head 1, plane 0, token 19, layer 0 differs from the pattern"
    );
    // A head slice of layer 1 on another head: found in both ways.
    flip(off);
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
    let filler = Filler::new(8, Verify::Full);
    filler.fill(&pool, (1, 32), &[2, 5], 0..32, 0..4).unwrap();
    // Damage a body byte of page 5: the next room on the page rewrites its stamps only.
    let host = pool.host().unwrap();
    let off = at(&pool, 0, 0, 5, 3, 0) + 20;
    host.write(off, &[!host.read(off, 1).unwrap()[0]]).unwrap();
    filler.fill(&pool, (2, 32), &[5, 2], 0..32, 0..4).unwrap();
    verify(&pool, 2, &[5, 2], 0..32, Verify::Stamp).unwrap();
    match verify(&pool, 2, &[5, 2], 0..32, Verify::Full) {
        Err(SyntheticError::Mismatch { element, byte }) => {
            assert_eq!((element.token, element.layer, byte), (3, 0, 20));
        }
        other => panic!("{other:?}"),
    }
    // A page not filled before gets its body: pieces by layer and by token range (one
    // starting mid-page, sharing page 6 with the piece before).
    filler.fill(&pool, (3, 32), &[6, 7], 0..20, 0..1).unwrap();
    filler.fill(&pool, (3, 32), &[6, 7], 0..20, 1..4).unwrap();
    filler.fill(&pool, (3, 32), &[6, 7], 20..32, 0..4).unwrap();
    verify(&pool, 3, &[6, 7], 0..32, Verify::Full).unwrap();
}

#[test]
fn rooms_verify_across_layouts_head_slices_and_page_sizes() {
    // A prefill of every head, token-major pages of 16, sends heads 2..4 from token 5 to a
    // decode of heads 2..4, head-major pages of 8 (token-major staging between them, as
    // pools of different page sizes exchange it).
    // Room 4: in `stamp` mode tokens 4, 20, 36 and 39 carry stamps.
    let prefill = host_pool(tiny(), 8);
    let filler = Filler::new(8, Verify::Full);
    let (src_pages, tokens) = ([4u32, 1, 6], 0..40);
    filler
        .fill(&prefill, (4, 40), &src_pages, tokens.clone(), 0..4)
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
    let mut staging = vec![
        0;
        src.bytes_in(prefill.layout(), PageOrder::TokenMajor)
            .unwrap()
    ];
    prefill
        .gather(&src, PageOrder::TokenMajor, &mut staging)
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
        verify(&decode, 4, &dst_pages, moved.clone(), mode).unwrap();
        // Token 4 never moved: it holds the poison.
        let (e, found) = stamp_error(verify(&decode, 4, &dst_pages, 4..40, mode));
        assert_eq!((e.token, e.head, found), (4, 2, Found::Foreign));
    }
}
