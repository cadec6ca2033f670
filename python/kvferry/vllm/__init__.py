"""``KvferryConnector``: a vLLM v1 KV connector (vLLM 0.32's connector API) that moves a prompt's
KV cache from a prefill server to a decode server through kvferry, straight between vLLM's own
KV tensors. docs/vllm.md says how to run it.

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_connector_extra_config": {"bootstrap": "http://HOST:PORT", ...}}'

``kv_both`` (NixlConnector's convention: every server of a fleet starts with one configuration)
runs both sides in one server: a scheduler side and an agent per worker for each role, and each
request goes to the side its ``kv_transfer_params`` name (``do_remote_decode`` and a router's
``kvferry_identify`` / ``kvferry_abort``: prefill; ``do_remote_prefill`` and
``kvferry_reason_of``: decode); a request with neither computes locally, as on a server without
a connector.

vLLM builds the connector once in its engine-core process (the scheduler side,
``scheduler.py``) and once per worker (the worker side, ``worker.py``: a kvferry agent over the
worker's KV cache). The scheduler side tells the workers each step which rooms to announce,
request or abort (``metadata.py``); the workers answer with the requests whose rooms settled.
The ``kv_transfer_params`` kvferry reads and writes are in ``params.py``; a model of several KV
cache groups (sliding windows beside full attention) moves as one room per group
(``groups.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

import vllm
from vllm.logger import init_logger

from .groups import Groups
from . import params as P
from .metadata import BothMetadata, Failures, KvferryMetadata
from .params import ConnectorConfig
from .scheduler import SchedulerSide
from .stats import KvferryPromMetrics, KvferryStats
from .timing import StepTimes
from .. import supported
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvferryConnector"]

logger = init_logger(f"vllm.{__name__}")


def aggregated(parts: Iterable[Any]) -> Any:
    """The workers' reports merged by their ``aggregate`` (None when no worker has one)."""
    present = [p for p in parts if p is not None]
    return functools.reduce(lambda a, b: a.aggregate(b), present) if present else None


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    # The worker side's class (a subclass may observe it).
    worker_side = WorkerSide

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # Another vLLM than the tested ones fails its start here, with what to install.
        supported.check("vllm", vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        if not (transfer.is_kv_producer or transfer.is_kv_consumer):
            raise ValueError(
                f"KvferryConnector: kv_role must be kv_producer (prefill), kv_consumer (decode) or kv_both, "
                f"not {transfer.kv_role}"
            )
        # vLLM runs each DP rank of a dense model as an engine of its own and resets its
        # parallel config's DP rank and size; data_parallel_index keeps the rank.
        parallel = vllm_config.parallel_config
        engine_dp_rank = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        config = ConnectorConfig.of(transfer.kv_connector_extra_config, str(transfer.engine_id), engine_dp_rank)
        # The roles this server plays: True for prefill, False for decode (kv_both: both, the
        # prefill first; each side's pinned ports by the agent's index, engine_options).
        roles = [r for r, on in ((True, transfer.is_kv_producer), (False, transfer.is_kv_consumer)) if on]
        self._both = len(roles) == 2
        self._schedulers: dict[bool, SchedulerSide] = {}
        self._workers: dict[bool, WorkerSide] = {}
        # kv_both: the side each request in flight went to (its params change on the way:
        # a decode request's do_remote_prefill is cleared once its room is asked for).
        self._side_of: dict[str, SchedulerSide | None] = {}
        if role == KVConnectorRole.SCHEDULER:
            groups = Groups.of(kv_cache_config)
            recompute = getattr(transfer, "kv_load_failure_policy", "fail") == "recompute"
            self._schedulers = {r: SchedulerSide(config, r, groups, recompute) for r in roles}
            if not getattr(vllm_config, "shutdown_timeout", 0):
                logger.warning(
                    "KvferryConnector: --shutdown-timeout is 0: on SIGTERM vLLM stops this engine at once, "
                    "failing the requests it runs and the rooms it holds for decodes; give "
                    "--shutdown-timeout (seconds) to drain them "
                    "(docs/operations.md, \"Draining and rolling upgrades\")")
        else:
            self._workers = {r: self.worker_side(vllm_config, kv_cache_config, config, r, len(roles)) for r in roles}
        self._times = StepTimes("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")

    def _timed(self, hook: Any, *args: Any) -> Any:
        if not self._times.on:
            return hook(*args)
        started = self._times.start()
        try:
            return hook(*args)
        finally:
            self._times.stop(started)

    # ---- scheduler side ------------------------------------------------------------------------

    def _side(self, request: Request) -> SchedulerSide | None:
        """The scheduler side of the request: this server's one, or with kv_both the one its
        ``kv_transfer_params`` name, the first time it is seen (None: no transfer, the request
        computes locally)."""
        if not self._both:
            return next(iter(self._schedulers.values()))
        req_id = request.request_id
        if req_id not in self._side_of:
            params = request.kv_transfer_params or {}
            if params.get("do_remote_decode") or P.IDENTIFY in params or P.ABORT in params:
                self._side_of[req_id] = self._schedulers[True]
            elif params.get("do_remote_prefill") or P.REASON_OF in params:
                self._side_of[req_id] = self._schedulers[False]
            else:
                self._side_of[req_id] = None
        return self._side_of[req_id]

    def on_new_request(self, request: Request) -> None:
        side = self._side(request)
        if side is not None:
            self._timed(side.on_new_request, request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._side(request)
        if side is None:
            return 0, False
        return self._timed(side.get_num_new_matched_tokens, request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        side = self._side(request)
        if side is not None:
            self._timed(side.update_state_after_alloc, request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._both:
            meta = self._timed(self._both_meta, scheduler_output)
        else:
            meta = self._timed(next(iter(self._schedulers.values())).build_connector_meta, scheduler_output)
        self._times.step_done(meta)
        return meta

    def _both_meta(self, scheduler_output: SchedulerOutput) -> BothMetadata:
        return BothMetadata(self._schedulers[True].build_connector_meta(scheduler_output),
                            self._schedulers[False].build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Request ids are unique: each side forgets only its own requests' rooms.
        for side in self._schedulers.values():
            self._timed(side.update_connector_output, connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self._side(request)
        self._side_of.pop(request.request_id, None)
        if side is None:
            return False, None
        return self._timed(side.request_finished, request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return any(side.has_pending_block_frees() for side in self._schedulers.values())

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # kv_both: both agents over the same tensors; vLLM gives each block to one request,
        # which one side at most sends from or loads into.
        for worker in self._workers.values():
            worker.register_kv_caches(kv_caches)

    def _meta(self, producer: bool | None = None) -> KvferryMetadata | None:
        """The step's metadata for the side of ``producer`` (None: this server's one role)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, BothMetadata):
            return meta.prefill if producer else meta.decode
        return meta if isinstance(meta, KvferryMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Every step, with or without a forward pass: rooms move in the background.
        for role, worker in self._workers.items():
            self._timed(worker.apply, self._meta(role))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: vLLM schedules a request only after its room landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        worker = self._workers.get(True)
        if worker is not None:
            self._timed(worker.save_layer, self._meta(True), layer_name)

    def wait_for_save(self) -> None:
        """Nothing waits: sends run in the agent while vLLM goes on."""
        for role, worker in self._workers.items():
            self._timed(worker.saved, self._meta(role))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for worker in self._workers.values():
            sent, landed = self._timed(worker.finished, finished_req_ids)
            sending |= sent
            recving |= landed
        self._times.step_done(self._get_connector_metadata() if self._times.on and self.has_connector_metadata() else None)
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> Failures | None:
        return aggregated(w.failure_report() for w in self._workers.values())

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad: set[int] = set()
        for worker in self._workers.values():
            bad |= self._timed(worker.load_errors)
        return bad

    # ---- vLLM's stats (stats.py) ---------------------------------------------------------------

    def get_kv_connector_stats(self) -> KvferryStats | None:
        return aggregated(w.stats.take() for w in self._workers.values())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvferryStats:
        return KvferryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._times.report()
        for worker in self._workers.values():
            worker.close()
