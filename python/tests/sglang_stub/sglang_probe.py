"""A test-only SGLang plugin (``kvferry_sglang_probe-0.dist-info`` beside it makes SGLang find
it on ``PYTHONPATH``): it reads the KV of kvferry's rooms in SGLang's own buffers.

- ``KVFERRY_PROBE_DUMP=DIR``: when a prefill rank announces a room, the bytes of its pages are
  written to ``DIR/prefill-ROOM-tpRANK.bin``; when a decode room succeeded, the bytes that
  landed in its pages to ``DIR/decode-ROOM-tpRANK.bin``. Each lists, region by region in the
  agent's order (a layer's K then its V), each page's bytes in the room's page order.
- ``DIR/corrupt`` exists: a decode room's landed KV is overwritten with its bitwise complement
  before SGLang reads it (a negative control: the output must change).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
from typing import Any


def room_bytes(mgr: Any, pages: list[int]) -> bytes:
    from kvferry.sglang.backend import regions_of

    item = int(mgr.kv_args.kv_item_lens[0])
    out = bytearray()
    for ptr, _ in regions_of(mgr.kv_args, mgr.is_mla):
        for page in pages:
            out += ctypes.string_at(ptr + page * item, item)
    return bytes(out)


def complement(mgr: Any, pages: list[int]) -> None:
    from kvferry.sglang.backend import regions_of

    item = int(mgr.kv_args.kv_item_lens[0])
    for ptr, _ in regions_of(mgr.kv_args, mgr.is_mla):
        for page in pages:
            at = ptr + page * item
            data = ctypes.string_at(at, item)
            ctypes.memmove(at, bytes(b ^ 0xFF for b in data), item)


def dump(role: str, room: int, mgr: Any, data: bytes) -> None:
    where = os.environ.get("KVFERRY_PROBE_DUMP")
    if where:
        pathlib.Path(where, f"{role}-{room}-tp{mgr.kv_args.engine_rank}.bin").write_bytes(data)


def after_send(result: Any, sender: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    if sender.state == KVPoll.Transferring and not getattr(sender, "probed", False):
        sender.probed = True
        dump("prefill", sender.room, sender.kv_mgr, room_bytes(sender.kv_mgr, sender.pages))
    return result


def after_poll(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    if result == KVPoll.Success and not getattr(receiver, "probed", False):
        receiver.probed = True
        mgr = receiver.kv_mgr
        dump("decode", receiver.room, mgr, room_bytes(mgr, receiver.pages))
        where = os.environ.get("KVFERRY_PROBE_DUMP")
        if where and pathlib.Path(where, "corrupt").exists():
            complement(mgr, receiver.pages)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("kvferry.sglang.backend.KvferryKVSender.send", after_send, HookType.AFTER)
    HookRegistry.register("kvferry.sglang.backend.KvferryKVReceiver.poll", after_poll, HookType.AFTER)
