//! 128 random bits that only the two ends of a transfer know: the decode draws one per
//! transfer and sends it on its authenticated control connection, and every chunk of the
//! transfer must carry it. A chunk without it, on a data port anyone may reach, is forged.
//! The same type carries a room's key, drawn by the router and given to both engines.

use super::constant_time_eq;
use std::fmt;
use std::str::FromStr;

/// A secret of 16 random bytes. Its `Debug` does not print it, and it compares in constant
/// time.
#[derive(Clone, Copy, Default)]
pub struct Secret([u8; 16]);

impl Secret {
    /// Fresh random bytes from the operating system.
    pub fn random() -> Result<Secret, getrandom::Error> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes)?;
        Ok(Secret(bytes))
    }

    /// The secret of these bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Secret {
        Secret(bytes)
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Lower-case hex, 32 digits (how JSON carries a room key).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        constant_time_eq(&self.0, &other.0)
    }
}

impl Eq for Secret {}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl FromStr for Secret {
    type Err = String;

    /// 32 hex digits.
    fn from_str(s: &str) -> Result<Secret, String> {
        parse_hex16(s)
            .map(Secret)
            .ok_or_else(|| format!("a room key is 32 hex digits (128 bits), not {s:?}"))
    }
}

/// 16 bytes from 32 hex digits (either case), or None.
pub(super) fn parse_hex16(s: &str) -> Option<[u8; 16]> {
    if s.len() != 32 || !s.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_random_hidden_and_round_trip_as_hex() {
        let a = Secret::random().expect("random");
        let b = Secret::random().expect("random");
        assert_ne!(a, b, "two draws of 128 bits collide");
        assert_eq!(format!("{a:?}"), "Secret(..)");
        assert_eq!(a.to_hex().parse::<Secret>(), Ok(a));
        assert_eq!(a.to_hex().len(), 32);
        let mut flipped = *a.as_bytes();
        flipped[15] ^= 1;
        assert_ne!(Secret::from_bytes(flipped), a, "the last byte counts");
        for bad in [
            "",
            "00",
            &"g".repeat(32),
            &"0".repeat(33),
            "é".repeat(16).as_str(),
        ] {
            assert!(bad.parse::<Secret>().is_err(), "{bad:?}");
        }
    }
}
