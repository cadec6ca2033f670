"""The connector's own CPU time per engine step, for measurements: with ``KVFERRY_VLLM_TIMING=1``
in a server's environment, each side of the connector adds up the thread CPU time it spends in
vLLM's hooks during a step, and logs every 64 steps (and at shutdown, when vLLM calls it) one line with the steps'
count, total and largest: ``kvferry: connector CPU (worker): 64 steps, 12345 us in all, 210 us
at most``. scripts/vllm/bench.py reads these lines. Off, a hook costs one attribute test (the connector checks ``on`` before timing).
"""

from __future__ import annotations

import os
import time

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

REPORT_EVERY = 64


class StepTimes:
    def __init__(self, side: str) -> None:
        self.on = os.environ.get("KVFERRY_VLLM_TIMING", "") not in ("", "0")
        self.side = side
        self.current = 0
        self.steps = 0
        self.total = 0
        self.most = 0

    def start(self) -> int:
        return time.thread_time_ns()

    def stop(self, started: int) -> None:
        self.current += time.thread_time_ns() - started

    def step_done(self) -> None:
        """The step ended: its time joins the report."""
        if not self.on:
            return
        self.steps += 1
        self.total += self.current
        self.most = max(self.most, self.current)
        self.current = 0
        if self.steps >= REPORT_EVERY:
            self.report()

    def report(self) -> None:
        if self.on and self.steps:
            logger.info(
                "kvferry: connector CPU (%s): %d steps, %d us in all, %d us at most",
                self.side, self.steps, self.total // 1000, self.most // 1000,
            )
            self.steps = self.total = self.most = 0
