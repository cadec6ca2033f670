"""An SGLang fleet as PD deployments run it: two prefill and two decode servers with identical
kvferry settings behind one sglang-router (each prefill on a bootstrap port of its own), the
prefills of two data-parallel ranks each (``--dp-size 2``: a room goes to the DP rank
``bootstrap_room % 2``, SGLang's ``follow_bootstrap_room``, and each rank is a kvferry group),
the decodes of one, SGLang's metrics on (``--enable-metrics``).

- Mixed prompts of 1 to 777 tokens at 8 in flight equal a plain SGLang's tokens, every server
  and every prefill DP rank served rooms, and kvferry's room timings reach SGLang's /metrics.
- A client that goes away mid-answer frees the pages on both sides.
- A request put on a prefill DP rank that is not its room's (``routed_dp_rank``) fails at once,
  naming both ranks; the manager's options refuse another ``--load-balance-method`` (tested
  below the server).
- A prefill stopped with SIGTERM while it holds rooms (its decodes paused) drains: its requests
  complete once the decodes take their rooms, then it exits.
- A decode killed with SIGKILL under load: the router sends the requests that failed with it
  again, every answer is right, the survivors serve on, and no server holds pages once the
  rooms no decode will ask for expired (``ROOM_TTL_MS``: SGLang's prefill learns its decode
  only when the decode asks).

SGLang's DP attention (``--enable-dp-attention``) does not run on its CPU engine (docs/sglang.md
quotes the error); test_agents.py covers kvferry's DP routing by room below the engine."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

import sglang_servers as S
from documented_metrics import assert_as_documented
from vllm_servers import make_model, make_prompts, metric, post
from waiting import wait_for

pytestmark = pytest.mark.deployment("sglang_fleet")

NEW_TOKENS = 16
IN_FLIGHT = 8
PREFILL_DP = 2
# A step of the fleet on two cores with six schedulers: bounds that hold on a loaded machine.
BOUND = 300
# A prefill room no decode asked for is dropped after this long (60 s by default): the rooms
# whose decode died before asking, and the router waits for their prefill requests.
ROOM_TTL_MS = 15_000
# Only a closed connection ends a peer within the tests' bounds: a paused decode sends no
# heartbeats (5 s by default) and six schedulers share two cores.
AGENTS = {"KVFERRY_PEER_DEAD_MS": "60000"}


@pytest.fixture(scope="module")
def model(sglang, tmp_path_factory):
    python, env = sglang
    return make_model(python, env, tmp_path_factory.mktemp("fleet-model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def prompts():
    """24 prompts of 1 to 777 tokens, some sharing a prefix."""
    return make_prompts(21)[:12] + make_prompts(22)[:12]


@pytest.fixture(scope="module")
def reference(sglang, model, prompts):
    return S.reference_outputs(*sglang, model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def fleet(sglang, model, tmp_path_factory, request):
    """The fleet, its router ready; the reference is computed while its servers start."""
    python, env = sglang
    fleet = S.Pd(
        # SGLang checks that the memory its weights took leaves its static fraction free, by
        # the host's free memory before and after loading them; six ranks loading at once take
        # more than 5% of it (CPU_ARGS' fraction). --max-total-tokens still sizes the pool.
        python, env, model, tmp_path_factory.mktemp("sglang-fleet"),
        ("--page-size", "4", "--enable-metrics", "--mem-fraction-static", "0.3"),
        prefill_args=("--dp-size", str(PREFILL_DP)), prefill_env=S.TP2 | AGENTS | {"KVFERRY_ROOM_TTL_MS": str(ROOM_TTL_MS)},
        decode_env=AGENTS, prefills=2, decodes=2,
        # Every server in turn, and a server that stops answering its health check is out of
        # the rotation within seconds (by default a minute).
        router_args=("--policy", "round_robin", "--health-check-interval-secs", "1",
                     "--health-failure-threshold", "1", "--health-check-timeout-secs", "30"),
    )
    try:
        request.getfixturevalue("reference")
        fleet.start_router()
        yield fleet
    finally:
        fleet.stop()


def generate(fleet: S.Pd, prompt: list[int], new_tokens: int = NEW_TOKENS) -> dict:
    return S.generate(fleet.url, prompt, new_tokens)


def sglang_metric(server: S.Server, name: str, label: str = "") -> float:
    return metric(server.url, name, label)


def held(fleet: S.Pd, servers: list[S.Server] | None = None) -> int:
    """KV tokens the requests of ``servers`` (by default every live one) hold."""
    return sum(S.used_tokens(s) for s in servers or live(fleet))


def health(server: S.Server) -> int:
    """The status of the server's /health."""
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def live(fleet: S.Pd) -> list[S.Server]:
    return [s for s in fleet.prefills + fleet.decodes if s.proc.poll() is None]


# Run in the SGLang venv: the backend's options of a prefill rank of DP rank 1 of 2 (a tiny
# Llama's pool: 2 KV heads of 64 float32 dimensions, pages of 4 tokens) under each load
# balancing method.
DP_OPTIONS = """
import json, sys, types
from kvferry.sglang import backend
backend.kv_pool = types.SimpleNamespace(dtype="torch.float32", heads=2, total_heads=2, cuda=None)
args = types.SimpleNamespace(kv_cache_dtype_str="auto", kv_data_ptrs=[1, 2], kv_item_lens=[2048, 2048],
                             kv_data_lens=[20480, 20480], page_size=4, engine_rank=0, system_dp_rank=1)
for method in sys.argv[1:]:
    server = types.SimpleNamespace(pp_size=1, tp_size=1, dp_size=2, load_balance_method=method)
    try:
        opts = backend.agent_options(args, server, True, False, "http://127.0.0.1:1")
        print(json.dumps({k: opts[k] for k in ("dp_rank", "dp_size")}))
    except ValueError as e:
        print(json.dumps(str(e)))
# Every rank reads the same variables: each listens on the base ports plus dp_rank * tp_size +
# tp_rank (DP 2 x TP 2), and takes SGLang's waiting timeout as its ready timeout; a decode rank's
# UCX gets the IB devices of its GPU (--disaggregation-ib-device), unless UCX_NET_DEVICES is set.
import os
os.environ.update({"KVFERRY_API_PORT": "7000", "KVFERRY_DATA_PORT": "7100", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120"})
ranks = []
for dp in (0, 1):
    for tp in (0, 1):
        rank = types.SimpleNamespace(**(vars(args) | dict(engine_rank=tp, system_dp_rank=dp)))
        server = types.SimpleNamespace(pp_size=1, tp_size=2, dp_size=2)
        opts = backend.agent_options(rank, server, False, False, "http://127.0.0.1:1")
        ranks.append([opts["api_port"], opts["data_port"], opts["timeout_ready_ms"]])
env, ib = {}, types.SimpleNamespace(ib_device='{"0": "mlx5_0", "1": "mlx5_1"}', gpu_id=1)
devices = [backend.use_ib_devices(ib, None, env), env.get("UCX_NET_DEVICES"),
           backend.use_ib_devices(ib, None, {"UCX_NET_DEVICES": "mine"})]
print(json.dumps({"ranks": ranks, "devices": devices}))
"""


def test_a_prefill_of_dp_ranks_is_a_group_per_rank_and_refuses_other_load_balancing(sglang):
    """(First: it needs no fleet.) A room goes to prefill DP group ``bootstrap_room % dp_size``: a prefill whose requests
    SGLang puts on ranks by another rule is refused at start, naming the flag."""
    python, env = sglang
    env = {k: v for k, v in env.items() if not k.startswith(("KVFERRY_", "SGLANG_DISAGGREGATION_", "UCX_"))}
    run = subprocess.run([python, "-c", DP_OPTIONS, "follow_bootstrap_room", "round_robin"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    follow, other, ranks = (json.loads(line) for line in run.stdout.strip().splitlines()[-3:])
    assert follow == {"dp_rank": 1, "dp_size": 2}, follow
    assert "--load-balance-method round_robin is not supported" in other, other
    # (Same run.) Pinned ports offset per rank, SGLang's settings honoured, the GPU's IB devices.
    assert ranks["ranks"] == [[7000 + i, 7100 + i, 120_000] for i in range(4)], ranks
    assert ranks["devices"] == ["mlx5_1", "mlx5_1", None], ranks


def test_mixed_prompts_at_8_in_flight_equal_a_plain_sglang_and_every_server_serves(fleet, prompts, reference):
    rooms = lambda s, label="": sglang_metric(s, "sglang:kvferry_room_bytes_count", label)  # noqa: E731
    before = {s.url: rooms(s) for s in fleet.prefills + fleet.decodes}
    # Per prefill: kvferry's transfer seconds and SGLang's transfer latency, their counts and sums.
    timed = lambda p: (sglang_metric(p, "sglang:kvferry_room_seconds_count"),  # noqa: E731
                       sglang_metric(p, "sglang:kv_transfer_latency_ms_count"),
                       sglang_metric(p, "sglang:kvferry_room_seconds_sum"),
                       sglang_metric(p, "sglang:kv_transfer_latency_ms_sum") / 1000)
    timed_before = [timed(p) for p in fleet.prefills]
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        got = list(pool.map(lambda p: generate(fleet, p), prompts))
    for p, g in zip(prompts, got):
        assert "output_ids" in g, f"prompt of {len(p)} tokens: {g}"
        assert S.output_ids(g) == reference[tuple(p)], f"prompt of {len(p)} tokens"
    served = {s.url: rooms(s) - before[s.url] for s in fleet.prefills + fleet.decodes}
    by_rank = [[rooms(p, f'dp_rank="{r}"') for r in range(PREFILL_DP)] for p in fleet.prefills]
    print(f"{len(prompts)} prompts of {sorted(len(p) for p in prompts)} tokens at {IN_FLIGHT} in flight: "
          f"token-identical; rooms per server {list(served.values())}, per prefill DP rank {by_rank}")
    assert all(n > 0 for n in served.values()), served
    assert all(n > 0 for ranks in by_rank for n in ranks), by_rank
    # Each room is one on a prefill rank and one on a decode (a prefill may count its last ones
    # after the router answered).
    counted = lambda role: sum(rooms(s) - before[s.url] for s in role)  # noqa: E731
    wait_for("every room counted on both sides", lambda: counted(fleet.prefills) == counted(fleet.decodes), BOUND)
    assert counted(fleet.decodes) >= len(prompts)
    # SGLang's own transfer metrics carry the rooms' transfer times (the senders' transfer
    # metric), not its own measure of the request's wait in its transfer queue.
    # SGLang observes a room right after kvferry's manager did, in the same pass.
    for p, start in zip(fleet.prefills, timed_before):
        delta = lambda: [a - b for a, b in zip(timed(p), start)]  # noqa: E731
        wait_for("SGLang observed every room", lambda: delta()[0] == delta()[1] > 0, BOUND)
        ours, sglangs = delta()[2:]
        assert ours > 0 and abs(sglangs - ours) < 1e-3, (ours, sglangs)
    wait_for("every server frees its pages", lambda: held(fleet) == 0, BOUND)


def stream_then_leave(fleet: S.Pd, prompt: list[int], tokens: int) -> float:
    """Streams a long answer through the router, closes the connection after ``tokens`` chunks;
    returns when it closed."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}}
    req = urllib.request.Request(fleet.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=BOUND)
    seen = 0
    for line in r:
        if line.startswith(b"data: {"):
            seen += 1
            if seen == tokens:
                break
    r.close()
    return time.monotonic()


def test_the_kvferry_metrics_sglang_exposes_are_those_docs_metrics_md_lists(fleet):
    """After rooms moved: the ``sglang:kvferry_`` families of every server's /metrics are the rows
    of docs/metrics.md's metrics table that SGLang exposes (documented_metrics.py). Every rank
    exposes its failed-rooms counter by every code from the start, at 0 where nothing failed
    (here ``checksum``: no server runs ``--checksum``)."""
    for server in live(fleet):
        assert_as_documented(server.url, "SGLang", "sglang:kvferry_")
        with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        assert re.search(r'^sglang:kvferry_failed_rooms_total\{[^}]*code="checksum"[^}]*\} 0(\.0)?$', text, re.M), text


def test_a_client_that_goes_away_mid_answer_frees_the_pages_on_both_sides(fleet, prompts):
    wait_for("the fleet is idle", lambda: held(fleet) == 0, BOUND)
    prompt = max(prompts, key=len)[:100]
    left = stream_then_leave(fleet, prompt, 4)
    freed = wait_for("every server frees the request's pages", lambda: held(fleet) == 0, BOUND)
    print(f"the client left after 4 tokens of a 900-token answer; every server's pages were free {freed:.2f} s later "
          f"({time.monotonic() - left:.2f} s after it closed)")
    aborted = sum(sglang_metric(d, "sglang:num_aborted_requests_total") for d in fleet.decodes)
    assert aborted >= 1, "no decode aborted the request"


def test_a_request_put_on_a_prefill_dp_rank_its_decode_does_not_ask_fails_at_once(fleet, prompts):
    """SGLang puts a request that names a DP rank (``routed_dp_rank``) on that rank, and its
    decode asks rank ``bootstrap_room % 2`` for the room unless the request names the rank to it
    too (``disagg_prefill_dp_rank``). The prefill fails such a request at once, naming both
    ranks, instead of computing KV no decode asks for."""
    room = random.getrandbits(62)
    rank = (room + 1) % PREFILL_DP
    body = {
        "rid": f"route-{room}", "input_ids": prompts[5], "routed_dp_rank": rank,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": fleet.bootstrap_ports[0], "bootstrap_room": room,
    }
    failed = lambda: sglang_metric(fleet.prefills[0], "sglang:kvferry_failed_rooms_total", 'code="bad_route"')  # noqa: E731
    before = failed()
    got = post(fleet.prefills[0].url + "/generate", body)
    print(f"a request on prefill DP rank {rank} for room {room}: {got}")
    assert "output_ids" not in got or got["meta_info"]["finish_reason"]["type"] == "abort", got
    assert f"the request is on prefill DP rank {rank}, but its decode asks rank {room % PREFILL_DP}" in str(got), got
    assert failed() == before + 1
    wait_for("the prefill frees the request's pages", lambda: S.used_tokens(fleet.prefills[0]) == 0, BOUND)


@pytest.mark.last(0)
def test_a_prefill_stopped_with_requests_in_flight_completes_them(fleet, prompts, reference):
    """Its decodes paused, the second prefill computes its share of 8 requests and holds their
    rooms; SIGTERM; the decodes resume and take every room; every answer is right, and the
    prefill exits once its requests are done."""
    victim = fleet.prefills[1]
    # Rooms announced that no decode asked for yet (a ready room waits in ``bootstrapping``).
    ready = lambda: sum(metric(api, "kvferry_rooms_held", 'state="bootstrapping"') for api in victim.agent_apis())  # noqa: E731
    batch = prompts[:IN_FLIGHT]
    for d in fleet.decodes:
        os.killpg(d.proc.pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
            futures = [pool.submit(generate, fleet, p) for p in batch]
            wait_for("the prefill holds ready rooms", lambda: ready() > 0, BOUND)
            victim.proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            wait_for("the prefill drains (its health check fails)", lambda: health(victim) == 503, BOUND)
            for d in fleet.decodes:
                os.killpg(d.proc.pid, signal.SIGCONT)
            results = [f.result(BOUND) for f in futures]
    finally:
        for d in fleet.decodes:
            os.killpg(d.proc.pid, signal.SIGCONT)
    for p, g in zip(batch, results):
        assert "output_ids" in g and S.output_ids(g) == reference[tuple(p)], (len(p), g)
    victim.proc.wait(BOUND)
    print(f"the prefill held rooms at SIGTERM; its {IN_FLIGHT} requests' answers were right, and it exited "
          f"{time.monotonic() - stopped:.2f} s after SIGTERM with {victim.proc.returncode}")
    if victim.engine:
        victim.engine.stopped()
    # The router takes it out of the rotation: the rest of the fleet serves on.
    wait_for("the router serves without it", lambda: "output_ids" in generate(fleet, prompts[3]), BOUND)
    for p in prompts[8:12]:
        assert S.output_ids(generate(fleet, p)) == reference[tuple(p)]


@pytest.mark.last(1)
def test_a_decode_killed_under_load_leaves_the_survivors_serving_and_no_pages_held(fleet, prompts, reference):
    victim, survivor = fleet.decodes[1], fleet.decodes[0]
    failed = lambda: {code: sum(sglang_metric(p, "sglang:kvferry_failed_rooms_total", f'code="{code}"')  # noqa: E731
                              for p in live(fleet) if p in fleet.prefills) for code in ("peer_dead", "unknown_room")}
    failed_before = failed()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(generate, fleet, p) for p in prompts[:16]]
        wait_for("the victim decodes", lambda: S.used_tokens(victim) > 0, BOUND)
        victim.kill()
        killed = time.monotonic()
        results = [f.result(BOUND) for f in futures]
    answered = [(p, g) for p, g in zip(prompts[:16], results) if "output_ids" in g and g.get("meta_info", {}).get("finish_reason", {}).get("type") != "abort"]
    for p, g in answered:
        assert S.output_ids(g) == reference[tuple(p)], f"prompt of {len(p)} tokens"
    print(f"{len(answered)} of 16 requests answered right while the decode died")
    # The router sends a request that failed with the decode again.
    assert len(answered) == 16, [g for g in results if g not in [a for _, a in answered]]
    # The router takes the dead decode out of the rotation; then every answer is right.
    wait_for("the router serves without it", lambda: "output_ids" in generate(fleet, prompts[5]), BOUND)
    later = prompts[8:16]
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        again = list(pool.map(lambda p: generate(fleet, p), later))
    for p, g in zip(later, again):
        assert "output_ids" in g and S.output_ids(g) == reference[tuple(p)], (len(p), g)
    freed = wait_for("no server holds pages", lambda: held(fleet) == 0, BOUND)
    ended = {code: n - failed_before[code] for code, n in failed().items()}
    print(f"the survivor answered {len(later)} more right; every live server's pages free {time.monotonic() - killed:.2f} s "
          f"after the kill ({freed:.2f} s after the last answer); prefill rooms that failed, by code: {ended}")
    assert S.used_tokens(survivor) == 0

