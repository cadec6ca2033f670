//! Tests of `agent::prefill::transfer`.

use super::direct::{runs_pay, shortest_run, source_ranges};
use super::*;
use crate::agent::DirectMethod;
use crate::memory::{Span, WriteRun};

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
        writes: true,
        fast: false,
    };
    let way = |method| Way::Transport {
        path: path.clone(),
        method,
        scatter: false,
    };
    let (w, p) = (way(DirectMethod::Write), way(DirectMethod::Place));
    let pays = |way: &Way, runs: &[WriteRun], block, floor| {
        runs_pay(
            runs.iter().map(|r| r.len),
            shortest_run(way, block, Some(floor)),
        )
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

/// For a decode that lands a run in several pieces, a chunk goes as the source's contiguous
/// ranges: head slices of 1 KiB (TP2 -> TP1: this prefill's whole rows into half of each of the
/// decode's) that follow each other in the source make one run, whatever their destinations.
#[test]
fn scattered_placed_runs_are_the_sources_contiguous_ranges() {
    let slices: Vec<WriteRun> = (0..64u64)
        .map(|k| WriteRun {
            src: 4096 + k * 1024,
            dst: k * 2048,
            len: 1024,
        })
        .chain([WriteRun {
            src: 1 << 20,
            dst: 64 * 2048,
            len: 512,
        }])
        .collect();
    let ranges = source_ranges(&slices);
    assert_eq!(
        ranges,
        [
            Span {
                offset: 4096,
                len: 64 << 10
            },
            Span {
                offset: 1 << 20,
                len: 512
            }
        ]
    );
    // Placed at the 16 KiB floor of eager runs: as ranges (32.25 KiB on average) they pay,
    // as slices (1 KiB) they would not.
    assert!(runs_pay(ranges.iter().map(|r| r.len), 16 << 10));
    assert!(!runs_pay(slices.iter().map(|r| r.len), 16 << 10));
}
