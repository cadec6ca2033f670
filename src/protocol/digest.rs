//! A prompt's digest: 128 bits of the token ids a room's KV was computed for. The prefill's
//! engine gives it with the room, the decode's engine with its request, each from the prompt it
//! holds; a request whose digest differs is refused (`prompt_mismatch`), so KV never lands on
//! another prompt than its own. Not a secret (the room key is): a check that two engines agree.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::secret::parse_hex16;

/// xxh3-128 of the token ids, each a little-endian u32.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PromptDigest([u8; 16]);

impl PromptDigest {
    /// The digest of these token ids.
    pub fn of_tokens(tokens: &[u32]) -> PromptDigest {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        PromptDigest(xxhash_rust::xxh3::xxh3_128(&bytes).to_le_bytes())
    }

    /// The digest of these bytes (as the wire carries it).
    pub fn from_bytes(bytes: [u8; 16]) -> PromptDigest {
        PromptDigest(bytes)
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

/// Lower-case hex, 32 digits.
impl fmt::Display for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PromptDigest({self})")
    }
}

impl FromStr for PromptDigest {
    type Err = String;

    /// 32 hex digits.
    fn from_str(s: &str) -> Result<PromptDigest, String> {
        parse_hex16(s)
            .map(PromptDigest)
            .ok_or_else(|| format!("a prompt digest is 32 hex digits (128 bits), not {s:?}"))
    }
}

impl Serialize for PromptDigest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PromptDigest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<PromptDigest, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_tell_prompts_apart_and_round_trip_as_hex() {
        let a = PromptDigest::of_tokens(&[1, 2, 3]);
        assert_eq!(a, PromptDigest::of_tokens(&[1, 2, 3]));
        for other in [&[1, 2, 4][..], &[1, 2], &[1, 2, 3, 0], &[3, 2, 1], &[]] {
            assert_ne!(a, PromptDigest::of_tokens(other), "{other:?}");
        }
        // The definition other engines' connectors reproduce: xxh3-128 of the ids as LE u32,
        // the 128-bit value's bytes little-endian.
        let bytes = [1u32, 2, 3].map(u32::to_le_bytes).concat();
        assert_eq!(
            a.as_bytes(),
            &xxhash_rust::xxh3::xxh3_128(&bytes).to_le_bytes()
        );
        assert_eq!(a.to_string().parse::<PromptDigest>(), Ok(a));
        assert_eq!(a.to_string().len(), 32);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<PromptDigest>(&json).unwrap(), a);
        let bad = serde_json::from_str::<PromptDigest>(r#""xyz""#).unwrap_err();
        assert!(bad.to_string().contains("32 hex digits"), "{bad}");
    }
}
