"""kvferry as a user installs it (docs/install.md): the built wheel, pip-installed into a fresh
venv under the test's temporary directory, on a ``PATH`` made from scratch (the venv's ``bin``,
``/usr/bin``, ``/bin``) where no ``cargo`` or ``rustc`` is. From that install: the ``kvferry``
command's ``--version`` (and ``python -m kvferry``'s), the registry, and docs/quickstart.md's vLLM
section, run as test_quickstart.py runs it but with the fresh venv as ``$VLLM_PY``: the page's
own block installs the wheel into it with pip, the registry and the proxy are its ``kvferry``
command, and the servers' connector is its ``kvferry``.

Installing vLLM into each fresh venv would take minutes, so the venv sees the vLLM venv's
packages through a ``.pth`` file, after its own: ``kvferry`` still resolves to the fresh
install, which the test asserts. The page's ``VLLM_PY=$(scripts/vllm/install)`` block is the one
replaced (by that venv); the blocks the page says the tests do not run are run here but its
first (the Rust build: a wheel needs none).

And what an install beside an engine version CI never ran gets: a refusal when the engine builds
kvferry's connector (``kvferry.supported``), checked here without any engine."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import types
import urllib.request

import pytest

import deployments
from conftest import REPO
from test_quickstart import ENGINE_STARTS, NOT_RUN, PAGE, SECTIONS, run_section, sh_blocks

import kvferry
from kvferry import supported

class Fresh(types.SimpleNamespace):
    """The fresh venv: ``python``, its ``bin``, the ``env`` every command of the install runs in,
    and ``site`` (its site-packages)."""


def wheel() -> pathlib.Path:
    wheels = sorted((REPO / "target" / "python-wheels").glob("kvferry-*.whl"))
    assert wheels, "no built wheel in target/python-wheels (scripts/python/build)"
    return wheels[-1]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Fresh:
    """A venv made by this interpreter's base Python, with the wheel pip-installed into it."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    bin_dir = venv / "bin"
    path = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    for tool in ("cargo", "rustc", "maturin"):
        assert shutil.which(tool, path=path) is None, f"{tool} on the install's PATH {path}"
    env = {"PATH": path, "HOME": str(root), "LANG": "C.UTF-8", "TMPDIR": str(root)}
    if os.environ.get(deployments.VARIABLE):
        env[deployments.VARIABLE] = os.environ[deployments.VARIABLE]
    python = bin_dir / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--disable-pip-version-check", "--quiet",
                    str(wheel())], env=env, check=True, capture_output=True, timeout=120)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          env=env, check=True, capture_output=True, text=True).stdout.strip()
    return Fresh(python=python, bin=bin_dir, env=env, site=pathlib.Path(site), root=root)


def run(fresh: Fresh, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), env=fresh.env, cwd=fresh.root, capture_output=True, text=True, timeout=60)


def test_the_wheel_gives_the_kvferry_command_and_its_version(fresh):
    command = shutil.which("kvferry", path=fresh.env["PATH"])
    assert command == str(fresh.bin / "kvferry"), command
    got = run(fresh, "kvferry", "--version")
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert len(lines) == 3, got.stdout
    assert re.fullmatch(rf"kvferry {re.escape(kvferry.__version__)} \(git ([0-9a-f]{{7,}}(-dirty)?|unknown)\)",
                        lines[0]), got.stdout
    now, oldest = map(int, re.fullmatch(r"protocol (\d+) \(speaks (\d+) to \1\)", lines[1]).groups())
    assert oldest < now, got.stdout
    assert re.fullmatch(r"features: (none|[a-z]+(, [a-z]+)*)", lines[2]), got.stdout
    # The same parser behind `python -m kvferry`, and behind -V its first line.
    assert run(fresh, str(fresh.python), "-m", "kvferry", "--version").stdout == got.stdout
    assert run(fresh, "kvferry", "-V").stdout == lines[0] + "\n"
    # A bad command line exits as the binary's does: clap's message, status 2.
    bad = run(fresh, "kvferry", "no-such-role")
    assert bad.returncode == 2 and "no-such-role" in bad.stderr, bad


def test_the_installed_command_runs_the_demo_and_the_benchmark(fresh):
    """``kvferry demo`` and ``kvferry bench`` start agents of their own: from the wheel, the
    interpreter's ``-m kvferry``. Every byte of the demo's rooms is verified."""
    demo = run(fresh, "kvferry", "demo", "--model", "tiny", "--transport", "zmq-tcp")
    assert demo.returncode == 0, demo.stderr[-3000:]
    summary = re.search(r"(\d+) rooms over zmq-tcp .*: (\d+) verified", demo.stdout)
    assert summary and summary.group(1) == summary.group(2) and int(summary.group(1)) > 0, demo.stdout
    bench = run(fresh, "kvferry", "bench", "--model", "tiny", "--transport", "zmq-tcp", "--tokens", "16",
                "--rooms", "3")
    assert bench.returncode == 0, bench.stderr[-3000:]
    row = next((line.split() for line in bench.stdout.splitlines() if line.split()[:2] == ["zmq-tcp", "16"]), None)
    assert row is not None and row[3] == row[4] == "3", bench.stdout
    print(f"\n{summary.group(0)}\nbench: {' '.join(row)}")


def test_the_installed_registry_serves(fresh):
    log = fresh.root / "bootstrap.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(["kvferry", "bootstrap", "--port", "0"], env=fresh.env, cwd=fresh.root,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"no listening line; {log}:\n{log.read_text()}"
        listening = json.loads(line)
        assert listening["event"] == "listening" and listening["role"] == "bootstrap", listening
        with urllib.request.urlopen(f"{listening['url']}/healthz", timeout=10) as answer:
            assert answer.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, f"{log}:\n{log.read_text()}"


@pytest.fixture
def fresh_with_vllm(fresh, torch_python) -> Fresh:
    """``fresh`` seeing the vLLM venv's packages after its own (a ``.pth`` file)."""
    vllm_python, _ = torch_python
    info = subprocess.run([vllm_python, "-c", "import sys, sysconfig; print(sysconfig.get_paths()['purelib']); "
                           "print(sys.version_info[:2])"], check=True, capture_output=True, text=True).stdout
    vllm_site, vllm_version = info.splitlines()
    assert vllm_version == str(sys.version_info[:2]), f"the vLLM venv is Python {vllm_version}"
    (fresh.site / "zz-kvferry-test-vllm-venv.pth").write_text(vllm_site + "\n")
    return fresh


@pytest.mark.deployment("quickstart")
def test_the_vllm_quickstart_runs_from_the_install(fresh_with_vllm, tmp_path):
    fresh = fresh_with_vllm
    # kvferry from the fresh install, vLLM from the vLLM venv (found, not imported: the servers do).
    where = subprocess.run([str(fresh.python), "-c", "import importlib.util, kvferry; "
                            "print(kvferry.__file__); print(importlib.util.find_spec('vllm').origin)"],
                           env=fresh.env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr[-2000:]
    ours, theirs = map(pathlib.Path, where.stdout.split())
    assert ours.is_relative_to(fresh.site), where.stdout
    assert not theirs.is_relative_to(fresh.site), where.stdout

    blocks = sh_blocks(PAGE.read_text())["vLLM"]
    replaced = [b for b in blocks if "scripts/vllm/install" in b]
    assert len(replaced) == 1 and replaced[0].strip() == "VLLM_PY=$(scripts/vllm/install)", replaced
    kept = [b for b in blocks if b not in replaced]
    # The page's own install of the wheel into $VLLM_PY runs here, as a user runs it.
    assert any(b.startswith(NOT_RUN) and "pip install" in b and "kvferry-*.whl" in b for b in kept), kept
    script = "set -euo pipefail\n" + "\n".join(kept)
    assert script.count(ENGINE_STARTS["vllm"]) == 2, script
    _, _, port_names = SECTIONS["vLLM"]
    run_section("vLLM", script, fresh.env | {"VLLM_PY": str(fresh.python)}, port_names, tmp_path,
                "docs/quickstart.md vLLM server, from the installed wheel")


# ---- an engine version CI never ran ------------------------------------------------------------


@pytest.mark.parametrize("engine, version, ok", [
    ("vllm", "0.32.0", True),
    ("vllm", "0.32.1+cpu", True),
    ("vllm", "0.33.0", False),
    ("vllm", "0.31.2", False),
    ("vllm", "1.0.0", False),
    ("vllm", "dev", False),
    ("sglang", "0.5.23", True),
    ("sglang", "0.5.23.post1", True),
    ("sglang", "0.5.24", False),
    ("sglang", "0.5.9", False),
])
def test_an_engine_version_outside_the_tested_range_is_refused(engine, version, ok):
    if ok:
        supported.check(engine, version)
        return
    with pytest.raises(kvferry.ConfigError) as refused:
        supported.check(engine, version)
    name, low, _, ci = supported.TESTED[engine]
    message = str(refused.value)
    assert f"{name} {version}" in message and ci in message and "docs/install.md" in message, message


def test_sglang_refuses_an_untested_version_when_it_asks_for_the_backend(monkeypatch):
    """The plugin's ``get_kv_class`` hook, with ``sglang.version`` faked: kvferry's classes are
    refused under SGLang 0.6.0, and any other backend's lookup is left alone."""
    import kvferry.sglang as plugin

    fake = types.ModuleType("sglang.version")
    fake.__version__ = "0.6.0"
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    monkeypatch.setitem(sys.modules, "sglang.version", fake)
    backend = types.SimpleNamespace(value=plugin.NAME)
    with pytest.raises(kvferry.ConfigError, match=r"SGLang 0\.6\.0"):
        plugin.get_kv_class(lambda *a: pytest.fail("asked SGLang"), backend, "manager")
    assert plugin.get_kv_class(lambda b, c: ("sglang's", c), types.SimpleNamespace(value="mooncake"), "manager") \
        == ("sglang's", "manager")


def test_vllm_checks_its_version_before_anything_else_of_the_connector():
    """``KvferryConnector.__init__`` starts with ``supported.check("vllm", vllm.__version__)``
    (read from the source: importing the connector needs vLLM)."""
    tree = ast.parse((REPO / "python" / "kvferry" / "vllm" / "__init__.py").read_text())
    connector = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KvferryConnector")
    init = next(n for n in connector.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert ast.unparse(init.body[0]) == "supported.check('vllm', vllm.__version__)"
