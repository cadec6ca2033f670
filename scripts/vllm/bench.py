"""vLLM prefill/decode through kvferry, measured (docs/benchmarks.md, "vLLM"): time to first
token and end-to-end latency of streamed completions through ``kvferry proxy``, sequential
against concurrent pairing, at 1 and at 4 requests in flight, against one plain vLLM server
(the single-engine reference) and vLLM's ExampleConnector PD (KV through files) in the same run.

    KVFERRY_PY=$(scripts/python/build) KVFERRY_VLLM_PYTHON=$(scripts/vllm/install)
    "$KVFERRY_PY" scripts/vllm/bench.py [--prompts 8] [--new-tokens 16] [--out DIR]

The tiny seeded model of the tests (float32, 128-token blocks, prefix caching on), every engine
pinned to its own core, everything on 127.0.0.1. Each measurement sends its own prompts
(random tokens, 128 to 1000 long; the same lengths for every setup, never a prefix-cache hit)
and checks every generated token id against the reference server's. Also measured for
kvferry: the decode's KV cache usage while requests wait (``vllm:kv_cache_usage_perc``,
sampled every 20 ms), the rooms' transfer time (the decode agent's
``kvferry_room_ready_wait_seconds`` and ``kvferry_room_transfer_seconds``), and the connector's own CPU time per
engine step (``KVFERRY_VLLM_TIMING=1``, read from the servers' logs). One JSON line per
measurement on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "tests"))

from vllm_servers import Pd, Server, make_model, metric  # noqa: E402


# The decode agent's room histograms: waiting for the prefill engine's first ready piece, and
# the transfer, start to success.
HISTOGRAMS = ("ready_wait", "transfer")


def stream(url: str, model: str, prompt: list[int], new_tokens: int, params: dict | None = None) -> dict:
    """A streamed greedy completion: time to the first token, to the end, and the token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.monotonic()
    first, ids = None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"streamed error: {event}")
            for choice in event.get("choices", []):
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.monotonic() - start
                ids += got
    return {"ttft": first, "e2e": time.monotonic() - start, "ids": ids}


def run(send, prompts: list[list[int]], inflight: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(inflight) as pool:
        return list(pool.map(send, prompts))


class Sampler:
    """A server's KV cache usage every 20 ms while a measurement runs."""

    def __init__(self, server: Server) -> None:
        self.server, self.values, self.stop = server, [], threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            self.values.append(metric(self.server.url, "vllm:kv_cache_usage_perc"))
            time.sleep(0.02)

    def done(self) -> dict:
        self.stop.set()
        self.thread.join()
        return {"kv_usage_mean": statistics.fmean(self.values), "kv_usage_max": max(self.values)}


def summary(setup: str, inflight: int, results: list[dict], reference: dict, prompts, extra: dict) -> dict:
    wrong = sum(r["ids"] != reference[tuple(p)] for p, r in zip(prompts, results))
    ttft = [r["ttft"] for r in results]
    e2e = [r["e2e"] for r in results]
    row = {"setup": setup, "inflight": inflight, "requests": len(results), "tokens_wrong": wrong,
           "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
           "e2e_p50_ms": 1e3 * statistics.median(e2e), "e2e_mean_ms": 1e3 * statistics.fmean(e2e), **extra}
    print(json.dumps(row), flush=True)
    return row


def connector_cpu(log: pathlib.Path) -> dict:
    """The connector's CPU per engine step, by side, from a server's log."""
    out = {}
    for side in ("scheduler", "worker"):
        lines = re.findall(rf"kvferry: connector CPU \({side}\): (\d+) steps, (\d+) us in all, (\d+) us at most",
                           log.read_text())
        steps = sum(int(s) for s, _, _ in lines)
        if steps:
            out[side] = {"steps": steps, "mean_us": sum(int(t) for _, t, _ in lines) / steps,
                         "max_us": max(int(m) for _, _, m in lines)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="requests per measurement")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--kvferry", default=str(REPO / "target" / "release" / "kvferry"))
    ap.add_argument("--out", type=pathlib.Path, default=None, help="logs and model (default: a temporary directory)")
    args = ap.parse_args()
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="kvferry-vllm-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    python = os.environ.get("KVFERRY_VLLM_PYTHON", str(pathlib.Path.home() / ".cache/kvferry/vllm-venv/bin/python"))
    wheel = sorted((REPO / "target" / "python-wheels").glob("kvferry-*.whl"))[-1]
    site = out / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = os.environ | {"PYTHONPATH": str(site), "KVFERRY_VLLM_TIMING": "1"}
    model = make_model(python, env, out / "tiny", seed=0)
    vllm = (python, env, model)
    rng = np.random.default_rng(3)
    lengths = rng.integers(128, 1001, args.prompts).tolist()
    names = [f"{setup}-{n}" for setup in ("reference", "sequential", "concurrent", "example") for n in (1, 4)]
    sets = {name: [rng.integers(3, 2048, n).tolist() for n in lengths] for name in names}
    rows, reference = [], {}
    print(f"prompt lengths {sorted(lengths)}; logs in {out}", file=sys.stderr)

    server = Server(python, env, model, 0, out / "reference.log")
    try:
        server.wait_healthy()
        for prompts in sets.values():  # the reference tokens of every prompt, untimed
            for p in prompts:
                reference[tuple(p)] = server.complete(p, args.new_tokens)["choices"][0]["token_ids"]
        for n in (1, 4):
            prompts = sets[f"reference-{n}"]
            results = run(lambda p: stream(server.url, server.model, p, args.new_tokens), prompts, n)
            rows.append(summary("single server", n, results, reference, prompts, {}))
    finally:
        server.stop()

    logs = out / "kvferry"
    logs.mkdir(exist_ok=True)
    pd = Pd(vllm, args.kvferry, logs)
    try:
        for pairing in ("sequential", "concurrent"):
            proxy = pd.proxy(pairing)
            for n in (1, 4):
                prompts = sets[f"{pairing}-{n}"]
                api = pd.decode_api
                series = [f"kvferry_room_{h}_seconds_{k}" for h in HISTOGRAMS for k in ("sum", "count")]
                before = {s: metric(api, s) for s in series}
                sampler = Sampler(pd.decode)
                results = run(lambda p: stream(proxy.url, proxy.model, p, args.new_tokens), prompts, n)
                extra = sampler.done()
                delta = {s: metric(api, s) - before[s] for s in series}
                extra["rooms"] = delta["kvferry_room_transfer_seconds_count"]
                for h in HISTOGRAMS:
                    count = delta[f"kvferry_room_{h}_seconds_count"]
                    extra[f"{h}_mean_ms"] = 1e3 * delta[f"kvferry_room_{h}_seconds_sum"] / count if count else None
                rows.append(summary(f"kvferry {pairing}", n, results, reference, prompts, extra))
    finally:
        pd.stop()
    cpu = {"prefill": connector_cpu(logs / "prefill.log"), "decode": connector_cpu(logs / "decode.log")}
    print(json.dumps({"connector_cpu_per_step": cpu}), flush=True)

    storage = out / "example-storage"
    storage.mkdir(exist_ok=True)
    config = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"shared_storage_path": str(storage)}})
    servers = [Server(python, env, model, core, out / f"example-{core}.log", "--kv-transfer-config", config)
               for core in (0, 1)]
    try:
        for s in servers:
            s.wait_healthy()
        prefill, decode = servers

        def example(p: list[int]) -> dict:
            start = time.monotonic()
            prefill.complete(p, 1)
            got = stream(decode.url, decode.model, p, args.new_tokens)
            waited = time.monotonic() - start - got["e2e"]
            return got | {"ttft": got["ttft"] + waited, "e2e": got["e2e"] + waited}

        for n in (1, 4):
            prompts = sets[f"example-{n}"]
            rows.append(summary("ExampleConnector", n, run(example, prompts, n), reference, prompts, {}))
    except Exception as e:  # noqa: BLE001 - the comparison is reported as failed, the rest stands
        print(json.dumps({"setup": "ExampleConnector", "error": str(e)}), flush=True)
    finally:
        for s in servers:
            s.stop()

    print("\n| setup | in flight | TTFT p50 / mean ms | e2e p50 / mean ms | decode KV usage mean / max | "
          "room ready wait / transfer mean ms | wrong tokens |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        usage = f"{r['kv_usage_mean']:.3f} / {r['kv_usage_max']:.3f}" if "kv_usage_mean" in r else ""
        transfer = f"{r['ready_wait_mean_ms'] or 0:.1f} / {r['transfer_mean_ms']:.1f}" if r.get("transfer_mean_ms") else ""
        print(f"| {r['setup']} | {r['inflight']} | {r['ttft_p50_ms']:.0f} / {r['ttft_mean_ms']:.0f} | "
              f"{r['e2e_p50_ms']:.0f} / {r['e2e_mean_ms']:.0f} | {usage} | {transfer} | {r['tokens_wrong']} |",
              file=sys.stderr)
    print(f"\nconnector CPU per engine step: {json.dumps(cpu)}", file=sys.stderr)


if __name__ == "__main__":
    main()
