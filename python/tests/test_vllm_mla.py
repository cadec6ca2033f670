"""kvferry moves an MLA model's latent KV between real vLLM servers (vLLM's CPU MLA backend,
``CPU_MLA``; format ``vllm-mla``): greedy outputs equal the model's reference (HF transformers',
which a plain vLLM server gives too), every landed byte equals the prefill's, and a room
carries one latent per token and layer.

The model is scripts/sglang/tiny_mla_model.py's with ``--latent 512,64``: vLLM's CPU MLA
decode kernel serves only a 576-element latent (kv_lora_rank 512 + RoPE 64), and its CPU
platform forces blocks of 16 tokens, no prefix caching and no chunked prefill for MLA. One
prefill server of TP 2 and two decode servers, of TP 1 and TP 2, behind a proxy each, in every
pairing. The latent is the same on every TP rank: a TP2 prefill's ranks send a room's layers
in halves (the agents' pairing spreads the readers over the holders), and every rank of a TP2
decode receives the whole latent. The bytes are read in vLLM's own cache by the test-only
connector vllm_probe.py."""

from __future__ import annotations

import os
import subprocess

import pytest

import hf_reference
from conftest import REPO
from vllm_servers import PROBE, Pd, View, make_prompts, metric

# The module's deployment (its fixture starts it): after the fleet's (conftest.ORDER).
pytestmark = pytest.mark.deployment("vllm_mla")

NEW_TOKENS = 8
LAYERS = 2
# Bytes of one token's latent in one layer: (512 + 64) fp32 elements.
LATENT_BYTES = 576 * 4
PAIRINGS = ("first-token", "sequential", "concurrent")


@pytest.fixture(scope="module")
def mla(torch_python, kvferry_bin, tmp_path_factory):
    """The tiny MLA model, its reference outputs, and the servers: prefill TP2, decodes TP1 and
    TP2, each decode behind a proxy per pairing."""
    python, env = torch_python
    model = tmp_path_factory.mktemp("mla-model") / "tiny-mla"
    subprocess.run([python, str(REPO / "scripts" / "sglang" / "tiny_mla_model.py"), str(model), "--seed", "0",
                    "--latent", "512,64", "--layers", str(LAYERS)], env=env, check=True, capture_output=True,
                   timeout=600)
    dumps = tmp_path_factory.mktemp("mla-dumps")
    path = os.pathsep.join(filter(None, [str(REPO / "python" / "tests"), env.get("PYTHONPATH")]))
    env = env | {"PYTHONPATH": path, "KVFERRY_PROBE_DUMP": str(dumps)}
    args = ("--block-size", "16")
    pd = Pd((python, env, model), kvferry_bin, tmp_path_factory.mktemp("mla-logs"), prefill_args=args,
            decode_args=args, prefill_tp=2, wait=False, connector_class=PROBE)
    try:
        pd.join(pd.start_decode(1, tp=2, log="decode-tp2.log"))
        prompts = make_prompts(12)[:8]
        reference = hf_reference.outputs(python, env, model, NEW_TOKENS, prompts)
        pd.wait_healthy()
        views = {}
        for decode in pd.decodes + pd.members:
            view = View(pd, pd.prefills, [decode])
            view.via = {pairing: view.proxy(pairing) for pairing in PAIRINGS}
            views[len(decode.agent_apis())] = view
        yield pd, views, prompts, reference, dumps
        for view in views.values():
            view.stop()
    finally:
        pd.stop()


@pytest.mark.parametrize("decode_tp", [1, 2])
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_an_mla_models_latent_moves_once_per_token_and_layer_and_lands_as_the_prefill_held_it(mla, pairing, decode_tp):
    pd, views, prompts, reference, dumps = mla
    view = views[decode_tp]
    decode_apis = view.decode.agent_apis()
    prefill_apis = pd.prefill.agent_apis()
    landed = sum(metric(a, "kvferry_kv_bytes_total") for a in decode_apis)
    sent = [metric(a, "kvferry_kv_bytes_total") for a in prefill_apis]
    rooms = []
    for prompt in prompts:
        got = view.via[pairing].complete(prompt, NEW_TOKENS)
        assert got["choices"][0]["token_ids"] == reference[tuple(prompt)], f"{len(prompt)}-token prompt"
        params = got["kv_transfer_params"]
        assert params["kvferry_tokens"] == len(prompt) and params["kvferry_start_token"] == 0, params
        rooms.append(int(params["kvferry_room"]))
    landed = sum(metric(a, "kvferry_kv_bytes_total") for a in decode_apis) - landed
    sent = [metric(a, "kvferry_kv_bytes_total") - s for a, s in zip(prefill_apis, sent)]
    tokens = sum(len(p) for p in prompts)
    # One latent per token and layer for each decode rank (each holds the whole latent),
    # never one per attention head.
    assert landed == tokens * LAYERS * LATENT_BYTES * decode_tp, (landed, tokens)
    # Both prefill ranks hold the latent and each sends a part of every room.
    assert sum(sent) == landed and all(s > 0 for s in sent), sent
    for room in rooms:
        held = (dumps / f"prefill-{room}.bin").read_bytes()
        for rank in range(decode_tp):
            got = dumps / f"decode-{room}-tp{rank}.bin"
            assert got.exists(), f"room {room}: decode rank {rank} dumped nothing"
            assert got.read_bytes() == held, f"room {room}: the bytes decode rank {rank} landed differ from the prefill's"
    print(f"{pairing}, TP2 prefill to TP{decode_tp} decode: {len(prompts)} prompts token-identical, {landed:.0f} "
          f"bytes landed ({tokens} tokens x {LAYERS} layers x {LATENT_BYTES} bytes x {decode_tp} ranks), sent by "
          f"the prefill's ranks {[int(s) for s in sent]}, every landed byte the prefill's")
    assert "vllm-mla" in (pd.logs / "prefill.log").read_text()
