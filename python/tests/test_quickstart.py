"""docs/quickstart.md, run as a newcomer pastes it: every ``sh`` block of an engine's section, in
order, in one bash (``set -euo pipefail``, this environment, the repository's root as working
directory), on free ports. The engine's install script runs too (a no-op when its venv is up to
date). Blocks whose first line is ``# not run by the tests`` are skipped; what they do is
provided instead: the release binary on ``PATH`` (``kvferry_bin``) and this checkout's wheel,
unpacked, on ``PYTHONPATH`` (conftest.engine_python), rather than installed into the shared venv.

Each section must answer its completion through the proxy or router with text, its decode's
kvferry agent must count a room landed, and its last block must stop every process the section
started: the bash runs in a process group of its own, which must be empty soon after it exits.
Whatever is left (a failed run) is killed with the group."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import time

import pytest

import deployments
from conftest import REPO, engine_python
from vllm_servers import free_port

PAGE = REPO / "docs" / "quickstart.md"
NOT_RUN = "# not run by the tests"
# Each engine's section: the venv fixture's arguments, the variable that points its install
# script at that venv, and the ports the page reads.
SECTIONS = {
    "vLLM": (("KVFERRY_VLLM_PYTHON", "vllm-venv", "scripts/vllm/install"), "KVFERRY_VLLM_VENV",
             ("PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT", "PROXY_PORT", "PREFILL_METRICS_PORT",
              "DECODE_METRICS_PORT")),
    "SGLang": (("KVFERRY_SGLANG_PYTHON", "sglang-venv", "scripts/sglang/install"), "KVFERRY_SGLANG_VENV",
               ("PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT", "ROUTER_PORT", "ROUTER_METRICS_PORT",
                "DECODE_METRICS_PORT")),
}
# Two servers starting (half a minute each, on the same two cores) and the install script's import
# check, with room to spare on a busy machine.
TIMEOUT_S = 900
# How a section starts an engine server (each is counted in the run's ledger, deployments.py).
ENGINE_STARTS = {"vllm": "-m vllm.entrypoints.openai.api_server", "sglang": "-m sglang.launch_server"}


def sh_blocks(text: str) -> dict[str, list[str]]:
    """The page's ``sh`` blocks by ``## `` section, in order."""
    sections: dict[str, list[str]] = {}
    section, block = "", None
    for line in text.splitlines():
        if block is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.strip() == "```sh":
                block = []
            elif line.startswith("```") and line.strip() != "```":
                assert not line.startswith("```sh"), f"a block opening {line!r} is not read as sh"
        elif line.startswith("```"):
            sections.setdefault(section, []).append("\n".join(block) + "\n")
            block = None
        else:
            block.append(line)
    assert block is None, "a code block of docs/quickstart.md is not closed"
    return sections


def runnable(blocks: list[str]) -> list[str]:
    return [b for b in blocks if not b.startswith(NOT_RUN)]


def test_the_page_runs_every_block_but_those_it_says_it_does_not():
    sections = sh_blocks(PAGE.read_text())
    assert set(SECTIONS) <= set(sections), f"sections with sh blocks: {list(sections)}"
    for name, blocks in sections.items():
        for block in blocks:
            if block.startswith(NOT_RUN):
                # The marker gives its reason: `# not run by the tests: because ...`.
                assert re.match(re.escape(NOT_RUN) + r": \S.{10,}", block), f"{name}: no reason given in {block!r}"
            else:
                assert NOT_RUN not in block, f"{name}: the marker is not the block's first line: {block!r}"
                assert name in SECTIONS, f"section {name!r} has a block no test runs: {block!r}"
    for name in SECTIONS:
        assert len(runnable(sections[name])) >= 5, f"{name}: {sections[name]}"


# vLLM's section runs from the wheel installed into a fresh venv, as a user runs it
# (test_install.py); the others from the venvs the tests share.
@pytest.fixture(params=[name for name in SECTIONS if name != "vLLM"])
def section(request, tmp_path_factory):
    """An engine section's name, its venv's python and the unpacked wheel (skipped, as every
    engine test is, when the venv's variable is unset and the default venv is missing)."""
    (variable, venv, install), _, _ = SECTIONS[request.param]
    python, site = engine_python(variable, venv, install, tmp_path_factory)
    return request.param, python, site


@pytest.mark.deployment("quickstart")
def test_a_section_answers_a_completion_and_stops_what_it_started(section, kvferry_bin, tmp_path):
    name, python, site = section
    _, venv_variable, port_names = SECTIONS[name]
    script = "set -euo pipefail\n" + "\n".join(runnable(sh_blocks(PAGE.read_text())[name]))
    env = os.environ | {
        # What the blocks the tests do not run provide: kvferry on PATH, its wheel on the path.
        "PATH": f"{kvferry_bin.parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": site,
        # The install script checks (and, if out of date, installs) the venv the tests use.
        venv_variable: str(pathlib.Path(python).parents[1]),
    }
    run_section(name, script, env, port_names, tmp_path, f"docs/quickstart.md {name} server")


def run_section(name: str, script: str, env: dict, port_names, tmp_path: pathlib.Path, engine_label: str) -> None:
    """Runs a section's ``script`` in ``env`` (and free ports of ``port_names``), in a process
    group of its own: it answers a completion, its decode agent lands the answer's room, and its
    last block stops everything it started."""
    engines = [deployments.Engine(kind, engine_label)
               for kind, start in ENGINE_STARTS.items() for _ in range(script.count(start))]
    assert engines, f"the {name} section starts no engine server the tests know of"
    (tmp_path / "section.sh").write_text(script)
    env = env | {p: str(free_port()) for p in port_names} | {"QUICKSTART_DIR": str(tmp_path)}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    start = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(["bash", str(tmp_path / "section.sh")], cwd=REPO, env=env, stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, process_group=0)
    try:
        try:
            rc = proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - start
        logs = server_logs(tmp_path / name.lower()) + f"\nstderr:\n{tail(err)}\nstdout:\n{tail(out)}"
        assert rc == 0, f"the {name} section ended with {rc} after {took:.0f} s; {logs}"
        answer = answer_of(name, out.read_text())
        assert answer is not None, f"no {name} answer in the section's output; {logs}"
        # The decode agent's counters, as the page prints them: the answer's room landed.
        rooms = counter(out.read_text(), "kvferry_rooms_total", 'state="success"')
        landed = counter(out.read_text(), "kvferry_kv_bytes_total", 'direction="received"')
        assert rooms >= 1 and landed > 0, f"the decode agent landed {rooms} rooms, {landed} bytes; {logs}"
        print(f"\n{name}: answered in a section of {took:.0f} s ({rooms:.0f} room, {landed:.0f} bytes landed): "
              f"{json.dumps(answer)[:300]}")
        # The last block stopped everything the section started.
        deadline = time.monotonic() + 60
        while group_alive(proc.pid):
            assert time.monotonic() < deadline, (
                f"processes of the {name} section still run 60 s after its last block:\n{group_ps(proc.pid)}")
            time.sleep(0.5)
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(5)
            if group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for engine in engines:
            engine.stopped()


def answer_of(name: str, stdout: str) -> dict | None:
    """The section's answer: vLLM's OpenAI completion, with text and the prompt's KV loaded
    from the prefill (kvferry's params in the decode's answer), or SGLang's ``/generate`` answer
    with text and token counts."""
    for line in stdout.splitlines():
        try:
            got = json.loads(line)
        except ValueError:
            continue
        if name == "vLLM" and isinstance(got, dict) and "choices" in got:
            text = got["choices"][0]["text"]
            assert isinstance(text, str) and text, got
            params = got["kv_transfer_params"]
            assert params["kvferry_tokens"] == got["usage"]["prompt_tokens"] > 0, got
            assert params["kvferry_start_token"] == 0, got
            return got
        if name == "SGLang" and isinstance(got, dict) and "meta_info" in got:
            assert isinstance(got["text"], str) and got["text"], got
            assert got["meta_info"]["prompt_tokens"] > 0 and got["meta_info"]["completion_tokens"] > 0, got
            return got
    return None


def counter(stdout: str, name: str, label: str) -> float:
    """The sum of a metric's series with ``label`` among the metrics lines of ``stdout``."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in stdout.splitlines()
        if line.startswith(name + "{") and label in line.split("}", 1)[0]
    )


def group_ps(pgid: int) -> str:
    """The processes of group ``pgid``, as ps lists them."""
    lines = subprocess.run(["ps", "-eo", "pgid=,pid=,args="], capture_output=True, text=True).stdout.splitlines()
    return "\n".join(line for line in lines if line.split(None, 1)[0] == str(pgid))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def server_logs(where: pathlib.Path) -> str:
    """The end of every log the section wrote."""
    return "".join(f"\n{log}:\n{tail(log, 15)}" for log in sorted(where.glob("*.log")))


def tail(path: pathlib.Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
