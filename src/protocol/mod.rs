//! The control protocol: one binary, versioned message set for every transport.
//!
//! Every message is one frame: a 12-byte header (magic `KVFY`, protocol version, message kind,
//! flags, body length) and a body of little-endian fields. [`Message::encode`] and
//! [`Message::decode`] are the only encoder and decoder; decoding any byte string returns a
//! message or a typed [`DecodeError`], never a panic. docs/protocol.md specifies the frames,
//! the staging wire order, the handshake and the versioning policy.
//!
//! This module checks the *shape* of a message (lengths, enum tags, ranges start <= end, size
//! limits); whether the values make sense for a room (pages in the pool, byte counts against the
//! layout, known rooms, epochs) is checked by the agent that handles the message.

mod challenge;
mod codec;
mod digest;
mod secret;

pub use challenge::{Challenge, ChallengeReply, Handshake, Prover, TokenMac, zap_password};

pub use codec::{DecodeError, HEADER_LEN, Header, is_hello, peek_header};
pub use digest::PromptDigest;
/// Compares without an early exit, so that the time taken does not tell how much of a guess
/// was right (secrets, the token in the ZAP handler).
pub use kvferry_wire::http::constant_time_eq;
pub use secret::Secret;

use std::ops::Range;

use uuid::Uuid;

use crate::layout::{AttentionKind, Dtype, PageOrder};
use crate::memory::RemoteMemory;
use crate::reason::FailureCode;

/// Four bytes that open every frame; anything else is foreign traffic.
pub const MAGIC: [u8; 4] = *b"KVFY";
/// The protocol version this build speaks natively.
pub const VERSION: u16 = 13;
/// The first version whose staged chunks may come in pieces (ZeroMQ: up to
/// [`crate::transport::MAX_PIECES`] payload frames, sent from the prefill's pool).
pub const PIECES: u16 = 6;
/// The first version whose decodes land a placed run in several pieces of their pool when
/// their placer is revocable (`Hello::revocable_runs`): a prefill then cuts a placed chunk
/// by its own contiguous ranges, not by ranges contiguous on both sides.
pub const SCATTERED: u16 = 8;
/// The first version whose transfer requests carry the decode's prompt digest
/// (`TransferRequest::prompt_digest`) and whose errors may say `prompt_mismatch`.
pub const PROMPT_DIGESTS: u16 = 9;
/// The first version whose heartbeats name the rooms a decode holds for queued requests
/// (`Heartbeat::rooms`).
pub const HELD_ROOMS: u16 = 9;
/// The first version that re-blocks vLLM CPU `vec` pages between pools of other page sizes
/// (wire order `vllm_cpu_vec_span`, tag 5).
pub const VEC_SPAN: u16 = 10;
/// The first version whose prefills prove each data connection with the key the decode gave
/// them in Hello ([`data_proof`]); older ones send an empty frame.
pub const DATA_PROOFS: u16 = 11;
/// The first version that proves the cluster token instead of sending it: a Hello carries a
/// nonce and no token, answered by a [`Challenge`] ([`challenge`](self::challenge)), and ZeroMQ
/// sockets present [`zap_password`] instead of the token.
pub const TOKEN_PROOFS: u16 = 12;
/// The first version whose transfer requests may name the prefill's pages themselves
/// (`TransferRequest::src_pages`): reads of a prefill that serves them (`--serve-reads`).
pub const READS: u16 = 13;
/// The oldest version this build still accepts (rolling upgrades: see docs/protocol.md).
/// Version 4 put a secret on every chunk; older peers cannot prove theirs, so they are refused.
pub const MIN_VERSION: u16 = 4;
/// What a prefill sends first on each data connection to a decode it speaks `version` with
/// (`transport::ProofCheck`): the decode's key for it ([`Hello::chunk_key`]), or from a
/// version before [`DATA_PROOFS`] an empty frame.
pub fn data_proof(version: u16, chunk_key: &Secret) -> bytes::Bytes {
    match version >= DATA_PROOFS {
        true => bytes::Bytes::copy_from_slice(chunk_key.as_bytes()),
        false => bytes::Bytes::new(),
    }
}

/// Largest body a control frame may carry; larger frames are refused before allocation (the
/// transport refuses them before it reads them: [`MAX_FRAME`]). A request for [`MAX_PAGES`]
/// pages fits.
pub const MAX_BODY: usize = 5 << 20;
/// Largest frame: header and body.
pub const MAX_FRAME: usize = codec::HEADER_LEN + MAX_BODY;
/// Longest string field.
pub const MAX_STRING: usize = 4096;
/// Most pages one message may list.
pub const MAX_PAGES: usize = 1 << 20;
/// Most runs one placed chunk may have (`Placed::runs`; the transport numbers them in 16 bits).
pub const MAX_RUNS: usize = 1 << 16;
/// Largest opaque payload a Done may carry (`Done::aux`).
pub const MAX_AUX: usize = 64 << 10;
/// Most rooms one heartbeat may name (`Heartbeat::rooms`).
pub const MAX_HELD_ROOMS: usize = 1 << 16;

/// Role of the sender of a Hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A prefill agent (sends KV).
    Prefill,
    /// A decode agent (receives KV).
    Decode,
}

/// Parallel ranks of an agent: data, tensor and pipeline parallel rank and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Ranks {
    /// DP rank.
    pub dp_rank: u32,
    /// DP size.
    pub dp_size: u32,
    /// TP rank.
    pub tp_rank: u32,
    /// TP size.
    pub tp_size: u32,
    /// PP rank.
    pub pp_rank: u32,
    /// PP size.
    pub pp_size: u32,
}

/// The KV layout an agent serves, as announced in Hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireLayout {
    /// Attention kind.
    pub kind: AttentionKind,
    /// Element type.
    pub dtype: Dtype,
    /// Order inside a page of this agent's pool.
    pub order: PageOrder,
    /// Layers of the model.
    pub num_layers: u32,
    /// KV heads of the model.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Global heads this agent holds.
    pub heads: Range<u32>,
    /// Global layers this agent holds.
    pub layers: Range<u32>,
}

/// Decode -> prefill, once per connection: who I am and what I hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Oldest protocol version the sender accepts.
    pub min_version: u16,
    /// Newest protocol version the sender speaks.
    pub max_version: u16,
    /// The sender's instance id (its epoch: new at every process start).
    pub instance: Uuid,
    /// The sender's role.
    pub role: Role,
    /// The sender's ranks.
    pub ranks: Ranks,
    /// The sender's layout.
    pub layout: WireLayout,
    /// Where the sender receives data (transport specific, e.g. `tcp://10.0.0.2:40111`).
    pub data_endpoint: String,
    /// The cluster's token, from decodes older than [`TOKEN_PROOFS`] (and to prefills older
    /// than it); empty otherwise: from that version on a decode with a token sends
    /// [`Hello::nonce`] and proves the token when challenged.
    pub token: String,
    /// Staging slots the sender of this Hello grants its peer: chunks that may be in flight
    /// towards it at once (its receive budget).
    pub slots: u32,
    /// Largest chunk the sender of this Hello accepts, in bytes.
    pub slot_bytes: u32,
    /// The decode pool, exposed for the transport's one-sided writes (the direct path), when
    /// the decode's transport has them (UCX: the pool's rkey).
    pub pool: Option<RemoteMemory>,
    /// The decode lands placed runs that arrive as eager messages through receives it can
    /// revoke (UCX over tcp); a prefill that would send runs eagerly places them only then.
    pub revocable_runs: bool,
    /// Chosen by the decode for this connection: every chunk the prefill sends it carries this
    /// key ([`Chunk::sender_key`]), so that a chunk is credited to its sender only if the
    /// sender is the peer that said Hello, whether or not its room is still known.
    pub chunk_key: Secret,
    /// The decode pool's memory file, served to prefills of its host for mapped writes
    /// (`transport/mapped.rs`), when its transport carries same-host traffic (`zmq-ipc`, UCX
    /// allowed shared memory) and the pool is a sealed memory file (version 7).
    pub shared_pool: Option<RemoteMemory>,
    /// The decode's nonce, when it has a token and proves it ([`TOKEN_PROOFS`]): the prefill
    /// answers with a [`Challenge`] before it takes the Hello.
    pub nonce: Option<Secret>,
}

/// Prefill -> decode: the Hello is accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloAck {
    /// The version both sides now speak.
    pub version: u16,
    /// The prefill's instance id; every later reference carries it.
    pub instance: Uuid,
    /// The prefill will write into the decode's pool directly (the direct path): the decode
    /// must count its writes possible until its last word on each room.
    pub direct: bool,
}

/// Decode -> prefill: send me this part of a room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferRequest {
    /// The room (chosen by the router).
    pub room: u64,
    /// The prefill instance the decode expects to serve it (refused if it is not the receiver).
    pub prefill_instance: Uuid,
    /// Tokens of the room to send, counted from the room's first token.
    pub tokens: Range<u32>,
    /// Global layers to send.
    pub layers: Range<u32>,
    /// Global heads to send.
    pub heads: Range<u32>,
    /// Order of the staging bytes the decode wants (usually the prefill's page order).
    pub wire_order: PageOrder,
    /// Destination pages in the decode pool (page `i` holds tokens `i*page_size..`): used by
    /// transports that write into the pool directly.
    pub dst_pages: Vec<u32>,
    /// How many decode ranks will ask this prefill rank for this room (heterogeneous TP: one
    /// prefill rank may serve several); the room is complete on the prefill once all have.
    pub requesters: u32,
    /// Chosen by the decode for this transfer, sent only here: every chunk of the transfer
    /// carries it, and a chunk that does not is dropped before it touches the pool.
    pub secret: Secret,
    /// The room's key, when the router gave the engines one: the prefill serves the room only
    /// to requests that carry the key its engine announced.
    pub room_key: Option<Secret>,
    /// The digest of the decode's prompt over the room's tokens, when its engine gave one
    /// (version 9): the prefill serves the room only if its engine announced the same one, or
    /// none.
    pub prompt_digest: Option<PromptDigest>,
    /// A read (version 13): the pages of the prefill's pool that are the room, named by the
    /// decode for a room no engine announced. Served only by a prefill started with
    /// `--serve-reads`, which then serves these pages as the room; `None`: the engine's room.
    pub src_pages: Option<Vec<u32>>,
}

/// Prefill -> decode, on the data plane ahead of each chunk's bytes: what the bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// The room.
    pub room: u64,
    /// The sender's instance id.
    pub prefill_instance: Uuid,
    /// Sequence number of the chunk within the room, from 0.
    pub seq: u32,
    /// Tokens of the room in this chunk.
    pub tokens: Range<u32>,
    /// Global layers in this chunk.
    pub layers: Range<u32>,
    /// Global heads in this chunk.
    pub heads: Range<u32>,
    /// Bytes of the chunk: the payload that follows, or, when `direct`, the bytes already
    /// written into the decode pool.
    pub len: u64,
    /// xxh3-64 of the bytes in wire order, or 0 when checksums are off.
    pub checksum: u64,
    /// The bytes were written straight into the decode pool's pages (one-sided, flushed
    /// before this header was sent); no payload follows.
    pub direct: bool,
    /// The bytes follow as placed messages, one per run, which the decode receives straight
    /// into its pages; no payload follows.
    pub placed: Option<Placed>,
    /// The secret of the transfer's request ([`TransferRequest::secret`]).
    pub secret: Secret,
    /// The decode's key for this prefill ([`Hello::chunk_key`]).
    pub sender_key: Secret,
}

/// How a placed chunk's bytes follow its header: the chunk's bytes in wire order, cut into
/// runs that are each contiguous in the prefill's pool and in the decode's. The decode
/// computes each run's place in its pages from its own layout (`kernel::cpu::placements`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Names the chunk's messages on the transport (UCX: the tags of its runs).
    pub key: u64,
    /// Bytes of each run, in wire order; at most [`MAX_RUNS`].
    pub runs: Vec<u64>,
}

/// Prefill -> decode: every chunk of the room has been posted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Done {
    /// The room.
    pub room: u64,
    /// The sender's instance id.
    pub prefill_instance: Uuid,
    /// Chunks posted.
    pub chunks: u32,
    /// Bytes posted.
    pub bytes: u64,
    /// Opaque payload from the prefill engine (e.g. the first output token); bounded size.
    pub aux: Vec<u8>,
}

/// Either side: stop this room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// The room.
    pub room: u64,
    /// The sender's instance id.
    pub instance: Uuid,
    /// Why.
    pub code: FailureCode,
    /// Free text.
    pub message: String,
}

/// Either side: the room is stopped here; nothing more will be sent or written for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortAck {
    /// The room.
    pub room: u64,
    /// The sender's instance id.
    pub instance: Uuid,
}

/// Either side, periodically: I am alive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// The sender's instance id.
    pub instance: Uuid,
    /// Increases by one per heartbeat.
    pub seq: u64,
    /// Decode -> prefill (version 9): rooms the decode's engine holds queued requests for,
    /// at most [`MAX_HELD_ROOMS`]; the prefill keeps them past their TTL, up to their maximum
    /// lifetime. Empty from a prefill.
    pub rooms: Vec<u64>,
}

/// Decode -> prefill: `slots` more chunks may be sent (one per chunk scattered and freed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credit {
    /// The sender's instance id.
    pub instance: Uuid,
    /// Slots freed.
    pub slots: u32,
}

/// Decode -> prefill: the receives for a placed chunk's runs are posted (or,
/// `accepted` false, never will be: the chunk was refused or its room ended), so the prefill
/// sends the runs (or drops them). Runs therefore always meet a posted receive: UCX 1.13 can
/// crash a receiver that matches a receive to a run queued by a sender that died since.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Posted {
    /// The sender's (decode's) instance id.
    pub instance: Uuid,
    /// The chunk's `Placed::key`.
    pub key: u64,
    /// Whether the receives are posted.
    pub accepted: bool,
}

/// Either side: a message could not be served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorMsg {
    /// The room concerned, if any.
    pub room: Option<u64>,
    /// Closed set of codes.
    pub code: FailureCode,
    /// Free text for operators.
    pub message: String,
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`HelloAck`].
    HelloAck(HelloAck),
    /// See [`TransferRequest`].
    TransferRequest(TransferRequest),
    /// See [`Chunk`].
    Chunk(Chunk),
    /// See [`Done`].
    Done(Done),
    /// See [`Abort`].
    Abort(Abort),
    /// See [`AbortAck`].
    AbortAck(AbortAck),
    /// See [`Heartbeat`].
    Heartbeat(Heartbeat),
    /// See [`ErrorMsg`].
    Error(ErrorMsg),
    /// See [`Credit`].
    Credit(Credit),
    /// See [`Challenge`].
    Challenge(Challenge),
    /// See [`ChallengeReply`].
    ChallengeReply(ChallengeReply),
    /// See [`Posted`].
    Posted(Posted),
}

impl Message {
    /// The message's name, for logs and metrics labels.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::HelloAck(_) => "hello_ack",
            Message::TransferRequest(_) => "transfer_request",
            Message::Chunk(_) => "chunk",
            Message::Done(_) => "done",
            Message::Abort(_) => "abort",
            Message::AbortAck(_) => "abort_ack",
            Message::Heartbeat(_) => "heartbeat",
            Message::Error(_) => "error",
            Message::Credit(_) => "credit",
            Message::Posted(_) => "posted",
            Message::Challenge(_) => "challenge",
            Message::ChallengeReply(_) => "challenge_reply",
        }
    }
}

/// Picks the version two peers speak: the newest both accept.
pub fn negotiate(min_version: u16, max_version: u16) -> Option<u16> {
    let v = max_version.min(VERSION);
    (v >= min_version.max(MIN_VERSION)).then_some(v)
}
