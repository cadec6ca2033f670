"""Rooms as the agents show them: :class:`RoomState` and the typed views.

Every view an agent returns (:class:`kvferry.PrefillAgent`, :class:`kvferry.DecodeAgent` or a
:class:`kvferry.Sidecar`) is a plain dict with the fields of the HTTP API's JSON for that room
(the views of ``src/agent/prefill/rooms.rs`` and ``src/agent/decode/rooms.rs``), typed here,
except that ``room`` is an int, every ``state`` is a :class:`RoomState` and a taken room's
``aux`` is bytes. A :class:`RoomState` is a ``str``: it compares equal to the state's name in
the JSON (``view["state"] == "success"``) and prints as that name.
"""

from __future__ import annotations

import enum
import sys
from typing import Literal, TypedDict, Union

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:
    # The package supports Python 3.10 (abi3-py310), which has no enum.StrEnum: this is what
    # 3.11's is, a str enum whose members print and format as their values.
    class StrEnum(str, enum.Enum):
        __str__ = str.__str__
        __format__ = str.__format__


class RoomState(StrEnum):
    """A room's state (``src/agent/room.rs``), named as in the HTTP API's JSON.

    A room moves forward through ``bootstrapping``, ``waiting_for_input`` and ``transferring``
    to ``success``; from any state before a final one it may fail (``failed``) or be aborted
    (``aborting`` until the peer acknowledges, then ``aborted``). A prefill room's transfers
    (one per decode rank) have states too: ``transferring``, then a final one.
    """

    BOOTSTRAPPING = "bootstrapping"
    """Resolving peers."""
    WAITING_FOR_INPUT = "waiting_for_input"
    """Waiting for the engine's input (prefill) or the first bytes (decode)."""
    TRANSFERRING = "transferring"
    """Bytes are moving."""
    SUCCESS = "success"
    """Every expected byte has landed (decode) or been sent (prefill)."""
    FAILED = "failed"
    """Failed; the view's ``reason`` says why."""
    ABORTING = "aborting"
    """An abort was sent; waiting for the peer's acknowledgement."""
    ABORTED = "aborted"
    """Aborted and acknowledged."""

    @property
    def is_final(self) -> bool:
        """The state never changes again: ``success``, ``failed`` or ``aborted``. (A room in a
        final state may still have transfers touching its pages: ``safe_to_reuse`` says when
        they are done.)"""
        return self in (RoomState.SUCCESS, RoomState.FAILED, RoomState.ABORTED)


class Reason(TypedDict):
    """Why a room or a transfer failed or was aborted."""

    code: str
    """A failure code (``kvferry.FAILURE_CODES`` maps each to its exception)."""
    message: str


class TransferView(TypedDict):
    """What one decode rank asked of a prefill room."""

    bytes: int
    """KV bytes sent to it."""
    decode_instance: str
    """The decode agent's instance (a UUID)."""
    reason: Reason | None
    sends_in_flight: int
    """Sends and writes that still read the room's pages."""
    state: RoomState
    """``transferring``, then ``success``, ``failed`` or ``aborted``."""


class PrefillRoomView(TypedDict):
    """A prefill room (``PrefillAgent.view``, ``ready``, ``wait``, ``abort``, ``poll``)."""

    bytes: int
    """KV bytes sent, over every transfer."""
    reason: Reason | None
    room: int
    safe_to_reuse: bool
    """No gather reads the room's pages any more: the engine may reuse them."""
    state: RoomState
    timings: dict[str, float]
    """Milliseconds since the Unix epoch of each state entered, ``created`` and ``ready``."""
    tokens: int | None
    """Tokens of the room, once a piece was announced."""
    transfers: list[TransferView]
    """One per decode rank that asked for the room."""


class SourceView(TypedDict):
    """One prefill rank serving a decode room."""

    bytes: int
    """KV bytes landed from it."""
    done: bool
    """It said Done."""
    heads: list[int]
    """Its global heads, ``[start, end)``."""
    layers: list[int]
    """Its global layers, ``[start, end)``."""
    prefill_instance: str
    """The prefill agent's instance (a UUID)."""


class DecodeRoomView(TypedDict):
    """A decode room (``DecodeAgent.view``, ``request``, ``wait``, ``abort``, ``poll``)."""

    bytes: int
    """KV bytes landed."""
    chunks: int
    """Chunks landed."""
    expected_bytes: int
    """KV bytes the room needs (``start_token..tokens``)."""
    page_owner: Literal["agent", "engine"]
    """Whose pages the room lands in: the agent's own return to its pool, the engine's stay
    the engine's."""
    pages: list[int]
    """The room's pages in the decode pool."""
    reason: Reason | None
    room: int
    safe_to_reuse: bool
    """No write into the room's pages can still arrive."""
    sources: list[SourceView]
    """One per prefill rank serving the room."""
    start_token: int
    """The first token requested."""
    state: RoomState
    timings: dict[str, float]
    """Milliseconds since the Unix epoch of each state entered, and ``created``."""
    tokens: int
    """Tokens of the whole prompt."""


class TakenRoom(DecodeRoomView):
    """A decode room handed over (``DecodeAgent.take``): its last view, the prefill engine's
    aux bytes and the synthetic check."""

    aux: bytes | None
    """The prefill engine's aux bytes, if it sent any."""
    verified: bool | None
    """Whether the landed bytes match the synthetic pattern (synthetic agents, landed rooms)."""


RoomView = Union[PrefillRoomView, DecodeRoomView]
"""A room of either role (a :class:`kvferry.Sidecar`'s, an exception's ``view``)."""


class PoolCounts(TypedDict):
    """The agent-owned pages of a pool (``pool()``); pages an engine names are not counted."""

    free_pages: int
    total_pages: int


def room_seconds(view: PrefillRoomView | DecodeRoomView, since: str | None = None) -> float:
    """Seconds from a room's mark ``since`` (by default its first) to its success, from its
    view's ``timings`` (ms since the Unix epoch, by state); 0 for a room without those marks."""
    timings: dict[str, float] = dict(view.get("timings") or {})
    if RoomState.SUCCESS not in timings or (since is not None and since not in timings):
        return 0.0
    first = timings[since] if since is not None else min(timings.values())
    return max(0.0, timings[RoomState.SUCCESS] - first) / 1000


def failure_code(view: PrefillRoomView | DecodeRoomView) -> str:
    """The failure code of a room that did not succeed (its reason's; its state when it has
    none, as an aborted room)."""
    reason = view.get("reason") or {}
    return str(reason.get("code") or view.get("state") or "unknown")
