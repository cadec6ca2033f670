"""Disaggregated generation with real vLLM servers and ``KvferryConnector``, token-identical to a
single engine.

A plain vLLM server answers every prompt first (the reference) and stops: two cores hold two
engines, not three. Then a kvferry registry, a prefill server (``kv_producer``) and a decode
server (``kv_consumer``), each pinned to its own core, with prefix caching on: 14 prompts of 1
to 1000 tokens (most not multiples of the 128-token block; four are prefixes of one another),
4 in flight, greedy, 16 new tokens each. The test routes requests itself, in both pairings:
sequential (the prefill's response carries ``kv_transfer_params``, copied into the decode
request) and concurrent (the router names the room and the prefill's group in both requests
up front). Every generated token id equals the reference's, and the decode agent landed exactly
the prompt blocks each response says it loaded: a silent local recompute cannot pass.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess

import numpy as np
import pytest

from vllm_servers import BLOCK_BYTES, BLOCK_SIZE, Server, connector, free_port, make_model, metric

NEW_TOKENS = 16
LENGTHS = [1, 2, 37, 127, 129, 200, 255, 300, 383, 500, 640, 777, 900, 1000]
# Prompts that are prefixes of the longest one (prefix-cache hits on both servers).
SHARED = {129, 383, 640, 1000}


def make_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 2048, max(LENGTHS)).tolist()
    return [base[:n] if n in SHARED else rng.integers(3, 2048, n).tolist() for n in LENGTHS]


# A prompt set per pairing, so that each starts with the decode's prefix cache cold for it.
SEEDS = {"sequential": 7, "concurrent": 8}


@pytest.fixture(scope="module")
def vllm(torch_python, tmp_path_factory):
    python, env = torch_python
    return python, env, make_model(python, env, tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def reference(vllm, tmp_path_factory):
    """Token ids of one plain server for every prompt; the smallest top-1/top-2 logprob margin
    among them must be far above float32 noise, or equal outputs would prove little."""
    python, env, model = vllm
    server = Server(python, env, model, 0, tmp_path_factory.mktemp("reference") / "vllm.log")
    try:
        server.wait_healthy()
        out, margin = {}, float("inf")
        for seed in SEEDS.values():
            for prompt in make_prompts(seed):
                got = server.complete(prompt, NEW_TOKENS, logprobs=2)
                choice = got["choices"][0]
                out[tuple(prompt)] = choice["token_ids"]
                for top in choice["logprobs"]["top_logprobs"]:
                    best = sorted(top.values(), reverse=True)
                    if len(best) == 2:
                        margin = min(margin, best[0] - best[1])
    finally:
        server.stop()
    print(f"reference: smallest top-1/top-2 logprob margin {margin:.4g}")
    assert margin > 1e-3, f"the model's margin {margin} is within float32 noise: choose another seed"
    return out


@pytest.fixture(scope="module")
def pd(vllm, kvferry_bin, tmp_path_factory):
    """A registry, a prefill and a decode server with the connector."""
    python, env, model = vllm
    logs = tmp_path_factory.mktemp("pd")
    registry_port = free_port()
    registry = subprocess.Popen(
        [str(kvferry_bin), "bootstrap", "--port", str(registry_port)],
        stdout=subprocess.DEVNULL, stderr=open(logs / "registry.log", "wb"),
    )
    bootstrap = f"http://127.0.0.1:{registry_port}"
    p_api, d_api = free_port(), free_port()
    prefill = Server(python, env, model, 0, logs / "prefill.log",
                     "--kv-transfer-config", connector("kv_producer", bootstrap, p_api))
    decode = Server(python, env, model, 1, logs / "decode.log",
                    "--kv-transfer-config", connector("kv_consumer", bootstrap, d_api))
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        yield prefill, decode, f"http://127.0.0.1:{d_api}", bootstrap
    finally:
        for s in (prefill, decode):
            s.stop()
        registry.terminate()
        registry.wait()


def sequential(prefill: Server, decode: Server, prompt: list[int]) -> dict:
    first = prefill.complete(prompt, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["kvferry_tokens"] == len(prompt), params
    return decode.complete(prompt, NEW_TOKENS, params)


def concurrently(prefill: Server, decode: Server, prompt: list[int], room: int) -> dict:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d = pool.submit(decode.complete, prompt, NEW_TOKENS,
                        {"do_remote_prefill": True, "kvferry_room": str(room), "kvferry_dp_rank": 0})
        p = pool.submit(prefill.complete, prompt, 1, {"do_remote_decode": True, "kvferry_room": str(room)})
        assert p.result()["kv_transfer_params"]["kvferry_room"] == str(room)
        return d.result()


def run_prompts(pd, pairing: str, prompts: list[list[int]], reference: dict) -> list[int]:
    """Routes every prompt, 4 in flight; checks each output against the reference and the
    bytes the decode agent landed against what the responses say was loaded. Returns the
    responses' start tokens."""
    prefill, decode, decode_agent, _ = pd
    landed_before = metric(decode_agent, "kvferry_kv_bytes_total")

    def one(prompt: list[int]) -> dict:
        if pairing == "sequential":
            return sequential(prefill, decode, prompt)
        return concurrently(prefill, decode, prompt, int.from_bytes(os.urandom(8), "little"))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, prompts))
    expected_bytes, starts = 0, []
    for prompt, got in zip(prompts, results):
        assert "choices" in got, got
        assert got["choices"][0]["token_ids"] == reference[tuple(prompt)], f"{len(prompt)}-token prompt"
        params = got["kv_transfer_params"]
        assert params["kvferry_tokens"] == len(prompt)
        start = params["kvferry_start_token"]
        assert start % BLOCK_SIZE == 0 and start < len(prompt)
        starts.append(start)
        expected_bytes += (-(-len(prompt) // BLOCK_SIZE) - start // BLOCK_SIZE) * BLOCK_BYTES
    landed = metric(decode_agent, "kvferry_kv_bytes_total") - landed_before
    print(f"{pairing}: {len(prompts)} prompts token-identical, {landed:.0f} bytes landed, start tokens {starts}")
    assert landed == expected_bytes
    return starts


@pytest.mark.parametrize("pairing", list(SEEDS))
def test_disaggregated_generation_equals_a_single_engine(reference, pd, pairing):
    run_prompts(pd, pairing, make_prompts(SEEDS[pairing]), reference)


def test_blocks_in_the_decode_prefix_cache_are_not_transferred(reference, pd):
    # The same prompts again: the decode holds their full blocks in its prefix cache now, so
    # only the blocks after them move (and a prompt of whole blocks still moves its last one:
    # vLLM recomputes the last prompt token, so its block is never a local hit).
    starts = run_prompts(pd, "sequential", make_prompts(SEEDS["sequential"]), reference)
    assert sum(s > 0 for s in starts) >= len(starts) // 2, starts
