"""Real SGLang servers for the tests: the SGLang venv's interpreter (scripts/sglang/install) with
this checkout's wheel on its path, so that SGLang finds kvferry's plugin; the test-only
stand-in for sgl-kernel's CPU ops (sglang_stub/, see its docstring); the tiny seeded model of
scripts/vllm/tiny_model.py; SGLang's own PD router (sglang-router) in front of a prefill and a
decode server; and HF transformers' greedy outputs as the reference (hf_reference.py).

Every process runs in a process group of its own in the tests' session; ``stop`` ends it with
SIGTERM, then SIGKILL to its group."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import subprocess
import time
import urllib.request
from typing import Any

import deployments
import hf_reference
from vllm_servers import free_port, log_name, post, tail, wait_ok

STUB = pathlib.Path(__file__).parent / "sglang_stub"
ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RUST_LOG": "kvferry=warn",
}
# A server at --tp-size 2 on this machine: a core per rank (SGLang refuses more ranks than NUMA
# nodes otherwise), and no NCCL (PyPI's torch ships libnccl; SGLang would set it up on the CPU
# and fail): a library path that does not load turns it off.
TP2 = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}
# What SGLang's CPU engine needs here (docs/sglang.md), and --sleep-on-idle: an idle scheduler
# otherwise polls a core of its own, and the tests run up to six on two cores.
CPU_ARGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
    "--grammar-backend", "none", "--max-total-tokens", "4096", "--context-length", "1024",
    "--mem-fraction-static", "0.05", "--dtype", "float32", "--random-seed", "0", "--sleep-on-idle",
)


def sglang_env(site: str, env: dict) -> dict:
    """The environment of an SGLang process: the wheel's unpacked ``site`` and the stand-in on
    its path."""
    path = os.pathsep.join([str(STUB), site])
    return env | ENV | {"PYTHONPATH": path}


class Process:
    """A process of its own group, its output in ``log``; an engine (``engine``) is counted in
    the run's ledger (deployments.py)."""

    def __init__(self, cmd: list[str], env: dict, log: pathlib.Path, engine: str | None = None) -> None:
        self.log = log
        self.engine = deployments.Engine(engine, f"{engine} server {log.name}") if engine else None
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL and self.engine:
            self.engine.stopped()

    def stop(self) -> None:
        """SIGTERM to the main process (SGLang stops its scheduler and detokenizer; SIGTERM to
        each of them makes it report a crash), then SIGKILL to whatever is left of the group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.engine:
            self.engine.stopped()

    def wait_ok(self, url: str, what: str, timeout: float = 300) -> None:
        wait_ok(self.proc, url, what, self.log, timeout)


class Server(Process):
    """``python -m sglang.launch_server`` on 127.0.0.1: plain, or a PD role with kvferry."""

    def __init__(self, python: str, env: dict, model: pathlib.Path, log: pathlib.Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(self.port), *CPU_ARGS, *args,
        ]
        super().__init__(cmd, env, log, engine="sglang")

    def wait_healthy(self, timeout: float = 300) -> None:
        self.wait_ok(self.url + "/health", "SGLang", timeout)

    def generate(self, prompt: list[int], max_new_tokens: int) -> dict:
        return generate(self.url, prompt, max_new_tokens)

    def agent_apis(self) -> list[str]:
        """The API URLs of the kvferry agents of this server's scheduler ranks (each manager
        logs its agent's when it starts)."""
        found = re.findall(r"kvferry (?:prefill|decode) agent \S+ \(registry \S+\): .* api (http://\S+)", self.log.read_text())
        assert found, f"no kvferry agent started in {self.log}"
        return found


def generate(url: str, prompt: list[int], max_new_tokens: int) -> dict:
    """SGLang's native ``/generate``, greedy; the response JSON."""
    body: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    return post(url + "/generate", body)


def output_ids(response: dict) -> list[int]:
    return list(response["output_ids"])


def reference_outputs(python: str, env: dict, model: pathlib.Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """HF transformers' greedy outputs for ``prompts`` (hf_reference.py, in the SGLang venv): the
    tokens a plain SGLang server gives, without starting one."""
    return hf_reference.outputs(python, env, model, new_tokens, prompts)


def check_outputs(pd: Pd, prompts: list[list[int]], reference: dict, new_tokens: int) -> None:
    """Sends every prompt through the router, 4 at once; each output equals the reference."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: pd.generate(p, new_tokens), prompts))
    for p, g in zip(prompts, got):
        assert "output_ids" in g, f"prompt of {len(p)} tokens: {g}"
        assert output_ids(g) == reference[tuple(p)], f"prompt of {len(p)} tokens"
    print(f"{len(prompts)} prompts of {sorted(len(p) for p in prompts)} tokens at concurrency 4: token-identical")


def used_tokens(server: Server) -> int:
    """KV tokens the server's requests hold now (``GET /v1/loads``; cached tokens no request
    holds are not counted)."""
    with urllib.request.urlopen(server.url + "/v1/loads", timeout=10) as r:
        loads = json.loads(r.read())
    return sum(int(load["num_used_tokens"]) for load in loads["loads"])


class Pd:
    """``prefills`` prefill and ``decodes`` decode SGLang servers with
    ``--disaggregation-transfer-backend kvferry`` and sglang-router in PD mode in front of them,
    each prefill on a bootstrap port of its own (as SGLang expects). ``args`` go to every server,
    ``prefill_args``, ``prefill_env`` and ``decode_env`` to every server of one role,
    ``router_args`` to the router. The decodes' agents trust the prefills' registries only, as an
    operator configures them: ``KVFERRY_ALLOWED_REGISTRIES`` lists each
    ``127.0.0.1:BOOTSTRAP_PORT`` (the addresses the router names), unless ``decode_env`` sets it.
    ``prefill`` and ``decode`` are the first server of each role."""

    def __init__(self, python: str, env: dict, model: pathlib.Path, logs: pathlib.Path, args: tuple[str, ...] = (),
                 prefill_args: tuple[str, ...] = (), prefill_env: dict | None = None,
                 decode_env: dict | None = None, prefills: int = 1, decodes: int = 1,
                 router_args: tuple[str, ...] = ()) -> None:
        self.python, self.env, self.model, self.logs, self.args = python, env, model, logs, args
        self.prefill_args, self.router_args = prefill_args, router_args
        self.bootstrap_ports = [free_port() for _ in range(prefills)]
        trusted = {"KVFERRY_ALLOWED_REGISTRIES": ",".join(f"127.0.0.1:{p}" for p in self.bootstrap_ports)}
        self.prefill_env, self.decode_env = env | (prefill_env or {}), env | trusted | (decode_env or {})
        self.allowed_registries = self.decode_env["KVFERRY_ALLOWED_REGISTRIES"]
        self.router: Process | None = None
        self.prefills = [self.start_prefill(i) for i in range(prefills)]
        self.decodes = [self.start_decode(i) for i in range(decodes)]

    @property
    def prefill(self) -> Server:
        return self.prefills[0]

    @property
    def decode(self) -> Server:
        return self.decodes[0]

    @property
    def bootstrap_port(self) -> int:
        return self.bootstrap_ports[0]

    def start_prefill(self, i: int) -> Server:
        return Server(
            self.python, self.prefill_env, self.model, self.logs / log_name("prefill", i), "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", "kvferry",
            "--disaggregation-bootstrap-port", str(self.bootstrap_ports[i]), *self.args, *self.prefill_args,
        )

    def start_decode(self, i: int) -> Server:
        return Server(
            self.python, self.decode_env, self.model, self.logs / log_name("decode", i), "--disaggregation-mode", "decode",
            "--disaggregation-transfer-backend", "kvferry",
            "--disaggregation-decode-retraction-backup", "none", *self.args,
        )

    def restart_prefill(self, i: int = 0) -> None:
        """Starts prefill ``i`` again after it died, then the router (which keeps a dead
        worker out of its rotation for minutes)."""
        self.prefills[i].proc.wait()
        self.prefills[i] = self.start_prefill(i)
        if self.router is not None:
            self.router.stop()
        self.start_router()

    def start_router(self) -> None:
        for server in self.prefills + self.decodes:
            server.wait_healthy()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        workers = [a for s, b in zip(self.prefills, self.bootstrap_ports) for a in ("--prefill", s.url, str(b))]
        workers += [a for s in self.decodes for a in ("--decode", s.url)]
        cmd = [
            self.python, "-m", "sglang_router.launch_router", "--pd-disaggregation", *workers,
            "--host", "127.0.0.1", "--port", str(port), "--disable-circuit-breaker",
            # Its metrics listen on 0.0.0.0:29000 unless told otherwise.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *self.router_args,
        ]
        self.router = Process(cmd, self.env, self.logs / "router.log")
        self.router.wait_ok(self.url + "/health", "sglang-router", 120)
        # The router admits its workers in the background after /health answers.
        deadline = time.monotonic() + 120
        while "output_ids" not in (got := generate(self.url, [5, 6, 7], 1)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router answers {got}; {self.router.log}:\n{tail(self.router.log)}")
            time.sleep(0.5)

    def generate(self, prompt: list[int], max_new_tokens: int) -> dict:
        return generate(self.url, prompt, max_new_tokens)

    def stop(self) -> None:
        for p in [self.router, *self.decodes, *self.prefills]:
            if p is not None:
                p.stop()
