"""SGLang prefill/decode through kvferry, measured with SGLang's own client
(``python -m sglang.bench_serving``) against a plain SGLang server (docs/benchmarks.md, "SGLang
with SGLang's own benchmark client"). Setups, one after another, on the same two cores:

- ``single``: one plain SGLang server (its one rank on core 0);
- ``kvferry``: a prefill and a decode server with ``--disaggregation-transfer-backend kvferry``
  (prefill on core 0, decode on core 1) behind sglang-router in PD mode (``--pd-disaggregation``);
- ``kvferry-2p2d``: two prefill and two decode servers behind one router (each prefill on a
  bootstrap port of its own), both prefills on core 0 and both decodes on core 1.

For each prompt size and concurrency, ``bench_serving`` sends ``--prompts`` random-token prompts
(``--dataset-name random-ids``, exactly that many tokens) asking ``--new-tokens`` each
(``ignore_eos``), that many in flight, and writes its summary; this script prints one JSON line
per cell on stdout and a table on stderr: requests completed, TTFT p50 and p99, ITL p50,
requests and output tokens per second, and for the PD setups the mean transfer time of the
cell's rooms at the decodes (``sglang:kvferry_room_seconds``, SGLang's metrics being on).
Every server gets SGLang's ``--sleep-on-idle``, as in the tests (sglang_servers.CPU_ARGS);
``--busy-poll`` leaves it out: then each scheduler polls for work on a core of its own, idle or
not.

    KVFERRY_PY=$(scripts/python/build) KVFERRY_SGLANG_PYTHON=$(scripts/sglang/install)
    "$KVFERRY_PY" scripts/sglang/bench.py [--sizes 128,512] [--concurrency 1,4] [--prompts 16]
        [--new-tokens 16] [--setups single,kvferry,kvferry-2p2d] [--layers 8] [--busy-poll] [--out DIR]

The model is scripts/vllm/tiny_model.py's Llama (float32, 2 KV heads of 64 dims) with
``--layers`` layers; SGLang runs its CPU engine with the test-only stand-in for sgl-kernel's CPU
ops (python/tests/sglang_stub), as the tests do; prefix caching off, so every setup computes the
same prompts afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "tests"))

import sglang_servers as S  # noqa: E402
from vllm_servers import make_model, metric, unpack_wheel  # noqa: E402

SETUPS = ["single", "kvferry", "kvferry-2p2d"]
# The engine flags of every setup beyond the tests' (sglang_servers.CPU_ARGS).
ARGS = ("--page-size", "4", "--disable-radix-cache", "--mem-fraction-static", "0.3", "--enable-metrics")


class Single:
    """One plain SGLang server."""

    def __init__(self, python: str, env: dict, model: pathlib.Path, logs: pathlib.Path) -> None:
        self.server = S.Server(python, env | {"SGLANG_CPU_OMP_THREADS_BIND": "0"}, model, logs / "single.log", *ARGS)
        self.server.wait_healthy()
        self.url = self.server.url

    def transfers(self) -> tuple[float, float]:
        return 0.0, 0.0

    def stop(self) -> None:
        self.server.stop()


class Disaggregated:
    """``n`` prefill and ``n`` decode servers with kvferry behind sglang-router."""

    def __init__(self, python: str, env: dict, model: pathlib.Path, logs: pathlib.Path, n: int) -> None:
        self.pd = S.Pd(python, env, model, logs, ARGS, prefill_env={"SGLANG_CPU_OMP_THREADS_BIND": "0"},
                       decode_env={"SGLANG_CPU_OMP_THREADS_BIND": "1"}, prefills=n, decodes=n)
        self.pd.start_router()
        self.url = self.pd.url

    def transfers(self) -> tuple[float, float]:
        """The decodes' rooms so far: their count and their transfer seconds summed (kvferry's
        series in SGLang's metrics)."""
        got = [sum(metric(d.url, f"sglang:kvferry_room_seconds_{k}") for d in self.pd.decodes) for k in ("count", "sum")]
        return got[0], got[1]

    def stop(self) -> None:
        self.pd.stop()


def bench_serving(python: str, env: dict, url: str, model: pathlib.Path, size: int, concurrency: int, prompts: int,
                  new_tokens: int, out: pathlib.Path) -> dict:
    """SGLang's client against ``url``; its summary (the output file's last line)."""
    out.unlink(missing_ok=True)
    cmd = [
        python, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
        "--tokenizer", str(model), "--dataset-name", "random-ids", "--random-input-len", str(size),
        "--random-output-len", str(new_tokens), "--random-range-ratio", "1", "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", "0",
        "--output-file", str(out), "--disable-tqdm",
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="128,512")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--busy-poll", action="store_true",
                        help="no --sleep-on-idle: every SGLang scheduler polls a core, idle or not")
    args = parser.parse_args()
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="kvferry-sglang-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    python = os.environ.get("KVFERRY_SGLANG_PYTHON", str(pathlib.Path.home() / ".cache/kvferry/sglang-venv/bin/python"))
    env = S.sglang_env(str(unpack_wheel(out / "site")), dict(os.environ))
    model = make_model(python, env, out / "model", seed=0, layers=args.layers)
    sizes = [int(s) for s in args.sizes.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.busy_poll:
        S.CPU_ARGS = tuple(a for a in S.CPU_ARGS if a != "--sleep-on-idle")
    rows = []
    for setup in args.setups.split(","):
        logs = out / setup
        logs.mkdir(exist_ok=True)
        deployment = (Single(python, env, model, logs) if setup == "single"
                      else Disaggregated(python, env, model, logs, 2 if setup == "kvferry-2p2d" else 1))
        try:
            for size in sizes:
                for c in concurrencies:
                    rooms, seconds = deployment.transfers()
                    got = bench_serving(python, env, deployment.url, model, size, c, args.prompts, args.new_tokens,
                                        logs / f"bench-{size}-{c}.jsonl")
                    row = dict(setup=setup, size=size, concurrency=c, completed=got["completed"],
                               ttft_p50_ms=got["median_ttft_ms"], ttft_p99_ms=got["p99_ttft_ms"],
                               itl_p50_ms=got["median_itl_ms"], requests_per_s=got["request_throughput"],
                               output_tokens_per_s=got["output_throughput"])
                    rooms_now, seconds_now = deployment.transfers()
                    if rooms_now > rooms:
                        row["room_transfer_ms"] = 1000 * (seconds_now - seconds) / (rooms_now - rooms)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            deployment.stop()
    print(f"{'setup':14} {'size':>5} {'c':>3} {'done':>5} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'req/s':>7} {'tok/s':>7}"
          f" {'room ms':>8}", file=sys.stderr)
    for r in rows:
        print(f"{r['setup']:14} {r['size']:>5} {r['concurrency']:>3} {r['completed']:>5} {r['ttft_p50_ms']:>9.1f} "
              f"{r['ttft_p99_ms']:>8.1f} {r['itl_p50_ms']:>8.1f} {r['requests_per_s']:>7.2f} {r['output_tokens_per_s']:>7.1f}"
              f" {r.get('room_transfer_ms', float('nan')):>8.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
