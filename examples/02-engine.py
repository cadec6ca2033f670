#!/usr/bin/env python3
"""An "engine" that drives two kvferry agents through their HTTP API (standard library only).

It starts a registry, a prefill agent and a decode agent from a kvferry binary (real
processes on 127.0.0.1, ports chosen by the OS and read from their listening lines), then plays
both engines for a few rooms. The prefill engine announces the first room in two token pieces
(chunked prefill) and attaches an aux payload. The decode engine asks for each room, long-polls
it, takes it and checks it. The agents run with --synthetic: the prefill fills its pages with a
pattern and the decode verifies every landed byte on take.

    cargo build --release && examples/02-engine.py [target/release/kvferry]
"""
import base64
import json
import os
import subprocess
import sys
import urllib.request

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/kvferry"


def start(*args):
    p = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return p, json.loads(p.stdout.readline())


def call(method, url, body=None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if os.environ.get("KVFERRY_TOKEN"):
        # Agents started with a token (they read KVFERRY_TOKEN) ask for it on their API.
        headers["authorization"] = f"Bearer {os.environ['KVFERRY_TOKEN']}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req) as r:
        return json.load(r)


procs = []
try:
    reg, line = start("bootstrap", "--host", "127.0.0.1", "--port", "0")
    procs.append(reg)
    common = ["--bootstrap", line["url"], "--model", "tiny", "--pool-pages", "128", "--synthetic"]
    pre, p = start("prefill", *common)
    dec, d = start("decode", *common)
    procs += [pre, dec]
    prefill, decode = p["api"], d["api"]
    for room, tokens in [(1, 100), (2, 16), (3, 999)]:
        call("POST", f"{decode}/v1/rooms/{room}", {"tokens": tokens})
        if room == 1:
            aux = base64.b64encode(b"first token: 42").decode()
            call("POST", f"{prefill}/v1/rooms/{room}/ready", {"tokens": tokens, "token_range": [0, 64]})
            call("POST", f"{prefill}/v1/rooms/{room}/ready",
                 {"tokens": tokens, "token_range": [64, tokens], "last": True, "aux": aux})
        else:
            call("POST", f"{prefill}/v1/rooms/{room}/ready", {"tokens": tokens})
        view = call("GET", f"{decode}/v1/rooms/{room}?wait_ms=10000")
        while view["state"] not in ("success", "failed", "aborted"):
            view = call("GET", f"{decode}/v1/rooms/{room}?wait_ms=10000")
        taken = call("POST", f"{decode}/v1/rooms/{room}/take")
        aux = base64.b64decode(taken["aux"]) if taken.get("aux") else b""
        print(f"room {room}: {taken['state']}, {taken['bytes']} bytes, verified {taken['verified']}, aux {aux!r}")
        assert taken["verified"], taken
    print("pool after the takes:", call("GET", f"{decode}/v1/pool"))
finally:
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(timeout=30)
