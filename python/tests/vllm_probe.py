"""A test-only KvferryConnector (``vllm_servers.PROBE``; python/tests on the engine's
``PYTHONPATH``) that reads the KV of kvferry's rooms in vLLM's own cache: the MLA cache
(``vllm-mla``: per layer ``[blocks, block_size, latent]``) and the CPU cache on its ``vec`` path
(``vllm-cpu-vec``: per layer ``[blocks, kv_heads, block_size, 2 x head_size]``, each (block,
head) K ``[head_size][block_size]`` then V ``[block_size][head_size]``).

``KVFERRY_PROBE_DUMP=DIR``: when TP rank 0 of a prefill has announced every layer of a room,
the room's tokens go to ``DIR/prefill-ROOM.bin``; when a decode rank took a room that landed,
the tokens it loaded (from its first loaded token) to ``DIR/decode-ROOM-tpRANK.bin``, and that
first token to ``DIR/decode-ROOM-tpRANK.start``. Each file is token after token, each token's
KV layer after layer (MLA: its latent; vec: each head's K then V), whatever the block size, so
a decode's file equals the prefill's from its start token on (rank 0's heads: compare TP1).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch

from kvferry.vllm import KvferryConnector
from kvferry.vllm.worker import WorkerSide


def token_kv(layer: torch.Tensor, page: int, slot: int, mla: bool) -> torch.Tensor:
    """One token's KV in one layer, as a flat tensor."""
    if mla:
        return layer.reshape(-1, layer.shape[-1])[page * layer.shape[-2] + slot]
    _, heads, block, two_dims = layer.shape
    dims = two_dims // 2
    runs = layer[page].reshape(heads, 2, block * dims)
    k = runs[:, 0].reshape(heads, dims, block)[:, :, slot]
    v = runs[:, 1].reshape(heads, block, dims)[:, slot]
    return torch.cat([k, v], dim=1).reshape(-1)


def rows(worker: WorkerSide, pages: list[int], start: int, end: int) -> bytes:
    """Tokens ``start..end`` of every layer, from the blocks ``pages`` (the room's, from token 0)."""
    layers = [worker.tensors[n] for n in sorted(worker.tensors, key=worker.positions.__getitem__)]
    block = worker.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    mla = worker.vllm_config.model_config.use_mla
    out = bytearray()
    for t in range(start, end):
        for layer in layers:
            out += token_kv(layer, pages[t // block], t % block, mla).contiguous().numpy().tobytes()
    return bytes(out)


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class ProbeWorker(WorkerSide):
    def announce(self, s: Any, layers: range | None) -> None:
        super().announce(s, layers)
        where = os.environ.get("KVFERRY_PROBE_DUMP")
        whole = layers is None or len(self.announced.get(s.room, ())) == self.num_layers
        if where and whole and tp_rank() == 0 and s.req_id in self.rooms:
            pathlib.Path(where, f"prefill-{s.room}.bin").write_bytes(rows(self, s.pages, 0, s.tokens))

    def take(self, req_id: str, room: int) -> None:
        load = self.loads.get(req_id)
        super().take(req_id, room)
        where = os.environ.get("KVFERRY_PROBE_DUMP")
        if where and load is not None and room not in self.failures:
            name = f"decode-{room}-tp{tp_rank()}"
            pathlib.Path(where, f"{name}.bin").write_bytes(rows(self, load.pages, load.start_token, load.tokens))
            pathlib.Path(where, f"{name}.start").write_text(str(load.start_token))


class KvferryProbeConnector(KvferryConnector):
    worker_side = ProbeWorker
