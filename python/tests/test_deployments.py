"""The run's ledger of engine starts (deployments.py): a start past its engine's ceiling, or one
that would make more engines resident than allowed, is refused with the ceiling's place named;
stopped engines leave room; the ledger is shared by every process that writes to it."""

import subprocess
import sys

import pytest

import deployments


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.txt"
    path.write_text("")
    monkeypatch.setenv(deployments.VARIABLE, str(path))
    monkeypatch.setattr(deployments, "CEILING", {"vllm": 3, "sglang": 1, "resident": 2})
    return path


def test_a_start_past_the_ceiling_of_its_engine_is_refused(ledger):
    first = deployments.Engine("vllm", "a")
    first.stopped()
    second = deployments.Engine("vllm", "b")
    second.stopped()
    second.stopped()  # once is counted
    deployments.Engine("sglang", "c").stopped()
    deployments.Engine("vllm", "d").stopped()
    with pytest.raises(deployments.CeilingExceeded, match=r"vllm cold start 4 of a run whose ceiling is 3 \(python/tests/deployments.py"):
        deployments.Engine("vllm", "e")
    with pytest.raises(deployments.CeilingExceeded, match="sglang cold start 2"):
        deployments.Engine("sglang", "f")
    assert deployments.totals(ledger) == {"starts": {"vllm": 3, "sglang": 1}, "resident": 0, "peak": 1}


def test_more_engines_resident_than_the_ceiling_are_refused_until_one_stops(ledger):
    a = deployments.Engine("vllm", "a")
    deployments.Engine("vllm", "b")
    with pytest.raises(deployments.CeilingExceeded, match="3 engines resident at once, ceiling 2"):
        deployments.Engine("sglang", "c")
    a.stopped()
    deployments.Engine("sglang", "d")
    assert deployments.totals(ledger) == {"starts": {"vllm": 2, "sglang": 1}, "resident": 2, "peak": 2}


def test_engines_started_by_another_process_count(ledger):
    """What scripts/vllm/bench.py and the quickstart's servers write is in the same ledger."""
    script = "import deployments; deployments.Engine('vllm', 'child')"
    subprocess.run([sys.executable, "-c", script], check=True, cwd=deployments.__file__.rsplit("/", 1)[0])
    assert deployments.totals(ledger)["starts"] == {"vllm": 1}
    # The child never said its engine stopped: it is still resident here.
    deployments.Engine("vllm", "here")
    with pytest.raises(deployments.CeilingExceeded, match="resident"):
        deployments.Engine("vllm", "third")
