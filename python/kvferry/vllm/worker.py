"""The connector's worker side (one per TP rank): a kvferry agent in the worker's process over
vLLM's own KV cache tensors, the rooms the scheduler side asks for, and their results.

The agent reads and writes vLLM's KV cache in place (memory.py: which regions and format, on
the CPU and on CUDA); nothing is copied into another buffer. The connector holds vLLM's
tensors for as long as the agent runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

import kvferry
from kvferry import engine_options

from . import params as P
from .groups import Groups, Part
from .memory import Cache, cpu_cache, cuda_cache, layers_in_order, mla_cache
from .metadata import Failures, KvferryMetadata, Load, Send
from .stats import EXPIRED, KvferryStats
from .timing import log_room

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(f"vllm.{__name__}")

# A layered room is announced in this many groups of consecutive layers (fewer when the model
# has fewer layers): each announcement wakes the agent's threads, which share the engine's cores
# on a busy host; one a layer cost a 32-layer prefill step 3 % of its time here.
ANNOUNCEMENTS = 8

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# vLLM keeps an FP8 cache in uint8 tensors and names the encoding in --kv-cache-dtype. Their
# static scales live in the model's layers, loaded from the same checkpoint on both sides: the
# cache holds one-byte elements only. (fp8_ds_mla, whose per-token scales sit inside each latent
# row, comes with DeepSeek V3.2's indexer cache, a second KV cache group: refused with it.)
FP8 = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def kv_dtype(spec_dtype: Any, cache_dtype: str) -> str:
    """kvferry's dtype for vLLM's KV cache spec dtype and ``--kv-cache-dtype``."""
    if cache_dtype in FP8 and spec_dtype == torch.uint8:
        return FP8[cache_dtype]
    if spec_dtype not in DTYPES:
        raise ValueError(
            f"KvferryConnector: KV cache dtype {cache_dtype} ({spec_dtype}) is not served (served: fp32, bf16, "
            f"fp16, and on CUDA {', '.join(FP8)})"
        )
    return DTYPES[spec_dtype]


def agent_options(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: P.ConnectorConfig, producer: bool, kv_format: str,
    agents: int = 1,
) -> dict[str, Any]:
    """The agent's options for this worker: vLLM's model and cache shape, this TP rank, under
    the operator's (``agent``, the config file, ``KVFERRY_*``; kvferry.engine_options), its
    pinned ports offset for this worker: its index in the server is ``dp_rank × tp_size +
    tp_rank`` (vLLM's data-parallel index), and a ``kv_both`` worker runs ``agents`` 2, the
    prefill agent first."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KvferryConnector: pipeline parallelism is not supported yet (PP must be 1)")
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = Groups.of(kv_cache_config)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    dtype = kv_dtype(spec.dtype, str(vllm_config.cache_config.cache_dtype))
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    tp_rank = get_tensor_model_parallel_rank()
    dp_rank = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
    worker = dp_rank * parallel.tensor_parallel_size + tp_rank
    # MLA: one latent per token and layer, the same on every TP rank (the agents' pairing
    # spreads a room's layers over the prefill ranks that hold them).
    mla = isinstance(spec, MLAAttentionSpec)
    opts = dict(
        bootstrap=config.bootstrap,
        model="tiny",
        attention="mla" if mla else "mha",
        layers=groups.layers or model.get_total_num_hidden_layers(),
        kv_heads=1 if mla else model.get_total_num_kv_heads(),
        head_dim=spec.head_size,
        dtype=dtype,
        page_size=spec.block_size,
        pool_pages=kv_cache_config.num_blocks,
        kv_format=kv_format,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=tp_rank,
    )
    if producer:
        opts |= dict(dp_rank=config.dp_rank, dp_size=config.dp_size)
    import vllm

    opts |= dict(engine=f"vllm {vllm.__version__}", served_model=served_model(model))
    url = config.server_url or P.server_url(sys.argv, dict(os.environ))
    if url:
        opts["server_url"] = url
    # Every worker of every DP rank is given the same options: each pinned port (the agent's
    # control, data and API ports) is the base port plus the agent's index in the server.
    return engine_options.agent_options(
        opts, config.agent, role="prefill" if producer else "decode", worker=worker, agents=agents,
        agent=0 if producer else agents - 1, source="kv_connector_extra_config's agent", config=config.config,
    )


def served_model(model: Any) -> str:
    """The model's name as clients give it: vLLM's first served model name."""
    name = getattr(model, "served_model_name", None) or model.model
    return str(name[0] if isinstance(name, (list, tuple)) else name)


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: P.ConnectorConfig, producer: bool,
                 agents: int = 1) -> None:
        self.vllm_config = vllm_config
        # The agents this worker runs: 2 for kv_both (a prefill and a decode agent), else 1.
        self.agents = agents
        self.kv_cache_config = kv_cache_config
        self.groups = Groups.of(kv_cache_config)
        self.config = config
        self.producer = producer
        self.agent: kvferry.PrefillAgent | kvferry.DecodeAgent | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        # The agent's layers, in its order (one KV cache group's; groups.py).
        self.layers: list[torch.Tensor] = []
        # The rooms of each request still in flight (one per KV cache group), by request id,
        # and what a load needs when it fails.
        self.rooms: dict[str, list[int]] = {}
        self.loads: dict[str, Load] = {}
        self.aborted: set[str] = set()
        # Settled before anything was in flight (refused at once).
        self.done: set[str] = set()
        self.bad_blocks: set[int] = set()
        # Why rooms failed since the last step's report (room -> "code: message").
        self.failures: dict[int, str] = {}
        # Prefill: rooms whose announcement was refused, layers announced per room in this
        # step, requests whose room settled, and requests vLLM has finished.
        self.unsent: set[str] = set()
        self.announced: dict[int, set[int]] = {}
        self.settled: set[str] = set()
        self.ended: set[str] = set()
        self.num_layers = 0
        # Model layer name -> (KV cache group, the agent's layer).
        self.positions: dict[str, tuple[int, int]] = {}
        # The CUDA device of the KV cache; None on the CPU.
        self.device: int | None = None
        # The rooms settled since vLLM last asked for its stats.
        self.stats = KvferryStats()
        # The agent told the registry that the engine shuts down.
        self.draining = False

    # ---- memory ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.groups.places:
            self.positions = dict(self.groups.places)
            first = sorted((j, n) for n, (g, j) in self.positions.items() if g == 0)
            names = [n for _, n in first]
        else:
            names = layers_in_order(kv_caches)
            self.positions = {name: (0, i) for i, name in enumerate(names)}
        self.layers = [kv_caches[n] for n in names]
        cache = self.cache_of(kv_caches)
        opts = agent_options(self.vllm_config, self.kv_cache_config, self.config, self.producer, cache.kv_format,
                             self.agents)
        layout = kvferry.memory_layout(**opts)
        if layout["num_regions"] != len(cache.regions) or layout["num_regions"] * layout["region_bytes"] != cache.bytes:
            raise ValueError(f"KvferryConnector: vLLM's KV cache holds {cache.bytes} bytes, kvferry's layout {layout}")
        self.tensors = dict(kv_caches)
        self.num_layers = len(names)
        agent_type = kvferry.PrefillAgent if self.producer else kvferry.DecodeAgent
        self.close()
        self.device = cache.device
        self.agent = agent_type(cache.regions, device=cache.device, **opts)
        logger.info(
            "kvferry %s agent %s on %s: %s, %d blocks of %d tokens (%d bytes), %d KV cache group(s), api %s",
            "prefill" if self.producer else "decode", self.agent.instance, opts["bootstrap"],
            opts["kv_format"], opts["pool_pages"], opts["page_size"], cache.bytes, len(self.groups.windows),
            self.agent.api_url,
        )

    def cache_of(self, kv_caches: dict[str, torch.Tensor]) -> Cache:
        """The agent's layers of vLLM's caches as its regions: MLA's latent per layer; otherwise
        on CUDA by vLLM's KV cache layout, on the CPU by how vLLM attends there."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        first = self.layers[0]
        if self.vllm_config.model_config.use_mla:
            return mla_cache(self.layers)
        if first.device.type == "cuda":
            return cuda_cache(self.layers, self.vllm_config.cache_config.kv_cache_layout)
        if first.device.type != "cpu":
            raise ValueError(f"KvferryConnector: KV caches on {first.device.type} are not supported (CPU and CUDA are)")
        if str(self.vllm_config.cache_config.cache_dtype) in FP8:
            # vLLM's CPU build runs an FP8 cache only with AVX-512: its layout was never seen.
            raise ValueError("KvferryConnector: vLLM's CPU FP8 KV cache has no kvferry format (FP8 is served on CUDA)")
        isas = {str(getattr(ctx.get(n), "isa", "unknown")) for n in kv_caches}
        if len(isas) != 1:
            raise ValueError(f"KvferryConnector: attention layers report several ISAs {sorted(isas)}")
        return cpu_cache(self.layers, isas.pop())

    # ---- each step ---------------------------------------------------------------------------

    def apply(self, meta: KvferryMetadata | None) -> None:
        """Announces the step's sends, requests its loads and aborts its aborted loads."""
        if meta is None or self.agent is None:
            return
        if meta.draining and not self.draining:
            self.draining = True
            self.agent.draining()
            logger.info("kvferry: the engine shuts down: the agent registers as draining")
        for s in meta.sends:
            if not s.layered:
                for part in s.parts:
                    self.announce(s, part, None)
        for h in meta.holds:
            for room in self.groups.rooms(h.room):
                try:
                    where = {} if self.producer else dict(bootstrap=h.bootstrap, dp_rank=h.dp_rank)
                    self.agent.hold(room, **where)
                except Exception as e:  # noqa: BLE001 - an unheld room may still land in time
                    logger.warning("kvferry: room %d not held: %s", room, e)
        for room in meta.unholds:
            for part in self.groups.rooms(room):
                self.agent.unhold(part)
        for load in meta.loads:
            self.load(load)
        for a in meta.aborts:
            if a.req_id in self.rooms:
                self.aborted.add(a.req_id)
                self.abort(a.req_id)

    def load(self, load: Load) -> None:
        """Asks for a load's rooms, one per KV cache group; a refusal fails the load and aborts
        the rooms asked for already (the load ends when they settle)."""
        self.loads[load.req_id] = load
        if load.prefill_tokens is not None and load.prefill_tokens != load.tokens:
            reason = f"prompt_mismatch: {load.tokens} prompt tokens, the prefill sent {load.prefill_tokens}"
            logger.error("kvferry: request %s room %d failed: %s", load.req_id, load.room, reason)
            self.fail(load.req_id, reason)
            self.done.add(load.req_id)
            return
        asked: list[int] = []
        for part in load.parts:
            if part.start_token >= part.tokens:
                # The decode holds every block of this group it attends to: nothing moves.
                self.agent.unhold(part.room)
                continue
            try:
                self.agent.request(
                    part.room, part.tokens, pages=part.pages, start_token=part.start_token,
                    dp_rank=load.dp_rank, bootstrap=load.bootstrap, prompt_digest=load.digest,
                )
                asked.append(part.room)
            except Exception as e:  # noqa: BLE001 - a refused load fails the request, not the engine
                logger.error("kvferry: request %s room %d refused: %s", load.req_id, part.room, e)
                self.fail(load.req_id, f"refused: {e}")
                for room in asked:
                    with contextlib.suppress(Exception):
                        self.agent.abort(room)
                break
        if asked:
            self.rooms[load.req_id] = asked
        else:
            self.done.add(load.req_id)

    def abort(self, req_id: str) -> None:
        """Aborts the request's rooms in flight; they settle, and the request with them."""
        for room in self.rooms.get(req_id, ()):
            try:
                self.agent.abort(room)
            except Exception as e:  # noqa: BLE001 - the room settles or expires anyway
                logger.info("kvferry: abort of room %d: %s", room, e)

    def announce(self, s: Send, part: Part, layers: range | None) -> None:
        """Announces ``part`` of room ``s`` ready: ``layers`` of it (the part's last piece once
        every layer was announced), or the whole part (``layers`` None). A refusal before
        anything was announced leaves nothing in flight; after some layers, the request's
        rooms are aborted and stay tracked until they settle (the agent may be reading the
        announced pages)."""
        if s.req_id in self.unsent:
            return
        pieces: dict[str, Any] = {}
        if layers is not None:
            done = self.announced.setdefault(part.room, set())
            done.update(layers)
            pieces = dict(layer_range=(layers.start, layers.stop), last=len(done) == self.num_layers)
        if self.device is not None:
            # vLLM's writes so far are queued on its stream: the agent's gathers wait for this
            # event on the device (it follows the event before ready returns).
            event = torch.cuda.Event()
            event.record()
            pieces["cuda_event"] = event.cuda_event
        try:
            self.agent.ready(part.room, part.tokens, pages=part.pages, prompt_digest=s.digest, **pieces)
            rooms = self.rooms.setdefault(s.req_id, [])
            if part.room not in rooms:
                rooms.append(part.room)
        except Exception as e:  # noqa: BLE001 - whatever the agent says, the engine goes on
            logger.error("kvferry: request %s room %d not announced: %s", s.req_id, part.room, e)
            self.unsent.add(s.req_id)
            self.abort(s.req_id)

    def save_layer(self, meta: KvferryMetadata | None, layer_name: str) -> None:
        """vLLM wrote this layer's KV of the step: the last layer of a group announces the group
        for the rooms the step completes (vLLM runs its layers in order, so the group's earlier
        layers are written)."""
        if meta is None or self.agent is None or not meta.sends:
            return
        kv_group, layer = self.positions[layer_name]
        group = self.group_of(layer)
        if layer != group.stop - 1:
            return
        for s in meta.sends:
            part = s.parts[kv_group]
            if s.layered and group.start not in self.announced.get(part.room, ()):
                self.announce(s, part, group)

    def group_of(self, layer: int) -> range:
        """The layers announced together with ``layer``: ANNOUNCEMENTS groups of consecutive
        layers a room."""
        size = -(-self.num_layers // ANNOUNCEMENTS)
        start = layer - layer % size
        return range(start, min(start + size, self.num_layers))

    def saved(self, meta: KvferryMetadata | None) -> None:
        """After the step's forward pass: any layer of a layered room not announced yet is."""
        if meta is None or self.agent is None:
            return
        if meta.draining and not self.draining:
            self.draining = True
            self.agent.draining()
            logger.info("kvferry: the engine shuts down: the agent registers as draining")
        for s in meta.sends:
            if not s.layered:
                continue
            for part in s.parts:
                missed = [layer for layer in range(self.num_layers) if layer not in self.announced.get(part.room, ())]
                if missed and s.req_id not in self.unsent:
                    logger.warning(
                        "kvferry: vLLM did not save layers %s of room %d through save_kv_layer; "
                        "announced after the forward pass", missed, part.room,
                    )
                for layer in missed:
                    self.announce(s, part, range(layer, layer + 1))
                self.announced.pop(part.room, None)

    def fail(self, req_id: str, reason: str) -> None:
        """A load that will not land, and why (the first reason of its rooms): its blocks from
        the first one to load on are bad (vLLM's ``kv_load_failure_policy`` decides what happens
        to the request)."""
        load = self.loads.get(req_id)
        if load is None:
            return
        self.failures.setdefault(load.room, reason)
        if req_id not in self.aborted:
            block = self.groups.block_size
            for part in load.parts:
                self.bad_blocks.update(part.pages[part.start_token // block:])

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose rooms all settled since the last call: (sending, receiving). A prefill
        request is reported only once vLLM has finished it (``finished_req_ids`` named it):
        vLLM frees the blocks of what it is told, and a running request's are still in use."""
        if self.agent is None:
            return set(), set()
        by_room = {room: req for req, rooms in self.rooms.items() for room in rooms}
        try:
            settled = self.agent.poll(list(by_room))
        except Exception as e:  # noqa: BLE001 - nothing is reported; the next step asks again
            logger.error("kvferry: polling the agent's rooms failed: %s", e)
            return set(), set()
        done = self.done
        self.done = set()
        for room, view in settled.items():
            req_id = by_room[room]
            if self.producer:
                log_room(req_id, room, view)
                if view is not None:
                    self.stats.settled(view)
                if view is not None and view["state"] != kvferry.RoomState.SUCCESS:
                    logger.warning("kvferry: request %s room %d %s: %s", req_id, room, view["state"], view["reason"])
            else:
                self.take(req_id, room)
            rooms = self.rooms[req_id]
            rooms.remove(room)
            if not rooms:
                del self.rooms[req_id]
                done.add(req_id)
        self.aborted -= done
        if not self.producer:
            for req_id in done:
                self.loads.pop(req_id, None)
            return set(), done
        mine = set(self.rooms) | self.settled | self.unsent | done
        self.ended |= finished_req_ids & mine
        self.settled |= done | self.unsent
        self.unsent = set()
        sent = self.settled & self.ended
        self.settled -= sent
        self.ended -= sent
        return sent, set()

    def take(self, req_id: str, room: int) -> None:
        """Takes one of a load's rooms that settled; a failed one fails the load and aborts its
        other rooms."""
        try:
            taken = self.agent.take(room)
            log_room(req_id, room, taken)
            self.stats.settled(taken)
            logger.debug("kvferry: request %s room %d landed %d bytes", req_id, room, taken["bytes"])
            return
        except kvferry.RoomFailed as e:
            self.stats.failed(e.code)
            if req_id not in self.aborted:
                logger.error("kvferry: request %s room %d failed: %s: %s", req_id, room, e.code, e.message)
            reason = f"{e.code}: {e.message}"
        except kvferry.UnknownRoom:
            self.stats.failed(EXPIRED)
            logger.error("kvferry: request %s room %d expired before it was taken", req_id, room)
            reason = "expired: the room was gone before it was taken"
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            logger.error("kvferry: request %s room %d could not be taken: %s", req_id, room, e)
            reason = f"not_taken: {e}"
        self.fail(req_id, reason)
        if req_id not in self.aborted:
            self.aborted.add(req_id)
            self.abort(req_id)

    def failure_report(self) -> Failures | None:
        """The step's room failures for the scheduler side, once."""
        if not self.failures:
            return None
        report, self.failures = Failures(self.failures), {}
        return report

    def load_errors(self) -> set[int]:
        bad, self.bad_blocks = self.bad_blocks, set()
        return bad

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
