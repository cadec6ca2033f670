//! The registries a decode trusts ([`TrustedRegistries`]): the only ones it asks for a room's
//! prefill group, with its token as bearer, and whose listed prefills it says Hello to, with
//! its token as the ZeroMQ PLAIN password.
//!
//! A room or a hold may name its own registry (`bootstrap`): SGLang's router names the prefill
//! server's bootstrap port with every request, and vLLM's proxy the prefill's group. That value
//! comes from a client, so it is checked here before any connection is made: a registry is
//! trusted when it is one of `--bootstrap`'s URLs, or matches an entry of
//! `--allowed-registries`. Anything else is refused with [`Untrusted`]; nothing is sent to it.
//!
//! An entry is `HOST:PORT`, where HOST is a host name, an IP address (`[...]` around IPv6), or
//! an IP network (`10.0.0.0/8`, `[fd00::/8]`), and PORT a port or `*` (any port: SGLang's
//! prefill servers each serve a registry on their own bootstrap port); a URL
//! (`http://HOST:PORT`) stands for its host and port. Host names are compared as written, never
//! resolved: `localhost` does not match `127.0.0.1`.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use url::{Host, Url};

/// The registries a decode sends its token to.
#[derive(Clone, Debug)]
pub struct TrustedRegistries {
    entries: Vec<Entry>,
    /// The entries as given, for the log.
    named: String,
    /// Plain `http://` registries beyond loopback are refused: the token would go in clear
    /// ([`TrustedRegistries::in_clear_refused`]).
    refuse_in_clear: bool,
}

/// One trusted host (or network) and port (or any).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    host: HostPattern,
    /// `None`: any port.
    port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum HostPattern {
    /// A host name, lowercase.
    Name(String),
    /// An address (a network of one) or a network.
    Net(IpNet),
}

/// A `--allowed-registries` entry (or a `--bootstrap` URL) that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag} entry {entry:?}: {why}")]
pub struct BadEntry {
    flag: &'static str,
    entry: String,
    why: String,
}

/// A registry the decode does not trust: nothing was sent to it. The message names only the
/// URL the request gave (it may reach the engine's client); the decode logs what it trusts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct Untrusted {
    url: String,
    why: String,
}

impl fmt::Display for Untrusted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "registry {:?} {}: a room may name only the decode's --bootstrap registries or one \
             that its --allowed-registries lists; nothing was sent to it",
            self.url, self.why
        )
    }
}

impl TrustedRegistries {
    /// The registries of `bootstrap` (one URL, or a comma-separated list) and the `allowed`
    /// entries.
    pub fn new(bootstrap: &str, allowed: &[String]) -> Result<Self, BadEntry> {
        let mut entries = Vec::new();
        for url in bootstrap
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
        {
            entries.push(Entry::parse("--bootstrap", url)?);
        }
        let allowed: Vec<&str> = allowed
            .iter()
            .flat_map(|a| a.split(','))
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .collect();
        for entry in &allowed {
            entries.push(Entry::parse("--allowed-registries", entry)?);
        }
        let mut named = format!("--bootstrap {bootstrap}");
        match allowed.is_empty() {
            true => named += ", no --allowed-registries",
            false => named += &format!(", --allowed-registries {}", allowed.join(",")),
        }
        Ok(TrustedRegistries {
            entries,
            named,
            refuse_in_clear: false,
        })
    }

    /// These registries, with a plain `http://` one beyond loopback refused when `refused`
    /// (an agent with a token and without `--insecure`): a trusted host named over plain HTTP
    /// would get the token in clear.
    pub fn in_clear_refused(mut self, refused: bool) -> Self {
        self.refuse_in_clear = refused;
        self
    }

    /// Whether the decode may send its token to every registry of `url` (one URL or a
    /// comma-separated list of replicas).
    pub fn check(&self, url: &str) -> Result<(), Untrusted> {
        let untrusted = |why: String| {
            tracing::warn!(registry = url, %why, trusted = %self.named, "refused a registry a room or hold named");
            Untrusted {
                url: url.to_owned(),
                why,
            }
        };
        let mut any = false;
        for one in url.split(',').map(str::trim) {
            any = true;
            let (host, port) = endpoint(one).map_err(&untrusted)?;
            if !self.entries.iter().any(|e| e.matches(&host, port)) {
                return Err(untrusted("is not trusted".into()));
            }
            let in_clear = crate::exposure::check_clear_url(("bootstrap", one), true, false);
            if self.refuse_in_clear && in_clear.is_err() {
                return Err(untrusted(
                    "is plain HTTP beyond loopback: the token would travel in clear (name its \
                     https:// URL)"
                        .into(),
                ));
            }
        }
        match any {
            true => Ok(()),
            false => Err(untrusted("is empty".into())),
        }
    }
}

impl Entry {
    fn parse(flag: &'static str, entry: &str) -> Result<Entry, BadEntry> {
        let bad = |why: &str| BadEntry {
            flag,
            entry: entry.to_owned(),
            why: why.to_owned(),
        };
        if entry.contains("://") {
            let (host, port) = endpoint(entry).map_err(|why| bad(&why))?;
            return Ok(Entry {
                host,
                port: Some(port),
            });
        }
        let (host, port) = entry
            .rsplit_once(':')
            .filter(|(h, _)| !h.is_empty())
            .ok_or_else(|| bad("expected HOST:PORT, HOST:* or a URL"))?;
        let port = match port {
            "*" => None,
            p => Some(
                p.parse::<u16>()
                    .map_err(|_| bad("the port is not 0-65535 or *"))?,
            ),
        };
        let bracketed = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
        if bracketed.is_none() && host.contains(':') {
            // `fd00::1:80` reads as an address and a port, or as a longer address.
            return Err(bad("an IPv6 address goes in brackets: [ADDRESS]:PORT"));
        }
        let bare = bracketed.unwrap_or(host);
        let host = if bare.contains('/') {
            HostPattern::Net(bare.parse().map_err(|_| bad("not an IP network"))?)
        } else if let Ok(ip) = bare.parse::<IpAddr>() {
            HostPattern::Net(IpNet::from(ip))
        } else {
            HostPattern::Name(bare.to_ascii_lowercase())
        };
        Ok(Entry { host, port })
    }

    fn matches(&self, host: &HostPattern, port: u16) -> bool {
        let host_ok = match (&self.host, host) {
            (HostPattern::Name(a), HostPattern::Name(b)) => a == b,
            (HostPattern::Net(net), HostPattern::Net(one)) => net.contains(&one.addr()),
            _ => false,
        };
        host_ok && self.port.is_none_or(|p| p == port)
    }
}

/// The host and port a registry URL reaches (the scheme's port when it names none).
fn endpoint(url: &str) -> Result<(HostPattern, u16), String> {
    let parsed = Url::parse(url).map_err(|e| format!("is not a URL ({e})"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("is not an http:// or https:// URL".into());
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("carries credentials".into());
    }
    let host = match parsed.host() {
        Some(Host::Domain(d)) => HostPattern::Name(d.to_ascii_lowercase()),
        Some(Host::Ipv4(ip)) => HostPattern::Net(IpNet::from(IpAddr::V4(ip))),
        Some(Host::Ipv6(ip)) => HostPattern::Net(IpNet::from(IpAddr::V6(ip))),
        None => return Err("names no host".into()),
    };
    let port = parsed
        .port_or_known_default()
        .ok_or_else(|| "names no port".to_owned())?;
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trusted(bootstrap: &str, allowed: &[&str]) -> TrustedRegistries {
        let allowed: Vec<String> = allowed.iter().map(|s| (*s).to_owned()).collect();
        TrustedRegistries::new(bootstrap, &allowed).expect("entries")
    }

    #[test]
    fn with_a_token_a_trusted_host_over_plain_http_beyond_loopback_is_refused() {
        let t = trusted("https://10.0.0.1:8998", &["10.0.0.0/24:*", "127.0.0.1:*"])
            .in_clear_refused(true);
        assert!(t.check("https://10.0.0.1:8998").is_ok());
        assert!(t.check("https://10.0.0.7:9000").is_ok());
        assert!(
            t.check("http://127.0.0.1:9000").is_ok(),
            "loopback stays plain"
        );
        for plain in [
            "http://10.0.0.1:8998",
            "https://10.0.0.1:8998,http://10.0.0.2:8998",
        ] {
            let e = t.check(plain).expect_err(plain);
            assert!(e.to_string().contains("in clear"), "{e}");
        }
        let insecure = trusted("http://10.0.0.1:8998", &[]).in_clear_refused(false);
        assert!(insecure.check("http://10.0.0.1:8998").is_ok());
    }

    #[test]
    fn bootstrap_urls_are_trusted_and_nothing_else_by_default() {
        let t = trusted("http://10.0.0.1:8998,http://10.0.0.2:8998", &[]);
        assert!(t.check("http://10.0.0.1:8998").is_ok());
        assert!(t.check("http://10.0.0.2:8998/").is_ok());
        assert!(t.check("http://10.0.0.1:8998,http://10.0.0.2:8998").is_ok());
        for bad in [
            "http://10.0.0.1:8999",
            "http://10.0.0.3:8998",
            "http://evil.example:8998",
            "http://10.0.0.1:8998,http://10.0.0.9:8998",
        ] {
            let e = t.check(bad).unwrap_err().to_string();
            assert!(e.contains("is not trusted"), "{bad}: {e}");
            assert!(e.contains("nothing was sent"), "{e}");
            assert!(
                !e.contains("10.0.0.2"),
                "what is trusted stays in the log: {e}"
            );
        }
    }

    #[test]
    fn entries_name_hosts_networks_and_any_port() {
        let t = trusted(
            "http://127.0.0.1:8998",
            &[
                "prefill-0.svc:*",
                "10.1.0.0/16:8998",
                "[fd00::/8]:*",
                "[::1]:9000",
            ],
        );
        assert!(t.check("http://prefill-0.svc:31000").is_ok());
        assert!(t.check("http://PREFILL-0.svc:1").is_ok());
        assert!(t.check("http://10.1.200.3:8998").is_ok());
        assert!(t.check("http://10.1.200.3:8999").is_err());
        assert!(t.check("http://10.2.0.1:8998").is_err());
        assert!(t.check("http://[fd12::1]:5").is_ok());
        assert!(t.check("http://[::1]:9000").is_ok());
        assert!(t.check("http://[::1]:9001").is_err());
        // Names are never resolved.
        assert!(t.check("http://localhost:8998").is_err());
        // The scheme's own port.
        let t = trusted("http://reg.example", &[]);
        assert!(t.check("http://reg.example:80").is_ok());
        assert!(t.check("https://reg.example").is_err());
    }

    #[test]
    fn a_url_that_hides_another_host_is_refused() {
        let t = trusted("http://127.0.0.1:8998", &["127.0.0.1:*"]);
        for bad in [
            "http://127.0.0.1:8998@10.9.9.9:80",
            "http://user:pw@127.0.0.1:8998",
            "ftp://127.0.0.1:8998",
            "127.0.0.1:8998",
            "",
            "http://",
        ] {
            assert!(t.check(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_entries_say_which_and_why() {
        let allowed = |e: &str| TrustedRegistries::new("http://a:1", &[e.to_owned()]);
        for (entry, why) in [
            ("host", "expected HOST:PORT"),
            ("host:70000", "port"),
            ("10.0.0.0/33:*", "not an IP network"),
            ("fd00::1:80", "brackets"),
            ("http://:80", "URL"),
        ] {
            let e = allowed(entry).unwrap_err().to_string();
            assert!(e.contains("--allowed-registries"), "{entry}: {e}");
            assert!(e.contains(why), "{entry}: {e}");
        }
    }
}
