"""Tensor and data parallelism through vLLM, each shape behind ``kvferry proxy``: a TP1 prefill
server with a TP2 decode server, a prefill server of two vLLM data-parallel ranks of TP2 each
with a TP1 decode (these two in all three pairings), and a TP4 prefill with a TP1 decode (concurrent
pairing). The TP1 servers are the run's fleet's (``vllm_fleet``), the TP2 decode is the fleet's
fifth server (``fleet_recompute_decode``), and each multi-rank prefill joins the fleet for its
shape (``fleet_prefill``).

A decode server of two vLLM data-parallel ranks (``fleet_dp_decode``) takes a TP1 prefill's rooms
in the concurrent and first-token pairings: vLLM gives each request to one of its ranks, whose
agent asks for the room, and both ranks land some.

The tiny model has 2 KV heads. A TP2 server's two workers each run an agent for one head, and
the TP1 side's agent pairs with both. At TP4 vLLM holds each head on two ranks, and each sends
half of its layers. A DP2 server's two engines are a kvferry group each; the proxy learns both
and sends each request's prefill to one of them in turn (``X-data-parallel-rank``), whose two
TP ranks each send their head.

Ten prompts of mixed lengths, 4 at once, give a single vLLM's tokens; the decode agents land
exactly the blocks the answers say they loaded, every prefill agent sent some, and every room
ends on every prefill agent. The decode agents listen on a base API port plus their TP rank,
and vLLM's own metrics and log line count their rooms and bytes.

A server of several ranks binds a core per rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``, and
``"0|1|0|1"`` for four ranks), so every core holds a rank of each server here.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest

from vllm_servers import (
    SEEDS,
    View,
    make_prompts,
    metric,
    reset_prefix_cache,
    run_prompts,
    unfinished_rooms,
    vllm_metric,
)

SHAPES = {
    "tp1-to-tp2": dict(decode_tp=2),
    # Two DP ranks of two TP ranks each: two groups, each rank sending one head.
    "dp2xtp2-to-tp1": dict(prefill_tp=2, prefill_dp=2),
    # More TP ranks than the model's 2 KV heads: vLLM holds each head on two ranks.
    "tp4-to-tp1": dict(prefill_tp=4),
    # A decode server of two DP ranks: vLLM gives each request to one of them, whose agent asks
    # the prefill for its room.
    "tp1-to-dp2": dict(decode_dp=2),
}
# The shapes whose prefill server joins the fleet for them (``fleet_prefill``).
PREFILL_SHAPES = ["dp2xtp2-to-tp1", "tp4-to-tp1"]
# The pairings a shape runs: replication changes what each prefill rank sends, not how a
# decode pairs with them (the other shapes run all three).
PAIRINGS = {"tp4-to-tp1": ["concurrent"], "tp1-to-dp2": ["concurrent", "first-token"]}
# The prompt set of each pairing (first-token pairing's runs on a cold prefix cache again).
PROMPT_SETS = {"sequential": "sequential", "concurrent": "concurrent", "first-token": "sequential"}


# Run in the vLLM venv: kvferry.vllm imports vLLM.
GROUPS_OF_DP_RANKS = """
import json
from kvferry.vllm.params import ConnectorConfig
configs = [ConnectorConfig.of({"bootstrap": "http://r"}, f"4f1c_dp{rank}", rank) for rank in (0, 1)]
again = ConnectorConfig.of({"bootstrap": "http://r"}, "4f1c_dp1", 1)
print(json.dumps({"identities": [c.identity() for c in configs], "again": again.identity()}))
# kv_connector_extra_config: agent options in either spelling, a config file, an unknown option
# refused naming the valid ones, the registry from KVFERRY_BOOTSTRAP.
import os
said = {}
c = ConnectorConfig.of({"bootstrap": "http://r:1", "agent": {"api-port": 7000, "room_ttl_ms": 5}, "config": "/k.toml"}, "e")
said["agent"], said["config"] = c.agent, c.config
try:
    ConnectorConfig.of({"bootstrap": "http://r:1", "agent": {"api-prot": 1}}, "e")
except Exception as e:
    said["unknown"] = str(e)
os.environ["KVFERRY_BOOTSTRAP"] = "http://env:2"
said["bootstrap"] = ConnectorConfig.of({}, "e").bootstrap
print(json.dumps(said))
"""


@pytest.fixture(scope="module")
def connector_configs(torch_python) -> list[dict]:
    """What GROUPS_OF_DP_RANKS prints, run once in the vLLM venv."""
    python, env = torch_python
    env = {k: v for k, v in env.items() if not k.startswith("KVFERRY_")}
    run = subprocess.run([python, "-c", GROUPS_OF_DP_RANKS], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.strip().splitlines()[-2:]]


def test_each_data_parallel_rank_of_a_prefill_server_is_a_group_that_names_its_rank(connector_configs):
    """vLLM gives each DP rank an engine id of its own (``<id>_dp<rank>``) and keeps the rank in
    its parallel config: the connector derives a group from the one and reports the other."""
    said = connector_configs[0]
    first, second = said["identities"]
    assert first["kvferry_dp_rank"] != second["kvferry_dp_rank"], said
    assert [first["kvferry_engine_dp_rank"], second["kvferry_engine_dp_rank"]] == [0, 1], said
    assert said["again"] == second, "the same engine id gives the same group"


def test_extra_config_takes_every_agent_option_in_either_spelling_and_a_config_file(connector_configs):
    said = connector_configs[1]
    assert said["agent"] == {"api_port": 7000, "room_ttl_ms": 5} and said["config"] == "/k.toml", said
    assert "unknown agent option `api_prot` (no --api-prot flag)" in said["unknown"], said
    assert "api_port" in said["unknown"].partition("valid options:")[2], said
    assert said["bootstrap"] == "http://env:2", said


def test_outputs_equal_a_single_engine_from_a_tp1_prefill_to_a_tp2_decode(vllm_fleet, fleet_recompute_decode, reference):
    # Pinned ports are offset per worker (kvferry.engine_options): the base data port plus the
    # TP rank, as the API port (check_shape).
    with urllib.request.urlopen(vllm_fleet.bootstrap + "/v1/ranks", timeout=10) as r:
        ranks = [r for r in json.loads(r.read())["ranks"] if r.get("server") == fleet_recompute_decode.url]
    ports = {r["tp_rank"]: int(r["data_endpoints"]["zmq-tcp"].rsplit(":", 1)[1]) for r in ranks}
    assert ports == {0: fleet_recompute_decode.data_port, 1: fleet_recompute_decode.data_port + 1}, ranks
    # Each worker's agent serves its metrics port at the base plus its TP rank: live, ready
    # (registered), and its metrics name the build.
    for worker in (0, 1):
        base = f"http://127.0.0.1:{fleet_recompute_decode.metrics_port + worker}"
        for path, body in (("/livez", "ok"), ("/readyz", "ready")):
            with urllib.request.urlopen(base + path, timeout=10) as r:
                assert (r.status, r.read().decode().strip()) == (200, body), (worker, path)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert any(line.startswith("kvferry_build_info{") for line in text.splitlines()), text
        assert 'kvferry_pool_pages{role="decode",state="free"}' in text, text
    reset_prefix_cache(fleet_recompute_decode)
    view = View(vllm_fleet, vllm_fleet.prefills[:1], [fleet_recompute_decode])
    try:
        check_shape(view, fleet_recompute_decode.api_port, "tp1-to-tp2", reference)
    finally:
        view.stop()


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_outputs_equal_a_single_engine_from_multi_rank_prefills_to_a_tp1_decode(vllm_fleet, fleet_prefill, reference, shape):
    ranks = SHAPES[shape]
    prefill = fleet_prefill.shape(ranks.get("prefill_tp", 1), ranks.get("prefill_dp", 1))
    decode = vllm_fleet.decodes[0]
    # Each shape starts with the decode's prefix cache cold, so that every room moves.
    reset_prefix_cache(decode)
    view = View(vllm_fleet, [prefill], [decode])
    try:
        check_shape(view, decode.api_port, shape, reference)
    finally:
        view.stop()


def test_outputs_equal_a_single_engine_from_a_tp1_prefill_to_a_decode_of_two_dp_ranks(vllm_fleet, fleet_dp_decode, reference):
    view = View(vllm_fleet, vllm_fleet.prefills[:1], [fleet_dp_decode])
    try:
        check_shape(view, fleet_dp_decode.api_port, "tp1-to-dp2", reference)
    finally:
        view.stop()


def check_shape(pd: View, api_port: int, shape: str, reference: dict) -> None:
    ranks = SHAPES[shape]
    decode_tp, decode_dp = ranks.get("decode_tp", 1), ranks.get("decode_dp", 1)
    prefill_agents = ranks.get("prefill_tp", 1) * ranks.get("prefill_dp", 1)
    assert [len(pd.prefill.agent_apis()), len(pd.decode.agent_apis())] == [prefill_agents, decode_tp * decode_dp]
    # Every rank on its own port from the first (the ranks register in any order).
    assert sorted(pd.decode.agent_apis()) == [f"http://127.0.0.1:{api_port + r}" for r in range(decode_tp * decode_dp)]
    # The decode server may have served other shapes: what this one adds is counted.
    counted = ("vllm:kvferry_room_bytes_count", "vllm:kvferry_room_bytes_sum", "vllm:kvferry_room_seconds_count")
    before = [vllm_metric(pd.decode, name) for name in counted]
    landed_before = sum(metric(api, "kvferry_kv_bytes_total") for api in pd.decode.agent_apis())
    log_from = len(pd.decode.log.read_text())
    pairings = PAIRINGS.get(shape, list(PROMPT_SETS))
    pd.via = {pairing: pd.proxy(pairing) for pairing in pairings}
    for pairing in pairings:
        if pairing == "first-token":
            reset_prefix_cache(pd.decode)
        run_prompts(pd, pairing, make_prompts(SEEDS[PROMPT_SETS[pairing]])[:10], reference, in_flight=4)
    sent = [metric(api, "kvferry_kv_bytes_total") for api in pd.prefill.agent_apis()]
    print(f"{shape}: bytes sent by each prefill agent {sent}")
    # Every prefill agent sends: ranks holding the same head send half its layers each.
    assert all(s > 0 for s in sent), sent
    # Every room ended on every prefill agent (a final room keeps no pages; the agent
    # forgets it after its TTL).
    deadline = time.monotonic() + 60
    while any(unfinished_rooms(api) for api in pd.prefill.agent_apis()):
        assert time.monotonic() < deadline, "a prefill agent still has a room that has not ended"
        time.sleep(0.5)
    # vLLM's own metrics count what the decode agents landed (its workers' stats, added up).
    landed = sum(metric(api, "kvferry_kv_bytes_total") for api in pd.decode.agent_apis()) - landed_before
    # Every decode rank landed rooms (vLLM gives a DP server's requests to each of its ranks).
    by_rank = [metric(api, "kvferry_kv_bytes_total") for api in pd.decode.agent_apis()]
    print(f"{shape}: bytes landed by each decode agent {by_rank}")
    assert all(b > 0 for b in by_rank), by_rank
    rooms, room_bytes, timed = (vllm_metric(pd.decode, name) - b for name, b in zip(counted, before))
    assert room_bytes == landed
    assert rooms == 10 * len(pairings) * decode_tp, rooms
    assert timed == rooms
    # Written with vLLM's periodic stats (every 10 s).
    deadline = time.monotonic() + 60
    while "KV Transfer metrics: rooms=" not in pd.decode.log.read_text()[log_from:]:
        assert time.monotonic() < deadline, "no KV Transfer metrics line in the decode's log"
        time.sleep(0.5)
