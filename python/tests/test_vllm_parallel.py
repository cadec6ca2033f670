"""Tensor and data parallelism through vLLM, each shape behind ``kvferry proxy``: a TP2 prefill
server with a TP1 decode server, a TP1 prefill with a TP2 decode, a prefill server of two vLLM
data-parallel ranks with a TP1 decode (these three in both pairings), and a TP4 prefill with a
TP1 decode (concurrent pairing).

The tiny model has 2 KV heads. A TP2 server's two workers each run an agent for one head, and
the TP1 side's agent pairs with both. At TP4 vLLM holds each head on two ranks: one of them
sends it and the other frees its pages unasked. A DP2 server's two engines are a kvferry group
each; the proxy learns both and sends each request's prefill to one of them in turn
(``X-data-parallel-rank``).

Ten prompts of mixed lengths, 4 at once, give a single vLLM's tokens; the decode agents land
exactly the blocks the answers say they loaded, the prefill agents that hold a head sent some
and none keeps a room. The decode agents listen on a base API port plus their TP rank, and
vLLM's own metrics and log line count their rooms and bytes.

A server of several ranks binds a core per rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``, and
``"0|1|0|1"`` at TP4), so every core holds a rank of each server here.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from vllm_servers import (
    SEEDS,
    Pd,
    free_port,
    make_prompts,
    metric,
    run_prompts,
    vllm_metric,
)

# The engines share both cores with each other: only a closed connection may end a peer or a
# Hello (the defaults, 5 s, assume engines with cores of their own).
AGENT = dict(peer_dead_ms=60_000, timeout_connect_ms=60_000)

SHAPES = {
    "tp2-to-tp1": dict(prefill_tp=2),
    "tp1-to-tp2": dict(decode_tp=2),
    "dp2-to-tp1": dict(prefill_dp=2),
    # More TP ranks than the model's 2 KV heads: vLLM holds each head on two ranks.
    "tp4-to-tp1": dict(prefill_tp=4),
}
# The pairings a shape runs: replication changes which prefill ranks send, not how a decode
# pairs with them (the other shapes run both pairings).
PAIRINGS = {"tp4-to-tp1": ["concurrent"]}
KV_HEADS = 2


# Run in the vLLM venv: kvferry.vllm imports vLLM.
GROUPS_OF_DP_RANKS = """
import json
from kvferry.vllm.params import ConnectorConfig
configs = [ConnectorConfig.of({"bootstrap": "http://r"}, f"4f1c_dp{rank}", rank) for rank in (0, 1)]
again = ConnectorConfig.of({"bootstrap": "http://r"}, "4f1c_dp1", 1)
print(json.dumps({"identities": [c.identity() for c in configs], "again": again.identity()}))
"""


def test_each_data_parallel_rank_of_a_prefill_server_is_a_group_that_names_its_rank(torch_python):
    """vLLM gives each DP rank an engine id of its own (``<id>_dp<rank>``) and keeps the rank in
    its parallel config: the connector derives a group from the one and reports the other."""
    python, env = torch_python
    run = subprocess.run([python, "-c", GROUPS_OF_DP_RANKS], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    first, second = said["identities"]
    assert first["kvferry_dp_rank"] != second["kvferry_dp_rank"], said
    assert [first["kvferry_engine_dp_rank"], second["kvferry_engine_dp_rank"]] == [0, 1], said
    assert said["again"] == second, "the same engine id gives the same group"


def two_free_ports() -> int:
    """A port ``p`` with ``p + 1`` free too (a base API port of a TP2 server)."""
    for _ in range(100):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two free ports in a row")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_outputs_equal_a_single_engine_across_parallel_shapes(vllm, kvferry_bin, tmp_path, reference, shape):
    ranks = SHAPES[shape]
    decode_tp = ranks.get("decode_tp", 1)
    # A decode's agents listen on a known base port plus their TP rank.
    api_port = two_free_ports()
    pd = Pd(vllm, kvferry_bin, tmp_path, **ranks, decode_agent=dict(api_port=api_port), **AGENT)
    try:
        prefill_agents = ranks.get("prefill_tp", 1) * ranks.get("prefill_dp", 1)
        assert [len(pd.prefill.agent_apis()), len(pd.decode.agent_apis())] == [prefill_agents, decode_tp]
        assert pd.decode.agent_apis() == [f"http://127.0.0.1:{api_port + r}" for r in range(decode_tp)]
        pairings = PAIRINGS.get(shape, list(SEEDS))
        pd.via = {pairing: pd.proxy(pairing) for pairing in pairings}
        for pairing in pairings:
            run_prompts(pd, pairing, make_prompts(SEEDS[pairing])[:10], reference, in_flight=4)
        sent = [metric(api, "kvferry_kv_bytes_total") for api in pd.prefill.agent_apis()]
        print(f"{shape}: bytes sent by each prefill agent {sent}")
        # Of the ranks holding the same head, the one a decode rank's TP rank picks sends it
        # (the first, for a TP1 decode); the others free their pages unasked.
        replicas = max(1, ranks.get("prefill_tp", 1) // KV_HEADS)
        assert [s > 0 for s in sent] == [r % replicas == 0 for r in range(prefill_agents)], sent
        deadline = time.monotonic() + 60
        while any(metric(api, "kvferry_rooms_held", "role") for api in pd.prefill.agent_apis()):
            assert time.monotonic() < deadline, "a prefill agent still holds rooms"
            time.sleep(0.5)
        # vLLM's own metrics count what the decode agents landed (its workers' stats, added up).
        landed = sum(metric(api, "kvferry_kv_bytes_total") for api in pd.decode.agent_apis())
        rooms = vllm_metric(pd.decode, "vllm:kvferry_room_bytes_count")
        assert vllm_metric(pd.decode, "vllm:kvferry_room_bytes_sum") == landed
        assert rooms == 10 * len(pairings) * decode_tp, rooms
        assert vllm_metric(pd.decode, "vllm:kvferry_room_seconds_count") == rooms
        # Written with vLLM's periodic stats (every 10 s).
        deadline = time.monotonic() + 60
        while "KV Transfer metrics: rooms=" not in pd.decode.log.read_text():
            assert time.monotonic() < deadline, "no KV Transfer metrics line in the decode's log"
            time.sleep(0.5)
    finally:
        pd.stop()
