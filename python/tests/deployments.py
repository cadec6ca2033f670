"""Engine deployments shared by the whole test run, and the ceiling on what they cost.

An engine server takes most of a minute of both cores to start here (three Python processes
that each import torch and the engine), so the run starts each distinct deployment once:

- A **deployment** is a session fixture named in ``ORDER`` (conftest.py). The tests that use
  it run together, in ``ORDER``'s order, and it stops after the last of them
  (``Live.release``): a later deployment never shares the machine with an idle one.
- Every engine start of the run, in this process or in a script a test runs
  (scripts/vllm/bench.py, the quickstart's shell), goes into one **ledger**, a file named by
  ``KVFERRY_ENGINE_LEDGER`` (conftest.py sets it for the run). A start past ``CEILING``'s count
  of its engine, or one that would make more engines resident than ``CEILING["resident"]``,
  fails the test that asked for it, and the run prints the ledger's totals at its end.

``CEILING`` is the one place these limits live: a change that needs more raises them, and says
in its description how many minutes the extra starts cost.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import pathlib
from typing import Callable

# Cold starts per run of each engine, and engine servers running at once (a server of several
# TP or DP ranks is one). A start costs about 50 CPU-seconds, a vLLM server about 2.7 GB.
# vLLM: the fleet 4, its TP2 decode 1, its first prefill started again 1, its DP2xTP2 and TP4
# prefills 2, its four servers started again in turn and a decode that pairs with none 5,
# scripts/vllm/bench.py's smoke run 5, the quickstart 2, a decode with a small KV cache that
# preempts 1, the MLA model's TP2 prefill and TP1 and TP2 decodes 3, prefills and decodes of
# blocks of 32 and 64 tokens 4, the sliding-window model's prefill and decode 2, a decode of two
# DP ranks 1, a kv_both server 1. SGLang: the TP2/TP1 pair 2 and its prefill started again 1,
# the MLA pair 2, the quickstart 2, the fleet of two prefills and two decodes 4. (The
# references come from HF transformers, hf_reference.py, or from a prefill server alone.)
CEILING = {"vllm": 32, "sglang": 11, "resident": 5}
VARIABLE = "KVFERRY_ENGINE_LEDGER"


class CeilingExceeded(RuntimeError):
    """An engine start past the run's ceiling."""


def ledger() -> pathlib.Path | None:
    path = os.environ.get(VARIABLE)
    return pathlib.Path(path) if path else None


def _events(path: pathlib.Path) -> list[list[str]]:
    return [line.split(" ", 3) for line in path.read_text().splitlines() if line]


def totals(path: pathlib.Path) -> dict:
    """Starts per engine, engines resident now and at most, from a ledger's lines
    (``start KIND ID WHAT`` and ``stop KIND ID``)."""
    starts: dict[str, int] = {}
    live: set[str] = set()
    peak = 0
    for event in _events(path):
        if event[0] == "start":
            starts[event[1]] = starts.get(event[1], 0) + 1
            live.add(event[2])
            peak = max(peak, len(live))
        else:
            live.discard(event[2])
    return {"starts": starts, "resident": len(live), "peak": peak}


_SEQUENCE = itertools.count()


class Engine:
    """One engine server's entry in the ledger: written when it starts (refused past the
    ceiling), and once more when it stops (``stopped``, any number of calls)."""

    def __init__(self, kind: str, what: str) -> None:
        self.kind = kind
        # Unique in the run: an object's id() is reused once the object is gone.
        self.id = f"{os.getpid()}-{next(_SEQUENCE)}"
        self.open = False
        path = ledger()
        if path is None:
            return
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            now = totals(path)
            started = now["starts"].get(kind, 0) + 1
            if started > CEILING[kind]:
                raise CeilingExceeded(
                    f"{what}: {kind} cold start {started} of a run whose ceiling is {CEILING[kind]} "
                    f"(python/tests/deployments.py CEILING)")
            if now["resident"] + 1 > CEILING["resident"]:
                raise CeilingExceeded(
                    f"{what}: {now['resident'] + 1} engines resident at once, ceiling {CEILING['resident']} "
                    f"(python/tests/deployments.py CEILING)")
            f.write(f"start {kind} {self.id} {what}\n")
            self.open = True

    def stopped(self) -> None:
        path = ledger()
        if not self.open or path is None:
            return
        self.open = False
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(f"stop {self.kind} {self.id}\n")


class Live:
    """The deployments running now, each with what stops it."""

    def __init__(self) -> None:
        self.stops: dict[str, Callable[[], None]] = {}

    def add(self, name: str, stop: Callable[[], None]) -> None:
        self.stops[name] = stop

    def release(self, needed: set[str]) -> None:
        """Stops every running deployment that no test still to run needs."""
        for name in [n for n in self.stops if n not in needed]:
            self.stops.pop(name)()


LIVE = Live()
