"""A test-only KvferryConnector (``vllm_servers.PROBE``; python/tests on the engine's
``PYTHONPATH``) that reads the KV of kvferry's rooms in vLLM's own cache: the MLA cache
(``vllm-mla``: per layer ``[blocks, block_size, latent]``) and the CPU cache on its ``vec`` path
(``vllm-cpu-vec``: per layer ``[blocks, kv_heads, block_size, 2 x head_size]``, each (block,
head) K ``[head_size][block_size]`` then V ``[block_size][head_size]``).

``KVFERRY_PROBE_DUMP=DIR``: when TP rank 0 of a prefill has announced every layer of a room,
the room's tokens go to ``DIR/prefill-ROOM.bin``; when a decode rank took a room that landed,
the tokens it loaded (from its first loaded token) to ``DIR/decode-ROOM-tpRANK.bin``, and that
first token to ``DIR/decode-ROOM-tpRANK.start`` and its KV cache group's sliding window (0 for
full attention) to ``DIR/decode-ROOM-tpRANK.window``. Each file is token after token, each token's
KV layer after layer (MLA: its latent; vec: each head's K then V), whatever the block size, so
a decode's file equals the prefill's from its start token on (rank 0's heads: compare TP1). A
model of several KV cache groups has a room, hence files, per group (groups.py), each over the
agent's layers.
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
    """Tokens ``start..end`` of every layer of the agent, from the blocks ``pages`` (the room's,
    from its token 0)."""
    block = worker.groups.block_size
    mla = worker.vllm_config.model_config.use_mla
    out = bytearray()
    for t in range(start, end):
        for layer in worker.layers:
            out += token_kv(layer, pages[t // block], t % block, mla).contiguous().numpy().tobytes()
    return bytes(out)


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class ProbeWorker(WorkerSide):
    def announce(self, s: Any, part: Any, layers: range | None) -> None:
        super().announce(s, part, layers)
        where = os.environ.get("KVFERRY_PROBE_DUMP")
        whole = layers is None or len(self.announced.get(part.room, ())) == self.num_layers
        if where and whole and tp_rank() == 0 and s.req_id in self.rooms:
            pathlib.Path(where, f"prefill-{part.room}.bin").write_bytes(rows(self, part.pages, 0, part.tokens))

    def take(self, req_id: str, room: int) -> None:
        load = self.loads.get(req_id)
        failed = set(self.failures)
        super().take(req_id, room)
        where = os.environ.get("KVFERRY_PROBE_DUMP")
        part = next((p for p in load.parts if p.room == room), None) if load is not None else None
        if where and part is not None and set(self.failures) == failed and req_id not in self.aborted:
            name = f"decode-{room}-tp{tp_rank()}"
            pathlib.Path(where, f"{name}.bin").write_bytes(rows(self, part.pages, part.start_token, part.tokens))
            pathlib.Path(where, f"{name}.start").write_text(str(part.start_token))
            window = self.groups.windows[load.parts.index(part)]
            pathlib.Path(where, f"{name}.window").write_text(str(window or 0))


class KvferryProbeConnector(KvferryConnector):
    worker_side = ProbeWorker
