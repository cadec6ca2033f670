//! Addresses taken out of what the proxy tells a client: an answer names the role and the place
//! of a server that failed (`decode server 2 of 3`), kvferry's reason code and message, never
//! an internal address. The log keeps the full text.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// What stands for an address in a client's answer.
pub(super) const HIDDEN: &str = "<address>";

/// `text` with every address in it replaced by [`HIDDEN`]: a URL (`scheme://...`, path
/// included), `host:port`, an IPv4 or IPv6 address (bracketed or not, with a port or a zone or
/// neither). A word that only looks like `name:number` is taken for an address too: better one
/// word too many hidden than one address shown.
pub(super) fn hide_addresses(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(|c: char| !ends_word(c)) {
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        let len = rest.find(ends_word).unwrap_or(rest.len());
        hide_in_word(&rest[..len], &mut out);
        rest = &rest[len..];
    }
    out.push_str(rest);
    out
}

/// What ends a word that may be or hold an address: white space, brackets and quotes around it,
/// separators of a list.
fn ends_word(c: char) -> bool {
    c.is_whitespace()
        || matches!(
            c,
            '(' | ')' | '{' | '}' | '<' | '>' | '"' | '\'' | '`' | ',' | ';'
        )
}

/// Punctuation that ends a sentence or a label rather than an address (`at 10.0.0.3.`,
/// `10.0.0.3: refused`).
const TRAILING: [char; 4] = ['.', ':', '!', '?'];

/// `word` onto `out`, a URL in it hidden from its scheme on, else each address in it.
fn hide_in_word(word: &str, out: &mut String) {
    if let Some(sep) = word.find("://") {
        let scheme = word[..sep]
            .char_indices()
            .rev()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |(i, c)| i + c.len_utf8());
        let url = &word[scheme..];
        let kept = url.trim_end_matches(TRAILING);
        hide_in_parts(&word[..scheme], out);
        out.push_str(HIDDEN);
        out.push_str(&url[kept.len()..]);
        return;
    }
    hide_in_parts(word, out);
}

/// The characters of a host, a port, an IP address, brackets and zone included.
fn in_address(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '_' | '[' | ']' | '%')
}

/// `word` onto `out`, each run of address characters in it that is an address hidden
/// (`room=10.0.0.3:5555/x` has one: `10.0.0.3:5555`).
fn hide_in_parts(word: &str, out: &mut String) {
    let mut rest = word;
    while let Some(start) = rest.find(in_address) {
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        let len = rest.find(|c| !in_address(c)).unwrap_or(rest.len());
        let run = &rest[..len];
        let trimmed = run.trim_end_matches(TRAILING);
        match [run, trimmed].into_iter().find(|a| is_address(a)) {
            Some(address) => {
                out.push_str(HIDDEN);
                out.push_str(&run[address.len()..]);
            }
            None => out.push_str(run),
        }
        rest = &rest[len..];
    }
    out.push_str(rest);
}

/// An IP address, a socket address, or `host:port`.
fn is_address(s: &str) -> bool {
    // `::` alone is no address anyone needs hidden (and is likelier prose).
    if s.len() <= 2 {
        return false;
    }
    if s.parse::<SocketAddr>().is_ok() || s.parse::<IpAddr>().is_ok() {
        return true;
    }
    let bare = s
        .strip_prefix('[')
        .and_then(|b| b.strip_suffix(']'))
        .unwrap_or(s);
    if is_ipv6(bare) {
        return true;
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    if !(1..=5).contains(&port.len())
        || !port.bytes().all(|b| b.is_ascii_digit())
        || port.parse::<u16>().is_err()
    {
        return false;
    }
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => is_ipv6(v6),
        None => is_host_name(host),
    }
}

/// An IPv6 address, with a zone (`fe80::1%eth0`) or not.
fn is_ipv6(s: &str) -> bool {
    let address = s.split_once('%').map_or(s, |(a, _)| a);
    address.parse::<Ipv6Addr>().is_ok()
}

/// A DNS name (at least one letter: `12:30` is a time, not a host and port).
fn is_host_name(host: &str) -> bool {
    !host.is_empty()
        && !host.starts_with(['.', '-'])
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        && host.chars().any(|c| c.is_ascii_alphabetic())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_hidden_and_the_rest_is_kept() {
        for (text, want) in [
            (
                "decode server http://10.0.0.3:8100 failed",
                "decode server <address> failed",
            ),
            (
                "peer_dead: prefill tcp://10.1.2.3:5555 reported the room lost",
                "peer_dead: prefill <address> reported the room lost",
            ),
            (
                "error sending request for url (http://127.0.0.1:40123/v1/completions): client \
                 error (Connect): tcp connect error: Connection refused (os error 111)",
                "error sending request for url (<address>): client error (Connect): tcp connect \
                 error: Connection refused (os error 111)",
            ),
            ("at http://decode-0:8100.", "at <address>."),
            ("url=https://h.example/x?a=b", "url=<address>"),
            ("10.0.0.3: refused", "<address>: refused"),
            ("from 10.0.0.3.", "from <address>."),
            ("agent 10.0.0.3:5555/rooms", "agent <address>/rooms"),
            ("peer [fe80::1%eth0]:5555 left", "peer <address> left"),
            ("peer [::1]:5555 left", "peer <address> left"),
            (
                "fe80::1 and ::1 and [2001:db8::7]",
                "<address> and <address> and <address>",
            ),
            ("fe80::1%eth0, then", "<address>, then"),
            ("host decode-0.svc.cluster.local:8100", "host <address>"),
            ("localhost:8100;", "<address>;"),
            ("room=10.0.0.3", "room=<address>"),
        ] {
            assert_eq!(hide_addresses(text), want, "{text:?}");
        }
    }

    #[test]
    fn text_without_addresses_is_left_as_it_is() {
        for text in [
            "peer_dead: the prefill went away",
            "Internal server error (decode server 2 of 3, kvferry room 18446744073709551615 \
             failed: timeout_ready: no announcement within 5000 ms)",
            "unknown_room: the room expired 12:30 ago",
            "key 0123456789abcdef0123456789abcdef",
            "a :: b",
            "no healthy decode server",
            "naïve: ünïcode (and some) text.",
            "",
        ] {
            assert_eq!(hide_addresses(text), text);
        }
    }
}
