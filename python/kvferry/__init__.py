"""kvferry in an engine's process: prefill and decode agents over the engine's own KV memory.

An engine builds an agent from the same options as the ``kvferry prefill`` / ``kvferry decode``
command lines (keyword arguments, ``page_size=16`` for ``--page-size 16``) and hands it its KV
memory as a list of regions, in its ``kv_format``'s region order (``memory_layout(**options)``
says how many and how large). The agent reads and writes that memory in place and keeps a
reference to every object it was given until it is closed; it never frees anything.

Every failure raises a subclass of :class:`Error`: one per refusal of a room operation
(:class:`BadRequest`, :class:`UnknownRoom`, :class:`Conflict`, :class:`Exhausted`,
:class:`Unavailable`, :class:`Forbidden`), one per room failure code under :class:`RoomFailed` (``FAILURE_CODES``
maps each code to its class), :class:`WaitTimeout` when ``wait`` runs out of time, and
:class:`ConfigError`, :class:`RegionError`, :class:`StartError` when an agent cannot be built.
docs/engines.md, "Embedding kvferry in Python", has a complete example.

Every room view is a dict whose ``state`` is a :class:`RoomState`; ``kvferry/rooms.py`` types
the views of each role (:class:`PrefillRoomView`, :class:`DecodeRoomView`, :class:`TakenRoom`).

Engines that prefer the agent in a process of its own start it with :func:`spawn` (a
:class:`Sidecar` with the same room operations, over the agent's HTTP API) and share their KV
memory with it through a :class:`ShmPool`.
"""

from ._kvferry import (
    FAILURE_CODES,
    Aborted,
    BadMessage,
    BadRequest,
    Checksum,
    ConfigError,
    Conflict,
    DecodeAgent,
    Error,
    Exhausted,
    IncompatibleLayout,
    IncompatibleVersion,
    PeerDead,
    PeerUnknownRoom,
    PrefillAgent,
    PromptMismatch,
    RegionError,
    RoomFailed,
    Shutdown,
    StartError,
    TimeoutBootstrap,
    TimeoutReady,
    TimeoutStall,
    Unauthorized,
    Unavailable,
    Forbidden,
    UnknownRoom,
    Unreachable,
    VerifyFailed,
    WaitTimeout,
    __version__,
    memory_layout,
    prompt_digest,
)
from .rooms import (
    DecodeRoomView,
    PoolCounts,
    PrefillRoomView,
    Reason,
    RoomState,
    RoomView,
    SourceView,
    TakenRoom,
    TransferView,
)
from .sidecar import ShmPool, Sidecar, spawn

__all__ = [
    "FAILURE_CODES",
    "Aborted",
    "BadMessage",
    "BadRequest",
    "Checksum",
    "ConfigError",
    "Conflict",
    "DecodeAgent",
    "DecodeRoomView",
    "Error",
    "Exhausted",
    "IncompatibleLayout",
    "IncompatibleVersion",
    "PeerDead",
    "PeerUnknownRoom",
    "PoolCounts",
    "PrefillAgent",
    "PrefillRoomView",
    "PromptMismatch",
    "Reason",
    "RegionError",
    "RoomFailed",
    "RoomState",
    "RoomView",
    "ShmPool",
    "Shutdown",
    "Sidecar",
    "SourceView",
    "StartError",
    "TakenRoom",
    "TimeoutBootstrap",
    "TimeoutReady",
    "TimeoutStall",
    "TransferView",
    "Unauthorized",
    "Unavailable",
    "Forbidden",
    "UnknownRoom",
    "Unreachable",
    "VerifyFailed",
    "WaitTimeout",
    "__version__",
    "memory_layout",
    "prompt_digest",
    "spawn",
]
