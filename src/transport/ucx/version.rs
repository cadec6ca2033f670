//! The UCX release this process loaded (`ucp_get_version`), and what differs between the
//! releases kvferry runs on: Debian's libucx 1.13 and UCX 1.22 (the `libucx-cu12`/`-cu13`
//! wheels, with CUDA transports). One binary runs on either: the dynamic loader picks the
//! `libucp.so.0` on the library path, and everything that depends on the release asks here.
//!
//! Peers of the two releases do not interoperate (a 1.22 worker cannot unpack a 1.13 peer's
//! rendezvous keys over tcp, and aborts its process on some 1.13 wireup messages), so a
//! receiver's endpoint names its release and a sender of another refuses it at the Hello.

use std::fmt;
use std::sync::OnceLock;

use super::result;

/// A UCX release, as `ucp_get_version` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UcxVersion {
    /// 1.
    pub major: u32,
    /// 13 or 22 where kvferry runs.
    pub minor: u32,
    /// The patch release.
    pub release: u32,
}

/// What a release packs and accepts, where the supported releases differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// UCX 1.13: transport settings go to `ucp_config_modify` by their field's own name, the
    /// worker address has no release trailer, remote keys end after the transports' keys.
    V1_13,
    /// UCX 1.22: transport settings by their prefixed name (`TCP_TX_SEG_SIZE`), a worker
    /// address may carry a system-device byte per device and ends with a release trailer,
    /// and a remote key ends with a system-device byte (and, for device memory, distances).
    V1_22,
}

impl UcxVersion {
    /// The release of the libucp this process loaded.
    pub fn loaded() -> UcxVersion {
        static LOADED: OnceLock<UcxVersion> = OnceLock::new();
        *LOADED.get_or_init(|| {
            let (major, minor, release) = result::version();
            UcxVersion {
                major,
                minor,
                release,
            }
        })
    }

    /// The family of a supported release; why not otherwise.
    pub fn family(self) -> Result<Family, String> {
        match (self.major, self.minor) {
            (1, 13) => Ok(Family::V1_13),
            (1, 22) => Ok(Family::V1_22),
            _ => Err(format!(
                "UCX {self} is not supported: kvferry runs on UCX 1.13 and 1.22 (put the libucp of one on the library path)"
            )),
        }
    }

    /// Parses `major.minor.release`.
    pub fn parse(s: &str) -> Option<UcxVersion> {
        let mut parts = s.split('.').map(|p| p.parse::<u32>().ok());
        let v = UcxVersion {
            major: parts.next()??,
            minor: parts.next()??,
            release: parts.next()??,
        };
        parts.next().is_none().then_some(v)
    }

    /// Whether workers of `self` and `peer` exchange data: the same family.
    pub fn interoperates(self, peer: UcxVersion) -> bool {
        self.family().is_ok() && self.family() == peer.family()
    }
}

impl fmt::Display for UcxVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.release)
    }
}

/// The family of the loaded release; an unsupported one is taken as the newest (the
/// workers refuse to start on it: [`UcxVersion::family`]).
pub fn family() -> Family {
    UcxVersion::loaded().family().unwrap_or(Family::V1_22)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_pair_by_family() {
        let v113 = UcxVersion::parse("1.13.1").unwrap();
        let v122 = UcxVersion::parse("1.22.0").unwrap();
        assert_eq!(v113.family(), Ok(Family::V1_13));
        assert_eq!(v122.family(), Ok(Family::V1_22));
        assert!(v113.interoperates(UcxVersion::parse("1.13.0").unwrap()));
        assert!(!v113.interoperates(v122));
        let v118 = UcxVersion::parse("1.18.1").unwrap();
        assert!(
            v118.family()
                .unwrap_err()
                .contains("UCX 1.18.1 is not supported")
        );
        assert!(
            !v118.interoperates(v118),
            "an unsupported release pairs with none"
        );
        for bad in ["1.22", "1.22.0.1", "x.1.2", ""] {
            assert_eq!(UcxVersion::parse(bad), None, "{bad}");
        }
        assert_eq!(v122.to_string(), "1.22.0");
        let loaded = UcxVersion::loaded();
        println!("this process loaded UCX {loaded}");
        assert!(loaded.family().is_ok(), "{loaded}");
    }
}
