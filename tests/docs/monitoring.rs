//! deploy/monitoring against Prometheus and docs/metrics.md: the alerting rules pass `promtool
//! check rules` and their tests (`promtool test rules`, a firing case of every alert), the
//! Grafana dashboard is dashboard JSON whose every query is PromQL that Prometheus parses, and
//! every metric the rules or the dashboard name is one docs/metrics.md lists. promtool is
//! Debian's `prometheus` package (scripts/test installs it); without it these tests fail.

use crate::common;
use crate::metrics_table::documented;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::docs::root;
use serde_json::Value;

fn monitoring(file: &str) -> PathBuf {
    root().join("deploy/monitoring").join(file)
}

/// `promtool ARGS` in `dir`; panics with its output unless it succeeds.
fn promtool(dir: &Path, args: &[&str]) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running promtool: {e}: install it with Debian's prometheus package \
                 (apt-get install prometheus; scripts/test does)"
            )
        });
    assert!(
        out.status.success(),
        "promtool {args:?} in {}: {}\n{}{}",
        dir.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The names of kvferry's metrics in `text` (PromQL or a file of it): every word that starts as
/// one (`kvferry_`, `vllm:kvferry_`, `sglang:kvferry_`), a histogram's series by its base name.
fn metrics_named(text: &str, histograms: &BTreeSet<String>) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| {
            ["kvferry_", "vllm:kvferry_", "sglang:kvferry_"]
                .iter()
                .any(|p| w.starts_with(p))
        })
        .map(|w| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .filter_map(|s| w.strip_suffix(s))
                .find(|base| histograms.contains(*base))
                .unwrap_or(w)
                .to_owned()
        })
        .collect()
}

/// Panics unless every metric `text` names is documented.
fn assert_documented(what: &str, text: &str) -> BTreeSet<String> {
    let docs = documented();
    let names: BTreeSet<String> = docs.iter().map(|d| d.name.clone()).collect();
    let histograms = docs
        .iter()
        .filter(|d| d.kind == "histogram")
        .map(|d| d.name.clone())
        .collect();
    let named = metrics_named(text, &histograms);
    let unknown: Vec<&String> = named.difference(&names).collect();
    assert!(
        unknown.is_empty(),
        "{what} names metrics docs/metrics.md does not list: {unknown:?}"
    );
    named
}

#[test]
fn the_alert_rules_pass_promtool_and_their_tests_and_name_documented_metrics() {
    let dir = monitoring("");
    promtool(&dir, &["check", "rules", "alerts.yml"]);
    promtool(&dir, &["test", "rules", "alerts_test.yml"]);
    let rules = std::fs::read_to_string(monitoring("alerts.yml")).expect("alerts.yml");
    let named = assert_documented("alerts.yml", &rules);
    assert!(named.len() >= 8, "alerts.yml names {named:?}");
    // Every alert is tested firing, with its labels.
    let tests = std::fs::read_to_string(monitoring("alerts_test.yml")).expect("alerts_test.yml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 5, "{alerts:?}");
    for alert in alerts {
        let firing = tests
            .split("alertname: ")
            .skip(1)
            .filter(|case| case.starts_with(&format!("{alert}\n")))
            .any(|case| case.contains("exp_labels:"));
        assert!(firing, "alerts_test.yml has no case where {alert} fires");
    }
}

#[test]
fn the_dashboard_is_grafana_json_of_promql_over_documented_metrics() {
    let path = monitoring("grafana-dashboard.json");
    let text = std::fs::read_to_string(&path).expect("grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert!(
        dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 39),
        "schemaVersion {}",
        dashboard["schemaVersion"]
    );
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    assert!(
        variables.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "a Prometheus data source variable: {variables:?}"
    );
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut exprs = Vec::new();
    let mut ids = BTreeSet::new();
    for p in panels {
        assert!(ids.insert(p["id"].as_u64()), "panel id {} twice", p["id"]);
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}", p["title"]);
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{}", p["title"]);
            exprs.push(t["expr"].as_str().expect("a query's expr").to_owned());
        }
    }
    let named = assert_documented("grafana-dashboard.json", &exprs.join("\n"));
    assert!(named.len() >= 30, "the dashboard shows {named:?}");
    // Prometheus parses every query (Grafana's $__rate_interval stands for a duration).
    let dir = std::env::temp_dir().join(format!("kvferry-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let rules: Vec<Value> = exprs
        .iter()
        .enumerate()
        .map(|(i, e)| {
            serde_json::json!({"record": format!("dashboard:query{i}"),
                               "expr": e.replace("$__rate_interval", "5m")})
        })
        .collect();
    // JSON is YAML.
    let file = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    std::fs::write(dir.join("queries.yml"), file.to_string()).expect("writing the queries");
    promtool(&dir, &["check", "rules", "queries.yml"]);
    std::fs::remove_dir_all(&dir).expect("removing the temporary folder");
}
