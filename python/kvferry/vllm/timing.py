"""The connector's own time and each room's stages, for measurements: with
``KVFERRY_VLLM_TIMING=1`` in a server's environment,

- each side of the connector adds up the time vLLM's thread spends in its hooks during a step
  (wall clock: what the hooks add to the step, the agent threads they wake included when those
  run on the same core), and logs every 64 steps (and at shutdown, when vLLM calls it) one line
  with the steps' count, total and largest: ``kvferry: connector time (worker): 64 steps, 12345
  us in all, 210 us at most``;
- a step that announced rooms (the prefill's forward pass that computed them) gets a line of its
  own: ``kvferry: connector time (worker) in a step announcing 128 tokens: 85 us``;
- each room that settles gets a line with the agent's timings of it (ms since the Unix epoch):
  ``kvferry: room 7 request cmpl-... timings {"created": ..., "ready": ..., "success": ...}``.

scripts/vllm/bench.py reads these lines. Off, a hook costs one attribute test (the connector
checks ``on`` before timing).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

REPORT_EVERY = 64
ON = os.environ.get("KVFERRY_VLLM_TIMING", "") not in ("", "0")


def log_room(req_id: str, room: int, view: dict[str, Any] | None) -> None:
    """A settled room's timings, as its agent recorded them."""
    if ON and view is not None:
        logger.info("kvferry: room %d request %s timings %s", room, req_id, json.dumps(view.get("timings") or {}))


class StepTimes:
    def __init__(self, side: str) -> None:
        self.on = ON
        self.side = side
        self.current = 0
        self.steps = 0
        self.total = 0
        self.most = 0

    # perf_counter, not the thread's CPU time: reading that clock is a system call, where the
    # kernel may hand the core to the agent threads a hook just woke (py-spy found most of the
    # hooks' samples there), so the CPU clock cost more than the hooks it measured.
    def start(self) -> int:
        return time.perf_counter_ns()

    def stop(self, started: int) -> None:
        self.current += time.perf_counter_ns() - started

    def step_done(self, meta: Any = None) -> None:
        """The step ended, with metadata ``meta`` (the rooms it announced, if any): its time
        joins the report."""
        if not self.on:
            return
        announced_tokens = sum(s.tokens for s in getattr(meta, "sends", ()))
        if announced_tokens:
            logger.info("kvferry: connector time (%s) in a step announcing %d tokens: %d us",
                        self.side, announced_tokens, self.current // 1000)
        self.steps += 1
        self.total += self.current
        self.most = max(self.most, self.current)
        self.current = 0
        if self.steps >= REPORT_EVERY:
            self.report()

    def report(self) -> None:
        if self.on and self.steps:
            logger.info(
                "kvferry: connector time (%s): %d steps, %d us in all, %d us at most",
                self.side, self.steps, self.total // 1000, self.most // 1000,
            )
            self.steps = self.total = self.most = 0
