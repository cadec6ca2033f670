"""The registry side of kvferry under SGLang.

SGLang starts its transfer backend's bootstrap server in a prefill server's main process, on
``--disaggregation-bootstrap-port``, and its router tells every decode that address with each
request (``bootstrap_host``, ``bootstrap_port``). For kvferry that address is a kvferry registry:
:class:`KvferryBootstrapServer` runs ``python -m kvferry bootstrap`` there, and the prefill's
agents register in it. With ``KVFERRY_BOOTSTRAP`` set, the agents register in that registry
instead, and the bootstrap port is expected to reach it.

A decode needs a registry for its own ranks' registrations only: it finds each room's prefill
group at the request's bootstrap address, which its agent asks only when it trusts it
(``KVFERRY_ALLOWED_REGISTRIES`` lists the prefill servers' bootstrap addresses; backend.py).
Without ``KVFERRY_BOOTSTRAP`` each decode rank runs a private one on 127.0.0.1
(``kvferry.registry.spawn_registry``).
"""

from __future__ import annotations

import logging
import subprocess

from .. import engine_options
from ..registry import spawn_registry, stop_registry

logger = logging.getLogger(__name__)


class KvferryBootstrapServer:
    """SGLang's bootstrap server for ``kvferry``: a kvferry registry on the bootstrap port, or
    nothing when ``KVFERRY_BOOTSTRAP`` names the registry."""

    def __init__(self, host: str, port: int) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = str(engine_options.setting("bootstrap") or "")
        if self.url:
            logger.info("kvferry: prefill ranks register in %s (KVFERRY_BOOTSTRAP or the config file)", self.url)
            return
        self.proc, self.url = spawn_registry(host or "127.0.0.1", port)
        logger.info("kvferry: registry listening at %s", self.url)

    def close(self) -> None:
        stop_registry(self.proc)
