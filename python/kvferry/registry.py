"""A kvferry registry beside an engine: the engine adapters that pair agents through a registry
of their own (SGLang's bootstrap server, an LMCache transfer channel) start
``python -m kvferry bootstrap`` from their process with :func:`spawn_registry`, name it by
:func:`url_of` and wait until it answers with :func:`wait_for_registry`. The registry stops by
itself when the process that started it ends."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from typing import Mapping

from . import StartError

# How long a rank waits for the registry it registers in to answer.
REGISTRY_WAIT_S = 120.0


def connect_host(host: str) -> str:
    """The address to reach a server listening on ``host`` from this host."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def url_of(host: str, port: int) -> str:
    """The URL of the registry listening on ``host:port``: HTTPS when the deployment's kvferry
    uses TLS (``KVFERRY_TLS_CA`` or ``KVFERRY_TLS_CERT`` set: every process of one deployment
    sets them, and a registry started by :func:`spawn_registry` then serves HTTPS with the
    certificate)."""
    host = connect_host(host)
    tls = os.environ.get("KVFERRY_TLS_CA") or os.environ.get("KVFERRY_TLS_CERT")
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def spawn_registry(host: str, port: int, env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Starts ``python -m kvferry bootstrap`` on ``host:port`` (0: a free port); returns the
    process and its URL once it listens. It stops by itself when this process ends (its stdin
    is a pipe from here). It takes ``KVFERRY_TOKEN``, the agents' token, unless
    ``KVFERRY_BOOTSTRAP_TOKEN`` gives it another; ``env`` adds to (and overrides) this
    process's environment for it."""
    argv = [sys.executable, "-m", "kvferry", "bootstrap", "--host", host, "--port", str(port)]
    env = os.environ | {"KVFERRY_STOP_ON_STDIN_EOF": "1"} | dict(env or {})
    token = env.get("KVFERRY_TOKEN")
    if token and "KVFERRY_BOOTSTRAP_TOKEN" not in env:
        # The agents' token opens their registry too.
        env["KVFERRY_BOOTSTRAP_TOKEN"] = token
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        listening = json.loads(line)
    except ValueError:
        listening = None
    if not isinstance(listening, dict) or listening.get("event") != "listening":
        proc.kill()
        status = proc.wait()
        raise StartError(
            f"kvferry's registry ({' '.join(argv)}) exited with status {status} before listening "
            f"(printed {line!r}); is the port taken?"
        )
    return proc, str(listening["url"])


def stop_registry(proc: subprocess.Popen[bytes] | None) -> None:
    """Stops a registry :func:`spawn_registry` started (its stdin closes, as when this process
    ends); kills it if it has not stopped within 10 s."""
    if proc is None or proc.poll() is not None:
        return
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for_registry(url: str, timeout: float = REGISTRY_WAIT_S) -> None:
    """Waits until the registry at ``url`` answers ``/healthz`` (an engine rank may start
    before the registry it registers in listens)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    first = url.split(",")[0].rstrip("/")
    # An HTTPS registry's certificate is checked against the agents' CA (KVFERRY_TLS_CA).
    ca = os.environ.get("KVFERRY_TLS_CA")
    tls = ssl.create_default_context(cafile=ca or None) if first.startswith("https://") else None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{first}/healthz", timeout=2.0, context=tls) as r:
                if r.status == 200:
                    return
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(0.2)
    raise StartError(f"kvferry's registry at {url} did not answer /healthz within {timeout:.0f} s: {last}")
