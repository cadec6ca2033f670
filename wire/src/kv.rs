//! The names the KV cache goes by wherever it is described: its element type ([`Dtype`]) and
//! its attention kind ([`AttentionKind`]). One definition serves the registry's JSON (serde),
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
