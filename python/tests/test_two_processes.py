"""Two engine processes, a prefill and a decode, each embedding its agent over its own
vLLM-CPU-layout numpy cache, move 100 rooms through a real registry process: random block
tables, partial last blocks, layer-wise and token pieces, cached prefixes. The decode process
compares every byte of its cache afterwards (tests/engine.py)."""

import json
import pathlib
import subprocess
import sys

ENGINE = pathlib.Path(__file__).parent / "engine.py"
ROOMS = 100


def spawn(role: str, registry: str, seed: int, log: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ENGINE), role, registry, str(seed), str(ROOMS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),
        text=True,
    )


def test_100_rooms_between_two_engine_processes(registry, tmp_path):
    seed = 20261125
    prefill = spawn("prefill", registry, seed, tmp_path / "prefill.log")
    decode = spawn("decode", registry, seed, tmp_path / "decode.log")
    try:
        out, _ = decode.communicate(timeout=180)
        assert decode.returncode == 0, (tmp_path / "decode.log").read_text()
        result = json.loads(out.strip().splitlines()[-1])
        print(result)
        assert result["rooms"] == ROOMS
        assert result["short"] == []
        assert result["mismatches"] == 0, result["first_mismatch"]
        assert result["landed_bytes"] > 0
        p_out, _ = prefill.communicate(input="done\n", timeout=60)
        assert prefill.returncode == 0, (tmp_path / "prefill.log").read_text()
        p_result = json.loads(p_out.strip().splitlines()[-1])
        print(p_result)
        assert p_result["states"] == ["success"]
    finally:
        for p in (prefill, decode):
            if p.poll() is None:
                p.kill()
                p.wait()
