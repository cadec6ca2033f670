"""``KvferryConnector``: a vLLM v1 KV connector (vLLM 0.32's connector API) that moves a prompt's
KV cache from a prefill server to a decode server through kvferry, straight between vLLM's own
KV tensors. docs/vllm.md says how to run it.

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {"bootstrap": "http://HOST:PORT", ...}}'

vLLM builds the connector once in its engine-core process (the scheduler side,
``scheduler.py``) and once per worker (the worker side, ``worker.py``: a kvferry agent over the
worker's KV cache). The scheduler side tells the workers each step which rooms to announce,
request or abort (``metadata.py``); the workers answer with the requests whose rooms settled.
The ``kv_transfer_params`` kvferry reads and writes are in ``params.py``; a model of several KV
cache groups (sliding windows beside full attention) moves as one room per group
(``groups.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm.logger import init_logger

from .groups import Groups
from .metadata import Failures, KvferryMetadata
from .params import ConnectorConfig
from .scheduler import SchedulerSide
from .stats import KvferryPromMetrics, KvferryStats
from .timing import StepTimes
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


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    # The worker side's class (a subclass may observe it).
    worker_side = WorkerSide

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.is_kv_producer == transfer.is_kv_consumer:
            raise ValueError(
                f"KvferryConnector: kv_role must be kv_producer (prefill) or kv_consumer (decode), "
                f"not {transfer.kv_role}"
            )
        # vLLM runs each DP rank of a dense model as an engine of its own and resets its
        # parallel config's DP rank and size; data_parallel_index keeps the rank.
        parallel = vllm_config.parallel_config
        engine_dp_rank = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        config = ConnectorConfig.of(transfer.kv_connector_extra_config, str(transfer.engine_id), engine_dp_rank)
        producer = transfer.is_kv_producer
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(config, producer, Groups.of(kv_cache_config))
            if not getattr(vllm_config, "shutdown_timeout", 0):
                logger.warning(
                    "KvferryConnector: --shutdown-timeout is 0: on SIGTERM vLLM stops this engine at once, "
                    "failing the requests it runs and the rooms it holds for decodes; give "
                    "--shutdown-timeout (seconds) to drain them (docs/operations.md, \"Drain\")")
        else:
            self._worker = self.worker_side(vllm_config, kv_cache_config, config, producer)
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

    def on_new_request(self, request: Request) -> None:
        self._timed(self._scheduler.on_new_request, request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._timed(self._scheduler.get_num_new_matched_tokens, request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._timed(self._scheduler.update_state_after_alloc, request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._timed(self._scheduler.build_connector_meta, scheduler_output)
        self._times.step_done(meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._timed(self._scheduler.update_connector_output, connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._timed(self._scheduler.request_finished, request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._timed(self._scheduler.request_finished, request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler.has_pending_block_frees()

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def _meta(self) -> KvferryMetadata | None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta if isinstance(meta, KvferryMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Every step, with or without a forward pass: rooms move in the background.
        self._timed(self._worker.apply, self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: vLLM schedules a request only after its room landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._timed(self._worker.save_layer, self._meta(), layer_name)

    def wait_for_save(self) -> None:
        """Nothing waits: sends run in the agent while vLLM goes on."""
        self._timed(self._worker.saved, self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._timed(self._worker.finished, finished_req_ids)
        self._times.step_done(self._meta() if self._times.on else None)
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> Failures | None:
        return self._worker.failure_report()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._timed(self._worker.load_errors)

    # ---- vLLM's stats (stats.py) ---------------------------------------------------------------

    def get_kv_connector_stats(self) -> KvferryStats | None:
        return self._worker.stats.take() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvferryStats:
        return KvferryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._times.report()
        if self._worker is not None:
            self._worker.close()
