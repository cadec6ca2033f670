#!/usr/bin/env python3
"""LMCache's transfer channel benchmark (``lmcache.tools.transfer_channel_benchmark``) for
kvferry and LMCache's own channels, NIXL and Mooncake's transfer engine, on this host.

Each configuration runs the benchmark's server and client as LMCache runs them, both started
through ``python -m kvferry.lmcache benchmark`` (LMCache's module with the ``kvferry`` channel
registered; the built-in channels run unchanged), with the LMCache venv's python
(``KVFERRY_LMCACHE_PYTHON``, default that of scripts/lmcache/install) and this checkout's built
wheel (target/python-wheels, scripts/python/build) on its path. The client reads
``--num-objects`` objects in one ``submit_read`` per iteration, ``--warmup`` + ``--iters``
times, and verifies every byte after the last (``--verify``); the figures are the
benchmark's own: GB/s = bytes of one read / 1e9 / its seconds, best, median and mean of the
iterations.

Channels (``--channels``):
  kvferry-zmq-tcp   kvferry over ZeroMQ tcp
  kvferry-ucx-tcp   kvferry over UCX, UCX_TLS=tcp,self on the loopback
  kvferry-ucx-shm   kvferry over UCX, UCX_TLS=sm,self (shared memory; not in the default list)
  nixl-ucx-tcp      NIXL's UCX backend, UCX_TLS=tcp,self on the loopback
  mooncake-tcp      Mooncake's transfer engine over tcp (its non-CUDA build)

Sizes: ``--sizes`` objects (page size the smaller of the object and 512 KiB, the benchmark's
default page; as many objects as make 256 MiB a read, between 1 and 1024), and, with
``--defaults``, the benchmark's defaults (10 MiB objects of 512 KiB pages, 100 a read) with a
source pool of 200 objects instead of 500 (2 GB of shared memory instead of 5).

Prints a table; ``--json PATH`` writes one JSON object per configuration (JSON Lines).
Usage: scripts/lmcache/bench.py [--channels ...] [--sizes 4KB,64KB,1MB,16MB,64MB] [--defaults]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[2]
MIB = 1 << 20
UCX_TCP = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
CHANNELS = {
    "kvferry-zmq-tcp": ("kvferry", {"KVFERRY_TRANSPORT": "zmq-tcp"}),
    "kvferry-ucx-tcp": ("kvferry", {"KVFERRY_TRANSPORT": "ucx"} | UCX_TCP),
    "kvferry-ucx-shm": ("kvferry", {"KVFERRY_TRANSPORT": "ucx", "UCX_TLS": "sm,self"}),
    "nixl-ucx-tcp": ("nixl", UCX_TCP),
    "mooncake-tcp": ("mooncake_te", {"MC_TE_PROTOCOL": "tcp"}),
}
# The bytes one read moves in the size sweep, and its bounds on objects.
READ_BYTES = 256 * MIB
MAX_OBJECTS = 1024
DEFAULT_PAGE = 512 * 1024


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)B?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def lmcache_python() -> str:
    python = os.environ.get("KVFERRY_LMCACHE_PYTHON") or str(pathlib.Path.home() / ".cache/kvferry/lmcache-venv/bin/python")
    if not pathlib.Path(python).exists():
        sys.exit(f"no LMCache venv at {python}: run scripts/lmcache/install (or set KVFERRY_LMCACHE_PYTHON)")
    return python


def unpacked_wheel(into: pathlib.Path) -> pathlib.Path:
    wheels = sorted((REPO / "target" / "python-wheels").glob("kvferry-*.whl"))
    if not wheels:
        sys.exit("no built wheel in target/python-wheels: run scripts/python/build")
    zipfile.ZipFile(wheels[-1]).extractall(into)
    return into


def run_one(python: str, env: dict, channel: str, object_size: int, page: int, objects: int, sources: int,
            iters: int, warmup: int, logs: pathlib.Path) -> dict:
    kind, extra = CHANNELS[channel]
    env = env | extra
    url, control, listen = free_ports(3)
    common = ["--transfer-channel-type", kind, "--url", f"127.0.0.1:{url}", "--control-url", f"127.0.0.1:{control}",
              "--page-size", str(page), "--object-size", str(object_size), "--num-objects", str(objects)]
    launcher = [python, "-m", "kvferry.lmcache", "benchmark"]
    tag = f"{channel}-{object_size}"
    server_log = logs / f"{tag}-server.log"
    buffer = sources * object_size + 64 * MIB
    server = subprocess.Popen(
        [*launcher, "--role", "server", *common, "--buffer-size", str(buffer), "--num-source-objects", str(sources),
         "--server-timeout", "900"],
        stdout=subprocess.PIPE, stderr=open(server_log, "wb"), text=True, env=env, start_new_session=True,
        # SIGINT ends the server's wait (KeyboardInterrupt), even when this script runs as a
        # background job, whose children inherit SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        assert server.stdout is not None
        while True:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"{tag}: the server never got ready; {server_log}")
            if select.select([server.stdout], [], [], 0.5)[0] and "[server] ready" in server.stdout.readline():
                break
        start = time.monotonic()
        client = subprocess.run(
            [*launcher, "--role", "client", *common, "--listen-url", f"127.0.0.1:{listen}", "--iters", str(iters),
             "--warmup", str(warmup), "--verify"],
            stdout=subprocess.PIPE, stderr=open(logs / f"{tag}-client.log", "wb"), text=True, env=env, timeout=1800,
        )
        wall = time.monotonic() - start
        out = client.stdout
        row = {"channel": channel, "transfer_channel_type": kind, "object_bytes": object_size, "page_bytes": page,
               "objects": objects, "read_bytes": objects * object_size, "iters": iters, "warmup": warmup,
               "ucx_tls": env.get("UCX_TLS") if "ucx" in channel else None, "client_wall_s": round(wall, 2),
               "verified": "verify OK" in out, "ok": client.returncode == 0}
        for stat in ("best", "median", "mean"):
            m = re.search(rf"{stat}\s*:\s*([\d.]+) ms\s+([\d.]+) GB/s", out)
            if m:
                row[f"{stat}_ms"], row[f"{stat}_gbps"] = float(m.group(1)), float(m.group(2))
        if not row["ok"]:
            row["error"] = (logs / f"{tag}-client.log").read_text(errors="replace").strip().splitlines()[-1:]
        return row
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--channels", default=",".join(c for c in CHANNELS if c != "kvferry-ucx-shm"))
    ap.add_argument("--sizes", default="4KB,64KB,1MB,16MB,64MB", help="object sizes of the sweep ('' for none)")
    ap.add_argument("--defaults", action="store_true", help="also the benchmark's defaults (10 MiB objects, 100 a read)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--logs", type=pathlib.Path, help="directory for the servers' and clients' logs (default: a temporary one)")
    ap.add_argument("--site", type=pathlib.Path, help="a directory holding the kvferry package to use instead of the built wheel")
    args = ap.parse_args()
    channels = [c for c in args.channels.split(",") if c]
    for c in channels:
        if c not in CHANNELS:
            sys.exit(f"unknown channel {c}; known: {', '.join(CHANNELS)}")

    configs = []
    if args.defaults:
        configs.append((10 * MIB, DEFAULT_PAGE, 100, 200))
    for size in (parse_size(s) for s in args.sizes.split(",") if s):
        objects = max(1, min(MAX_OBJECTS, READ_BYTES // size))
        configs.append((size, min(size, DEFAULT_PAGE), objects, 2 * objects))

    python = lmcache_python()
    with tempfile.TemporaryDirectory(prefix="kvferry-lmcache-bench-") as tmp:
        site = args.site or unpacked_wheel(pathlib.Path(tmp) / "site")
        logs = args.logs or pathlib.Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"PYTHONPATH": str(site), "LMCACHE_DISABLE_BANNER": "1", "KVFERRY_TOKEN": "bench",
                            "RUST_LOG": "kvferry=warn"}
        rows = []
        print(f"{'channel':<16} {'object':>8} {'page':>8} {'objects':>7} {'best GB/s':>9} {'median':>7} {'mean':>7}  verified",
              flush=True)
        for size, page, objects, sources in configs:
            for channel in channels:
                row = run_one(python, env, channel, size, page, objects, sources, args.iters, args.warmup, logs)
                rows.append(row)
                if row["ok"]:
                    print(f"{channel:<16} {human(size):>8} {human(page):>8} {objects:>7} {row['best_gbps']:>9.2f} "
                          f"{row['median_gbps']:>7.2f} {row['mean_gbps']:>7.2f}  {row['verified']}", flush=True)
                else:
                    print(f"{channel:<16} {human(size):>8} {human(page):>8} {objects:>7} failed: {row.get('error')}", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
        if any(not r["ok"] or not r["verified"] for r in rows):
            sys.exit(1)


if __name__ == "__main__":
    main()
