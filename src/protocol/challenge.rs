//! The cluster token proven on the control connection, never sent (from [`TOKEN_PROOFS`] on).
//!
//! A decode with a token puts a fresh nonce in its Hello and no token. The prefill answers with
//! a [`Challenge`]: a nonce of its own and its proof over the decode's Hello; the decode checks
//! that proof (a prefill that does not know the token gets nothing more) and answers with a
//! [`ChallengeReply`], its proof over the same Hello and both nonces. Only then does the prefill
//! take the Hello. Each proof is HMAC-SHA-256 keyed by the token over a label naming the
//! prover's role, both nonces and the whole Hello frame: an observer of the exchange learns
//! neither the token nor anything it can answer the next challenge with, a proof made for one
//! role is no proof for the other, and a Hello changed on the way (its data endpoint, its key)
//! fails both proofs.
//!
//! [`TOKEN_PROOFS`]: super::TOKEN_PROOFS

use ring::hmac;

use super::Secret;

/// An HMAC-SHA-256 tag: one side's proof that it holds the token. Its `Debug` does not print
/// it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenMac(pub [u8; 32]);

impl std::fmt::Debug for TokenMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenMac(..)")
    }
}

/// Prefill -> decode, answering a Hello that carries a nonce, when the prefill has a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// The prefill's nonce, fresh for this Hello.
    pub nonce: Secret,
    /// The prefill's proof ([`Prover::Prefill`]).
    pub proof: TokenMac,
}

/// Decode -> prefill: the answer to a [`Challenge`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChallengeReply {
    /// The decode's proof ([`Prover::Decode`]).
    pub proof: TokenMac,
}

/// Which side a proof is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prover {
    /// The prefill, in its [`Challenge`].
    Prefill,
    /// The decode, in its [`ChallengeReply`].
    Decode,
}

impl Prover {
    fn label(self) -> &'static [u8] {
        match self {
            Prover::Prefill => b"kvferry token proof: prefill\0",
            Prover::Decode => b"kvferry token proof: decode\0",
        }
    }
}

/// What both proofs of one handshake cover: the Hello frame as sent, the decode's nonce (in
/// that Hello) and the prefill's.
#[derive(Clone, Copy, Debug)]
pub struct Handshake<'a> {
    /// The decode's Hello, the whole frame.
    pub hello: &'a [u8],
    /// The decode's nonce.
    pub decode_nonce: &'a Secret,
    /// The prefill's nonce.
    pub prefill_nonce: &'a Secret,
}

impl Handshake<'_> {
    fn message(&self, prover: Prover) -> Vec<u8> {
        let label = prover.label();
        let mut m = Vec::with_capacity(label.len() + 32 + self.hello.len());
        m.extend_from_slice(label);
        m.extend_from_slice(self.decode_nonce.as_bytes());
        m.extend_from_slice(self.prefill_nonce.as_bytes());
        m.extend_from_slice(self.hello);
        m
    }

    /// `prover`'s proof that it holds `token`.
    pub fn prove(&self, token: &str, prover: Prover) -> TokenMac {
        let key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
        let tag = hmac::sign(&key, &self.message(prover));
        let mut mac = [0u8; 32];
        mac.copy_from_slice(tag.as_ref());
        TokenMac(mac)
    }

    /// Whether `mac` is `prover`'s proof that it holds `token` (compared in constant time).
    pub fn verify(&self, token: &str, prover: Prover, mac: &TokenMac) -> bool {
        let key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
        hmac::verify(&key, &self.message(prover), &mac.0).is_ok()
    }
}

/// What a ZeroMQ socket presents as its PLAIN password to a peer of [`TOKEN_PROOFS`] or later:
/// derived from the token and useless for anything but passing that peer's ZAP handler (the
/// token itself never goes). Lower-case hex of HMAC-SHA-256 keyed by the token.
///
/// [`TOKEN_PROOFS`]: super::TOKEN_PROOFS
pub fn zap_password(token: &str) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
    let tag = hmac::sign(&key, b"kvferry ZeroMQ PLAIN password\0");
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_only_for_its_token_role_nonces_and_hello() {
        let (d, p) = (Secret::random().unwrap(), Secret::random().unwrap());
        let hs = Handshake {
            hello: b"a hello frame",
            decode_nonce: &d,
            prefill_nonce: &p,
        };
        let mac = hs.prove("s3cret", Prover::Decode);
        assert!(hs.verify("s3cret", Prover::Decode, &mac));
        assert!(!hs.verify("s3cre", Prover::Decode, &mac), "another token");
        assert!(
            !hs.verify("s3cret", Prover::Prefill, &mac),
            "a decode's proof is no prefill's"
        );
        let other = Secret::random().unwrap();
        let replayed = Handshake {
            prefill_nonce: &other,
            ..hs
        };
        assert!(
            !replayed.verify("s3cret", Prover::Decode, &mac),
            "a proof for one challenge answers no other"
        );
        let changed = Handshake {
            hello: b"a hellO frame",
            ..hs
        };
        assert!(
            !changed.verify("s3cret", Prover::Decode, &mac),
            "a changed Hello"
        );
        assert_eq!(format!("{mac:?}"), "TokenMac(..)");
    }

    #[test]
    fn the_zap_password_is_not_the_token_and_depends_on_it() {
        let p = zap_password("s3cret");
        assert_eq!(p.len(), 64);
        assert!(!p.contains("s3cret"));
        assert_eq!(p, zap_password("s3cret"));
        assert_ne!(p, zap_password("s3cret2"));
    }
}
