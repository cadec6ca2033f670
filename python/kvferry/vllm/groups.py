"""vLLM's KV cache groups as kvferry rooms: one room per group and request.

A model that mixes full and sliding-window attention layers (Gemma 2 and 3, Mistral-style
windows) gets several KV cache groups from vLLM's hybrid allocator: each group's layers have a
block table of their own, and every group lies over the same buffer (layer ``j`` of each group
at one place, ``KVCacheTensor``s of one offset and strides; a block belongs to one group at a
time). kvferry's agent sees that buffer as ``j`` layers, the model's layers per group, and a
request's KV moves as one room per group over those layers, with that group's blocks. A model
of one group moves as before: its one room is the router's.

A model with a sliding window moves its prompt but the last token (``room_tokens``): the decode
computes the rest, from the token at the room's end, whose window starts at token
``tokens + 1 - window`` (a room of the whole prompt would have the decode recompute its last
token, attending one token further back than vLLM keeps for a prompt it has whole). A
sliding-window group's room starts at the block holding that token: vLLM frees (on the prefill)
and never allocates (on the decode) the blocks before a window, leaving its empty block in the
block table, and neither side frees a block the token at the room's end attends to (the
prefill's last step began before it). So both sides cut the group's blocks at block
``(tokens + 1 - window) // block_size`` without asking each other, and the decode starts the
room at the first block it holds from there.

Both sides derive a group's room from the router's (the first group's is the router's own), so
a proxy or router sees one room per request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

# The block vLLM puts in a block table where a sliding window freed or skipped one (its block
# pool's first block, never handed out).
NULL_BLOCK = 0


class GroupsError(ValueError):
    """vLLM's KV cache groups that kvferry cannot move."""


@dataclass(frozen=True)
class Part:
    """One group's room of a request: ``tokens`` tokens from the group's cut on, held in
    ``pages``; the decode asks from ``start_token`` (its prefix-cache hits and empty blocks
    before it do not move)."""

    room: int
    tokens: int
    pages: list[int]
    start_token: int = 0


@dataclass(frozen=True)
class Groups:
    """The KV cache groups of an engine: their block size, and each one's sliding window (None
    for full attention)."""

    block_size: int
    windows: tuple[int | None, ...]
    # Several groups: model layer name -> (group, the layer's place in the agent's layers),
    # and the agent's layers (the model's layers per group). One group: empty and 0.
    places: dict[str, tuple[int, int]]
    layers: int

    @classmethod
    def of(cls, kv_cache_config: Any) -> Groups:
        """The groups of ``kv_cache_config``; GroupsError for groups kvferry cannot move: other
        than full or sliding-window attention, of different shapes, or not overlaying one
        buffer layer for layer."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        groups = kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        windows: list[int | None] = []
        for g, spec in enumerate(specs):
            if isinstance(spec, SlidingWindowSpec):
                windows.append(int(spec.sliding_window))
            elif isinstance(spec, FullAttentionSpec) and getattr(spec, "sliding_window", None) is None:
                windows.append(None)
            else:
                raise GroupsError(
                    f"KvferryConnector: KV cache group {g} is {type(spec).__name__}: kvferry moves full "
                    "attention, and sliding windows beside it"
                )
        if len(groups) == 1:
            # The model's own layers, in its order (the worker's KV cache names give it).
            return cls(specs[0].block_size, tuple(windows), {}, 0)
        shape = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs}
        if len(shape) != 1:
            raise GroupsError(f"KvferryConnector: KV cache groups of different shapes {sorted(map(str, shape))}")
        tensors = list(kv_cache_config.kv_cache_tensors)
        placement = {(t.offset, t.layer_stride, t.block_stride, len(t.layers)) for t in tensors}
        if len(tensors) != len(groups) or len(placement) != 1:
            raise GroupsError(
                f"KvferryConnector: {len(groups)} KV cache groups in {len(tensors)} tensors of placements "
                f"{sorted(placement)}: kvferry moves groups that overlay one buffer layer for layer"
            )
        places: dict[str, tuple[int, int]] = {}
        for t in tensors:
            owner = {g for g, group in enumerate(groups) if set(t.layers) <= set(group.layer_names)}
            if len(owner) != 1:
                raise GroupsError(f"KvferryConnector: a KV cache tensor holds layers of several groups: {t.layers}")
            g = owner.pop()
            places.update((name, (g, j)) for j, name in enumerate(t.layers))
        return cls(specs[0].block_size, tuple(windows), places, len(tensors[0].layers))

    def rooms(self, room: int) -> list[int]:
        """The rooms of a request whose router named ``room``, one per group."""
        return [room] + [derived_room(room, g) for g in range(1, len(self.windows))]

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def room_tokens(self, prompt_tokens: int) -> int:
        """The tokens a room of a prompt of ``prompt_tokens`` tokens (the prefill's) holds: all
        of them, or with a sliding window all but the last (0: nothing moves)."""
        return prompt_tokens - 1 if self.sliding else prompt_tokens

    def cut(self, group: int, tokens: int) -> int:
        """The first block of ``group`` a room of ``tokens`` tokens carries."""
        window = self.windows[group]
        return 0 if window is None else max(0, tokens + 1 - window) // self.block_size

    def parts(self, room: int, tokens: int, block_ids: Any, start_token: int | None = None) -> list[Part]:
        """A request's rooms with their blocks (vLLM's block table per group) for ``tokens``
        tokens: the prefill's (``start_token`` None), or the decode's from ``start_token`` on
        (its own prefix-cache hits before). GroupsError where the prefill freed a block the
        decode attends to (a request that went on computing after its prompt)."""
        end = -(-tokens // self.block_size)
        parts = []
        for g, (r, ids) in enumerate(zip(self.rooms(room), block_ids)):
            cut = self.cut(g, tokens)
            pages = [int(b) for b in ids[cut:end]]
            held = next((i for i, b in enumerate(pages) if b != NULL_BLOCK), len(pages))
            if start_token is None and NULL_BLOCK in pages:
                raise GroupsError(
                    f"KvferryConnector: room {room}: blocks of the sliding window of KV cache group {g} "
                    "were freed before the room was sent"
                )
            start = 0 if start_token is None else max(start_token - cut * self.block_size, held * self.block_size, 0)
            parts.append(Part(r, tokens - cut * self.block_size, pages, start))
        return parts


def derived_room(room: int, group: int) -> int:
    """Group ``group``'s room of a request whose router named ``room``: a u64 both sides derive
    alike, as random as the router's."""
    digest = hashlib.blake2b(room.to_bytes(8, "little") + group.to_bytes(2, "little"), digest_size=8,
                             person=b"kvferry-group").digest()
    return int.from_bytes(digest, "little")
