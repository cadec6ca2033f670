"""Two engine processes, a prefill and a decode, move 100 rooms through a real registry
process: random block tables, partial last blocks, layer-wise and token pieces, cached
prefixes, in vLLM's CPU layout. The engines hold their caches as numpy arrays or torch tensors
with in-process agents, or as numpy arrays in shared memory with sidecar agents spawned from
Python. The decode engine drives its rooms by polling, then compares every byte of its cache
with what the prefill had (tests/engine.py): the rooms' blocks equal, every other byte poison."""

import json
import pathlib
import subprocess
import sys

import pytest

ENGINE = pathlib.Path(__file__).parent / "engine.py"
ROOMS = 100


@pytest.mark.parametrize("memory", ["numpy", "torch", "sidecar"])
def test_100_rooms_between_two_engine_processes(registry, tmp_path, memory, request):
    python, env = sys.executable, None
    if memory == "torch":
        python, env = request.getfixturevalue("torch_python")
    seed = 20261125

    def spawn(role: str) -> subprocess.Popen:
        return subprocess.Popen(
            [python, str(ENGINE), role, registry, str(seed), str(ROOMS), memory],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / f"{role}.log", "wb"),
            text=True,
            env=env,
        )

    prefill, decode = spawn("prefill"), spawn("decode")
    try:
        out, _ = decode.communicate(timeout=300)
        assert decode.returncode == 0, (tmp_path / "decode.log").read_text()
        result = json.loads(out.strip().splitlines()[-1])
        print(result)
        assert result["memory"] == memory
        assert result["rooms"] == ROOMS
        assert result["short"] == []
        assert result["mismatches"] == 0, result["first_mismatch"]
        assert result["landed_bytes"] > 0
        p_out, _ = prefill.communicate(input="done\n", timeout=120)
        assert prefill.returncode == 0, (tmp_path / "prefill.log").read_text()
        p_result = json.loads(p_out.strip().splitlines()[-1])
        print(p_result)
        assert p_result["states"] == ["success"]
    finally:
        for p in (prefill, decode):
            if p.poll() is None:
                p.kill()
                p.wait()
