//! The names the KV cache goes by wherever it is described: its element type ([`Dtype`]), its
//! attention kind ([`AttentionKind`]) and the order of tokens and heads inside a page
//! ([`PageOrder`]), with the rule that says which page orders and sizes can exchange KV
//! ([`wire_order`]: the agents' Hello and the registry's pairing use it alike). One definition serves the registry's JSON (serde),
//! the control protocol's Hello, the command line and the layout arithmetic, so a rank's
//! description never passes through a conversion on its way from one to another.
//!
//! Each name is written once, in the enum's `name()`: [`crate::named_enum!`] parses and displays
//! by it, and the serde names (snake_case) are the same, as a test here checks.

/// A name that does not parse as the enum it should.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown {what} {name:?}; expected one of {expected}")]
pub struct UnknownName {
    /// Which kind of name.
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The accepted names.
    pub expected: &'static str,
}

/// Implements `FromStr` (error [`UnknownName`]) and `Display` for an enum by its `name()`
/// method, over every value `all` holds: `named_enum!(Type, "what", "a, b", [Type::A, Type::B])`.
#[macro_export]
macro_rules! named_enum {
    ($ty:ty, $what:literal, $expected:literal, $all:expr) => {
        impl ::std::str::FromStr for $ty {
            type Err = $crate::UnknownName;
            fn from_str(s: &str) -> ::std::result::Result<Self, $crate::UnknownName> {
                $all.into_iter()
                    .find(|v| v.name() == s)
                    .ok_or_else(|| $crate::UnknownName {
                        what: $what,
                        name: s.to_owned(),
                        expected: $expected,
                    })
            }
        }
        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

/// Element type of the KV cache. fp8 variants are one byte each; kvferry never interprets values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    Fp16,
    /// fp8 e4m3 (4 exponent bits, 3 mantissa bits), 1 byte.
    Fp8E4m3,
    /// fp8 e5m2 (5 exponent bits, 2 mantissa bits), 1 byte.
    Fp8E5m2,
    /// IEEE single, 4 bytes.
    Fp32,
}

impl Dtype {
    /// Every dtype, for tests and help texts.
    pub const ALL: [Dtype; 5] = [
        Dtype::Bf16,
        Dtype::Fp16,
        Dtype::Fp8E4m3,
        Dtype::Fp8E5m2,
        Dtype::Fp32,
    ];

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
            Dtype::Fp32 => 4,
        }
    }

    /// The name used on the command line and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
            Dtype::Fp32 => "fp32",
        }
    }
}

/// Attention kind, which decides how many planes a layer has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Multi-head or grouped-query attention: a K plane and a V plane per layer.
    Mha,
    /// Multi-head latent attention (DeepSeek): one latent plane per layer, replicated across TP,
    /// so the model has one KV "head".
    Mla,
}

impl AttentionKind {
    /// Both kinds.
    pub const ALL: [AttentionKind; 2] = [AttentionKind::Mha, AttentionKind::Mla];

    /// Planes per layer.
    pub fn planes(self) -> usize {
        match self {
            AttentionKind::Mha => 2,
            AttentionKind::Mla => 1,
        }
    }

    /// The name used on the command line and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Mha => "mha",
            AttentionKind::Mla => "mla",
        }
    }
}

/// Order of tokens and heads inside one block (one page of one plane).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PageOrder {
    /// `[token][head][dim]`: SGLang, vLLM NHD, FlashInfer. A token's heads are contiguous.
    TokenMajor,
    /// `[head][token][dim]`: vLLM HND. A head's tokens are contiguous, so a head slice of a
    /// page is one run.
    HeadMajor,
    /// vLLM's CPU backend on its `vec` attention path (float32, or a CPU without AMX): per
    /// page `[head][K: dim x token (transposed) | V: token x dim]`. K's tokens are not
    /// separable, so a page moves as whole head slices, and only to a pool of the same order.
    VllmCpuVec,
    /// vLLM's CPU backend on its `amx` path (bf16 on a CPU with AMX): per page `[head][K | V]`
    /// as the `vec` path, each half packed in 16 x 2 tiles (K `[token/16][dim/2][16][2]`, V
    /// `[dim/16][token/2][16][2]`). Moves as whole head slices, only to a pool of this order.
    VllmCpuAmx,
    /// A transfer's order only, never a pool's: `vllm_cpu_vec` pages between pools of other
    /// page sizes, re-blocked. A selection of `nt` tokens travels per layer and head as one
    /// `vec` block of exactly those tokens, K `[dim][nt]` (transposed) then V `[nt][dim]`, so
    /// each side copies, per page it touches, one run of tokens for each of K's dims and one
    /// for V, and pieces start at any token.
    VllmCpuVecSpan,
}

impl PageOrder {
    /// Every order.
    pub const ALL: [PageOrder; 5] = [
        PageOrder::TokenMajor,
        PageOrder::HeadMajor,
        PageOrder::VllmCpuVec,
        PageOrder::VllmCpuAmx,
        PageOrder::VllmCpuVecSpan,
    ];

    /// The name used on the command line and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            PageOrder::TokenMajor => "token_major",
            PageOrder::HeadMajor => "head_major",
            PageOrder::VllmCpuVec => "vllm_cpu_vec",
            PageOrder::VllmCpuAmx => "vllm_cpu_amx",
            PageOrder::VllmCpuVecSpan => "vllm_cpu_vec_span",
        }
    }

    /// The finest unit a transfer may cut a page into.
    pub fn granularity(self) -> Granularity {
        match self {
            PageOrder::TokenMajor | PageOrder::HeadMajor | PageOrder::VllmCpuVecSpan => {
                Granularity::Token
            }
            PageOrder::VllmCpuVec | PageOrder::VllmCpuAmx => Granularity::Head,
        }
    }
}

/// The finest unit of a page that a transfer may move on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// Any token range of any head range: pieces may start and end mid-page.
    Token,
    /// Whole head slices of whole pages: pieces start on a page boundary, and the last page of
    /// a room moves whole (its unused token slots included).
    Head,
}

/// The order a page selection travels in between a pool of `source` (its page order and page
/// size) and one of `destination`: the destination's when both cut pages by token and their
/// pages are the same size, token-major when the sizes differ (re-blocked token by token). A
/// head-granular order moves to a pool of the same order only: whole pages when the page sizes
/// match, and `vllm_cpu_vec` pages of other sizes re-blocked (`vllm_cpu_vec_span`); `amx`'s
/// tiles only to pages of their own size. Otherwise why not, naming both.
pub fn wire_order(
    source: (PageOrder, usize),
    destination: (PageOrder, usize),
) -> Result<PageOrder, String> {
    let ((a, a_page), (b, b_page)) = (source, destination);
    if a.granularity() == Granularity::Token && b.granularity() == Granularity::Token {
        return Ok(if a_page == b_page {
            b
        } else {
            PageOrder::TokenMajor
        });
    }
    if a != b {
        let whole = if a.granularity() == Granularity::Head {
            a
        } else {
            b
        };
        return Err(format!(
            "page orders {a} and {b} cannot exchange KV: {whole} pages move only as whole head slices, to a pool of the same order"
        ));
    }
    if a_page != b_page {
        if a == PageOrder::VllmCpuVec {
            return Ok(PageOrder::VllmCpuVecSpan);
        }
        return Err(format!(
            "{a} pages move whole: page_size must match (source {a_page}, destination {b_page})"
        ));
    }
    Ok(a)
}

named_enum!(
    PageOrder,
    "page order",
    "token_major, head_major, vllm_cpu_vec, vllm_cpu_amx, vllm_cpu_vec_span",
    PageOrder::ALL
);
named_enum!(
    Dtype,
    "dtype",
    "bf16, fp16, fp8_e4m3, fp8_e5m2, fp32",
    Dtype::ALL
);
named_enum!(
    AttentionKind,
    "attention kind",
    "mha, mla",
    AttentionKind::ALL
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_the_same_in_json_on_the_command_line_and_in_text() {
        fn check<T>(all: &[T], name: fn(T) -> &'static str)
        where
            T: Copy + std::fmt::Debug + PartialEq + std::str::FromStr + std::fmt::Display,
            T: serde::Serialize + serde::de::DeserializeOwned,
            T::Err: std::fmt::Debug,
        {
            for &v in all {
                let json = serde_json::to_value(v).unwrap();
                assert_eq!(json, name(v), "{v:?}");
                assert_eq!(serde_json::from_value::<T>(json).unwrap(), v);
                assert_eq!(name(v).parse::<T>().unwrap(), v);
                assert_eq!(v.to_string(), name(v));
            }
        }
        check(&Dtype::ALL, Dtype::name);
        check(&AttentionKind::ALL, AttentionKind::name);
        check(&PageOrder::ALL, PageOrder::name);
    }

    #[test]
    fn an_unknown_name_lists_the_accepted_ones() {
        let e = "fp64".parse::<Dtype>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown dtype \"fp64\"; expected one of bf16, fp16, fp8_e4m3, fp8_e5m2, fp32"
        );
        assert!("gqa".parse::<AttentionKind>().is_err());
    }
}
