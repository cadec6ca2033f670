"""kvferry as an LMCache transfer channel: ``transfer_channel_type="kvferry"``.

Importing this package registers the channel with LMCache's factory registry
(``lmcache.v1.distributed.transfer_channel.factory.register_transfer_channel_factory``), so
that ``initialize_transfer_channel_context("kvferry", ...)``, LMCache's transfer channel
benchmark (``--transfer-channel-type kvferry``) and its P2P server
(``--p2p-transfer-engine kvferry``) build a :class:`~kvferry.lmcache.channel.KvferryContext`.
LMCache has no entry point for third-party channels, so the package must be imported before
LMCache creates its context: ``python -m kvferry.lmcache`` runs LMCache's own commands with it
imported (``__main__.py``). docs/lmcache.md has the commands and the settings.

LMCache is not a dependency of the ``kvferry`` package: only this subpackage needs it, and
importing it without LMCache raises ImportError.
"""

from __future__ import annotations

try:
    from lmcache.v1.distributed.transfer_channel.factory import register_transfer_channel_factory
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvferry.lmcache needs LMCache's transfer channel API (lmcache 0.5.6: "
        "`pip install lmcache==0.5.6`, or scripts/lmcache/install for a venv with it); "
        f"importing it failed: {e}"
    ) from e

from .channel import KvferryClient, KvferryContext, KvferryServer, create_context

NAME = "kvferry"

__all__ = ["NAME", "KvferryClient", "KvferryContext", "KvferryServer", "create_context", "register"]


_registered = False


def register() -> None:
    """Registers ``kvferry`` with LMCache's transfer channel factories (done once, on import;
    a second call does nothing). LMCache refuses a second factory of the name with ValueError."""
    global _registered
    if not _registered:
        register_transfer_channel_factory(NAME, create_context)
        _registered = True


register()
