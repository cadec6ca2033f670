"""Fixtures: the kvferry binary of this checkout, a real registry process, a fake registry that
records what it receives (fake_registry.py), the vLLM, SGLang and LMCache venvs' interpreters with this
checkout's wheel on their path, and, once per test run, the tiny model and a plain vLLM's
outputs for the prompt sets (vllm_servers.py).

The run's engine deployments (deployments.py): the tests are ordered by the deployment they
use (``ORDER``), each deployment stops after its last test, and every engine start is counted
against the ceiling."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import deployments  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]

# The engine deployments in the order they run, each with the modules whose tests it serves in
# the order they run there (those not named run after the named ones, in pytest's order). A
# deployment is a session fixture, or a ``deployment`` mark's name for tests that start their
# engines themselves. Tests of no deployment run first.
ORDER = [
    ("vllm_fleet", ["test_vllm_xpyd", "test_vllm_pd", "test_vllm_faults", "test_vllm_cancel",
                    "test_vllm_first_token", "test_vllm_parallel", "test_vllm_fleet_change", "test_vllm_preemption"]),
    ("vllm_bench", []),
    ("vllm_mla", []),
    ("vllm_blocks", []),
    ("vllm_hybrid", []),
    ("sglang_pd", []),
    ("sglang_fleet", []),
    ("sglang_mla", []),
    ("quickstart", []),
]
# Servers that join a deployment for some of its tests and stop after the last of them.
MEMBERS = {"fleet_recompute_decode": "vllm_fleet", "fleet_prefill": "vllm_fleet", "fleet_dp_decode": "vllm_fleet",
           "fleet_both": "vllm_fleet"}


def pytest_configure(config):
    config.addinivalue_line("markers", "deployment(name): the test starts its own engines as deployment `name` (conftest.ORDER)")
    config.addinivalue_line("markers", "last(n): runs after the other tests of its deployment, lowest n first (a test that kills a server it does not restart)")
    # One ledger of engine starts for the run and the scripts it runs: the file scripts/test
    # names, or one of this run's own.
    if not os.environ.get(deployments.VARIABLE):
        fd, name = tempfile.mkstemp(prefix="kvferry-engine-ledger-", suffix=".txt")
        os.close(fd)
        os.environ[deployments.VARIABLE] = name
    pathlib.Path(os.environ[deployments.VARIABLE]).write_text("")


def uses(item) -> set[str]:
    """The deployments and members ``item`` needs."""
    names = set(getattr(item, "fixturenames", ())) & ({name for name, _ in ORDER} | set(MEMBERS))
    mark = item.get_closest_marker("deployment")
    return names | ({mark.args[0]} if mark else set())


def sort_key(item, index: int) -> tuple:
    used = uses(item)
    groups = [i for i, (name, _) in enumerate(ORDER) if name in used or name in {MEMBERS.get(u) for u in used}]
    if not groups:
        return (-1, 0, 0, index)
    group = min(groups)
    modules = ORDER[group][1]
    module = item.module.__name__ if item.module else ""
    rank = modules.index(module) if module in modules else len(modules)
    last = item.get_closest_marker("last")
    phase = 1 + last.args[0] if last else 0
    return (group, phase, rank if phase == 0 else 0, index)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Tests by deployment (after pytest grouped its parametrized fixtures)."""
    items[:] = [item for _, item in sorted(((sort_key(item, i), item) for i, item in enumerate(items)), key=lambda t: t[0])]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stops each deployment whose last test this was."""
    items = item.session.items
    rest = items[items.index(item) + 1:] if nextitem is not None else []
    needed = set().union(*(uses(i) for i in rest))
    deployments.LIVE.release(needed | {MEMBERS[m] for m in needed if m in MEMBERS})


# What a failed test's report quotes of each process log written during it.
QUOTED = ("WARN", "ERROR", "Error", "Traceback")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report quotes the last warnings and errors of every engine, agent, proxy
    and registry log written while it ran (CI keeps no logs)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    factory = getattr(item.config, "_tmp_path_factory", None)
    if factory is None:
        return
    for log in sorted(factory.getbasetemp().rglob("*.log")):
        try:
            if log.stat().st_mtime < call.start:
                continue
            lines = [line[:240] for line in log.read_text(errors="replace").splitlines() if any(q in line for q in QUOTED)]
        except OSError:
            continue
        if lines:
            report.sections.append((f"{log.parent.name}/{log.name}: its last warnings", "\n".join(lines[-12:])))


def pytest_terminal_summary(terminalreporter):
    path = deployments.ledger()
    if path is None or not path.exists():
        return
    t = deployments.totals(path)
    starts = ", ".join(f"{kind} {n} of {deployments.CEILING[kind]}" for kind, n in sorted(t["starts"].items())) or "none"
    terminalreporter.write_line(
        f"engine cold starts: {starts}; at most {t['peak']} resident of {deployments.CEILING['resident']} "
        f"(ledger {path})")


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
    import vllm_servers

    return python, str(vllm_servers.unpack_wheel(tmp_path_factory.mktemp(f"{venv}-site")))


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
def lmcache(tmp_path_factory) -> tuple[str, dict]:
    """The LMCache venv's python (scripts/lmcache/install) and an environment with the wheel on
    its path (test_lmcache.py)."""
    python, site = engine_python("KVFERRY_LMCACHE_PYTHON", "lmcache-venv", "scripts/lmcache/install", tmp_path_factory)
    return python, os.environ | {"PYTHONPATH": site, "LMCACHE_DISABLE_BANNER": "1"}


@pytest.fixture(scope="session")
def vllm(torch_python, tmp_path_factory):
    """The vLLM venv's python, its environment and the tiny seeded model (made once per run)."""
    import vllm_servers

    return vllm_servers.tiny_vllm(torch_python, tmp_path_factory)


@pytest.fixture(scope="session")
def reference(vllm):
    """The tiny model's greedy outputs for every prompt set and chat, a plain vLLM server's
    (computed once per run by HF transformers, vllm_servers.reference_outputs)."""
    import vllm_servers

    return vllm_servers.reference_outputs(vllm)


@pytest.fixture
def recording_registry():
    """A fake registry and the fake prefill its group lists, recording every connection,
    request and byte they receive (fake_registry.py); closed after the test."""
    import fake_registry

    with fake_registry.fake_registry() as fake:
        yield fake


@pytest.fixture(scope="session")
def vllm_fleet(vllm, kvferry_bin, tmp_path_factory, request):
    """The run's vLLM fleet (vllm_servers.fleet): 2 prefill and 2 decode servers that the xPyD,
    disaggregation, fault and parallel-shape tests share; started by the first, stopped after
    the last (a test that kills a server it does not start again runs last: ``last``). The
    reference (HF transformers) is computed while the fleet's servers start."""
    import vllm_servers

    fleet = vllm_servers.fleet(vllm, kvferry_bin, tmp_path_factory.mktemp("fleet"))
    deployments.LIVE.add("vllm_fleet", fleet.stop)
    request.getfixturevalue("reference")
    fleet.wait_healthy()
    yield fleet
    fleet.stop()


@pytest.fixture(scope="session")
def fleet_recompute_decode(vllm_fleet):
    """A fifth server of the fleet: a TP2 decode whose kv_load_failure_policy is ``recompute``
    (the fleet's decodes fail a request whose KV does not land), its agents on a base API port;
    stopped after the last test that uses it."""
    import vllm_servers

    port = vllm_servers.two_free_ports()
    # Its agents' data ports pinned too (kvferry.engine_options: base plus the TP rank).
    data_port = next(p for p in iter(vllm_servers.two_free_ports, None) if abs(p - port) > 1)
    metrics_port = next(p for p in iter(vllm_servers.two_free_ports, None) if min(abs(p - port), abs(p - data_port)) > 1)
    agent = dict(api_port=port, data_port=data_port, metrics_port=metrics_port)
    server = vllm_fleet.join(vllm_fleet.start_decode(2, tp=2, policy="recompute", agent=agent,
                                                     log="decode-recompute-tp2.log"))
    server.api_port, server.data_port, server.metrics_port = port, data_port, metrics_port
    deployments.LIVE.add("fleet_recompute_decode", server.stop)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fleet_dp_decode(vllm_fleet):
    """A decode server of two vLLM data-parallel ranks (TP1 each) joining the fleet, its agents
    on a base API port; stopped after the last test that uses it."""
    import vllm_servers

    port = vllm_servers.two_free_ports()
    server = vllm_fleet.join(vllm_fleet.start_decode(3, dp=2, agent=dict(api_port=port), log="decode-dp2.log"))
    server.api_port = port
    deployments.LIVE.add("fleet_dp_decode", server.stop)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fleet_both(vllm_fleet):
    """A ``kv_both`` server joining the fleet (its registry and agent options, prefix caching
    off: it is the prefill and the decode of its own requests), its agents on a base API port
    (the prefill agent on it, the decode agent on the next); stopped after the last test that
    uses it."""
    import vllm_servers

    port = vllm_servers.two_free_ports()
    f = vllm_fleet
    config = vllm_servers.connector("kv_both", f.bootstrap, f.connector_class, **(f.agent | dict(api_port=port)))
    server = f.join(vllm_servers.Server(f.python, f.env, f.model, 1, f.logs / "both.log", *f.prefill_args,
                                        "--no-enable-prefix-caching", "--kv-transfer-config", config))
    server.api_port = port
    deployments.LIVE.add("fleet_both", server.stop)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fleet_prefill(vllm_fleet):
    """A prefill server of the fleet of the shape a test asks for (vllm_servers.FleetPrefill)."""
    import vllm_servers

    extra = vllm_servers.FleetPrefill(vllm_fleet)
    deployments.LIVE.add("fleet_prefill", extra.stop)
    yield extra
    extra.stop()
