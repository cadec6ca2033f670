//! What build a kvferry process is, as every role's `/metrics` says it: the gauge
//! `kvferry_build_info` (value 1) with the labels `version`, `revision` and `protocol`, the parts
//! of `kvferry --version`. The registry's crate knows neither the git revision nor the protocol:
//! its caller passes them in.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The build of this process: its labels on `kvferry_build_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BuildInfo {
    /// The crate's version (`0.1.0`).
    pub version: &'static str,
    /// The git revision it was built from (a short hash, `-dirty` when the tree differed,
    /// `unknown` outside git).
    pub revision: &'static str,
    /// The control protocol version it speaks.
    pub protocol: u16,
}

impl BuildInfo {
    /// The OpenMetrics text of `registry`, `kvferry_build_info` first.
    pub fn encode(&self, registry: &Registry) -> String {
        encode(Some(self), &[registry])
    }

    /// The OpenMetrics text of several registries, with this build first.
    pub fn encode_all(&self, registries: &[&Registry]) -> String {
        encode(Some(self), registries)
    }
}

/// The OpenMetrics text of `registries`, with `kvferry_build_info` first when `build` is known.
pub fn encode(build: Option<&BuildInfo>, registries: &[&Registry]) -> String {
    use prometheus_client::encoding::text;
    let mut out = String::with_capacity(4096);
    if let Some(build) = build {
        let mut own = Registry::with_prefix("kvferry");
        let info = Family::<BuildInfo, Gauge>::default();
        info.get_or_create(build).set(1);
        own.register(
            "build_info",
            "The build of this process: 1, its version, git revision and protocol as labels",
            info,
        );
        // Writing into a String cannot fail.
        let _ = text::encode_registry(&mut out, &own);
    }
    for registry in registries {
        let _ = text::encode_registry(&mut out, registry);
    }
    let _ = text::encode_eof(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn build_info_comes_first_and_the_text_ends_once() {
        let mut r = Registry::with_prefix("kvferry_test");
        let c = Counter::<u64>::default();
        c.inc();
        r.register("things", "Things", c);
        let build = BuildInfo {
            version: "1.2.3",
            revision: "abc1234-dirty",
            protocol: 13,
        };
        let text = build.encode(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[1], "# TYPE kvferry_build_info gauge", "{text}");
        assert_eq!(
            lines[2],
            "kvferry_build_info{version=\"1.2.3\",revision=\"abc1234-dirty\",protocol=\"13\"} 1"
        );
        assert!(lines.contains(&"kvferry_test_things_total 1"), "{text}");
        assert_eq!(lines.iter().filter(|l| **l == "# EOF").count(), 1);
        assert_eq!(lines.last(), Some(&"# EOF"));
        let without = encode(None, &[&r]);
        assert!(!without.contains("build_info"), "{without}");
        assert!(without.ends_with("# EOF\n"), "{without}");
    }
}
