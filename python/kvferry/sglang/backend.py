"""SGLang's transfer backend classes for ``kvferry``: a manager per scheduler rank that runs a
kvferry agent over SGLang's own KV buffers, a sender per prefill request and a receiver per
decode request, each a kvferry room (SGLang's ``bootstrap_room``).

- Memory: SGLang gives the manager its per-layer buffers as raw addresses, all K buffers then
  all V buffers for MHA (one buffer a layer for MLA), ``page_size`` tokens an item. They are
  the agent's regions in the ``sglang-mha`` / ``sglang-mla`` format (a layer's K then its V);
  the agent reads and writes them in place, in host memory or on the buffers' CUDA device
  (that path never ran: SGLang has been tested on its CPU engine only).
- Rooms: the prefill announces a room ready once its last chunk was sent to the backend, with
  every page of the prompt and SGLang's metadata row (the first output token and the rest of
  ``MetadataBuffers``) as the room's aux bytes; the decode asks for the room into the pages
  SGLang allocated and, once it landed, writes the aux bytes into its own metadata row. Rooms
  move whole pages: ``pages × page_size`` tokens. Both sides send the digest of the request's
  prompt (``origin_input_ids``, handed over by the plugin's hooks) with the room: a decode
  whose prompt is not the one the prefill computed is refused ``prompt_mismatch``.
- States: a prefill room is ``WaitingForInput`` until it is announced (the prefill computes at
  once; kvferry keeps the ready KV until the decode asks or ``--room-ttl-ms`` passes), then
  ``Transferring`` until it settles. A decode room is ``WaitingForInput`` from ``init`` until
  SGLang sends its pages, then ``Transferring``. ``Success`` and ``Failed`` are the room's final
  states; ``failure_exception`` raises SGLang's ``KVTransferError`` with kvferry's reason code
  and message.
- Registries: SGLang's router names the prefill server of each request (``bootstrap_host``,
  ``bootstrap_port``), and a decode asks that server's registry for the prefill group, then
  says Hello to the ranks it lists, with ``KVFERRY_TOKEN``. Those fields come from the request
  body, so only the agent talks to registries, and only to ones it trusts: its own
  ``--bootstrap`` and those ``KVFERRY_ALLOWED_REGISTRIES`` lists (comma-separated ``HOST:PORT``,
  ``HOST:*``, ``NETWORK:*`` or URLs). Operators set it in every decode server's environment to
  the prefill servers' bootstrap addresses as the router names them: each
  ``prefill-host:bootstrap_port``, or a network such as ``10.0.0.0/8:*``. A request naming any
  other registry fails at once with a ``KVTransferError`` that names it (nothing is sent to
  it); without the variable, a decode serves no request whose prefill is another server's
  registry.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError, PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode

import kvferry
from kvferry import engine_options

from ..registry import spawn_registry, url_of, wait_for_registry
from ..rooms import failure_code
from .metrics import Metrics, transfer_seconds
from .settings import sglang_settings, ucx_net_devices

logger = logging.getLogger(__name__)

# What an agent's ``poll`` leaves out: a room still in flight.
IN_FLIGHT = object()
# How long a room aborted because another rank failed may take to settle.
SETTLE_S = 30.0
# The most refused bootstrap addresses a manager remembers.
REFUSED = 4096

# SGLang's KV cache dtypes (``kv_cache_dtype_str``) as kvferry's, with their sizes.
DTYPES = {
    "bfloat16": ("bf16", 2),
    "float16": ("fp16", 2),
    "half": ("fp16", 2),
    "float32": ("fp32", 4),
    "float": ("fp32", 4),
    "float8_e4m3fn": ("fp8-e4m3", 1),
    "fp8_e4m3": ("fp8-e4m3", 1),
    "float8_e5m2": ("fp8-e5m2", 1),
    "fp8_e5m2": ("fp8-e5m2", 1),
}



def dtype_of(name: str) -> tuple[str, int]:
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"kvferry: SGLang's KV cache dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[key]


class Pool:
    """What ``KVArgs`` leaves out of the KV pool: its dtype (named ``auto`` when it is the
    model's), its device, this rank's KV heads and the model's (a decode's ``KVArgs`` has
    neither)."""

    def __init__(self, queue: Any) -> None:
        pool = queue.token_to_kv_pool
        self.dtype = str(pool.dtype)
        device = str(getattr(pool, "device", "cpu"))
        # The CUDA device of the KV buffers; None for host memory.
        self.cuda: int | None = None
        if device.startswith("cuda"):
            self.cuda = int(device.partition(":")[2] or 0)
        elif device != "cpu":
            raise ValueError(f"kvferry: SGLang's KV cache on {device} is not supported (CPU and CUDA are)")
        self.heads = int(getattr(pool, "head_num", 1))
        self.total_heads = int(queue.scheduler.model_config.get_total_num_kv_heads())


# The pool of the queue whose manager is being made (``with_kv_pool``).
kv_pool: Pool | None = None


def with_kv_pool(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    """Around SGLang's prefill and decode queues' ``_init_kv_manager``: keeps the queue's KV
    pool in sight of the manager it makes."""
    global kv_pool
    kv_pool = Pool(queue)
    try:
        return original(queue, *args, **kwargs)
    finally:
        kv_pool = None


def code_of(error: kvferry.Error) -> str:
    """A failure code for an agent's refusal: the room's code (``kvferry.RoomFailed``), else
    the exception's name (``Conflict``, ``Unavailable``...)."""
    return str(getattr(error, "code", None) or type(error).__name__)


def know_prompt(room: Any, req: Any) -> None:
    """Gives a kvferry sender or receiver its request's prompt digest (SGLang makes them
    without the request): both sides send it with the room, and a prefill refuses a decode
    whose prompt is not the one it computed the KV for (``prompt_mismatch``)."""
    ids = getattr(req, "origin_input_ids", None)
    if isinstance(room, _Room) and ids is not None:
        room.digest = kvferry.prompt_digest([int(t) for t in ids])


def use_ib_devices(args: Any, server_args: Any, env: Any = os.environ) -> str | None:
    """Points this rank's UCX at SGLang's ``--disaggregation-ib-device`` (the devices of the
    rank's GPU, as SGLang reads the flag: a list, a JSON mapping by GPU id, or a JSON file) by
    setting ``UCX_NET_DEVICES`` before the agent starts; one set already wins (logged). The
    value set, or None."""
    ib_device = getattr(args, "ib_device", None) or getattr(server_args, "disaggregation_ib_device", None)
    if not ib_device:
        return None
    if env.get("UCX_NET_DEVICES"):
        logger.warning("kvferry: UCX_NET_DEVICES is set: --disaggregation-ib-device %s is ignored", ib_device)
        return None
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu

    devices = get_ib_devices_for_gpu(ib_device, int(getattr(args, "gpu_id", 0) or 0))
    if not devices:
        return None
    env["UCX_NET_DEVICES"] = value = ucx_net_devices(devices)
    logger.info("kvferry: UCX_NET_DEVICES=%s (--disaggregation-ib-device)", value)
    return value


def agent_options(args: Any, server_args: Any, prefill: bool, mla: bool, bootstrap: str) -> dict[str, Any]:
    """The agent's options for this rank, from SGLang's ``KVArgs`` and server arguments, over
    the ``KVFERRY_*`` environment, the config file (``KVFERRY_CONFIG``) and SGLang's own
    settings (``sglang_settings``) (kvferry.engine_options); each pinned port offset by the
    rank's index in its server, ``dp_rank × tp_size + tp_rank``."""
    if getattr(server_args, "pp_size", 1) != 1:
        raise ValueError("kvferry: SGLang pipeline parallelism is not supported yet (--pp-size must be 1)")
    if kv_pool is None:
        raise RuntimeError("kvferry: the manager was made outside SGLang's queues (the plugin's hooks are not applied)")
    name = args.kv_cache_dtype_str
    dtype, size = dtype_of(kv_pool.dtype if name == "auto" else name)
    ptrs, item = list(args.kv_data_ptrs), int(args.kv_item_lens[0])
    page_size = int(args.page_size)
    if len(set(args.kv_item_lens)) != 1 or len(set(args.kv_data_lens)) != 1:
        raise ValueError("kvferry: SGLang's KV buffers differ in size (draft or hybrid pools are not supported)")
    if mla:
        layers, heads, total_heads = len(ptrs), 1, 1
    else:
        if len(ptrs) % 2:
            raise ValueError(f"kvferry: {len(ptrs)} KV buffers are not a K and a V buffer per layer")
        layers, heads, total_heads = len(ptrs) // 2, kv_pool.heads, kv_pool.total_heads
    head_dim, rest = divmod(item, page_size * heads * size)
    if rest:
        raise ValueError(f"kvferry: a KV item of {item} bytes is not {page_size} tokens x {heads} heads of {dtype}")
    opts: dict[str, Any] = dict(
        model="tiny",
        attention="mla" if mla else "mha",
        layers=layers,
        kv_heads=total_heads,
        head_dim=head_dim,
        dtype=dtype,
        page_size=page_size,
        pool_pages=int(args.kv_data_lens[0]) // item,
        kv_format="sglang-mla" if mla else "sglang-mha",
        tp_size=attention_tp_size(server_args),
        # A prefill's engine rank counts every TP rank of the server; a decode's, those of its
        # attention group: with DP attention each group is a TP group of its own.
        tp_rank=int(args.engine_rank) % attention_tp_size(server_args),
    )
    if prefill:
        dp_size = int(getattr(server_args, "dp_size", 1))
        method = getattr(server_args, "load_balance_method", None)
        if dp_size > 1 and method not in (None, "auto", "follow_bootstrap_room"):
            # A decode asks DP group bootstrap_room % dp_size for the room (follow_bootstrap_room).
            raise ValueError(f"kvferry: a prefill of {dp_size} DP ranks puts each request on rank bootstrap_room % "
                             f"{dp_size}; --load-balance-method {method} is not supported (leave it unset)")
        opts |= dict(dp_rank=int(args.system_dp_rank or 0), dp_size=dp_size)
    opts["bootstrap"] = bootstrap
    worker = int(getattr(args, "system_dp_rank", 0) or 0) * opts["tp_size"] + opts["tp_rank"]
    return engine_options.agent_options(opts, None, role="prefill" if prefill else "decode", worker=worker,
                                        mapped=sglang_settings(os.environ, prefill))


def attention_tp_size(server_args: Any) -> int:
    """The ranks one copy of the KV is split over: the TP size, or its share of a DP group
    with DP attention."""
    tp, dp = int(getattr(server_args, "tp_size", 1)), int(getattr(server_args, "dp_size", 1))
    return tp // dp if getattr(server_args, "enable_dp_attention", False) else tp


def regions_of(args: Any, mla: bool) -> list[tuple[int, int]]:
    """SGLang's buffers in the format's region order: per layer its K then its V buffer."""
    bufs = list(zip(args.kv_data_ptrs, args.kv_data_lens))
    if mla:
        return bufs
    layers = len(bufs) // 2
    return [b for layer in range(layers) for b in (bufs[layer], bufs[layers + layer])]


class Aux:
    """SGLang's metadata row of a request (``MetadataBuffers``, one item per buffer at the
    request's index) as the room's aux bytes, read at the prefill and written at the decode."""

    def __init__(self, args: Any) -> None:
        self.buffers = list(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens))
        self.size = sum(item for _, _, item in self.buffers)

    def read(self, index: int) -> bytes:
        return b"".join(ctypes.string_at(ptr + index * item, item) for ptr, _, item in self.buffers)

    def write(self, index: int, data: bytes) -> None:
        if len(data) != self.size:
            raise ValueError(f"the prefill's metadata row has {len(data)} bytes, this decode's {self.size}")
        at = 0
        for ptr, _, item in self.buffers:
            ctypes.memmove(ptr + index * item, data[at : at + item], item)
            at += item


class KvferryKVManager(BaseKVManager):
    """One scheduler rank's kvferry agent over SGLang's KV buffers."""

    supports_host_destination = False
    enable_deferred_decode_kv_release = False

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.server_args = server_args
        self.is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        if not self.is_prefill and disaggregation_mode != DisaggregationMode.DECODE:
            raise ValueError(f"kvferry: no transfer in disaggregation mode {disaggregation_mode}")
        self.is_mla = mla = bool(is_mla_backend)
        self.page_size = int(args.page_size)
        self.aux = Aux(args)
        # Prefill groups by bootstrap address, as SGLang's decode reads them.
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        # Bootstrap addresses this decode never asks (an untrusted registry, an address that
        # is not one), why and the failure code: their requests fail (``KvferryKVReceiver.poll``).
        self.refused: dict[str, tuple[str, str]] = {}
        self.registry = None
        bootstrap = str(engine_options.setting("bootstrap") or "")
        if not bootstrap and self.is_prefill:
            bootstrap = url_of(server_args.host, server_args.disaggregation_bootstrap_port)
        elif not bootstrap:
            # A decode rank's registration is its own business: a private registry.
            self.registry, bootstrap = spawn_registry("127.0.0.1", 0)
        wait_for_registry(bootstrap)
        opts = agent_options(args, server_args, self.is_prefill, mla, bootstrap)
        use_ib_devices(args, server_args)
        assert kv_pool is not None
        self.cuda = kv_pool.cuda
        self.metrics = Metrics(server_args, "prefill" if self.is_prefill else "decode", opts["tp_rank"],
                               int(getattr(args, "system_dp_rank", 0) or 0))
        agent_type = kvferry.PrefillAgent if self.is_prefill else kvferry.DecodeAgent
        self.agent = agent_type(regions_of(args, mla), device=self.cuda, **opts)
        logger.info(
            "kvferry %s agent %s (registry %s): %s, %d layers, %d pages of %d tokens, api %s",
            "prefill" if self.is_prefill else "decode", self.agent.instance, bootstrap,
            opts["kv_format"], opts["layers"], opts["pool_pages"], self.page_size, self.agent.api_url,
        )

    def register_to_bootstrap(self) -> None:
        """The agent registered its rank when it started."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Reads the prefill group's shape from the kvferry registry at ``bootstrap_addr``,
        through the agent (which asks only a registry it trusts, with its token). Rooms go to
        prefill DP group ``room % dp_size`` (``follow_bootstrap_room``), kvferry's rule too.

        False while the group cannot be read (SGLang asks again): incomplete, or the registry
        unreachable. A registry the agent does not trust is never asked: the address is
        refused for good, and its requests' receivers fail at their next poll with the
        agent's reason (SGLang aborts them) instead of being retried."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        if bootstrap_addr in self.refused:
            return False
        try:
            url = self.registry_url(bootstrap_addr)
        except ValueError:
            self.refuse(bootstrap_addr, f"kvferry: the bootstrap address {bootstrap_addr!r} is not HOST:PORT", "bad_address")
            return False
        try:
            group = self.agent.prefill_group(url, 0)
        except kvferry.Forbidden as e:
            self.refuse(bootstrap_addr, f"kvferry: {e}", "untrusted_registry")
            return False
        except kvferry.Error as e:
            logger.info("kvferry: no complete prefill group at %s yet: %s", bootstrap_addr, e)
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=int(group["tp_size"]),
            attn_cp_size=1,
            dp_size=int(group["dp_size"]),
            pp_size=int(group["pp_size"]),
            page_size=int(group["layout"]["page_size"]),
            kv_cache_dtype=None,
            follow_bootstrap_room=True,
        )
        return True

    def refuse(self, bootstrap_addr: str, why: str, code: str) -> None:
        """Never asks ``bootstrap_addr``: the requests naming it fail with ``why``."""
        if bootstrap_addr in self.refused:
            return
        logger.error("kvferry: requests naming bootstrap address %s fail: %s", bootstrap_addr, why)
        if len(self.refused) >= REFUSED:
            # Addresses come from requests: the table stays bounded.
            self.refused.clear()
        self.refused[bootstrap_addr] = (why, code)

    def registry_url(self, bootstrap_addr: str) -> str:
        host, _, port = bootstrap_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{bootstrap_addr!r} is not HOST:PORT")
        return url_of(host.strip("[]"), int(port))

    def room_failure(self, room: int, view: dict[str, Any] | None) -> tuple[KVTransferError, str]:
        """The error of a room that did not succeed, and its failure code."""
        if view is None:
            why = ("no decode asked for it within KVFERRY_ROOM_TTL_MS (or it ended long ago)" if self.is_prefill
                   else "it ended long ago, or the agent never made it")
            return KVTransferError(room, f"kvferry: the agent no longer knows the room: {why}"), "unknown_room"
        code, message = failure_code(view), (view.get("reason") or {}).get("message", "")
        return KVTransferError(room, f"kvferry {code}: {message}"), code

    def shutdown(self) -> None:
        self.agent.close()
        if self.registry is not None and self.registry.poll() is None:
            assert self.registry.stdin is not None
            self.registry.stdin.close()
            self.registry.wait(timeout=10)


class _Room:
    """What a sender and a receiver share: the room, its state, and how it ended."""

    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: int | None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self.state = KVPoll.WaitingForInput
        self.conclude_state: int | None = None
        self.error: KVTransferError | None = None
        self.bytes: int | None = None
        self.seconds: float | None = None
        self.held = False
        # kvferry.prompt_digest of the request's prompt (``know_prompt``), sent with the room.
        self.digest: str | None = None

    def hold(self, call: Any) -> None:
        """Holds the room while SGLang has its request queued (the announcement or the
        request ends the hold)."""
        try:
            call()
            self.held = True
        except kvferry.Error as e:
            logger.warning("kvferry: room %d not held: %s", self.room, e)

    def fail(self, error: KVTransferError, code: str) -> int:
        """Ends the room failed with ``error``, counted under ``code`` in SGLang's metrics."""
        if self.held and self.state != KVPoll.Transferring:
            # Neither announced nor asked for: nobody should wait for it any more.
            try:
                self.kv_mgr.agent.unhold(self.room)
            except kvferry.Error as e:
                logger.info("kvferry: unhold of room %d: %s", self.room, e)
        if self.conclude_state != KVPoll.Success:
            # A room this rank moved, failed on another: counted once, as a success.
            self.kv_mgr.metrics.failed_with(code)
        self.error = error
        self.conclude_state = self.state = KVPoll.Failed
        logger.error("kvferry: room %d failed: %s", self.room, error)
        return self.state

    def failure_exception(self) -> None:
        if self.error is None:
            self.failed_elsewhere()
        assert self.error is not None
        raise self.error

    def failed_elsewhere(self) -> None:
        """SGLang takes the lowest of its ranks' polls: another rank's room failed, this one's
        may still be in flight, and SGLang frees its pages next. It is aborted, and this returns
        once no transfer touches them."""
        agent = self.kv_mgr.agent
        if self.state == KVPoll.Transferring:
            try:
                agent.abort(self.room)
                agent.wait(self.room, SETTLE_S)
            except kvferry.Error as e:
                logger.info("kvferry: room %d after another rank failed: %s", self.room, e)
            if isinstance(agent, kvferry.DecodeAgent):
                with contextlib.suppress(kvferry.Error):
                    agent.take(self.room)
        self.fail(KVTransferError(self.room, "kvferry: the room failed on another rank (its log says why)", is_from_another_rank=True), "another_rank")

    def get_transfer_metric(self) -> KVTransferMetric:
        # SGLang leaves a room of 0 seconds (one that never transferred) out of its latency.
        return KVTransferMetric(transfer_latency_s=self.seconds, transfer_total_bytes=self.bytes)

    def abort(self) -> None:
        """Aborts the room. One in flight is reported by ``poll`` once the agent no longer
        touches its pages (SGLang frees them then)."""
        if self.conclude_state is not None:
            return
        if self.state != KVPoll.Transferring:
            self.fail(KVTransferError(self.room, "kvferry aborted: the engine aborted the request"), "aborted")
            return
        try:
            self.kv_mgr.agent.abort(self.room)
        except kvferry.Error as e:
            logger.info("kvferry: abort of room %d: %s", self.room, e)

    def clear(self) -> None:
        pass

    def start(self, call: Any, refused: str) -> None:
        """Announces or asks for the room (``call``); the room is in flight from then on."""
        try:
            call()
        except kvferry.Error as e:
            self.fail(KVTransferError(self.room, f"kvferry: {refused}: {e}"), code_of(e))
            return
        self.state = KVPoll.Transferring

    def poll(self) -> int:
        if self.conclude_state is not None or self.state != KVPoll.Transferring:
            return self.state
        view = self.kv_mgr.agent.poll([self.room]).get(self.room, IN_FLIGHT)
        if view is IN_FLIGHT:
            return self.state
        if view is None:
            return self.fail(*self.kv_mgr.room_failure(self.room, None))
        return self.settled(view)

    def settled(self, view: dict[str, Any]) -> int:
        """The room's final state from its settled view."""
        raise NotImplementedError

    def succeed(self, view: dict[str, Any]) -> int:
        self.bytes, self.seconds = view.get("bytes"), transfer_seconds(view)
        self.kv_mgr.metrics.succeeded(self.seconds, int(self.bytes or 0))
        self.conclude_state = self.state = KVPoll.Success
        return self.state


class KvferryKVSender(_Room, BaseKVSender):
    """A prefill request's room: announced once SGLang sent its last chunk."""

    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False) -> None:
        _Room.__init__(self, mgr, bootstrap_addr, bootstrap_room)
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.pages: list[int] = []
        dp_rank, dp_size = int(mgr.kv_args.system_dp_rank or 0), int(getattr(mgr.server_args, "dp_size", 1))
        if dp_size > 1 and dp_rank != self.room % dp_size and not req_has_disagg_prefill_dp_rank:
            # Its decode asks DP group room % dp_size (a request routed to a rank by hand).
            self.fail(KVTransferError(self.room, f"kvferry: the request is on prefill DP rank {dp_rank}, but its decode asks "
                                      f"rank {self.room % dp_size} (bootstrap_room % {dp_size}) for its room"), "bad_route")
            return
        # Until it is announced, a decode that asked waits for the room past its ready timeout.
        self.hold(lambda: mgr.agent.hold(self.room))

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **_: Any) -> None:
        if self.conclude_state is not None:
            return
        if state_indices:
            self.fail(KVTransferError(self.room, "kvferry: state transfers (mamba, SWA, DSA) are not supported"), "incompatible_layout")
            return
        self.pages.extend(int(p) for p in np.asarray(kv_indices).reshape(-1))
        if self.num_pages is None or len(self.pages) < self.num_pages:
            return
        mgr = self.kv_mgr
        aux = mgr.aux.read(self.aux_index) if self.aux_index is not None else None
        pieces: dict[str, Any] = {}
        if mgr.cuda is not None:
            # SGLang's writes of this KV are queued on its stream: the agent's gathers wait for
            # this event on the device.
            import torch

            event = torch.cuda.Event()
            event.record()
            pieces["cuda_event"] = event.cuda_event
        tokens = len(self.pages) * mgr.page_size
        pieces["prompt_digest"] = self.digest
        self.start(lambda: mgr.agent.ready(self.room, tokens, pages=self.pages, aux=aux, **pieces), "the room was not announced")

    def settled(self, view: dict[str, Any]) -> int:
        if view["state"] == kvferry.RoomState.SUCCESS:
            return self.succeed(view)
        return self.fail(*self.kv_mgr.room_failure(self.room, view))


class KvferryKVReceiver(_Room, BaseKVReceiver):
    """A decode request's room: asked for once SGLang allocated its pages; its metadata row is
    written when it landed."""

    require_staging = False
    abort_notified = False

    def __init__(self, mgr: KvferryKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_: Any) -> None:
        _Room.__init__(self, mgr, bootstrap_addr, bootstrap_room)
        self.state = KVPoll.Bootstrapping
        self.bootstrap_infos: list[Any] = []
        self.prefill_dp_rank: int | None = None
        self.aux_index: int | None = None
        self.pages: list[int] = []

    def poll(self) -> int:
        if self.state == KVPoll.Bootstrapping and self.conclude_state is None:
            refused = self.kv_mgr.refused.get(self.bootstrap_addr)
            if refused is not None:
                # SGLang waits for the prefill group's shape, which this address never gives.
                why, code = refused
                return self.fail(KVTransferError(self.room, why), code)
        return _Room.poll(self)

    def init(self, prefill_dp_rank: int) -> None:
        self.prefill_dp_rank = int(prefill_dp_rank)
        if self.state == KVPoll.Bootstrapping:
            self.state = KVPoll.WaitingForInput
            # Until SGLang allocates its pages, the prefill keeps the room past its TTL.
            mgr = self.kv_mgr
            where = dict(bootstrap=mgr.registry_url(self.bootstrap_addr), dp_rank=self.prefill_dp_rank)
            self.hold(lambda: mgr.agent.hold(self.room, **where))

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None, decode_prefix_len: int | None = None, **_: Any) -> None:
        if self.conclude_state is not None:
            return
        if state_indices:
            self.fail(KVTransferError(self.room, "kvferry: state transfers (mamba, SWA, DSA) are not supported"), "incompatible_layout")
            return
        if decode_prefix_len:
            self.fail(KVTransferError(self.room, "kvferry: a decode-side prefix (decode radix cache) is not supported"), "incompatible_layout")
            return
        mgr = self.kv_mgr
        self.pages = pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        self.aux_index = aux_index
        where = dict(bootstrap=mgr.registry_url(self.bootstrap_addr), dp_rank=self.prefill_dp_rank)
        tokens = len(pages) * mgr.page_size
        digest = self.digest
        self.start(lambda: mgr.agent.request(self.room, tokens, pages=pages, prompt_digest=digest, **where), "the room was refused")

    def settled(self, view: dict[str, Any]) -> int:
        """Takes the room (failed ones too) and writes its metadata row."""
        try:
            taken = self.kv_mgr.agent.take(self.room)
        except kvferry.RoomFailed as e:
            return self.fail(KVTransferError(self.room, f"kvferry {e.code}: {e.message}"), e.code)
        except kvferry.Error as e:
            return self.fail(KVTransferError(self.room, f"kvferry: the room could not be taken: {e}"), code_of(e))
        if self.aux_index is not None:
            try:
                self.kv_mgr.aux.write(self.aux_index, taken.get("aux") or b"")
            except ValueError as e:
                return self.fail(KVTransferError(self.room, f"kvferry: {e}"), "incompatible_layout")
        return self.succeed(taken)

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        pass

    def is_abort_release_safe(self) -> bool:
        return self.conclude_state is not None
