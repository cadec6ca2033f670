//! Tests of `agent::prefill::transfer`.

use super::*;

fn runs(lens: &[u64]) -> Vec<WriteRun> {
    lens.iter()
        .map(|&len| WriteRun {
            src: 0,
            dst: 0,
            len,
        })
        .collect()
}

#[test]
fn placed_runs_must_average_the_floor_and_writes_one_block() {
    let (block, floor) = (32 << 10, 128 << 10);
    let path = crate::transport::WritePath {
        via: "x".to_owned(),
        placed: true,
        eager: false,
        fast: false,
    };
    let way = |method| Way::Transport {
        path: path.clone(),
        method,
    };
    let (w, p) = (way(DirectMethod::Write), way(DirectMethod::Place));
    let pays = |way: &Way, runs: &[WriteRun], block, floor| {
        runs_pay(runs, shortest_run(way, block, Some(floor)))
    };
    // 16 KiB head slices: half a block, far below the floor.
    assert!(!pays(&w, &runs(&[16 << 10; 4]), block, floor));
    assert!(!pays(&p, &runs(&[16 << 10; 4]), block, floor));
    // One block each: written, but placed only from the floor on.
    assert!(pays(&w, &runs(&[32 << 10; 4]), block, floor));
    assert!(!pays(&p, &runs(&[32 << 10; 4]), block, floor));
    // The average decides: one long run carries short ones.
    assert!(pays(&p, &runs(&[(128 << 10) * 3 - 2, 1, 1]), block, floor));
    assert!(!pays(&p, &runs(&[(128 << 10) * 3 - 3, 1, 1]), block, floor));
    // Runs shorter than a block, long enough to place (head-major slices of big pages).
    assert!(pays(&p, &runs(&[256 << 10; 2]), 512 << 10, floor));
    assert!(!pays(&w, &runs(&[256 << 10; 2]), 512 << 10, floor));
    // Nothing to move goes staged; a floor of 0 places whatever there is.
    assert!(!pays(&p, &[], block, 0));
    assert!(pays(&p, &runs(&[1]), block, 0));
    // Without a floor set, the path's default: 128 KiB by rendezvous.
    assert_eq!(shortest_run(&p, block, None), 128 << 10);
}
