//! Tests of the codec's version rules: older Hellos, Hellos from the future, negotiation.

use super::*;

/// Hellos of older versions end before the fields added since: they decode with those absent.
/// Versions 1 to 3 are then refused by version; version 6 (no `shared_pool`) and 11 (no
/// `nonce`) are spoken.
#[test]
fn an_older_hello_decodes_without_the_fields_it_lacks() {
    let v3 = Hello {
        pool: None,
        revocable_runs: false,
        chunk_key: Secret::default(),
        shared_pool: None,
        nonce: None,
        max_version: 3,
        ..hello()
    };
    let v6 = Hello {
        shared_pool: None,
        nonce: None,
        max_version: 6,
        ..hello()
    };
    let v11 = Hello {
        nonce: None,
        max_version: 11,
        ..hello()
    };
    // The trailing bytes a version-3 build does not send (flag, key, shared pool's flag,
    // nonce's flag), those a version-6 build does not (the flags of shared pool and nonce),
    // and the one a version-11 build does not (the nonce's flag).
    for (h, cut, spoken) in [(v3, 19, None), (v6, 2, Some(6)), (v11, 1, Some(11))] {
        let mut f = Message::Hello(h.clone()).encode_as(h.max_version);
        f.truncate(f.len() - cut);
        let len = u32::from_le_bytes(f[8..12].try_into().unwrap()) - cut as u32;
        f[8..12].copy_from_slice(&len.to_le_bytes());
        assert_eq!(Message::decode(&f), Ok(Message::Hello(h.clone())));
        assert_eq!(negotiate(h.min_version, h.max_version), spoken);
    }
}

#[test]
fn a_hello_of_any_version_decodes_other_messages_do_not() {
    let body = Message::Hello(Hello {
        min_version: 97,
        max_version: 99,
        ..hello()
    })
    .encode()[HEADER_LEN..]
        .to_vec();
    let Ok(Message::Hello(h)) = Message::decode(&frame(99, KIND_HELLO, 0, &body)) else {
        panic!("a Hello from the future must decode");
    };
    // ...so the receiver can refuse it explicitly, naming both ranges.
    assert_eq!((h.min_version, h.max_version), (97, 99));
    assert_eq!(negotiate(h.min_version, h.max_version), None);

    // A newer Hello may append fields; a current one may not.
    let mut extended = body.clone();
    extended.extend_from_slice(b"v99 field");
    assert!(matches!(
        Message::decode(&frame(99, KIND_HELLO, 0, &extended)),
        Ok(Message::Hello(_))
    ));
    assert_eq!(
        Message::decode(&frame(VERSION, KIND_HELLO, 0, &extended)),
        Err(DecodeError::TrailingBytes(9))
    );

    let body = Message::TransferRequest(transfer_request(vec![1])).encode()[HEADER_LEN..].to_vec();
    for version in [0, 99] {
        assert_eq!(
            Message::decode(&frame(version, KIND_TRANSFER_REQUEST, 0, &body)),
            Err(DecodeError::UnsupportedVersion {
                version,
                min: MIN_VERSION,
                max: VERSION
            })
        );
    }
}

#[test]
fn prompt_digests_and_held_rooms_go_only_to_peers_of_their_version() {
    let req = transfer_request(vec![1]);
    assert!(req.prompt_digest.is_some());
    let ours = Message::TransferRequest(req.clone());
    assert_eq!(Message::decode(&ours.encode()), Ok(ours.clone()));
    // An older peer gets the fields it knows, and nothing it would refuse as trailing bytes.
    let older = ours.encode_as(PROMPT_DIGESTS - 1);
    // 17 bytes of digest, 1 of the absent source pages (version 13).
    assert_eq!(older.len(), ours.encode().len() - 18);
    let Ok(Message::TransferRequest(back)) = Message::decode(&older) else {
        panic!("an older frame decodes");
    };
    assert_eq!(back.prompt_digest, None);
    assert_eq!(
        back,
        TransferRequest {
            prompt_digest: None,
            ..req
        }
    );
    // A frame of the digest's version must carry the field.
    let body = &older[HEADER_LEN..];
    assert!(matches!(
        Message::decode(&frame(PROMPT_DIGESTS, KIND_TRANSFER_REQUEST, 0, body)),
        Err(DecodeError::Truncated { .. })
    ));

    // A heartbeat names its held rooms to a peer that reads them, and to no other.
    let beat = Heartbeat {
        instance: uuid(3),
        seq: 9,
        rooms: vec![7, 8],
    };
    let older = Message::Heartbeat(beat.clone()).encode_as(HELD_ROOMS - 1);
    assert_eq!(
        Message::decode(&older),
        Ok(Message::Heartbeat(Heartbeat {
            rooms: vec![],
            ..beat.clone()
        }))
    );
    let mut body = Message::Heartbeat(beat).encode()[HEADER_LEN..].to_vec();
    body[24..28].copy_from_slice(&(MAX_HELD_ROOMS as u32 + 1).to_le_bytes());
    assert_eq!(
        Message::decode(&frame(HELD_ROOMS, KIND_HEARTBEAT, 0, &body)),
        Err(DecodeError::TooLarge {
            what: "rooms",
            len: MAX_HELD_ROOMS + 1,
            max: MAX_HELD_ROOMS
        })
    );
}

/// A read's source pages go only to a prefill of their version (the decode refuses to send a
/// read to an older one, which would take it for an engine's room); a frame of that version
/// must carry the field.
#[test]
fn source_pages_go_only_to_peers_of_their_version() {
    let req = TransferRequest {
        src_pages: Some(vec![4, 5, 6]),
        ..transfer_request(vec![1, 2, 3])
    };
    let ours = Message::TransferRequest(req.clone());
    assert_eq!(Message::decode(&ours.encode()), Ok(ours.clone()));
    let older = ours.encode_as(READS - 1);
    // The tag, the count and three pages.
    assert_eq!(older.len(), ours.encode().len() - 1 - 4 - 12);
    assert_eq!(
        Message::decode(&older),
        Ok(Message::TransferRequest(TransferRequest {
            src_pages: None,
            ..req
        }))
    );
    let body = &older[HEADER_LEN..];
    assert!(matches!(
        Message::decode(&frame(READS, KIND_TRANSFER_REQUEST, 0, body)),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn negotiate_picks_the_newest_common_version() {
    assert_eq!(negotiate(MIN_VERSION, VERSION), Some(VERSION));
    assert_eq!(negotiate(0, u16::MAX), Some(VERSION));
    assert_eq!(negotiate(VERSION, VERSION + 5), Some(VERSION));
    // Disjoint ranges: the peer is entirely newer, or entirely older.
    assert_eq!(negotiate(VERSION + 1, VERSION + 3), None);
    assert_eq!(negotiate(0, MIN_VERSION - 1), None);
    // A nonsensical range from the peer.
    assert_eq!(negotiate(VERSION, MIN_VERSION - 1), None);
}

#[test]
fn a_data_connection_is_proven_by_the_key_from_data_proofs_on_by_an_empty_frame_before() {
    let key = Secret::from_bytes([0xc3; 16]);
    assert_eq!(&data_proof(DATA_PROOFS, &key)[..], key.as_bytes());
    assert_eq!(&data_proof(VERSION, &key)[..], key.as_bytes());
    assert!(data_proof(DATA_PROOFS - 1, &key).is_empty());
    assert!(data_proof(MIN_VERSION, &key).is_empty());
}
