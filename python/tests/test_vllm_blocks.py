"""Prefill and decode servers of other block sizes: vLLM's CPU pages (``vllm-cpu-vec``, K
transposed inside each block) are re-blocked in the transfer (``vllm_cpu_vec_span``), never
refused, in both directions.

Four servers of the tiny Llama, all with the test-only probe connector (vllm_probe.py): a
prefill with blocks of 32 tokens and one with 64, a decode with 32 and one with 64 (vLLM's CPU
attention takes block sizes that are multiples of 32). Prompts of 1 to 1000 tokens go from the
32-token prefill to the 64-token decode in first-token pairing, and from the 64-token prefill
to the 32-token decode in concurrent pairing. Every generated token equals the reference's;
exactly the room's tokens land (bytes = tokens x 2048, not whole blocks of either size); and
every landed token's K and V, read in the decode's cache, equal the prefill's, read in its
own."""

from __future__ import annotations

import os

import pytest

from conftest import REPO
from vllm_servers import NEW_TOKENS, PROBE, SEEDS, Pd, Server, View, connector, make_prompts, metric

# The module's deployment (its fixture starts it): after the MLA one (conftest.ORDER).
pytestmark = pytest.mark.deployment("vllm_blocks")

# KV bytes of one token of the tiny Llama: 2 layers x K and V x 2 heads x 64 fp32 dims.
TOKEN_BYTES = 2 * 2 * 2 * 64 * 4
# (prefill block size, decode block size, pairing)
DIRECTIONS = [(32, 64, "first-token"), (64, 32, "concurrent")]


@pytest.fixture(scope="module")
def blocks(vllm, kvferry_bin, tmp_path_factory):
    python, env, model = vllm
    dumps = tmp_path_factory.mktemp("blocks-dumps")
    path = os.pathsep.join(filter(None, [str(REPO / "python" / "tests"), env.get("PYTHONPATH")]))
    env = env | {"PYTHONPATH": path, "KVFERRY_PROBE_DUMP": str(dumps)}
    logs = tmp_path_factory.mktemp("blocks-logs")
    pd = Pd((python, env, model), kvferry_bin, logs, prefill_args=("--block-size", "32"),
            decode_args=("--block-size", "64"), wait=False, connector_class=PROBE)
    try:
        prefill64 = pd.join(Server(python, env, model, 1, logs / "prefill-64.log", "--block-size", "64",
                                   "--kv-transfer-config", connector("kv_producer", pd.bootstrap, PROBE)))
        decode32 = pd.join(Server(python, env, model, 0, logs / "decode-32.log", "--block-size", "32",
                                  "--kv-transfer-config", connector("kv_consumer", pd.bootstrap, PROBE)))
        pd.wait_healthy()
        servers = {32: (pd.prefill, decode32), 64: (prefill64, pd.decode)}
        yield pd, servers, dumps
    finally:
        pd.stop()


@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: f"{d[0]}-to-{d[1]}")
def test_pages_of_other_block_sizes_are_re_blocked_token_for_token(blocks, reference, direction):
    pd, servers, dumps = blocks
    prefill_block, decode_block, pairing = direction
    prefill, decode = servers[prefill_block][0], servers[decode_block][1]
    view = View(pd, [prefill], [decode])
    try:
        proxy = view.proxy(pairing)
        prompts = make_prompts(SEEDS["concurrent" if pairing == "concurrent" else "sequential"])
        landed = metric(decode.agent_api(), "kvferry_kv_bytes_total")
        expected, rooms = 0, []
        for prompt in prompts:
            got = proxy.complete(prompt, NEW_TOKENS)
            assert got["choices"][0]["token_ids"] == reference[tuple(prompt)], f"{len(prompt)}-token prompt"
            params = got["kv_transfer_params"]
            if params["kvferry_kv"] == "cached":
                continue  # first-token pairing: whole blocks in the decode's prefix cache
            start = params["kvferry_start_token"]
            assert params["kvferry_tokens"] == len(prompt) and start % decode_block == 0, params
            expected += (len(prompt) - start) * TOKEN_BYTES
            rooms.append((int(params["kvferry_room"]), start))
        landed = metric(decode.agent_api(), "kvferry_kv_bytes_total") - landed
    finally:
        view.stop()
    assert landed == expected, (landed, expected)
    for room, start in rooms:
        held = (dumps / f"prefill-{room}.bin").read_bytes()
        got = (dumps / f"decode-{room}-tp0.bin").read_bytes()
        assert got == held[start * TOKEN_BYTES:], f"room {room}: the landed K and V differ from the prefill's"
    print(f"blocks of {prefill_block} to blocks of {decode_block} ({pairing}): {len(prompts)} prompts token-identical, "
          f"{landed:.0f} bytes landed (the rooms' tokens exactly), every landed token's K and V the prefill's")
