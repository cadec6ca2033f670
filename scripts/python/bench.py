"""The Python package's figures (docs/benchmarks.md, "Python"): what one room operation costs
through Python, and large rooms between two Python engine processes against `kvferry bench`
in the same run.

    KVFERRY_PY=$(scripts/python/build)
    "$KVFERRY_PY" scripts/python/bench.py [--rooms 30] [--warmup 2] [--tokens 4096]
        [--transport zmq-tcp,ucx-shm] [--ops 2000] [--kvferry target/release/kvferry]

Room operations: a prefill and a decode agent in this process (the `tiny` model, 16-token
rooms) and the same through sidecars (`kvferry.spawn`, the HTTP API); each call timed alone,
median and p99 in microseconds.

Transfers: two engine processes (this script with `--worker prefill|decode`), each with an
in-process agent over a numpy array in kvferry's format, move `--rooms` rooms of `--tokens`
tokens of llama3-8b, one at a time, after `--warmup` rooms. A room's latency is the decode's
`success` time minus the prefill's `ready` time (the views' timings), exactly as `kvferry
bench` measures it; its rate is bytes over the median latency. Every landed byte is compared
with the prefill's after each room (outside the timing), and the room's pages are poisoned
again before the next. Then `kvferry bench` runs the same rooms over the same transport, and
the ratio is printed. One JSON line per measurement on stdout, a table on stderr.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import kvferry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `kvferry bench` names for the UCX transports: the agent's transport and UCX_TLS.
UCX_TLS = {"ucx-shm": "posix,cma,self", "ucx-tcp": "tcp"}
SEED = 4096


def agent_options(registry: str, transport: str, tokens: int, model: str = "llama3-8b") -> dict:
    """The agents' flags of `kvferry bench` for one room of `tokens` (its defaults)."""
    pages = -(-tokens // 16)
    return dict(
        bootstrap=registry,
        model=model,
        page_size=16,
        pool_pages=pages + 8,
        transport="ucx" if transport in UCX_TLS else transport,
        chunk_bytes=1 << 20,
        host="127.0.0.1",
        api_host="127.0.0.1",
    )


def transport_env(transport: str) -> dict:
    env = dict(os.environ)
    if transport in UCX_TLS:
        env["UCX_TLS"] = UCX_TLS[transport]
        if transport == "ucx-tcp":
            env["UCX_NET_DEVICES"] = "lo"
    return env


def registry(tag: str) -> tuple[subprocess.Popen, str]:
    """A registry process (`python -m kvferry bootstrap`) and its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry", "bootstrap", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    return proc, json.loads(proc.stdout.readline())["url"]


def pages_view(kv: np.ndarray, layout: dict) -> np.ndarray:
    """kvferry's format as [layer x plane, page, page bytes]."""
    planes = (layout["layers"][1] - layout["layers"][0]) * layout["planes"]
    return kv.reshape(planes, layout["pool_pages"], -1)


# ---- the engine processes -------------------------------------------------------------------


def worker(role: str, registry_url: str, transport: str, tokens: int) -> None:
    """One engine process: reads one command per line, answers one JSON line each (on the
    original stdout; fd 1 goes to stderr, where UCX also prints its own log lines)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    opts = agent_options(registry_url, transport, tokens)
    layout = kvferry.memory_layout(**opts)
    n = -(-tokens // layout["page_size"])
    pages = list(range(n))
    kv = np.empty(layout["region_bytes"], np.uint8)
    noise = np.random.default_rng(SEED).integers(0, 256, kv.size, dtype=np.uint8)
    agent_type = kvferry.PrefillAgent if role == "prefill" else kvferry.DecodeAgent
    if role == "prefill":
        kv[:] = noise
    else:
        kv[:] = 0xA5
    want = pages_view(noise, layout)[:, :n]
    with agent_type([kv], **opts) as agent:
        print(json.dumps({"started": True}), file=answers, flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            room = cmd["room"]
            if cmd["op"] == "ready":
                agent.ready(room, tokens, pages=pages)
                agent.wait(room, 120)
                out = {"ready_at": agent.view(room)["timings"]["ready"]}
            elif cmd["op"] == "request":
                agent.request(room, tokens, pages=pages)
                out = {}
            else:  # take: wait, take, verify every byte, poison the pages again
                view = agent.wait(room, 120)
                taken = agent.take(room)
                got = pages_view(kv, layout)
                ok = bool(np.array_equal(got[:, :n], want)) and bool((got[:, n:] == 0xA5).all())
                got[:, :n] = 0xA5
                out = {"success_at": view["timings"]["success"], "bytes": taken["bytes"], "ok": ok}
            print(json.dumps(out), file=answers, flush=True)


class Engine:
    def __init__(self, role: str, registry_url: str, transport: str, tokens: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", role, "--registry", registry_url,
             "--transport", transport, "--tokens", str(tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=transport_env(transport),
        )

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"an engine process exited with status {self.proc.wait()}")
        try:
            return json.loads(line)
        except ValueError:
            raise SystemExit(f"an engine process answered {line!r}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def python_rooms(transport: str, tokens: int, rooms: int, warmup: int) -> dict:
    reg, url = registry(transport)
    prefill, decode = Engine("prefill", url, transport, tokens), Engine("decode", url, transport, tokens)
    try:
        prefill.proc.stdout.readline(), decode.proc.stdout.readline()  # started
        lat, room_bytes, bad = [], 0, 0
        base = int(time.time() * 1e3) << 8
        for i in range(warmup + rooms):
            room = base + i
            decode.call(op="request", room=room)
            ready_at = prefill.call(op="ready", room=room)["ready_at"]
            done = decode.call(op="take", room=room)
            if i >= warmup:
                lat.append(done["success_at"] - ready_at)
                room_bytes = done["bytes"]
                bad += not done["ok"]
        p50 = statistics.median(lat)
        return dict(
            measure="python_rooms", transport=transport, tokens=tokens, rooms=rooms,
            bytes_per_room=room_bytes, latency_ms={"p50": p50, "p99": percentile(lat, 99)},
            room_gbps_p50=room_bytes / (p50 / 1e3) / 1e9, failed_rooms=bad,
        )
    finally:
        for e in (prefill, decode):
            e.close()
        reg.terminate()
        reg.wait()


def kvferry_bench(binary: str, transport: str, tokens: int, rooms: int, warmup: int) -> dict:
    out = subprocess.run(
        [binary, "bench", "--transport", transport, "--model", "llama3-8b", "--tokens", str(tokens),
         "--rooms", str(rooms), "--warmup", str(warmup), "--json"],
        capture_output=True, text=True, check=True,
    )
    line = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(measure="kvferry_bench", transport=transport, tokens=tokens, rooms=rooms,
                room_gbps_p50=line["room_gbps_p50"], latency_ms=line["latency_ms"],
                failed_rooms=line["failed_rooms"], memcpy_gbps=line["memcpy_gbps"])


# ---- room operations ------------------------------------------------------------------------


def percentile(v: list[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def room_ops(count: int, where: str) -> dict:
    """Each room operation timed alone: `count` rooms of 16 tokens (tiny model, zmq-tcp)."""
    reg, url = registry("ops")
    opts = agent_options(url, "zmq-tcp", 16, model="tiny") | dict(pool_pages=64)
    need = kvferry.memory_layout(**opts)
    costs: dict[str, list[float]] = {k: [] for k in ("request", "ready", "view", "poll", "wait", "take", "abort")}

    def timed(name, call, *args, **kwargs):
        t = time.perf_counter()
        out = call(*args, **kwargs)
        costs[name].append((time.perf_counter() - t) * 1e6)
        return out

    try:
        if where == "in-process":
            p_kv, d_kv = np.zeros(need["region_bytes"], np.uint8), np.zeros(need["region_bytes"], np.uint8)
            prefill, decode = kvferry.PrefillAgent([p_kv], **opts), kvferry.DecodeAgent([d_kv], **opts)
        else:
            prefill, decode = kvferry.spawn("prefill", **opts), kvferry.spawn("decode", **opts)
        with prefill, decode:
            base = int(time.time() * 1e3) << 8
            for i in range(count):
                room = base + 2 * i
                timed("request", decode.request, room, 16, pages=[1])
                timed("ready", prefill.ready, room, 16, pages=[2])
                while not decode.poll([room]):
                    pass
                timed("view", decode.view, room)
                timed("poll", decode.poll, [room])
                timed("wait", decode.wait, room, 10)  # settled: the call's own cost
                timed("take", decode.take, room)
                prefill.wait(room, 10)
                decode.request(room + 1, 16, pages=[3])
                timed("abort", decode.abort, room + 1)
                with contextlib.suppress(kvferry.Aborted):
                    decode.wait(room + 1, 10)
                with contextlib.suppress(kvferry.Aborted):
                    decode.take(room + 1)
        return dict(measure="room_ops", where=where, rooms=count,
                    us={k: {"p50": statistics.median(v), "p99": percentile(v, 99)} for k, v in costs.items()})
    finally:
        reg.terminate()
        reg.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--transport", default="zmq-tcp,ucx-shm")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--kvferry", default=os.path.join(REPO, "target", "release", "kvferry"))
    ap.add_argument("--worker", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--registry", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.registry, args.transport, args.tokens)
        return

    def emit(line: dict) -> dict:
        print(json.dumps(line), flush=True)
        return line

    for where in ("in-process", "sidecar"):
        ops = emit(room_ops(args.ops, where))
        print(f"{where:>10} room operations, us (p50 / p99): "
              + ", ".join(f"{k} {v['p50']:.0f} / {v['p99']:.0f}" for k, v in ops["us"].items()), file=sys.stderr)
    for transport in args.transport.split(","):
        py = emit(python_rooms(transport, args.tokens, args.rooms, args.warmup))
        rs = emit(kvferry_bench(args.kvferry, transport, args.tokens, args.rooms, args.warmup))
        ratio = py["room_gbps_p50"] / rs["room_gbps_p50"]
        emit(dict(measure="ratio", transport=transport, tokens=args.tokens, python_over_bench=ratio))
        print(f"{transport}: Python {py['room_gbps_p50']:.2f} GB/s (p50 {py['latency_ms']['p50']:.1f} ms, "
              f"{py['failed_rooms']} failed), kvferry bench {rs['room_gbps_p50']:.2f} GB/s "
              f"(p50 {rs['latency_ms']['p50']:.1f} ms): ratio {ratio:.3f}; memcpy {rs['memcpy_gbps']:.1f} GB/s",
              file=sys.stderr)
        if py["failed_rooms"] or rs["failed_rooms"]:
            raise SystemExit("rooms did not land intact")


if __name__ == "__main__":
    main()
