"""Two prefill and two decode vLLM servers behind one ``kvferry proxy`` (2P2D), every server of
a role started with the same command: each prefill server is a kvferry group of its own (derived
from its vLLM engine id) and both decode servers register the same ranks.

The servers are shared by the module's tests. Prompts of 1 to 1000 tokens from both prompt sets
go 8 at once through the proxy in sequential pairing: every output equals the single engine's,
the decode agents landed exactly the blocks the responses say they loaded, and every server
served some.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from vllm_servers import (  # noqa: F401 - vllm, reference: fixtures
    SEEDS,
    Pd,
    make_prompts,
    reference,
    run_prompts,
    vllm,
    vllm_metric,
)

IN_FLIGHT = 8
# Four engines on two cores: an agent's thread can wait seconds to run. Only a closed
# connection may end a peer or a Hello here; the defaults (5 s) assume engines that do not
# share their cores.
AGENT = dict(peer_dead_ms=60_000, timeout_connect_ms=60_000)


def all_prompts() -> list[list[int]]:
    """Both prompt sets, 28 prompts."""
    return [p for seed in SEEDS.values() for p in make_prompts(seed)]


def served(server) -> float:
    return vllm_metric(server, "vllm:request_success_total")


@pytest.fixture(scope="module")
def xpyd(vllm, kvferry_bin, tmp_path_factory):
    cluster = Pd(vllm, kvferry_bin, tmp_path_factory.mktemp("xpyd"), prefills=2, decodes=2, **AGENT)
    try:
        cluster.via = {"sequential": cluster.proxy("sequential")}
        yield cluster
    finally:
        cluster.stop()


def test_prefill_servers_with_one_config_are_groups_of_their_own(xpyd):
    groups = [s.kvferry_group() for s in xpyd.prefills]
    assert groups[0] != groups[1], groups
    with urllib.request.urlopen(xpyd.bootstrap + "/v1/ranks", timeout=10) as r:
        ranks = json.loads(r.read())["ranks"]
    prefill = sorted(r["dp_rank"] for r in ranks if r["role"] == "prefill")
    decode = [(r["dp_rank"], r["tp_rank"], r["pp_rank"]) for r in ranks if r["role"] == "decode"]
    assert prefill == sorted(groups), ranks
    assert decode == [(0, 0, 0), (0, 0, 0)], ranks


def test_every_server_serves_and_every_output_equals_a_single_engine(reference, xpyd):
    pairing = "sequential"
    servers = xpyd.prefills + xpyd.decodes
    before = [served(s) for s in servers]
    run_prompts(xpyd, pairing, all_prompts(), reference, in_flight=IN_FLIGHT)
    counts = [served(s) - b for s, b in zip(servers, before)]
    print(f"{pairing}: requests served by prefill, prefill, decode, decode: {counts}")
    assert all(c > 0 for c in counts), counts
    assert sum(counts[2:]) == len(all_prompts()), counts
