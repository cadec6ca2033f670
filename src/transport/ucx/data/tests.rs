//! Unit tests of `transport/ucx/data.rs`: endpoint addresses, run shares, lane parsing, the
//! eager settings and the path rules.

use super::*;

#[test]
fn endpoints_round_trip_and_garbage_is_refused() {
    let (a, b) = (vec![0u8, 1, 0xab, 0xff], vec![7u8; 3]);
    let tags = Tags::random();
    assert!(tags.prefix & 0x8000_0000 != 0);
    let one = encode_endpoint(tags, &[Bytes::from(a.clone())]);
    assert_eq!(one, format!("ucx:{:08x}/0001abff", tags.prefix));
    assert_eq!(decode_endpoint(&one), Some((tags, vec![a.clone()])));
    let two = encode_endpoint(tags, &[Bytes::from(a.clone()), Bytes::from(b.clone())]);
    assert_eq!(decode_endpoint(&two), Some((tags, vec![a, b])));
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
    ] {
        assert!(decode_endpoint(bad).is_none(), "{bad}");
    }
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

#[test]
fn eager_tcp_workers_take_large_segments_unless_the_environment_says_otherwise() {
    let none = |_: &str| false;
    let ids = ("PROTO_INDIRECT_ID", "on");
    assert_eq!(
        worker_vars(Some("tcp"), none),
        [
            ids,
            ("RNDV_THRESH", "inf"),
            ("TX_SEG_SIZE", EAGER_TCP_SEGMENT),
            ("RX_SEG_SIZE", EAGER_TCP_SEGMENT)
        ]
    );
    let tx_set = |name: &str| name == "TCP_TX_SEG_SIZE";
    assert_eq!(
        worker_vars(Some("tcp,self"), tx_set),
        [
            ids,
            ("RNDV_THRESH", "inf"),
            ("RX_SEG_SIZE", EAGER_TCP_SEGMENT)
        ]
    );
    // Rendezvous wanted, or not tcp alone: UCX's own settings, but segments large enough to
    // receive an eager peer's wherever tcp may carry them.
    let rx = [ids, ("RX_SEG_SIZE", EAGER_TCP_SEGMENT)];
    assert_eq!(worker_vars(Some("tcp"), |name| name == "RNDV_THRESH"), rx);
    assert_eq!(worker_vars(None, none), rx);
    assert_eq!(worker_vars(Some("^ud"), none), rx);
    assert_eq!(worker_vars(Some("tcp,cma"), none), rx);
    assert_eq!(worker_vars(None, |name| name == "TCP_RX_SEG_SIZE"), [ids]);
    assert_eq!(worker_vars(Some("posix,cma,self"), none), [ids]);
    assert!(worker_vars(Some("posix"), |name| name == "PROTO_INDIRECT_ID").is_empty());
}

#[test]
fn shared_memory_transports_only_make_unsupervised_endpoints() {
    for tls in ["posix,cma,self", "sm,self", "shm", "sysv, cma"] {
        assert!(shared_memory_only(Some(tls)), "{tls}");
    }
    for tls in [
        None,
        Some("tcp"),
        Some("posix,cma,tcp"),
        Some("^tcp"),
        Some("rc,sm"),
    ] {
        assert!(!shared_memory_only(tls), "{tls:?}");
    }
}

#[test]
fn pools_are_shared_with_same_host_prefills_where_ucx_may_use_shared_memory() {
    for tls in [
        None,
        Some("posix,cma,self"),
        Some("rc,sm"),
        Some("tcp, cma"),
        Some("^tcp"),
        Some("^posix,sysv"),
    ] {
        assert!(shared_memory_allowed(tls), "{tls:?}");
    }
    for tls in [
        Some("tcp"),
        Some("tcp,self"),
        Some("rc,ud"),
        Some("^sm"),
        Some("^posix,sysv,cma,knem,xpmem"),
    ] {
        assert!(!shared_memory_allowed(tls), "{tls:?}");
    }
}

#[test]
fn chunks_go_eagerly_over_tcp_only() {
    assert!(eager_chunks(Some("tcp"), false));
    assert!(eager_chunks(Some("tcp,self"), false));
    // Shared memory, RDMA, everything (unset, an exclusion list): rendezvous.
    for tls in [
        None,
        Some("posix,cma,self"),
        Some("tcp,sm"),
        Some("rc,tcp"),
        Some("^rc"),
        Some("self"),
    ] {
        assert!(!eager_chunks(tls, false), "{tls:?}");
    }
    // The user's UCX_RNDV_THRESH always wins.
    assert!(!eager_chunks(Some("tcp"), true));
}

#[test]
fn only_a_writer_over_rdma_only_transports_asks_for_rma() {
    // (writes, UCX_TLS, insecure) -> RMA
    for (writes, tls, insecure, want) in [
        (true, Some("rc"), false, true),
        (true, Some("rc_mlx5,dc_mlx5,self"), false, true),
        (true, Some("rc_verbs"), false, true),
        // A decode never: its NIC serves the writes.
        (false, Some("rc"), false, false),
        // Any transport whose puts libucx emulates for any connected peer: no.
        (true, None, false, false),
        (true, Some("tcp"), false, false),
        (true, Some("rc,tcp"), false, false),
        (true, Some("posix,cma,self"), false, false),
        (true, Some("ud"), false, false),
        (true, Some("^tcp"), false, false),
        (true, Some("all"), false, false),
        // The tests' own switch.
        (false, Some("tcp"), true, true),
    ] {
        assert_eq!(
            rma(writes, tls, insecure),
            want,
            "{writes} {tls:?} {insecure}"
        );
    }
}
