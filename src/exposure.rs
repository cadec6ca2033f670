//! Credentials are not optional off loopback: a process (`bootstrap`, `prefill`, `decode`)
//! whose listening address is not a loopback one refuses to start without a token, unless the
//! operator says `--insecure` (then it warns at start). An agent's engine API, which reads and
//! changes rooms and the pool, never goes beyond loopback without a token ([`check_api`]).
//!
//! A bearer token beyond loopback never travels in clear by default: an HTTP port that checks
//! one and listens beyond loopback serves HTTPS (`--tls-cert`, `--tls-key`), and a client
//! that sends one beyond loopback uses an `https://` URL ([`check_clear`], [`check_clear_url`]);
//! `--insecure` accepts plain HTTP there (a network where every host is trusted, warned at
//! start).
//!
//! An address is loopback when it parses as a loopback IP (`127.0.0.0/8`, `::1`, with or
//! without brackets) or is `localhost`. Everything else counts as exposed: the wildcard
//! addresses `0.0.0.0` and `::`, any other IP, and host names (which may resolve anywhere).

use std::net::IpAddr;

/// A listening address that needs credentials.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {host} is not loopback: give --token or --insecure")]
pub(crate) struct NotLoopback {
    /// The flag that set the address (`--host`, `--api-host`).
    pub(crate) flag: &'static str,
    /// The address as given.
    pub(crate) host: String,
}

/// An engine API beyond loopback without a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--api-host {0} is not loopback: the engine API reads and changes rooms and the pool, so it \
     needs --token (--insecure does not lift this)"
)]
pub(crate) struct ApiNotLoopback(String);

/// A bearer token that would cross the network in clear.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum InClear {
    /// A port checking a token, beyond loopback, without TLS.
    #[error(
        "{flag} {host} is not loopback and its port checks a bearer token, which plain HTTP \
         carries in clear: give --tls-cert and --tls-key (HTTPS), or --insecure"
    )]
    Port {
        /// The flag that set the address.
        flag: &'static str,
        /// The address as given.
        host: String,
    },
    /// A token sent to a plain `http://` URL beyond loopback.
    #[error(
        "{flag} {url} is plain HTTP beyond loopback and the token would travel in clear: serve \
         it over HTTPS and give its https:// URL, or --insecure"
    )]
    Url {
        /// The flag that named the URL.
        flag: &'static str,
        /// The URL as given.
        url: String,
    },
}

/// Refuses a port that checks a token (`token`) on an exposed `host` without `tls`, unless
/// `insecure`.
pub(crate) fn check_clear(
    (flag, host): (&'static str, &str),
    token: bool,
    tls: bool,
    insecure: bool,
) -> Result<(), InClear> {
    match token && !tls && !insecure && !is_loopback(host) {
        true => Err(InClear::Port {
            flag,
            host: host.to_owned(),
        }),
        false => Ok(()),
    }
}

/// Refuses sending a token (`token`) to a plain `http://` `url` beyond loopback, unless
/// `insecure`.
pub(crate) fn check_clear_url(
    (flag, url): (&'static str, &str),
    token: bool,
    insecure: bool,
) -> Result<(), InClear> {
    // The `url` crate reads the scheme and host, as the registry client does (a host of `[::1]`
    // keeps its brackets, which `is_loopback` takes); an `http://` URL it cannot read counts as
    // beyond loopback.
    let plain = match url::Url::parse(url) {
        Ok(parsed) => parsed.scheme() == "http" && !parsed.host_str().is_some_and(is_loopback),
        Err(_) => url.trim_start().to_ascii_lowercase().starts_with("http://"),
    };
    match token && !insecure && plain {
        true => Err(InClear::Url {
            flag,
            url: url.to_owned(),
        }),
        false => Ok(()),
    }
}

/// An advertised address that peers cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unadvertisable {
    /// A wildcard: a peer cannot connect to it.
    #[error(
        "{flag} {host} is a wildcard, not an address peers can reach: give --advertise-host with this host's address"
    )]
    Wildcard {
        /// The flag that set it.
        flag: &'static str,
        /// The address as given.
        host: String,
    },
    /// Empty.
    #[error("--advertise-host is empty")]
    Empty,
}

/// The address to advertise: `advertise` when given, else the bound `host`; a wildcard
/// (`0.0.0.0`, `::`) or an empty one is refused.
pub(crate) fn advertised(host: &str, advertise: Option<&str>) -> Result<String, Unadvertisable> {
    let (flag, chosen) = match advertise {
        Some(a) => ("--advertise-host", a),
        None => ("--host", host),
    };
    let bare = chosen
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(chosen);
    if bare.is_empty() {
        return Err(Unadvertisable::Empty);
    }
    if bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
        return Err(Unadvertisable::Wildcard {
            flag,
            host: chosen.to_owned(),
        });
    }
    Ok(bare.to_owned())
}

/// The URL of an HTTP port bound at `bound` (`https://` when `tls`), for listening lines and
/// logs: the bound address, or for a wildcard bind (0.0.0.0, ::) `ADVERTISE:PORT`, an address
/// a client can use.
pub(crate) fn url_of(bound: std::net::SocketAddr, advertise: &str, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    if !bound.ip().is_unspecified() {
        return format!("{scheme}://{bound}");
    }
    match advertise.parse::<std::net::Ipv6Addr>() {
        Ok(v6) => format!("{scheme}://[{v6}]:{}", bound.port()),
        Err(_) => format!("{scheme}://{advertise}:{}", bound.port()),
    }
}

/// The loopback address of `bound`'s family: what a client on this host reaches a wildcard
/// bind at.
pub(crate) fn loopback_of(bound: std::net::SocketAddr) -> &'static str {
    match bound {
        std::net::SocketAddr::V4(_) => "127.0.0.1",
        std::net::SocketAddr::V6(_) => "::1",
    }
}

/// True for a loopback IP (`127.0.0.0/8`, `::1`, bracketed or not) and `localhost`.
pub(crate) fn is_loopback(host: &str) -> bool {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether the token sent in clear to a ZeroMQ `endpoint` would cross a network: a `tcp://`
/// endpoint whose host is not loopback. `ipc://` stays on the host, and other transports'
/// endpoints (UCX worker addresses) carry no token.
pub(crate) fn zmq_beyond_loopback(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return false;
    };
    let host = rest.rsplit_once(':').map_or(rest, |(host, _)| host);
    !is_loopback(host)
}

/// Why the token would go in clear to `peer`, an agent of protocol `version` (older than
/// token proofs) at `endpoint`, when that is refused: beyond loopback without `--insecure`.
pub(crate) fn token_in_clear_refused(
    peer: &str,
    version: impl std::fmt::Display,
    endpoint: &str,
    insecure: bool,
) -> Option<String> {
    (zmq_beyond_loopback(endpoint) && !insecure).then(|| {
        format!(
            "{peer} at {endpoint} speaks protocol {version}, older than {}: it takes the cluster \
             token in clear, which is not sent beyond loopback (upgrade it, or give --insecure)",
            crate::protocol::TOKEN_PROOFS
        )
    })
}

/// The exposed addresses among `binds` (`(flag, host)` pairs).
fn exposed<'a>(
    binds: &'a [(&'static str, &'a str)],
) -> impl Iterator<Item = &'a (&'static str, &'a str)> {
    binds.iter().filter(|(_, host)| !is_loopback(host))
}

/// Refuses the first exposed address of `binds` unless a token is set or `insecure`.
pub(crate) fn check(
    binds: &[(&'static str, &str)],
    token: bool,
    insecure: bool,
) -> Result<(), NotLoopback> {
    if token || insecure {
        return Ok(());
    }
    match exposed(binds).next() {
        Some((flag, host)) => Err(NotLoopback {
            flag,
            host: (*host).to_owned(),
        }),
        None => Ok(()),
    }
}

/// Refuses an engine API host beyond loopback unless a token is set.
pub(crate) fn check_api(api_host: &str, token: bool) -> Result<(), ApiNotLoopback> {
    match token || is_loopback(api_host) {
        true => Ok(()),
        false => Err(ApiNotLoopback(api_host.to_owned())),
    }
}

/// Warns, once at start, for every exposed address served without a token, or with one in
/// clear (`http`: the flags of HTTP ports checking a token without TLS).
pub(crate) fn warn_if_insecure(binds: &[(&'static str, &str)], token: bool, http: &[&str]) {
    for (flag, host) in exposed(binds).filter(|(flag, _)| token && http.contains(flag)) {
        tracing::warn!(
            flag,
            host,
            "--insecure: a bearer token in clear over plain HTTP on a non-loopback address; anyone on the path reads it"
        );
    }
    if token {
        return;
    }
    for (flag, host) in exposed(binds) {
        tracing::warn!(
            flag,
            host,
            "--insecure: serving without a token on a non-loopback address; anyone who reaches it can use it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_goes_in_clear_to_an_older_peer_only_on_the_host_or_with_insecure() {
        for (endpoint, beyond) in [
            ("tcp://127.0.0.1:5000", false),
            ("tcp://127.0.0.2:5000", false),
            ("tcp://[::1]:5000", false),
            ("tcp://localhost:5000", false),
            ("ipc:///tmp/kvferry-data", false),
            ("ucx:AAAA", false),
            ("tcp://10.0.0.5:5000", true),
            ("tcp://[fd00::5]:5000", true),
            ("tcp://node-3:5000", true),
        ] {
            assert_eq!(zmq_beyond_loopback(endpoint), beyond, "{endpoint}");
        }
        let why = token_in_clear_refused("prefill", 11, "tcp://10.0.0.5:5000", false);
        assert!(why.is_some_and(|w| w.contains("protocol 11") && w.contains("--insecure")));
        assert_eq!(
            token_in_clear_refused("prefill", 11, "tcp://10.0.0.5:5000", true),
            None
        );
        assert_eq!(
            token_in_clear_refused("decode", 11, "tcp://127.0.0.1:5000", false),
            None
        );
    }

    #[test]
    fn the_advertised_address_is_the_bound_one_unless_given_and_never_a_wildcard() {
        assert_eq!(advertised("127.0.0.1", None).as_deref(), Ok("127.0.0.1"));
        assert_eq!(
            advertised("0.0.0.0", Some("10.0.0.5")).as_deref(),
            Ok("10.0.0.5")
        );
        assert_eq!(
            advertised("::", Some("[fd00::5]")).as_deref(),
            Ok("fd00::5")
        );
        assert_eq!(
            advertised("127.0.0.1", Some("node-3")).as_deref(),
            Ok("node-3")
        );
        for (host, given, flag) in [
            ("0.0.0.0", None, "--host"),
            ("::", None, "--host"),
            ("[::]", None, "--host"),
            ("127.0.0.1", Some("0.0.0.0"), "--advertise-host"),
        ] {
            let e = advertised(host, given).expect_err("a wildcard");
            assert!(
                matches!(&e, Unadvertisable::Wildcard { flag: f, .. } if *f == flag),
                "{e}"
            );
            assert!(e.to_string().contains("--advertise-host"), "{e}");
        }
        assert_eq!(
            advertised("127.0.0.1", Some("")),
            Err(Unadvertisable::Empty)
        );
    }

    #[test]
    fn a_token_beyond_loopback_needs_tls_or_insecure() {
        let port = ("--host", "10.0.0.5");
        let e = check_clear(port, true, false, false).expect_err("in clear");
        assert!(e.to_string().contains("--tls-cert and --tls-key"), "{e}");
        assert_eq!(check_clear(port, true, true, false), Ok(()), "HTTPS");
        assert_eq!(check_clear(port, true, false, true), Ok(()), "--insecure");
        assert_eq!(check_clear(port, false, false, false), Ok(()), "no token");
        assert_eq!(
            check_clear(("--host", "127.0.0.1"), true, false, false),
            Ok(())
        );
        for url in [
            "http://10.0.0.5:8998",
            "http://node-3:8998/",
            "http://[fd00::5]:8998",
            "http://0.0.0.0",
            "HTTP://10.0.0.5:8998",
            "http://user@10.0.0.5:8998",
        ] {
            let e = check_clear_url(("--bootstrap", url), true, false).expect_err(url);
            assert!(e.to_string().contains("https://"), "{e}");
            assert_eq!(
                check_clear_url(("--bootstrap", url), true, true),
                Ok(()),
                "{url}"
            );
            assert_eq!(
                check_clear_url(("--bootstrap", url), false, false),
                Ok(()),
                "{url}"
            );
        }
        for url in [
            "https://10.0.0.5:8998",
            "http://127.0.0.1:8998",
            "http://localhost:8998/x",
            "http://[::1]:8998",
        ] {
            assert_eq!(
                check_clear_url(("--bootstrap", url), true, false),
                Ok(()),
                "{url}"
            );
        }
    }

    #[test]
    fn loopback_addresses() {
        for host in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "[::1]",
            "localhost",
            "LOCALHOST",
        ] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["0.0.0.0", "::", "[::]", "10.0.0.1", "example.com", "*", ""] {
            assert!(!is_loopback(host), "{host}");
        }
    }

    #[test]
    fn exposed_needs_a_token_or_insecure() {
        let binds = [("--host", "127.0.0.1"), ("--api-host", "0.0.0.0")];
        let err = check(&binds, false, false).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--api-host 0.0.0.0 is not loopback: give --token or --insecure"
        );
        assert_eq!(check(&binds, true, false), Ok(()));
        assert_eq!(check(&binds, false, true), Ok(()));
        assert_eq!(check(&binds[..1], false, false), Ok(()));
    }

    #[test]
    fn a_url_never_names_a_wildcard() {
        let at = |a: &str| a.parse::<std::net::SocketAddr>().unwrap();
        assert_eq!(
            url_of(at("127.0.0.1:80"), "10.0.0.5", false),
            "http://127.0.0.1:80"
        );
        assert_eq!(
            url_of(at("0.0.0.0:81"), "10.0.0.5", false),
            "http://10.0.0.5:81"
        );
        assert_eq!(
            url_of(at("0.0.0.0:81"), "10.0.0.5", true),
            "https://10.0.0.5:81"
        );
        assert_eq!(
            url_of(at("[::]:82"), "fd00::5", false),
            "http://[fd00::5]:82"
        );
        assert_eq!(url_of(at("[::]:83"), "node-3", false), "http://node-3:83");
        let wild = at("[::]:84");
        assert_eq!(url_of(wild, loopback_of(wild), false), "http://[::1]:84");
    }

    #[test]
    fn an_exposed_engine_api_needs_a_token_even_when_insecure() {
        let err = check_api("0.0.0.0", false).unwrap_err().to_string();
        assert!(err.contains("--api-host 0.0.0.0 is not loopback"), "{err}");
        assert!(err.contains("--insecure does not lift this"), "{err}");
        assert!(check_api("10.0.0.5", false).is_err());
        assert_eq!(check_api("0.0.0.0", true), Ok(()));
        assert_eq!(check_api("127.0.0.1", false), Ok(()));
        assert_eq!(check_api("[::1]", false), Ok(()));
    }
}
