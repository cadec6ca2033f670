"""``python -m kvferry.lmcache COMMAND ARGS``: LMCache's own commands with the ``kvferry``
transfer channel registered (LMCache has no entry point for third-party channels, and its
server imports ``--server-module`` plugins only after it created its channel).

- ``benchmark ARGS``: LMCache's transfer channel benchmark,
  ``python -m lmcache.tools.transfer_channel_benchmark ARGS`` (``--transfer-channel-type
  kvferry``);
- anything else: LMCache's command line, ``lmcache ARGS`` (``server ... --p2p-transfer-engine
  kvferry``, ``tool transfer-channel-benchmark ...``).
"""

from __future__ import annotations

import runpy
import sys

# Importing the package registers the channel.
from kvferry.lmcache import NAME

BENCHMARK = "lmcache.tools.transfer_channel_benchmark"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{__doc__.strip()}\n\nRegistered channel: {NAME}", file=sys.stderr)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "benchmark":
        sys.argv = [f"python -m {BENCHMARK}", *rest]
        runpy.run_module(BENCHMARK, run_name="__main__", alter_sys=True)
        return
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache", *argv]
    lmcache_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
