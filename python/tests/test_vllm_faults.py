"""Real vLLM servers with ``KvferryConnector`` when a server dies mid-batch (kill -9 of its whole
process group: API server, engine core, worker).

- The prefill dies while two decodes wait for their rooms (asked at the prefill's agent, not yet
  announced by its engine). With ``kv_load_failure_policy`` ``recompute`` every request still
  returns the reference's tokens (the decode computes the prompt itself); with ``fail`` the
  affected requests end with an error, and the decode's log and its answer to
  ``kvferry_reason_of`` name kvferry's reason. ``kvferry proxy`` in front of the pair stops
  routing to the dead prefill (its /health says so) and, once the prefill is back on its URL,
  serves new requests through it.
- The decode dies after it asked for rooms the prefill has not computed yet: the rooms wait for
  another decode for ``--requeue-ms``, then fail (``peer_dead``, not their TTL), and the
  prefill's delayed blocks come back.
- Negative control: KV corrupted in flight (checksums off) changes the generated tokens.
- A request that waits in the decode's queue past the prefill's room TTL, or in the prefill's
  queue past both sides' ready timeout: the agents hold the room meanwhile, and it lands.
- A decode whose prompt differs from the prefill's by one token: the prefill refuses the room
  (``prompt_mismatch``, by the prompts' digests), and the decode recomputes or fails by its
  policy, never landing the other prompt's KV.

The servers are the run's fleet's (``vllm_fleet``: a decode of each policy, the one of
``recompute`` at TP2), whose agents run with ``--peer-dead-ms 60000``: only a closed connection
can end a peer within the tests' bounds, the tests check the rooms' reasons (a room's TTL, 60 s,
is not one of them), and print how long it took; the negative control arms a fault in the
prefill's agent while it runs, and the queue tests shorten the first prefill's and decode's
timeouts while they run (both by a test-only switch of the agents' engine API).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from vllm_servers import (
    SEEDS,
    MAX_NUM_SEQS,
    Pd,
    View,
    arm_corrupt_chunk,
    make_prompts,
    metric,
    reset_prefix_cache,
    set_timeouts,
    vllm_metric,
)


def wait_asked(agent_api: str, rooms: list[int], timeout: float = 120) -> None:
    """Until the prefill agent's view of every room lists a decode's transfer."""
    deadline = time.monotonic() + timeout
    pending = set(rooms)
    while pending and time.monotonic() < deadline:
        for room in list(pending):
            try:
                with urllib.request.urlopen(f"{agent_api}/v1/rooms/{room}", timeout=10) as r:
                    if json.loads(r.read())["transfers"]:
                        pending.discard(room)
            except urllib.error.HTTPError as e:
                assert e.code == 404, e
        time.sleep(0.01)
    assert not pending, f"the decode never asked for rooms {pending}"


def log_tail(path, containing: str = "", lines: int = 20) -> str:
    """The last lines of a log (those containing ``containing``, Python's warnings left out), for
    an assertion's message."""
    kept = [line for line in path.read_text(errors="replace").splitlines()
            if containing in line and "site-packages" not in line]
    return f"{path.name}:\n" + "\n".join(kept[-lines:])


def timed_get(url: str) -> tuple[str, str]:
    """How a GET of ``url`` went ("200 in 0.01 s", or the error and when) and its body."""
    start = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return f"{r.status} in {time.monotonic() - start:.2f} s", r.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - a diagnostic names whatever happened
        return f"{e!r} after {time.monotonic() - start:.2f} s", ""


def diagnose(pd: Pd, logs) -> str:
    """Who answers now (the registry, both agents' APIs, timed from the test), the registry's
    lookup counters and the logs' last kvferry lines: printed before a failed assertion, so the
    captured output shows them whole."""
    out = []
    for name, url in (("registry", pd.bootstrap + "/healthz"), ("decode agent", pd.decode_api + "/healthz"),
                      ("prefill agent", pd.prefill_api + "/healthz")):
        out.append(f"{name} {url}: {timed_get(url)[0]}")
    metrics = timed_get(pd.bootstrap + "/metrics")[1]
    out += [line for line in metrics.splitlines() if line.startswith(("kvferry_bootstrap_lookups", "kvferry_bootstrap_ranks"))]
    out.append(log_tail(logs / "registry.log", lines=8))
    out.append(log_tail(logs / "decode.log", "kvferry", lines=8))
    out.append(log_tail(logs / "prefill.log", "kvferry", lines=8))
    return "\n".join(out)


def long_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 2048, 900 + 17 * i).tolist() for i in range(n)]


def decodes_by_policy(fleet: Pd, recompute_decode) -> dict:
    """The fleet's decode of each kv_load_failure_policy."""
    return {"recompute": recompute_decode, "fail": fleet.decodes[0]}


@pytest.fixture(scope="module", params=["recompute", "fail"])
def policy_pd(vllm_fleet, fleet_recompute_decode, request):
    """The fleet's first prefill and its decode whose kv_load_failure_policy is the parameter."""
    pd = View(vllm_fleet, vllm_fleet.prefills[:1], [decodes_by_policy(vllm_fleet, fleet_recompute_decode)[request.param]])
    yield request.param, pd
    pd.stop()


def reasons_logged(log: str) -> list[str]:
    """The failure codes of the rooms the decode's log says failed."""
    return sorted(set(re.findall(r"kvferry: request \S+ room \d+ failed: (\w+):", log)))


@pytest.mark.parametrize("flow", ["concurrent", "continues"])
def test_a_decode_whose_prompt_differs_from_the_prefills_never_takes_its_kv(policy_pd, reference, flow):
    """The two requests paired by hand: the decode's prompt differs from the prefill's in one
    early token (so the prefill's KV would be wrong for it from there on). ``concurrent``: both
    at once, the router naming the room; ``continues``: first-token pairing's, the prefill
    first, and the decode continuing from its prompt plus the prefill's token
    (``kvferry_continues``: the room is its prompt but the last token). The prefill refuses the
    room (``prompt_mismatch``): with ``recompute`` the decode answers what a single engine
    answers for its own prompt, with ``fail`` an error, never the other prompt's KV."""
    policy, pd = policy_pd
    log_start = len(pd.decode.log.read_text())
    prompt = make_prompts(SEEDS["concurrent"])[7]  # 300 tokens
    other = list(prompt)
    other[5] = 3 + (other[5] - 2) % 2045
    room = int.from_bytes(os.urandom(8), "little")
    to_prefill = {"do_remote_decode": True, "kvferry_room": str(room)}
    if flow == "concurrent":
        to_decode = {"do_remote_prefill": True, "kvferry_room": str(room), "kvferry_dp_rank": pd.prefill.kvferry_group()}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            prefilled = pool.submit(pd.prefill.complete, prompt, 1, to_prefill)
            decoded = pool.submit(pd.decode.complete, other, 16, to_decode)
            assert "choices" in prefilled.result(), prefilled.result()
            got = decoded.result()
    else:
        prefilled = pd.prefill.complete(prompt, 1, to_prefill)
        assert "choices" in prefilled, prefilled
        other.append(prefilled["choices"][0]["token_ids"][0])
        got = pd.decode.complete(other, 15, prefilled["kv_transfer_params"] | {"kvferry_continues": True})
    # A single engine's answer for the decode's prompt (the prefill server computes it alone).
    asked = 16 - (len(other) - len(prompt))
    single = pd.prefill.complete(other, asked)["choices"][0]["token_ids"]
    assert single != reference[tuple(prompt)][-asked:], "the two prompts must continue differently"
    asked = pd.decode.complete([5, 6, 7], 1, {"kvferry_reason_of": str(room)})["kv_transfer_params"]
    reason = asked["kvferry_reason"]
    print(f"{policy}, {flow}: the decode's room failed with {reason!r}")
    assert asked["kvferry_kv"] == {"recompute": "recomputed", "fail": "failed"}[policy], asked
    assert re.match(rf"prompt_mismatch: prefill \S+: room {room}: the decode's prompt \(digest \w+\) is not the one", reason), reason
    assert reasons_logged(pd.decode.log.read_text()[log_start:]) == ["prompt_mismatch"]
    if policy == "recompute":
        assert got["choices"][0]["token_ids"] == single, got
        # The answer says its KV was computed, and why.
        assert (got["kv_transfer_params"]["kvferry_kv"], got["kv_transfer_params"]["kvferry_reason"]) == ("recomputed", reason)
    else:
        assert got["http_status"] == 500, got


def test_a_prefill_killed_while_the_decodes_wait(vllm_fleet, fleet_recompute_decode, reference):
    """Each decode (one of each policy) waits on four rooms at the fleet's first prefill, which
    is killed, and comes back on its URL."""
    decodes = decodes_by_policy(vllm_fleet, fleet_recompute_decode)
    pd = View(vllm_fleet, vllm_fleet.prefills[:1], [vllm_fleet.decodes[0]])
    log_start = {policy: len(d.log.read_text()) for policy, d in decodes.items()}
    # vLLM's count of each decode's failed rooms, by code (every code there from the start).
    codes = ("peer_dead", "unreachable")
    failed_rooms = lambda d: {c: vllm_metric(d, "vllm:kvferry_failed_rooms_total", f'code="{c}"') for c in codes}  # noqa: E731
    failed_before = {policy: failed_rooms(d) for policy, d in decodes.items()}
    with urllib.request.urlopen(decodes["recompute"].url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    assert re.search(r'vllm:kvferry_failed_rooms_total\{[^}]*code="checksum"[^}]*\} 0', text), "not every code is exposed"
    proxy = pd.proxy("concurrent")
    prompts = make_prompts(SEEDS["concurrent"])[-4:]  # 640..1000 tokens
    group = pd.prefill.kvferry_group()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        decoded, rooms = {}, {policy: [] for policy in decodes}
        for policy, decode in decodes.items():
            for prompt in prompts:
                room = int.from_bytes(os.urandom(8), "little")
                rooms[policy].append(room)
                params = {"do_remote_prefill": True, "kvferry_room": str(room), "kvferry_dp_rank": group}
                decoded[pool.submit(decode.complete, prompt, 16, params)] = (policy, prompt)
        # The decodes wait on every room at the prefill's agent; the prefill engine has not
        # announced any (its requests never come), so none can land before the kill.
        wait_asked(pd.prefill_api, [room for asked in rooms.values() for room in asked])
        pd.prefill.kill()
        killed = time.monotonic()
        results = []
        for f in concurrent.futures.as_completed(decoded):
            results.append((*decoded[f], f.result(), time.monotonic() - killed))
    slowest = max(t for *_, t in results)
    print(f"every decode request answered {slowest:.2f} s after the prefill was killed")
    assert slowest < 60
    for policy, decode in decodes.items():
        mine = [(prompt, r) for p, prompt, r, _ in results if p == policy]
        errors = [r for _, r in mine if "choices" not in r]
        for prompt, r in mine:
            if "choices" in r:
                assert r["choices"][0]["token_ids"] == reference[tuple(prompt)], f"{policy}: {len(prompt)}-token prompt"
        reasons = reasons_logged(decode.log.read_text()[log_start[policy]:])
        print(f"{policy}: {len(errors)} of {len(mine)} requests ended with an error; kvferry's reasons {reasons}")
        assert reasons and set(reasons) <= {"peer_dead", "unreachable"}, reasons
        # The decode server answers why each room failed (vLLM's own error says only
        # "Internal server error"); kvferry proxy adds this to its error messages.
        for room in rooms[policy]:
            asked = decode.complete([5, 6, 7], 1, {"kvferry_reason_of": str(room)})["kv_transfer_params"]
            assert asked["kvferry_room"] == str(room)
            assert asked["kvferry_reason"].split(":")[0] in reasons, asked
        if policy == "recompute":
            assert errors == []
        else:
            assert len(errors) == len(prompts) and all(r["http_status"] == 500 for r in errors), errors
        # vLLM counts them by the codes the log names (its stats come with its next steps).
        deadline = time.monotonic() + 60
        while True:
            counted = {c: n - failed_before[policy][c] for c, n in failed_rooms(decode).items()}
            if sum(counted.values()) >= len(prompts):
                break
            assert time.monotonic() < deadline, f"{policy}: vLLM counted {counted} failed rooms"
            time.sleep(0.2)
        assert {c for c, n in counted.items() if n} <= set(reasons), (counted, reasons)
    # The proxy routes around the dead prefill: an OpenAI error, not a hang.
    proxy.wait_health(503)
    up = lambda role: metric(proxy.url, "kvferry_proxy_backend_up", f'role="{role}"')  # noqa: E731
    assert (up("prefill"), up("decode")) == (0, 1)
    got = proxy.complete(prompts[0], 16)
    assert got["http_status"] == 503 and got["error"]["error"]["message"] == "no healthy prefill server", got
    # The prefill comes back on its URL, a new vLLM engine and so a kvferry group of its own
    # (the dead one's lapses with its lease); the proxy asks it again which group it is, and
    # new requests land.
    pd.prefill = vllm_fleet.restart_prefill(0)
    assert pd.prefill.kvferry_group() != group
    back = proxy.wait_health(200)
    assert up("prefill") == 1
    print(f"the proxy routed to the restarted prefill {back:.2f} s after it was healthy")
    try:
        for prompt in make_prompts(SEEDS["sequential"])[:6]:
            asked = time.monotonic()
            got = proxy.complete(prompt, 16)
            if "choices" not in got:
                print(f"a request through the restarted prefill failed after {time.monotonic() - asked:.2f} s "
                      f"(registry exit status {pd.registry.poll()}): {got}\n{diagnose(pd, pd.logs)}")
            assert "choices" in got, got
            assert got["choices"][0]["token_ids"] == reference[tuple(prompt)], got
    finally:
        pd.stop()


# The server whose queue a request waits in, and the pairing that makes a timeout end its room
# there without holds: the prefill's room TTL (the decode's request waits, sequential pairing),
# or both sides' ready timeout (the prefill's request waits while the decode asked already).
QUEUES = {"decode": "sequential", "prefill": "concurrent"}


def wait_in_queue(pd: View, queue: str, reference: dict) -> None:
    """The server of ``queue`` is busy with long generations; a request behind them, through
    the proxy, waits in its queue three times the timeout that would end its room (300 ms), and
    lands."""
    busy = pd.decode if queue == "decode" else pd.prefill
    pairing = QUEUES[queue]
    proxy = pd.proxy(pairing)
    # Every block of the prompt moves.
    reset_prefix_cache(pd.decode)
    # No room of an earlier test is left to expire under the short TTL.
    deadline = time.monotonic() + 60
    while metric(pd.prefill_api, "kvferry_rooms_held"):
        assert time.monotonic() < deadline, "the prefill agent still holds rooms of earlier tests"
        time.sleep(0.2)
    expired_before = metric(pd.prefill_api, "kvferry_rooms_expired_total")
    landed_before = metric(pd.decode_api, "kvferry_kv_bytes_total")
    # The blockers: a stream of 1000 tokens for each sequence the server runs at once, cut by
    # closing them once the wait is over (longer than the wait even at 1 ms a step).
    body = {"model": busy.model, "prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(busy.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    blockers = [urllib.request.urlopen(req, timeout=300) for _ in range(MAX_NUM_SEQS)]
    try:
        for blocker in blockers:
            assert blocker.readline().startswith(b"data: "), "a blocker is not generating"
        prompt = make_prompts(SEEDS[pairing])[6]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(proxy.complete, prompt, 16)
            # The prefill agent knows the room: announced (the decode's request waits) or asked
            # for by the decode (the prefill's request waits).
            deadline = time.monotonic() + 120
            while not metric(pd.prefill_api, "kvferry_rooms_held", 'role="prefill"'):
                assert time.monotonic() < deadline and not queued.done(), "the room never reached the prefill agent"
                time.sleep(0.05)
            known = time.monotonic()
            time.sleep(0.9)
            waited = time.monotonic() - known
            # The request is outstanding at its decode, and at its prefill while it waits there.
            in_flight = {role: metric(proxy.url, "kvferry_proxy_backend_in_flight", f'role="{role}"')
                         for role in ("prefill", "decode")}
            assert not queued.done(), f"{queue}: the request did not wait in the queue: {queued.result()}"
            assert in_flight == {"prefill": float(queue == "prefill"), "decode": 1.0}, in_flight
            for blocker in blockers:
                blocker.close()
            got = queued.result()
    finally:
        for blocker in blockers:
            blocker.close()
    print(f"{queue}: the request waited {waited:.1f} s and more in the queue (timeouts 0.3 s)")
    assert "choices" in got, got
    assert got["choices"][0]["token_ids"] == reference[tuple(prompt)]
    assert got["kv_transfer_params"]["kvferry_tokens"] == len(prompt), got
    assert metric(pd.prefill_api, "kvferry_rooms_expired_total") == expired_before
    assert metric(pd.decode_api, "kvferry_kv_bytes_total") > landed_before


def test_negative_control_kv_corrupted_in_flight_changes_the_output(vllm_fleet, reference):
    # Checksums off and the prefill agent inverting every byte of the room's first chunk (a
    # test-only fault switch, armed at run time): the room still ends `success`, the decode
    # generates from wrong KV, and its tokens differ from the reference. The equality the other
    # tests assert is not automatic.
    pd = View(vllm_fleet, vllm_fleet.prefills[:1], vllm_fleet.decodes[:1])
    prompt = make_prompts(SEEDS["sequential"])[-1]  # 1000 tokens: 8 blocks, 2 MiB, 2 chunks
    log_start = len(pd.prefill.log.read_text())
    # Every block moves, and none of the wrong ones stays in the decode's prefix cache.
    reset_prefix_cache(pd.decode)
    try:
        armed = arm_corrupt_chunk(pd.prefill_api)
        got = pd.proxy("sequential").complete(prompt, 16)
    finally:
        pd.stop()
        reset_prefix_cache(pd.decode)
    assert "choices" in got, got
    assert got["kv_transfer_params"]["kvferry_start_token"] == 0
    ids = got["choices"][0]["token_ids"]
    same = sum(a == b for a, b in zip(ids, reference[tuple(prompt)]))
    print(f"corrupted KV (chunk {armed['corrupt_chunk']}): {same} of {len(ids)} tokens equal the reference's")
    assert ids != reference[tuple(prompt)]
    assert "fault injection: corrupting a chunk" in pd.prefill.log.read_text()[log_start:]


def test_a_room_outlives_its_timeouts_while_its_request_waits_in_either_queue(vllm_fleet, reference):
    """The agents hold the room while its request waits (their heartbeats name it to the other
    side). The fleet's first prefill and decode, whose agents end a room after 300 ms while the
    test runs: the prefill's room TTL and both sides' ready timeout (the decode keeps landed
    rooms for its engine as usual), heartbeats every 30 ms."""
    pd = View(vllm_fleet, vllm_fleet.prefills[:1], vllm_fleet.decodes[:1])
    short = {pd.prefill_api: dict(room_ttl_ms=300, timeout_ready_ms=300, heartbeat_ms=30),
             pd.decode_api: dict(timeout_ready_ms=300, heartbeat_ms=30)}
    were = {}
    try:
        for api, ms in short.items():
            were[api] = set_timeouts(api, **ms)
        for queue in QUEUES:
            wait_in_queue(pd, queue, reference)
    finally:
        for api, timeouts in were.items():
            set_timeouts(api, **{k: timeouts[k] for k in short[api]})
        pd.stop()


@pytest.mark.last(1)
def test_a_decode_killed_after_asking_for_rooms_fails_them_and_the_prefill_frees_their_blocks(vllm_fleet, reference):
    """The fleet's first decode asks the first prefill for four rooms of long prompts and is
    killed before the prefill computed any (their prefill requests are sent once the prefill's
    agent knows the decode dead): the rooms wait for another decode (``--requeue-ms``), which
    never asks, then fail with ``peer_dead`` (not their TTL) and every block the prefill lent to
    them comes back; the prefill serves on."""
    prefill, decode = vllm_fleet.prefills[0], vllm_fleet.decodes[0]
    api = prefill.agent_api()
    expired = metric(api, "kvferry_rooms_expired_total")
    dead = metric(api, "kvferry_room_failures_total", 'code="peer_dead"')
    peers_dead = metric(api, "kvferry_peers_dead_total")
    prompts = long_prompts(4, 11)
    group = prefill.kvferry_group()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rooms = []
        for prompt in prompts:
            room = int.from_bytes(os.urandom(8), "little")
            rooms.append(room)
            pool.submit(decode.complete, prompt, 16,
                        {"do_remote_prefill": True, "kvferry_room": str(room), "kvferry_dp_rank": group})
        # Once the decode has asked the prefill's agent for every room (a room nobody asked
        # for is released only by its TTL: the prefill cannot know it never will be).
        wait_asked(api, rooms)
        decode.kill()
        killed = time.monotonic()
        while metric(api, "kvferry_peers_dead_total") == peers_dead:
            assert time.monotonic() - killed < 60, "the prefill's agent never found the decode dead"
            time.sleep(0.05)
        prefilled = [pool.submit(prefill.complete, prompt, 1, {"do_remote_decode": True, "kvferry_room": str(room)})
                     for prompt, room in zip(prompts, rooms)]
        for f in prefilled:
            assert "choices" in f.result(), f.result()
    deadline = time.monotonic() + 60
    while vllm_metric(prefill, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, f"the prefill still holds blocks: {vllm_metric(prefill, 'vllm:kv_cache_usage_perc')}"
        time.sleep(0.2)
    took = time.monotonic() - killed
    failed = metric(api, "kvferry_room_failures_total", 'code="peer_dead"') - dead
    expired = metric(api, "kvferry_rooms_expired_total") - expired
    print(f"every block of the prefill was free {took:.2f} s after the decode was killed; "
          f"{failed:.0f} rooms failed peer_dead, {expired:.0f} expired meanwhile")
    # Each room's own fate (the counters also count rooms other tests left behind, which may
    # expire or fail in this window).
    for room in rooms:
        with urllib.request.urlopen(f"{api}/v1/rooms/{room}", timeout=10) as r:
            view = json.loads(r.read())
        assert view["state"] == "failed" and view["reason"]["code"] == "peer_dead", view
    assert failed >= len(rooms)
    got = prefill.complete(long_prompts(1, 12)[0], 1)
    assert "choices" in got, got

