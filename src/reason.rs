//! Why a room failed: the closed set of failure codes and the reason that
//! carries one with a free-text message. The codes appear in room JSON, in metrics labels and
//! on the wire (as a one-byte tag); docs/operations.md says what each means and what to do.

use std::fmt;

use serde::{Serialize, Serializer};

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = $tag:literal, $name:literal;)+) => {
        /// A failure code. The set is closed: tags are stable on the wire.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum FailureCode {
            $($(#[$doc])* $variant,)+
        }

        impl FailureCode {
            /// Every code, in tag order.
            pub const ALL: &'static [FailureCode] = &[$(FailureCode::$variant,)+];

            /// The code's name in JSON and metrics.
            pub fn name(self) -> &'static str {
                match self { $(FailureCode::$variant => $name,)+ }
            }

            /// The one-byte wire tag.
            pub fn tag(self) -> u8 {
                match self { $(FailureCode::$variant => $tag,)+ }
            }

            /// The code of a wire tag.
            pub fn from_tag(tag: u8) -> Option<Self> {
                match tag { $($tag => Some(FailureCode::$variant),)+ _ => None }
            }
        }
    };
}

codes! {
    /// The peer stopped answering heartbeats or its connection died.
    PeerDead = 1, "peer_dead";
    /// The prefill group did not register in time.
    TimeoutBootstrap = 2, "timeout_bootstrap";
    /// The prefill engine did not announce the room's pages in time.
    TimeoutReady = 3, "timeout_ready";
    /// A transfer made no progress in time.
    TimeoutStall = 4, "timeout_stall";
    /// An engine or a peer aborted the room.
    Aborted = 5, "aborted";
    /// A chunk's checksum did not match its bytes.
    Checksum = 6, "checksum";
    /// The peers' KV layouts cannot be paired.
    IncompatibleLayout = 7, "incompatible_layout";
    /// The peers share no protocol version.
    IncompatibleVersion = 8, "incompatible_version";
    /// An advertised address could not be reached.
    Unreachable = 9, "unreachable";
    /// The peer refused our token.
    Unauthorized = 10, "unauthorized";
    /// A message was malformed or inconsistent with the room.
    BadMessage = 11, "bad_message";
    /// Landed bytes differ from the synthetic pattern.
    VerifyFailed = 12, "verify_failed";
    /// The peer does not know the room.
    UnknownRoom = 13, "unknown_room";
    /// The agent is shutting down.
    Shutdown = 14, "shutdown";
    /// The decode's prompt differs from the one the prefill computed the room's KV for.
    PromptMismatch = 15, "prompt_mismatch";
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for FailureCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// A failure code with a message for operators.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reason {
    /// The code.
    pub code: FailureCode,
    /// Free text.
    pub message: String,
}

impl Reason {
    /// A reason from a code and a message.
    pub fn new(code: FailureCode, message: impl Into<String>) -> Self {
        Reason {
            code,
            message: message.into(),
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_names_are_unique_and_round_trip() {
        let mut tags = std::collections::HashSet::new();
        let mut names = std::collections::HashSet::new();
        for &c in FailureCode::ALL {
            assert!(tags.insert(c.tag()) && names.insert(c.name()));
            assert_eq!(FailureCode::from_tag(c.tag()), Some(c));
        }
        assert_eq!(FailureCode::from_tag(0), None);
        assert_eq!(FailureCode::from_tag(255), None);
        let json = serde_json::to_string(&Reason::new(FailureCode::PeerDead, "x")).unwrap();
        assert_eq!(json, r#"{"code":"peer_dead","message":"x"}"#);
    }
}
