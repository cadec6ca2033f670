"""scripts/vllm/bench.py still runs (its one-request smoke run): every setup answers with the
single engine's tokens, kvferry's TTFT splits into stages from both sides' room timings, and the
connector's time in the prefill step is found in the prefill's log, and a 9-layer model's layers
are announced in groups during the forward pass."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

# The benchmark script starts its engines itself (conftest.ORDER).
pytestmark = pytest.mark.deployment("vllm_bench")

SETUPS = ("kvferry-sequential", "kvferry-concurrent", "nixl")


def test_the_benchmark_smoke_run(torch_python, kvferry_bin, tmp_path):
    python, env = torch_python
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "vllm" / "bench.py"), "--smoke", "--setups", ",".join(SETUPS),
         "--kvferry", str(kvferry_bin), "--out", str(tmp_path)],
        env=env | {"KVFERRY_VLLM_PYTHON": python}, capture_output=True, text=True, timeout=900,
    )
    print(out.stderr[-3000:])
    assert out.returncode == 0, out.stderr[-5000:]
    rows = {r["setup"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == {"single", *SETUPS}, rows
    for name, row in rows.items():
        assert row["requests"] == 1 and row["tokens_wrong"] == 0, row
    for name in ("kvferry-sequential", "kvferry-concurrent"):
        stages = rows[name]["stages_ms"]
        assert stages["rooms"] == 1, stages
        # The stages tile the TTFT: client send to the first token.
        assert abs(sum(stages[k] for k in ("to_ready", "hop", "transfer", "first_step")) - rows[name]["ttft_p50_ms"]) < 2
        assert set(rows[name]["connector_us"]) == {"scheduler", "worker"}, rows[name]
    assert rows["kvferry-concurrent"]["stages_ms"]["hop"] == 0
    # Each group of layers was announced as vLLM saved its last layer, during the forward pass.
    assert "did not save layers" not in (tmp_path / "kvferry-tcp" / "prefill.log").read_text()
    assert rows["nixl"]["vllm_ms"]["decode nixl_xfer_time"] > 0
