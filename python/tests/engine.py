"""A toy engine for the tests: vLLM's CPU KV cache as numpy arrays, room plans both sides
derive from one seed, and the agent options the tests share.

vLLM's CPU backend keeps one buffer for every layer; layer ``l`` is a dense
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` tensor at ``l * layer_bytes``
(docs/vllm.md), block 0 is its null block. kvferry's ``vllm-cpu-vec`` format is that buffer.

Run as a script it is one engine process of test_two_processes.py:
``engine.py prefill|decode REGISTRY SEED ROOMS MEMORY`` (see ``main``), where MEMORY is
``numpy`` or ``torch`` (an in-process agent over that array) or ``sidecar`` (a spawned agent
process over a numpy array in an ``ShmPool``).
"""

import contextlib
import json
import os
import sys
import time

import numpy as np

import kvferry

MODEL = dict(model="tiny", page_size=32, kv_format="vllm-cpu-vec")
POOL_PAGES = 400
POISON = 0xDEAD  # a float16 NaN pattern nothing else writes


def options(registry: str, **extra) -> dict:
    """Agent options for a test: loopback only, short bounds."""
    return dict(
        bootstrap=registry,
        pool_pages=POOL_PAGES,
        host="127.0.0.1",
        api_host="127.0.0.1",
        timeout_bootstrap_ms=10_000,
        timeout_ready_ms=30_000,
        timeout_stall_ms=10_000,
        chunk_bytes=65536,
        **MODEL,
    ) | extra


def kv_shape(opts: dict) -> tuple[int, ...]:
    """vLLM's CPU KV cache for these options: one float16 buffer
    ``[layers, num_blocks, kv_heads, block_size, 2 * head_size]`` (layer ``l`` is ``kv[l]``)."""
    layout = kvferry.memory_layout(**opts)
    assert layout["num_regions"] == 1, layout
    layers = layout["layers"][1] - layout["layers"][0]
    heads = layout["heads"][1] - layout["heads"][0]
    dim = layout["head_bytes"] // layout["dtype_bytes"]
    shape = (layers, layout["pool_pages"], heads, layout["page_size"], 2 * dim)
    assert 2 * np.prod(shape) == layout["region_bytes"], (shape, layout)
    return shape


def fill(kv: np.ndarray, how: str, seed: int = 0) -> np.ndarray:
    """Fills a cache with seeded noise (``how="noise"``) or poison; returns it."""
    bits = kv.view(np.uint16)
    if how == "noise":
        bits[...] = np.random.default_rng(seed).integers(0, 1 << 16, size=kv.shape, dtype=np.uint16)
    else:
        bits[...] = POISON
    return kv


def kv_cache(opts: dict, how: str, seed: int = 0) -> np.ndarray:
    """A numpy cache of these options (:func:`kv_shape`), filled (:func:`fill`)."""
    return fill(np.empty(kv_shape(opts), dtype=np.float16), how, seed)


@contextlib.contextmanager
def engine_agent(role: str, memory: str, opts: dict):
    """An agent of ``role`` over a fresh cache held as ``memory`` says; yields the agent and a
    float16 numpy view of the cache (the engine fills and checks it through that view)."""
    shape = kv_shape(opts)
    if memory == "sidecar":
        path = f"/dev/shm/kvferry-test-{role}-{os.getpid()}"
        with kvferry.ShmPool(path, **opts) as pool:
            kv = np.frombuffer(pool.regions[0], np.float16).reshape(shape)
            with kvferry.spawn(role, pool, **opts) as agent:
                yield agent, kv
            del kv  # the pool unmaps only once no array uses it
        return
    if memory == "torch":
        import torch

        tensor = torch.empty(shape, dtype=torch.float16)
        region, kv = tensor, tensor.numpy()
    else:
        region = kv = np.empty(shape, dtype=np.float16)
    agent_type = kvferry.PrefillAgent if role == "prefill" else kvferry.DecodeAgent
    with agent_type([region], **opts) as agent:
        yield agent, kv


def plan(seed: int, rooms: int, page: int = 32, pool_pages: int = POOL_PAGES) -> list[dict]:
    """Rooms both engines agree on: lengths with partial and exact last pages, random block
    tables on both sides that never share a block (block 0 never used), some announced layer by
    layer, some in token pieces cut at a page, some with a cached prefix on the decode."""
    rng = np.random.default_rng(seed)
    src_free = list(rng.permutation(np.arange(1, pool_pages)))
    dst_free = list(rng.permutation(np.arange(1, pool_pages)))
    out = []
    for i in range(rooms):
        tokens = page * 3 if i % 10 == 0 else int(rng.integers(1, 4 * page + 1))
        n = -(-tokens // page)
        src = [int(src_free.pop()) for _ in range(n)]
        dst = [int(dst_free.pop()) for _ in range(n)]
        kind = ("layers", "tokens", "whole")[i % 3]
        cut = page * int(rng.integers(1, n)) if n > 1 else None
        start = page * int(rng.integers(1, n)) if n > 1 and i % 7 == 0 else 0
        out.append(
            dict(room=1000 + i, tokens=tokens, src=src, dst=dst, kind=kind, cut=cut, start=start)
        )
    return out


def pieces(room: dict, layers: int) -> list[dict]:
    """The ready calls of a room, as keyword arguments."""
    if room["kind"] == "layers":
        return [dict(layer_range=(l, l + 1), last=l + 1 == layers) for l in range(layers)]
    if room["kind"] == "tokens" and room["cut"] is not None:
        cut, n = room["cut"], room["tokens"]
        return [dict(token_range=(0, cut), last=False), dict(token_range=(cut, n), last=True)]
    return [dict()]


def expected(prefill_kv: np.ndarray, poison_kv: np.ndarray, rooms: list[dict], page: int) -> np.ndarray:
    """The decode's cache after the rooms land: vLLM CPU blocks move whole per (block, head),
    so every block of a room from its cached prefix on equals the prefill's block, and
    everything else keeps its poison."""
    want = poison_kv.copy()
    for r in rooms:
        for i in range(r["start"] // page, len(r["dst"])):
            want[:, r["dst"][i]] = prefill_kv[:, r["src"][i]]
    return want


def main() -> int:
    role, registry, seed, count, memory = sys.argv[1:6]
    seed, count = int(seed), int(count)
    opts = options(registry)
    rooms = plan(seed, count)
    t0 = time.monotonic()
    if role == "prefill":
        with engine_agent(role, memory, opts) as (agent, kv):
            fill(kv, "noise", seed)
            layers = kvferry.memory_layout(**opts)["layers"][1]
            for r in rooms:
                for piece in pieces(r, layers):
                    agent.ready(r["room"], r["tokens"], pages=r["src"], **piece)
            states = {agent.wait(r["room"], 60)["state"] for r in rooms}
            print(json.dumps(dict(role=role, states=sorted(states), seconds=time.monotonic() - t0)), flush=True)
            sys.stdin.readline()  # the test says when the decode is done
        return 0
    with engine_agent(role, memory, opts) as (agent, kv):
        fill(kv, "poison")
        for r in rooms:
            agent.request(r["room"], r["tokens"], pages=r["dst"], start_token=r["start"])
        taken = []
        pending = {r["room"] for r in rooms}
        # The rooms as an engine's step loop sees them: poll, take what settled, go on.
        while pending:
            for room, view in agent.poll(sorted(pending)).items():
                assert view is not None, f"room {room} vanished before it was taken"
                got = agent.take(room)
                assert got["state"] == "success" and got["page_owner"] == "engine", got
                taken.append(dict(room=room, bytes=view["bytes"], expected=view["expected_bytes"]))
                pending.discard(room)
            if time.monotonic() - t0 > 120:
                raise SystemExit(f"rooms still pending after 120 s: {sorted(pending)[:10]}")
            time.sleep(0.002)
        seconds = time.monotonic() - t0
        # Every byte of the decode's cache: the rooms' blocks equal the prefill's, the rest poison.
        want = expected(kv_cache(opts, "noise", seed), kv_cache(opts, "poison"), rooms, MODEL["page_size"])
        bad = np.argwhere(kv.view(np.uint16) != want.view(np.uint16))
    print(
        json.dumps(
            dict(
                role=role,
                memory=memory,
                rooms=len(taken),
                landed_bytes=sum(t["bytes"] for t in taken),
                short=[t for t in taken if t["bytes"] != t["expected"]],
                mismatches=len(bad),
                first_mismatch=bad[0].tolist() if len(bad) else None,
                seconds=seconds,
            )
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
