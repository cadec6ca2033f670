//! docs/metrics.md's metrics table against what real processes expose, both ways: a registry, a
//! prefill and a decode agent (release binary, synthetic engine, tiny model) after a room moved,
//! and a proxy after a request it could not serve. Each process's `/metrics` must expose exactly
//! the metrics the table says its role exposes, by name (from the `# TYPE` lines, which name
//! every family, with or without series), type, and labels (from the samples, for the families
//! that have some). The engines' rows (`vllm:`, `sglang:`) are checked by their pytest modules.

use crate::common;
use crate::metrics_table::{Documented, EVERY_ROLE, documented};

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use kvferry::cluster::{Apis, drive_rooms};
use reqwest::Method;
use serde_json::json;

/// A family as exposed: its type and, when it has samples, its labels.
#[derive(Debug)]
struct Exposed {
    kind: String,
    labels: Option<BTreeSet<String>>,
}

/// The label names of a sample's `{...}` (values are quoted, with `\"` and `\\` escapes).
fn label_names(labels: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = labels;
    while let Some((name, after)) = rest.split_once("=\"") {
        names.insert(name.trim_start_matches(',').trim().to_owned());
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    names
}

/// Every family of an OpenMetrics text, by the name its samples carry (a counter's with
/// `_total`, an info's with `_info`, a histogram's base name).
fn exposed(text: &str) -> BTreeMap<String, Exposed> {
    let mut families = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
            let name = match kind {
                "counter" => format!("{name}_total"),
                "info" => format!("{name}_info"),
                _ => name.to_owned(),
            };
            let kind = kind.to_owned();
            families.insert(name, Exposed { kind, labels: None });
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let series = line.rsplit_once(' ').expect("a sample: series value").0;
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let labels = label_names(labels.trim_end_matches('}'));
            // A histogram's labels are its `_count`'s (its `_bucket`'s add `le`).
            let key = match families.get(name) {
                Some(f) if f.kind != "histogram" => Some(name),
                _ => name
                    .strip_suffix("_count")
                    .filter(|base| families.get(*base).is_some_and(|f| f.kind == "histogram")),
            };
            if let Some(f) = key.and_then(|k| families.get_mut(k)) {
                f.labels = Some(labels);
            }
        }
    }
    families
}

/// What differs between the rows documented for `role` and `text`, that role's `/metrics`.
fn differences(role: &str, docs: &[Documented], text: &str) -> Vec<String> {
    let exposed = exposed(text);
    let documented: BTreeMap<&str, &Documented> = docs
        .iter()
        .filter(|d| d.roles.contains(role))
        .map(|d| (d.name.as_str(), d))
        .collect();
    let mut out = Vec::new();
    for name in documented.keys().filter(|n| !exposed.contains_key(**n)) {
        out.push(format!("{role}: {name} is documented but not exposed"));
    }
    for (name, e) in &exposed {
        let Some(d) = documented.get(name.as_str()) else {
            out.push(format!(
                "{role}: {name} ({}) is exposed but not documented",
                e.kind
            ));
            continue;
        };
        if d.kind != e.kind {
            out.push(format!(
                "{role}: {name} is a {} but documented as a {}",
                e.kind, d.kind
            ));
        }
        if let Some(labels) = e.labels.as_ref().filter(|l| **l != d.labels) {
            out.push(format!(
                "{role}: {name} has labels {labels:?} but documented {:?}",
                d.labels
            ));
        }
    }
    out
}

#[test]
fn documented_metrics_are_those_the_registry_agents_and_proxy_expose() {
    let docs = documented();
    for d in &docs {
        for r in &d.roles {
            assert!(
                EVERY_ROLE.contains(&r.as_str()) || r == "vLLM" || r == "SGLang",
                "{}: unknown role {r:?}",
                d.name
            );
        }
    }
    let cluster = FaultCluster::start("metrics-names", &AgentOpts::default().args(), &[], &[], &[]);
    let logs = cluster.logs.clone();
    let closed = format!("http://127.0.0.1:{}", closed_port());
    let proxy = common::spawn(
        &release_binary(),
        &[],
        "proxy",
        &owned(&[
            "proxy",
            "--prefill",
            &closed,
            "--decode",
            &closed,
            "--port",
            "0",
            "--health-ms",
            "50",
        ]),
        &[],
        &logs,
    );
    let proxy_url = proxy.field("url").expect("the proxy's url");
    let texts = runtime().block_on(async {
        let http = http();
        let moved = drive_rooms(
            &Apis::pair(&cluster.prefill_api, &cluster.decode_api),
            vec![(1, 64)],
            1,
        )
        .await
        .expect("driving a room");
        assert!(
            moved[0].verified && moved[0].state == "success",
            "{moved:?}"
        );
        // The proxy has no server to use: it answers with an error of its own.
        let body = json!({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4});
        let (status, answer) = call(
            &http,
            Method::POST,
            &format!("{proxy_url}/v1/completions"),
            Some(&body),
        )
        .await;
        assert!(!status.is_success(), "{status} {answer}");
        let mut texts = Vec::new();
        for (role, base) in [
            ("registry", &cluster.registry_url),
            ("prefill", &cluster.prefill_api),
            ("decode", &cluster.decode_api),
            ("proxy", &proxy_url),
        ] {
            let (status, text) = call(&http, Method::GET, &format!("{base}/metrics"), None).await;
            assert!(status.is_success(), "{role} /metrics: {status}");
            let text = text.as_str().expect("metrics text").to_owned();
            texts.push((role, text));
        }
        texts
    });
    let mut wrong = Vec::new();
    for (role, text) in &texts {
        let n = exposed(text).len();
        println!("[metrics-names] {role}: {n} families");
        assert!(n >= 5, "{role} exposes {n} families:\n{text}");
        wrong.extend(differences(role, &docs, text));
    }
    assert!(
        wrong.is_empty(),
        "docs/metrics.md and /metrics differ:\n{}",
        wrong.join("\n")
    );
    drop(proxy);
}

#[test]
fn label_names_are_read_past_commas_and_quotes_in_values() {
    let text = "# TYPE m counter\nm_total{a=\"x,y\",b=\"say \\\"hi\\\"\",c=\"\"} 1\n\
                # TYPE h histogram\nh_bucket{role=\"decode\",le=\"1\"} 0\nh_count{role=\"decode\"} 0\n\
                # TYPE g gauge\n# TYPE p info\np_info{memory=\"host\"} 1\n# EOF\n";
    let e = exposed(text);
    let labels = |n: &str| {
        e[n].labels
            .clone()
            .map(|l| l.into_iter().collect::<Vec<_>>())
    };
    assert_eq!(
        labels("m_total"),
        Some(vec!["a".into(), "b".into(), "c".into()])
    );
    assert_eq!(labels("h"), Some(vec!["role".into()]));
    assert_eq!(labels("g"), None);
    assert_eq!(labels("p_info"), Some(vec!["memory".into()]));
    assert_eq!(e["p_info"].kind, "info");
}
