"""The metrics an engine exposes for kvferry against docs/metrics.md's metrics table, both ways,
by name, type and labels (those of the families with series)."""

from __future__ import annotations

import pathlib
import re
import urllib.request

TABLE = pathlib.Path(__file__).parents[2] / "docs" / "metrics.md"


def documented(exposer: str) -> dict[str, tuple[str, set[str]]]:
    """The rows of the metrics table whose "exposed by" names ``exposer`` (``vLLM``, ``SGLang``):
    name -> (type, labels)."""
    section = TABLE.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and exposer in [r.strip() for r in cells[3].split(",")]:
            rows[cells[0].strip("`")] = (cells[1], set(re.findall(r"`([^`]+)`", cells[2])))
    assert rows, f"docs/metrics.md lists no metric of {exposer}'s"
    return rows


def exposed(text: str, prefix: str) -> dict[str, tuple[str, set[str] | None]]:
    """The families of an OpenMetrics/Prometheus text named ``prefix...``: name -> (type, labels;
    None for a family without series). Every family is typed, with or without series."""
    out: dict[str, tuple[str, set[str] | None]] = {}
    for name, kind in re.findall(rf"^# TYPE ({re.escape(prefix)}\S+) (\S+)$", text, re.M):
        out[name] = (kind, None)
    # prometheus_client's own series of when each child was made.
    for name in [n for n in out if n.endswith("_created")]:
        base = name.removesuffix("_created")
        if base in out or base + "_total" in out:
            del out[name]
    for name, labels in re.findall(rf"^({re.escape(prefix)}\w+)\{{([^}}]*)\}}", text, re.M):
        # A histogram's labels are its _count's (its _bucket's add ``le``).
        family = name if name in out else name.removesuffix("_count")
        if family in out and (out[family][0] == "histogram") == (family != name):
            out[family] = (out[family][0], set(re.findall(r'(\w+)="', labels)))
    return out


def assert_as_documented(url: str, exposer: str, prefix: str) -> None:
    """The ``prefix`` families of ``url``'s /metrics are exactly the table's rows of ``exposer``."""
    rows = documented(exposer)
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        families = exposed(r.read().decode(), prefix)
    assert families.keys() == rows.keys(), (url, families, rows)
    for name, (kind, labels) in families.items():
        assert kind == rows[name][0], (name, kind, rows[name])
        assert labels is None or labels == rows[name][1], (name, labels, rows[name])
