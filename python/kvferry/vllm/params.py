"""The ``kv_transfer_params`` kvferry reads and writes in vLLM requests and responses, and the
configuration it reads from ``kv_connector_extra_config``.

A request's params (HTTP body field ``kv_transfer_params``):

- to a prefill server: ``{"do_remote_decode": true}``, and in concurrent pairing the room the
  router chose, ``"kvferry_room": "<u64>"``;
- from the prefill server's response, copied by the router into the decode request:
  ``{"do_remote_prefill": true, "kvferry_room": "<u64>", "kvferry_dp_rank": G,
  "kvferry_bootstrap": URL, "kvferry_tokens": N}``;
- to a decode server: those, or in concurrent pairing ``{"do_remote_prefill": true,
  "kvferry_room": ..., "kvferry_dp_rank": G}`` before the prefill has run.

A router that sent the client the first token the prefill sampled asks the decode to continue
from it: the decode request's prompt is the prefill's prompt plus that token, and its params add
``"kvferry_continues": true``. The room then holds one token fewer than the prompt
(``kvferry_tokens``, required): the decode loads the room's tokens and computes the last one
itself, and the prompt digest it sends is that of the room's tokens, so KV computed for another
prompt is still refused.

A router learns a prefill server's kvferry identity by sending it any short request with
``{"kvferry_identify": true}``: the response's params are ``{"kvferry_dp_rank": G,
"kvferry_bootstrap": URL, "kvferry_engine_dp_rank": R}``: the kvferry group of the vLLM engine
that answered, which is the server's vLLM data-parallel rank ``R``. A server of several ranks is
one group per rank; a router reaches rank ``R`` with vLLM's ``X-data-parallel-rank: R`` header,
on the identify request and on the prefill request alike (vLLM answers 400 for a rank it does
not have).

A decode server's answer says where its prompt's KV came from: its params add
``"kvferry_kv"``, one of ``"landed"`` (the room's KV landed), ``"cached"`` (the decode's own
prefix cache held all of the room: nothing moved), ``"recomputed"`` (the room failed, or the
request's params were unusable, and vLLM computed the prompt: ``kv_load_failure_policy``
``recompute``) or ``"failed"`` (the room failed and so did the request: policy ``fail``), and
``"kvferry_reason"``, ``"<code>: <message>"`` when the KV did not land (``bad_params: ...`` for
params the connector could not act on; a room's failure code otherwise, or ``expired``,
``refused``, ``not_taken``). vLLM passes a request's params only into an answer that is not
streamed: any short request to the same decode server with ``{"kvferry_reason_of": "<room>"}``
asks after the room of any answer, streamed or not, once its first token came: the response's
params are ``{"kvferry_room": "<room>", "kvferry_kv": ..., "kvferry_reason": ...}`` (``null``
when the server does not know the room; it remembers the last 4096). A router asks so after a
decode's error answer too (``kv_load_failure_policy`` ``fail`` answers a bare "Internal server
error").

A router whose request ended before a decode answered it (its client left, the decode failed)
has the prefill release the room by sending the prefill server any short request with
``{"kvferry_abort": "<room>"}``: the room of a request that holds it is aborted (its blocks freed
once the agents settle it), a request still computing sends nothing, and a room not seen yet is
never sent. The response's params are ``{"kvferry_room": "<room>", "kvferry_aborted": true}``
(``false``: the server held nothing of that room). A router names the room itself
(``kvferry_room`` in the prefill request) so that it can do this before the prefill answered.

Rooms travel as decimal strings (a u64 does not survive every JSON parser as a number).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

ROOM = "kvferry_room"
DP_RANK = "kvferry_dp_rank"
BOOTSTRAP = "kvferry_bootstrap"
TOKENS = "kvferry_tokens"
IDENTIFY = "kvferry_identify"
ENGINE_DP_RANK = "kvferry_engine_dp_rank"
REASON_OF = "kvferry_reason_of"
REASON = "kvferry_reason"
KV = "kvferry_kv"
LANDED, CACHED, RECOMPUTED, FAILED = "landed", "cached", "recomputed", "failed"
ABORT = "kvferry_abort"
ABORTED = "kvferry_aborted"
CONTINUES = "kvferry_continues"


class ParamsError(ValueError):
    """kv_transfer_params that kvferry cannot act on."""


def room_of(params: dict[str, Any]) -> int | None:
    """The room the params name, or None; ParamsError if it is not a u64 (an int or a string of
    decimal digits)."""
    raw = params.get(ROOM)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)) or (isinstance(raw, str) and not raw.isdigit()):
        raise ParamsError(f"{ROOM} {raw!r} is not a u64 (decimal digits)")
    room = int(raw)
    if not 0 <= room < 1 << 64:
        raise ParamsError(f"{ROOM} {room} is not a u64")
    return room


def valid_room(params: dict[str, Any]) -> bool:
    """Whether the params' room, if any, is a u64 (``room_of`` would not raise)."""
    try:
        room_of(params)
    except ParamsError:
        return False
    return True


def check_load(params: dict[str, Any]) -> None:
    """ParamsError unless a decode request's params name a room, and the prefill group, registry
    and token count are absent or of the right type."""
    if room_of(params) is None:
        raise ParamsError(f"do_remote_prefill without {ROOM}")
    for key, kind in ((DP_RANK, int), (TOKENS, int), (BOOTSTRAP, str)):
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise ParamsError(f"{key} {value!r} is not a {kind.__name__}")
        if kind is int and value is not None and not 0 <= value < 1 << 32:
            raise ParamsError(f"{key} {value} is out of range")


def room_tokens(params: dict[str, Any], prompt_tokens: int) -> int:
    """The prompt tokens a decode request's room holds: all of them, or with ``kvferry_continues``
    all but the last (the first token the prefill sampled, which the decode computes);
    ParamsError if the room's ``kvferry_tokens`` says otherwise."""
    if not params.get(CONTINUES):
        return prompt_tokens
    tokens = params.get(TOKENS)
    if tokens != prompt_tokens - 1:
        raise ParamsError(f"{CONTINUES}: the room holds {tokens!r} tokens, not the prompt's {prompt_tokens} less the one to continue from")
    return tokens


def fresh_room(live: set[int]) -> int:
    """A random u64 room not among ``live``: rooms from independent prefill servers and
    routers do not collide (2^-64 per pair), and a live one is never reused."""
    while True:
        room = int.from_bytes(os.urandom(8), "little")
        if room not in live:
            return room


# A prefill server's kvferry group, unless set: a number derived from vLLM's engine id, which
# every process of one server shares (vLLM appends ``_dp<rank>`` for each of its DP ranks) and
# which differs between servers (a fresh uuid per server start unless set by hand). Groups are
# named, not counted: their "DP size" is the size of the name space.
DERIVED_GROUPS = 1 << 31


def derived_group(engine_id: str) -> int:
    """The kvferry group of the prefill server whose vLLM engine id is ``engine_id``."""
    digest = hashlib.sha256(engine_id.encode()).digest()
    return int.from_bytes(digest[:4], "little") % DERIVED_GROUPS


@dataclass
class ConnectorConfig:
    """``kv_connector_extra_config``: ``bootstrap`` (the registry URL, required), ``dp_rank``
    and ``dp_size`` (a prefill server's kvferry DP group among the prefill servers sharing the
    registry; by default derived from vLLM's engine id, so that prefill servers with identical
    configurations each form their own group), and ``agent``, further agent options as keywords
    (``{"transport": "zmq-ipc", "host": "10.0.0.5"}``), and ``server_url``, the base URL the
    agents register as their engine server's (by default the server's own ``--host`` and
    ``--port``, ``VLLM_HOST_IP`` for a server listening on every address: ``server_url``).
    ``engine_dp_rank`` is the engine's vLLM
    data-parallel rank (its parallel config's ``data_parallel_index``): each DP rank of a server
    is an engine of its own, with an engine id of its own (vLLM appends ``_dp<rank>``), hence a
    group of its own. ``config``: a kvferry config file for the agents (as ``kvferry prefill
    --config`` reads it; ``KVFERRY_CONFIG`` when absent), below ``agent``'s options.

    Keys, the agent's options among them, are spelled with ``_`` or ``-`` alike (``api_port``,
    ``api-port``; kvferry.engine_options); an agent option that no agent has is refused with
    the valid ones named."""

    bootstrap: str
    dp_rank: int = 0
    dp_size: int = 1
    agent: dict[str, Any] = field(default_factory=dict)
    engine_dp_rank: int = 0
    server_url: str | None = None
    config: str | None = None

    def identity(self) -> dict[str, Any]:
        """The answer to ``kvferry_identify``."""
        return {DP_RANK: self.dp_rank, BOOTSTRAP: self.bootstrap, ENGINE_DP_RANK: self.engine_dp_rank}

    @classmethod
    def of(cls, extra: dict[str, Any] | None, engine_id: str, engine_dp_rank: int = 0) -> ConnectorConfig:
        from kvferry import engine_options

        extra = engine_options.normalized(extra, "KvferryConnector: kv_connector_extra_config")
        agent = engine_options.normalized(extra.get("agent"), "KvferryConnector: kv_connector_extra_config's agent")
        config = agent.pop("config", None) or extra.get("config")
        # The registry, as any agent option: from the agent's options, KVFERRY_BOOTSTRAP or
        # the config file when not given here.
        extra["bootstrap"] = (extra.get("bootstrap") or agent.pop("bootstrap", None)
                              or engine_options.setting("bootstrap", str(config) if config else None))
        if not extra.get("bootstrap"):
            raise ValueError(
                "KvferryConnector: kv_connector_extra_config needs \"bootstrap\": the kvferry "
                "registry URL (e.g. http://127.0.0.1:8998)"
            )
        unknown = set(extra) - {"bootstrap", "dp_rank", "dp_size", "agent", "server_url", "config"}
        if unknown:
            raise ValueError(
                f"KvferryConnector: unknown kv_connector_extra_config keys {sorted(unknown)} (keys: bootstrap, "
                "dp_rank, dp_size, server_url, config, agent); agent options go under \"agent\""
            )
        engine_options.check_names(agent, "prefill", "KvferryConnector: kv_connector_extra_config's agent")
        if "dp_rank" in extra or "dp_size" in extra:
            dp_rank, dp_size = int(extra.get("dp_rank", 0)), int(extra.get("dp_size", 1))
            if not 0 <= dp_rank < dp_size:
                raise ValueError(f"KvferryConnector: dp_rank {dp_rank} must be < dp_size {dp_size}")
        else:
            dp_rank, dp_size = derived_group(engine_id), DERIVED_GROUPS
        url = extra.get("server_url")
        return cls(str(extra["bootstrap"]), dp_rank, dp_size, agent, engine_dp_rank,
                   str(url).rstrip("/") if url else None, str(config) if config else None)


# vLLM's own default port of its OpenAI-compatible server.
VLLM_PORT = 8000


def server_url(argv: list[str], env: dict[str, str]) -> str | None:
    """The base URL of the vLLM server whose command line is ``argv`` (engine and worker
    processes keep their API server's: vLLM forks them, or spawns them with the parent's
    ``sys.argv``): its ``--host`` and ``--port``; ``VLLM_HOST_IP`` (vLLM's own variable naming
    this node's address) for a server listening on every address. None when no address is
    known (no host given and no ``VLLM_HOST_IP``)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int, default=VLLM_PORT)
    try:
        args, _ = parser.parse_known_args(argv[1:])
    except SystemExit:
        return None
    host = args.host
    if host in (None, "", "0.0.0.0", "::"):
        host = env.get("VLLM_HOST_IP")
    if not host:
        return None
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{args.port}"
