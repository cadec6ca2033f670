//! The process's ZAP handler (ZeroMQ RFC 27): libzmq asks it, during the handshake of every
//! connection to a socket with a ZAP domain, whether the credentials the peer presented may
//! pass. kvferry's server sockets use PLAIN with a password derived from the cluster token
//! ([`crate::protocol::zap_password`]), or, from peers older than
//! [`crate::protocol::TOKEN_PROOFS`], the token itself; each socket registers its own domain,
//! so agents with different tokens can share a process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::context;
use crate::protocol::{constant_time_eq, zap_password};

/// Where libzmq sends ZAP requests (fixed by RFC 27).
const ZAP_ENDPOINT: &str = "inproc://zeromq.zap.01";

/// What one registered domain takes: the password derived from its token, or (from a peer
/// older than token proofs) the token.
struct Expected {
    token: Arc<str>,
    password: String,
    /// The token itself is taken from beyond loopback too (`--insecure`).
    insecure: bool,
}

/// What each registered domain expects.
fn domains() -> &'static Mutex<HashMap<String, Arc<Expected>>> {
    static DOMAINS: OnceLock<Mutex<HashMap<String, Arc<Expected>>>> = OnceLock::new();
    DOMAINS.get_or_init(Default::default)
}

/// A ZAP domain expecting one token; unregistered when dropped (with the socket it guards).
pub(super) struct Domain(String);

impl Domain {
    /// Registers a fresh domain for `token`, starting the handler on first use.
    pub(super) fn register(token: Arc<str>, insecure: bool) -> Result<Domain, zmq::Error> {
        static HANDLER: OnceLock<Result<(), zmq::Error>> = OnceLock::new();
        (*HANDLER.get_or_init(start))?;
        let name = format!("kvferry-{}", uuid::Uuid::new_v4().simple());
        domains().lock().unwrap_or_else(|e| e.into_inner()).insert(
            name.clone(),
            Arc::new(Expected {
                password: zap_password(&token),
                token,
                insecure,
            }),
        );
        Ok(Domain(name))
    }

    pub(super) fn name(&self) -> &str {
        &self.0
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        domains()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.0);
    }
}

/// Binds the handler's socket (before any socket needs it) and serves it on a thread for the
/// life of the process.
fn start() -> Result<(), zmq::Error> {
    let socket = context().socket(zmq::REP)?;
    socket.set_linger(0)?;
    socket.bind(ZAP_ENDPOINT)?;
    super::spawn("kvferry-zap", move || {
        loop {
            let request = match socket.recv_multipart(0) {
                Ok(r) => r,
                Err(zmq::Error::EINTR) => continue,
                Err(_) => return, // the context is going away
            };
            let reply = answer(&request);
            if socket.send_multipart(reply, 0).is_err() {
                return;
            }
        }
    })
    .map_err(|_| zmq::Error::EMFILE)
}

/// The reply to one ZAP request: version, request id, status code, status text, user id,
/// metadata.
fn answer(request: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let id = request.get(1).cloned().unwrap_or_default();
    let (code, text) = verdict(request);
    let address = || {
        request
            .get(3)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .unwrap_or_default()
    };
    match (code, text) {
        ("200", IN_CLEAR) => tracing::warn!(
            peer = %address(),
            "a peer older than token proofs sent the cluster token in clear: upgrade it"
        ),
        ("200", _) => {}
        _ => tracing::warn!(peer = %address(), reason = text, "connection refused: authentication"),
    }
    vec![
        b"1.0".to_vec(),
        id,
        code.as_bytes().to_vec(),
        text.as_bytes().to_vec(),
        if code == "200" {
            super::PLAIN_USER.as_bytes().to_vec()
        } else {
            Vec::new()
        },
        Vec::new(),
    ]
}

/// RFC 27 request frames: version, request id, domain, address, routing id, mechanism, then the
/// mechanism's credentials (PLAIN: user name, password).
fn verdict(request: &[Vec<u8>]) -> (&'static str, &'static str) {
    let frame = |i: usize| request.get(i).map(Vec::as_slice).unwrap_or_default();
    if frame(0) != b"1.0" {
        return ("500", "unsupported ZAP version");
    }
    if frame(5) != b"PLAIN" {
        return ("400", "a token is required (PLAIN)");
    }
    let domain = String::from_utf8_lossy(frame(2));
    let expected = domains()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(domain.as_ref())
        .cloned();
    // An IP address beyond loopback (an ipc peer's address is none).
    let address = String::from_utf8_lossy(frame(3));
    let remote = address
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| !ip.to_canonical().is_loopback());
    match expected {
        Some(e) if constant_time_eq(frame(7), e.password.as_bytes()) => ("200", "OK"),
        Some(e) if constant_time_eq(frame(7), e.token.as_bytes()) && remote && !e.insecure => (
            "400",
            "the token in clear from beyond loopback (a peer older than protocol 12: upgrade \
             it, or give --insecure)",
        ),
        Some(e) if constant_time_eq(frame(7), e.token.as_bytes()) => ("200", IN_CLEAR),
        Some(_) => ("400", "wrong token"),
        None => ("400", "unknown domain"),
    }
}

/// The status text of a peer let in by the token itself (one older than token proofs).
const IN_CLEAR: &str = "OK (the token in clear)";

#[cfg(test)]
mod tests {
    use super::*;

    fn request(domain: &str, mechanism: &str, password: &[u8]) -> Vec<Vec<u8>> {
        from("127.0.0.1", domain, mechanism, password)
    }

    fn from(address: &str, domain: &str, mechanism: &str, password: &[u8]) -> Vec<Vec<u8>> {
        vec![
            b"1.0".to_vec(),
            b"7".to_vec(),
            domain.as_bytes().to_vec(),
            address.as_bytes().to_vec(),
            Vec::new(),
            mechanism.as_bytes().to_vec(),
            b"kvferry".to_vec(),
            password.to_vec(),
        ]
    }

    #[test]
    fn only_the_password_of_the_domains_token_or_that_token_passes() {
        let domain = Domain::register(Arc::from("s3cret"), false).expect("register");
        let derived = zap_password("s3cret");
        let ok = answer(&request(domain.name(), "PLAIN", derived.as_bytes()));
        assert_eq!(
            (ok[1].as_slice(), ok[2].as_slice()),
            (&b"7"[..], &b"200"[..])
        );
        // A peer older than token proofs: on loopback (IPv4 as IPv6 too), or by ipc (no
        // address), only.
        assert_eq!(
            answer(&from("::ffff:127.0.0.1", domain.name(), "PLAIN", b"s3cret"))[2],
            b"200"
        );
        assert_eq!(
            answer(&from("", domain.name(), "PLAIN", b"s3cret"))[2],
            b"200"
        );
        let remote = answer(&from("10.0.0.5", domain.name(), "PLAIN", b"s3cret"));
        assert_eq!(remote[2], b"400");
        assert!(String::from_utf8_lossy(&remote[3]).contains("--insecure"));
        let derived_remote = answer(&from(
            "10.0.0.5",
            domain.name(),
            "PLAIN",
            derived.as_bytes(),
        ));
        assert_eq!(derived_remote[2], b"200");
        let insecure = Domain::register(Arc::from("s3cret"), true).expect("register");
        assert_eq!(
            answer(&from("10.0.0.5", insecure.name(), "PLAIN", b"s3cret"))[2],
            b"200"
        );
        assert_eq!(
            answer(&request(domain.name(), "PLAIN", b"s3cret"))[2],
            b"200"
        );
        let other = zap_password("s3cret2");
        assert_eq!(
            answer(&request(domain.name(), "PLAIN", other.as_bytes()))[2],
            b"400"
        );
        assert_eq!(
            answer(&request(domain.name(), "PLAIN", b"s3cre"))[2],
            b"400"
        );
        assert_eq!(answer(&request(domain.name(), "PLAIN", b""))[2], b"400");
        assert_eq!(
            answer(&request(domain.name(), "NULL", b"s3cret"))[2],
            b"400"
        );
        assert_eq!(
            answer(&request("kvferry-other", "PLAIN", b"s3cret"))[2],
            b"400"
        );
        assert_eq!(answer(&[b"2.0".to_vec()])[2], b"500");
        assert_eq!(
            answer(&[])[2],
            b"500",
            "an empty request is answered, not a panic"
        );
        let name = domain.name().to_owned();
        drop(domain);
        assert_eq!(answer(&request(&name, "PLAIN", b"s3cret"))[2], b"400");
    }
}
