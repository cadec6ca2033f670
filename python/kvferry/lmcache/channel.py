"""LMCache's transfer channel API (``lmcache.v1.distributed.transfer_channel``) over kvferry
agents.

- Memory: LMCache registers one L1 arena per process, ``(ptr, size)``, allocated in multiples
  of ``align_bytes``. The channel sees it as a kvferry pool of byte pages, one page per
  ``align_bytes`` (:class:`Arena`: one layer, one head, 1-byte elements, a "token" of up to
  4096 bytes), and serves and lands reads in it in place: a :class:`kvferry.PrefillAgent`
  started with ``serve_reads`` serves any pages of it that a peer names, a
  :class:`kvferry.DecodeAgent` lands the pages this process reads into it. Both agents borrow
  the arena; LMCache owns and frees it, after closing the context.
- Pairing: the context runs a kvferry registry on its listen ``host:port`` (the channel
  server's address in LMCache), where both agents register. Peers find it at the context's
  advertise ``host:port``: a client for a peer asks the peer's registry for its prefill
  agent, and only when its decode agent trusts that registry (``allowed_registries``).
- Reads: each object of a ``submit_read`` is one kvferry room (a random 64-bit id): the decode
  asks the peer's prefill for the object's pages (``source_pages``) into the local object's
  pages, so every object succeeds or fails on its own, with kvferry's reason, logged once.
  Offsets are bytes from the arena's start and must be multiples of ``align_bytes``; an object
  moves whole pages (LMCache rounds every allocation up to them), and both peers must use the
  same ``align_bytes``.
- ``query_read_status`` never blocks: it takes the settled rooms and reports the task once
  all its objects settled. LMCache abandons a timed-out P2P load without telling the channel
  and reuses its pages: a read older than ``read_timeout_s`` has its rooms aborted at the
  client's next call, and a task nobody queries for that long again is forgotten (its settled
  rooms expire ``room_ttl_ms`` later).

Settings come from the factory's keyword arguments or the agents' ``KVFERRY_*`` environment
(:class:`ChannelConfig`); docs/lmcache.md lists them.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from lmcache.logging import init_logger
from lmcache.v1.distributed.transfer_channel.abstract import (
    TransferChannelClient,
    TransferChannelContext,
    TransferChannelServer,
)
from lmcache.v1.distributed.transfer_channel.api import TransferChannelAddress, TransferChannelReadResult

import kvferry

from ..registry import connect_host, spawn_registry, stop_registry, url_of, wait_for_registry

logger = init_logger(__name__)

# The largest "token" of the arena's pool, in bytes: a page of align_bytes is align_bytes /
# TOKEN_BYTES tokens (align_bytes is a power of two in LMCache; any other alignment takes the
# largest common divisor).
TOKEN_BYTES = 4096

# The factory's keyword arguments this channel reads, and those it accepts and ignores
# (LMCache's benchmark passes `backends` to every channel type).
KWARGS = ("transport", "token", "insecure", "allowed_registries", "room_ttl_ms", "read_timeout_s", "agent_options")
IGNORED_KWARGS = ("backends",)

# What clap, which parses the agents' flags, reads as false in a flag's environment variable.
FALSE_WORDS = {"", "0", "false", "no", "off", "n", "f"}

# How long closing a client waits for its aborted rooms to be safe (no byte can land any more).
CLOSE_WAIT_S = 5.0

# A read still moving this long after its submit is aborted at the client's next call: LMCache
# gives up on a P2P load after its load timeout (--p2p-load-timeout, 30 s by default) without
# telling the channel and reuses the objects' pages, so no byte may land after that. Shorter
# than LMCache's; such a task nobody queries for as long is forgotten. The default of the
# factory's ``read_timeout_s``.
READ_TIMEOUT_S = 10.0

# Pages a read may name (kvferry's protocol limit), and the largest page number it carries.
MAX_PAGES = 1 << 20
PAGE_LIMIT = 1 << 32


def parse_url(url: str) -> tuple[str, int]:
    """``host:port`` (or ``scheme://host:port``, ``[v6]:port``) as (host, port)."""
    stripped = url.split("://", 1)[-1].rstrip("/")
    host, _, port = stripped.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"kvferry: transfer channel url {url!r} is not host:port")
    return host, int(port)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in FALSE_WORDS


def code_of(e: BaseException) -> str:
    """kvferry's reason code of an error: a failed room's own, or its refusal's class."""
    return str(getattr(e, "code", None) or type(e).__name__)


@dataclass(frozen=True)
class ChannelConfig:
    """The channel's settings: the factory's keyword arguments over the ``KVFERRY_*``
    environment that the agents read themselves (``transport``: ``KVFERRY_TRANSPORT``,
    ``token``: ``KVFERRY_TOKEN``, ``insecure``: ``KVFERRY_INSECURE``, ``allowed_registries``:
    ``KVFERRY_ALLOWED_REGISTRIES``, ``room_ttl_ms``: ``KVFERRY_ROOM_TTL_MS``), plus
    ``read_timeout_s`` (``READ_TIMEOUT_S``: reads still moving after it are aborted; below
    LMCache's P2P load timeout) and ``agent_options``, more flags of both agents as keywords
    (``checksum=True``)."""

    token: str | None
    insecure: bool
    allowed_registries: str
    options: dict[str, Any] = field(default_factory=dict)
    """Options of both agents (their flags as keywords), beyond the arena's layout."""
    read_timeout_s: float = READ_TIMEOUT_S

    @classmethod
    def from_kwargs(cls, advertise_host: str, kwargs: dict[str, Any]) -> "ChannelConfig":
        unknown = sorted(set(kwargs) - set(KWARGS) - set(IGNORED_KWARGS))
        if unknown:
            raise TypeError(f"kvferry transfer channel: unknown arguments {unknown} (it takes {list(KWARGS)})")
        token = kwargs.get("token") or os.environ.get("KVFERRY_TOKEN") or None
        insecure = bool(kwargs["insecure"]) if kwargs.get("insecure") is not None else env_flag("KVFERRY_INSECURE")
        if not token and not insecure:
            # serve_reads lets every peer that reaches the agent read any page of the arena.
            raise ValueError(
                "kvferry transfer channel: set a token (KVFERRY_TOKEN or token=), shared by every peer: "
                "the channel serves any page of the L1 arena to the peers that prove it; "
                "insecure=True (KVFERRY_INSECURE=1) serves without one, only where every host that "
                "can reach it is trusted"
            )
        allowed = kwargs.get("allowed_registries") or os.environ.get("KVFERRY_ALLOWED_REGISTRIES")
        if not allowed:
            # Peers on this host; others must be listed.
            host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
            allowed = f"{host}:*"
        options: dict[str, Any] = {"api_port": 0}
        if kwargs.get("transport"):
            options["transport"] = str(kwargs["transport"])
        if token:
            options["token"] = token
        if insecure:
            options["insecure"] = True
        if kwargs.get("room_ttl_ms") is not None:
            options["room_ttl_ms"] = int(kwargs["room_ttl_ms"])
        options.update(kwargs.get("agent_options") or {})
        try:
            options.setdefault("engine", f"lmcache {metadata.version('lmcache')}")
        except metadata.PackageNotFoundError:
            pass
        timeout = READ_TIMEOUT_S if kwargs.get("read_timeout_s") is None else float(kwargs["read_timeout_s"])
        if not 0 < timeout < float("inf"):
            raise ValueError(f"kvferry transfer channel: read_timeout_s must be > 0, not {timeout}")
        return cls(token=token, insecure=insecure, allowed_registries=str(allowed), options=options,
                   read_timeout_s=timeout)

    def registry_env(self) -> dict[str, str]:
        """The environment of the context's registry: the channel's token and insecure setting."""
        env = {}
        if self.token:
            env["KVFERRY_BOOTSTRAP_TOKEN"] = self.token
        if self.insecure:
            env["KVFERRY_INSECURE"] = "true"
        return env


class Arena:
    """LMCache's L1 arena as a kvferry pool: page ``i`` is the ``align_bytes`` at ``ptr + i *
    align_bytes`` (a trailing part smaller than a page is never read or written)."""

    def __init__(self, l1_memory_desc: Any) -> None:
        self.ptr = int(l1_memory_desc.ptr)
        self.size = int(l1_memory_desc.size)
        self.align = int(l1_memory_desc.align_bytes)
        if self.align <= 0:
            raise ValueError(f"kvferry transfer channel: align_bytes {self.align} must be > 0")
        self.pages = self.size // self.align
        if self.pages == 0:
            raise ValueError(f"kvferry transfer channel: the L1 arena ({self.size} bytes) is smaller than a page ({self.align})")
        token_bytes = math.gcd(self.align, TOKEN_BYTES)
        self.page_tokens = self.align // token_bytes
        self.layout: dict[str, Any] = dict(
            layers=1, kv_heads=1, head_dim=token_bytes, dtype="fp8_e4m3", attention="mla",
            page_size=self.page_tokens, pool_pages=self.pages, kv_format="kvferry",
        )
        mem = kvferry.memory_layout(**self.layout)
        self.pool_bytes = int(mem["pool_bytes"])
        if mem["num_regions"] != 1 or self.pool_bytes != self.pages * self.align or self.pool_bytes > self.size:
            raise ValueError(f"kvferry transfer channel: the pool {self.layout} does not fit the L1 arena: {mem}")

    @property
    def regions(self) -> list[tuple[int, int]]:
        return [(self.ptr, self.pool_bytes)]

    def span(self, addr: TransferChannelAddress) -> tuple[int, int] | str:
        """The first page and page count of an object, or why it has none."""
        if addr.offset < 0 or addr.size <= 0:
            return f"object at offset {addr.offset} of {addr.size} bytes is not one"
        if addr.offset % self.align:
            return f"offset {addr.offset} is not a multiple of align_bytes {self.align}"
        return addr.offset // self.align, -(-addr.size // self.align)

    def local_pages(self, addr: TransferChannelAddress) -> list[int]:
        """This arena's pages of a local object; ValueError if it is not whole pages inside it."""
        span = self.span(addr)
        if isinstance(span, str):
            raise ValueError(f"kvferry transfer channel: local {span}")
        first, count = span
        if first + count > self.pages:
            raise ValueError(
                f"kvferry transfer channel: local object [{addr.offset:#x}, {addr.offset + count * self.align:#x}) "
                f"is outside the L1 arena's pages [0x0, {self.pool_bytes:#x})"
            )
        return list(range(first, first + count))

    def remote_pages(self, addr: TransferChannelAddress, want: int) -> list[int] | str:
        """The peer's pages of a remote object of ``want`` pages (its agent checks them against
        its arena), or why it has none. The address comes from the peer: nothing is built for a
        span of another size or beyond what a read can name."""
        span = self.span(addr)
        if isinstance(span, str):
            return f"remote {span}"
        first, count = span
        if count != want:
            return f"remote object of {addr.size} bytes is {count} pages, the local one {want}"
        if count > MAX_PAGES or first + count > PAGE_LIMIT:
            return f"remote object at page {first} of {count} pages is beyond what a read names"
        return list(range(first, first + count))


class KvferryServer(TransferChannelServer):
    """The channel's server: a kvferry registry on the listen address and a prefill agent
    registered in it that serves reads of the arena's pages to trusted peers."""

    def __init__(self, listen_url: str, advertise_url: str, l1_memory_desc: Any, *,
                 config: ChannelConfig | None = None, arena: Arena | None = None) -> None:
        host, port = parse_url(listen_url)
        advertise_host, _ = parse_url(advertise_url)
        self.arena = arena or Arena(l1_memory_desc)
        self.config = config or ChannelConfig.from_kwargs(connect_host(advertise_host), {})
        self.listen_url, self.advertise_url = listen_url, advertise_url
        self.registry, started_url = spawn_registry(host, port, env=self.config.registry_env())
        self.prefill: kvferry.PrefillAgent | None = None
        try:
            self.registry_url = url_of(host, parse_url(started_url)[1])
            wait_for_registry(self.registry_url)
            self.agent_host = dict(host=host, advertise_host=connect_host(advertise_host))
            self.prefill = kvferry.PrefillAgent(
                self.arena.regions, bootstrap=self.registry_url, serve_reads=True,
                **(self.config.options | self.agent_host | self.arena.layout),
            )
        except BaseException:
            stop_registry(self.registry)
            raise

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
            self.prefill = None
        stop_registry(self.registry)


@dataclass
class _Task:
    """One ``submit_read``: an object's outcome (None while it moves), its rooms in flight and
    the objects an agent at its room limit refused, to ask again."""

    mask: list[bool | None]
    rooms: dict[int, int] = field(default_factory=dict)
    pending: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    submitted: float = field(default_factory=time.monotonic)
    queried: float = field(default_factory=time.monotonic)
    timed_out: bool = False

    def settled(self) -> bool:
        return not self.rooms and not self.pending


class KvferryClient(TransferChannelClient):
    """Reads from one peer: each object a room of the context's decode agent, from the
    peer's prefill agent (found in the peer's registry)."""

    def __init__(self, context: "KvferryContext", peer_advertise_url: str) -> None:
        host, port = parse_url(peer_advertise_url)
        self.ctx = context
        self.peer = peer_advertise_url
        self.bootstrap = url_of(host, port)
        self._lock = threading.Lock()
        self._tasks: dict[int, _Task] = {}
        self._next_task = 0
        decode = context.decode
        try:
            decode.prefill_group(self.bootstrap, 0)
            logger.info("kvferry: reading from %s, whose registry %s lists its agent", peer_advertise_url, self.bootstrap)
        except kvferry.Forbidden:
            # Never asked: an untrusted registry would get the token.
            raise
        except kvferry.Error as e:
            logger.warning("kvferry: the registry of %s (%s) does not list its agent (each read asks again): %s",
                           peer_advertise_url, self.bootstrap, e)

    def submit_read(self, local_addresses: list[TransferChannelAddress],
                    remote_addresses: list[TransferChannelAddress]) -> int:
        """Starts reading each remote object into its local one; returns the task id. Raises
        ValueError, before anything moves, when the lists differ in length, a local object is
        not whole pages of the arena, or two paired objects differ in pages; a remote object
        that is not (or that the peer refuses) fails on its own."""
        if len(local_addresses) != len(remote_addresses):
            raise ValueError(
                "local_addresses and remote_addresses must have equal length "
                f"({len(local_addresses)} != {len(remote_addresses)})"
            )
        arena = self.ctx.arena
        plans: list[tuple[list[int], list[int] | str]] = []
        for local, remote in zip(local_addresses, remote_addresses):
            dst = arena.local_pages(local)
            plans.append((dst, arena.remote_pages(remote, len(dst))))
        with self._lock:
            self._time_out()
            task_id = self._next_task
            self._next_task += 1
            task = _Task(mask=[None] * len(plans))
            self._tasks[task_id] = task
            for i, (dst, src) in enumerate(plans):
                if isinstance(src, str):
                    self._fail(task_id, task, i, "bad_address", src)
                elif task.pending:
                    task.pending.append((i, dst, src))
                else:
                    self._start(task_id, task, i, dst, src)
        return task_id

    def query_read_status(self, task_id: int) -> TransferChannelReadResult:
        """The task's result once every object settled (then the task is forgotten: a second
        query raises KeyError, as LMCache's own channels do), else ``finished=False``. Never
        blocks."""
        decode = self.ctx.decode
        with self._lock:
            self._time_out()
            task = self._tasks.get(task_id)
            if task is None:
                raise KeyError(f"Unknown read task id: {task_id}")
            task.queried = time.monotonic()
            while task.pending:
                i, dst, src = task.pending.pop(0)
                if not self._start(task_id, task, i, dst, src):
                    break
            if task.rooms:
                for room, view in decode.poll(list(task.rooms)).items():
                    i = task.rooms.pop(room)
                    if view is None:
                        self._fail(task_id, task, i, "expired", f"room {room} is gone (expired)")
                        continue
                    try:
                        decode.take(room)
                        task.mask[i] = True
                    except kvferry.RoomFailed as e:
                        self._fail(task_id, task, i, e.code, e.message)
                    except kvferry.Error as e:
                        self._fail(task_id, task, i, code_of(e), str(e))
            finished = task.settled()
            if finished:
                del self._tasks[task_id]
        if not finished:
            # A caller that spins on this (LMCache's benchmark does) leaves the rest of its
            # time slice to the agents' threads: a yield, not a wait.
            time.sleep(0)
            return TransferChannelReadResult(finished=False, succeeded_mask=[])
        return TransferChannelReadResult(finished=True, succeeded_mask=[bool(ok) for ok in task.mask])

    def _start(self, task_id: int, task: _Task, i: int, dst: list[int], src: list[int]) -> bool:
        """Asks for object ``i``'s room; False when the agent is at its room limit (the object
        waits in ``pending``, asked again at the next query)."""
        room = secrets.randbits(64) or 1
        try:
            self.ctx.decode.request(room, len(dst) * self.ctx.arena.page_tokens, pages=dst,
                                    source_pages=src, bootstrap=self.bootstrap)
        except kvferry.Exhausted:
            task.pending.insert(0, (i, dst, src))
            return False
        except Exception as e:  # noqa: BLE001 - an object's failure must not escape into LMCache's thread
            self._fail(task_id, task, i, code_of(e), str(e))
            return True
        task.rooms[room] = i
        return True

    def _time_out(self) -> None:
        """Aborts the rooms of reads older than the read timeout (their objects then fail
        ``aborted`` once no byte can land any more) and fails their waiting objects; forgets
        such a task once nobody queried it for as long (a task its caller still polls is
        reported, never forgotten). Called with the lock held."""
        now, timeout = time.monotonic(), self.ctx.config.read_timeout_s
        for task_id, task in list(self._tasks.items()):
            age = now - task.submitted
            if task.timed_out and now - task.queried >= timeout:
                del self._tasks[task_id]
            elif age >= timeout and not task.timed_out:
                task.timed_out = True
                for i, _, _ in task.pending:
                    self._fail(task_id, task, i, "timeout", f"not started within {timeout:g} s")
                task.pending.clear()
                for room in task.rooms:
                    try:
                        self.ctx.decode.abort(room)
                    except kvferry.Error:
                        pass  # settled meanwhile: the next query takes it
                logger.warning("kvferry at %s: read %d from %s still moving after %g s: its %d rooms aborted",
                               self.ctx.advertise_url, task_id, self.peer, timeout, len(task.rooms))

    def _fail(self, task_id: int, task: _Task, i: int, code: str, message: str) -> None:
        task.mask[i] = False
        logger.warning("kvferry at %s: read %d from %s: object %d failed: %s: %s", self.ctx.advertise_url, task_id,
                       self.peer, i, code, message)

    def close(self) -> None:
        """Drops the tasks in flight: aborts their rooms and waits (up to 5 s) until no byte
        can land in their pages any more. The peer is not told."""
        with self._lock:
            tasks, self._tasks = self._tasks, {}
        rooms = [room for task in tasks.values() for room in task.rooms]
        if not rooms:
            return
        decode = self.ctx.decode
        for room in rooms:
            try:
                decode.abort(room)
            except kvferry.Error:
                pass  # settled meanwhile, or gone
        deadline = time.monotonic() + CLOSE_WAIT_S
        left = rooms
        while left and time.monotonic() < deadline:
            settled = decode.poll(left)
            for room in settled:
                try:
                    decode.take(room)
                except kvferry.Error:
                    pass
            left = [room for room in left if room not in settled]
            if left:
                time.sleep(0.01)
        if left:
            logger.warning("kvferry: %d aborted reads from %s were not safe to reuse after %.0f s", len(left),
                           self.peer, CLOSE_WAIT_S)


class KvferryContext(TransferChannelContext):
    """The process's channel: the arena, the server (registry and prefill agent), the decode
    agent that lands reads, and a client per peer."""

    def __init__(self, l1_memory_desc: Any, listen_url: str, advertise_url: str, **kwargs: Any) -> None:
        advertise_host, _ = parse_url(advertise_url)
        self.arena = Arena(l1_memory_desc)
        self.config = ChannelConfig.from_kwargs(connect_host(advertise_host), kwargs)
        self.advertise_url = advertise_url
        self._lock = threading.Lock()
        self._clients: dict[str, KvferryClient] = {}
        self._closed = False
        self._server = KvferryServer(listen_url, advertise_url, l1_memory_desc, config=self.config, arena=self.arena)
        try:
            self.decode = kvferry.DecodeAgent(
                self.arena.regions, bootstrap=self._server.registry_url,
                allowed_registries=self.config.allowed_registries,
                **(self.config.options | self._server.agent_host | self.arena.layout),
            )
        except BaseException:
            self._server.close()
            raise
        assert self._server.prefill is not None
        logger.info(
            "kvferry transfer channel on %s (advertised %s): registry %s, %d pages of %d bytes at %#x; "
            "prefill agent api %s, decode agent api %s (data %s); trusts registries %s",
            listen_url, advertise_url, self._server.registry_url, self.arena.pages, self.arena.align,
            self.arena.ptr, self._server.prefill.api_url, self.decode.api_url, self.decode.data_endpoint,
            self.config.allowed_registries,
        )

    @property
    def prefill(self) -> kvferry.PrefillAgent:
        assert self._server.prefill is not None
        return self._server.prefill

    def get_transfer_channel_server(self) -> KvferryServer:
        return self._server

    def get_transfer_channel_client(self, peer_advertise_url: str) -> KvferryClient:
        with self._lock:
            if self._closed:
                raise RuntimeError("kvferry transfer channel: the context is closed")
            client = self._clients.get(peer_advertise_url)
        if client is not None:
            return client
        # Outside the lock: asking the peer's registry may take a while.
        fresh = KvferryClient(self, peer_advertise_url)
        with self._lock:
            closed = self._closed
            client = fresh if closed else self._clients.setdefault(peer_advertise_url, fresh)
        if closed:
            fresh.close()
            raise RuntimeError("kvferry transfer channel: the context is closed")
        if client is not fresh:
            fresh.close()
        return client

    def remove_transfer_channel_client(self, peer_advertise_url: str) -> None:
        with self._lock:
            client = self._clients.pop(peer_advertise_url, None)
        if client is not None:
            client.close()

    def get_transfer_channel_address(self, lmcache_addresses: list[tuple[int, int]]) -> list[TransferChannelAddress]:
        out = []
        for offset, size in lmcache_addresses:
            if offset < 0 or offset + size > self.arena.size:
                raise ValueError(
                    f"Object [{offset:#x}, {offset + size:#x}) is outside the registered L1 region "
                    f"[0x0, {self.arena.size:#x})"
                )
            out.append(TransferChannelAddress(offset=offset, size=size))
        return out

    def get_num_connected_clients(self) -> int:
        """The peers this process reads from (a peer reading from it needs no client here)."""
        with self._lock:
            return len(self._clients)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        try:
            for client in clients:
                client.close()
        finally:
            try:
                self.decode.close()
            finally:
                self._server.close()


def create_context(l1_memory_desc: Any, listen_url: str, advertise_url: str, **kwargs: Any) -> KvferryContext:
    """LMCache's factory for ``transfer_channel_type="kvferry"``."""
    return KvferryContext(l1_memory_desc, listen_url, advertise_url, **kwargs)
