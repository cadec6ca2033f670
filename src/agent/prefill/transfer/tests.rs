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
    let (w, p) = (DirectMethod::Write, DirectMethod::Place);
    // 16 KiB head slices: half a block, far below the floor.
    assert!(!runs_pay(w, &runs(&[16 << 10; 4]), block, floor));
    assert!(!runs_pay(p, &runs(&[16 << 10; 4]), block, floor));
    // One block each: written, but placed only from the floor on.
    assert!(runs_pay(w, &runs(&[32 << 10; 4]), block, floor));
    assert!(!runs_pay(p, &runs(&[32 << 10; 4]), block, floor));
    // The average decides: one long run carries short ones.
    assert!(runs_pay(
        p,
        &runs(&[(128 << 10) * 3 - 2, 1, 1]),
        block,
        floor
    ));
    assert!(!runs_pay(
        p,
        &runs(&[(128 << 10) * 3 - 3, 1, 1]),
        block,
        floor
    ));
    // Runs shorter than a block, long enough to place (head-major slices of big pages).
    assert!(runs_pay(p, &runs(&[256 << 10; 2]), 512 << 10, floor));
    assert!(!runs_pay(w, &runs(&[256 << 10; 2]), 512 << 10, floor));
    // Nothing to move goes staged; a floor of 0 places whatever there is.
    assert!(!runs_pay(p, &[], block, 0));
    assert!(runs_pay(p, &runs(&[1]), block, 0));
}
