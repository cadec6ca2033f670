"""Torch tensors as the engine's memory (data_ptr() and nbytes), with the vLLM venv's torch
(the ``torch_python`` fixture): a room moves between two tensors in vLLM's CPU layout in one
process, also after the engine pointed the prefill's tensor elsewhere and dropped it (the agent
holds the storage), and a tensor that is not contiguous is refused. test_two_processes.py moves 100 rooms
between torch tensors in two processes."""

import pathlib
import subprocess

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
sent = prefill_kv.clone()
with kvferry.PrefillAgent([prefill_kv], **opts) as prefill, kvferry.DecodeAgent([decode_kv], **opts) as decode:
    # The engine points its tensor at other memory and drops it: the storage the agent was given
    # must stay (the agent holds it), else the prefill reads freed memory.
    prefill_kv.set_(torch.empty(0, dtype=torch.float16))
    del prefill_kv
    import gc
    gc.collect()
    decode.request(9, 50, pages=[2, 8])
    prefill.ready(9, 50, pages=[5, 6])
    assert decode.wait(9, 30)["state"] == "success"
    decode.take(9)
assert torch.equal(decode_kv[:, [2, 8]], sent[:, [5, 6]])
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


def test_torch_tensors_as_engine_memory(registry, torch_python, tmp_path):
    python, env = torch_python
    script = tmp_path / "torch_room.py"
    script.write_text(RAISES + SCRIPT)
    out = subprocess.run(
        [python, str(script), registry, str(pathlib.Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
