"""Waiting in a test for what another process does: ``wait_for`` polls a condition until it
holds and says how long that took, or fails naming what never happened within its bound (a
bound far above what the condition needs on a loaded machine, never a window it must hit)."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(what: str, check: Callable[[], object], bound: float = 300, every: float = 0.05) -> float:
    """Seconds until ``check()`` is true, polled every ``every`` seconds; fails after ``bound``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < bound, f"{what}: not after {bound} s"
        time.sleep(every)
    return time.monotonic() - start
