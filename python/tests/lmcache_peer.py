"""LMCache processes for test_lmcache.py, run by the LMCache venv's python with this checkout's
wheel on its path: each holds an L1 arena (a numpy array, as LMCache's L1 memory manager is a
pinned host buffer) and the ``kvferry`` transfer channel over it, built as LMCache builds it
(``initialize_transfer_channel_context``).

- ``serve CONFIG``: an arena filled with the pattern of ``seed`` (``pattern``), served until
  stdin closes; prints ``{"event": "ready", "pid", "prefill_api", "decode_api"}`` once it serves.
- ``read CONFIG``: the reader. Its arena starts as poison (0xDE); it reads from the peers the
  config names through the channel's API (``submit_read``, ``query_read_status``), each case
  of the test's bad input (and, with contexts of their own, a reader without the token, one
  that trusts no registry of the peer's and one that admits 2 rooms at once), and prints one
  JSON line: every read's mask and seconds, the
  ValueErrors, and the bytes of its arena that differ from what they must be (the landed
  objects equal to the peer's bytes, every other byte poison)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import numpy as np  # noqa: E402
from lmcache.v1.distributed.internal_api import L1MemoryDesc  # noqa: E402
from lmcache.v1.distributed.transfer_channel import (  # noqa: E402
    delete_transfer_channel_context,
    initialize_transfer_channel_context,
)
from lmcache.v1.distributed.transfer_channel.api import TransferChannelAddress as Addr  # noqa: E402

import kvferry.lmcache  # noqa: E402

POISON = 0xDE
# How long a read may take before the test calls it a hang.
READ_BOUND_S = 60.0


def pattern(seed: int, size: int) -> np.ndarray:
    """A peer's arena: random bytes of ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def desc(arena: np.ndarray, align: int) -> L1MemoryDesc:
    return L1MemoryDesc(ptr=arena.ctypes.data, size=arena.nbytes, align_bytes=align, stable_registration_size=None)


def metric(api: str, name: str, label: str) -> float:
    with urllib.request.urlopen(api + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line.split("}", 1)[0])


def serve(cfg: dict) -> None:
    arena = pattern(cfg["seed"], cfg["size"])
    ctx = initialize_transfer_channel_context("kvferry", desc(arena, cfg["align"]), listen_url=cfg["url"],
                                              advertise_url=cfg["url"], **cfg.get("kwargs", {}))
    print(json.dumps({"event": "ready", "pid": os.getpid(), "prefill_api": ctx.prefill.api_url,
                      "decode_api": ctx.decode.api_url}), flush=True)
    sys.stdin.read()
    delete_transfer_channel_context()


class Reader:
    """One context's reads into its arena, and what the arena must hold after them."""

    def __init__(self, ctx, arena: np.ndarray, align: int) -> None:
        self.ctx, self.arena, self.align = ctx, arena, align
        self.expected = arena.copy()
        # Bytes whose content the test cannot know (a failed object's pages may hold part of it).
        self.unknown = np.zeros(arena.nbytes, bool)

    def extent(self, size: int) -> int:
        return -(-size // self.align) * self.align

    def read(self, peer: dict, objects: list[tuple[int, int, int]], spin=None) -> dict:
        """Reads ``(local offset, remote offset, size)`` objects from ``peer``; returns the
        mask, the seconds and the task, and books the landed bytes in ``expected``."""
        client = self.ctx.get_transfer_channel_client(peer["url"])
        local = [Addr(offset=lo, size=size) for lo, _, size in objects]
        remote = [Addr(offset=ro, size=size) for _, ro, size in objects]
        start = time.monotonic()
        task = client.submit_read(local, remote)
        result = client.query_read_status(task)
        while not result.is_finished():
            if spin is not None:
                spin(client, task)
            assert time.monotonic() - start < READ_BOUND_S, f"read {task} from {peer['url']}: not finished after {READ_BOUND_S} s"
            result = client.query_read_status(task)
        seconds = time.monotonic() - start
        source = pattern(peer["seed"], peer["size"])
        for ok, (lo, ro, size) in zip(result.succeeded_mask, objects):
            n = self.extent(size)
            if ok:
                self.expected[lo:lo + n] = source[ro:ro + n]
            else:
                self.unknown[lo:lo + n] = True
        return {"mask": result.succeeded_mask, "seconds": seconds, "bytes": sum(
            self.extent(size) for ok, (_, _, size) in zip(result.succeeded_mask, objects) if ok)}

    def mismatches(self) -> dict:
        bad = np.flatnonzero((self.arena != self.expected) & ~self.unknown)
        return {"mismatches": int(bad.size), "first": int(bad[0]) if bad.size else None,
                "unknown_bytes": int(self.unknown.sum())}


def value_error(call) -> str | None:
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def read(cfg: dict) -> None:
    align, size = cfg["align"], cfg["size"]
    good, dying = cfg["good"], cfg["dying"]
    page = align
    out: dict = {}

    arena = np.full(size, POISON, np.uint8)
    ctx = initialize_transfer_channel_context("kvferry", desc(arena, align), listen_url=cfg["url"],
                                              advertise_url=cfg["url"], backends=["UCX"], token=cfg["token"])
    reader = Reader(ctx, arena, align)
    out["decode_api"] = ctx.decode.api_url

    # Bad remote objects among good ones: each fails alone, the rest land.
    mixed = [
        (0, 3 * page, 2 * page),                        # good
        (4 * page, good["size"], page),                 # past the peer's arena
        (6 * page, 10 * page, 3 * page + 100),          # good, not a whole number of pages
        (12 * page, good["size"] - page, 2 * page),     # straddles the end of the peer's arena
        (16 * page, 100, page),                         # not page-aligned at the peer
        (20 * page, 40 * page, 4 * page),               # good
    ]
    out["mixed"] = reader.read(good, mixed)
    # Then a read of good objects only.
    out["after"] = reader.read(good, [(32 * page, 7 * page, page), (40 * page, 50 * page, 5 * page)])

    # Local objects that are not whole pages of the arena: ValueError, nothing starts.
    client = ctx.get_transfer_channel_client(good["url"])
    out["value_errors"] = {
        "outside": value_error(lambda: client.submit_read([Addr(size - page, 2 * page)], [Addr(0, 2 * page)])),
        "negative": value_error(lambda: client.submit_read([Addr(-page, page)], [Addr(0, page)])),
        "unaligned": value_error(lambda: client.submit_read([Addr(page + 1, page)], [Addr(0, page)])),
        "lengths": value_error(lambda: client.submit_read([Addr(0, page)], [])),
        "address": value_error(lambda: ctx.get_transfer_channel_address([(size - page, 2 * page)])),
    }
    # A remote object (the peer's word) of another size than its local one, or beyond any page
    # a read can name: that object fails, nothing is built for it, the call returns.
    task = client.submit_read([Addr(4000 * page, page), Addr(4001 * page, page)],
                              [Addr(0, 2 * page), Addr((1 << 40) * page, page)])
    while not (result := client.query_read_status(task)).finished:
        time.sleep(0.001)
    out["peer_sizes"] = result.succeeded_mask

    # A context without the token (another arena, its own registry) reads from the same peer.
    stranger_arena = np.full(size // 4, POISON, np.uint8)
    stranger = kvferry.lmcache.create_context(desc(stranger_arena, align), listen_url=cfg["stranger_url"],
                                              advertise_url=cfg["stranger_url"], insecure=True)
    try:
        out["stranger"] = Reader(stranger, stranger_arena, align).read(good, [(0, 0, 2 * page)])
        out["stranger_untouched"] = bool((stranger_arena == POISON).all())
    finally:
        stranger.close()

    # A context that trusts no registry of the peer's: a client for the peer is refused.
    small = size // 8
    wary_arena = np.full(small, POISON, np.uint8)
    wary = kvferry.lmcache.create_context(desc(wary_arena, align), listen_url=cfg["wary_url"],
                                          advertise_url=cfg["wary_url"], token=cfg["token"],
                                          allowed_registries="127.0.0.2:1")
    try:
        wary.get_transfer_channel_client(good["url"])
        out["wary"] = None
    except kvferry.Forbidden as e:
        out["wary"] = str(e)
    finally:
        wary.close()

    # A context that admits 2 rooms at once reads 6 objects: the rest wait in the task.
    narrow_arena = np.full(small, POISON, np.uint8)
    narrow = kvferry.lmcache.create_context(desc(narrow_arena, align), listen_url=cfg["narrow_url"],
                                            advertise_url=cfg["narrow_url"], token=cfg["token"],
                                            agent_options={"max_rooms": 2})
    waiting = []
    try:
        narrow_reader = Reader(narrow, narrow_arena, align)
        out["narrow"] = narrow_reader.read(good, [(i * 2 * page, i * 3 * page, 2 * page) for i in range(6)],
                                           spin=lambda client, task: waiting.append(len(client._tasks[task].pending)))
        out["narrow"] |= narrow_reader.mismatches() | {"most_waiting": max(waiting, default=0)}
    finally:
        narrow.close()

    # A peer that stopped answering (SIGSTOP), with every slower way to notice it made
    # impossible (peer_dead_ms, timeout_connect_ms: 60 s): the read timeout aborts its rooms,
    # its objects fail and nothing lands.
    stalled_arena = np.full(small, POISON, np.uint8)
    stalled = kvferry.lmcache.create_context(desc(stalled_arena, align), listen_url=cfg["stalled_url"],
                                             advertise_url=cfg["stalled_url"], token=cfg["token"],
                                             read_timeout_s=1.0,
                                             agent_options={"peer_dead_ms": 60000, "timeout_connect_ms": 60000})
    os.kill(dying["pid"], signal.SIGSTOP)
    try:
        out["stalled"] = Reader(stalled, stalled_arena, align).read(dying, [(0, 0, 2 * page), (2 * page, 5 * page, page)])
        out["stalled_untouched"] = bool((stalled_arena == POISON).all())
    finally:
        os.kill(dying["pid"], signal.SIGCONT)
        stalled.close()

    # A peer killed while a read from it moves: the objects that landed are right, the rest
    # fail, and the read finishes.
    base, gap = size // 4, page
    count, obj = cfg["dying_objects"], cfg["dying_object_bytes"]
    objects = [(base + i * (obj + gap), i * obj, obj) for i in range(count)]
    killed: dict = {}

    def kill_once_some_landed(client, task) -> None:
        if not killed and any(client._tasks[task].mask):
            os.kill(dying["pid"], signal.SIGKILL)
            killed["at"] = time.monotonic()
            killed["in_flight"] = len(client._tasks[task].rooms) + len(client._tasks[task].pending)

    attempts = []
    for _ in range(5):
        attempt = reader.read(dying, objects, spin=kill_once_some_landed)
        attempts.append(attempt)
        if killed:
            attempt["after_kill_s"] = time.monotonic() - killed["at"]
            attempt["in_flight_at_kill"] = killed["in_flight"]
            break
    out["dying"] = attempts
    if not killed:
        os.kill(dying["pid"], signal.SIGKILL)
        out["dying_dead"] = reader.read(dying, objects[:2])

    # The good peer still serves.
    out["last"] = reader.read(good, [(48 * page, 60 * page, 3 * page)])
    out["received_bytes"] = metric(ctx.decode.api_url, "kvferry_kv_bytes_total", 'direction="received"')
    out["clients"] = ctx.get_num_connected_clients()
    out |= reader.mismatches()
    delete_transfer_channel_context()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    {"serve": serve, "read": read}[sys.argv[1]](json.loads(sys.argv[2]))
