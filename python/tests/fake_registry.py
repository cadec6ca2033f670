"""A fake kvferry registry and a fake prefill that record everything they receive: the
instruments of the tests that a decode sends nothing (no connection, no token) to a registry it
does not trust (src/agent/registries.rs).

:class:`FakeRegistry` is a threaded HTTP server on 127.0.0.1 (port 0) that records every
connection and request (method, path, headers with lowercase names) and answers
``GET /v1/groups/N`` with a plausible complete prefill group of one rank, whose control
endpoint is :class:`FakePrefill`: a raw TCP listener on 127.0.0.1 (port 0) that records every
connection and the bytes it receives (a decode's ZeroMQ greeting; it never answers, so no
Hello follows). Neither serves a transfer: a positive control shows the instruments see a
decode that does talk to them.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time
import uuid
from typing import Any, Iterator

# The group's KV layout: the tests' tiny model (engine.MODEL), one rank holding all of it.
LAYOUT = dict(kind="mha", num_layers=4, num_kv_heads=4, head_dim=32, dtype="fp16", page_size=32)


class FakePrefill:
    """A raw TCP listener that records who connected and what they sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.connections: list[tuple[str, int]] = []
        self.data = bytearray()
        self.closed = False
        threading.Thread(target=self._accept, name="fake-prefill", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections.append(peer)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            while not self.closed:
                try:
                    got = conn.recv(65536)
                except OSError:
                    return
                if not got:
                    return
                with self.lock:
                    self.data += got

    def received(self) -> bool:
        with self.lock:
            return bool(self.connections or self.data)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeRegistry

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, peer = super().get_request()
        with self.fake.lock:
            self.fake.connections.append(peer)
        return conn, peer


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:
        pass

    def _record(self) -> None:
        fake = self.server.fake
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with fake.lock:
            fake.requests.append(dict(method=self.command, path=self.path, headers={k.lower(): v for k, v in self.headers.items()}, body=body))

    def _answer(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._record()
        fake = self.server.fake
        if self.path == "/healthz":
            self._answer(200, dict(status="ok", prefill_ranks=1, decode_ranks=0, groups=1))
        elif self.path.startswith("/v1/groups/") and self.path.rsplit("/", 1)[1].isdigit():
            self._answer(200, fake.group(int(self.path.rsplit("/", 1)[1])))
        else:
            self._answer(404, dict(error=f"no route {self.path}"))

    def do_POST(self) -> None:  # noqa: N802
        self._record()
        self._answer(404, dict(error=f"no route {self.path}"))

    do_PUT = do_DELETE = do_POST


class FakeRegistry:
    """A recording registry on 127.0.0.1 whose one prefill group lists :attr:`prefill`.
    ``url``, ``host_port`` (``127.0.0.1:PORT``, an ``--allowed-registries`` entry), ``port``."""

    def __init__(self, layout: dict[str, Any] | None = None) -> None:
        self.prefill = FakePrefill()
        self.layout = dict(LAYOUT if layout is None else layout)
        self.lock = threading.Lock()
        self.connections: list[tuple[str, int]] = []
        self.requests: list[dict[str, Any]] = []
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.fake = self
        self.port = self.server.server_address[1]
        self.host_port = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host_port}"
        self.instance = str(uuid.uuid4())
        threading.Thread(target=self.server.serve_forever, name="fake-registry", daemon=True).start()

    def group(self, dp_rank: int) -> dict[str, Any]:
        """``GET /v1/groups/{dp_rank}``: one rank holding every head and layer."""
        heads, layers = self.layout["num_kv_heads"], self.layout["num_layers"]
        rank = dict(
            instance_id=self.instance, role="prefill", dp_rank=dp_rank, dp_size=max(1, dp_rank + 1), tp_rank=0,
            tp_size=1, pp_rank=0, pp_size=1, layout=self.layout,
            slice=dict(heads=dict(start=0, end=heads), layers=dict(start=0, end=layers)),
            control_endpoint=self.prefill.endpoint, data_endpoints={"zmq-tcp": self.prefill.endpoint},
        )
        return dict(dp_rank=dp_rank, dp_size=rank["dp_size"], tp_size=1, pp_size=1, layout=self.layout, ranks=[rank])

    def bearers(self) -> list[str | None]:
        """The ``Authorization`` header of every request, in order."""
        with self.lock:
            return [r["headers"].get("authorization") for r in self.requests]

    def received(self) -> bool:
        """Whether anything reached the registry or its prefill (a connection is enough)."""
        with self.lock:
            mine = bool(self.connections or self.requests)
        return mine or self.prefill.received()

    def record(self) -> str:
        """What was received, for assertion messages."""
        with self.lock, self.prefill.lock:
            return (f"registry connections {self.connections}, requests "
                    f"{[(r['method'], r['path']) for r in self.requests]}; prefill connections "
                    f"{self.prefill.connections}, {len(self.prefill.data)} bytes")

    def wait_for(self, what: str, check: Any, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"not within {timeout} s: {what} ({self.record()})"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.prefill.close()


@contextlib.contextmanager
def fake_registry(layout: dict[str, Any] | None = None) -> Iterator[FakeRegistry]:
    fake = FakeRegistry(layout)
    try:
        yield fake
    finally:
        fake.close()
