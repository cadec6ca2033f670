//! Where KV bytes live, in terms every layer shares: the kind of memory, a span of a pool, a
//! run from one pool to another, and memory a receiver exposes for one-sided writes.
//!
//! These types sit below the kernels, the protocol and the transports (all three use them, none
//! owns them) and know nothing of layouts or the network: offsets and lengths, nothing more.

/// Where a pool's memory lives, which decides the kernel that moves its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory (anonymous or shared): the CPU kernel.
    Host,
    /// Memory of CUDA device `ordinal`: the CUDA kernel.
    Device {
        /// CUDA device ordinal.
        ordinal: usize,
    },
}

/// Memory a receiver exposed for one-sided writes (its decode pool): what a sender needs to
/// write into it. Carried in Hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteMemory {
    /// Address of the first byte in the receiver's process.
    pub base: u64,
    /// Bytes exposed.
    pub size: u64,
    /// The transport's access key (a packed UCX rkey).
    pub key: Vec<u8>,
}

/// One contiguous copy from pool to pool (a one-sided write, or a placed run): `len` bytes
/// from offset `src` of the sender's pool to offset `dst` of the receiver's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRun {
    /// Offset in the sender's pool.
    pub src: u64,
    /// Offset in the receiver's memory.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

impl WriteRun {
    /// Where the run is read, in the sender's pool.
    pub fn source(&self) -> Span {
        Span {
            offset: self.src,
            len: self.len,
        }
    }

    /// Where the run lands, in the receiver's pool.
    pub fn destination(&self) -> Span {
        Span {
            offset: self.dst,
            len: self.len,
        }
    }
}

/// A contiguous range of a pool: the run of a placed send ([`DataSender::send_runs`]) or the
/// place a receiver lands it ([`Placer::place`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Offset in the pool.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}
