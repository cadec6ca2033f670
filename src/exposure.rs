//! Credentials are not optional off loopback: a process (`bootstrap`, `prefill`, `decode`)
//! whose listening address is not a loopback one refuses to start without a token, unless the
//! operator says `--insecure` (then it warns at start).
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

/// True for a loopback IP (`127.0.0.0/8`, `::1`, bracketed or not) and `localhost`.
pub(crate) fn is_loopback(host: &str) -> bool {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
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

/// Warns, once at start, for every exposed address served without a token.
pub(crate) fn warn_if_insecure(binds: &[(&'static str, &str)], token: bool) {
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
}
