"""Sidecar agents spawned from Python (``kvferry.spawn``) over an engine's shared-memory pool
(``kvferry.ShmPool``): the kvferry binary as a sidecar, a sidecar that cannot start explained
by its own log, and a sidecar that stops with its engine. test_agents.py runs every room
operation and error surface on sidecars too; test_two_processes.py moves 100 rooms through
them. ``python -m kvferry proxy`` runs the PD proxy from the package."""

import http.client
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

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


FULL = """
import os, sys
import kvferry
sys.path.insert(0, sys.argv[2])
from engine import options
path = os.path.join(sys.argv[1], "pool")
try:
    kvferry.ShmPool(path, **options("http://127.0.0.1:1"))
except kvferry.RegionError as e:
    print("refused:", e, "| left:", os.listdir(sys.argv[1]))
"""


def test_a_pool_its_filesystem_cannot_hold_fails_when_made(tmp_path):
    """A pool file bigger than its filesystem's free space (a tmpfs of half the pool's size, as a
    container's small /dev/shm) fails when ShmPool makes it, naming the shortage, and leaves no
    file behind: never a SIGBUS when a transfer first touches a page. Needs root for the tmpfs
    (in a mount namespace of its own); CI runs as root."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root with unshare(1): this test must run")
        pytest.skip("needs root and unshare(1) to mount a small tmpfs")
    size = kvferry.memory_layout(**options("http://127.0.0.1:1"))["pool_bytes"]
    mnt = tmp_path / "shm"
    mnt.mkdir()
    script = 'mount -t tmpfs -o size="$1" kvferry-test "$2" && exec "$3" -c "$4" "$2" "$5"'
    tests = os.path.dirname(os.path.abspath(__file__))
    args = [str(size // 2), str(mnt), sys.executable, FULL, tests]
    got = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *args],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert f"cannot reserve the pool's {size} bytes (No space left on device)" in got.stdout, got.stdout + got.stderr
    assert got.stdout.rstrip().endswith("| left: []"), got.stdout


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


def raw_status(url: str, method: str = "GET", headers: dict | None = None) -> int:
    """The status of one API call made without the Sidecar class (urllib)."""
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_sidecar_with_a_token_sends_it_and_its_api_refuses_calls_without_it(registry, shm, monkeypatch, tmp_path):
    """A sidecar's agent with a token asks for it on its engine API (all but /healthz and
    /metrics): the Sidecar sends it with every call (from ``token=``, or ``KVFERRY_TOKEN`` of the
    engine's environment), a call without it or with another gets 401. The token is on no
    command line, in no log."""
    token = "s3cret"
    opts = options(registry)
    shape = kv_shape(opts)
    with kvferry.ShmPool(shm("tp"), **opts) as p_pool, kvferry.ShmPool(shm("td"), **opts) as d_pool:
        p_kv = fill(np.frombuffer(p_pool.regions[0], np.float16).reshape(shape), "noise", 12)
        d_kv = fill(np.frombuffer(d_pool.regions[0], np.float16).reshape(shape), "poison")
        monkeypatch.setenv("KVFERRY_TOKEN", token)
        # The prefill takes the token from the environment, the decode from its option.
        logs = [tmp_path / "prefill.log", tmp_path / "decode.log"]
        prefill = kvferry.spawn("prefill", p_pool, log=logs[0], **opts)
        monkeypatch.delenv("KVFERRY_TOKEN")
        with prefill, kvferry.spawn("decode", d_pool, token=token, log=logs[1], **opts) as decode:
            # Every call carries the bearer: a room moves between them.
            decode.request(1, 40, pages=[7, 3])
            prefill.ready(1, 40, pages=[5, 9], aux=b"meta")
            assert decode.wait(1, 30)["state"] == "success"
            assert decode.take(1)["aux"] == b"meta"
            assert prefill.wait(1, 30)["state"] == "success"
            assert decode.pool() == {"free_pages": 400, "total_pages": 400}
            for agent in (prefill, decode):
                for method, path in (("GET", "/v1/rooms/1"), ("GET", "/v1/pool"), ("POST", "/v1/rooms/2"),
                                     ("DELETE", "/v1/rooms/1")):
                    assert raw_status(agent.api_url + path, method) == 401, (agent.role, method, path)
                    wrong = {"Authorization": "Bearer nope"}
                    assert raw_status(agent.api_url + path, method, wrong) == 401, (agent.role, method, path)
                right = {"Authorization": f"Bearer {token}"}
                assert raw_status(agent.api_url + "/v1/pool", headers=right) == 200
                for path in ("/healthz", "/metrics"):
                    assert raw_status(agent.api_url + path) == 200, (agent.role, path)
                with open(f"/proc/{agent.process.pid}/cmdline", "rb") as f:
                    assert token.encode() not in f.read()
                assert token not in " ".join(agent.process.args)
            # The refused POST made no room.
            with pytest.raises(kvferry.UnknownRoom):
                decode.view(2)
        for s, d in zip([5, 9], [7, 3]):
            assert (d_kv[:, d].view(np.uint16) == p_kv[:, s].view(np.uint16)).all()
        del p_kv, d_kv
    for log in logs:
        text = log.read_text()
        assert "listening" in text and token not in text, log


def test_a_sidecar_without_the_agents_token_is_refused_by_its_api(registry, monkeypatch):
    """A Sidecar made for an agent with a token, calling without it (as one made before the
    agent had a token would), gets the API's 401 as an Error, whose message holds no token."""
    monkeypatch.delenv("KVFERRY_TOKEN", raising=False)
    with kvferry.spawn("decode", token="s3cret", **options(registry)) as decode:
        blind = kvferry.Sidecar(decode.process, dict(role="decode", api=decode.api_url, instance=decode.instance), decode.log)
        with pytest.raises(kvferry.Error, match="Authorization") as e:
            blind.pool()
        assert "s3cret" not in str(e.value)
        assert decode.pool()["total_pages"] == 400


def _certificates(dir) -> tuple[str, str, str]:
    """A CA and a certificate it signed for 127.0.0.1 (openssl): ca, cert, key paths."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=dir)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvferry-test-ca")
    run("req", *ec, "-keyout", "key.pem", "-out", "cert.csr", "-subj", "/CN=127.0.0.1")
    (dir / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "cert.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "cert.pem", "-days", "2", "-extfile", "san.ext")
    return str(dir / "ca.pem"), str(dir / "cert.pem"), str(dir / "key.pem")


def test_a_sidecar_serving_https_is_called_over_it_and_never_in_clear(registry, monkeypatch, tmp_path):
    """An agent given a certificate (``tls_cert``, ``tls_key``) serves its engine API over
    HTTPS only: the Sidecar calls it over TLS, checking the certificate against ``tls_ca``; a
    plain HTTP request to the same port is not served."""
    monkeypatch.delenv("KVFERRY_TOKEN", raising=False)
    ca, cert, key = _certificates(tmp_path)
    with kvferry.spawn("decode", token="s3cret", tls_cert=cert, tls_key=key, tls_ca=ca,
                       **options(registry)) as decode:
        assert decode.api_url.startswith("https://127.0.0.1:"), decode.api_url
        assert decode.pool()["total_pages"] == 400
        plain = decode.api_url.replace("https://", "http://", 1)
        # rustls answers it with a TLS alert, which no HTTP client takes for an answer.
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(plain + "/healthz", timeout=30).read()
        # A client that does not trust the agent's CA refuses its certificate.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(decode.api_url + "/healthz", timeout=30,
                                   context=ssl.create_default_context()).read()
        trusting = ssl.create_default_context(cafile=ca)
        assert urllib.request.urlopen(decode.api_url + "/healthz", timeout=30, context=trusting).status == 200
