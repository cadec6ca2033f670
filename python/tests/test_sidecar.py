"""Sidecar agents spawned from Python (``kvferry.spawn``) over an engine's shared-memory pool
(``kvferry.ShmPool``): the kvferry binary as a sidecar, a sidecar that cannot start explained
by its own log, and a sidecar that stops with its engine. test_agents.py runs every room
operation and error surface on sidecars too; test_two_processes.py moves 100 rooms through
them. ``python -m kvferry proxy`` runs the PD proxy from the package."""

import os

import numpy as np
import pytest

import kvferry
from engine import POISON, fill, kv_shape, options


@pytest.fixture
def shm(tmp_path):
    """Pool file paths on /dev/shm, removed after the test."""
    made = []

    def path(name: str) -> str:
        made.append(f"/dev/shm/kvferry-pytest-{os.getpid()}-{name}")
        return made[-1]

    yield path
    for p in made:
        if os.path.exists(p):
            os.unlink(p)


def test_a_binary_sidecar_moves_a_room_and_stops_cleanly(registry, shm, kvferry_bin):
    # `program=` runs the kvferry binary instead of `python -m kvferry`; the calls are the same.
    opts = options(registry)
    shape = kv_shape(opts)
    with kvferry.ShmPool(shm("p"), **opts) as p_pool, kvferry.ShmPool(shm("d"), **opts) as d_pool:
        p_kv = fill(np.frombuffer(p_pool.regions[0], np.float16).reshape(shape), "noise", 11)
        d_kv = fill(np.frombuffer(d_pool.regions[0], np.float16).reshape(shape), "poison")
        program = [str(kvferry_bin)]
        with kvferry.spawn("prefill", p_pool, program=program, **opts) as prefill, \
                kvferry.spawn("decode", d_pool.descriptor, program=program, **opts) as decode:
            assert prefill.api_url.startswith("http://127.0.0.1:") and decode.data_endpoint
            decode.request(1, 70, pages=[7, 3, 11])
            prefill.ready(1, 70, pages=[5, 9, 2], aux=b"meta")
            assert decode.wait(1, 30)["state"] == "success"
            taken = decode.take(1)
            assert taken["aux"] == b"meta" and taken["bytes"] == taken["expected_bytes"]
            log = decode.log
        # SIGTERM: both drained and exited 0; the temporary log went with them.
        assert prefill.process.returncode == 0 and decode.process.returncode == 0
        assert not os.path.exists(log)
        with pytest.raises(kvferry.Unavailable, match="exited"):
            decode.view(1)
        for s, d in zip([5, 9, 2], [7, 3, 11]):
            assert (d_kv[:, d].view(np.uint16) == p_kv[:, s].view(np.uint16)).all()
        assert (np.delete(d_kv, [7, 3, 11], axis=1).view(np.uint16) == POISON).all()
        del p_kv, d_kv


def test_a_sidecar_that_cannot_start_says_why(registry, shm):
    opts = options(registry)
    with pytest.raises(kvferry.ConfigError, match="nope"):
        kvferry.spawn("decode", kv_format="nope", **{k: v for k, v in opts.items() if k != "kv_format"})
    with pytest.raises(kvferry.ConfigError, match="role"):
        kvferry.spawn("bootstrap", **opts)
    # A pool file of another size than the options need: the agent refuses it, and the
    # StartError quotes the agent's own message from its log.
    path = shm("small")
    with open(path, "wb") as f:
        f.truncate(4096)
    with pytest.raises(kvferry.RegionError, match="holds 4096 bytes"):
        kvferry.ShmPool(path, **opts)
    with pytest.raises(kvferry.StartError, match="holds 4096 bytes but the layout needs") as e:
        kvferry.spawn("decode", f"shm:{path}", **opts)
    assert "exited with status 1" in str(e.value)


ORPHAN = """
import sys, time
import kvferry
sys.path.insert(0, sys.argv[2])
from engine import options
agent = kvferry.spawn("decode", **options(sys.argv[1]))
print(agent.process.pid, flush=True)
time.sleep(600)
"""


def test_the_package_runs_the_proxy():
    # No server behind it answers: it listens, and its /health says which role has none.
    import json
    import signal
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    dead = "http://127.0.0.1:9"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry", "proxy", "--prefill", dead, "--decode", dead, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        listening = json.loads(proc.stdout.readline())
        assert listening["event"] == "listening" and listening["role"] == "proxy", listening
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(listening["url"] + "/health", timeout=10)
        assert e.value.code == 503
        assert json.loads(e.value.read())["error"]["message"] == "no healthy prefill server"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_a_sidecar_stops_when_its_engine_dies(registry, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "engine.py"
    script.write_text(ORPHAN)
    engine = subprocess.Popen(
        [sys.executable, str(script), registry, os.path.dirname(__file__)], stdout=subprocess.PIPE, text=True
    )
    sidecar_pid = int(engine.stdout.readline())
    engine.send_signal(signal.SIGKILL)
    engine.wait()
    t0 = time.monotonic()

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    while running(sidecar_pid):
        assert time.monotonic() - t0 < 60, "the orphaned sidecar still runs after 60 s"
        time.sleep(0.05)
    print(f"the sidecar stopped {time.monotonic() - t0:.2f} s after its engine was killed")
    # It left the registry: a new sidecar takes the same rank at once (a live holder would
    # keep it for three leases, then the start fails).
    with kvferry.spawn("decode", **options(registry)) as again:
        assert again.view  # started
