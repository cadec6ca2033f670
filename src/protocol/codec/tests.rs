//! Codec tests: round trips of every message, typed errors for each malformed shape, and
//! property tests that no byte string panics the decoder.

use uuid::Uuid;

use super::*;
use crate::layout::{AttentionKind, Dtype, PageOrder};
use crate::memory::RemoteMemory;
use crate::protocol::*;
use crate::reason::FailureCode;

fn uuid(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

fn layout(kind: AttentionKind, dtype: Dtype, order: PageOrder) -> WireLayout {
    WireLayout {
        kind,
        dtype,
        order,
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        page_size: 16,
        heads: 0..8,
        layers: 0..32,
    }
}

fn hello() -> Hello {
    Hello {
        min_version: MIN_VERSION,
        max_version: VERSION,
        instance: uuid(0x1234),
        role: Role::Decode,
        ranks: Ranks {
            dp_rank: 0,
            dp_size: 1,
            tp_rank: 1,
            tp_size: 2,
            pp_rank: 0,
            pp_size: 1,
        },
        layout: layout(AttentionKind::Mha, Dtype::Bf16, PageOrder::TokenMajor),
        data_endpoint: "tcp://10.0.0.2:40111".into(),
        token: "secret".into(),
        slots: 4,
        slot_bytes: 1 << 20,
        pool: Some(RemoteMemory {
            base: 0x7f00_0000_0000,
            size: 1 << 30,
            key: vec![1, 2, 3, 0xff],
        }),
        revocable_runs: true,
        chunk_key: Secret::from_bytes([0xc0; 16]),
        shared_pool: Some(RemoteMemory {
            base: 0,
            size: 1 << 30,
            key: b"0123456789abcdefkvferry-pool-x".to_vec(),
        }),
        nonce: Some(Secret::from_bytes([0x5e; 16])),
    }
}

fn transfer_request(dst_pages: Vec<u32>) -> TransferRequest {
    TransferRequest {
        room: 7,
        prefill_instance: uuid(9),
        tokens: 0..32,
        layers: 0..2,
        heads: 0..8,
        wire_order: PageOrder::TokenMajor,
        dst_pages,
        requesters: 2,
        secret: Secret::from_bytes([0x5e; 16]),
        room_key: Some(Secret::from_bytes(*b"room-key-0123456")),
        prompt_digest: Some(PromptDigest::of_tokens(&[1, 2, 3])),
        src_pages: None,
    }
}

/// A frame with the given header fields around `body`, its length field set to `body.len()`.
fn frame(version: u16, kind: u8, flags: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::from(MAGIC);
    f.extend_from_slice(&version.to_le_bytes());
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

fn set_body_len(f: &mut [u8], len: u32) {
    f[8..12].copy_from_slice(&len.to_le_bytes());
}

/// Every message kind with representative and edge values.
fn samples() -> Vec<Message> {
    let mut out = Vec::new();
    for role in [Role::Prefill, Role::Decode] {
        for kind in AttentionKind::ALL {
            for dtype in Dtype::ALL {
                for order in [PageOrder::TokenMajor, PageOrder::HeadMajor] {
                    out.push(Message::Hello(Hello {
                        role,
                        layout: layout(kind, dtype, order),
                        ..hello()
                    }));
                }
            }
        }
    }
    out.push(Message::Hello(Hello {
        min_version: 0,
        max_version: u16::MAX,
        instance: Uuid::nil(),
        ranks: Ranks::default(),
        data_endpoint: String::new(),
        token: String::new(),
        slots: 0,
        slot_bytes: u32::MAX,
        ..hello()
    }));
    out.push(Message::Hello(Hello {
        instance: Uuid::max(),
        data_endpoint: "x".repeat(MAX_STRING),
        // 4096 bytes of 2-, 3- and 4-byte characters.
        token: "é€😀".repeat(MAX_STRING / 9) + "!",
        slots: 8,
        slot_bytes: 1 << 20,
        layout: WireLayout {
            num_layers: u32::MAX,
            heads: u32::MAX..u32::MAX,
            layers: 3..3,
            ..layout(AttentionKind::Mla, Dtype::Fp32, PageOrder::HeadMajor)
        },
        ..hello()
    }));
    if let Some(Message::Hello(h)) = out.last() {
        assert_eq!(h.token.len(), MAX_STRING);
    }
    out.push(Message::HelloAck(HelloAck {
        version: VERSION,
        instance: uuid(1),
        direct: true,
    }));
    out.push(Message::TransferRequest(transfer_request(vec![])));
    out.push(Message::TransferRequest(transfer_request(vec![
        0,
        1,
        u32::MAX,
    ])));
    out.push(Message::TransferRequest(TransferRequest {
        room: u64::MAX,
        tokens: u32::MAX..u32::MAX,
        wire_order: PageOrder::HeadMajor,
        ..transfer_request((0..4096).collect())
    }));
    out.push(Message::TransferRequest(TransferRequest {
        src_pages: Some(vec![9, 0, u32::MAX]),
        ..transfer_request(vec![0, 1, 2])
    }));
    out.push(Message::Chunk(Chunk {
        room: 0,
        prefill_instance: uuid(2),
        seq: 0,
        tokens: 0..0,
        layers: 0..0,
        heads: 0..0,
        len: 0,
        checksum: 0,
        direct: false,
        placed: None,
        secret: Secret::default(),
        sender_key: Secret::default(),
    }));
    out.push(Message::Chunk(Chunk {
        room: u64::MAX,
        prefill_instance: Uuid::max(),
        seq: u32::MAX,
        tokens: 16..32,
        layers: 0..u32::MAX,
        heads: 4..8,
        len: u64::MAX,
        checksum: 0xdead_beef_cafe_f00d,
        direct: true,
        placed: None,
        secret: Secret::from_bytes([0xff; 16]),
        sender_key: Secret::from_bytes([1; 16]),
    }));
    out.push(Message::Chunk(Chunk {
        room: 3,
        prefill_instance: uuid(2),
        seq: 1,
        tokens: 0..4096,
        layers: 0..32,
        heads: 0..8,
        len: 64 << 20,
        checksum: 1,
        direct: false,
        placed: Some(Placed {
            key: u64::MAX,
            runs: vec![1 << 20; MAX_RUNS],
        }),
        secret: Secret::from_bytes([7; 16]),
        sender_key: Secret::from_bytes([8; 16]),
    }));
    for aux in [vec![], vec![42], vec![0xAB; MAX_AUX]] {
        out.push(Message::Done(Done {
            room: 5,
            prefill_instance: uuid(3),
            chunks: 4,
            bytes: 262_144,
            aux,
        }));
    }
    for &code in FailureCode::ALL {
        out.push(Message::Abort(Abort {
            room: 11,
            instance: uuid(4),
            code,
            message: format!("abort: {code}"),
        }));
        out.push(Message::Error(ErrorMsg {
            room: Some(11),
            code,
            message: String::new(),
        }));
    }
    out.push(Message::Error(ErrorMsg {
        room: None,
        code: FailureCode::IncompatibleVersion,
        message: "x".repeat(MAX_STRING),
    }));
    out.push(Message::Error(ErrorMsg {
        room: Some(u64::MAX),
        code: FailureCode::BadMessage,
        message: "ü".into(),
    }));
    out.push(Message::AbortAck(AbortAck {
        room: 0,
        instance: uuid(5),
    }));
    out.push(Message::Heartbeat(Heartbeat {
        instance: uuid(6),
        seq: u64::MAX,
        rooms: vec![1, u64::MAX],
    }));
    out.push(Message::Credit(Credit {
        instance: uuid(7),
        slots: 3,
    }));
    for accepted in [true, false] {
        out.push(Message::Posted(Posted {
            instance: uuid(8),
            key: u64::MAX,
            accepted,
        }));
    }
    out.push(Message::Hello(Hello {
        nonce: None,
        ..hello()
    }));
    out.push(Message::Challenge(Challenge {
        nonce: Secret::from_bytes([0x11; 16]),
        proof: TokenMac([0xee; 32]),
    }));
    out.push(Message::ChallengeReply(ChallengeReply {
        proof: TokenMac([0x01; 32]),
    }));
    out
}

#[test]
fn every_sample_round_trips_with_a_well_formed_header() {
    let samples = samples();
    let names: std::collections::HashSet<_> = samples.iter().map(Message::name).collect();
    assert_eq!(names.len(), 13, "samples must cover every kind");
    for msg in samples {
        let bytes = msg.encode();
        assert_eq!(&bytes[..4], b"KVFY");
        assert_eq!(u16::from_le_bytes([bytes[4], bytes[5]]), VERSION);
        assert_eq!(bytes[7], 0, "flags");
        let header = peek_header(&bytes).unwrap();
        assert_eq!(header.frame_len(), bytes.len(), "{}", msg.name());
        assert_eq!(Message::decode(&bytes), Ok(msg));
    }
}

#[test]
fn kind_tags_are_stable() {
    let expected = [
        ("hello", 1),
        ("hello_ack", 2),
        ("transfer_request", 3),
        ("chunk", 4),
        ("done", 5),
        ("abort", 6),
        ("abort_ack", 7),
        ("heartbeat", 8),
        ("error", 9),
        ("credit", 10),
        ("posted", 11),
        ("challenge", 12),
        ("challenge_reply", 13),
    ];
    for msg in samples() {
        let tag = msg.encode()[6];
        let want = expected.iter().find(|(n, _)| *n == msg.name()).unwrap().1;
        assert_eq!(tag, want, "{}", msg.name());
    }
}

#[test]
fn a_heartbeat_has_the_documented_bytes() {
    let msg = Message::Heartbeat(Heartbeat {
        instance: uuid(0x0102),
        seq: 3,
        rooms: vec![5],
    });
    let mut want = b"KVFY\x0d\x00\x08\x00\x24\x00\x00\x00".to_vec();
    want.extend_from_slice(&uuid(0x0102).into_bytes());
    want.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[1, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(msg.encode(), want);
}

/// A chunk of 4096 bytes, or of its placed runs' bytes.
fn chunk_of(direct: bool, placed: Option<Placed>) -> Chunk {
    Chunk {
        room: 7,
        prefill_instance: uuid(1),
        seq: 2,
        tokens: 0..16,
        layers: 0..2,
        heads: 0..4,
        len: placed.as_ref().map_or(4096, |p| p.runs.iter().sum()),
        checksum: 9,
        direct,
        placed,
        secret: Secret::from_bytes([0x5e; 16]),
        sender_key: Secret::from_bytes([0xc0; 16]),
    }
}

#[test]
fn chunks_carry_their_secrets_and_frames_of_older_versions_are_refused() {
    let chunk = |direct| chunk_of(direct, None);
    let frame = Message::Chunk(chunk(false)).encode();
    assert_eq!(Message::decode(&frame), Ok(Message::Chunk(chunk(false))));
    // The two secrets are the last 32 bytes of the body, as sent.
    assert_eq!(&frame[frame.len() - 32..frame.len() - 16], &[0x5e; 16]);
    assert_eq!(&frame[frame.len() - 16..], &[0xc0; 16]);
    // A chunk without its secrets (what a version-3 build sends) is refused by version, and
    // cut to that length it is truncated.
    for old in 1..MIN_VERSION {
        assert!(matches!(
            Message::decode(&Message::Chunk(chunk(false)).encode_as(old)),
            Err(DecodeError::UnsupportedVersion { version, .. }) if version == old
        ));
    }
    let mut short = frame.clone();
    short.truncate(short.len() - 32);
    let body = (short.len() - HEADER_LEN) as u32;
    short[8..12].copy_from_slice(&body.to_le_bytes());
    assert!(matches!(
        Message::decode(&short),
        Err(DecodeError::Truncated { what: "secret", .. })
    ));
    let direct = Message::Chunk(chunk(true));
    assert_eq!(Message::decode(&direct.encode()), Ok(direct));
    // A flag other than 0 or 1 is refused.
    let mut bad = Message::Chunk(chunk(true)).encode();
    let at = bad.len() - 32 - 2; // direct flag, then the placed tag, then the secrets
    bad[at] = 2;
    assert_eq!(
        Message::decode(&bad),
        Err(DecodeError::BadTag {
            what: "direct",
            tag: 2
        })
    );
}

#[test]
fn a_placed_chunk_lists_at_most_max_runs_and_all_of_them_must_be_there() {
    let chunk = |runs| Message::Chunk(chunk_of(false, Some(Placed { key: 5, runs })));
    let ok = chunk(vec![4096, 8192]);
    assert_eq!(Message::decode(&ok.encode()), Ok(ok.clone()));
    assert_eq!(
        Message::decode(&chunk(vec![1; MAX_RUNS + 1]).encode()),
        Err(DecodeError::TooLarge {
            what: "placed.runs",
            len: MAX_RUNS + 1,
            max: MAX_RUNS
        })
    );
    // A count beyond the lengths present is truncation, found before allocating.
    let mut short = ok.encode();
    short.truncate(short.len() - 8 - 32);
    let body = (short.len() - HEADER_LEN) as u32;
    short[8..12].copy_from_slice(&body.to_le_bytes());
    assert!(matches!(
        Message::decode(&short),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn encode_into_appends_frames_that_peek_header_separates() {
    let a = Message::HelloAck(HelloAck {
        version: 1,
        instance: uuid(1),
        direct: false,
    });
    let b = Message::TransferRequest(transfer_request(vec![3, 4]));
    let mut buf = vec![0xEE];
    a.encode_into(&mut buf);
    b.encode_into(&mut buf);
    let rest = &buf[1..];
    let first = peek_header(rest).unwrap().frame_len();
    assert_eq!(Message::decode(&rest[..first]), Ok(a));
    assert_eq!(Message::decode(&rest[first..]), Ok(b));
}

#[test]
fn strings_longer_than_the_limit_are_cut_at_a_char_boundary() {
    let long = "€".repeat(MAX_STRING); // 3 bytes each: the limit falls inside a character
    let msg = Message::Error(ErrorMsg {
        room: None,
        code: FailureCode::Aborted,
        message: long.clone(),
    });
    let Ok(Message::Error(back)) = Message::decode(&msg.encode()) else {
        panic!("an over-long string must still encode to a valid frame");
    };
    assert!(back.message.len() <= MAX_STRING && back.message.len() > MAX_STRING - 3);
    assert!(long.starts_with(&back.message));
}

#[test]
fn bad_magic_is_refused() {
    let mut f = Message::Heartbeat(Heartbeat {
        instance: uuid(1),
        seq: 1,
        rooms: vec![],
    })
    .encode();
    f[0] = b'G';
    assert_eq!(
        Message::decode(&f),
        Err(DecodeError::BadMagic { found: *b"GVFY" })
    );
    let http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_eq!(Message::decode(http).unwrap_err().kind(), "bad_magic");
}

#[test]
fn truncated_header_is_refused() {
    for len in 0..HEADER_LEN {
        let f = &frame(VERSION, KIND_HEARTBEAT, 0, &[])[..len];
        assert_eq!(
            Message::decode(f),
            Err(DecodeError::Truncated {
                what: "header",
                needed: HEADER_LEN,
                available: len
            })
        );
    }
}

#[test]
fn body_length_must_match_the_bytes_given() {
    let good = Message::AbortAck(AbortAck {
        room: 1,
        instance: uuid(1),
    })
    .encode();
    // Frame cut short.
    assert_eq!(
        Message::decode(&good[..good.len() - 1]),
        Err(DecodeError::Truncated {
            what: "body",
            needed: 24,
            available: 23
        })
    );
    // Garbage after the frame.
    let mut long = good.clone();
    long.extend_from_slice(&[0, 0]);
    assert_eq!(Message::decode(&long), Err(DecodeError::TrailingBytes(2)));
    // Length field covering bytes the body does not use.
    let mut padded = good.clone();
    padded.push(0);
    set_body_len(&mut padded, 25);
    assert_eq!(Message::decode(&padded), Err(DecodeError::TrailingBytes(1)));
    // Length field shorter than the fields: the body runs out mid-field.
    let mut short = good[..good.len() - 4].to_vec();
    set_body_len(&mut short, 20);
    assert_eq!(
        Message::decode(&short),
        Err(DecodeError::Truncated {
            what: "instance",
            needed: 16,
            available: 12
        })
    );
}

#[test]
fn unknown_kind_and_flags_are_refused() {
    for kind in [0, 14, 255] {
        assert_eq!(
            Message::decode(&frame(VERSION, kind, 0, &[])),
            Err(DecodeError::UnknownKind(kind))
        );
    }
    let mut f = Message::Heartbeat(Heartbeat {
        instance: uuid(1),
        seq: 1,
        rooms: vec![],
    })
    .encode();
    f[7] = 0x80;
    assert_eq!(Message::decode(&f), Err(DecodeError::BadFlags(0x80)));
}

#[test]
fn unknown_enum_tags_are_refused() {
    // Offsets are body offsets (the header is 12 bytes).
    let hello = Message::Hello(hello()).encode();
    let tr = Message::TransferRequest(transfer_request(vec![])).encode();
    let abort = Message::Abort(Abort {
        room: 1,
        instance: uuid(1),
        code: FailureCode::Aborted,
        message: String::new(),
    })
    .encode();
    let err = Message::Error(ErrorMsg {
        room: None,
        code: FailureCode::Aborted,
        message: String::new(),
    })
    .encode();
    let cases: [(&[u8], usize, u8, &str); 7] = [
        (&hello, 20, 3, "role"),
        (&hello, 45, 0, "layout.kind"),
        (&hello, 46, 6, "layout.dtype"),
        (&hello, 47, 9, "layout.order"),
        (&tr, 48, 0, "wire_order"),
        (&abort, 24, 0, "code"),
        (&err, 0, 2, "room"),
    ];
    for (good, offset, tag, what) in cases {
        let mut f = good.to_vec();
        f[HEADER_LEN + offset] = tag;
        assert_eq!(
            Message::decode(&f),
            Err(DecodeError::BadTag { what, tag }),
            "{what}"
        );
    }
    let mut f = err.clone();
    f[HEADER_LEN + 1] = 200; // the code, after a None room
    assert_eq!(
        Message::decode(&f),
        Err(DecodeError::BadTag {
            what: "code",
            tag: 200
        })
    );
}

#[test]
fn reversed_ranges_are_refused() {
    let mut f = Message::TransferRequest(transfer_request(vec![])).encode();
    // tokens 0..32 -> 33..32
    f[HEADER_LEN + 24..HEADER_LEN + 28].copy_from_slice(&33u32.to_le_bytes());
    assert_eq!(
        Message::decode(&f),
        Err(DecodeError::BadRange {
            what: "tokens",
            start: 33,
            end: 32
        })
    );
    let msg = Message::Chunk(Chunk {
        room: 1,
        prefill_instance: uuid(1),
        seq: 0,
        tokens: 0..16,
        layers: 0..2,
        heads: 5..5,
        len: 0,
        checksum: 0,
        direct: false,
        placed: None,
        secret: Secret::default(),
        sender_key: Secret::default(),
    });
    let mut f = msg.encode();
    // heads 5..5 -> 6..5
    f[HEADER_LEN + 44..HEADER_LEN + 48].copy_from_slice(&6u32.to_le_bytes());
    assert_eq!(
        Message::decode(&f),
        Err(DecodeError::BadRange {
            what: "heads",
            start: 6,
            end: 5
        })
    );
}

#[test]
fn oversized_lengths_are_refused_before_allocation() {
    // A header announcing a 4 GiB body, with no body at all: TooLarge, not Truncated.
    let mut f = frame(VERSION, KIND_DONE, 0, &[]);
    set_body_len(&mut f, u32::MAX);
    let err = DecodeError::TooLarge {
        what: "body",
        len: u32::MAX as usize,
        max: MAX_BODY,
    };
    assert_eq!(peek_header(&f), Err(err.clone()));
    assert_eq!(Message::decode(&f), Err(err));

    // A page count of u32::MAX in a tiny body (the page count is followed by `requesters`, the
    // secret, the room key, the prompt digest and the absent source pages).
    let mut body =
        Message::TransferRequest(transfer_request(vec![])).encode()[HEADER_LEN..].to_vec();
    let n = body.len() - 16 - 17 - 17 - 1;
    body[n - 8..n - 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        Message::decode(&frame(VERSION, KIND_TRANSFER_REQUEST, 0, &body)),
        Err(DecodeError::TooLarge {
            what: "dst_pages",
            len: u32::MAX as usize,
            max: MAX_PAGES
        })
    );
    // A count within the limit whose items are missing: Truncated before the vector exists.
    body[n - 8..n - 4].copy_from_slice(&(MAX_PAGES as u32).to_le_bytes());
    assert_eq!(
        Message::decode(&frame(VERSION, KIND_TRANSFER_REQUEST, 0, &body)),
        Err(DecodeError::Truncated {
            what: "dst_pages",
            needed: MAX_PAGES * 4,
            // Only `requesters`, the secret, the room key, the digest and the source pages'
            // tag follow.
            available: 4 + 16 + 17 + 17 + 1,
        })
    );

    // An aux blob beyond MAX_AUX, and a string beyond MAX_STRING.
    let mut done = Message::Done(Done {
        room: 1,
        prefill_instance: uuid(1),
        chunks: 0,
        bytes: 0,
        aux: vec![],
    })
    .encode();
    let n = done.len();
    done[n - 4..].copy_from_slice(&(MAX_AUX as u32 + 1).to_le_bytes());
    assert_eq!(
        Message::decode(&done),
        Err(DecodeError::TooLarge {
            what: "aux",
            len: MAX_AUX + 1,
            max: MAX_AUX
        })
    );
    let mut body = vec![0]; // room: None
    body.push(FailureCode::Aborted.tag());
    body.extend_from_slice(&(MAX_STRING as u16 + 1).to_le_bytes());
    assert_eq!(
        Message::decode(&frame(VERSION, KIND_ERROR, 0, &body)),
        Err(DecodeError::TooLarge {
            what: "message",
            len: MAX_STRING + 1,
            max: MAX_STRING
        })
    );
}

#[test]
fn invalid_utf8_is_refused() {
    let mut body = vec![0, FailureCode::Aborted.tag()];
    body.extend_from_slice(&2u16.to_le_bytes());
    body.extend_from_slice(&[0xC3, 0x28]);
    assert_eq!(
        Message::decode(&frame(VERSION, KIND_ERROR, 0, &body)),
        Err(DecodeError::BadUtf8 { what: "message" })
    );
}

#[test]
fn error_kinds_are_distinct_and_messages_name_the_problem() {
    let errors = [
        DecodeError::BadMagic { found: *b"GET " },
        DecodeError::UnsupportedVersion {
            version: 9,
            min: 1,
            max: 1,
        },
        DecodeError::UnknownKind(42),
        DecodeError::BadFlags(1),
        DecodeError::Truncated {
            what: "room",
            needed: 8,
            available: 3,
        },
        DecodeError::TrailingBytes(5),
        DecodeError::TooLarge {
            what: "aux",
            len: 70_000,
            max: MAX_AUX,
        },
        DecodeError::BadTag {
            what: "role",
            tag: 7,
        },
        DecodeError::BadRange {
            what: "heads",
            start: 4,
            end: 2,
        },
        DecodeError::BadUtf8 { what: "token" },
    ];
    let kinds: std::collections::HashSet<_> = errors.iter().map(DecodeError::kind).collect();
    assert_eq!(kinds.len(), errors.len());
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    for (text, needle) in texts.iter().zip([
        "KVFY",
        "1..=1",
        "42",
        "flags",
        "room",
        "5 trailing",
        "70000",
        "role",
        "4..2",
        "token",
    ]) {
        assert!(text.contains(needle), "{text:?} should mention {needle:?}");
    }
}

mod properties;
mod versions;
