//! Tests of host pools: anonymous, shared-memory and engine-owned memory, bounds checks, and
//! the piecewise copies.

use super::*;
use crate::layout::ModelSpec;

fn tiny() -> KvLayout {
    KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap()
}

#[test]
fn anonymous_pool_is_page_aligned_and_sized_by_the_layout() {
    let pool = HostPool::anonymous(tiny(), 7).unwrap();
    assert_eq!(pool.size(), tiny().pool_bytes(7).unwrap());
    assert_eq!(pool.base_ptr() as usize % 4096, 0);
    assert!(pool.read(0, pool.size()).unwrap().iter().all(|b| *b == 0));
    assert!(matches!(
        HostPool::anonymous(tiny(), 0),
        Err(PoolError::Empty)
    ));
}

#[test]
fn reads_and_writes_are_bounds_checked() {
    let pool = HostPool::anonymous(tiny(), 2).unwrap();
    let size = pool.size();
    pool.write(size - 3, &[1, 2, 3]).unwrap();
    assert_eq!(pool.read(size - 3, 3).unwrap(), vec![1, 2, 3]);
    assert!(matches!(
        pool.write(size - 2, &[1, 2, 3]),
        Err(PoolError::OutOfBounds { .. })
    ));
    assert!(matches!(
        pool.read(usize::MAX, 2),
        Err(PoolError::OutOfBounds { .. })
    ));
    assert!(matches!(
        pool.block_offset(4, 0, 0),
        Err(PoolError::BadBlock { .. })
    ));
    assert!(matches!(
        pool.block_offset(0, 2, 0),
        Err(PoolError::BadBlock { .. })
    ));
    assert!(matches!(
        pool.block_offset(0, 0, 2),
        Err(PoolError::BadBlock { .. })
    ));
}

#[test]
fn pieces_land_where_asked_and_are_bounds_checked() {
    let pool = HostPool::anonymous(tiny(), 2).unwrap();
    let size = pool.size();
    pool.write_pieces(100, &[64, 0, 32], &[1, 2, 3, 4, 5, 6])
        .unwrap();
    assert_eq!(pool.read(100, 2).unwrap(), vec![3, 4]);
    assert_eq!(pool.read(132, 2).unwrap(), vec![5, 6]);
    assert_eq!(pool.read(164, 2).unwrap(), vec![1, 2]);
    let mut out = [0; 4];
    pool.read_pieces(132, &[32, 0], &mut out).unwrap();
    assert_eq!(out, [1, 2, 5, 6]);
    // The last piece one byte past the end; a length that does not split evenly.
    for (offset, at, bytes) in [
        (size - 8, [0, 7], 4),
        (0, [0, 8], 3),
        (usize::MAX, [0, 0], 2),
    ] {
        assert!(matches!(
            pool.write_pieces(offset, &at, &vec![0; bytes]),
            Err(PoolError::OutOfBounds { .. })
        ));
    }
    pool.write_pieces(size - 2, &[0], &[9, 9]).unwrap();
    pool.write_pieces(0, &[], &[]).unwrap();
}

#[test]
fn descriptors_parse_and_print() {
    let d: PoolDescriptor = "shm:/dev/shm/kv0".parse().unwrap();
    assert_eq!(d, PoolDescriptor::Shm("/dev/shm/kv0".into()));
    assert_eq!(d.to_string(), "shm:/dev/shm/kv0");
    assert_eq!(
        "anon".parse::<PoolDescriptor>().unwrap(),
        PoolDescriptor::Anonymous
    );
    for bad in [
        "",
        "shm:",
        "cuda",
        "file:/x",
        "anon:x",
        "cuda-ipc:0",
        "cuda-ipc:x:00",
        "cuda-ipc:0:zz",
        "cuda-vmm:0",
        "cuda-vmm:0:",
        "cuda-vmm:x:/run/pool.sock",
    ] {
        assert!(bad.parse::<PoolDescriptor>().is_err(), "{bad}");
    }
    let ipc = format!("cuda-ipc:1:{}", "ab".repeat(64));
    let d: PoolDescriptor = ipc.parse().unwrap();
    assert_eq!(
        d,
        PoolDescriptor::CudaIpc {
            device: 1,
            handle: [0xab; 64]
        }
    );
    assert_eq!(d.to_string(), ipc);
    let vmm = "cuda-vmm:2:/run/engine/pool.sock";
    let d: PoolDescriptor = vmm.parse().unwrap();
    assert_eq!(
        d,
        PoolDescriptor::CudaVmm {
            device: 2,
            socket: "/run/engine/pool.sock".into()
        }
    );
    assert_eq!(d.to_string(), vmm);
}

#[test]
fn shm_pool_is_shared_reserved_and_unlinked_by_its_creator() {
    let path = std::env::temp_dir().join(format!("kvferry-pool-test-{}", std::process::id()));
    let creator = HostPool::create_shm(&path, tiny(), 3).unwrap();
    assert_eq!(
        std::fs::metadata(&path).unwrap().len() as usize,
        creator.size()
    );
    // A second creation at the same path refuses to clobber the first.
    assert!(HostPool::create_shm(&path, tiny(), 3).is_err());
    // Another mapping with a different page count is refused with both sizes.
    let err = HostPool::open_shm(&path, tiny(), 4).unwrap_err();
    assert!(matches!(err, PoolError::SizeMismatch { .. }), "{err}");
    let opener = HostPool::open(&PoolDescriptor::Shm(path.clone()), tiny(), 3).unwrap();
    creator.write(100, b"kvferry").unwrap();
    assert_eq!(opener.read(100, 7).unwrap(), b"kvferry");
    drop(opener);
    assert!(path.exists(), "an opener must not unlink");
    drop(creator);
    assert!(!path.exists(), "the creator unlinks on drop");
}
