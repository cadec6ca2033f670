"""The connector's scheduler side (vLLM's engine-core process): which requests send or load a
room, with which blocks, and when their blocks may go.

Prefill (``kv_producer``): a request with ``do_remote_decode`` and ``max_tokens`` 1 (the
disaggregated pattern) gets its room in the step that computes the rest of its prompt (the last
chunk, with chunked prefill); the workers announce each layer as vLLM saves it, so the transfer
overlaps the rest of the forward pass. The request finishes with that step; until then vLLM
is told not to preempt (``has_pending_block_frees``), so its blocks cannot change hands while
they are read. A request that generates more tokens on the prefill is announced whole when it
finishes. Either way a finished request keeps its blocks (``delay_free``) until every worker
reports the room settled (sent, failed, aborted or expired); a request that ends abnormally
after its layers were announced aborts its room, and so does a router's ``kvferry_abort``
(params.py) for a room no decode will take. Blocks vLLM served from its prefix cache are
in the request's block table, so they are sent too.

Decode (``kv_consumer``): a request with ``do_remote_prefill`` claims its whole prompt as an
asynchronous external hit (vLLM recomputes the last prompt token itself); its room is requested
into the request's block table from the first block that is not a local prefix-cache hit
(``start_token``). A request that continues from the first token the prefill sampled
(``kvferry_continues``) has a prompt one token longer than its room: it claims the room's tokens,
and vLLM computes the last one. A client abort while the room loads aborts the room; vLLM frees
the blocks only when the workers report the room settled. Where each room's KV came from (landed,
the decode's own prefix cache, or computed by vLLM after a failure and why) is remembered for
the request's answer and for ``kvferry_reason_of`` (params.py), the latest ``REASONS_KEPT``.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import kvferry
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from . import params as P
from .groups import Groups, GroupsError
from .metadata import Abort, Failures, Hold, KvferryMetadata, Load, Send

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

REASONS_KEPT = 4096


def kept(remembered: dict, key: Any, value: Any) -> None:
    """``remembered[key] = value``, the oldest entries past ``REASONS_KEPT`` forgotten (dicts
    keep insertion order)."""
    remembered[key] = value
    while len(remembered) > REASONS_KEPT:
        remembered.pop(next(iter(remembered)))

logger = init_logger(f"vllm.{__name__}")

FINISHED_NORMALLY = tuple(
    getattr(RequestStatus, name)
    for name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")
    if hasattr(RequestStatus, name)
)


class SchedulerSide:
    def __init__(self, config: P.ConnectorConfig, producer: bool, groups: Groups, recompute: bool) -> None:
        self.config = config
        self.producer = producer
        # Decode: vLLM computes the prompt of a request whose room failed
        # (kv_load_failure_policy ``recompute``), or fails the request (``fail``).
        self.recompute = recompute
        self.groups = groups
        self.meta = KvferryMetadata()
        # Rooms whose blocks are held: prefill sends not yet settled, decode loads not yet
        # reported finished. By request id.
        self.rooms: dict[str, int] = {}
        # Decode: the local prefix-cache hit each loading request was matched with, and what
        # each request loaded (reported in its response's kv_transfer_params).
        self.local_hit: dict[str, int] = {}
        # The rooms of requests waiting in vLLM's queue, held by the agents (decode: at their
        # prefill; prefill: from the decodes that asked already).
        self.held: dict[str, int] = {}
        self.loaded: dict[str, Load] = {}
        # Decode: why rooms failed, and where each room's KV came from (P.LANDED...), the latest
        # REASONS_KEPT.
        self.reasons: dict[int, str] = {}
        self.outcomes: dict[int, str] = {}
        # Prefill: requests to send once their prompt is computed (prompt tokens, params,
        # digest), and the rooms of those whose layers were announced.
        self.to_send: dict[str, tuple[int, dict[str, Any], str | None]] = {}
        self.streamed: dict[str, int] = {}
        # Prefill: rooms a router asked to release (``kvferry_abort``) before they were
        # announced, never to be sent (the latest REASONS_KEPT), and the answers to those
        # questions by request id.
        self.cancelled: dict[int, None] = {}
        self.released: dict[str, dict[str, Any]] = {}
        # Set once the engine is told to shut down (SIGTERM); each step's metadata says so.
        self.draining = False
        self.watch_shutdown()

    def watch_shutdown(self) -> None:
        """Learns that the engine shuts down: vLLM's API server passes SIGTERM to its engine
        process, which drains (with ``--shutdown-timeout``: the requests it has finish, new
        ones are refused) while its steps go on. This side runs in that process's main thread,
        after vLLM set its handler: it sets its own, which marks the engine draining and calls
        vLLM's."""
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except ValueError:
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            self.draining = True
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:
            pass  # not the main thread: no drain announcement, the engine's refusals say it

    def send(self, req_id: str, room: int, tokens: int, block_ids: Any, layered: bool, digest: str | None) -> bool:
        """Sends ``room`` from the request's blocks (``block_ids``: vLLM's per KV cache group);
        False, with why logged, if it cannot be sent."""
        try:
            parts = self.groups.parts(room, tokens, block_ids)
        except GroupsError as e:
            logger.warning("kvferry: request %s sends nothing: %s", req_id, e)
            return False
        self.rooms[req_id] = room
        self.meta.sends.append(Send(req_id, room, tokens, parts, layered=layered, digest=digest))
        return True

    @staticmethod
    def digest(request: Request, tokens: int | None = None) -> str | None:
        """kvferry.prompt_digest of the request's prompt, or of its first ``tokens`` (None for a
        prompt given as embeddings)."""
        ids = request.prompt_token_ids
        return None if ids is None else kvferry.prompt_digest(list(ids[:tokens]))

    # ---- decode ------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """A request with a room arrives in vLLM's queue: its room is held until the request
        asks for it (decode: the prefill keeps the room past its TTL) or announces it (prefill,
        concurrent pairing: the decodes that asked already keep waiting), however long the
        queue."""
        params = request.kv_transfer_params or {}
        if self.producer and P.ABORT in params:
            self.released[request.request_id] = self.release(params[P.ABORT])
            return
        if self.producer and params.get("do_remote_decode"):
            try:
                room = P.room_of(params)
            except P.ParamsError:
                return  # nothing is sent (room_for says why)
            if room is None:
                return  # sequential pairing: the room is chosen when the prompt is computed
            hold = Hold(room, None, None)
        elif not self.producer and params.get("do_remote_prefill"):
            try:
                P.check_load(params)
            except P.ParamsError:
                return  # computed locally (get_num_new_matched_tokens says why)
            hold = Hold(P.room_of(params), params.get(P.DP_RANK), params.get(P.BOOTSTRAP))
        else:
            return
        self.held[request.request_id] = hold.room
        self.meta.holds.append(hold)

    def release(self, raw: Any) -> dict[str, Any]:
        """A router's ``kvferry_abort``: the room is aborted where a request holds it (its layers
        announced or in flight; the blocks go once the agents settle it), and never sent when
        its request is still computing or not here yet. The answer says whether anything of it
        was held."""
        try:
            room = P.room_of({P.ROOM: raw})
        except P.ParamsError as e:
            return {P.ABORTED: False, P.REASON: f"bad {P.ABORT}: {e}"}
        if room is None:
            return {P.ABORTED: False, P.REASON: f"{P.ABORT} names no room"}
        held = next((req for req, r in self.rooms.items() if r == room), None)
        if held is not None:
            self.meta.aborts.append(Abort(held, room))
        computing = any(P.room_of(params) == room for _, params, _ in self.to_send.values()
                        if P.valid_room(params))
        kept(self.cancelled, room, None)
        logger.info("kvferry: room %d released at the router's request (%s)", room,
                    "aborted" if held is not None else "computing: never sent" if computing else "not held here")
        return {P.ROOM: str(room), P.ABORTED: held is not None or computing}

    def unhold(self, req_id: str) -> None:
        """The request no longer waits in the queue for its room's sake (it ended, or computes
        its prompt itself)."""
        room = self.held.pop(req_id, None)
        if room is not None:
            self.meta.unholds.append(room)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.producer or not params.get("do_remote_prefill"):
            return 0, False
        try:
            P.check_load(params)
            tokens = self.groups.room_tokens(P.room_tokens(params, request.num_prompt_tokens))
        except P.ParamsError as e:
            logger.warning("kvferry: request %s computes its prompt locally: %s", request.request_id, e)
            if P.valid_room(params):
                self.settle(P.room_of(params), P.RECOMPUTED, f"bad_params: {e}")
            return 0, False
        missing = tokens - num_computed_tokens
        if missing <= 0:
            # The decode's prefix cache holds every token of the room.
            self.settle(P.room_of(params), P.CACHED)
            return 0, False
        self.local_hit[request.request_id] = num_computed_tokens
        return missing, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if self.producer:
            one_token = getattr(request.sampling_params, "max_tokens", None) == 1
            if params.get("do_remote_decode") and one_token and request.request_id not in self.streamed:
                tokens = self.groups.room_tokens(request.num_prompt_tokens)
                self.to_send[request.request_id] = (request.num_prompt_tokens, params, self.digest(request, tokens))
            return
        if num_external_tokens == 0:
            self.local_hit.pop(request.request_id, None)
            self.unhold(request.request_id)
            return
        # Asking for the room ends its hold at the agent.
        self.held.pop(request.request_id, None)
        room = P.room_of(params)
        start = self.local_hit.pop(request.request_id, 0)
        tokens = self.groups.room_tokens(P.room_tokens(params, request.num_prompt_tokens))
        prefill_tokens = params.get(P.TOKENS)
        load = Load(
            req_id=request.request_id,
            room=room,
            tokens=tokens,
            start_token=start,
            parts=self.groups.parts(room, tokens, blocks.get_block_ids(), start),
            dp_rank=params.get(P.DP_RANK),
            bootstrap=params.get(P.BOOTSTRAP),
            prefill_tokens=None if prefill_tokens is None else self.groups.room_tokens(prefill_tokens),
            digest=self.digest(request, tokens),
        )
        # Loaded once: a preempted request recomputes instead of asking for the room again.
        params["do_remote_prefill"] = False
        self.rooms[request.request_id] = room
        self.loaded[request.request_id] = load
        self.meta.loads.append(load)

    # ---- both --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryMetadata:
        if self.producer and self.to_send:
            self.stream_completed_prompts(scheduler_output)
        meta, self.meta = self.meta, KvferryMetadata()
        meta.draining = self.draining
        return meta

    def stream_completed_prompts(self, out: SchedulerOutput) -> None:
        """Rooms for the requests whose prompt this step completes, announced layer by layer."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, (prompt, params, digest) in list(self.to_send.items()):
            scheduled = out.num_scheduled_tokens.get(req_id, 0)
            if not scheduled or computed.get(req_id, 0) + scheduled < prompt:
                continue
            del self.to_send[req_id]
            # Announced this step: the agent ends the room's hold.
            self.held.pop(req_id, None)
            tokens = self.groups.room_tokens(prompt)
            room = self.room_for(req_id, params) if tokens else None
            blocks = out.kv_connector_block_state.get_block_ids(req_id) if out.kv_connector_block_state else None
            if room is None or not blocks:
                continue
            if self.send(req_id, room, tokens, blocks, True, digest):
                self.streamed[req_id] = room

    def room_for(self, req_id: str, params: dict[str, Any]) -> int | None:
        """The router's room, or a fresh one; None (nothing is sent) if the router's is unusable."""
        try:
            room = P.room_of(params)
        except P.ParamsError as e:
            logger.warning("kvferry: request %s sends nothing: %s", req_id, e)
            return None
        live = set(self.rooms.values())
        if room is None:
            return P.fresh_room(live)
        if room in self.cancelled:
            logger.info("kvferry: request %s sends nothing: the router released room %d", req_id, room)
            return None
        if room in live:
            logger.warning("kvferry: request %s names room %d, which is still live: nothing sent", req_id, room)
            return None
        return room

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        # A room's failure comes with the step that reports its load finished, or an earlier one
        # (another TP rank's).
        failures = output.kv_connector_worker_meta
        if isinstance(failures, Failures):
            for room, reason in failures.reasons.items():
                kept(self.reasons, room, reason)
        for req_id in output.finished_sending or set():
            self.rooms.pop(req_id, None)
        for req_id in output.finished_recving or set():
            room = self.rooms.pop(req_id, None)
            if room is not None and not self.producer:
                failed = P.RECOMPUTED if self.recompute else P.FAILED
                self.settle(room, failed if room in self.reasons else P.LANDED)

    def settle(self, room: int | None, kv: str, reason: str | None = None) -> None:
        """Decode: where ``room``'s KV came from (P.LANDED...) and why it failed."""
        if room is None:
            return
        kept(self.outcomes, room, kv)
        if reason is not None:
            kept(self.reasons, room, reason)

    def outcome(self, room: int) -> dict[str, Any]:
        """What this decode knows of ``room``: where its KV came from and why it failed (None:
        not known here)."""
        return {P.ROOM: str(room), P.KV: self.outcomes.get(room), P.REASON: self.reasons.get(room)}

    def reason_of(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """The answer to ``kvferry_reason_of`` (params.py), or None for any other request."""
        if P.REASON_OF not in params:
            return None
        try:
            room = P.room_of({P.ROOM: params[P.REASON_OF]})
        except P.ParamsError as e:
            return {P.REASON: f"bad {P.REASON_OF}: {e}"}
        return self.outcome(room)

    def has_pending_block_frees(self) -> bool:
        """Prefill: rooms announced layer by layer whose request has not finished yet (one
        step): vLLM must not preempt them (it would free blocks the agent reads)."""
        return bool(self.streamed)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished the request; ``block_ids``: its blocks per KV cache group."""
        req_id = request.request_id
        if not self.producer:
            self.local_hit.pop(req_id, None)
            self.unhold(req_id)
            room = self.rooms.get(req_id)
            if room is not None and request.status == RequestStatus.FINISHED_ABORTED:
                # Aborted while loading: vLLM holds the blocks until the room is reported.
                self.meta.aborts.append(Abort(req_id, room))
            params = request.kv_transfer_params or {}
            load = self.loaded.pop(req_id, None)
            if load is None and params.get("do_remote_prefill"):
                # Its room was not asked for: the prefix cache held it, or its params were unusable.
                if not P.valid_room(params) or P.room_of(params) is None:
                    return False, {P.KV: P.RECOMPUTED, P.REASON: f"bad_params: no usable {P.ROOM}"}
                return False, self.outcome(P.room_of(params))
            if load is None:
                return False, self.reason_of(params)
            # The response says which room the prompt's KV came from, which tokens moved (from
            # start_token on; those before were the decode's own prefix-cache hits), and whether
            # they landed.
            return False, self.outcome(load.room) | {"kvferry_start_token": load.start_token, P.TOKENS: load.tokens}
        self.to_send.pop(req_id, None)
        self.unhold(req_id)
        params = request.kv_transfer_params or {}
        room = self.streamed.pop(req_id, None)
        if room is not None and request.status not in FINISHED_NORMALLY:
            # Its layers may be in flight: the room is aborted, the blocks wait for it to settle.
            self.meta.aborts.append(Abort(req_id, room))
            return True, None
        if room is None:
            if req_id in self.released:
                return False, self.released.pop(req_id)
            if params.get(P.IDENTIFY):
                # A router asking which kvferry group this server is (concurrent pairing).
                return False, self.config.identity()
            if not params.get("do_remote_decode") or request.status not in FINISHED_NORMALLY:
                return False, None
            # Not announced while its prompt was computed (it generated more than one token
            # here, or nothing of its prompt moves): announced whole now, if anything moves.
            room = self.room_for(req_id, params)
            if room is None:
                return False, None
            tokens = self.groups.room_tokens(request.num_prompt_tokens)
            if not tokens:
                # Nothing of it moves (a 1-token prompt of a model with a sliding window): the
                # decode computes it.
                return False, self.load_params(room, request)
            if not self.send(req_id, room, tokens, block_ids, False, self.digest(request, tokens)):
                return False, None
        return True, self.load_params(room, request)

    def load_params(self, room: int, request: Request) -> dict[str, Any]:
        """The ``kv_transfer_params`` a prefill answers with: what the decode loads."""
        return {
            "do_remote_prefill": True,
            P.ROOM: str(room),
            P.DP_RANK: self.config.dp_rank,
            P.BOOTSTRAP: self.config.bootstrap,
            P.TOKENS: request.num_prompt_tokens,
        }
