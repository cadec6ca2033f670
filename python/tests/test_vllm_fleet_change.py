"""The run's vLLM fleet (2 prefill and 2 decode servers, ``vllm_fleet``) changing under a steady
load, behind a ``kvferry proxy`` that knows no server by name: it finds them in the registry,
where their agents register (``--bootstrap``).

While mixed prompts of 1 to 1000 tokens arrive at 2 requests a second (every answer compared
with a single engine's), each of the four servers is stopped with SIGTERM to its API server
alone (what an orchestrator sends) and started again on a new port, the next only once the last
serves:

- the first prefill is stopped with 8 requests in flight on it: both decode servers are paused
  (SIGSTOP) while the requests reach it, so that it computed all 8 and holds their rooms when
  SIGTERM comes; the proxy sees it drain within a health round and sends it nothing more, the
  decodes resume and take every room, and the server exits once they did;
- the first decode is stopped while it streams answers: the ones it has finish, new requests go
  to the other decode;
- each server started again is found by the proxy and gets requests; the first request between
  it and a warm server of the other role is timed against a second one.

Beside them, until the first prefill is back, runs a decode server whose KV cannot pair with
the prefills' (bfloat16 against their float32): the registry tells it so when it registers, and
the proxy never sends it a request. No request fails.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from vllm_servers import NEW_TOKENS, Proxy, Server, View, connector
from test_vllm_xpyd import all_prompts, stream
from waiting import wait_for

# The steady load, requests a second.
RATE = 2.0
# Seconds any one step of the fleet's change may take on a loaded machine.
BOUND = 300
SHUTDOWN_TIMEOUT = "60"


def servers(proxy: Proxy) -> dict:
    with urllib.request.urlopen(proxy.url + "/v1/servers", timeout=30) as r:
        return json.loads(r.read())


def seen(proxy: Proxy, role: str, url: str) -> dict | None:
    """The proxy's view of the server of ``url``, or None when it lists no such server."""
    return next((s for s in servers(proxy)[role] if s["url"] == url), None)


def routed_to_no_more(proxy: Proxy, role: str, url: str) -> bool:
    """Whether the proxy sends the server of ``url`` no new requests: it sees it drain, or it
    is gone from the registry already (a server with nothing to finish leaves at once)."""
    view = seen(proxy, role, url)
    return view is None or view["draining"]


class Load:
    """Requests at ``RATE`` a second through ``proxy``, prompts of every length in turn; each
    answer is checked against the reference when it comes."""

    def __init__(self, proxy: Proxy, reference: dict) -> None:
        self.proxy, self.reference = proxy, reference
        self.prompts = all_prompts()
        self.pool = concurrent.futures.ThreadPoolExecutor(64)
        self.sent: list[tuple[list[int], concurrent.futures.Future]] = []
        self.stop = threading.Event()
        self.next = 0
        self.resume()

    def run(self) -> None:
        while not self.stop.wait(1 / RATE):
            prompt = self.prompts[self.next % len(self.prompts)]
            self.sent.append((prompt, self.pool.submit(self.proxy.complete, prompt, NEW_TOKENS)))
            self.next += 1

    def pause(self) -> None:
        """No more requests until ``resume`` (those sent go on)."""
        self.stop.set()
        self.thread.join()

    def resume(self) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def failures(self) -> list[str]:
        """Every request sent so far that failed or answered other tokens (waits for them)."""
        failed = []
        for prompt, future in list(self.sent):
            got = future.result(timeout=BOUND)
            if "choices" not in got:
                failed.append(f"{len(prompt)}-token prompt: {got}")
            elif got["choices"][0]["token_ids"] != self.reference[tuple(prompt)]:
                failed.append(f"{len(prompt)}-token prompt: other tokens")
        return failed

    def close(self) -> None:
        self.pause()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def changing(vllm_fleet, reference):
    """The fleet with a decode server that cannot pair with its prefills beside it, a proxy
    that finds them all in the registry, and the steady load."""
    odd = vllm_fleet.join(Server(
        vllm_fleet.python, vllm_fleet.env, vllm_fleet.model, 1, vllm_fleet.logs / "decode-bf16.log",
        "--dtype", "bfloat16", "--shutdown-timeout", SHUTDOWN_TIMEOUT,
        "--kv-transfer-config", connector_of(vllm_fleet, "kv_consumer"),
    ))
    proxy = Proxy(vllm_fleet.kvferry_bin, [], [], "concurrent", vllm_fleet.logs, vllm_fleet.model,
                  bootstrap=vllm_fleet.bootstrap)
    # Every server, the odd decode too: usable, though nothing pairs with it.
    wait_for("the proxy sees the fleet", lambda: [sum(s["usable"] for s in servers(proxy)[role])
                                                  for role in ("prefill", "decode")] == [2, 3])
    load = Load(proxy, reference)
    yield vllm_fleet, proxy, load, odd
    load.close()
    proxy.stop()
    odd.stop()


def connector_of(fleet, role: str) -> str:
    return connector(role, fleet.bootstrap, **fleet.agent)


def restart(fleet, proxy: Proxy, load: Load, role: str, i: int) -> Server:
    """Starts server ``i`` of ``role`` again on a new port (its old one stopped) under the load,
    times its first request with a warm server of the other role (the load paused meanwhile),
    and waits until the proxy routes the load to it."""
    old = (fleet.prefills if role == "prefill" else fleet.decodes)[i]
    if role == "prefill":
        new = fleet.start_prefill(i)
    else:
        new = fleet.start_decode(i, agent=dict(api_port=old.api_port))
        new.api_port = old.api_port
    (fleet.prefills if role == "prefill" else fleet.decodes)[i] = new
    new.wait_healthy()
    load.pause()
    try:
        time_first_pairing(fleet, proxy, role, new)
    finally:
        load.resume()
    joined = wait_for(f"the proxy routes to the new {role}", lambda: (seen(proxy, role, new.url) or {}).get("usable"))
    served = wait_for(f"the new {role} serves", lambda: seen(proxy, role, new.url)["routed"] > 0)
    print(f"{role} {i} started again on a new port: usable at the proxy {joined:.2f} s after its timed requests, "
          f"its first request of the load routed {served:.2f} s later")
    return new


def time_first_pairing(fleet, proxy: Proxy, role: str, new: Server) -> None:
    """The first request between ``new`` and a warm server of the other role (its first
    contact: kvferry's Hello and connections), against a second one; ``new``'s engine warmed
    first with a request of its own, so that what differs is the pairing."""
    other = (fleet.decodes if role == "prefill" else fleet.prefills)[1]
    prompts = all_prompts()
    # vLLM's first forward pass of a shape on a fresh engine is slow on the CPU: not kvferry's.
    new.complete(prompts[5], 2)
    before = (seen(proxy, role, new.url) or {"routed": 0})["routed"]
    pair = View(fleet, [new] if role == "prefill" else [other], [other] if role == "prefill" else [new])
    try:
        via = pair.proxy("concurrent")
        times = []
        for prompt in (prompts[7], prompts[21]):
            start = time.monotonic()
            got = via.complete(prompt, NEW_TOKENS)
            times.append(time.monotonic() - start)
            assert "choices" in got, got
        first = "" if before == 0 else f" (the load had reached it {before} times before)"
        print(f"new {role}: its first request with a warm {'decode' if role == 'prefill' else 'prefill'}{first} "
              f"{times[0] * 1000:.0f} ms, a second {times[1] * 1000:.0f} ms: "
              f"{(times[0] - times[1]) * 1000:.0f} ms more (goal under 100 ms)")
    finally:
        pair.stop()


def terminate(server: Server) -> None:
    """SIGTERM to the server's API server alone, as an orchestrator sends it."""
    os.kill(server.proc.pid, signal.SIGTERM)


def exits(server: Server) -> float:
    start = time.monotonic()
    server.proc.wait(BOUND)
    server.engine.stopped()
    return time.monotonic() - start


def paused(servers: list[Server], sig: int) -> None:
    for s in servers:
        os.killpg(s.proc.pid, sig)


def test_a_decode_that_cannot_take_the_prefills_kv_is_told_at_registration(changing):
    fleet, proxy, load, odd = changing
    with urllib.request.urlopen(fleet.bootstrap + "/v1/ranks", timeout=30) as r:
        ranks = json.loads(r.read())["ranks"]
    mine = [r for r in ranks if r.get("server") == odd.url]
    assert mine and all("dtype differs: prefill fp32, decode bf16" in (r.get("unmatched") or "") for r in mine), mine
    assert "the registry says no instance of the other role can exchange KV" in odd.log.read_text()
    paired = [r for r in ranks if r["role"] == "decode" and r.get("server") != odd.url]
    assert paired and not any(r.get("unmatched") for r in paired), paired
    assert seen(proxy, "decode", odd.url) is not None, "the proxy lists it"


def test_every_server_is_stopped_and_started_again_in_turn_under_load_and_no_request_fails(changing):
    fleet, proxy, load, odd = changing
    prompts = all_prompts()

    # The first prefill, stopped with 8 requests in flight on it: requests go one by one until
    # 8 went to it, while the decodes are paused, so that it holds all 8 rooms.
    victim, other = fleet.prefills[0], fleet.prefills[1]
    routed = lambda server: seen(proxy, "prefill", server.url)["routed"]  # noqa: E731
    load.pause()
    paused(fleet.decodes, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            start = {s.url: routed(s) for s in (victim, other)}
            burst = []
            while routed(victim) - start[victim.url] < 8:
                assert len(burst) < 32, "the proxy sent the victim fewer than 8 of 32 requests"
                prompt = prompts[len(burst) % len(prompts)]
                burst.append((prompt, pool.submit(proxy.complete, prompt, NEW_TOKENS)))
                wait_for("the request routed", lambda: sum(routed(s) - start[s.url] for s in (victim, other)) == len(burst))
            # Their prefill requests answered: the victim computed them and holds their rooms.
            wait_for("the victim answered them", lambda: seen(proxy, "prefill", victim.url)["outstanding"] == 0)
            on_victim = routed(victim) - start[victim.url]
            terminate(victim)
            drained = wait_for("the proxy sees the victim drain", lambda: routed_to_no_more(proxy, "prefill", victim.url))
            then = {s.url: routed(s) for s in (victim, other)}
            after = [(p, pool.submit(proxy.complete, p, NEW_TOKENS)) for p in prompts[16:24]]
            wait_for("the new requests routed", lambda: routed(other) - then[other.url] == len(after))
            assert routed(victim) == then[victim.url], "a request went to the draining prefill"
            paused(fleet.decodes, signal.SIGCONT)
            results = [(p, f.result(BOUND)) for p, f in burst + after]
    finally:
        paused(fleet.decodes, signal.SIGCONT)
    print(f"prefill 0 stopped with {on_victim} requests in flight on it; the proxy saw it drain {drained:.2f} s "
          f"after SIGTERM; the {len(after)} requests sent then went to the other prefill")
    for p, got in results:
        assert "choices" in got and got["choices"][0]["token_ids"] == load.reference[tuple(p)], (len(p), got)
    took = exits(victim)
    print(f"prefill 0 exited {took:.2f} s after its decodes resumed and its requests were answered")
    assert victim.proc.returncode == 0
    load.resume()
    restart(fleet, proxy, load, "prefill", 0)
    # The decode that pairs with no prefill served beside them all along, and got nothing; it
    # stops now, to leave the two cores to the rest of the change.
    odd_view = seen(proxy, "decode", odd.url)
    assert odd_view is not None and odd_view["routed"] == 0, odd_view
    odd.stop()

    # The first decode, stopped while it streams answers.
    victim = fleet.decodes[0]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [(p, pool.submit(stream, proxy, p, 128)) for p in prompts[:8]]
        wait_for("the victim decode answers", lambda: seen(proxy, "decode", victim.url)["outstanding"] > 0)
        terminate(victim)
        drained = wait_for("the proxy sees the decode drain", lambda: routed_to_no_more(proxy, "decode", victim.url))
        count = (seen(proxy, "decode", victim.url) or {"routed": None})["routed"]
        later = [(p, pool.submit(stream, proxy, p, NEW_TOKENS)) for p in prompts[8:16]]
        for p, f in streams + later:
            ids, error = f.result(BOUND)
            assert error is None and ids[:NEW_TOKENS] == load.reference[tuple(p)], (len(p), error)
    print(f"decode 0 stopped while answering; the proxy saw it drain {drained:.2f} s later")
    took = exits(victim)
    print(f"decode 0 exited {took:.2f} s after SIGTERM's drain was seen")
    assert victim.proc.returncode == 0
    assert (seen(proxy, "decode", victim.url) or {"routed": count})["routed"] == count, "a request went to the draining decode"
    restart(fleet, proxy, load, "decode", 0)

    # The other two, in turn.
    for role, server in (("prefill", fleet.prefills[1]), ("decode", fleet.decodes[1])):
        terminate(server)
        exits(server)
        wait_for(f"the proxy forgets the old {role}", lambda: seen(proxy, role, server.url) is None)
        restart(fleet, proxy, load, role, 1)

    time.sleep(2)
    load.close()
    failed = load.failures()
    print(f"{len(load.sent)} requests of the steady load, {len(failed)} failed")
    assert not failed, failed
    metrics = urllib.request.urlopen(proxy.url + "/metrics", timeout=30).read().decode()
    print("\n".join(l for l in metrics.splitlines() if l.startswith("kvferry_proxy_rerouted")))
