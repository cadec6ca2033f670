"""Two prefill and two decode vLLM servers behind one ``kvferry proxy`` (2P2D), every server of
a role started with the same command (the run's fleet, ``vllm_fleet``): each prefill server is a
kvferry group of its own (derived from its vLLM engine id) and both decode servers register the
same ranks.

The kill test runs after every other test of the fleet. Prompts of 1 to 1000 tokens
from both prompt sets go 8 at once through the proxy in each of its three pairings: every output equals the
single engine's, the decode agents landed exactly the blocks the responses say they loaded, and
every server served some. Then one decode server's whole process group is killed with SIGKILL
while it streams answers (the proxy names the decode of each answer) and while rooms it asked
for are mid-transfer (the prefills' agents hold their chunks, a test-only switch): the answers
it had begun end with an error naming it; the requests whose rooms had not landed go to the
other decode with their rooms, which waited on the prefills, and return the reference's tokens
with no prompt computed twice (the prefills' prompt tokens); requests sent after the kill go to
the other decode, and every block the prefill servers lent to rooms comes back.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from vllm_servers import (
    FLEET_ROOM_TTL_MS,
    NEW_TOKENS,
    SEEDS,
    View,
    held_for,
    hold_chunks,
    instances_of,
    make_prompts,
    metric,
    run_prompts,
    vllm_metric,
)

IN_FLIGHT = 8
# Every pairing of the proxy.
PAIRINGS = [*SEEDS, "first-token"]


def all_prompts() -> list[list[int]]:
    """Both prompt sets, 28 prompts."""
    return [p for seed in SEEDS.values() for p in make_prompts(seed)]


def served(server) -> float:
    return vllm_metric(server, "vllm:request_success_total")


@pytest.fixture(scope="module")
def xpyd(vllm_fleet):
    """The fleet's four servers behind a proxy of each pairing (its lists: a prefill started
    again by another test is in them)."""
    cluster = View(vllm_fleet, vllm_fleet.prefills, vllm_fleet.decodes)
    cluster.via = {pairing: cluster.proxy(pairing) for pairing in PAIRINGS}
    yield cluster
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


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_every_server_serves_and_every_output_equals_a_single_engine(reference, xpyd, pairing):
    servers = xpyd.prefills + xpyd.decodes
    before = [served(s) for s in servers]
    run_prompts(xpyd, pairing, all_prompts(), reference, in_flight=IN_FLIGHT)
    counts = [served(s) - b for s, b in zip(servers, before)]
    print(f"{pairing}: requests served by prefill, prefill, decode, decode: {counts}")
    assert all(c > 0 for c in counts), counts
    assert sum(counts[2:]) == len(all_prompts()), counts


def stream(proxy, prompt: list[int], max_tokens: int, on_token=lambda server: None) -> tuple[list[int], str | None]:
    """A streamed completion through the proxy: its token ids, and the error's message (None
    when it ended with ``[DONE]``). ``on_token`` is called with the decode server that answers
    (the proxy names it) at each token."""
    body = {"model": proxy.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    req = urllib.request.Request(proxy.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    ids: list[int] = []
    try:
        r = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as e:
        return ids, json.loads(e.read())["error"]["message"]
    except TimeoutError as e:
        raise TimeoutError(f"a stream of a {len(prompt)}-token prompt: no answer within 300 s") from e
    with r:
        server = r.headers["x-kvferry-decode"]
        for line in stalled(r, f"a stream of a {len(prompt)}-token prompt from decode server {server}", lambda: len(ids)):
            line = line.decode().strip()
            if line == "data: [DONE]":
                return ids, None
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return ids, event["error"]["message"]
                for choice in event["choices"]:
                    ids += choice.get("token_ids") or []
                on_token(server)
    return ids, "the stream ended without [DONE]"


def stalled(lines, what: str, count):
    """``lines``, a timeout naming ``what`` and the tokens it gave so far (``count()``)."""
    try:
        yield from lines
    except TimeoutError as e:
        raise TimeoutError(f"{what}: nothing for 300 s after {count()} tokens") from e


def complete(proxy, prompt: list[int], max_tokens: int) -> tuple[list[int], str | None]:
    got = proxy.complete(prompt, max_tokens)
    if "choices" in got:
        return got["choices"][0]["token_ids"], None
    return [], got["error"]["error"]["message"]


@pytest.mark.last(0)
def test_a_decode_killed_while_answering_and_while_its_rooms_land(reference, xpyd):
    proxy = xpyd.via["concurrent"]
    victim, survivor = xpyd.decodes[1], xpyd.decodes[0]
    # The proxy names a decode server by its place in --decode, never by its address.
    place = f"{xpyd.decodes.index(victim) + 1}"
    prefill_apis = [api for p in xpyd.prefills for api in p.agent_apis()]
    counted = lambda name, label="model_name": sum(vllm_metric(p, name, label) for p in xpyd.prefills)  # noqa: E731
    prompt_tokens = counted("vllm:prompt_tokens_total")
    requeued = sum(metric(api, "kvferry_rooms_requeued_total") for api in prefill_apis)
    rerouted = metric(proxy.url, "kvferry_proxy_rerouted_total", 'role="decode"')
    victim_agents = instances_of(xpyd.bootstrap, victim)
    assert victim_agents, "the victim's agent is not registered"
    answering = threading.Event()

    def on_token(server: str) -> None:
        if server == place:
            answering.set()

    # Long streamed answers (short prompts, 600 tokens each): the victim dies while it answers
    # one of them.
    prompts = all_prompts()[:4]
    assert all(len(p) + 600 <= 1024 for p in prompts)
    later = all_prompts()[4:12]
    with concurrent.futures.ThreadPoolExecutor(len(prompts) + len(later)) as pool:
        futures = [pool.submit(stream, proxy, p, 600, on_token) for p in prompts]
        assert answering.wait(300), "the victim decode never answered"
        # From now on the prefills hold every chunk before it goes: the rooms of the requests
        # sent now stay mid-transfer, the victim's among them.
        for api in prefill_apis:
            hold_chunks(api, 1)
        try:
            futures += [pool.submit(stream, proxy, p, NEW_TOKENS, on_token) for p in later]
            # Until a prefill holds a chunk of a room the victim asked for.
            start = time.monotonic()
            while not any(held_for(api) & victim_agents for api in prefill_apis):
                assert time.monotonic() - start < 300, "no room of the victim was held mid-transfer"
                time.sleep(0.05)
            victim.kill()
            killed = time.monotonic()
            # The prefills put the rooms the victim had not received back to waiting (its
            # connection dropped; its heartbeats could not have ended it in the bound).
            while sum(metric(api, "kvferry_rooms_requeued_total") for api in prefill_apis) == requeued:
                assert time.monotonic() - killed < 60, "no room of the victim went back to waiting"
                time.sleep(0.05)
            requeued_in = time.monotonic() - killed
        finally:
            for api in prefill_apis:
                hold_chunks(api, 0)
        results = [f.result() for f in futures]
    sent = prompts + later
    failed = [(len(p), error) for p, (ids, error) in zip(sent, results) if error]
    moved = metric(proxy.url, "kvferry_proxy_rerouted_total", 'role="decode"') - rerouted
    print(f"rooms of the victim waiting again {requeued_in:.2f} s after the kill; {moved:.0f} requests "
          f"sent again to the survivor; {len(failed)} of {len(sent)} failed with the victim: {failed}")
    assert failed, "no request was answering on the victim when it died"
    assert moved >= 1, "no request went to the survivor with its room"
    for (ids, error), prompt in zip(results, sent):
        if error:
            # Only a stream the victim had begun fails, and the error says which server.
            assert prompt in prompts, (len(prompt), error)
            assert f"decode server {place} of {len(xpyd.decodes)}" in error, error
            assert victim.url not in error, error
        else:
            assert ids[:NEW_TOKENS] == reference[tuple(prompt)], f"{len(prompt)}-token prompt"
    # No prompt was computed twice: each request's prefill ran once.
    computed = counted("vllm:prompt_tokens_total") - prompt_tokens
    assert computed == sum(len(p) for p in sent), (computed, sum(len(p) for p in sent))
    # Requests sent now go to the surviving decode.
    again = all_prompts()[16:24]
    before = served(survivor)
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        after = list(pool.map(lambda p: complete(proxy, p, NEW_TOKENS), again))
    for (ids, error), prompt in zip(after, again):
        assert error is None and ids == reference[tuple(prompt)], error
    assert served(survivor) - before == len(again)
    # Every block the prefills lent to rooms comes back: the rooms the survivor took, and the
    # rest with their TTL.
    deadline = time.monotonic() + FLEET_ROOM_TTL_MS / 1000 + 60
    while any(vllm_metric(p, "vllm:kv_cache_usage_perc") > 0 for p in xpyd.prefills):
        assert time.monotonic() < deadline, [vllm_metric(p, "vllm:kv_cache_usage_perc") for p in xpyd.prefills]
        time.sleep(0.2)
    expired = sum(metric(api, "kvferry_rooms_expired_total") for api in prefill_apis)
    print(f"every prefill block was back {time.monotonic() - killed:.2f} s after the kill "
          f"({expired:.0f} prefill rooms expired)")
