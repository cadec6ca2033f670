"""Fixtures: the kvferry binary of this checkout and a real registry process."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def kvferry_bin() -> pathlib.Path:
    """target/release/kvferry (scripts/test builds it first)."""
    path = pathlib.Path(os.environ.get("KVFERRY_BIN", REPO / "target" / "release" / "kvferry"))
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo build --release` first")
    return path


@pytest.fixture(scope="session")
def registry(kvferry_bin, tmp_path_factory):
    """A `kvferry bootstrap --port 0` process; yields its URL from the listening line."""
    log = tmp_path_factory.mktemp("registry") / "stderr.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [str(kvferry_bin), "bootstrap", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the registry printed no listening line; {log}:\n{log.read_text()}")
        listening = json.loads(line)
        assert listening["event"] == "listening" and listening["role"] == "bootstrap", listening
        yield listening["url"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "own_process: run the test in a forked child that starts its own agents and exits",
    )


def pytest_pyfunc_call(pyfuncitem):
    """Runs `own_process` tests in a forked child. The pytest process itself never starts an
    agent (nor the extension's runtime), so the fork is clean, and no test inherits another's
    agents."""
    if pyfuncitem.get_closest_marker("own_process") is None:
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run the test, report a failure's traceback, exit without cleanup
        os.close(read)
        status, text = 0, b""
        try:
            pyfuncitem.obj(**args)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            import traceback

            status, text = 1, traceback.format_exc().encode()
        with os.fdopen(write, "wb") as out:
            out.write(text)
        os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        text = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status != 0:
        pytest.fail(f"in the test's own process (wait status {status}):\n{text}", pytrace=False)
    return True
