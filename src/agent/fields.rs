//! The engine's request fields as the engine API reads and writes them: the checks of an
//! engine's pages, and the JSON forms of fields that JSON cannot carry as they are (room ids as
//! strings, room keys and CUDA IPC event handles as hex, aux bytes as base64). The HTTP API and
//! the Python package parse requests through the same serde forms, so both refuse the same
//! input with the same message.

use serde::Serializer;

use super::engine_api::RoomError;

/// Refuses a room that can never fit: its `tokens` need more pages than the whole pool has
/// (exhausted would invite a retry that cannot succeed).
pub(crate) fn fits_pool(tokens: usize, needed: usize, pool_pages: usize) -> Result<(), RoomError> {
    if needed > pool_pages {
        return Err(RoomError::BadRequest(format!(
            "tokens {tokens} need {needed} pages but the whole pool has {pool_pages} (--pool-pages): this room can never fit"
        )));
    }
    Ok(())
}

/// Checks an engine's page list: enough pages for the tokens, each in the pool, none twice
/// from page `from` on. The pages before `from` are never touched (a decode's own prefix, or
/// the blocks before a sliding window, which an engine may leave all the same empty block), so
/// they may repeat.
pub(crate) fn validate_pages(
    pages: &[u32],
    needed: usize,
    num_pages: usize,
    from: usize,
) -> Result<(), RoomError> {
    if pages.len() < needed {
        return Err(RoomError::BadRequest(format!(
            "{} pages given, the tokens need {needed}",
            pages.len()
        )));
    }
    if let Some(p) = pages.iter().find(|&&p| p as usize >= num_pages) {
        return Err(RoomError::BadRequest(format!(
            "page {p} is out of range: the pool has {num_pages} pages"
        )));
    }
    let mut sorted = pages[from.min(pages.len())..].to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(RoomError::BadRequest(format!(
            "page {} is listed twice",
            w[0]
        )));
    }
    Ok(())
}

/// A room id in JSON: a string (beyond 2^53 a JSON number breaks).
pub(crate) fn room_as_string<S: Serializer>(room: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(room)
}

/// A room key in JSON: 32 hex digits, or absent.
pub(crate) mod room_key {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::protocol::Secret;

    pub(crate) fn serialize<S: Serializer>(key: &Option<Secret>, s: S) -> Result<S::Ok, S::Error> {
        match key {
            Some(key) => s.serialize_str(&key.to_hex()),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Secret>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|k| {
                k.parse()
                    .map_err(|e: String| serde::de::Error::custom(format!("room_key: {e}")))
            })
            .transpose()
    }
}

/// A CUDA IPC event handle in JSON: 128 hex digits, or absent.
pub(crate) mod ipc_event {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::kernel::cuda::IpcEventHandle;

    pub(crate) fn serialize<S: Serializer>(
        handle: &Option<IpcEventHandle>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match handle {
            Some(handle) => s.serialize_str(&handle.to_string()),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<IpcEventHandle>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|h| {
                h.parse()
                    .map_err(|e: String| serde::de::Error::custom(format!("cuda_ipc_event {e}")))
            })
            .transpose()
    }
}

/// Aux bytes in JSON: standard base64 (with padding), or absent.
pub(crate) mod aux {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(
        bytes: &Option<Vec<u8>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => s.serialize_str(&STANDARD.encode(bytes)),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| {
                STANDARD
                    .decode(text)
                    .map_err(|e| serde::de::Error::custom(format!("aux is not valid base64: {e}")))
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_lists_are_checked() {
        assert_eq!(validate_pages(&[0, 1, 2], 3, 4, 0), Ok(()));
        assert_eq!(
            validate_pages(&[0, 0, 1, 2], 4, 4, 2),
            Ok(()),
            "not touched: may repeat"
        );
        let bad = |pages: &[u32], needed| match validate_pages(pages, needed, 4, 0) {
            Err(RoomError::BadRequest(m)) => m,
            other => panic!("{pages:?}: {other:?}"),
        };
        assert!(bad(&[0], 2).contains("1 pages given"));
        assert!(bad(&[0, 4], 2).contains("page 4 is out of range"));
        assert!(bad(&[2, 1, 2], 3).contains("page 2 is listed twice"));
        assert!(
            matches!(validate_pages(&[3, 3, 0, 4], 4, 4, 2), Err(RoomError::BadRequest(m)) if m.contains("page 4 is out of range")),
            "every page in range, even those not touched"
        );
        assert!(
            matches!(validate_pages(&[3, 3, 0, 0], 4, 4, 1), Err(RoomError::BadRequest(m)) if m.contains("page 0 is listed twice"))
        );
        assert!(
            matches!(fits_pool(17, 5, 4), Err(RoomError::BadRequest(m)) if m.contains("--pool-pages"))
        );
    }
}
