//! Property tests of the codec: every message round-trips, and no byte string, random or a
//! mutated valid frame, panics the decoder.

use std::ops::Range;

use proptest::prelude::*;

use super::*;

fn arb_uuid() -> impl Strategy<Value = Uuid> {
    any::<u128>().prop_map(Uuid::from_u128)
}

fn arb_range() -> impl Strategy<Value = Range<u32>> {
    (any::<u32>(), any::<u32>()).prop_map(|(a, b)| a.min(b)..a.max(b))
}

fn arb_string() -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..24).prop_map(String::from_iter)
}

fn arb_order() -> impl Strategy<Value = PageOrder> {
    prop_oneof![Just(PageOrder::TokenMajor), Just(PageOrder::HeadMajor)]
}

fn arb_code() -> impl Strategy<Value = FailureCode> {
    proptest::sample::select(FailureCode::ALL)
}

fn arb_hello() -> impl Strategy<Value = Hello> {
    let layout = (
        proptest::sample::select(AttentionKind::ALL.to_vec()),
        proptest::sample::select(Dtype::ALL.to_vec()),
        arb_order(),
        any::<[u32; 4]>(),
        arb_range(),
        arb_range(),
    )
        .prop_map(|(kind, dtype, order, n, heads, layers)| WireLayout {
            kind,
            dtype,
            order,
            num_layers: n[0],
            num_kv_heads: n[1],
            head_dim: n[2],
            page_size: n[3],
            heads,
            layers,
        });
    (
        any::<(u16, u16)>(),
        arb_uuid(),
        prop_oneof![Just(Role::Prefill), Just(Role::Decode)],
        any::<[u32; 6]>(),
        layout,
        arb_string(),
        arb_string(),
    )
        .prop_map(
            |(v, instance, role, r, layout, data_endpoint, token)| Hello {
                min_version: v.0,
                max_version: v.1,
                instance,
                role,
                ranks: Ranks {
                    dp_rank: r[0],
                    dp_size: r[1],
                    tp_rank: r[2],
                    tp_size: r[3],
                    pp_rank: r[4],
                    pp_size: r[5],
                },
                layout,
                data_endpoint,
                token,
                slots: v.0.into(),
                slot_bytes: v.1.into(),
                pool: (r[0] % 2 == 1).then(|| RemoteMemory {
                    base: u64::from(r[1]) << 12,
                    size: u64::from(r[2]),
                    key: r[3].to_le_bytes().to_vec(),
                }),
                revocable_runs: r[4] % 2 == 0,
                chunk_key: Secret::from_bytes(instance.into_bytes()),
                shared_pool: (r[5] % 3 == 0).then(|| RemoteMemory {
                    base: 0,
                    size: u64::from(r[5]),
                    key: r[4].to_le_bytes().to_vec(),
                }),
                nonce: (r[0] % 3 == 0).then(|| Secret::from_bytes(instance.into_bytes())),
            },
        )
}

fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        arb_hello().prop_map(Message::Hello),
        (any::<u16>(), arb_uuid()).prop_map(|(version, instance)| Message::HelloAck(HelloAck {
            version,
            instance,
            direct: version % 2 == 0,
        })),
        (
            any::<u64>(),
            arb_uuid(),
            [arb_range(), arb_range(), arb_range()],
            arb_order(),
            proptest::collection::vec(any::<u32>(), 0..40),
        )
            .prop_map(
                |(room, prefill_instance, [tokens, layers, heads], wire_order, dst_pages)| {
                    Message::TransferRequest(TransferRequest {
                        room,
                        prefill_instance,
                        tokens,
                        layers,
                        heads,
                        wire_order,
                        requesters: (room % 5) as u32,
                        secret: Secret::from_bytes(prefill_instance.into_bytes()),
                        room_key: (room % 2 == 0)
                            .then(|| Secret::from_bytes((u128::from(room) << 3).to_le_bytes())),
                        prompt_digest: (room % 3 == 0).then(|| {
                            PromptDigest::from_bytes((u128::from(room) << 5).to_le_bytes())
                        }),
                        src_pages: (room % 4 == 1)
                            .then(|| dst_pages.iter().rev().copied().collect()),
                        dst_pages,
                    })
                }
            ),
        (
            any::<(u64, u32, u64, u64)>(),
            arb_uuid(),
            [arb_range(), arb_range(), arb_range()]
        )
            .prop_map(
                |((room, seq, len, checksum), prefill_instance, [tokens, layers, heads])| {
                    Message::Chunk(Chunk {
                        room,
                        prefill_instance,
                        seq,
                        tokens,
                        layers,
                        heads,
                        len,
                        checksum,
                        direct: seq % 4 == 1,
                        placed: (seq % 4 == 2).then(|| Placed {
                            key: room ^ len,
                            runs: vec![len % 4096; (seq % 7) as usize],
                        }),
                        secret: Secret::from_bytes((u128::from(checksum) << 1).to_le_bytes()),
                        sender_key: Secret::from_bytes(prefill_instance.into_bytes()),
                    })
                }
            ),
        (
            any::<(u64, u32, u64)>(),
            arb_uuid(),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|((room, chunks, bytes), prefill_instance, aux)| {
                Message::Done(Done {
                    room,
                    prefill_instance,
                    chunks,
                    bytes,
                    aux,
                })
            }),
        (any::<u64>(), arb_uuid(), arb_code(), arb_string()).prop_map(
            |(room, instance, code, message)| Message::Abort(Abort {
                room,
                instance,
                code,
                message,
            })
        ),
        (any::<u64>(), arb_uuid())
            .prop_map(|(room, instance)| Message::AbortAck(AbortAck { room, instance })),
        (
            arb_uuid(),
            any::<u64>(),
            proptest::collection::vec(any::<u64>(), 0..5)
        )
            .prop_map(|(instance, seq, rooms)| Message::Heartbeat(Heartbeat {
                instance,
                seq,
                rooms
            })),
        (arb_uuid(), any::<u32>())
            .prop_map(|(instance, slots)| Message::Credit(Credit { instance, slots })),
        (any::<[u8; 16]>(), any::<[u8; 32]>()).prop_map(|(nonce, proof)| {
            Message::Challenge(Challenge {
                nonce: Secret::from_bytes(nonce),
                proof: TokenMac(proof),
            })
        }),
        any::<[u8; 32]>().prop_map(|proof| Message::ChallengeReply(ChallengeReply {
            proof: TokenMac(proof)
        })),
        (arb_uuid(), any::<(u64, bool)>()).prop_map(|(instance, (key, accepted))| {
            Message::Posted(Posted {
                instance,
                key,
                accepted,
            })
        }),
        (any::<Option<u64>>(), arb_code(), arb_string()).prop_map(|(room, code, message)| {
            Message::Error(ErrorMsg {
                room,
                code,
                message,
            })
        }),
    ]
}

/// One damage done to a valid frame.
#[derive(Clone, Debug)]
enum Mutation {
    /// XOR one byte (index taken modulo the length) with a nonzero mask.
    Flip(usize, u8),
    /// Keep only the first bytes (modulo length + 1).
    Truncate(usize),
    /// Append bytes.
    Extend(Vec<u8>),
    /// Overwrite one header byte.
    Header(usize, u8),
    /// Overwrite the body length field.
    BodyLen(u32),
    /// Overwrite the version field.
    Version(u16),
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=u8::MAX).prop_map(|(i, m)| Mutation::Flip(i, m)),
        any::<usize>().prop_map(Mutation::Truncate),
        proptest::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Extend),
        (0..HEADER_LEN, any::<u8>()).prop_map(|(i, b)| Mutation::Header(i, b)),
        any::<u32>().prop_map(Mutation::BodyLen),
        any::<u16>().prop_map(Mutation::Version),
    ]
}

fn apply(f: &mut Vec<u8>, m: &Mutation) {
    let len = f.len();
    match m {
        Mutation::Flip(i, mask) if len > 0 => f[i % len] ^= mask,
        Mutation::Flip(..) => {}
        Mutation::Truncate(n) => f.truncate(n % (len + 1)),
        Mutation::Extend(bytes) => f.extend_from_slice(bytes),
        Mutation::Header(i, b) if *i < len => f[*i] = *b,
        Mutation::Header(..) => {}
        Mutation::BodyLen(n) if len >= HEADER_LEN => set_body_len(f, *n),
        Mutation::Version(v) if len >= HEADER_LEN => f[4..6].copy_from_slice(&v.to_le_bytes()),
        Mutation::BodyLen(_) | Mutation::Version(_) => {}
    }
}

/// Whatever the decoder accepts must itself round-trip: nothing is accepted half-read.
fn check_decoded(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(msg) = Message::decode(bytes) {
        prop_assert_eq!(Message::decode(&msg.encode()), Ok(msg));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check_decoded(&bytes)?;
    }

    /// Random bodies behind valid headers, so the body decoders see arbitrary input too.
    #[test]
    fn arbitrary_bodies_never_panic(
        kind in KIND_HELLO..=KIND_ERROR,
        body in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        check_decoded(&frame(VERSION, kind, 0, &body))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn mutated_frames_never_panic(
        msg in arb_message(),
        mutations in proptest::collection::vec(arb_mutation(), 1..4),
    ) {
        let mut f = msg.encode();
        for m in &mutations {
            apply(&mut f, m);
        }
        check_decoded(&f)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5_000))]

    #[test]
    fn generated_messages_round_trip(msg in arb_message()) {
        let bytes = msg.encode();
        prop_assert_eq!(peek_header(&bytes).map(|h| h.frame_len()), Ok(bytes.len()));
        prop_assert_eq!(Message::decode(&bytes), Ok(msg));
    }
}
