"""Fixtures: the kvferry binary of this checkout, a real registry process, a fake registry that
records what it receives (fake_registry.py), the vLLM and SGLang venvs' interpreters with this
checkout's wheel on their path, and, once per test run, the tiny model and a plain vLLM's
outputs for the prompt sets (vllm_servers.py)."""

import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def kvferry_bin() -> pathlib.Path:
    """target/release/kvferry (scripts/test builds it first)."""
    path = pathlib.Path(os.environ.get("KVFERRY_BIN", REPO / "target" / "release" / "kvferry"))
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo build --release` first")
    return path


@pytest.fixture(scope="session")
def registry(kvferry_bin, tmp_path_factory):
    """A `kvferry bootstrap --port 0` process; yields its URL from the listening line."""
    log = tmp_path_factory.mktemp("registry") / "stderr.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [str(kvferry_bin), "bootstrap", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the registry printed no listening line; {log}:\n{log.read_text()}")
        listening = json.loads(line)
        assert listening["event"] == "listening" and listening["role"] == "bootstrap", listening
        yield listening["url"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def engine_python(variable: str, venv: str, install: str, tmp_path_factory) -> tuple[str, str]:
    """An engine venv's python (``variable``, which scripts/test always sets; by default
    ~/.cache/kvferry/``venv``, from ``install``) and a directory holding the built abi3 wheel
    unpacked for it. Skipped only when the variable is unset and the default venv is missing."""
    python = os.environ.get(variable)
    if not python:
        python = str(pathlib.Path.home() / ".cache/kvferry" / venv / "bin/python")
        if not pathlib.Path(python).exists():
            pytest.skip(f"no {venv} ({install})")
    wheels = sorted((REPO / "target" / "python-wheels").glob("kvferry-*.whl"))
    assert wheels, "no built wheel in target/python-wheels (scripts/python/build)"
    site = tmp_path_factory.mktemp(f"{venv}-site")
    zipfile.ZipFile(wheels[-1]).extractall(site)
    return python, str(site)


@pytest.fixture(scope="session")
def torch_python(tmp_path_factory) -> tuple[str, dict]:
    """The vLLM venv's python (it has torch) and an environment with the wheel on its path."""
    python, site = engine_python("KVFERRY_VLLM_PYTHON", "vllm-venv", "scripts/vllm/install", tmp_path_factory)
    return python, os.environ | {"PYTHONPATH": site}


@pytest.fixture(scope="session")
def sglang(tmp_path_factory) -> tuple[str, dict]:
    """The SGLang venv's python and an environment with the wheel and the test-only stand-ins
    of sglang_stub/ on its path (sglang_servers.py)."""
    import sglang_servers

    python, site = engine_python("KVFERRY_SGLANG_PYTHON", "sglang-venv", "scripts/sglang/install", tmp_path_factory)
    return python, sglang_servers.sglang_env(site, dict(os.environ))


@pytest.fixture(scope="session")
def vllm(torch_python, tmp_path_factory):
    """The vLLM venv's python, its environment and the tiny seeded model (made once per run)."""
    import vllm_servers

    return vllm_servers.tiny_vllm(torch_python, tmp_path_factory)


@pytest.fixture(scope="session")
def reference(vllm, tmp_path_factory):
    """A single plain vLLM server's outputs for every prompt set (computed once per run)."""
    import vllm_servers

    return vllm_servers.reference_outputs(vllm, tmp_path_factory)


@pytest.fixture
def recording_registry():
    """A fake registry and the fake prefill its group lists, recording every connection,
    request and byte they receive (fake_registry.py); closed after the test."""
    import fake_registry

    with fake_registry.fake_registry() as fake:
        yield fake
