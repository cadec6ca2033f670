#!/usr/bin/env python3
"""The table that closes scripts/test: minutes per step, then seconds per Rust test binary and per
pytest module from their JUnit files (a test's setup included, so a module's engines count where
they start).

Usage: test-table.py RC END N NAME... START...   (scripts/test passes its steps)

A step named `NAME &` runs in the background until the step `wait NAME` ends; the steps after it
run meanwhile.
"""

import os
import sys
import xml.etree.ElementTree as ET


def junit_seconds(path, key):
    """Seconds per group of test cases, grouped by key(testsuite, testcase)."""
    if not os.path.exists(path):
        return {}
    out = {}
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for case in suite.iter("testcase"):
            k = key(suite, case)
            out[k] = out.get(k, 0.0) + float(case.get("time") or 0)
    return out


def rows(title, seconds):
    if not seconds:
        return []
    lines = [f"{title}:"]
    for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:<44} {v / 60:6.1f}")
    return lines


def main():
    rc, end, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    names, starts = sys.argv[4 : 4 + n], [int(s) for s in sys.argv[4 + n : 4 + 2 * n]]
    lines = [f"scripts/test: exit {rc}; minutes per step", f"  {'step':<44} {'min':>6}"]
    ends = [starts[i + 1] if i + 1 < n else end for i in range(n)]
    for i, (name, start) in enumerate(zip(names, starts)):
        stop = ends[i]
        if name.endswith("&"):
            name = name[:-1].strip()
            waited = [j for j in range(n) if names[j] == f"wait {name}"]
            stop = ends[waited[0]] if waited else end
            name = f"{name} (beside the steps after it)"
        lines.append(f"  {name:<44} {(stop - start) / 60:6.1f}")
    if starts:
        lines.append(f"  {'total':<44} {(end - starts[0]) / 60:6.1f}")
    # nextest's suites are test binaries (`kvferry::processes`); the summed time of the
    # tests that ran one at a time is wall time.
    by_binary = lambda suite, case: suite.get("name")
    lines += rows("Rust test binaries, summed test minutes (nextest JUnit)",
                  junit_seconds("target/nextest/default/junit.xml", by_binary))
    lines += rows("on the CUDA driver emulator",
                  junit_seconds("target/nextest/emulator/junit.xml", by_binary))
    lines += rows("on UCX 1.22",
                  junit_seconds("target/nextest/ucx122/junit.xml", by_binary))
    # classname is `tests.test_x` or `tests.test_x.TestClass`: the module is the test_ part.
    by_module = lambda suite, case: next(
        (p for p in (case.get("classname") or "?").split(".") if p.startswith("test_")), "?")
    lines += rows("pytest modules, minutes with fixtures (pytest JUnit)",
                  junit_seconds("target/pytest-junit.xml", by_module))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
