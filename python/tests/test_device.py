"""Agents embedded in an engine whose KV cache is CUDA device memory, on the CUDA driver
emulator (emu/cuda, docs/gpu.md), each in a child process with the emulator's libcuda and NVRTC
on its library path: device_engine.py registers per-layer device allocations by address with
``device=0``, moves rooms through the transfer kernel (one behind the engine's CUDA event), and
reads both caches back with cuMemcpyDtoH: every byte of a room's pages is the prefill's, every
other byte the poison. device_vllm.py does the same with the regions and formats the vLLM
connector picks for vLLM's CUDA caches."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
REPO = HERE.parents[1]


@pytest.fixture(scope="session")
def emulator_env() -> dict:
    """This environment with the emulator (emu/cuda/build's own folder, built there if a source
    changed) and NVRTC first on LD_LIBRARY_PATH."""
    built = subprocess.run([str(REPO / "emu/cuda/build")], check=True, capture_output=True, text=True)
    out = built.stdout.strip()
    nvrtc = subprocess.run([str(REPO / "scripts/nvrtc-env")], check=True, capture_output=True, text=True)
    found = re.search(r"export LD_LIBRARY_PATH=(\S+)", nvrtc.stdout)
    assert found, nvrtc.stdout
    path = f"{out}:{found.group(1)}"
    return os.environ | {"LD_LIBRARY_PATH": path, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}


def test_in_process_agents_move_a_room_between_device_caches(registry, emulator_env):
    run = subprocess.run(
        [sys.executable, str(HERE / "device_engine.py"), registry],
        env=emulator_env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-4000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{result['landed_bytes']} bytes landed, the rest of {result['pool_bytes']} poison")
    assert result["landed_bytes"] > 0



def test_vllm_cuda_caches_become_agent_regions(registry, emulator_env, torch_python):
    """kvferry.vllm.memory on the emulator's memory, in the vLLM venv (the connector imports vLLM)."""
    python, env = torch_python
    env = emulator_env | {"PYTHONPATH": f"{HERE}:{env['PYTHONPATH']}"}
    run = subprocess.run(
        [python, str(HERE / "device_vllm.py"), registry], env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-4000:]}"
    print(run.stdout.strip().splitlines()[-1])


def test_a_sidecar_room_behind_the_engines_ipc_event_lands_after_its_writes(registry, emulator_env):
    run = subprocess.run(
        [sys.executable, str(HERE / "device_sidecar.py"), registry],
        env=emulator_env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-4000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{result['landed_bytes']} bytes landed behind the event, the rest of {result['pool_bytes']} poison")
    assert result["landed_bytes"] > 0
