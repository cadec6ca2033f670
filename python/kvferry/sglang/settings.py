"""SGLang's own transfer settings as kvferry's options, importable without SGLang: its
``SGLANG_DISAGGREGATION_*`` timeouts and heartbeats (``sglang_settings``) and its
``--disaggregation-ib-device`` as UCX's device list (``ucx_net_devices``). docs/sglang.md has the
table."""

from __future__ import annotations

import os
from typing import Any

from .. import ConfigError

# SGLang's own transfer settings (``sglang.srt.environ``: seconds) that kvferry honours, and
# SGLang's defaults and floors where one depends on another. docs/sglang.md has the table.
BOOTSTRAP_TIMEOUT = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_TIMEOUT = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
HEARTBEAT_INTERVAL = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
HEARTBEAT_MAX_FAILURE = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
HEARTBEAT_DEFAULTS = (5.0, 2)
HEARTBEAT_FLOORS = (2.0, 1)


def sglang_settings(env: Any, prefill: bool) -> dict[str, int]:
    """The kvferry options of the ``SGLANG_DISAGGREGATION_*`` settings set in ``env`` (unset
    ones leave kvferry's defaults: SGLang's own, 300 s, are the waits kvferry exists to avoid):

    - ``BOOTSTRAP_TIMEOUT``: a prefill's room waits this long for its decode
      (``room_ttl_ms``); a decode waits this long for the prefill group to register
      (``timeout_bootstrap_ms``).
    - ``WAITING_TIMEOUT``: a decode's requested room waits this long for the prefill's KV
      (``timeout_ready_ms``).
    - ``HEARTBEAT_INTERVAL`` (at least 2 s, as SGLang has it): ``heartbeat_ms``;
      ``HEARTBEAT_MAX_FAILURE`` (at least 1) missed heartbeats declare a peer dead:
      ``peer_dead_ms`` is their product (SGLang's defaults for the one not set, 5 s and 2)."""

    def number(name: str, kind: type) -> Any:
        raw = env.get(name)
        if raw is None or not str(raw).strip():
            return None
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a {kind.__name__}") from None

    out: dict[str, int] = {}
    bootstrap = number(BOOTSTRAP_TIMEOUT, float)
    if bootstrap is not None:
        out["room_ttl_ms" if prefill else "timeout_bootstrap_ms"] = round(bootstrap * 1000)
    waiting = number(WAITING_TIMEOUT, float)
    if waiting is not None and not prefill:
        out["timeout_ready_ms"] = round(waiting * 1000)
    interval, failures = number(HEARTBEAT_INTERVAL, float), number(HEARTBEAT_MAX_FAILURE, int)
    if interval is not None:
        out["heartbeat_ms"] = round(max(interval, HEARTBEAT_FLOORS[0]) * 1000)
    if interval is not None or failures is not None:
        every = max(HEARTBEAT_DEFAULTS[0] if interval is None else interval, HEARTBEAT_FLOORS[0])
        times = max(HEARTBEAT_DEFAULTS[1] if failures is None else failures, HEARTBEAT_FLOORS[1])
        out["peer_dead_ms"] = round(every * times * 1000)
    return out


# Where the host lists its RDMA devices (a name there is an HCA, not a network interface).
RDMA_DEVICES = "/sys/class/infiniband"


def ucx_net_devices(devices: str, rdma: str = RDMA_DEVICES) -> str:
    """``UCX_NET_DEVICES`` for SGLang's ``--disaggregation-ib-device`` list of one GPU
    (``mlx5_0,mlx5_1``): an RDMA device gets UCX's port suffix ``:1`` (as SGLang's NIXL
    backend does), a network interface (``eth0``) and a name with a port (``mlx5_0:2``) stay."""
    names = [n.strip() for n in devices.split(",") if n.strip()]
    return ",".join(f"{n}:1" if ":" not in n and os.path.isdir(os.path.join(rdma, n)) else n for n in names)
