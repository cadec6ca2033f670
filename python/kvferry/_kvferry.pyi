"""Type stub of the extension module kvferry._kvferry (re-exported by ``kvferry``)."""

from types import TracebackType
from typing import Any, Iterable, Protocol, Sequence, SupportsIndex, TypedDict, Union

from .rooms import DecodeRoomView, PoolCounts, PrefillRoomView, RoomView, TakenRoom

__version__: str

class _Operation(TypedDict):
    """One operation of the engine API (``src/agent/engine_api.rs``)."""

    name: str
    roles: tuple[str, ...]
    """``prefill``, ``decode`` or both."""
    http: tuple[str, str] | None
    """Its route, ``(method, path)``; None: not over HTTP."""
    python: tuple[str, ...]
    """The methods that serve it, on the role's agent class and on ``Sidecar``; empty: not in
    Python."""

OPERATIONS: tuple[_Operation, ...]
"""Every operation of the engine API, with the roles that serve it, its HTTP route and its
Python methods."""

ROOM_STATES: dict[str, bool]
"""Every room state's name and whether it is final (``kvferry.RoomState`` has the same)."""

class _Tensor(Protocol):
    """A torch-style tensor: contiguous, on the CPU."""

    def data_ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

# One region of the engine's KV memory: an (address, length) pair (the caller keeps that
# memory valid while the agent lives), a writable C-contiguous buffer (numpy array, bytearray,
# mmap), an object with __array_interface__, or a tensor.
Region = Union[tuple[int, int], Any, _Tensor]

def memory_layout(**options: Any) -> dict[str, Any]:
    """The memory an agent of these options needs: ``num_regions``, ``region_bytes``,
    ``pool_bytes`` (all regions back to back: an ``shm:`` pool file), ``kv_format``,
    ``pool_pages``, ``page_size``, ``layers``, ``heads``, ``planes``, ``head_bytes``,
    ``dtype_bytes``."""

def agent_flags(**options: Any) -> list[str]:
    """The command-line flags of these options, checked as an agent would check them."""

def prompt_digest(tokens: Sequence[SupportsIndex]) -> str:
    """The digest (32 hex digits) of a prompt's token ids over a room's tokens, given as
    ``prompt_digest`` to ``PrefillAgent.ready`` and ``DecodeAgent.request``: a decode whose
    prompt differs from the prefill's is refused (``PromptMismatch``)."""

def main(argv: list[str]) -> None:
    """The ``kvferry`` command line (``python -m kvferry``) for bootstrap, prefill, decode and proxy."""

class PrefillAgent:
    """A prefill agent in this process."""

    def __init__(
        self, regions: Iterable[Region] | None = None, device: int | None = None, **options: Any
    ) -> None:
        """Starts the agent; ``options`` are the ``kvferry prefill`` flags as keywords;
        without ``regions`` the agent allocates its own pool (``pool`` option). CUDA tensors
        are device memory of their device; ``device`` names the CUDA device of raw
        ``(address, length)`` regions."""
    @property
    def api_url(self) -> str: ...
    @property
    def instance(self) -> str: ...
    @property
    def control_endpoint(self) -> str: ...
    def hold(self, room: int) -> None:
        """Holds a room while the engine has its request queued: decodes that asked for it
        already wait (neither side's ready timeout fails it) until it is announced, ``unhold``
        is called, or ``--room-max-ms`` passes."""
    def unhold(self, room: int) -> None:
        """Stops holding a room (its request left the engine's queue uncomputed)."""
    def ready(
        self,
        room: int,
        tokens: int,
        pages: Sequence[SupportsIndex] | None = None,
        token_range: tuple[int, int] | None = None,
        layer_range: tuple[int, int] | None = None,
        last: bool | None = None,
        aux: bytes | None = None,
        room_key: str | bytes | None = None,
        cuda_event: int | None = None,
        prompt_digest: str | None = None,
    ) -> PrefillRoomView:
        """Announces a ready piece of a room (the whole room without ranges). For a device
        pool whose KV the engine writes asynchronously, ``cuda_event`` is the engine's CUDA
        event (a live ``CUevent`` handle of this process, such as
        ``torch.cuda.Event().cuda_event``; anything else is undefined behaviour in the CUDA
        driver, and only a null, misaligned or out-of-range value can be refused) recorded on its
        stream after the piece's KV was written: the agent's gathers wait for that record (a
        record that never completes fails this room alone with ``timeout_ready``), nothing
        synchronizes the engine's stream, and the engine may record it again as soon as this
        returns. A sidecar (``kvferry.Sidecar.ready``) cannot use an event of
        this process: it takes ``cuda_ipc_event=``, the 64-byte IPC handle of an event created
        with ``CU_EVENT_INTERPROCESS`` (``torch.cuda.Event(interprocess=True).ipc_handle()``)."""
    def view(self, room: int) -> PrefillRoomView:
        """The room's view now; never blocks."""
    def poll(self, rooms: Iterable[int]) -> dict[int, PrefillRoomView | None]:
        """The views of the settled rooms among ``rooms`` (final, and ``safe_to_reuse``: they
        can no longer change), by room, and None for a room the agent does not know (taken,
        expired, never made); rooms still in progress are left out. Never blocks: for engines
        that check their rooms once per step."""
    def wait(self, room: int, timeout: float) -> PrefillRoomView:
        """Blocks (GIL released) until the room is settled (see ``poll``): its view on
        success, its reason's exception (a RoomFailed subclass) on failure or abort,
        WaitTimeout after ``timeout`` seconds."""
    def abort(self, room: int) -> PrefillRoomView: ...
    def pool(self) -> PoolCounts:
        """Agent-owned pages: ``free_pages``, ``total_pages``."""
    def draining(self) -> None:
        """The engine shuts down: tells the registry, in the background, that this rank drains
        (routers reading it send the engine no new requests); rooms are served as before."""
    def close(self) -> None:
        """Stops the agent, joins its tasks, then drops its references to the memory."""
    def __enter__(self) -> "PrefillAgent": ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

class DecodeAgent:
    """A decode agent in this process."""

    def __init__(
        self, regions: Iterable[Region] | None = None, device: int | None = None, **options: Any
    ) -> None:
        """Starts the agent; ``options`` are the ``kvferry decode`` flags as keywords;
        ``regions`` and ``device`` as for :class:`PrefillAgent`."""
    @property
    def api_url(self) -> str: ...
    @property
    def instance(self) -> str: ...
    @property
    def data_endpoint(self) -> str: ...
    def request(
        self,
        room: int,
        tokens: int,
        pages: Sequence[SupportsIndex] | None = None,
        start_token: int = 0,
        bootstrap: str | None = None,
        dp_rank: int | None = None,
        room_key: str | bytes | None = None,
        prompt_digest: str | None = None,
        source_pages: Sequence[SupportsIndex] | None = None,
    ) -> DecodeRoomView:
        """Asks for a room's KV into ``pages`` (the engine's) or the agent's own pages. With
        ``source_pages``, a read: those pages of the prefill's pool are the room, which no
        engine announced (the prefill serves reads: ``serve_reads=True``)."""
    def hold(self, room: int, bootstrap: str | None = None, dp_rank: int | None = None) -> None:
        """Holds a room at its prefill while the engine has its request queued: the prefill
        keeps the room's KV past its TTL (up to its ``--room-max-ms``) until the room is
        requested, ``unhold`` is called, or the maximum passes. Returns at once."""
    def unhold(self, room: int) -> None:
        """Stops holding a room (its request left the engine's queue without asking)."""
    def prefill_group(self, bootstrap: str | None = None, dp_rank: int = 0) -> dict[str, Any]:
        """The prefill group ``dp_rank`` as the registry at ``bootstrap`` (a trusted one; by
        default ``--bootstrap``'s) lists it, asked once with the agent's token: ``Forbidden``
        for a registry the agent does not trust (nothing is sent), ``Unavailable`` when the
        group is incomplete or the registry cannot be asked."""
    def view(self, room: int) -> DecodeRoomView: ...
    def poll(self, rooms: Iterable[int]) -> dict[int, DecodeRoomView | None]:
        """As PrefillAgent.poll."""
    def wait(self, room: int, timeout: float) -> DecodeRoomView:
        """As PrefillAgent.wait."""
    def take(self, room: int) -> TakenRoom:
        """Hands a landed room over and forgets it (its view plus ``aux`` bytes and
        ``verified``); a failed or aborted room is taken too, then raises its reason's
        exception."""
    def abort(self, room: int) -> DecodeRoomView: ...
    def pool(self) -> PoolCounts: ...
    def draining(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "DecodeAgent": ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

FAILURE_CODES: dict[str, type[RoomFailed]]

class Error(Exception): ...
class ConfigError(Error): ...
class RegionError(Error): ...
class StartError(Error): ...
class WaitTimeout(Error):
    room: int
    view: RoomView

class BadRequest(Error): ...
class UnknownRoom(Error): ...
class Conflict(Error): ...
class Exhausted(Error): ...
class Unavailable(Error): ...
class Forbidden(Error): ...

class RoomFailed(Error):
    room: int
    code: str
    message: str
    view: RoomView

class PeerDead(RoomFailed): ...
class TimeoutBootstrap(RoomFailed): ...
class TimeoutReady(RoomFailed): ...
class TimeoutStall(RoomFailed): ...
class Aborted(RoomFailed): ...
class Checksum(RoomFailed): ...
class IncompatibleLayout(RoomFailed): ...
class IncompatibleVersion(RoomFailed): ...
class Unreachable(RoomFailed): ...
class Unauthorized(RoomFailed): ...
class BadMessage(RoomFailed): ...
class VerifyFailed(RoomFailed): ...
class PeerUnknownRoom(RoomFailed): ...
class Shutdown(RoomFailed): ...
class PromptMismatch(RoomFailed): ...
