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
import time
import types
import urllib.request

import pytest

import deployments
from conftest import REPO
from test_quickstart import (
    ENGINE_STARTS,
    NOT_RUN,
    PAGE,
    answer_of,
    counter,
    group_alive,
    group_ps,
    server_logs,
    sh_blocks,
    tail,
)
from vllm_servers import free_port

import kvferry
from kvferry import supported

# The quickstart's two servers start together on the same two cores (about a minute), with room
# to spare on a busy machine.
TIMEOUT_S = 600


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
    engines = [deployments.Engine(kind, "docs/quickstart.md vLLM server, from the installed wheel")
               for kind, start in ENGINE_STARTS.items() for _ in range(script.count(start))]
    assert len(engines) == 2, script
    (tmp_path / "section.sh").write_text(script)
    env = fresh.env | {p: str(free_port()) for p in ("PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT", "PROXY_PORT")}
    env |= {"VLLM_PY": str(fresh.python), "QUICKSTART_DIR": str(tmp_path)}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    start = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(["bash", str(tmp_path / "section.sh")], cwd=REPO, env=env, stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, process_group=0)
    try:
        try:
            rc = proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - start
        logs = server_logs(tmp_path / "vllm") + f"\nstderr:\n{tail(err)}\nstdout:\n{tail(out)}"
        assert rc == 0, f"the vLLM section ended with {rc} after {took:.0f} s; {logs}"
        answer = answer_of("vLLM", out.read_text())
        assert answer is not None, f"no answer in the section's output; {logs}"
        rooms = counter(out.read_text(), "kvferry_rooms_total", 'state="success"')
        landed = counter(out.read_text(), "kvferry_kv_bytes_total", 'direction="received"')
        assert rooms >= 1 and landed > 0, f"the decode agent landed {rooms} rooms, {landed} bytes; {logs}"
        print(f"\nvLLM quickstart from the installed wheel: {took:.0f} s, {rooms:.0f} room, {landed:.0f} bytes landed")
        deadline = time.monotonic() + 60
        while group_alive(proc.pid):
            assert time.monotonic() < deadline, f"processes still run 60 s after the last block:\n{group_ps(proc.pid)}"
            time.sleep(0.5)
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(5)
            if group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for engine in engines:
            engine.stopped()


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
