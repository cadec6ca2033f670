"""Torch tensors as the engine's memory (data_ptr() and nbytes), with the vLLM venv's torch
(KVFERRY_VLLM_PYTHON, scripts/vllm/install): the built wheel is unpacked for that interpreter
and a room moves between two tensors in vLLM's CPU layout. Skipped without that venv."""

import os
import pathlib
import subprocess
import zipfile

import pytest

from conftest import REPO

SCRIPT = r"""
import sys
import torch
import kvferry
sys.path.insert(0, sys.argv[2])
from engine import options

opts = options(sys.argv[1])
mem = kvferry.memory_layout(**opts)
shape = (4, mem["pool_pages"], 4, mem["page_size"], 64)
prefill_kv = torch.randn(shape, dtype=torch.float16)
decode_kv = torch.zeros(shape, dtype=torch.float16)
with pytest_raises(kvferry.RegionError, "not contiguous"):
    kvferry.DecodeAgent([torch.zeros(shape, dtype=torch.float16).transpose(0, 1)], **opts)
with kvferry.PrefillAgent([prefill_kv], **opts) as prefill, kvferry.DecodeAgent([decode_kv], **opts) as decode:
    decode.request(9, 50, pages=[2, 8])
    prefill.ready(9, 50, pages=[5, 6])
    assert decode.wait(9, 30)["state"] == "success"
    decode.take(9)
assert torch.equal(decode_kv[:, [2, 8]], prefill_kv[:, [5, 6]])
rest = torch.ones(shape[1], dtype=torch.bool)
rest[[2, 8]] = False
assert (decode_kv[:, rest] == 0).all()
print("ok")
"""

RAISES = """
import contextlib
@contextlib.contextmanager
def pytest_raises(exc, text):
    try:
        yield
    except exc as e:
        assert text in str(e), e
    else:
        raise AssertionError(f"{exc} not raised")
"""


def test_torch_tensors_as_engine_memory(registry, tmp_path):
    python = os.environ.get("KVFERRY_VLLM_PYTHON") or str(pathlib.Path.home() / ".cache/kvferry/vllm-venv/bin/python")
    if not pathlib.Path(python).exists():
        pytest.skip("no vLLM venv with torch (scripts/vllm/install)")
    wheels = sorted((REPO / "target" / "python-wheels").glob("kvferry-*.whl"))
    if not wheels:
        pytest.skip("no built wheel (scripts/python/build)")
    site = tmp_path / "site"
    zipfile.ZipFile(wheels[-1]).extractall(site)
    script = tmp_path / "torch_room.py"
    script.write_text(RAISES + SCRIPT)
    env = os.environ | {"PYTHONPATH": str(site)}
    out = subprocess.run(
        [python, str(script), registry, str(pathlib.Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
