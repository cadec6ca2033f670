"""Disaggregated generation with real vLLM servers and ``KvferryConnector``, token-identical to a
single engine.

A plain vLLM server answers every prompt first (the reference) and stops. Then a prefill server
(``kv_producer``) and a decode server (``kv_consumer``) of the run's fleet (``vllm_fleet``),
each pinned to its own core, with prefix caching on (the decode's emptied first): 14 prompts of
1 to 1000 tokens (most not multiples of the 128-token block; four are prefixes of one another),
4 in flight, greedy, 16 new tokens each, and chat conversations streamed and not. The prefill
computes at most 320 tokens a step: prompts of up to 300 tokens in one step, longer ones in
chunks (chunked prefill), one ending inside a block. Requests go
through ``kvferry proxy``, in both pairings: sequential (the prefill's response carries
``kv_transfer_params``, copied into the decode request) and concurrent (the proxy names the room
and the prefill's group in both requests up front). Every generated token id equals the
reference's, and the decode agent landed exactly the prompt blocks each response says it
loaded: a silent local recompute cannot pass.

A server of ``kv_role`` ``kv_both`` (NixlConnector's convention: one configuration for every
server) runs a prefill and a decode agent per worker and takes each request's role from its
``kv_transfer_params``: behind the proxy as both the prefill and the decode of its own requests
(prefix caching off, so that every room moves), it answers as a single engine does, its decode
agent lands what its prefill agent sent, and a request without params computes locally.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

import pytest

from documented_metrics import assert_as_documented

from vllm_servers import (
    LENGTHS,
    NEW_TOKENS,
    SEEDS,
    View,
    make_chats,
    make_prompts,
    metric,
    reset_prefix_cache,
    run_prompts,
)


@pytest.fixture(scope="module")
def pd(vllm_fleet):
    """The fleet's first prefill and first decode behind proxies of their own, the decode's
    prefix cache empty (the fleet served other tests)."""
    reset_prefix_cache(vllm_fleet.decode)
    pair = View(vllm_fleet, vllm_fleet.prefills[:1], vllm_fleet.decodes[:1])
    pair.via = {pairing: pair.proxy(pairing) for pairing in SEEDS}
    yield pair
    pair.stop()


@pytest.mark.parametrize("pairing", list(SEEDS))
def test_disaggregated_generation_equals_a_single_engine(reference, pd, pairing):
    run_prompts(pd, pairing, make_prompts(SEEDS[pairing]), reference)
    # Every layer of every room was announced as vLLM saved it, during the forward pass.
    assert "did not save layers" not in (pd.logs / "prefill.log").read_text()
    answered = metric(pd.via[pairing].url, "kvferry_proxy_requests_total", 'outcome="answered"')
    assert answered >= len(LENGTHS), answered


@pytest.mark.parametrize("pairing", list(SEEDS))
def test_chat_streamed_and_not_equals_a_single_engine(reference, pd, pairing):
    proxy = pd.via[pairing]
    first_tokens = metric(proxy.url, "kvferry_proxy_time_to_first_token_seconds_count")
    landed = metric(proxy.url, "kvferry_proxy_kv_total", 'outcome="landed"')
    for i, messages in enumerate(make_chats()):
        got = proxy.chat(messages, 16)
        assert "choices" in got, got
        assert got["choices"][0]["message"]["content"] == reference[("chat", i)], f"chat {i}"
        # Where the KV came from: the header of a whole answer, a comment in a stream.
        assert got["x-kvferry-kv"] == got["kv_transfer_params"]["kvferry_kv"] == "landed", got
        assert proxy.stream_chat(messages, 16) == (reference[("chat", i)], "landed"), f"chat {i} streamed"
    assert metric(proxy.url, "kvferry_proxy_time_to_first_token_seconds_count") - first_tokens == len(make_chats())
    # Counted once each, streamed or not (a stream's before its comment goes).
    assert metric(proxy.url, "kvferry_proxy_kv_total", 'outcome="landed"') - landed == 2 * len(make_chats())


def test_blocks_in_the_decode_prefix_cache_are_not_transferred(reference, pd):
    # The same prompts again: the decode holds their full blocks in its prefix cache now, so
    # only the blocks after them move (and a prompt of whole blocks still moves its last one:
    # vLLM recomputes the last prompt token, so its block is never a local hit).
    starts = run_prompts(pd, "sequential", make_prompts(SEEDS["sequential"]), reference)
    assert sum(s > 0 for s in starts) >= len(starts) // 2, starts


def test_a_client_abort_while_loading_aborts_the_room(reference, pd):
    # A decode request whose prefill never comes: it waits on its room until its client goes
    # away. vLLM aborts the request, the connector aborts the room, and vLLM frees the blocks
    # once the agent reports the room settled; the pair then serves as before.
    aborted = 'state="aborted"'
    before = metric(pd.decode_api, "kvferry_rooms_total", aborted)
    prompt = make_prompts(SEEDS["concurrent"])[5]
    room = str(int.from_bytes(os.urandom(8), "little"))
    body = {"model": pd.decode.model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True, "kvferry_room": room, "kvferry_dp_rank": pd.prefill.kvferry_group()}}
    req = urllib.request.Request(pd.decode.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(OSError):  # the client gives up and closes its connection
        urllib.request.urlopen(req, timeout=3)
    deadline = time.monotonic() + 60
    while metric(pd.decode_api, "kvferry_rooms_total", aborted) == before:
        assert time.monotonic() < deadline, "the decode's room was never aborted"
        time.sleep(0.05)
    got = pd.via["sequential"].complete(prompt, 16)
    assert got["choices"][0]["token_ids"] == reference[tuple(prompt)]


def test_a_prefill_server_says_which_kvferry_group_it_is(pd):
    got = pd.prefill.complete([5, 6, 7], 1, {"kvferry_identify": True})
    params = got["kv_transfer_params"]
    # One vLLM data-parallel rank: rank 0.
    assert params == {"kvferry_dp_rank": params["kvferry_dp_rank"], "kvferry_bootstrap": pd.bootstrap,
                      "kvferry_engine_dp_rank": 0}
    # The group is the one the prefill's agent registered (derived from vLLM's engine id).
    with urllib.request.urlopen(pd.bootstrap + "/v1/ranks", timeout=10) as r:
        ranks = json.loads(r.read())
    prefill = [r for r in ranks["ranks"] if r["role"] == "prefill"]
    assert params["kvferry_dp_rank"] in [r["dp_rank"] for r in prefill], ranks


def test_the_kvferry_metrics_vllm_exposes_are_those_docs_metrics_md_lists(pd):
    """The ``vllm:kvferry_`` families of the decode's and the prefill's /metrics are the rows of
    docs/metrics.md's metrics table that vLLM exposes (documented_metrics.py)."""
    for server in (pd.decode, pd.prefill):
        assert_as_documented(server.url, "vLLM", "vllm:kvferry_")


def test_a_decode_request_naming_an_untrusted_registry_sends_it_nothing(pd, recording_registry):
    """``kvferry_bootstrap`` comes from the client: a decode request sent straight to the decode
    server (no proxy) naming a registry its agent does not trust never reaches it, nor the
    prefill it would list. The hold and the room are refused at once (Forbidden), the request
    fails (vLLM's default ``kv_load_failure_policy`` ``fail``), and ``kvferry_reason_of`` names
    the registry."""
    fake = recording_registry
    prompt = make_prompts(SEEDS["concurrent"])[3]
    room = str(int.from_bytes(os.urandom(8), "little"))
    params = {"do_remote_prefill": True, "kvferry_room": room, "kvferry_dp_rank": 0, "kvferry_bootstrap": fake.url,
              "kvferry_tokens": len(prompt)}
    start = time.monotonic()
    got = pd.decode.complete(prompt, 4, params)
    took = time.monotonic() - start
    reason = pd.decode.complete([5, 6, 7], 1, {"kvferry_reason_of": room})["kv_transfer_params"]["kvferry_reason"]
    print(f"answered in {took:.2f} s: {str(got)[:300]}; reason: {reason}")
    assert reason and f'registry "{fake.url}" is not trusted' in reason, reason
    assert "choices" not in got and got.get("http_status", 0) >= 400, got
    assert took < 60
    assert not fake.received(), fake.record()


class Role:
    """One role of a ``kv_both`` server as a proxy and ``run_prompts`` see a server: its URL
    and its agents of that role (the connector logs each with its role when it starts)."""

    def __init__(self, server, role: str) -> None:
        self.server, self.role = server, role
        self.url, self.model, self.log = server.url, server.model, server.log

    def agent_apis(self) -> list[str]:
        text = self.log.read_text()
        text = text[text.rfind("non-default args"):]
        return sorted(re.findall(rf"kvferry {self.role} agent \S+ on \S+: .* api (http://\S+)", text))


def test_a_kv_both_server_is_the_prefill_or_the_decode_of_a_request_by_its_params(reference, vllm_fleet, fleet_both):
    prefill, decode = Role(fleet_both, "prefill"), Role(fleet_both, "decode")
    # One worker, two agents: the prefill agent on the base API port, the decode agent on the next.
    assert prefill.agent_apis() == [f"http://127.0.0.1:{fleet_both.api_port}"], prefill.agent_apis()
    assert decode.agent_apis() == [f"http://127.0.0.1:{fleet_both.api_port + 1}"], decode.agent_apis()
    sent_before = metric(prefill.agent_apis()[0], "kvferry_kv_bytes_total")
    view = View(vllm_fleet, [prefill], [decode])
    try:
        view.via = {pairing: view.proxy(pairing) for pairing in SEEDS}
        for pairing, seed in SEEDS.items():
            run_prompts(view, pairing, make_prompts(seed)[:6], reference)
    finally:
        view.stop()
    # What the decode agent landed (run_prompts: exactly the rooms' blocks), the prefill agent sent.
    assert metric(prefill.agent_apis()[0], "kvferry_kv_bytes_total") > sent_before
    # Without kv_transfer_params a request is the server's alone: no room, no transfer.
    prompt = make_prompts(SEEDS["sequential"])[0]
    landed = metric(decode.agent_apis()[0], "kvferry_kv_bytes_total")
    got = fleet_both.complete(prompt, NEW_TOKENS)
    assert got["choices"][0]["token_ids"] == reference[tuple(prompt)]
    assert got.get("kv_transfer_params") is None, got
    assert metric(decode.agent_apis()[0], "kvferry_kv_bytes_total") == landed


def test_a_kv_both_server_pairs_with_servers_of_one_role(reference, vllm_fleet, fleet_both):
    """kv_both beside the fleet's kv_producer and kv_consumer servers, as deployments mix them:
    its prefill role feeds the fleet's decode, the fleet's prefill feeds its decode role; both
    answer as a single engine does, each decode landing exactly the blocks it loaded."""
    reset_prefix_cache(vllm_fleet.decode)
    mixes = {"kv_both prefill to a kv_consumer": ([Role(fleet_both, "prefill")], vllm_fleet.decodes[:1]),
             "a kv_producer to kv_both decode": (vllm_fleet.prefills[:1], [Role(fleet_both, "decode")])}
    for name, (prefills, decodes) in mixes.items():
        view = View(vllm_fleet, prefills, decodes)
        try:
            view.via = {pairing: view.proxy(pairing) for pairing in SEEDS}
            for pairing, seed in SEEDS.items():
                run_prompts(view, pairing, make_prompts(seed)[6:10], reference)
        finally:
            view.stop()
        print(f"{name}: token-identical in both pairings")
