//! Unit tests of `transport/ucx/settings.rs`: which settings follow from `UCX_TLS` and the
//! environment.

use super::*;

const V113: Family = Family::V1_13;

#[test]
fn eager_tcp_workers_take_large_segments_unless_the_environment_says_otherwise() {
    let none = |_: &str| false;
    let ids = ("PROTO_INDIRECT_ID", "on");
    assert_eq!(
        worker_vars(Some("tcp"), none, V113),
        [
            ids,
            ("RNDV_THRESH", "inf"),
            ("TX_SEG_SIZE", EAGER_TCP_SEGMENT),
            ("RX_SEG_SIZE", EAGER_TCP_SEGMENT)
        ]
    );
    let tx_set = |name: &str| name == "TCP_TX_SEG_SIZE";
    assert_eq!(
        worker_vars(Some("tcp,self"), tx_set, V113),
        [
            ids,
            ("RNDV_THRESH", "inf"),
            ("RX_SEG_SIZE", EAGER_TCP_SEGMENT)
        ]
    );
    // Rendezvous wanted, or not tcp alone: UCX's own settings, but segments large enough to
    // receive an eager peer's wherever tcp may carry them.
    let rx = [ids, ("RX_SEG_SIZE", EAGER_TCP_SEGMENT)];
    assert_eq!(
        worker_vars(Some("tcp"), |name| name == "RNDV_THRESH", V113),
        rx
    );
    assert_eq!(worker_vars(None, none, V113), rx);
    assert_eq!(worker_vars(Some("^ud"), none, V113), rx);
    assert_eq!(worker_vars(Some("tcp,cma"), none, V113), rx);
    assert_eq!(
        worker_vars(None, |name| name == "TCP_RX_SEG_SIZE", V113),
        [ids]
    );
    assert_eq!(worker_vars(Some("posix,cma,self"), none, V113), [ids]);
    assert!(worker_vars(Some("posix"), |name| name == "PROTO_INDIRECT_ID", V113).is_empty());
    // UCX 1.22 takes a transport's setting by its prefixed name.
    assert_eq!(
        worker_vars(Some("tcp"), none, Family::V1_22),
        [
            ids,
            ("RNDV_THRESH", "inf"),
            ("TCP_TX_SEG_SIZE", EAGER_TCP_SEGMENT),
            ("TCP_RX_SEG_SIZE", EAGER_TCP_SEGMENT)
        ]
    );
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
