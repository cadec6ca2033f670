"""A decode whose KV cache is too small for the requests it runs preempts some of them; those
whose prompt KV came from a room must come back with the right KV.

After the fleet's other tests (its decodes are gone by then), a decode server with a KV cache of
6 blocks (``--num-gpu-blocks-override``; ``--max-model-len 768`` so that one request fits)
joins the fleet's two prefills behind a proxy. Prompts that end just before a block boundary go
8 at once, so that the running requests outgrow the cache while they generate and vLLM preempts
some. A preempted request recomputes its KV on the decode: the connector asks for a room once
(it clears ``do_remote_prefill`` after the load), and vLLM's recomputation needs no prefill.
Every answer equals a single engine's, every room landed exactly once (the decode agents'
bytes against what the responses say they loaded, no room failed), and nothing is held
afterwards on any agent or engine.
"""

from __future__ import annotations

import time

import pytest

from test_vllm_xpyd import all_prompts
from vllm_servers import (
    BLOCK_SIZE,
    NEW_TOKENS,
    Server,
    View,
    connector,
    metric,
    run_prompts,
    unfinished_rooms,
    vllm_metric,
)

# Usable blocks of the small decode (vLLM keeps one more, its null block).
BLOCKS = 6


@pytest.mark.last(2)
def test_preempted_requests_whose_kv_came_from_a_room_recompute_it(vllm_fleet, reference):
    fleet = vllm_fleet
    small = fleet.join(Server(
        fleet.python, fleet.env, fleet.model, 1, fleet.logs / "decode-small-cache.log", *fleet.decode_args,
        "--num-gpu-blocks-override", str(BLOCKS + 1), "--max-model-len", str(BLOCKS * BLOCK_SIZE),
        "--kv-transfer-config", connector("kv_consumer", fleet.bootstrap, **fleet.agent),
    ))
    view = View(fleet, fleet.prefills, [small])
    try:
        view.via = {"concurrent": view.proxy("concurrent")}
        # Prompts whose answer crosses into one more block than the prompt fills.
        prompts = [p for p in all_prompts()
                   if len(p) + NEW_TOKENS <= BLOCKS * BLOCK_SIZE
                   and -(-(len(p) + NEW_TOKENS) // BLOCK_SIZE) > -(-len(p) // BLOCK_SIZE)]
        assert len(prompts) >= 8, [len(p) for p in prompts]
        api = small.agent_api()
        preempted = vllm_metric(small, "vllm:num_preemptions_total")
        failures = metric(api, "kvferry_room_failures_total")
        run_prompts(view, "concurrent", prompts, reference, in_flight=8)
        preempted = vllm_metric(small, "vllm:num_preemptions_total") - preempted
        failed = metric(api, "kvferry_room_failures_total") - failures
        print(f"{len(prompts)} prompts of {sorted(len(p) for p in prompts)} tokens, 8 at once, on a decode of "
              f"{BLOCKS} blocks: {preempted:.0f} preemptions, every answer the reference's; preempted "
              f"requests recomputed their KV (each room landed once, {failed:.0f} failed)")
        assert preempted > 0, "the decode never preempted: its cache is not small enough"
        assert failed == 0
        agents = [a for p in fleet.prefills for a in p.agent_apis()] + [api]
        start = time.monotonic()
        while (any(unfinished_rooms(a) for a in agents)
               or any(vllm_metric(s, "vllm:kv_cache_usage_perc") > 0 for s in fleet.prefills + [small])):
            assert time.monotonic() - start < 60, "rooms or blocks still held after the requests"
            time.sleep(0.1)
    finally:
        view.stop()
        small.stop()
