"""A model of sliding-window and full-attention layers (Gemma 2's shape) between real vLLM
servers: vLLM's hybrid allocator keeps two KV cache groups with kvferry as the connector, each
group's blocks move as a room of their own, and a sliding window's room carries only the
blocks the decode attends to.

The model is scripts/vllm/tiny_gemma2_model.py's, 4 layers (sliding, full, sliding, full;
window 64), blocks of 32 tokens. One prefill and one decode server, each of TP 1, with the
test-only probe connector (vllm_probe.py), behind a proxy per pairing. The reference is the
prefill server answering the same prompts alone (one engine). Every generated token equals the
reference's; every landed token's K and V, read in the decode's cache, equal the prefill's,
read in its own, in both groups' rooms; the bytes landed are the rooms' blocks exactly; and a
sliding window's room holds fewer than window + block tokens, whatever the prompt."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import REPO
from vllm_servers import PROBE, Pd, View, make_prompts, metric

# The module's deployment (its fixture starts it): after the blocks one (conftest.ORDER).
pytestmark = pytest.mark.deployment("vllm_hybrid")

NEW_TOKENS = 8
BLOCK = 32
WINDOW = 64
# KV bytes of one token in one group's room: 2 layers x K and V x 2 heads x 64 fp32 dims.
TOKEN_BYTES = 2 * 2 * 2 * 64 * 4
# Each pairing's prompts (make_prompts' seed): others than the other pairing's, so that none is
# in the decode's prefix cache already.
PAIRINGS = {"first-token": 21, "concurrent": 22}


@pytest.fixture(scope="module")
def hybrid(torch_python, kvferry_bin, tmp_path_factory):
    """The tiny Gemma 2, a prefill and a decode server, and each prompt's answer from the
    prefill server alone."""
    python, env = torch_python
    model = tmp_path_factory.mktemp("gemma2-model") / "tiny-gemma2"
    subprocess.run([python, str(REPO / "scripts" / "vllm" / "tiny_gemma2_model.py"), str(model), "--seed", "0",
                    "--layers", "4"], env=env, check=True, capture_output=True, timeout=600)
    dumps = tmp_path_factory.mktemp("hybrid-dumps")
    path = os.pathsep.join(filter(None, [str(REPO / "python" / "tests"), env.get("PYTHONPATH")]))
    env = env | {"PYTHONPATH": path, "KVFERRY_PROBE_DUMP": str(dumps)}
    args = ("--block-size", str(BLOCK))
    pd = Pd((python, env, model), kvferry_bin, tmp_path_factory.mktemp("hybrid-logs"), prefill_args=args,
            decode_args=args, connector_class=PROBE)
    try:
        prompts = {pairing: make_prompts(seed) for pairing, seed in PAIRINGS.items()}
        reference = {tuple(p): pd.prefill.complete(p, NEW_TOKENS)["choices"][0]["token_ids"]
                     for each in prompts.values() for p in each}
        yield pd, prompts, reference, dumps
    finally:
        pd.stop()


def test_vllm_keeps_two_kv_cache_groups_with_kvferry_as_its_connector(hybrid):
    pd, *_ = hybrid
    for log in ("prefill.log", "decode.log"):
        text = (pd.logs / log).read_text()
        assert "2 KV cache group(s)" in text, f"{log}: kvferry's agent did not see vLLM's two groups"
        assert "Turning off hybrid kv cache manager" not in text, log


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_each_groups_blocks_move_and_a_sliding_windows_room_holds_only_the_window(hybrid, pairing):
    pd, prompts, reference, dumps = hybrid
    prompts = prompts[pairing]
    view = View(pd, pd.prefills, pd.decodes)
    before = set(os.listdir(dumps))
    landed = metric(pd.decode.agent_api(), "kvferry_kv_bytes_total")
    try:
        proxy = view.proxy(pairing)
        rooms, lengths = set(), {}
        for prompt in prompts:
            got = proxy.complete(prompt, NEW_TOKENS)
            assert got["choices"][0]["token_ids"] == reference[tuple(prompt)], f"{len(prompt)}-token prompt"
            params = got["kv_transfer_params"]
            if params["kvferry_kv"] == "cached":
                continue  # first-token pairing: the prompt is whole blocks in the decode's prefix cache
            room = int(params["kvferry_room"])
            assert params["kvferry_tokens"] == len(prompt) - 1, params
            rooms.add(room)
            lengths[room] = params["kvferry_tokens"]
        landed = metric(pd.decode.agent_api(), "kvferry_kv_bytes_total") - landed
    finally:
        view.stop()
    new = {int(name.split("-")[1]) for name in set(os.listdir(dumps)) - before if name.startswith("decode-")}
    assert rooms <= new and len(new) == 2 * len(rooms), f"{len(rooms)} requests, {len(new)} rooms landed"
    expected = whole = 0
    tokens = {"full": [], "window": []}
    for room in new:
        held = (dumps / f"prefill-{room}.bin").read_bytes()
        got = (dumps / f"decode-{room}-tp0.bin").read_bytes()
        start = int((dumps / f"decode-{room}-tp0.start").read_text())
        window = int((dumps / f"decode-{room}-tp0.window").read_text())
        assert got == held[start * TOKEN_BYTES:], f"room {room}: the landed K and V differ from the prefill's"
        held_tokens = len(held) // TOKEN_BYTES
        moved = (-(-held_tokens // BLOCK) - start // BLOCK) * BLOCK * TOKEN_BYTES
        expected += moved
        tokens["window" if window else "full"].append(held_tokens)
        if not window:
            whole += 2 * moved
        else:
            assert window == WINDOW and held_tokens < WINDOW + BLOCK, (room, window, held_tokens)
    # One room of each group per request: the full group's holds the prompt but its last token
    # (the decode computes it), the sliding window's the same from the block holding the first
    # token that last one attends to.
    lengths = sorted(lengths.values())
    assert sorted(tokens["full"]) == lengths, tokens
    assert sorted(tokens["window"]) == sorted(n - max(0, n + 1 - WINDOW) // BLOCK * BLOCK for n in lengths), tokens
    # The decode's cache takes whole blocks (K lies transposed in each).
    assert landed == expected, (landed, expected)
    print(f"{pairing}: {len(prompts)} prompts token-identical, {len(rooms)} requests of 2 rooms each, "
          f"{landed:.0f} bytes landed, every landed token's K and V the prefill's; both groups whole would be "
          f"{whole} bytes: the window saved {1 - landed / whole:.0%}")
