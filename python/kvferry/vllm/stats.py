"""kvferry's transfers in vLLM's own stats. Each worker counts the rooms that settled since vLLM
last asked (``KvferryConnector.get_kv_connector_stats``): for each room that succeeded, its bytes
and its seconds from the agent's first mark to success; for the others, their failure code.
vLLM adds up the workers' counts, writes them on its "KV Transfer metrics" log line and observes
them into ``vllm:kvferry_*`` metrics on its /metrics, one series per engine (and failure code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvferry import FAILURE_CODES

from ..rooms import RoomState, failure_code, room_seconds

# Failure codes counted besides the rooms' own (FAILURE_CODES): a decode room gone before its
# engine took it.
EXPIRED = "expired"


@dataclass
class KvferryStats(KVConnectorStats):
    """``data``: ``bytes`` and ``seconds``, one entry per room that succeeded, and ``failures``,
    rooms that did not by failure code (plain lists and dicts: vLLM sends them between
    processes)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"bytes": [], "seconds": [], "failures": {}}

    def settled(self, view: dict[str, Any]) -> None:
        """A room's final view, as an agent gives it (``poll``, ``take``)."""
        if view.get("state") == RoomState.SUCCESS:
            self.data["bytes"].append(int(view.get("bytes") or 0))
            self.data["seconds"].append(room_seconds(view))
        else:
            self.failed(failure_code(view))

    def failed(self, code: str) -> None:
        failures = self.data["failures"]
        failures[code] = failures.get(code, 0) + 1

    def aggregate(self, other: KVConnectorStats) -> KvferryStats:
        if not other.is_empty():
            self.data["bytes"] += other.data["bytes"]
            self.data["seconds"] += other.data["seconds"]
            for code, n in other.data["failures"].items():
                self.data["failures"][code] = self.data["failures"].get(code, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        rooms, seconds = len(self.data["bytes"]), self.data["seconds"]
        total = sum(self.data["bytes"])
        busy = sum(seconds)
        return {
            "rooms": rooms,
            "failed rooms": sum(self.data["failures"].values()),
            "MB": round(total / 1e6, 3),
            "avg room ms": round(1000 * busy / rooms, 3) if rooms else 0.0,
            "max room ms": round(1000 * max(seconds, default=0.0), 3),
            "MB/s per room": round(total / 1e6 / busy, 3) if busy else 0.0,
        }

    def is_empty(self) -> bool:
        return not self.data["bytes"] and not self.data["failures"]

    def take(self) -> KvferryStats | None:
        """What was counted since the last take (None if nothing), counting anew."""
        if self.is_empty():
            return None
        taken = KvferryStats(data=self.data)
        self.reset()
        return taken


class KvferryPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvferry_room_seconds`` and ``vllm:kvferry_room_bytes`` (histograms of the rooms
    that succeeded) and ``vllm:kvferry_failed_rooms`` (a counter by failure code, ``code``:
    every room failure code and ``expired`` exposed from the start), per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = self._histogram_cls(
            name="vllm:kvferry_room_seconds",
            documentation="Seconds from a kvferry room's start to its success (rooms that succeeded).",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
            labelnames=labelnames,
        )
        size = self._histogram_cls(
            name="vllm:kvferry_room_bytes",
            documentation="KV bytes of each kvferry room that succeeded.",
            buckets=[2.0 ** (12 + 2 * i) for i in range(12)],
            labelnames=labelnames,
        )
        failed = self._counter_cls(
            name="vllm:kvferry_failed_rooms",
            documentation="kvferry rooms that did not succeed, by failure code.",
            labelnames=[*labelnames, "code"],
        )
        self.seconds = create_metric_per_engine(seconds, per_engine_labelvalues)
        self.size = create_metric_per_engine(size, per_engine_labelvalues)
        self.failed_rooms = failed
        self.engines = per_engine_labelvalues
        for engine in per_engine_labelvalues:
            for code in [*FAILURE_CODES, EXPIRED]:
                self.failed(engine, code)

    def failed(self, engine_idx: int, code: str) -> Any:
        """The failed-rooms counter of an engine and a failure code."""
        return self.failed_rooms.labels(*self.engines[engine_idx], code)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for s in transfer_stats_data["seconds"]:
            self.seconds[engine_idx].observe(s)
        for b in transfer_stats_data["bytes"]:
            self.size[engine_idx].observe(b)
        for code, n in transfer_stats_data["failures"].items():
            self.failed(engine_idx, code).inc(n)
