"""A vLLM v1 KV connector that only observes: it dumps the KV cache bytes of finished prefills.

Loaded out of tree by probe_kv.py through `kv_transfer_config`
(`kv_connector_module_path="kv_probe_connector"`, `kv_connector="KvProbeConnector"`,
`kv_connector_extra_config={"dump_dir": DIR}`); this directory must be on the PYTHONPATH of
vLLM's engine and worker processes.

- Scheduler side (engine core process): for every request flagged with
  `kv_transfer_params={"kvferry_probe_dump": true}` whose whole prompt is computed in the step
  being scheduled, puts (request id, block ids, prompt token ids) into the step's connector
  metadata; `request_finished` hands the request's block ids back to the client in
  `kv_transfer_params["kvferry_probe"]`, so the caller can cross-check them.
- Worker side: keeps the tensors from `register_kv_caches`; in `wait_for_save` (after the
  step's forward pass, metadata still bound) writes, for every layer and every block of such a
  request, the raw bytes of `kv_cache[layer][block]` to DIR/kv.bin and describes them in
  DIR/worker.json (offsets relative to layer 0's data_ptr, shapes, strides, the CPU attention
  ISA vLLM picked for the layers).

It never loads anything (`get_num_new_matched_tokens` is always 0) and never delays a free.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

PARAMS_KEY = "kvferry_probe"
DUMP_FLAG = "kvferry_probe_dump"


@dataclass
class DumpRequest:
    """One request whose prompt KV is complete after this step."""

    req_id: str
    block_ids: list[int]
    token_ids: list[int]


@dataclass
class ProbeMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    dumps: list[DumpRequest] = field(default_factory=list)


def layer_index(name: str) -> int:
    """The N of `model.layers.N.self_attn.attn` (names sort by it, not as strings)."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"kv probe: cannot find a layer index in {name!r}")
    return int(m.group(1))


class KvProbeConnector(KVConnectorBase_V1):
    """Observe-only connector: see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        dump_dir = extra.get("dump_dir")
        if not dump_dir:
            raise ValueError("kv probe: kv_connector_extra_config needs 'dump_dir'")
        self._dump_dir = str(dump_dir)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._dumped: set[str] = set()
        self._flagged: set[str] = set()

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Nothing is ever loaded from outside."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember flagged requests; their blocks reach build_connector_meta in the scheduler output."""
        if (request.kv_transfer_params or {}).get(DUMP_FLAG):
            self._flagged.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Ask the workers to dump flagged new requests whose whole prompt is computed in this step."""
        meta = ProbeMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._flagged:
                continue
            prompt = list(new.prompt_token_ids or [])
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if new.num_computed_tokens == 0 and scheduled >= len(prompt) > 0:
                meta.dumps.append(
                    DumpRequest(new.req_id, [int(b) for b in new.block_ids[0]], prompt)
                )
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Free at once; return a flagged request's block ids so the client can cross-check."""
        if request.request_id not in self._flagged:
            return False, None
        self._flagged.discard(request.request_id)
        return False, {PARAMS_KEY: {"block_ids": [int(b) for b in block_ids]}}

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep vLLM's own tensors (views, no copy)."""
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to load."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Dumps happen after the whole forward pass, in wait_for_save."""

    def wait_for_save(self) -> None:
        """After this step's forward pass: dump the requests the metadata names."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, ProbeMetadata):
            return
        for req in meta.dumps:
            if req.req_id not in self._dumped:
                self._dump(req)
                self._dumped.add(req.req_id)

    def _attention_isa(self) -> dict[str, str]:
        """The ISA string vLLM's CPU attention builder set on each attention layer."""
        ctx = self._vllm_config.compilation_config.static_forward_context
        return {
            name: str(getattr(ctx[name], "isa", "unknown"))
            for name in self._kv_caches
            if name in ctx
        }

    def _dump(self, req: DumpRequest) -> None:
        """Write every (layer, block) of `req` to kv.bin and describe the layout in worker.json."""
        if not self._kv_caches:
            raise RuntimeError("kv probe: wait_for_save before register_kv_caches")
        names = sorted(self._kv_caches, key=layer_index)
        base = self._kv_caches[names[0]].data_ptr()
        layers, extents = [], []
        os.makedirs(self._dump_dir, exist_ok=True)
        file_offset = 0
        with open(os.path.join(self._dump_dir, "kv.bin"), "wb") as out:
            for name in names:
                t = self._kv_caches[name]
                layers.append(describe_tensor(name, t, base))
                for b in req.block_ids:
                    raw = block_bytes(t, b)
                    out.write(raw)
                    extents.append(
                        {"offset": t[b].data_ptr() - base, "len": len(raw), "file_offset": file_offset}
                    )
                    file_offset += len(raw)
        first = self._kv_caches[names[0]]
        info = {
            "req_id": req.req_id,
            "block_ids": req.block_ids,
            "token_ids": req.token_ids,
            "layers": layers,
            "extents": extents,
            "element_size": first.element_size(),
            "dtype": str(first.dtype),
            "storage": {
                "nbytes": first.untyped_storage().nbytes(),
                "offset_of_layer0": base - first.untyped_storage().data_ptr(),
                "shared_by_all_layers": len(
                    {self._kv_caches[n].untyped_storage().data_ptr() for n in names}
                )
                == 1,
            },
            "isa": self._attention_isa(),
        }
        tmp = os.path.join(self._dump_dir, "worker.json.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(self._dump_dir, "worker.json"))


def describe_tensor(name: str, t: torch.Tensor, base: int) -> dict[str, Any]:
    """Name, byte offset from layer 0, shape and strides (elements) of one layer's KV tensor."""
    return {
        "name": name,
        "offset": t.data_ptr() - base,
        "shape": list(t.shape),
        "strides": list(t.stride()),
    }


def block_bytes(t: torch.Tensor, block: int) -> bytes:
    """The raw bytes of block `block` of a [num_blocks, ...] tensor, in memory order."""
    if not 0 <= block < t.shape[0]:
        raise IndexError(f"kv probe: block {block} outside 0..{t.shape[0]}")
    blk = t[block]
    if not blk.is_contiguous():
        raise ValueError("kv probe: a block is not one contiguous run of memory")
    return blk.view(torch.uint8).numpy().tobytes()
