"""A client that leaves at any point of a request through ``kvferry proxy`` leaves nothing held:
the fleet's first prefill and first decode (``vllm_fleet``) behind a proxy of each pairing.

The client sends a streamed completion of a fresh prompt and closes its connection at one point
of the request, made certain without a window of time:

- **before the prefill answers**: the prefill server is paused (SIGSTOP) until the proxy has
  dropped its request;
- **between the legs** (sequential pairing): the prefill answered, and the decode server is
  paused until the proxy has dropped the decode's request;
- **during the transfer**: the prefill's agent holds every chunk (a test-only switch) while the
  decode's agent waits for the room, and still holds them when the client leaves;
- **while the decode streams**: after the first event of the answer.

At each point, within a bound far below every slower mechanism (the fleet's room TTL is 60 s;
no peer dies), both agents hold no unfinished room, both engines no request and no KV block, and
the room ended as it should: aborted on the prefill unless a decode took it (the proxy has the
prefill release a room no decode answered for), aborted on the decode where its load had begun,
and the decode's engine stopped the request (it generated far fewer tokens than the 600 asked
while streaming, none before). The time each took is printed.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import urllib.parse
import urllib.request

import numpy as np
import pytest

from vllm_servers import View, held_for, hold_chunks, metric, unfinished_rooms, vllm_metric
from waiting import wait_for

# Far below the fleet's room TTL (60 s), the only other way a room held here would end.
BOUND = 30
POINTS = ["before_the_prefill_answers", "between_the_legs", "during_the_transfer", "while_the_decode_streams"]


@pytest.fixture(scope="module")
def pair(vllm_fleet):
    """The fleet's first prefill and decode behind a proxy of each pairing."""
    view = View(vllm_fleet, vllm_fleet.prefills[:1], vllm_fleet.decodes[:1])
    view.via = {pairing: view.proxy(pairing) for pairing in ("sequential", "concurrent")}
    yield view
    view.stop()


def outstanding(proxy, role: str) -> int:
    with urllib.request.urlopen(proxy.url + "/v1/servers", timeout=30) as r:
        return sum(s["outstanding"] for s in json.loads(r.read())[role])


def paused(server, sig: int) -> None:
    os.killpg(server.proc.pid, sig)


class Client:
    """A streamed completion through ``proxy`` on a connection of its own, closed at will."""

    def __init__(self, proxy, prompt: list[int], max_tokens: int) -> None:
        url = urllib.parse.urlsplit(proxy.url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
        body = {"model": proxy.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})

    def first_event(self) -> str:
        response = self.conn.getresponse()
        assert response.status == 200, response.read()
        while True:
            line = response.fp.readline().decode().strip()
            if line.startswith("data: "):
                return line

    def leave(self) -> None:
        """Closes the connection (the client is gone)."""
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


class Counts:
    """What the agents and engines counted, to compare after a point."""

    def __init__(self, pair) -> None:
        self.pair = pair
        self.values = self.read()

    def read(self) -> dict[str, float]:
        p, d = self.pair.prefill, self.pair.decode
        return {
            "prefill_aborted": metric(self.pair.prefill_api, "kvferry_rooms_total", 'state="aborted"'),
            "prefill_success": metric(self.pair.prefill_api, "kvferry_rooms_total", 'state="success"'),
            "decode_aborted": metric(self.pair.decode_api, "kvferry_rooms_total", 'state="aborted"'),
            "prefill_generated": vllm_metric(p, "vllm:generation_tokens_total"),
            "decode_generated": vllm_metric(d, "vllm:generation_tokens_total"),
        }

    def since(self) -> dict[str, float]:
        now = self.read()
        return {k: now[k] - v for k, v in self.values.items()}


def nothing_held(pair) -> bool:
    """Neither agent holds an unfinished room; neither engine a request or a KV block."""
    engines = (pair.prefill, pair.decode)
    return (unfinished_rooms(pair.prefill_api) == 0 and unfinished_rooms(pair.decode_api) == 0
            and all(vllm_metric(s, "vllm:num_requests_running") == 0 for s in engines)
            and all(vllm_metric(s, "vllm:num_requests_waiting") == 0 for s in engines)
            and all(vllm_metric(s, "vllm:kv_cache_usage_perc") == 0 for s in engines))


def fresh_prompt() -> list[int]:
    """A prompt neither server has in its prefix cache: every block of it moves."""
    rng = np.random.default_rng()
    return rng.integers(3, 2048, 300).tolist()


@pytest.mark.parametrize("pairing,point", [("sequential", p) for p in POINTS]
                         + [("concurrent", p) for p in POINTS if p != "between_the_legs"])
def test_a_client_that_leaves_leaves_nothing_held(pair, pairing, point):
    proxy = pair.via[pairing]
    wait_for("nothing held before", lambda: nothing_held(pair))
    counts = Counts(pair)
    released = metric(proxy.url, "kvferry_proxy_rooms_released_total")
    if point == "before_the_prefill_answers":
        paused(pair.prefill, signal.SIGSTOP)
        try:
            client = Client(proxy, fresh_prompt(), 600)
            wait_for("the prefill's request sent", lambda: outstanding(proxy, "prefill") == 1)
            client.leave()
            wait_for("the proxy dropped it", lambda: outstanding(proxy, "prefill") == 0)
        finally:
            paused(pair.prefill, signal.SIGCONT)
    elif point == "between_the_legs":
        paused(pair.decode, signal.SIGSTOP)
        try:
            client = Client(proxy, fresh_prompt(), 600)
            wait_for("the decode's request sent", lambda: outstanding(proxy, "decode") == 1
                     and outstanding(proxy, "prefill") == 0)
            client.leave()
            wait_for("the proxy dropped it", lambda: outstanding(proxy, "decode") == 0)
        finally:
            paused(pair.decode, signal.SIGCONT)
    elif point == "during_the_transfer":
        hold_chunks(pair.prefill_api, 1)
        try:
            client = Client(proxy, fresh_prompt(), 600)
            wait_for("the room mid-transfer", lambda: bool(held_for(pair.prefill_api)))
            client.leave()
            took = wait_for("nothing held while the chunks are held", lambda: nothing_held(pair), BOUND)
        finally:
            hold_chunks(pair.prefill_api, 0)
    else:
        client = Client(proxy, fresh_prompt(), 600)
        client.first_event()
        client.leave()
    if point != "during_the_transfer":
        took = wait_for("nothing held", lambda: nothing_held(pair), BOUND)
    # The aborts are counted when the engines' steps report them: the agents' rooms are final.
    delta = counts.since()
    released = metric(proxy.url, "kvferry_proxy_rooms_released_total") - released
    print(f"{pairing}, the client gone {point.replace('_', ' ')}: nothing held {took * 1000:.0f} ms later; "
          f"{delta}, {released:.0f} room released by the proxy")
    # The decode's engine stopped the request: it generated far fewer tokens than asked.
    assert delta["decode_generated"] < 600 / 2, delta
    if point == "while_the_decode_streams":
        # The decode took the room.
        assert delta["prefill_success"] >= 1 and delta["prefill_aborted"] == 0, delta
        assert released == 0
    else:
        # No decode answered: the proxy had the prefill release the room.
        assert released == 1
        if point != "before_the_prefill_answers":
            # The prefill computed the room: it was aborted, not sent.
            assert delta["prefill_aborted"] >= 1 and delta["prefill_success"] == 0, delta
        if point == "during_the_transfer":
            # The decode's room was aborted while it loaded; its engine never generated.
            assert delta["decode_aborted"] >= 1 and delta["decode_generated"] == 0, delta
