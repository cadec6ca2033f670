//! Unit tests of `transport/ucx/data.rs`: endpoint addresses, run shares, lane parsing and the
//! path rules.

use super::*;

#[test]
fn endpoints_round_trip_and_garbage_is_refused() {
    let (a, b) = (vec![0u8, 1, 0xab, 0xff], vec![7u8; 3]);
    let tags = Tags::random();
    assert!(tags.prefix & 0x8000_0000 != 0);
    let v113 = UcxVersion::parse("1.13.1").unwrap();
    let v122 = UcxVersion::parse("1.22.0").unwrap();
    let one = encode_endpoint(tags, &[Bytes::from(a.clone())], v113);
    assert_eq!(one, format!("ucx:{:08x}/0001abff", tags.prefix));
    assert_eq!(decode_endpoint(&one), Some((tags, vec![a.clone()], None)));
    let two = encode_endpoint(
        tags,
        &[Bytes::from(a.clone()), Bytes::from(b.clone())],
        v113,
    );
    assert_eq!(
        decode_endpoint(&two),
        Some((tags, vec![a.clone(), b], None))
    );
    // UCX 1.22 names its release.
    let newer = encode_endpoint(tags, &[Bytes::from(a.clone())], v122);
    assert_eq!(newer, format!("ucx:{:08x}/0001abff/1.22.0", tags.prefix));
    assert_eq!(decode_endpoint(&newer), Some((tags, vec![a], Some(v122))));
    for bad in [
        "",
        "ucx:",
        "ucx:0",
        "ucx:zz",
        "tcp://x",
        "ucx:00,",
        "ucx:,00",
        "ucx:00,0",
        // An endpoint of a build before tag prefixes.
        "ucx:0001abff",
        "ucx:80000001/",
        "ucx:80000001/00,",
        "ucx:80000001/zz",
        // A prefix without its top bit, of the wrong length, not hex.
        "ucx:00000001/00",
        "ucx:8000001/00",
        "ucx:800000001/00",
        "ucx:8000000g/00",
        // A release that is not one.
        "ucx:80000001/00/1.22",
        "ucx:80000001/00/",
        "ucx:80000001/00/1.22.0/x",
    ] {
        assert!(decode_endpoint(bad).is_none(), "{bad}");
    }
}

#[test]
fn a_receiver_of_another_ucx_release_is_refused_naming_both() {
    let ours = UcxVersion::loaded();
    assert_eq!(
        check_release(Some(ours), "x").map_err(|e| e.message),
        Ok(())
    );
    let other = match ours.family() {
        Ok(Family::V1_13) => Some(UcxVersion::parse("1.22.0").unwrap()),
        _ => None,
    };
    let e = check_release(other, "ucx:80000001/..").unwrap_err();
    assert_eq!(e.kind, TransportErrorKind::Incompatible);
    let theirs = other.map_or("1.13 (its endpoint names no release)".to_owned(), |v| {
        v.to_string()
    });
    assert!(
        e.message.contains(&format!("UCX {theirs}")),
        "{}",
        e.message
    );
    assert!(e.message.contains(&format!("UCX {ours}")), "{}", e.message);
}

/// Every tag a sender puts on a message for a receiver but a placed run's carries the
/// receiver's prefix (so its workers keep it if it arrives unexpected); runs' tags never do,
/// and a device payload's never matches the receives posted for chunks.
#[test]
fn a_receivers_tags_carry_its_prefix_and_runs_never_do() {
    let tags = Tags::random();
    let kept = |tag: u64| (tag >> 32) as u32 == tags.prefix;
    assert!(kept(tags.chunk()) && kept(tags.device_chunk()));
    assert!(kept(tags.device_payload(4)) && kept(tags.device_payload(u32::MAX)));
    let posted = |tag: u64| tag & CHUNK_MASK == tags.chunk() & CHUNK_MASK;
    assert!(posted(tags.chunk()) && posted(tags.device_chunk()));
    assert!(!posted(tags.device_payload(4)));
    for key in [0, 1, u64::MAX, 0x1234_5678_9abc] {
        let run = placed_tag(key);
        assert!(run >> 63 == 0 && (run >> 56) as u8 == PLACED_PREFIX && !kept(run));
    }
}

#[test]
fn runs_are_shared_out_in_consecutive_ranges_covering_each_once() {
    assert_eq!(shares(4, 2), [0..2, 2..4]);
    assert_eq!(shares(5, 2), [0..3, 3..5]);
    assert_eq!(shares(1, 2), vec![std::ops::Range { start: 0, end: 1 }]);
    assert!(shares(0, 2).is_empty());
    assert_eq!(shares(3, 1), vec![std::ops::Range { start: 0, end: 3 }]);
    for n in 0..40 {
        for parts in 1..5 {
            let s = shares(n, parts);
            let covered: Vec<usize> = s.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(
                covered,
                (0..n).collect::<Vec<_>>(),
                "{n} runs, {parts} parts"
            );
            assert!(s.len() <= parts);
        }
    }
}

#[test]
fn rma_lanes_are_read_off_the_endpoint_description() {
    // As `ucx_info -e` prints them (UCX 1.13) for shared memory and for tcp.
    let shm = "#  lane[0]:  0:self/memory0.0 md[0]  -> md[0]/self/sysdev[255] am am_bw#0\n\
               #  lane[1]:  2:cma/memory.0 md[2]    -> md[2]/cma/sysdev[255] rma_bw#0\n\
               #  rma_bw: mds rndv_rkey_size 9\n";
    let tcp =
        "#  lane[0]:  0:tcp/lo.0 md[0]  -> md[0]/tcp/sysdev[255] rma_bw#0 am am_bw#0 wireup\n";
    assert_eq!(rma_transports(shm), ["cma"]);
    assert_eq!(rma_transports(tcp), ["tcp"]);
    assert!(rma_transports("# lane[0]: 0:self/memory0.0 md[0] am\n").is_empty());
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(fast_writes(&names(&["rc_mlx5"]), true));
    assert!(
        !fast_writes(&names(&["cma"]), false),
        "unsupervised shared memory"
    );
    assert!(!fast_writes(&names(&["tcp"]), true), "tcp emulates puts");
    assert!(!fast_writes(&[], true));
    // Placed runs: eager (revocable receives), or rendezvous reads on a native lane,
    // supervised or not.
    assert!(placed_runs(false, &names(&["cma"])));
    assert!(placed_runs(false, &names(&["rc_mlx5"])));
    assert!(placed_runs(true, &names(&["tcp"])), "eager");
    assert!(!placed_runs(false, &names(&["tcp"])), "emulated reads");
    assert!(!placed_runs(false, &[]), "no one-sided lane");
}
