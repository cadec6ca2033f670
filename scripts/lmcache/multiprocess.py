"""scripts/lmcache/multiprocess's checks: free ports, the requests to the two vLLM servers, the
kvferry agents' metrics and the comparison of the two LMCache servers' L1 arenas.

Usage (run with the LMCache venv's python: it needs numpy):
  multiprocess.py ports N
      N distinct free ports of 127.0.0.1 (each bound to port 0 at once, then released).
  multiprocess.py direction SRC DST TAG OUT
      SRC and DST are NAME,VLLM_PORT,SERVER_LOG,SERVER_PID. One prompt (TAG makes it unique) is
      computed on SRC's vLLM, then sent twice to DST's: both times DST's LMCache server must find
      its chunks at SRC's (a "retained keys (... L2)" line), SRC's prefill agent must have sent
      exactly the bytes DST's decode agent received (more than 0, every room a success), DST's
      answer must be SRC's token for token, and after the first fetch every object that changed
      in DST's L1 arena must be byte for byte a page-aligned span of SRC's arena (both read
      through /proc/PID/mem at the address the channel logs). Writes the figures to OUT (JSON);
      exits 1 if a check failed.
  multiprocess.py summary OUT...
      One line per direction and fetch from the OUT files; exits 1 if any check failed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request

import numpy as np

from bench import free_ports  # scripts/lmcache/bench.py, beside this file

# An 889-token prompt of the tiny model: 3 whole LMCache chunks of 256 tokens.
BASE = (
    "Prefill computes the KV cache of a prompt; decode extends it one token at a time. "
    "A page of KV cache holds the keys and values of a fixed number of tokens. "
    "Rotary embeddings turn each key by an angle that grows with its position. "
)
REPEAT = 17
NEW_TOKENS = 16
REQUEST_TIMEOUT_S = 300
# How long LMCache's log line and the agents' counters may lag behind the answer.
SETTLE_S = 10
ANSI = re.compile(r"\x1b\[[0-9;]*m")
CHANNEL = re.compile(
    r"kvferry transfer channel on \S+ \(advertised (\S+)\): registry \S+, (\d+) pages of (\d+) bytes at "
    r"(0x[0-9a-f]+); prefill agent api (\S+), decode agent api (\S+) \(data (\S+?)\)"
)
RETAINED = re.compile(r"(\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\) in ([0-9.]+) ms")


class Side:
    """One vLLM server and its LMCache server: NAME,VLLM_PORT,SERVER_LOG,SERVER_PID."""

    def __init__(self, spec: str):
        self.name, port, self.log, pid = spec.split(",")
        self.port, self.pid = int(port), int(pid)
        m = CHANNEL.findall(self.text())
        if not m:
            raise SystemExit(f"{self.name}: no 'kvferry transfer channel on' line in {self.log}")
        adv, pages, page, ptr, self.prefill_api, self.decode_api, self.data = m[-1]
        self.pages, self.page, self.ptr = int(pages), int(page), int(ptr, 16)

    def text(self, start: int = 0) -> str:
        with open(self.log, "rb") as f:
            f.seek(start)
            return ANSI.sub("", f.read().decode(errors="replace"))

    def log_size(self) -> int:
        return os.path.getsize(self.log)

    def complete(self, prompt: str) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t = time.monotonic()
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            got = json.load(r)
        choice = got["choices"][0]
        return {"s": round(time.monotonic() - t, 3), "prompt_tokens": got["usage"]["prompt_tokens"],
                "text": choice["text"], "tokens": choice["logprobs"]["tokens"]}

    def arena(self) -> dict[int, bytes]:
        """The arena's non-zero pages (index: bytes)."""
        nz: dict[int, bytes] = {}
        step = 16384  # pages a read
        with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as f:
            for p0 in range(0, self.pages, step):
                n = min(step, self.pages - p0)
                f.seek(self.ptr + p0 * self.page)
                buf = np.frombuffer(f.read(n * self.page), dtype=np.uint8).reshape(n, self.page)
                for i in np.flatnonzero(buf.any(axis=1)):
                    nz[p0 + int(i)] = buf[i].tobytes()
        return nz


def metric(api: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` at an agent's /metrics."""
    with urllib.request.urlopen(api.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def counters(src: Side, dst: Side) -> dict[str, float]:
    return {
        "sent": metric(src.prefill_api, "kvferry_kv_bytes_total", direction="sent"),
        "received": metric(dst.decode_api, "kvferry_kv_bytes_total", direction="received"),
        "rooms": metric(dst.decode_api, "kvferry_rooms_total", state="success"),
        "failed_rooms": metric(dst.decode_api, "kvferry_rooms_total")
        - metric(dst.decode_api, "kvferry_rooms_total", state="success"),
    }


def runs(pages: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for p in sorted(pages):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out


def arena_check(src: Side, dst: Side, before: dict[int, bytes], object_pages: int) -> tuple[bool, str]:
    """Every object that changed in DST's arena since ``before`` is a page-aligned span of SRC's."""
    after = dst.arena()
    changed = [p for p, data in after.items() if before.get(p) != data]
    theirs = src.arena()
    index: dict[bytes, list[int]] = {}
    for p, data in theirs.items():
        index.setdefault(data, []).append(p)
    found = missing = 0
    for s0, e0 in runs(changed):
        for s in range(s0, e0, object_pages):
            e = min(s + object_pages, e0)
            hit = any(all(theirs.get(q + k) == after[s + k] for k in range(e - s)) for q in index.get(after[s], []))
            found, missing = found + hit, missing + (not hit)
    ok = found > 0 and missing == 0
    return ok, (f"{found + missing} objects ({len(changed)} pages of {dst.page} bytes) changed in {dst.name}'s arena, "
                f"{found} byte-identical to a span of {src.name}'s, {missing} not found")


def new_retained(side: Side, start: int) -> tuple[int, float] | None:
    """The last prefetch after byte ``start`` of the log that found keys in L2: (keys, ms)."""
    hits = [m for m in RETAINED.finditer(side.text(start)) if int(m.group(4)) > 0]
    return (int(hits[-1].group(4)), float(hits[-1].group(5))) if hits else None


def direction(src: Side, dst: Side, tag: str) -> dict:
    transport = os.environ.get("KVFERRY_TRANSPORT", "zmq-tcp")
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    scheme = "ucx" if transport == "ucx" else "tcp://"
    for side in (src, dst):
        check(side.data.startswith(scheme), f"{side.name}'s decode agent moves data over {transport} ({side.data[:40]})")
    prompt = f"[{tag}] " + BASE * REPEAT
    print(f"{src.name} -> {dst.name}: prompt {tag} on {src.name} (computes it)", flush=True)
    ref = src.complete(prompt)
    print(f"  {ref['prompt_tokens']} prompt tokens, answered in {ref['s']} s", flush=True)
    fetches = []
    for i in (1, 2):
        before = dst.arena() if i == 1 else None
        c0, start = counters(src, dst), dst.log_size()
        print(f"{src.name} -> {dst.name}: prompt {tag} on {dst.name}, fetch {i}", flush=True)
        got = dst.complete(prompt)
        deadline = time.monotonic() + SETTLE_S
        while True:
            retained, c1 = new_retained(dst, start), counters(src, dst)
            moved = {k: c1[k] - c0[k] for k in c1}
            if (retained and moved["sent"] == moved["received"] > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        fetch = {"fetch": i, "request_s": got["s"], "bytes": moved["received"], "sent": moved["sent"],
                 "rooms": moved["rooms"], "l2_keys": retained[0] if retained else 0,
                 "fetch_ms": retained[1] if retained else None, "identical": got["tokens"] == ref["tokens"]}
        check(retained is not None, f"{dst.name}'s LMCache found the prompt's chunks at its peer: "
              + (f"{retained[0]} keys in L2, fetched in {retained[1]} ms" if retained else "no 'retained keys (... L2)' line"))
        check(moved["sent"] == moved["received"] > 0,
              f"{src.name}'s prefill agent sent {moved['sent']:.0f} bytes, {dst.name}'s decode agent received "
              f"{moved['received']:.0f} in {moved['rooms']:.0f} rooms")
        check(moved["failed_rooms"] == 0, f"{dst.name}'s decode agent: {moved['failed_rooms']:.0f} rooms not a success")
        check(fetch["identical"], f"{dst.name}'s answer is {src.name}'s token for token ({len(got['tokens'])} tokens)")
        if i == 1 and before is not None and moved["rooms"] > 0:
            object_pages = max(1, int(moved["received"] // moved["rooms"] // dst.page))
            ok, what = arena_check(src, dst, before, object_pages)
            check(ok, what)
            fetch["arena_identical"] = ok
        fetches.append(fetch)
    return {"src": src.name, "dst": dst.name, "tag": tag, "transport": transport, "prompt_tokens": ref["prompt_tokens"],
            "fetches": fetches, "failures": failures}


def summary(paths: list[str]) -> int:
    failed = 0
    for path in paths:
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            print(f"{path}: no result ({e})")
            failed += 1
            continue
        for f in d["fetches"]:
            arena = {True: ", arena byte-identical", False: ", arena DIFFERS"}.get(f.get("arena_identical"), "")
            print(f"{d['transport']:7} {d['src']} -> {d['dst']} fetch {f['fetch']}: {f['l2_keys']} chunks, "
                  f"{f['bytes']:.0f} bytes in {f['rooms']:.0f} rooms, LMCache fetch {f['fetch_ms']} ms, "
                  f"request {f['request_s']} s, token-identical {'yes' if f['identical'] else 'NO'}{arena}")
        for what in d["failures"]:
            print(f"  FAILED: {what}")
        failed += bool(d["failures"])
    print("PASS" if not failed else "FAIL")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["ports"] and len(argv) == 2:
        print(" ".join(map(str, free_ports(int(argv[1])))))
        return 0
    if argv[:1] == ["direction"] and len(argv) == 5:
        result = direction(Side(argv[1]), Side(argv[2]), argv[3])
        with open(argv[4], "w") as f:
            json.dump(result, f, indent=1)
        return 1 if result["failures"] else 0
    if argv[:1] == ["summary"]:
        return summary(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
