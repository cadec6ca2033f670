//! The one encoder and the one decoder of the control protocol (docs/protocol.md).
//!
//! A frame is a 12-byte [`Header`] followed by a body of little-endian fields. The decoder checks
//! the header before it looks at the body, checks every length against the bytes that are
//! actually there and against the protocol's limits before it allocates, and refuses unknown
//! tags, reversed ranges, invalid UTF-8, trailing bytes and frames whose length field disagrees
//! with the bytes given. It never panics and never indexes out of bounds: every read goes
//! through [`Reader`], which returns [`DecodeError::Truncated`] instead.
//!
//! Version rule: the header carries the sender's protocol version and a frame is accepted only
//! if that version is in `MIN_VERSION..=VERSION`, with one exception: a Hello decodes whatever
//! its header version, so that a receiver can answer a peer from the future (or the distant
//! past) with an explicit `incompatible_version` error naming both version ranges instead of a
//! decode failure. For the same reason a Hello from a newer version may carry fields appended
//! after the ones this build knows; they are ignored. The Hello body defined here is frozen:
//! later versions may only append to it.
//!
//! The encoder is infallible. It does not enforce the limits (`MAX_STRING`, `MAX_PAGES`,
//! `MAX_AUX`, `MAX_BODY`) except that a string longer than `MAX_STRING` bytes is cut at a
//! character boundary; a sender that exceeds the other limits produces a frame its peer refuses
//! with [`DecodeError::TooLarge`] (lengths that do not fit their field saturate, so they are
//! refused rather than misread).

use super::{
    Abort, AbortAck, Challenge, ChallengeReply, Chunk, Credit, Done, ErrorMsg, HELD_ROOMS,
    Heartbeat, Hello, HelloAck, MAGIC, MAX_BODY, MIN_VERSION, Message, PROMPT_DIGESTS, Posted,
    PromptDigest, READS, Secret, TokenMac, TransferRequest, VERSION,
};

// Lengths read as u32 are used as usize; kvferry builds for 64-bit targets only.
const _: () = assert!(usize::BITS >= 32);

/// Bytes of the frame header: magic (4), version (2), kind (1), flags (1), body length (4).
pub const HEADER_LEN: usize = 12;

/// Stable kind tags of the frame header.
const KIND_HELLO: u8 = 1;
const KIND_HELLO_ACK: u8 = 2;
const KIND_TRANSFER_REQUEST: u8 = 3;
const KIND_CHUNK: u8 = 4;
const KIND_DONE: u8 = 5;
const KIND_ABORT: u8 = 6;
const KIND_ABORT_ACK: u8 = 7;
const KIND_HEARTBEAT: u8 = 8;
const KIND_ERROR: u8 = 9;
const KIND_CREDIT: u8 = 10;
const KIND_POSTED: u8 = 11;
const KIND_CHALLENGE: u8 = 12;
const KIND_CHALLENGE_REPLY: u8 = 13;

/// Why a byte string is not a valid frame. Every variant is the sender's fault (or foreign
/// traffic); the receiver answers with `bad_message` (or `incompatible_version`) and keeps serving.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The frame does not start with `KVFY`: not kvferry traffic.
    #[error("bad magic {found:02x?}: not a kvferry frame (expected \"KVFY\")")]
    BadMagic {
        /// The first four bytes received.
        found: [u8; 4],
    },
    /// The header's protocol version is outside what this build accepts.
    #[error("unsupported protocol version {version}: this build accepts {min}..={max}")]
    UnsupportedVersion {
        /// Version in the header.
        version: u16,
        /// Oldest version accepted.
        min: u16,
        /// Newest version accepted.
        max: u16,
    },
    /// The header names a message kind that does not exist.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The header's flags byte is not zero (no flags are defined).
    #[error("unsupported header flags {0:#04x}: no flags are defined")]
    BadFlags(u8),
    /// The bytes end before a field (or the header, or the body) is complete.
    #[error("truncated {what}: needs {needed} bytes but {available} remain")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes it needs.
        needed: usize,
        /// Bytes left.
        available: usize,
    },
    /// Bytes left over after the body (frame longer than its header says) or after the last
    /// field of the body.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    /// A length beyond the protocol's limit; refused before anything is allocated.
    #[error("{what} is {len} bytes or items, more than the limit of {max}")]
    TooLarge {
        /// The body, a string field, the page list or the aux blob.
        what: &'static str,
        /// The length announced.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An enum field carries a tag that names no variant.
    #[error("unknown {what} tag {tag}")]
    BadTag {
        /// The enum field.
        what: &'static str,
        /// The tag received.
        tag: u8,
    },
    /// A range whose start is after its end.
    #[error("{what} range {start}..{end} is reversed (start > end)")]
    BadRange {
        /// The range field.
        what: &'static str,
        /// Range start.
        start: u32,
        /// Range end.
        end: u32,
    },
    /// A string field is not valid UTF-8.
    #[error("{what} is not valid UTF-8")]
    BadUtf8 {
        /// The string field.
        what: &'static str,
    },
}

impl DecodeError {
    /// A stable short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::BadMagic { .. } => "bad_magic",
            DecodeError::UnsupportedVersion { .. } => "unsupported_version",
            DecodeError::UnknownKind(_) => "unknown_kind",
            DecodeError::BadFlags(_) => "bad_flags",
            DecodeError::Truncated { .. } => "truncated",
            DecodeError::TrailingBytes(_) => "trailing_bytes",
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::BadTag { .. } => "bad_tag",
            DecodeError::BadRange { .. } => "bad_range",
            DecodeError::BadUtf8 { .. } => "bad_utf8",
        }
    }
}

/// A checked frame header: magic, kind, flags, version and body length are valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The sender's protocol version (anything for a Hello, else within `MIN_VERSION..=VERSION`).
    pub version: u16,
    /// The message kind tag (1..=9).
    pub kind: u8,
    /// Body bytes that follow the header (at most `MAX_BODY`).
    pub body_len: u32,
}

impl Header {
    /// Bytes of the whole frame: header plus body.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len as usize
    }
}

/// Reads and checks the header at the start of `bytes` (which may hold only the header), so a
/// stream transport can learn how many body bytes to read before reading them.
pub fn peek_header(bytes: &[u8]) -> Result<Header, DecodeError> {
    let mut r = Reader::new(Reader::new(bytes).take(HEADER_LEN, "header")?);
    let magic: [u8; 4] = r.array("header")?;
    if magic != MAGIC {
        return Err(DecodeError::BadMagic { found: magic });
    }
    let version = r.u16("header")?;
    let kind = r.u8("header")?;
    let flags = r.u8("header")?;
    let body_len = r.u32("header")?;
    if !(KIND_HELLO..=KIND_CHALLENGE_REPLY).contains(&kind) {
        return Err(DecodeError::UnknownKind(kind));
    }
    if kind != KIND_HELLO && !(MIN_VERSION..=VERSION).contains(&version) {
        return Err(DecodeError::UnsupportedVersion {
            version,
            min: MIN_VERSION,
            max: VERSION,
        });
    }
    if flags != 0 {
        return Err(DecodeError::BadFlags(flags));
    }
    if body_len as usize > MAX_BODY {
        return Err(DecodeError::TooLarge {
            what: "body",
            len: body_len as usize,
            max: MAX_BODY,
        });
    }
    Ok(Header {
        version,
        kind,
        body_len,
    })
}

/// Whether `frame` is one whole, valid Hello: what proves a connection to a prefill's control
/// socket (anything else before it is dropped unread).
pub fn is_hello(frame: &[u8]) -> bool {
    matches!(Message::decode(frame), Ok(Message::Hello(_)))
}

impl Message {
    /// The frame of this message, stamped with this build's [`VERSION`].
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(VERSION)
    }

    /// The frame of this message stamped with protocol `version` (the one negotiated with the
    /// peer, in `MIN_VERSION..=VERSION`), with the fields that version has.
    pub fn encode_as(&self, version: u16) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        self.encode_into_as(version, &mut out);
        out
    }

    /// Appends the frame of this message to `out` (which may already hold other frames).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        self.encode_into_as(VERSION, out);
    }

    fn encode_into_as(&self, version: u16, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.push(self.kind_tag());
        out.push(0); // flags
        out.extend_from_slice(&[0; 4]); // body length, patched below
        let mut w = Writer(out);
        match self {
            Message::Hello(m) => {
                w.u16(m.min_version);
                w.u16(m.max_version);
                w.uuid(&m.instance);
                w.u8(role_tag(m.role));
                w.ranks(&m.ranks);
                w.layout(&m.layout);
                w.str(&m.data_endpoint);
                w.str(&m.token);
                w.u32(m.slots);
                w.u32(m.slot_bytes);
                w.memory(m.pool.as_ref());
                w.u8(u8::from(m.revocable_runs));
                w.secret(&m.chunk_key);
                w.memory(m.shared_pool.as_ref());
                w.opt_secret(m.nonce.as_ref());
            }
            Message::HelloAck(m) => {
                w.u16(m.version);
                w.uuid(&m.instance);
                w.u8(u8::from(m.direct));
            }
            Message::TransferRequest(m) => {
                w.u64(m.room);
                w.uuid(&m.prefill_instance);
                w.range(&m.tokens);
                w.range(&m.layers);
                w.range(&m.heads);
                w.u8(order_tag(m.wire_order));
                w.pages(&m.dst_pages);
                w.u32(m.requesters);
                w.secret(&m.secret);
                w.opt_secret(m.room_key.as_ref());
                if version >= PROMPT_DIGESTS {
                    w.opt16(m.prompt_digest.as_ref().map(PromptDigest::as_bytes));
                }
                if version >= READS {
                    w.opt_pages(m.src_pages.as_deref());
                }
            }
            Message::Chunk(m) => {
                w.u64(m.room);
                w.uuid(&m.prefill_instance);
                w.u32(m.seq);
                w.range(&m.tokens);
                w.range(&m.layers);
                w.range(&m.heads);
                w.u64(m.len);
                w.u64(m.checksum);
                w.u8(u8::from(m.direct));
                w.placed(m.placed.as_ref());
                w.secret(&m.secret);
                w.secret(&m.sender_key);
            }
            Message::Done(m) => {
                w.u64(m.room);
                w.uuid(&m.prefill_instance);
                w.u32(m.chunks);
                w.u64(m.bytes);
                w.blob(&m.aux);
            }
            Message::Abort(m) => {
                w.u64(m.room);
                w.uuid(&m.instance);
                w.u8(m.code.tag());
                w.str(&m.message);
            }
            Message::AbortAck(m) => {
                w.u64(m.room);
                w.uuid(&m.instance);
            }
            Message::Heartbeat(m) => {
                w.uuid(&m.instance);
                w.u64(m.seq);
                if version >= HELD_ROOMS {
                    w.rooms(&m.rooms);
                }
            }
            Message::Error(m) => {
                w.opt_u64(m.room);
                w.u8(m.code.tag());
                w.str(&m.message);
            }
            Message::Credit(m) => {
                w.uuid(&m.instance);
                w.u32(m.slots);
            }
            Message::Posted(m) => {
                w.uuid(&m.instance);
                w.u64(m.key);
                w.u8(u8::from(m.accepted));
            }
            Message::Challenge(m) => {
                w.secret(&m.nonce);
                w.fixed(&m.proof.0);
            }
            Message::ChallengeReply(m) => w.fixed(&m.proof.0),
        }
        let body_len = saturate(out.len() - start - HEADER_LEN);
        out[start + 8..start + HEADER_LEN].copy_from_slice(&body_len.to_le_bytes());
    }

    /// Decodes exactly one frame: `bytes` must hold the header and the whole body, nothing more.
    pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
        let header = peek_header(bytes)?;
        let body = bytes.get(HEADER_LEN..).unwrap_or_default();
        let body_len = header.body_len as usize;
        if body.len() < body_len {
            return Err(DecodeError::Truncated {
                what: "body",
                needed: body_len,
                available: body.len(),
            });
        }
        if body.len() > body_len {
            return Err(DecodeError::TrailingBytes(body.len() - body_len));
        }
        let mut r = Reader::new(body);
        let msg = match header.kind {
            KIND_HELLO => Message::Hello(Hello {
                min_version: r.u16("min_version")?,
                max_version: r.u16("max_version")?,
                instance: r.uuid("instance")?,
                role: role_from_tag(r.u8("role")?)?,
                ranks: r.ranks()?,
                layout: r.layout()?,
                data_endpoint: r.string("data_endpoint")?,
                token: r.string("token")?,
                slots: r.u32("slots")?,
                slot_bytes: r.u32("slot_bytes")?,
                // Older Hellos end before these: they still decode, to be refused by version.
                pool: if r.is_empty() {
                    None
                } else {
                    r.memory("pool")?
                },
                revocable_runs: !r.is_empty() && r.flag("revocable_runs")?,
                chunk_key: match r.is_empty() {
                    true => Secret::default(),
                    false => r.secret("chunk_key")?,
                },
                shared_pool: match r.is_empty() {
                    true => None,
                    false => r.memory("shared_pool")?,
                },
                nonce: match r.is_empty() {
                    true => None,
                    false => r.opt_secret("nonce")?,
                },
            }),
            KIND_HELLO_ACK => Message::HelloAck(HelloAck {
                version: r.u16("version")?,
                instance: r.uuid("instance")?,
                direct: r.flag("direct")?,
            }),
            KIND_TRANSFER_REQUEST => Message::TransferRequest(TransferRequest {
                room: r.u64("room")?,
                prefill_instance: r.uuid("prefill_instance")?,
                tokens: r.range("tokens")?,
                layers: r.range("layers")?,
                heads: r.range("heads")?,
                wire_order: order_from_tag(r.u8("wire_order")?, "wire_order")?,
                dst_pages: r.pages("dst_pages")?,
                requesters: r.u32("requesters")?,
                secret: r.secret("secret")?,
                room_key: r.opt_secret("room_key")?,
                prompt_digest: match header.version >= PROMPT_DIGESTS {
                    true => r.opt16("prompt_digest")?.map(PromptDigest::from_bytes),
                    false => None,
                },
                src_pages: match header.version >= READS {
                    true => r.opt_pages("src_pages")?,
                    false => None,
                },
            }),
            KIND_CHUNK => Message::Chunk(Chunk {
                room: r.u64("room")?,
                prefill_instance: r.uuid("prefill_instance")?,
                seq: r.u32("seq")?,
                tokens: r.range("tokens")?,
                layers: r.range("layers")?,
                heads: r.range("heads")?,
                len: r.u64("len")?,
                checksum: r.u64("checksum")?,
                direct: r.flag("direct")?,
                placed: r.placed()?,
                secret: r.secret("secret")?,
                sender_key: r.secret("sender_key")?,
            }),
            KIND_DONE => Message::Done(Done {
                room: r.u64("room")?,
                prefill_instance: r.uuid("prefill_instance")?,
                chunks: r.u32("chunks")?,
                bytes: r.u64("bytes")?,
                aux: r.blob("aux")?,
            }),
            KIND_ABORT => Message::Abort(Abort {
                room: r.u64("room")?,
                instance: r.uuid("instance")?,
                code: code_from_tag(r.u8("code")?)?,
                message: r.string("message")?,
            }),
            KIND_ABORT_ACK => Message::AbortAck(AbortAck {
                room: r.u64("room")?,
                instance: r.uuid("instance")?,
            }),
            KIND_HEARTBEAT => Message::Heartbeat(Heartbeat {
                instance: r.uuid("instance")?,
                seq: r.u64("seq")?,
                rooms: match header.version >= HELD_ROOMS {
                    true => r.rooms("rooms")?,
                    false => Vec::new(),
                },
            }),
            KIND_ERROR => Message::Error(ErrorMsg {
                room: r.opt_u64("room")?,
                code: code_from_tag(r.u8("code")?)?,
                message: r.string("message")?,
            }),
            KIND_CREDIT => Message::Credit(Credit {
                instance: r.uuid("instance")?,
                slots: r.u32("slots")?,
            }),
            KIND_POSTED => Message::Posted(Posted {
                instance: r.uuid("instance")?,
                key: r.u64("key")?,
                accepted: r.flag("accepted")?,
            }),
            KIND_CHALLENGE => Message::Challenge(Challenge {
                nonce: r.secret("nonce")?,
                proof: TokenMac(r.array("proof")?),
            }),
            KIND_CHALLENGE_REPLY => Message::ChallengeReply(ChallengeReply {
                proof: TokenMac(r.array("proof")?),
            }),
            other => return Err(DecodeError::UnknownKind(other)),
        };
        // A newer peer's Hello may append fields this build does not know.
        let extensible = header.kind == KIND_HELLO && header.version > VERSION;
        if !r.is_empty() && !extensible {
            return Err(DecodeError::TrailingBytes(r.remaining()));
        }
        Ok(msg)
    }

    /// The stable kind tag of the frame header.
    fn kind_tag(&self) -> u8 {
        match self {
            Message::Hello(_) => KIND_HELLO,
            Message::HelloAck(_) => KIND_HELLO_ACK,
            Message::TransferRequest(_) => KIND_TRANSFER_REQUEST,
            Message::Chunk(_) => KIND_CHUNK,
            Message::Done(_) => KIND_DONE,
            Message::Abort(_) => KIND_ABORT,
            Message::AbortAck(_) => KIND_ABORT_ACK,
            Message::Heartbeat(_) => KIND_HEARTBEAT,
            Message::Error(_) => KIND_ERROR,
            Message::Credit(_) => KIND_CREDIT,
            Message::Posted(_) => KIND_POSTED,
            Message::Challenge(_) => KIND_CHALLENGE,
            Message::ChallengeReply(_) => KIND_CHALLENGE_REPLY,
        }
    }
}

mod fields;

use fields::*;

#[cfg(test)]
mod tests;
