"""``kvferry ROLE FLAGS`` and ``python -m kvferry ROLE FLAGS``: the ``kvferry`` command line,
every subcommand (``bootstrap``, ``prefill``, ``decode``, ``proxy``, ``demo``, ``bench``; the
agents ``demo`` and ``bench`` start are this interpreter's ``-m kvferry``), run by the extension
module: no binary, no Rust toolchain needed. The wheel's ``kvferry``
console script calls :func:`main`.

``kvferry.spawn`` starts sidecar agents this way, with ``KVFERRY_STOP_ON_STDIN_EOF=1`` and its
end of a pipe as stdin: when the engine process is gone (closed or killed), the pipe ends and the
agent stops as on SIGTERM, so no sidecar outlives its engine holding the engine's rank."""

import os
import signal
import sys
import threading

from . import Error
from ._kvferry import main as _run


def stop_on_stdin_eof() -> None:
    def watch() -> None:
        # The raw descriptor, not sys.stdin: a daemon thread blocked in a buffered read would
        # hold the buffer's lock while the interpreter finalizes (a fatal error at exit).
        while os.read(0, 65536):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvferry-stdin-watch", daemon=True).start()


def main() -> None:
    """Runs the command line in ``sys.argv``; a role that fails exits 1 with its message."""
    if os.environ.get("KVFERRY_STOP_ON_STDIN_EOF") == "1":
        stop_on_stdin_eof()
    try:
        _run(["kvferry", *sys.argv[1:]])
    except Error as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
