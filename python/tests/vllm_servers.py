"""Real vLLM servers for the tests: the vLLM venv's interpreter with this checkout's wheel on its
path (the ``torch_python`` fixture), the tiny seeded model of scripts/vllm/tiny_model.py, the
settings this machine needs (../docs/vllm.md), an OpenAI client small enough to read, the
prompt sets and their reference outputs (``tiny_vllm`` and ``reference_outputs``, the session
fixtures ``vllm`` and ``reference`` of conftest.py: one model and one reference per test run), prefill and decode
servers with the connector (``Pd``; ``View``: some of them behind proxies of their own),
``kvferry proxy`` in front of them (``Proxy``), and the run's fleet that most vLLM tests share
(``fleet``, ``FleetPrefill``; conftest.py's ``vllm_fleet``).

Every server runs in its own session, pinned to one core, and is stopped with SIGTERM to its
whole process group (its engine-core and worker processes too)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import zipfile
from typing import Any

import numpy as np

import deployments
import hf_reference
from conftest import REPO

MAX_MODEL_LEN = 1024
# Requests a server runs at once; more wait in its queue.
MAX_NUM_SEQS = 4
BLOCK_SIZE = 128
# The tiny model: 2 layers, 2 KV heads of 64 fp32 dims; one vLLM CPU block of every layer.
BLOCK_BYTES = 2 * BLOCK_SIZE * 2 * 2 * 64 * 4
# A server's KV cache unless its arguments size it: 512 blocks of the tiny model (a TP rank's
# half as many heads, twice the blocks), 8 times what 4 sequences of 1024 tokens hold.
KV_CACHE = ("--kv-cache-memory-bytes", "128M")
ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # The embedded agents' warnings and errors go to the server's log.
    "RUST_LOG": "kvferry=warn",
}


def ephemeral_ports() -> range:
    """The ports the kernel gives connections and port-0 binds (``ip_local_port_range``)."""
    try:
        low, high = map(int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


# Ports for servers that are told their port: below the kernel's ephemeral ones, so that no
# connection's source port and no port-0 bind can take one between the test choosing it and the
# server binding it (a server that binds with SO_REUSEADDR, as vLLM does, may then never see a
# request; one that does not fails "address already in use").
CHOSEN_PORTS = range(20000, 32767)


def free_port() -> int:
    """A port no socket holds now, outside the kernel's ephemeral ports."""
    ephemeral = ephemeral_ports()
    candidates = [p for p in CHOSEN_PORTS if p not in ephemeral]
    rng = np.random.default_rng()
    for _ in range(1000):
        port = int(rng.choice(candidates))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port outside the ephemeral range")


def unpack_wheel(into: pathlib.Path) -> pathlib.Path:
    """This checkout's built abi3 wheel (scripts/python/build) unpacked into ``into``, for an
    engine venv's ``PYTHONPATH``."""
    wheels = sorted((REPO / "target" / "python-wheels").glob("kvferry-*.whl"))
    assert wheels, "no built wheel in target/python-wheels (scripts/python/build)"
    zipfile.ZipFile(wheels[-1]).extractall(into)
    return into


def make_model(python: str, env: dict, out: pathlib.Path, seed: int, layers: int = 2) -> pathlib.Path:
    subprocess.run(
        [python, str(REPO / "scripts" / "vllm" / "tiny_model.py"), str(out), "--seed", str(seed), "--layers", str(layers)],
        env=env | ENV, check=True, capture_output=True, timeout=600,
    )
    return out


# The test-only connector that dumps the KV bytes of rooms (vllm_probe.py): its class and module.
PROBE = ("KvferryProbeConnector", "vllm_probe")


def connector(role: str, bootstrap: str, connector_class: tuple[str, str] = ("KvferryConnector", "kvferry.vllm"),
              **extra: Any) -> str:
    """The --kv-transfer-config of a kvferry prefill (``kv_producer``) or decode server
    (``connector_class``: the connector's class and module, PROBE for vllm_probe.py's)."""
    policy = extra.pop("kv_load_failure_policy", None)
    config = {
        "kv_connector": connector_class[0],
        "kv_connector_module_path": connector_class[1],
        "kv_role": role,
        "kv_connector_extra_config": {"bootstrap": bootstrap, "agent": extra},
    }
    if policy:
        config["kv_load_failure_policy"] = policy
    return json.dumps(config)


class Server:
    """One ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1."""

    def __init__(self, python: str, env: dict, model: pathlib.Path, cores: int | str, log: pathlib.Path, *args: str,
                 port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log = log
        self.engine = deployments.Engine("vllm", f"vLLM server {log.name} ({' '.join(args)[:120]})")
        cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--seed", "0",
            *(() if KV_CACHE[0] in args else KV_CACHE), *args,
        ]
        # A process group of its own (killed as one), in the tests' session: the kernel shares
        # a core evenly between sessions (autogroups), and an idle vLLM worker polls with
        # sched_yield, which gives the core away only within its own session. In sessions of
        # their own, a decode worker polling for a room kept the prefill computing that room,
        # pinned to the same core, from running for a minute.
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=env | ENV | {"VLLM_CPU_OMP_THREADS_BIND": str(cores)},
                stdout=out, stderr=subprocess.STDOUT, process_group=0,
            )

    def wait_healthy(self, timeout: float = 300) -> None:
        wait_ok(self.proc, self.url + "/health", "vLLM", self.log, timeout)

    def complete(self, prompt: list[int], max_tokens: int, params: dict | None = None, **extra: Any) -> dict:
        """POST /v1/completions, greedy; the response JSON (token ids returned)."""
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True, **extra,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        return post(self.url + "/v1/completions", body)

    def kvferry_group(self) -> int:
        """A prefill server's kvferry group, as a router learns it (``kvferry_identify``)."""
        got = self.complete([5, 6, 7], 1, {"kvferry_identify": True})
        return got["kv_transfer_params"]["kvferry_dp_rank"]

    def agent_api(self) -> str:
        """The API URL of the kvferry agent in this server's (first) worker."""
        return self.agent_apis()[0]

    def agent_apis(self) -> list[str]:
        """The API URLs of the kvferry agents in this server's workers, one per TP rank and DP
        rank (the connector logs each when it starts, after the worker's name and pid; an agent
        picks its own port), TP ranks in order; those of the server's latest start."""
        text = self.log.read_text()
        text = text[text.rfind("non-default args"):]
        found = re.findall(r"\((\w+) pid=(\d+)\).*kvferry (?:prefill|decode) agent \S+ on \S+: .* api (http://\S+)", text)
        assert found, f"no kvferry agent started in {self.log}"
        return [api for _, _, api in sorted(found)]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the server's whole process group (engine core and workers too)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.engine.stopped()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.engine.stopped()


    def chat(self, messages: list[dict], max_tokens: int, **extra: Any) -> dict:
        """POST /v1/chat/completions, greedy."""
        return post(self.url + "/v1/chat/completions", chat_body(self.model, messages, max_tokens, **extra))


def chat_body(model: str, messages: list[dict], max_tokens: int, **extra: Any) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


# What kvferry proxy says of where an answer's KV came from: a header, or in a stream a comment.
KV_HEADER = "x-kvferry-kv"


def post(url: str, body: dict, timeout: float = 300) -> dict:
    """The JSON answer (an error's as ``{"http_status", "error"}``), with the proxy's
    ``x-kvferry-kv`` header under that key when it has one."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer, said = json.loads(r.read()), r.headers.get(KV_HEADER)
    except urllib.error.HTTPError as e:
        answer, said = {"http_status": e.code, "error": json.loads(e.read() or b"null")}, e.headers.get(KV_HEADER)
    except TimeoutError as e:
        raise TimeoutError(f"POST {url}: no answer within {timeout} s (prompt of {len(body.get('prompt') or body.get('input_ids') or [])} tokens)") from e
    if said is not None:
        answer[KV_HEADER] = said
    return answer


def sse(url: str, body: dict, timeout: float = 300) -> tuple[list[dict], str | None]:
    """A streamed answer's events (``[DONE]`` checked and left out) and where its KV came from as
    the proxy says it: its ``x-kvferry-kv`` header, or the one comment line of the stream
    (``: x-kvferry-kv: ...``), checked to come before ``[DONE]`` (None: neither)."""
    req = urllib.request.Request(url, json.dumps(body | {"stream": True}).encode(), {"Content-Type": "application/json"})
    events, done, said = [], False, []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream"), r.headers
        header = r.headers.get(KV_HEADER)
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
            elif line.startswith(f": {KV_HEADER}: "):
                assert not done, "the stream said where its KV came from after [DONE]"
                said.append(line.removeprefix(f": {KV_HEADER}: "))
    assert done, events
    assert len(said) + (header is not None) <= 1, (header, said)
    return events, header or (said[0] if said else None)

def metric(url: str, name: str, label: str = "") -> float:
    """The sum of a metric's series (those whose labels contain ``label``; any, or the one
    without labels, when ``label`` is empty) on a /metrics."""
    # A busy machine can keep an agent's thread from answering for seconds.
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            text = r.read().decode()
    except TimeoutError as e:
        raise TimeoutError(f"GET {url}/metrics: no answer within 60 s") from e
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith(name + "{") and label in line.split("}", 1)[0]) or (not label and line.startswith(name + " "))
    )


def vllm_metric(server: Server, name: str, label: str = "model_name") -> float:
    """The sum of a vLLM metric's series on ``server`` (vLLM labels every series; ``label``:
    those whose labels contain it)."""
    return metric(server.url, name, label)


# A room an agent holds and has not finished: every state before a final one.
UNFINISHED = ("bootstrapping", "waiting_for_input", "transferring", "aborting")


def unfinished_rooms(agent_api: str) -> float:
    """Rooms an agent holds that are not final (``kvferry_rooms_held``)."""
    return sum(metric(agent_api, "kvferry_rooms_held", f'state="{s}"') for s in UNFINISHED)


def wait_ok(proc: subprocess.Popen, url: str, what: str, log: pathlib.Path, timeout: float) -> None:
    """Waits until ``url`` answers 200; fails, quoting the end of ``log``, when ``proc`` exits
    first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; {log}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout} s; {log}:\n{tail(log)}")


def tail(path: pathlib.Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


NEW_TOKENS = 16
LENGTHS = [1, 2, 37, 127, 129, 200, 255, 300, 383, 500, 640, 777, 900, 1000]
# Prompts that are prefixes of the longest one (prefix-cache hits on both servers).
SHARED = {129, 383, 640, 1000}


def make_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 2048, max(LENGTHS)).tolist()
    return [base[:n] if n in SHARED else rng.integers(3, 2048, n).tolist() for n in LENGTHS]


def make_chats() -> list[list[dict]]:
    """Conversations of a few to several hundred tokens (the tiny model's chat template)."""
    rng = np.random.default_rng(5)
    words = "prefill decode page token cache room layer head key value rank group".split()
    chats = []
    for n in (3, 60, 250):
        text = " ".join(rng.choice(words, n).tolist())
        chats.append([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}])
    return chats


# A prompt set per pairing, so that each starts with the decode's prefix cache cold for it.
SEEDS = {"sequential": 7, "concurrent": 8}


def tiny_vllm(torch_python: tuple[str, dict], tmp_path_factory) -> tuple[str, dict, pathlib.Path]:
    """The ``vllm`` fixture (conftest.py): the vLLM venv's python, its environment and the tiny
    model."""
    python, env = torch_python
    return python, env, make_model(python, env, tmp_path_factory.mktemp("model") / "tiny", seed=0)


def reference_outputs(vllm) -> dict:
    """The ``reference`` fixture (conftest.py): HF transformers' greedy outputs for every prompt
    and chat (hf_reference.py, in the vLLM venv), which a plain vLLM server gives too, without
    starting one."""
    python, env, model = vllm
    prompts = [prompt for seed in SEEDS.values() for prompt in make_prompts(seed)]
    return hf_reference.outputs(python, env | ENV, model, NEW_TOKENS, prompts, make_chats(), margin=1e-3)


def run_prompts(pd: Pd, pairing: str, prompts: list[list[int]], reference: dict, in_flight: int = 4) -> list[int]:
    """Sends every prompt through the proxy of ``pairing`` (``pd.via``), ``in_flight`` at once;
    checks each output against the reference and the bytes the decode agents landed against
    what the responses say was loaded. Returns the responses' start tokens. In first-token
    pairing a prompt of whole blocks that a decode's prefix cache holds entirely loads nothing
    (the decode computes only the first token, after the prompt) and counts as starting at its
    end."""
    landed_before = sum(metric(a, "kvferry_kv_bytes_total") for d in pd.decodes for a in d.agent_apis())
    counted_before = metric(pd.via[pairing].url, "kvferry_proxy_kv_total", 'outcome="landed"')
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        results = list(pool.map(lambda p: pd.via[pairing].complete(p, NEW_TOKENS), prompts))
    expected_bytes, starts = 0, []
    for prompt, got in zip(prompts, results):
        assert "choices" in got, got
        assert got["choices"][0]["token_ids"] == reference[tuple(prompt)], f"{len(prompt)}-token prompt"
        params = got["kv_transfer_params"]
        # The proxy says what the decode's connector said.
        assert got[KV_HEADER] == params["kvferry_kv"], (got[KV_HEADER], params)
        if params["kvferry_kv"] == "cached" and pairing == "first-token" and len(prompt) % BLOCK_SIZE == 0:
            starts.append(len(prompt))
            continue
        assert params["kvferry_kv"] == "landed", params
        assert params["kvferry_tokens"] == len(prompt), params
        start = params["kvferry_start_token"]
        assert start % BLOCK_SIZE == 0 and start < len(prompt)
        starts.append(start)
        expected_bytes += (-(-len(prompt) // BLOCK_SIZE) - start // BLOCK_SIZE) * BLOCK_BYTES
    landed = sum(metric(a, "kvferry_kv_bytes_total") for d in pd.decodes for a in d.agent_apis()) - landed_before
    counted = metric(pd.via[pairing].url, "kvferry_proxy_kv_total", 'outcome="landed"') - counted_before
    assert counted == sum(got[KV_HEADER] == "landed" for got in results), counted
    print(f"{pairing}: {len(prompts)} prompts token-identical, {landed:.0f} bytes landed, start tokens {starts}")
    assert landed == expected_bytes
    return starts


class Servers:
    """Prefill and decode servers of one registry with ``kvferry proxy`` in front of them:
    ``prefill`` and ``decode`` are the first of each role; ``via`` the proxies by pairing, of
    whoever made them (``proxy`` starts one; they stop with ``stop_proxies``)."""

    bootstrap: str
    logs: pathlib.Path
    kvferry_bin: Any
    model: str
    prefills: list[Server]
    decodes: list[Server]

    def __init__(self) -> None:
        self.proxies: list[Proxy] = []
        self.via: dict[str, Proxy] = {}

    @property
    def prefill(self) -> Server:
        return self.prefills[0]

    @prefill.setter
    def prefill(self, server: Server) -> None:
        self.prefills[0] = server

    @property
    def decode(self) -> Server:
        return self.decodes[0]

    @property
    def prefill_api(self) -> str:
        return self.prefill.agent_api()

    @property
    def decode_api(self) -> str:
        return self.decode.agent_api()

    def proxy(self, pairing: str, short_below: int | None = 0) -> Proxy:
        """``kvferry proxy`` in front of every server of these (``short_below``: its
        ``--short-below-tokens``, None for its default)."""
        p = Proxy(self.kvferry_bin, [s.url for s in self.prefills], [s.url for s in self.decodes], pairing,
                  self.logs, self.model, short_below=short_below)
        self.proxies.append(p)
        return p

    def stop_proxies(self) -> None:
        for p in self.proxies:
            p.stop()
        self.proxies, self.via = [], {}


class Pd(Servers):
    """A kvferry registry, ``prefills`` prefill servers and ``decodes`` decode servers with the
    connector, every server of one role started with the same configuration (prefill ``i`` on
    core ``i % 2``, decode ``i`` on the other core; a server of ``prefill_tp``/``decode_tp`` > 1
    TP ranks or ``prefill_dp`` > 1 DP ranks on a core per rank); ``prefill_args``/``decode_args``
    are extra vLLM flags, ``decode_policy`` the decodes' kv_load_failure_policy, ``agent`` extra
    agent options of every server (``decode_agent``: of the decode servers only; a list of
    dicts: one per decode), ``lease_ttl_ms`` the registry's lease, ``connector_class`` the
    connector's class and module (``connector``). More servers join the deployment with ``start_prefill`` and
    ``start_decode`` (``join``), and ``View`` shows some of them behind proxies of their own."""

    def __init__(self, vllm, kvferry_bin, logs: pathlib.Path, prefill_args=(), decode_args=(),
                 decode_policy: str | None = None, prefills: int = 1, decodes: int = 1, prefill_tp: int = 1,
                 decode_tp: int = 1, prefill_dp: int = 1, decode_agent: dict | list[dict] | None = None,
                 wait: bool = True, lease_ttl_ms: int | None = None,
                 connector_class: tuple[str, str] = ("KvferryConnector", "kvferry.vllm"), **agent: Any) -> None:
        super().__init__()
        self.python, self.env, self.model = vllm
        self.connector_class = connector_class
        self.logs = logs
        self.kvferry_bin = kvferry_bin
        self.members: list[Server] = []
        self.registry = subprocess.Popen(
            [str(kvferry_bin), "bootstrap", "--port", "0",
             *(("--lease-ttl-ms", str(lease_ttl_ms)) if lease_ttl_ms else ())],
            stdout=subprocess.PIPE, stderr=open(logs / "registry.log", "wb"), text=True,
        )
        self.bootstrap = json.loads(self.registry.stdout.readline())["url"]
        self.agent = agent
        self.prefill_args = tuple(prefill_args)
        self.decode_args = tuple(decode_args)
        self.prefill_shape = (prefill_tp, prefill_dp)
        per_decode = decode_agent if isinstance(decode_agent, list) else [decode_agent or {}] * decodes
        try:
            self.prefills = [self.start_prefill(i) for i in range(prefills)]
            self.decodes = [self.start_decode(i, decode_tp, decode_policy, per_decode[i]) for i in range(decodes)]
        except BaseException:
            self.stop()
            raise
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        """Until every server answers (``Pd(..., wait=False)`` returns as they start)."""
        try:
            for server in self.prefills + self.decodes:
                server.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def start_prefill(self, i: int = 0, port: int | None = None, tp: int | None = None, dp: int | None = None,
                      log: str | None = None) -> Server:
        """Prefill server ``i`` (on ``port``: a restarted one keeps its URL, as behind a proxy), of
        the deployment's shape unless ``tp``/``dp`` say otherwise."""
        tp, dp = tp or self.prefill_shape[0], dp or self.prefill_shape[1]
        return Server(
            self.python, self.env, self.model, cores(i % 2, tp * dp), self.logs / (log or log_name("prefill", i)),
            *self.prefill_args, *parallel_args(tp, dp),
            "--kv-transfer-config", connector("kv_producer", self.bootstrap, self.connector_class, **self.agent),
            port=port,
        )

    def start_decode(self, i: int, tp: int = 1, policy: str | None = None, agent: dict | None = None,
                     log: str | None = None, dp: int = 1) -> Server:
        """Decode server ``i`` of ``tp`` TP and ``dp`` DP ranks with ``policy`` and these agent
        options besides the deployment's."""
        config = connector("kv_consumer", self.bootstrap, self.connector_class, kv_load_failure_policy=policy,
                           **(self.agent | (agent or {})))
        return Server(self.python, self.env, self.model, cores((i + 1) % 2, tp * dp), self.logs / (log or log_name("decode", i)),
                      *self.decode_args, *parallel_args(tp, dp), "--kv-transfer-config", config)

    def join(self, server: Server) -> Server:
        """A server started for some tests, stopped with the deployment unless before."""
        self.members.append(server)
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        return server

    def restart_prefill(self, i: int = 0) -> Server:
        """Prefill server ``i`` again after it died, on its URL."""
        self.prefills[i] = self.start_prefill(i, port=self.prefills[i].port)
        self.prefills[i].wait_healthy()
        return self.prefills[i]

    def stop(self) -> None:
        """Everything (any number of calls)."""
        self.stop_proxies()
        for s in getattr(self, "prefills", []) + getattr(self, "decodes", []) + self.members:
            s.stop()
        self.registry.terminate()
        self.registry.wait()


class View(Servers):
    """Some servers of a deployment behind proxies of their own (``stop`` stops the proxies)."""

    def __init__(self, pd: Pd, prefills: list[Server], decodes: list[Server]) -> None:
        super().__init__()
        self.bootstrap, self.logs, self.kvferry_bin, self.model = pd.bootstrap, pd.logs, pd.kvferry_bin, pd.model
        self.registry = pd.registry
        self.prefills, self.decodes = prefills, decodes

    def stop(self) -> None:
        self.stop_proxies()


# The run's vLLM fleet (conftest's ``vllm_fleet``): every agent ends rooms nobody takes after
# FLEET_ROOM_TTL_MS, a room whose decode died waits FLEET_REQUEUE_MS for another, and only a
# closed connection ends a peer or a Hello within the tests' bounds (four engines and more on
# two cores: an agent's thread can wait seconds to run; the defaults, 5 s, assume engines with
# cores of their own); a test can arm a fault in a prefill's agent (``arm_corrupt_chunk``,
# ``hold_chunks``).
FLEET_ROOM_TTL_MS = 60_000
FLEET_REQUEUE_MS = 20_000
FLEET_AGENT = dict(room_ttl_ms=FLEET_ROOM_TTL_MS, peer_dead_ms=60_000, timeout_connect_ms=60_000,
                   requeue_ms=FLEET_REQUEUE_MS, fault_injection=True)
# A step computes at most this many tokens: prompts up to 320 tokens in one step, longer ones
# in chunks (ending inside a block, 320, and on one, 640).
FLEET_STEP_TOKENS = 320
# On SIGTERM a server drains for up to this many seconds (vLLM's --shutdown-timeout): the
# requests it has finish, and a prefill keeps the rooms it holds until their decodes take them.
FLEET_SHUTDOWN_S = 60
# The registry's lease: a server paused for a test (SIGSTOP) keeps its registration.
FLEET_LEASE_MS = 60_000


def fleet(vllm, kvferry_bin, logs: pathlib.Path) -> Pd:
    """Two prefill and two decode servers, every server of a role with one configuration
    (ports aside) and draining on SIGTERM (``FLEET_SHUTDOWN_S``), started (``wait_healthy``
    waits for them): the decodes' agents listen on
    base API ports of their own (``api_port``), and vLLM's development routes are on
    (``reset_prefix_cache``)."""
    python, env, model = vllm
    ports = [two_free_ports(), two_free_ports()]
    drain = ("--shutdown-timeout", str(FLEET_SHUTDOWN_S))
    pd = Pd((python, env | {"VLLM_SERVER_DEV_MODE": "1"}, model), kvferry_bin, logs, prefills=2, decodes=2,
            prefill_args=("--max-num-batched-tokens", str(FLEET_STEP_TOKENS), *drain), decode_args=drain,
            decode_agent=[dict(api_port=p) for p in ports], wait=False, lease_ttl_ms=FLEET_LEASE_MS,
            **FLEET_AGENT)
    for server, port in zip(pd.decodes, ports):
        server.api_port = port
    return pd


class FleetPrefill:
    """One more prefill server of the fleet at a time, of a TP and DP shape (``shape``); the
    previous one stops first."""

    def __init__(self, fleet: Pd) -> None:
        self.fleet = fleet
        self.server: Server | None = None
        self.ranks: tuple[int, int] | None = None

    def shape(self, tp: int = 1, dp: int = 1) -> Server:
        if self.ranks != (tp, dp):
            self.stop()
            self.server = self.fleet.join(self.fleet.start_prefill(0, tp=tp, dp=dp, log=f"prefill-tp{tp}-dp{dp}.log"))
            self.ranks = (tp, dp)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server, self.ranks = None, None


def reset_prefix_cache(server: Server) -> None:
    """Empties ``server``'s prefix cache (vLLM's development route; it refuses while requests
    run), so that every block of the next prompts moves."""
    deadline = time.monotonic() + 60
    while not post(server.url + "/reset_prefix_cache", {}).get("success"):
        assert time.monotonic() < deadline, f"{server.url}: the prefix cache was never reset"
        time.sleep(0.5)


def arm_corrupt_chunk(agent_api: str, nth: int = 1) -> dict:
    """Has a prefill agent started with ``fault_injection`` invert the bytes of the ``nth``
    chunk it sends from now (a test-only switch of its engine API)."""
    got = post(agent_api + "/v1/faults", {"corrupt_chunk": nth}, timeout=30)
    assert "corrupt_chunk" in got, got
    return got


def hold_chunks(agent_api: str, nth: int) -> dict:
    """Has a prefill agent started with ``fault_injection`` hold the ``nth`` chunk it sends from
    now and every later one before they go, until ``hold_chunks(api, 0)`` (a test-only switch
    of its engine API): rooms asked for meanwhile stay mid-transfer."""
    got = post(agent_api + "/v1/faults", {"hold_chunks": nth}, timeout=30)
    assert "hold_chunks" in got, got
    return got


def held_for(agent_api: str) -> set[str]:
    """The decode agents (instances) a prefill agent holds chunks for now (``hold_chunks``)."""
    got = post(agent_api + "/v1/faults", {}, timeout=30)
    return set(got["held_for"])


def instances_of(bootstrap: str, server: "Server") -> set[str]:
    """The kvferry agents (instances) of ``server``'s workers, as they registered."""
    with urllib.request.urlopen(bootstrap + "/v1/ranks", timeout=10) as r:
        ranks = json.loads(r.read())["ranks"]
    return {r["instance_id"] for r in ranks if r.get("server") == server.url}


def set_timeouts(agent_api: str, **ms: int) -> dict:
    """Sets timeouts of an agent started with ``fault_injection`` while it runs, by their flags'
    names (``room_ttl_ms=1000``; a test-only switch of its engine API); returns them as they
    were, to set back."""
    got = post(agent_api + "/v1/faults", {"timeouts": ms}, timeout=30)
    assert "timeouts_were" in got and all(got["timeouts"][k] == v for k, v in ms.items()), got
    return got["timeouts_were"]


def two_free_ports() -> int:
    """A port ``p`` with ``p + 1`` free too (a base API port of a TP2 server)."""
    for _ in range(100):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two free ports in a row")


def parallel_args(tp: int, dp: int = 1) -> tuple[str, ...]:
    """vLLM's flags for ``tp`` tensor-parallel and ``dp`` data-parallel ranks."""
    return (("--tensor-parallel-size", str(tp)) if tp > 1 else ()) + (
        ("--data-parallel-size", str(dp)) if dp > 1 else ())


def cores(core: int, tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a server of ``tp`` ranks: ``core`` for one, a core of
    its own per rank (``|`` separates ranks) for more, as many as the machine has."""
    return str(core) if tp == 1 else "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))


def log_name(role: str, i: int) -> str:
    """``prefill.log`` for the first server of a role, ``prefill-1.log`` for the next."""
    return f"{role}.log" if i == 0 else f"{role}-{i}.log"


class Proxy:
    """``kvferry proxy --port 0`` in front of prefill and decode servers, those listed and, with
    ``bootstrap``, those their agents register there; ready once its ``/health`` says a server
    of each role is usable."""

    def __init__(self, kvferry_bin, prefills: list[str], decodes: list[str], pairing: str,
                 logs: pathlib.Path, model: str, bootstrap: str | None = None,
                 short_below: int | None = 0) -> None:
        self.model = str(model)
        listed = [arg for flag, urls in (("--prefill", prefills), ("--decode", decodes)) if urls
                  for arg in (flag, ",".join(urls))]
        found = ["--bootstrap", bootstrap] if bootstrap else []
        # Tests disaggregate every prompt, short or not (None: the proxy's default).
        short = [] if short_below is None else ["--short-below-tokens", str(short_below)]
        self.proc = subprocess.Popen(
            [str(kvferry_bin), "proxy", *listed, *found,
             "--port", "0", "--pairing", pairing, *short, "--health-ms", "200",
             # A busy server that answers /health late is not what these tests are about: only a
             # refused connection (a dead server) routes around a server within their bounds.
             "--health-timeout-ms", "60000"],
            stdout=subprocess.PIPE, stderr=open(logs / f"proxy-{pairing}{'-found' if bootstrap else ''}.log", "ab"), text=True,
        )
        self.url = json.loads(self.proc.stdout.readline())["url"]
        self.wait_health(200)

    def wait_health(self, want: int, timeout: float = 120) -> float:
        """Seconds until the proxy's /health answers ``want``."""
        start = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            if status == want:
                return time.monotonic() - start
            assert time.monotonic() - start < timeout, f"proxy /health never answered {want}"
            time.sleep(0.05)

    def complete(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True, **extra}
        return post(self.url + "/v1/completions", body)

    def chat(self, messages: list[dict], max_tokens: int, **extra: Any) -> dict:
        return post(self.url + "/v1/chat/completions", chat_body(self.model, messages, max_tokens, **extra))

    def stream(self, prompt: list[int], max_tokens: int, **extra: Any) -> tuple[list[int], str | None]:
        """A streamed answer's token ids and where its KV came from (``sse``)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True, **extra}
        events, said = sse(self.url + "/v1/completions", body)
        assert not [e for e in events if "error" in e], events
        return [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])], said

    def stream_chat(self, messages: list[dict], max_tokens: int) -> tuple[str, str | None]:
        """A streamed chat answer's content, its deltas joined, and where its KV came from
        (``sse``)."""
        events, said = sse(self.url + "/v1/chat/completions", chat_body(self.model, messages, max_tokens))
        assert not [e for e in events if "error" in e], events
        return "".join(choice["delta"].get("content") or "" for e in events for choice in e["choices"]), said

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
