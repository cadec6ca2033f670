//! The table of docs/metrics.md, section "Metrics": every metric a kvferry process (or an engine,
//! for kvferry's rooms) exposes, one row each, as exposed (counters with `_total`, histograms by
//! their base name): its type, its labels (the code spans of the labels cell) and who exposes it.
//! Read by the docs tests (the alerts and the dashboard name only these) and by the processes'
//! test that compares it with what real processes expose.

use std::collections::BTreeSet;

use crate::common::docs::root;

/// The kvferry processes "every role" stands for.
pub(crate) const EVERY_ROLE: [&str; 4] = ["registry", "prefill", "decode", "proxy"];

/// One documented metric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Documented {
    pub(crate) name: String,
    /// `counter`, `gauge`, `histogram` or `info`.
    pub(crate) kind: String,
    pub(crate) labels: BTreeSet<String>,
    /// `registry`, `prefill`, `decode`, `proxy`, `vLLM`, `SGLang`.
    pub(crate) roles: BTreeSet<String>,
}

/// The text of every code span of `cell`.
fn spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The rows of the metrics table of docs/metrics.md. Panics if the section or its table is
/// missing, or a row is not of the table's form.
pub(crate) fn documented() -> Vec<Documented> {
    let path = root().join("docs/metrics.md");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let section: Vec<&str> = text
        .lines()
        .skip_while(|l| *l != "## Metrics")
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect();
    assert!(
        !section.is_empty(),
        "docs/metrics.md has no \"## Metrics\" section"
    );
    let mut table = section
        .iter()
        .skip_while(|l| !l.starts_with("| metric |"))
        .take_while(|l| l.starts_with('|'));
    let header = table
        .next()
        .expect("a table under \"## Metrics\" in docs/metrics.md");
    let columns: Vec<&str> = header.trim_matches('|').split('|').map(str::trim).collect();
    assert_eq!(
        columns[..4],
        ["metric", "type", "labels", "exposed by"],
        "docs/metrics.md's metrics table: {header}"
    );
    let rows: Vec<Documented> = table
        .skip(1)
        .map(|row| {
            let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
            let name = spans(cells[0]);
            assert_eq!(name.len(), 1, "one metric a row: {row}");
            let roles = cells[3]
                .split(',')
                .map(str::trim)
                .flat_map(|r| match r {
                    "every role" => EVERY_ROLE.iter().map(|r| (*r).to_owned()).collect(),
                    r => vec![r.to_owned()],
                })
                .collect();
            Documented {
                name: name[0].clone(),
                kind: cells[1].to_owned(),
                labels: spans(cells[2]).into_iter().collect(),
                roles,
            }
        })
        .collect();
    let mut seen = BTreeSet::new();
    for d in &rows {
        assert!(seen.insert(&d.name), "{} is documented twice", d.name);
        assert!(
            ["counter", "gauge", "histogram", "info"].contains(&d.kind.as_str()),
            "{}: type {:?}",
            d.name,
            d.kind
        );
        assert_eq!(
            d.kind == "counter",
            d.name.ends_with("_total"),
            "{}: a counter's name ends in _total, no other's does",
            d.name
        );
    }
    assert!(
        rows.len() > 30,
        "docs/metrics.md lists {} metrics",
        rows.len()
    );
    rows
}
