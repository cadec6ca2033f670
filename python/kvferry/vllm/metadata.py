"""What the scheduler side tells the workers each step (pickled inside vLLM's SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Send:
    """Prefill: the request's prompt KV is complete; announce room ``room`` ready."""

    req_id: str
    room: int
    tokens: int
    pages: list[int]


@dataclass
class Load:
    """Decode: ask for room ``room`` into ``pages`` (the request's whole block table; blocks
    before ``start_token`` are the decode's own prefix-cache hits and do not move)."""

    req_id: str
    room: int
    tokens: int
    start_token: int
    pages: list[int]
    dp_rank: int | None
    bootstrap: str | None
    # What the prefill said the room holds, when it said it (sequential pairing).
    prefill_tokens: int | None = None


@dataclass
class Abort:
    """Decode: the client aborted the request while its room was loading."""

    req_id: str
    room: int


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    sends: list[Send] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    aborts: list[Abort] = field(default_factory=list)
