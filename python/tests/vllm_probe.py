"""A test-only KvferryConnector (``vllm_servers.PROBE``; python/tests on the engine's
``PYTHONPATH``) that reads the KV of kvferry's rooms in vLLM's own MLA cache (``vllm-mla``: per
layer ``[blocks, block_size, latent]``, one row per token).

``KVFERRY_PROBE_DUMP=DIR``: when TP rank 0 of a prefill has announced every layer of a room,
the rows of the room's tokens go to ``DIR/prefill-ROOM.bin``; when a decode rank took a room
that landed, the rows it loaded (from its first loaded token) to ``DIR/decode-ROOM-tpRANK.bin``,
and that first token to ``DIR/decode-ROOM-tpRANK.start``. Each file is layer after layer, each
layer's rows in token order, so a decode's file equals the prefill's from its start token on.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from kvferry.vllm import KvferryConnector
from kvferry.vllm.worker import WorkerSide


def rows(worker: WorkerSide, pages: list[int], start: int, end: int) -> bytes:
    """Tokens ``start..end`` of every layer, from the blocks ``pages`` (the room's, from token 0)."""
    out = bytearray()
    for name in sorted(worker.tensors, key=worker.positions.__getitem__):
        layer = worker.tensors[name]
        block = layer.shape[-2]
        flat = layer.reshape(-1, layer.shape[-1])
        for t in range(start, end):
            out += flat[pages[t // block] * block + t % block].numpy().tobytes()
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
