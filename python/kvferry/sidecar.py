"""Sidecar agents: a ``kvferry prefill|decode`` process beside the engine, started and stopped
from Python, with the room operations of the in-process agents over the agent's HTTP API.

The engine's KV memory is shared with the sidecar through a file on /dev/shm
(:class:`ShmPool`, the ``--pool shm:PATH`` of the command line): the engine maps it, describes
it as regions exactly as for an in-process agent, and the sidecar maps the same file.

A :class:`Sidecar` answers like :class:`kvferry.PrefillAgent` / :class:`kvferry.DecodeAgent`:
the same methods and arguments, the same views (dicts with ``room`` as an int, each ``state`` a
:class:`kvferry.RoomState`, a taken room's ``aux`` as bytes: ``kvferry/rooms.py``) and the same
exceptions, because the HTTP API is a thin layer over the same operations (listed in
``kvferry._kvferry.OPERATIONS``).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import http.client
import json
import mmap
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from typing import Any, Iterable, Sequence, TypeVar, cast

from . import _kvferry
from ._kvferry import (
    FAILURE_CODES,
    BadRequest,
    Conflict,
    Error,
    Exhausted,
    Forbidden,
    RoomFailed,
    StartError,
    Unavailable,
    UnknownRoom,
    WaitTimeout,
)
from .rooms import DecodeRoomView, PoolCounts, PrefillRoomView, RoomState, RoomView, TakenRoom

# How long a kept-alive connection to the agent's API is reused after its last answer: below the
# 30 s in which the agent wants the next request's head (kvferry_wire::http::HEADER_TIMEOUT).
_CLIENT_IDLE = 20.0

# The refusal of a room operation by HTTP status (docs/engines.md, "The room API"): 403 is
# a room or hold naming a registry the decode does not trust (nothing was sent to it).
_REFUSALS = {400: BadRequest, 403: Forbidden, 404: UnknownRoom, 409: Conflict, 429: Exhausted, 503: Unavailable}
# The longest one long-poll of the API waits (the server caps ?wait_ms= at 60 s).
_SLICE_S = 30.0


class ShmPool:
    """An engine's KV memory in a shared-memory file, for a sidecar (``pool=`` of :func:`spawn`).

    Creates ``path`` (or opens it if it exists with the right size) at the size the agent
    options need (``memory_layout(**options)["pool_bytes"]``) and maps it. ``regions`` are
    writable memoryviews of the format's regions, back to back in the file, as the engine
    would hand them to an in-process agent (wrap them with ``numpy.frombuffer`` or
    ``torch.frombuffer``). The file is removed by :meth:`unlink` (or on leaving a ``with``
    block when this object created it), never by the sidecar.
    """

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        layout = _kvferry.memory_layout(**options)
        self.path = os.fspath(path)
        self.layout = layout
        size = layout["pool_bytes"]
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            self.created = have == 0
            if have not in (0, size):
                raise _kvferry.RegionError(
                    f"{self.path} holds {have} bytes but the layout needs {size}"
                )
            if self.created:
                self._reserve(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        whole = memoryview(self._map)
        step = layout["region_bytes"]
        self.regions = [whole[i * step : (i + 1) * step] for i in range(layout["num_regions"])]

    def _reserve(self, fd: int, size: int) -> None:
        """Allocates the whole file now, so that a full filesystem (a small /dev/shm in a
        container) fails here rather than as SIGBUS when a transfer first touches a page."""
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            self.unlink()
            raise _kvferry.RegionError(
                f"{self.path}: cannot reserve the pool's {size} bytes ({e.strerror}): free space "
                "on its filesystem (for /dev/shm, its size) or give fewer pool pages"
            ) from e

    @property
    def descriptor(self) -> str:
        """``shm:PATH``, the sidecar's ``--pool``."""
        return f"shm:{self.path}"

    def close(self) -> None:
        """Unmaps the file (arrays made from ``regions`` must be gone first: BufferError)."""
        for r in self.regions:
            r.release()
        self.regions = []
        self._map.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(BufferError):
            self.close()
        if self.created:
            self.unlink()


def spawn(
    role: str,
    pool: ShmPool | str | None = None,
    *,
    program: Sequence[str] | None = None,
    log: str | os.PathLike[str] | None = None,
    start_timeout: float = 60.0,
    **options: Any,
) -> Sidecar:
    """Starts a ``prefill`` or ``decode`` sidecar agent process and returns it once it listens.

    ``options`` are the agent's flags as for the in-process agents (checked here first);
    ``pool`` is the engine's memory (a :class:`ShmPool` or an ``shm:PATH`` / ``anon``
    descriptor). The process is ``python -m kvferry`` of this interpreter unless ``program``
    names another command (``["/usr/local/bin/kvferry"]``). A ``python -m kvferry`` sidecar
    stops by itself when this process ends without closing it (its stdin is a pipe from this
    process; see ``kvferry/__main__.py``); a binary does not. Its stderr (the agent's log) goes
    to ``log``, by default a temporary file (``Sidecar.log``, removed when the sidecar exits
    cleanly) whose tail a :class:`StartError` quotes when the agent exits before listening.

    The agent's token (``token=``, else ``KVFERRY_TOKEN`` of this process's environment) goes
    to the sidecar in its environment, never on its command line (which any local user can
    read, and which a :class:`StartError` quotes), and the :class:`Sidecar` sends it as
    ``Authorization: Bearer`` on every call of the agent's API, which needs it then.
    """
    if role not in ("prefill", "decode"):
        raise _kvferry.ConfigError(f"role must be prefill or decode, not {role!r}")
    if isinstance(pool, ShmPool):
        pool = pool.descriptor
    if pool is not None:
        options["pool"] = pool
    env = os.environ | {"KVFERRY_STOP_ON_STDIN_EOF": "1"}
    token = options.pop("token", None)
    if token is not None and str(token):
        token = env["KVFERRY_TOKEN"] = str(token)
    else:
        token = env.get("KVFERRY_TOKEN") or None
    # Checked with the token (an engine API beyond loopback needs one), then its flag and
    # value left out of the command line.
    flags = list(_kvferry.agent_flags(**options, token=token))
    if token is not None:
        at = flags.index("--token")
        del flags[at : at + 2]
    argv = [*(program or [sys.executable, "-m", "kvferry"]), role, *flags]
    temporary = log is None
    if log is None:
        fd, log = tempfile.mkstemp(prefix=f"kvferry-{role}-", suffix=".log")
        os.close(fd)
    log = os.fspath(log)
    try:
        with open(log, "ab") as err:
            # Its own session: stopping it signals whatever it started too.
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                start_new_session=True,
            )
    except OSError as e:
        if temporary:
            os.unlink(log)
        raise StartError(f"cannot start the {role} sidecar ({' '.join(argv)}): {e}") from e
    try:
        line = _first_line(proc, start_timeout)
    except BaseException:
        _stop(proc, 10.0)
        raise
    try:
        listening = json.loads(line) if line else None
    except ValueError:
        listening = None
    fields = ("role", "api", "instance")
    if not (isinstance(listening, dict) and listening.get("event") == "listening" and all(k in listening for k in fields)):
        status = _stop(proc, 10.0)
        what = f"printed {line!r} instead of its listening line" if line else f"exited with status {status} before listening"
        raise StartError(f"the {role} sidecar ({' '.join(argv)}) {what}; its log {log} ends:\n{_tail(log)}")
    # Nothing else is expected on stdout, but a library may print there (UCX logs to stdout by
    # default): it is drained into the log so the agent never blocks on a full pipe.
    threading.Thread(target=_drain, args=(proc.stdout, log), name="kvferry-sidecar-stdout", daemon=True).start()
    tls_ca = options.get("tls_ca") or env.get("KVFERRY_TLS_CA")
    return Sidecar(proc, listening, log, temporary, token=token, tls_ca=tls_ca)


def _drain(out: Any, log: str) -> None:
    with open(log, "ab") as f:
        for line in out:
            f.write(line)
            f.flush()


def _first_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """The child's first stdout line, or b"" if it exits first; StartError after ``timeout``."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise StartError(f"the sidecar printed no listening line within {timeout} s")
    return got[0]


def _tail(path: str, lines: int = 20) -> str:
    with open(path, "rb") as f:
        return b"".join(collections.deque(f, lines)).decode(errors="replace")


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM to the sidecar's session (the agent drains and stops), SIGKILL after
    ``timeout``; the exit status."""

    def signal_all(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    if proc.poll() is None:
        signal_all(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            signal_all(signal.SIGKILL)
            proc.wait()
    if proc.stdin:
        proc.stdin.close()
    return proc.returncode


class Sidecar:
    """A running sidecar agent process; the room operations go to its HTTP API."""

    def __init__(
        self, proc: subprocess.Popen[bytes], listening: dict[str, Any], log: str, temporary: bool = False,
        *, token: str | None = None, tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self.process = proc
        # Sent with every call (the agent's API asks for it when the agent has one); never
        # logged, never in a message.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._temporary_log = temporary
        self.role: str = listening["role"]
        self.api_url: str = listening["api"]
        self.instance: str = listening["instance"]
        self.endpoint: str = listening.get("control") or listening.get("data", "")
        self.log = log
        url = urllib.parse.urlsplit(self.api_url)
        self._host, self._port = url.hostname, url.port
        # An agent given --tls-cert serves HTTPS only: its certificate is checked against
        # ``tls_ca`` (its --tls-ca, else KVFERRY_TLS_CA), or else the system's roots.
        self._tls = ssl.create_default_context(cafile=os.fspath(tls_ca) if tls_ca else None) if url.scheme == "https" else None
        self._local = threading.local()

    # The prefill's control endpoint and the decode's data endpoint, as on the in-process agents.
    @property
    def control_endpoint(self) -> str:
        return self.endpoint

    @property
    def data_endpoint(self) -> str:
        return self.endpoint

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
        """One API call on this thread's keep-alive connection; the answer's JSON, or the
        exception of its status."""
        if self.process.poll() is not None:
            raise Unavailable(f"the sidecar exited with status {self.process.returncode} (log: {self.log})")
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._auth)
        if data is not None:
            headers["Content-Type"] = "application/json"
        # Only a read is tried again (on a fresh connection): an operation that may have run
        # already must not run twice.
        attempts = 2 if method == "GET" else 1
        for attempt in range(attempts):
            conn = getattr(self._local, "conn", None)
            if conn is not None and time.monotonic() - self._local.used >= _CLIENT_IDLE:
                # The agent closes a connection that sends no request for 30 s: never send one
                # on a connection it may be closing.
                conn.close()
                conn = None
            if conn is None:
                if self._tls is not None:
                    conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._tls)
                else:
                    conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
                self._local.conn = conn
                self._local.used = time.monotonic()
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request(method, path, data, headers)
                resp = conn.getresponse()
                raw = resp.read()
                self._local.used = time.monotonic()
                break
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                conn.close()
                self._local.conn = None
                if attempt + 1 == attempts or self.process.poll() is not None:
                    raise Unavailable(f"the sidecar's API {self.api_url} failed: {e} (log: {self.log})") from e
        try:
            payload = json.loads(raw or b"null")
        except ValueError:
            raise Error(f"the sidecar's API answered {resp.status} with a body that is not JSON: {raw[:200]!r}") from None
        if resp.status >= 400:
            message = payload.get("error", "") if isinstance(payload, dict) else str(payload)
            raise _REFUSALS.get(resp.status, Error)(message)
        return payload

    def view(self, room: int) -> RoomView:
        return _view(self._call("GET", f"/v1/rooms/{room}"))

    def poll(self, rooms: Iterable[int]) -> dict[int, RoomView | None]:
        """The views of the settled rooms among ``rooms``, None for unknown rooms (see the
        in-process ``poll``)."""
        out: dict[int, RoomView | None] = {}
        for room in rooms:
            try:
                v = self.view(room)
            except UnknownRoom:
                out[room] = None
                continue
            if _settled(v):
                out[room] = v
        return out

    def wait(self, room: int, timeout: float) -> RoomView:
        if not timeout >= 0:
            raise BadRequest(f"timeout {timeout} is not a number of seconds >= 0")
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            ms = int(min(left, _SLICE_S) * 1000)
            v = _view(self._call("GET", f"/v1/rooms/{room}?wait_ms={ms}", timeout=ms / 1000 + 30))
            if _settled(v):
                return _finished(room, v)
            if time.monotonic() >= deadline:
                e = WaitTimeout(f"room {room} is still {v['state']} after {timeout} s")
                e.room, e.view = room, v
                raise e

    def abort(self, room: int) -> RoomView:
        return _view(self._call("DELETE", f"/v1/rooms/{room}"))

    def pool(self) -> PoolCounts:
        got = self._call("GET", "/v1/pool")
        return {"free_pages": got["free_pages"], "total_pages": got["total_pages"]}

    def draining(self) -> None:
        """The engine shuts down: the agent tells the registry that it drains."""
        self._call("POST", "/v1/draining")

    def ready(
        self,
        room: int,
        tokens: int,
        pages: Sequence[int] | None = None,
        token_range: tuple[int, int] | None = None,
        layer_range: tuple[int, int] | None = None,
        last: bool | None = None,
        aux: bytes | None = None,
        room_key: str | bytes | None = None,
        cuda_ipc_event: bytes | None = None,
        prompt_digest: str | None = None,
    ) -> PrefillRoomView:
        """Announces a ready piece, as :meth:`kvferry.PrefillAgent.ready`. On a device pool
        (``--pool cuda-ipc:`` or ``cuda-vmm:``) whose KV the engine writes asynchronously,
        ``cuda_ipc_event`` is the 64-byte CUDA IPC handle of the interprocess event the engine
        recorded on its stream behind the piece's writes (``cuIpcGetEventHandle`` of an event
        created with ``CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING``; torch:
        ``torch.cuda.Event(interprocess=True).ipc_handle()``). The sidecar's gathers wait for
        that record (one that never completes fails this room alone with ``timeout_ready``);
        the engine keeps the event alive while the sidecar runs and
        may record it again as soon as this returns."""
        if cuda_ipc_event is not None:
            if not isinstance(cuda_ipc_event, (bytes, bytearray, memoryview)):
                kind = type(cuda_ipc_event).__name__
                raise BadRequest(f"cuda_ipc_event must be the 64 bytes of a CUipcEventHandle, not {kind}")
            cuda_ipc_event = bytes(cuda_ipc_event)
            if len(cuda_ipc_event) != 64:
                raise BadRequest(f"cuda_ipc_event must be the 64 bytes of a CUipcEventHandle, not {len(cuda_ipc_event)}")
        body = _fields(
            tokens=tokens,
            pages=pages,
            token_range=token_range,
            layer_range=layer_range,
            last=last,
            aux=None if aux is None else base64.b64encode(aux).decode(),
            room_key=_hex(room_key),
            cuda_ipc_event=None if cuda_ipc_event is None else cuda_ipc_event.hex(),
            prompt_digest=prompt_digest,
        )
        return cast(PrefillRoomView, _view(self._call("POST", f"/v1/rooms/{room}/ready", body)))

    def request(
        self,
        room: int,
        tokens: int,
        pages: Sequence[int] | None = None,
        start_token: int = 0,
        bootstrap: str | None = None,
        dp_rank: int | None = None,
        room_key: str | bytes | None = None,
        prompt_digest: str | None = None,
        source_pages: Sequence[int] | None = None,
    ) -> DecodeRoomView:
        body = _fields(
            tokens=tokens,
            pages=pages,
            start_token=start_token,
            bootstrap=bootstrap,
            dp_rank=dp_rank,
            room_key=_hex(room_key),
            prompt_digest=prompt_digest,
            source_pages=source_pages,
        )
        return cast(DecodeRoomView, _view(self._call("POST", f"/v1/rooms/{room}", body)))

    def hold(self, room: int, bootstrap: str | None = None, dp_rank: int | None = None) -> None:
        """As :meth:`kvferry.DecodeAgent.hold`."""
        self._call("POST", f"/v1/rooms/{room}/hold", _fields(bootstrap=bootstrap, dp_rank=dp_rank))

    def unhold(self, room: int) -> None:
        """As :meth:`kvferry.DecodeAgent.unhold`."""
        self._call("DELETE", f"/v1/rooms/{room}/hold")

    def prefill_group(self, bootstrap: str | None = None, dp_rank: int = 0) -> dict[str, Any]:
        """As :meth:`kvferry.DecodeAgent.prefill_group`."""
        query = "" if bootstrap is None else "?" + urllib.parse.urlencode({"bootstrap": bootstrap})
        return self._call("GET", f"/v1/prefill-groups/{dp_rank}{query}")

    def take(self, room: int) -> TakenRoom:
        taken = cast(TakenRoom, _view(self._call("POST", f"/v1/rooms/{room}/take")))
        aux = taken.get("aux")
        taken["aux"] = None if aux is None else base64.b64decode(aux)
        return _finished(room, taken)

    def close(self, timeout: float = 30.0) -> int:
        """Stops the sidecar (SIGTERM: it drains and exits; SIGKILL after ``timeout``) and
        returns its exit status. A temporary log is removed when the status is 0."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        status = _stop(self.process, timeout)
        if status == 0 and self._temporary_log:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.log)
        return status

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fields(**fields: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, (tuple, range)) else v) for k, v in fields.items() if v is not None}


def _hex(key: str | bytes | None) -> str | None:
    return key.hex() if isinstance(key, (bytes, bytearray)) else key


def _view(v: dict[str, Any]) -> RoomView:
    """A view of the API's JSON as the in-process agents give it: ``room`` an int, each
    ``state`` (the room's, its transfers') a :class:`RoomState`."""
    v["room"] = int(v["room"])
    for item in (v, *v.get("transfers", ())):
        item["state"] = RoomState(item["state"])
    return cast(RoomView, v)


_V = TypeVar("_V", bound=RoomView)


def _settled(v: RoomView) -> bool:
    return v["state"].is_final and v["safe_to_reuse"]


def _finished(room: int, v: _V) -> _V:
    """The view on success; its reason's exception otherwise (as the in-process agents)."""
    if v["state"] == RoomState.SUCCESS:
        return v
    reason = v.get("reason") or {}
    code, message = reason.get("code", ""), reason.get("message", "")
    e = FAILURE_CODES.get(code, RoomFailed)(f"room {room}: {code}: {message}")
    e.room, e.code, e.message, e.view = room, code, message, v
    raise e
