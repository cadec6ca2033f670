//! The JSON wire types of the registry API, shared by the server, its client and the agents.
//!
//! Owns the shape of a [`Registration`] and its validation ([`Registration::validate`]): every
//! check that needs only the registration itself lives here, so a client can run it before
//! sending. Checks against other registrations (group topology) live in `registry`.
//! Ranges are half-open (`start..end`); all counts are `u32`. A layout's [`Dtype`],
//! [`AttentionKind`] and [`PageOrder`] are `kvferry_wire`'s, the words the agents' layouts and
//! Hello use too.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use kvferry_wire::kv::{AttentionKind, Dtype, PageOrder};

/// The role a rank plays in the PD cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Computes the KV cache; registered into a prefill group keyed by `dp_rank`.
    Prefill,
    /// Receives the KV cache; its registration is informational (listed, not grouped).
    Decode,
}

impl Role {
    /// The name used on the wire and in metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The model's whole KV layout (not the part one rank holds: that is [`Slice`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// MHA or MLA.
    pub kind: AttentionKind,
    /// Number of layers in the model.
    pub num_layers: u32,
    /// Number of KV heads in the whole model (1 for MLA).
    pub num_kv_heads: u32,
    /// Elements per head (per token, per layer).
    pub head_dim: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per page.
    pub page_size: u32,
    /// The order of tokens and heads inside a page of the engine's memory, which decides with
    /// the page size which instances can exchange KV (absent from an older agent's
    /// registration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<PageOrder>,
}

/// A half-open range `start..end` of heads or layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IndexRange {
    /// First index in the range.
    pub start: u32,
    /// One past the last index in the range.
    pub end: u32,
}

impl IndexRange {
    /// The range `start..end`.
    pub fn new(start: u32, end: u32) -> Self {
        Self { start, end }
    }

    /// Number of indices in the range (0 when `end <= start`).
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// True when the range holds no index.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Display for IndexRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// The part of the model's KV cache one rank holds: TP splits heads, PP splits layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Slice {
    /// KV heads this rank holds (indices into the model's heads).
    pub heads: IndexRange,
    /// Layers this rank holds (PP splits may be uneven, e.g. 61 layers over 2 stages).
    pub layers: IndexRange,
}

/// What a rank tells the registry about itself. `POST /v1/ranks` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// New for every process start: a restarted rank is a new instance.
    pub instance_id: Uuid,
    /// Prefill or decode.
    pub role: Role,
    /// Data-parallel rank; prefill groups are keyed by it.
    pub dp_rank: u32,
    /// Data-parallel size.
    pub dp_size: u32,
    /// Tensor-parallel rank within the DP group.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel rank (stage) within the DP group.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// The model's KV layout.
    pub layout: KvLayout,
    /// The part of the layout this rank holds.
    pub slice: Slice,
    /// Where the rank's agent takes control messages; opaque to the registry.
    pub control_endpoint: String,
    /// Data endpoint per transport name (e.g. `zmq-tcp`); opaque to the registry.
    #[serde(default)]
    pub data_endpoints: BTreeMap<String, String>,
    /// What the instance is beyond its layout, and whether it is draining; every field may be
    /// absent (an agent of an older release registers none).
    #[serde(flatten)]
    pub about: About,
}

/// What an instance says it is beyond its layout: what a registry and a router need to pair
/// only instances that can exchange KV (`crate::pairing`), and to find the engine server it
/// belongs to. Absent fields are unknown: they never keep two instances apart.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct About {
    /// The kvferry wire protocol versions the instance speaks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<Versions>,
    /// The kvferry release it runs (`0.1.0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvferry_version: Option<String>,
    /// The engine that embeds the agent and its version (`vllm 0.32.0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// The model the engine serves, by the name clients give it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The base URL of the engine's OpenAI-compatible server (`http://10.0.0.5:8000`), where a
    /// router sends requests: every rank of one server registers the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// The instance is shutting down: it finishes the requests and rooms it has and must be
    /// sent no new ones.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// The protocol versions an instance speaks: `min..=max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versions {
    /// The oldest it accepts.
    pub min: u16,
    /// The newest (the one it speaks natively).
    pub max: u16,
}

impl fmt::Display for Versions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..={}", self.min, self.max)
    }
}

/// Why a registration is impossible on its own, with a message naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRegistration(pub String);

impl Registration {
    /// Checks everything that needs only this registration: sizes > 0, rank < size, layout
    /// numbers > 0, MLA has one KV head, the slice is non-empty and inside the layout.
    pub fn validate(&self) -> Result<(), InvalidRegistration> {
        let fail = |m: String| Err(InvalidRegistration(m));
        for (rank_name, rank, size_name, size) in [
            ("dp_rank", self.dp_rank, "dp_size", self.dp_size),
            ("tp_rank", self.tp_rank, "tp_size", self.tp_size),
            ("pp_rank", self.pp_rank, "pp_size", self.pp_size),
        ] {
            if size == 0 {
                return fail(format!("{size_name} must be > 0"));
            }
            if rank >= size {
                return fail(format!("{rank_name} {rank} must be < {size_name} {size}"));
            }
        }
        let l = &self.layout;
        for (name, value) in [
            ("layout.num_layers", l.num_layers),
            ("layout.num_kv_heads", l.num_kv_heads),
            ("layout.head_dim", l.head_dim),
            ("layout.page_size", l.page_size),
        ] {
            if value == 0 {
                return fail(format!("{name} must be > 0"));
            }
        }
        if l.kind == AttentionKind::Mla && l.num_kv_heads != 1 {
            return fail(format!(
                "layout.num_kv_heads {} must be 1 for an mla layout",
                l.num_kv_heads
            ));
        }
        for (name, range, limit_name, limit) in [
            (
                "slice.heads",
                self.slice.heads,
                "layout.num_kv_heads",
                l.num_kv_heads,
            ),
            (
                "slice.layers",
                self.slice.layers,
                "layout.num_layers",
                l.num_layers,
            ),
        ] {
            if range.is_empty() {
                return fail(format!("{name} {range} is empty (start must be < end)"));
            }
            if range.end > limit {
                return fail(format!("{name} {range} exceeds {limit_name} {limit}"));
            }
        }
        if self.control_endpoint.trim().is_empty() {
            return fail("control_endpoint must not be empty".to_owned());
        }
        Ok(())
    }
}

/// The lease granted by a registration or renewed by a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The rank disappears from lookups unless renewed within this many milliseconds.
    pub lease_ttl_ms: u64,
}

/// `POST /v1/ranks` answer: the lease, and why the instance can exchange KV with none of the
/// other role's live instances, when it can with none of them (`crate::pairing`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admitted {
    /// The lease granted.
    #[serde(flatten)]
    pub lease: Lease,
    /// Set when instances of the other role are registered and none can pair with this one:
    /// the first one's reason, and how many there are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmatched: Option<String>,
}

/// A registration as listed by `GET /v1/ranks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankInfo {
    /// What the rank registered.
    #[serde(flatten)]
    pub registration: Registration,
    /// Milliseconds left before the lease expires unless renewed.
    pub lease_remaining_ms: u64,
    /// Why it can pair with none of the other role's live instances, when it can with none
    /// (`crate::pairing`); absent when it can with one, or none is registered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmatched: Option<String>,
}

/// `GET /v1/ranks` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankList {
    /// Every live registration, prefill first, then by dp, pp, tp rank.
    pub ranks: Vec<RankInfo>,
}

/// A complete prefill DP group: `GET /v1/groups/{dp_rank}` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillGroup {
    /// The group's data-parallel rank.
    pub dp_rank: u32,
    /// Data-parallel size fixed by the group's first registration.
    pub dp_size: u32,
    /// Tensor-parallel size of the group.
    pub tp_size: u32,
    /// Pipeline-parallel size of the group.
    pub pp_size: u32,
    /// The model's KV layout, identical for every rank of the group.
    pub layout: KvLayout,
    /// All `tp_size * pp_size` ranks, ordered by `(pp_rank, tp_rank)`.
    pub ranks: Vec<Registration>,
}

/// `GET /healthz` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// Always `"ok"` when the registry answers.
    pub status: String,
    /// Live prefill registrations.
    pub prefill_ranks: u64,
    /// Live decode registrations.
    pub decode_ranks: u64,
    /// Prefill groups currently known (complete or not).
    pub groups: u64,
}

/// The body of every error response: `{"error": "..."}`. A registration refused because its
/// slot is held by another live instance (409) also names the holder, what is left of its
/// lease and the registry's lease length, so a restarted rank knows how long to wait.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What was wrong, for a human.
    pub error: String,
    /// The live instance holding the slot (409 on register only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Uuid>,
    /// What is left of the holder's lease, in ms (409 on register only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_lease_remaining_ms: Option<u64>,
    /// The registry's lease length, in ms (409 on register only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl_ms: Option<u64>,
}

impl ErrorBody {
    /// A body with only `error`.
    pub fn new(error: impl Into<String>) -> Self {
        Self {
            error: error.into(),
            holder: None,
            holder_lease_remaining_ms: None,
            lease_ttl_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Registration {
        Registration {
            instance_id: Uuid::new_v4(),
            role: Role::Prefill,
            dp_rank: 0,
            dp_size: 1,
            tp_rank: 1,
            tp_size: 2,
            pp_rank: 0,
            pp_size: 1,
            layout: KvLayout {
                kind: AttentionKind::Mha,
                num_layers: 61,
                num_kv_heads: 8,
                head_dim: 128,
                dtype: Dtype::Fp8E4m3,
                page_size: 16,
                order: None,
            },
            slice: Slice {
                heads: IndexRange::new(4, 8),
                layers: IndexRange::new(0, 61),
            },
            control_endpoint: "tcp://10.0.0.1:7000".to_owned(),
            data_endpoints: BTreeMap::from([(
                "zmq-tcp".to_owned(),
                "tcp://10.0.0.1:7001".to_owned(),
            )]),
            about: Default::default(),
        }
    }

    #[test]
    fn wire_names_are_the_documented_ones() {
        let v = serde_json::to_value(sample()).unwrap();
        assert_eq!(v["role"], "prefill");
        assert_eq!(v["layout"]["kind"], "mha");
        assert_eq!(v["layout"]["dtype"], "fp8_e4m3");
        assert_eq!(v["slice"]["heads"]["start"], 4);
        let back: Registration = serde_json::from_value(v).unwrap();
        assert_eq!(back, sample_with_id(back.instance_id));
    }

    fn sample_with_id(id: Uuid) -> Registration {
        Registration {
            instance_id: id,
            ..sample()
        }
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(sample().validate(), Ok(()));
        type Mutation = fn(&mut Registration);
        let cases: Vec<(Mutation, &str)> = vec![
            (|r| r.tp_rank = 2, "tp_rank 2 must be < tp_size 2"),
            (|r| r.dp_size = 0, "dp_size must be > 0"),
            (|r| r.pp_rank = 1, "pp_rank 1 must be < pp_size 1"),
            (|r| r.layout.page_size = 0, "layout.page_size must be > 0"),
            (
                |r| r.layout.kind = AttentionKind::Mla,
                "must be 1 for an mla layout",
            ),
            (
                |r| r.slice.heads = IndexRange::new(3, 3),
                "slice.heads 3..3 is empty",
            ),
            (
                |r| r.slice.layers = IndexRange::new(30, 62),
                "exceeds layout.num_layers 61",
            ),
            (|r| r.control_endpoint.clear(), "control_endpoint"),
        ];
        for (mutate, want) in cases {
            let mut r = sample();
            mutate(&mut r);
            let err = r.validate().expect_err(want).0;
            assert!(err.contains(want), "{err:?} should contain {want:?}");
        }
    }
}
