"""kvferry's rooms in SGLang's own metrics (``--enable-metrics``): SGLang serves every metric its
processes write to its multiprocess directory on the server's ``/metrics``, and every scheduler
rank's manager writes these there, as SGLang's own per-request series (label ``tp_rank``):

- ``sglang:kvferry_room_seconds`` and ``sglang:kvferry_room_bytes``: histograms of the rooms
  that succeeded on this rank, their transfer's seconds (:func:`transfer_seconds`; a room
  without them is left out of this one) and this rank's bytes;
- ``sglang:kvferry_failed_rooms_total``: a counter of the rooms that did not, by failure code
  (``code``): kvferry's room failure codes, ``aborted`` for a request SGLang aborted,
  ``another_rank`` for a room that failed because another TP rank's did (that rank counts it
  under its own code), ``untrusted_registry``, ``bad_address`` and ``bad_route`` for a request
  naming no usable prefill, and an agent's refusal by its exception's name (``Conflict``...).
  Every code but the refusals' is exposed from the start, at 0.

Each series is labelled with the model, the role and the rank (``tp_rank``, ``dp_rank``). A
prefill's rooms also reach SGLang's own ``sglang:kv_transfer_latency_ms`` and
``sglang:kv_transfer_speed_gb_s``: a sender's transfer metric carries the room's seconds."""

from __future__ import annotations

from typing import Any

from .. import FAILURE_CODES
from ..rooms import RoomState, room_seconds

LABELS = ["model_name", "role", "tp_rank", "dp_rank"]

# Failure codes of this backend's own besides the rooms' (FAILURE_CODES).
BACKEND_CODES = ["another_rank", "untrusted_registry", "bad_address", "bad_route"]


def transfer_seconds(view: dict[str, Any]) -> float:
    """Seconds from a room's transfer start (``transferring``: the prefill has the decode's
    request and its KV is ready; the decode's first bytes are on their way) to its success. The
    room's life before (SGLang computing the prefill, a decode waiting for it) is not counted."""
    return room_seconds(view, since=RoomState.TRANSFERRING)


# The process's series, made by its first manager (prometheus_client refuses a name twice in
# one process, and a process may hold more than one manager).
SERIES: dict[str, Any] = {}


def series() -> dict[str, Any]:
    if not SERIES:
        # Imported once SGLang set PROMETHEUS_MULTIPROC_DIR (it did before making schedulers).
        from prometheus_client import Counter, Histogram

        SERIES["seconds"] = Histogram(
            "sglang:kvferry_room_seconds",
            "Seconds from a kvferry room's transfer start to its success (rooms that succeeded).",
            LABELS,
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        )
        SERIES["bytes"] = Histogram(
            "sglang:kvferry_room_bytes",
            "KV bytes of each kvferry room that succeeded.",
            LABELS,
            buckets=[2.0 ** (12 + 2 * i) for i in range(12)],
        )
        SERIES["failed"] = Counter(
            "sglang:kvferry_failed_rooms",
            "kvferry rooms that did not succeed, by failure code.",
            LABELS + ["code"],
        )
    return SERIES


class Metrics:
    """One rank's kvferry series; nothing is written unless SGLang serves metrics."""

    def __init__(self, server_args: Any, role: str, tp_rank: int, dp_rank: int) -> None:
        self.on = bool(getattr(server_args, "enable_metrics", False))
        if not self.on:
            return
        model = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", "")
        self.labels = dict(model_name=str(model), role=role, tp_rank=str(tp_rank), dp_rank=str(dp_rank))
        self.series = series()
        for code in [*FAILURE_CODES, *BACKEND_CODES]:
            self.series["failed"].labels(**self.labels, code=code)

    def succeeded(self, seconds: float, size: int) -> None:
        if self.on:
            if seconds > 0:
                # SGLang's own transfer latency leaves such a room out too.
                self.series["seconds"].labels(**self.labels).observe(seconds)
            self.series["bytes"].labels(**self.labels).observe(size)

    def failed_with(self, code: str) -> None:
        if self.on:
            self.series["failed"].labels(**self.labels, code=code).inc()
