"""What the scheduler side tells the workers each step (pickled inside vLLM's SchedulerOutput),
and what decode workers tell the scheduler side (``Failures``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .groups import Part


@dataclass
class Send:
    """Prefill: announce room ``room`` ready, as its ``parts`` (one room per KV cache group,
    groups.py). ``layered``: this step computes the rest of the prompt, and each layer is
    announced as vLLM saves it (the transfer overlaps the forward pass); otherwise the prompt
    KV is complete already and the room is announced whole."""

    req_id: str
    room: int
    tokens: int
    parts: list[Part]
    layered: bool = False
    # kvferry.prompt_digest of the prompt: a decode asking with another prompt is refused.
    digest: str | None = None


@dataclass
class Load:
    """Decode: ask for room ``room``, as its ``parts`` (one room per KV cache group, into the
    group's blocks; tokens before ``start_token`` are the decode's own prefix-cache hits and do
    not move)."""

    req_id: str
    room: int
    tokens: int
    start_token: int
    parts: list[Part]
    dp_rank: int | None
    bootstrap: str | None
    # What the prefill said the room holds, when it said it (sequential pairing).
    prefill_tokens: int | None = None
    # kvferry.prompt_digest of the prompt: the prefill refuses the room if it computed another.
    digest: str | None = None


@dataclass
class Hold:
    """The request of room ``room`` waits in vLLM's queue: the agent holds the room (each of its
    parts) until it is asked for (decode: its prefill keeps it past its TTL) or announced
    (prefill: the decodes that asked already keep waiting), or ``unholds`` names it.
    ``dp_rank`` and ``bootstrap``: the decode's prefill group."""

    room: int
    dp_rank: int | None
    bootstrap: str | None


@dataclass
class Abort:
    """The request ended while its room was in flight: aborted by its client while loading
    (decode), or ended abnormally after its layers were announced (prefill)."""

    req_id: str
    room: int


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    sends: list[Send] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    aborts: list[Abort] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    unholds: list[int] = field(default_factory=list)
    # The engine shuts down (SIGTERM): the agents tell the registry they drain.
    draining: bool = False


@dataclass
class BothMetadata(KVConnectorMetadata):
    """A ``kv_both`` server's step: each side's metadata, for the worker's agent of that side."""

    prefill: KvferryMetadata = field(default_factory=KvferryMetadata)
    decode: KvferryMetadata = field(default_factory=KvferryMetadata)

    @property
    def sends(self) -> list[Send]:
        return self.prefill.sends


@dataclass
class Failures(KVConnectorWorkerMetadata):
    """Decode workers to the scheduler side, with a step's output: why rooms failed
    (room -> "code: message"), for ``kvferry_reason_of`` (params.py)."""

    reasons: dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> Failures:
        merged = Failures(dict(self.reasons))
        if isinstance(other, Failures):
            merged.reasons.update(other.reasons)
        return merged
