//! A pool backed by a shared-memory file is written by one process and read by another.
//!
//! The test re-runs its own test binary as the second process (selecting the child test by
//! name), so both sides are real processes mapping the same /dev/shm file.

use std::process::Command;

use kvferry::kernel::Selection;
use kvferry::kernel::cpu::CpuKernel;
use kvferry::layout::{KvLayout, ModelSpec, PageOrder};
use kvferry::pool::{HostPool, PoolDescriptor};

const PAGES: usize = 8;
const CHILD_ENV: &str = "KVFERRY_TEST_SHM_CHILD";

fn layout() -> KvLayout {
    KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap()
}

/// The byte at `i` of the pool as the parent writes it.
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 7) as u8
}

fn shm_dir() -> std::path::PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

#[test]
fn shm_pool_written_by_one_process_is_read_by_another() {
    let path = shm_dir().join(format!("kvferry-test-{}", std::process::id()));
    let pool = HostPool::create_shm(&path, layout(), PAGES).unwrap();
    let bytes: Vec<u8> = (0..pool.size()).map(pattern).collect();
    pool.write(0, &bytes).unwrap();

    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "pool_shm::child_reads_the_pool", "--nocapture"])
        .env(CHILD_ENV, pool.descriptor().to_string())
        .status()
        .unwrap();
    assert!(
        status.success(),
        "the child process did not see the parent's bytes"
    );

    // The child scattered a marker into page 5 of layer 0; the parent sees it.
    let off = pool.block_offset(0, 0, 5).unwrap();
    assert_eq!(pool.read(off, 4).unwrap(), b"kvfe");
    drop(pool);
    assert!(!path.exists(), "the creating process unlinks the file");
}

/// Runs only as the child of the test above.
#[test]
fn child_reads_the_pool() {
    let Ok(descriptor) = std::env::var(CHILD_ENV) else {
        return;
    };
    let descriptor: PoolDescriptor = descriptor.parse().unwrap();
    let pool = HostPool::open(&descriptor, layout(), PAGES).unwrap();
    let seen = pool.read(0, pool.size()).unwrap();
    assert!(seen.iter().enumerate().all(|(i, b)| *b == pattern(i)));
    // Write back through the kernel: one token of layer 0's K plane of page 5.
    let sel = Selection {
        pages: &[5],
        tokens: 0..1,
        layers: 0..1,
        heads: 0..pool.layout().num_heads(),
    };
    let mut staging = vec![0u8; sel.bytes(&pool, PageOrder::TokenMajor).unwrap()];
    CpuKernel::new(1)
        .gather(&pool, &sel, PageOrder::TokenMajor, &mut staging)
        .unwrap();
    staging[..4].copy_from_slice(b"kvfe");
    CpuKernel::new(1)
        .scatter(&staging, PageOrder::TokenMajor, &pool, &sel)
        .unwrap();
}
