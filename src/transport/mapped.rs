//! One-sided writes between processes of one host: the receiver hands its pool's memory file
//! to the sender, which maps it and copies runs into it with the CPU kernel. One copy of each
//! byte, by the sender's CPU, whatever the runs' lengths: agents of one host move rooms this
//! way (`zmq-ipc`, UCX with shared memory: [`super::maps_pools`]) when the decode's pool is its
//! own sealed memory file ([`HostPool::shareable`]; docs/architecture.md, "Data paths"). The
//! file is named in Hello's `shared_pool`, beside the transport's own key.
//!
//! The handshake:
//! - the receiver ([`serve`]) listens on an abstract Unix socket, `kvferry-pool-<random>`, which
//!   only processes of its host and network namespace reach, and puts a fresh 16-byte secret
//!   and the socket's name in the key of its [`RemoteMemory`] (Hello, sent only to the peers
//!   it asks for rooms): `key = secret ++ name`;
//! - a sender ([`attach`]) connects and sends the secret; the receiver answers with one
//!   16-byte message, the pool's size and a zero, with the file's descriptor attached
//!   (`fd_passing`), or closes the connection if the secret is wrong;
//! - the sender checks that the file is sealed against shrinking (a shrunk file's pages fault
//!   with SIGBUS in every process that maps them), holds exactly the announced bytes and has
//!   them all allocated (mapping a file with holes populated would allocate them in the
//!   sender's name), and maps it shared.
//!
//! The sender's connect and handshake are bounded by [`HANDSHAKE_TIMEOUT`] each: a socket that
//! never accepts, or never answers, costs the sender a blocking thread for that long.
//!
//! A connection that sends nothing is dropped after [`HANDSHAKE_TIMEOUT`]; connections in the
//! middle of their handshake are bounded as on every port
//! ([`kvferry_wire::admission`]: the oldest dropped first), so silent ones never keep a
//! sender out. Which pages a sender may write when is the agents'
//! business: a decode counts a prefill with writes a writer of each room until its last word
//! on it, as for RDMA (`agent/decode/rooms.rs`).
#![allow(unsafe_code)]

use std::io::Write as _;
use std::os::fd::AsRawFd as _;
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};

use super::TransportError;
use crate::kernel::cpu::CpuKernel;
use crate::memory::{RemoteMemory, WriteRun};
use crate::pool::HostPool;
use crate::protocol::{Secret, constant_time_eq};
use kvferry_wire::admission::Admission;

/// What every socket name starts with; a key naming another socket is refused.
const NAME_PREFIX: &[u8] = b"kvferry-pool-";

/// `statfs`'s type of tmpfs and shmem, where memfds live (`linux/magic.h`).
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// How long a connection may take to send its secret.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `pool`'s memory file to senders until the returned guard drops; `None` when the
/// pool is not a sealed memory file ([`crate::pool::is_sealed`]): anonymous or engine memory,
/// or a file on /dev/shm, which its engine could shrink under the senders' mappings.
pub async fn serve(
    pool: &HostPool,
) -> Result<Option<(RemoteMemory, tokio_util::task::AbortOnDropHandle<()>)>, TransportError> {
    let Some(file) = pool.memory_file().filter(|f| crate::pool::is_sealed(f)) else {
        return Ok(None);
    };
    let fail = |op, e: std::io::Error| TransportError::new(op, "pool socket", e);
    let file = Arc::new(file.try_clone().map_err(|e| fail("serve", e))?);
    let mut name = NAME_PREFIX.to_vec();
    name.extend_from_slice(uuid::Uuid::new_v4().simple().to_string().as_bytes());
    let addr = SocketAddr::from_abstract_name(&name).map_err(|e| fail("bind", e))?;
    let listener = UnixListener::bind_addr(&addr).map_err(|e| fail("bind", e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail("bind", e))?;
    let listener = tokio::net::UnixListener::from_std(listener).map_err(|e| fail("bind", e))?;
    let secret = Secret::random().map_err(|e| fail("serve", std::io::Error::other(e)))?;
    let size = pool.size() as u64;
    let admission = Admission::new("pool socket");
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let peer = match stream.peer_cred().ok().and_then(|c| c.pid()) {
                Some(pid) => format!("pid {pid}"),
                None => "unknown".to_owned(),
            };
            let admitted = admission.admit(peer);
            let file = file.clone();
            tokio::spawn(async move {
                tokio::select! {
                    handed = hand_over(stream, secret, size, &file) => if let Err(e) = handed {
                        tracing::warn!(error = %e, "pool socket: handshake refused");
                    },
                    () = admitted.dropped() => {}
                }
            });
        }
    });
    let mut key = secret.as_bytes().to_vec();
    key.extend_from_slice(&name);
    let memory = RemoteMemory { base: 0, size, key };
    Ok(Some((
        memory,
        tokio_util::task::AbortOnDropHandle::new(task),
    )))
}

/// One connection: the secret in, the file out.
async fn hand_over(
    mut stream: tokio::net::UnixStream,
    secret: Secret,
    size: u64,
    file: &std::fs::File,
) -> std::io::Result<()> {
    use tokio::io::AsyncReadExt as _;
    let mut got = [0u8; 16];
    tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.read_exact(&mut got))
        .await
        .map_err(|_| std::io::Error::other("no secret in time"))??;
    if !constant_time_eq(&got, secret.as_bytes()) {
        return Err(std::io::Error::other("wrong secret"));
    }
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&size.to_le_bytes());
    crate::fd_passing::send(&stream, &header, Some(file.as_raw_fd()))
}

/// A receiver's pool mapped into this process.
#[derive(Debug)]
pub struct MappedPool {
    map: MmapRaw,
    kernel: CpuKernel,
}

/// Maps the pool `memory` names (blocking: run it off the reactor). A key of another form is
/// [`super::TransportErrorKind::Malformed`].
pub fn attach(memory: &RemoteMemory, endpoint: &str) -> Result<MappedPool, TransportError> {
    let (secret, name) =
        parse_key(memory).map_err(|m| TransportError::malformed("attach", endpoint, m))?;
    let fail = |m: String| TransportError::new("attach", endpoint, m);
    let mut stream = connect(name).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::TimedOut => "",
            _ => " (not on this host?)",
        };
        fail(format!("the decode's pool socket: {e}{hint}"))
    })?;
    let handshake = stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
        .and_then(|()| stream.write_all(secret))
        .and_then(|()| crate::fd_passing::receive(&stream));
    use std::io::ErrorKind::{BrokenPipe, ConnectionReset, TimedOut, UnexpectedEof, WouldBlock};
    let (header, fd) = handshake.map_err(|e| match e.kind() {
        // A socket timeout reads as "Resource temporarily unavailable".
        WouldBlock | TimedOut => fail(format!(
            "the decode did not answer on its pool socket within {HANDSHAKE_TIMEOUT:?}"
        )),
        UnexpectedEof | ConnectionReset | BrokenPipe => fail(
            "the decode closed its pool socket: a wrong secret, or its limit of connections in \
             the middle of a handshake (its log says which)"
                .to_owned(),
        ),
        _ => fail(format!("the decode's pool socket: {e}")),
    })?;
    let size = u64::from_le_bytes(header[..8].try_into().unwrap_or_default());
    let Some(fd) = fd else {
        return Err(fail("the decode sent no pool file".to_owned()));
    };
    let file = std::fs::File::from(fd);
    // A file that could shrink would turn this process's next write into it into a SIGBUS.
    if !crate::pool::is_sealed(&file) {
        return Err(fail(
            "the decode's pool file is not sealed against shrinking".to_owned(),
        ));
    }
    // Plain shared memory only: a hugetlbfs file passes the seal check, yet a write into it
    // faults (SIGBUS) when the host runs out of huge pages.
    let kind = rustix::fs::fstatfs(&file)
        .map_err(|e| fail(e.to_string()))?
        .f_type;
    if kind != TMPFS_MAGIC {
        return Err(fail(format!(
            "the pool file is not plain shared memory (file system type {kind:#x}): not mapped"
        )));
    }
    let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
    let actual = meta.len();
    if size != memory.size || actual != memory.size {
        return Err(fail(format!(
            "the pool file holds {actual} bytes ({size} said on its socket), the Hello {}",
            memory.size
        )));
    }
    // Mapping a file with holes populated would allocate the holes in this process's name: a
    // decode's pool file is allocated whole when it is made (`HostPool::shareable`).
    let backed = std::os::unix::fs::MetadataExt::blocks(&meta).saturating_mul(512);
    if backed < actual {
        return Err(fail(format!(
            "the pool file is sparse ({backed} of its {actual} bytes allocated): not mapped"
        )));
    }
    let len = usize::try_from(size).map_err(|e| fail(e.to_string()))?;
    let map = MmapOptions::new()
        .len(len)
        .populate()
        .map_raw(&file)
        .map_err(|e| fail(format!("mapping the decode's pool: {e}")))?;
    Ok(MappedPool {
        map,
        kernel: CpuKernel::default(),
    })
}

/// Connects to the abstract Unix socket `name`, giving up after [`HANDSHAKE_TIMEOUT`]: a blocking
/// connect to a listener that never accepts waits for ever once its backlog is full.
fn connect(name: &[u8]) -> std::io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new_abstract_name(name)?;
    let deadline = std::time::Instant::now() + HANDSHAKE_TIMEOUT;
    loop {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => {
                let stream = UnixStream::from(fd);
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            // A Unix socket's backlog is full: a non-blocking connect says so at once.
            Err(rustix::io::Errno::AGAIN) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(rustix::io::Errno::AGAIN) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("accepted no connection within {HANDSHAKE_TIMEOUT:?}"),
                ));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Refuses a key `serve` could not have made ([`super::TransportErrorKind::Malformed`]).
pub fn check_key(memory: &RemoteMemory) -> Result<(), TransportError> {
    parse_key(memory)
        .map(|_| ())
        .map_err(|m| TransportError::malformed("hello", "pool key", m))
}

/// The secret and socket name of a key `serve` made.
fn parse_key(memory: &RemoteMemory) -> Result<(&[u8], &[u8]), String> {
    let key = &memory.key;
    match (key.get(..16), key.get(16..)) {
        (Some(secret), Some(name)) if name.starts_with(NAME_PREFIX) && name.len() <= 100 => {
            Ok((secret, name))
        }
        _ => Err(format!(
            "a key of {} bytes is not a secret and a pool socket name",
            key.len()
        )),
    }
}

impl MappedPool {
    /// Copies every run of `source` into the mapped pool (blocking); the stores are fenced
    /// when it returns.
    pub fn write(&self, source: &HostPool, runs: &[WriteRun]) -> Result<(), String> {
        write_together(source, &[(self, runs)])
    }
}

/// Copies each pool's runs of `source` into it, all in one pass (blocking): runs of one chunk
/// planned for several pools (one prefill rank's tokens, their heads shared out over decode
/// ranks) go interleaved, so that each source row is read once, in order, instead of once per
/// pool, in strides ([`crate::kernel::cpu::CpuKernel::write_runs`]). The stores are fenced
/// when it returns.
pub fn write_together(
    source: &HostPool,
    writes: &[(&MappedPool, &[WriteRun])],
) -> Result<(), String> {
    let Some((first, _)) = writes.first() else {
        return Ok(());
    };
    let runs: Vec<&[WriteRun]> = writes.iter().map(|&(_, runs)| runs).collect();
    let dsts: Vec<(*mut u8, usize)> = writes
        .iter()
        .map(|(pool, _)| (pool.map.as_mut_ptr(), pool.map.len()))
        .collect();
    // SAFETY: each mapping is its value's and lives through the call; each is another
    // process's pool file, never `source`'s memory (a receiver serves its own pool, and a
    // sender maps only the pool of the receiver it connected to), and no two are one
    // receiver's (each receiver's file is mapped once per sender).
    unsafe { first.kernel.write_runs(source, &runs, &dsts) }.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvLayout, ModelSpec};
    use crate::pool::testing::tiny_pool as pool;
    use kvferry_wire::admission::MAX_UNPROVEN;

    /// `dst` served and mapped here, with the guard that serves it.
    async fn mapped(dst: &HostPool) -> (MappedPool, tokio_util::task::AbortOnDropHandle<()>) {
        let (memory, serving) = serve(dst).await.unwrap().expect("a memory file");
        let pool = tokio::task::spawn_blocking(move || attach(&memory, "test"))
            .await
            .unwrap()
            .unwrap();
        (pool, serving)
    }

    #[tokio::test]
    async fn runs_into_two_pools_in_one_pass_land_each_in_its_own_and_nowhere_else() {
        let (a, b, src) = (pool(true), pool(true), pool(false));
        a.fill(0xAA);
        b.fill(0xBB);
        let bytes: Vec<u8> = (0..src.size()).map(|i| (i * 13 + 5) as u8).collect();
        src.write(0, &bytes).unwrap();
        let ((into_a, _sa), (into_b, _sb)) = (mapped(&a).await, mapped(&b).await);
        // Each 2 KiB of the source: its first KiB to `a`, its second to `b` (TP1 -> TP2).
        let half = |k: u64, second: bool| WriteRun {
            src: k * 2048 + u64::from(second) * 1024,
            dst: k * 1024 + 512,
            len: 1024,
        };
        let runs_a: Vec<WriteRun> = (0..6).map(|k| half(k, false)).collect();
        let runs_b: Vec<WriteRun> = (0..6).map(|k| half(k, true)).collect();
        write_together(&src, &[(&into_a, &runs_a[..]), (&into_b, &runs_b[..])]).unwrap();
        for (dst, runs, poison) in [(&a, &runs_a, 0xAA), (&b, &runs_b, 0xBB)] {
            let mut want = vec![poison; dst.size()];
            for r in runs {
                let (s, d, n) = (r.src as usize, r.dst as usize, r.len as usize);
                want[d..d + n].copy_from_slice(&bytes[s..s + n]);
            }
            assert!(dst.read(0, dst.size()).unwrap() == want, "{poison:#x}");
        }
        // A run outside the second pool is refused before a byte moves into either.
        a.fill(0xAA);
        let outside = [WriteRun {
            src: 0,
            dst: b.size() as u64,
            len: 1,
        }];
        let e = write_together(&src, &[(&into_a, &runs_a[..]), (&into_b, &outside[..])]);
        assert!(e.unwrap_err().contains("destination"));
        assert!(a.read(0, a.size()).unwrap().iter().all(|&x| x == 0xAA));
    }

    #[tokio::test]
    async fn a_sender_with_the_secret_writes_into_the_receivers_pool_and_nowhere_else() {
        let (dst, src) = (pool(true), pool(false));
        dst.fill(0xDE);
        let bytes: Vec<u8> = (0..src.size()).map(|i| (i * 7 + 3) as u8).collect();
        src.write(0, &bytes).unwrap();
        let (memory, _serving) = serve(&dst).await.unwrap().expect("a memory file");
        assert_eq!(memory.size, dst.size() as u64);
        let mapped = tokio::task::spawn_blocking({
            let memory = memory.clone();
            move || attach(&memory, "test")
        })
        .await
        .unwrap()
        .unwrap();
        let runs = [
            WriteRun {
                src: 0,
                dst: 4096,
                len: 1000,
            },
            WriteRun {
                src: 5000,
                dst: 100,
                len: 300,
            },
        ];
        mapped.write(&src, &runs).unwrap();
        let landed = dst.read(0, dst.size()).unwrap();
        let mut want = vec![0xDE; dst.size()];
        for r in runs {
            let (s, d, n) = (r.src as usize, r.dst as usize, r.len as usize);
            want[d..d + n].copy_from_slice(&bytes[s..s + n]);
        }
        assert!(landed == want, "every run landed, nothing else changed");
        // Runs outside either side are refused before a byte moves.
        let size = dst.size() as u64;
        for bad in [
            WriteRun {
                src: 0,
                dst: size - 10,
                len: 11,
            },
            WriteRun {
                src: size - 10,
                dst: 0,
                len: 11,
            },
            WriteRun {
                src: 0,
                dst: u64::MAX - 5,
                len: 11,
            },
        ] {
            let e = mapped
                .write(
                    &src,
                    &[
                        WriteRun {
                            src: 0,
                            dst: 0,
                            len: 64,
                        },
                        bad,
                    ],
                )
                .unwrap_err();
            assert!(e.contains("leaves the"), "{e}");
        }
        assert_eq!(
            dst.read(0, 64).unwrap(),
            vec![0xDE; 64],
            "the good run before a bad one did not move"
        );
    }

    #[tokio::test]
    async fn wrong_secrets_foreign_keys_and_silent_connections_get_no_pool() {
        let dst = pool(true);
        let (memory, _serving) = serve(&dst).await.unwrap().unwrap();
        let attach_with =
            |memory: RemoteMemory| tokio::task::spawn_blocking(move || attach(&memory, "test"));
        // A wrong secret: the decode closes the connection, no descriptor.
        let mut forged = memory.clone();
        forged.key[0] ^= 1;
        let e = attach_with(forged).await.unwrap().unwrap_err();
        assert!(e.message.contains("a wrong secret"), "{e}");
        // Keys that do not name a pool socket are malformed, not tried.
        for key in [
            vec![],
            vec![0; 16],
            [vec![0; 16], b"other-socket".to_vec()].concat(),
        ] {
            let e = attach_with(RemoteMemory {
                key,
                ..memory.clone()
            })
            .await
            .unwrap()
            .unwrap_err();
            assert!(e.is_malformed(), "{e}");
        }
        // A socket nobody serves (another host, or a receiver gone).
        let mut gone = memory.clone();
        *gone.key.last_mut().unwrap() ^= 1;
        let e = attach_with(gone).await.unwrap().unwrap_err();
        assert!(e.message.contains("not on this host"), "{e}");
        // A size other than the file's.
        let e = attach_with(RemoteMemory {
            size: memory.size + 4096,
            ..memory.clone()
        })
        .await
        .unwrap()
        .unwrap_err();
        assert!(e.message.contains("holds"), "{e}");
        // Silent connections, more than the unproven bound: a sender still gets the pool at
        // once, the oldest silent ones are closed, and the sender goes on getting it.
        let (_, name) = parse_key(&memory).unwrap();
        let addr = SocketAddr::from_abstract_name(name).unwrap();
        let mut silent: Vec<_> = (0..MAX_UNPROVEN + 4)
            .map(|_| UnixStream::connect_addr(&addr).unwrap())
            .collect();
        for _ in 0..3 {
            let t = std::time::Instant::now();
            attach_with(memory.clone())
                .await
                .unwrap()
                .expect("attached");
            assert!(t.elapsed() < HANDSHAKE_TIMEOUT, "waited {:?}", t.elapsed());
        }
        silent[0]
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let read = std::io::Read::read(&mut silent[0], &mut [0u8; 1]);
        assert!(matches!(read, Ok(0)), "the oldest was closed: {read:?}");
        silent.clear();
        // An anonymous pool is not a file, one on /dev/shm can shrink: nothing to serve.
        assert!(serve(&pool(false)).await.unwrap().is_none());
        let path = std::env::temp_dir().join(format!("kvferry-mapped-{}", std::process::id()));
        let layout = KvLayout::new(ModelSpec::preset("tiny").unwrap(), 16).unwrap();
        let shm = HostPool::create_shm(&path, layout, 8).unwrap();
        assert!(serve(&shm).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_pool_file_that_could_shrink_is_never_mapped() {
        // A rogue receiver that answers the secret with a file it could shrink under the
        // sender's mapping (a SIGBUS at the sender's next write).
        let dst = pool(true);
        let mut name = NAME_PREFIX.to_vec();
        name.extend_from_slice(uuid::Uuid::new_v4().simple().to_string().as_bytes());
        let listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let size = dst.size() as u64;
        let rogue = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _ = std::io::Read::read_exact(&mut stream, &mut [0u8; 16]);
            let fd = rustix::fs::memfd_create("rogue", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            rustix::fs::ftruncate(&fd, size).unwrap();
            let mut header = [0u8; 16];
            header[..8].copy_from_slice(&size.to_le_bytes());
            crate::fd_passing::send(&stream, &header, Some(fd.as_raw_fd())).unwrap();
        });
        let memory = RemoteMemory {
            base: 0,
            size,
            key: [vec![1; 16], name].concat(),
        };
        let e = tokio::task::spawn_blocking(move || attach(&memory, "test"))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.message.contains("not sealed"), "{e}");
        rogue.join().unwrap();
    }

    /// A rogue receiver's listener on a fresh pool socket name, and its key.
    fn rogue_listener(size: u64) -> (UnixListener, RemoteMemory) {
        let mut name = NAME_PREFIX.to_vec();
        name.extend_from_slice(uuid::Uuid::new_v4().simple().to_string().as_bytes());
        let listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let memory = RemoteMemory {
            base: 0,
            size,
            key: [vec![1; 16], name].concat(),
        };
        (listener, memory)
    }

    /// What `attach` says of a rogue receiver's sealed memfd of `size` bytes made with `flags`
    /// (`None`: such a memfd cannot be made here).
    async fn rogue_file(size: u64, flags: rustix::fs::MemfdFlags) -> Option<String> {
        let seal = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
        let fd = rustix::fs::memfd_create("rogue", seal | flags).ok()?;
        rustix::fs::ftruncate(&fd, size).ok()?;
        rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK).unwrap();
        let (listener, memory) = rogue_listener(size);
        let rogue = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _ = std::io::Read::read_exact(&mut stream, &mut [0u8; 16]);
            let mut header = [0u8; 16];
            header[..8].copy_from_slice(&size.to_le_bytes());
            crate::fd_passing::send(&stream, &header, Some(fd.as_raw_fd())).unwrap();
        });
        let e = tokio::task::spawn_blocking(move || attach(&memory, "test"))
            .await
            .unwrap()
            .unwrap_err();
        rogue.join().unwrap();
        Some(e.message)
    }

    #[tokio::test]
    async fn a_sparse_pool_file_is_never_mapped() {
        // Sealed, of the size its Hello announced, but with nothing allocated: mapping it
        // populated would allocate 1 GiB of shared memory in the sender's name.
        let e = rogue_file(1 << 30, rustix::fs::MemfdFlags::empty()).await;
        let e = e.expect("a memfd");
        assert!(e.contains("sparse (0 of its 1073741824 bytes"), "{e}");
    }

    #[tokio::test]
    async fn a_hugetlbfs_pool_file_is_never_mapped() {
        // Sealed, and it could be allocated whole, but writes into it fault once the host's
        // huge pages run out: refused by its file system before its size is looked at.
        match rogue_file(2 << 20, rustix::fs::MemfdFlags::HUGETLB).await {
            Some(e) => assert!(e.contains("not plain shared memory"), "{e}"),
            None => println!("no hugetlbfs memfd on this kernel: nothing to refuse"),
        }
    }

    #[tokio::test]
    async fn a_pool_socket_that_never_accepts_costs_a_bounded_wait() {
        // A listener whose backlog is full: a blocking connect would wait for ever.
        let (listener, memory) = rogue_listener(1 << 20);
        let name = memory.key[16..].to_vec();
        let addr = rustix::net::SocketAddrUnix::new_abstract_name(&name).unwrap();
        let mut queued = Vec::new();
        loop {
            let fd = rustix::net::socket_with(
                rustix::net::AddressFamily::UNIX,
                rustix::net::SocketType::STREAM,
                rustix::net::SocketFlags::NONBLOCK,
                None,
            )
            .unwrap();
            match rustix::net::connect(&fd, &addr) {
                Ok(()) => queued.push(fd),
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => panic!("filling the backlog: {e}"),
            }
            assert!(queued.len() < 100_000, "the backlog never filled");
        }
        let t = std::time::Instant::now();
        let e = tokio::task::spawn_blocking(move || attach(&memory, "test"))
            .await
            .unwrap()
            .unwrap_err();
        println!(
            "refused after {:?} ({} connections queued): {e}",
            t.elapsed(),
            queued.len()
        );
        assert!(e.message.contains("accepted no connection within"), "{e}");
        assert!(t.elapsed() < HANDSHAKE_TIMEOUT * 4, "{:?}", t.elapsed());
        drop(listener);
    }
}
