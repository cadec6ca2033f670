"""The registry side of kvferry under SGLang.

SGLang starts its transfer backend's bootstrap server in a prefill server's main process, on
``--disaggregation-bootstrap-port``, and its router tells every decode that address with each
request (``bootstrap_host``, ``bootstrap_port``). For kvferry that address is a kvferry registry:
:class:`KvferryBootstrapServer` runs ``python -m kvferry bootstrap`` there, and the prefill's
agents register in it. With ``KVFERRY_BOOTSTRAP`` set, the agents register in that registry
instead, and the bootstrap port is expected to reach it.

A decode needs a registry for its own ranks' registrations only: it finds each room's prefill
group at the request's bootstrap address, which its agent asks only when it trusts it
(``KVFERRY_ALLOWED_REGISTRIES`` lists the prefill servers' bootstrap addresses; backend.py).
Without ``KVFERRY_BOOTSTRAP`` each decode rank runs a private one on 127.0.0.1
(:func:`spawn_registry`).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import sys
import time
import urllib.request

from .. import StartError

logger = logging.getLogger(__name__)

# How long a rank waits for the registry it registers in to answer.
REGISTRY_WAIT_S = 120.0


def connect_host(host: str) -> str:
    """The address to reach a server listening on ``host`` from this host."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def url_of(host: str, port: int) -> str:
    """The URL of the registry a prefill server runs at its bootstrap ``host:port``: HTTPS when
    the deployment's kvferry uses TLS (``KVFERRY_TLS_CA`` or ``KVFERRY_TLS_CERT`` set: every
    server of one deployment sets them, and the registry a prefill server starts serves HTTPS
    with the certificate)."""
    host = connect_host(host)
    tls = os.environ.get("KVFERRY_TLS_CA") or os.environ.get("KVFERRY_TLS_CERT")
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def spawn_registry(host: str, port: int) -> tuple[subprocess.Popen[bytes], str]:
    """Starts ``python -m kvferry bootstrap`` on ``host:port`` (0: a free port); returns the
    process and its URL once it listens. It stops by itself when this process ends (its stdin
    is a pipe from here). It takes ``KVFERRY_TOKEN``, the agents' token, unless
    ``KVFERRY_BOOTSTRAP_TOKEN`` gives it another."""
    argv = [sys.executable, "-m", "kvferry", "bootstrap", "--host", host, "--port", str(port)]
    env = os.environ | {"KVFERRY_STOP_ON_STDIN_EOF": "1"}
    token = os.environ.get("KVFERRY_TOKEN")
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


def wait_for_registry(url: str, timeout: float = REGISTRY_WAIT_S) -> None:
    """Waits until the registry at ``url`` answers ``/healthz`` (a prefill's scheduler may
    start before its server's bootstrap port listens)."""
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


class KvferryBootstrapServer:
    """SGLang's bootstrap server for ``kvferry``: a kvferry registry on the bootstrap port, or
    nothing when ``KVFERRY_BOOTSTRAP`` names the registry."""

    def __init__(self, host: str, port: int) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = os.environ.get("KVFERRY_BOOTSTRAP") or ""
        if self.url:
            logger.info("kvferry: prefill ranks register in %s (KVFERRY_BOOTSTRAP)", self.url)
            return
        self.proc, self.url = spawn_registry(host or "127.0.0.1", port)
        logger.info("kvferry: registry listening at %s", self.url)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
