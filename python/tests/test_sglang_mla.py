"""kvferry moves an MLA model's latent KV (SGLang's ``MLATokenToKVPool``, format ``sglang-mla``)
between SGLang servers under sglang-router: greedy outputs equal the model's reference
implementation's (HF transformers', which a plain SGLang server gives too), and the bytes that
landed equal the prefill's.

The tiny MLA model comes from scripts/sglang/tiny_mla_model.py. SGLang 0.5.23's CPU engine
computes it right only with the test-only plugin sglang_stub/sglang_mla_path.py (its docstring
says why), which every SGLang server of the tests loads."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

import sglang_servers as S
from conftest import REPO
from vllm_servers import make_prompts

# The module's deployment (its test starts it): after the vLLM ones (conftest.ORDER).
pytestmark = pytest.mark.deployment("sglang_mla")

NEW_TOKENS = 8
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def model(sglang, tmp_path_factory) -> pathlib.Path:
    python, env = sglang
    out = tmp_path_factory.mktemp("mla-model") / "tiny-mla"
    script = REPO / "scripts" / "sglang" / "tiny_mla_model.py"
    subprocess.run([python, str(script), str(out), "--seed", "0"], env=env, check=True, capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def prompts():
    """8 prompts of 1 to 300 tokens."""
    return make_prompts(12)[:8]


def test_an_mla_models_outputs_through_sglang_router_equal_a_plain_sglang_and_every_landed_byte_the_prefills(
    sglang, model, prompts, tmp_path_factory
):
    python, env = sglang
    reference = S.reference_outputs(python, env, model, prompts, NEW_TOKENS)
    dumps = tmp_path_factory.mktemp("dumps")
    probe = {"KVFERRY_PROBE_DUMP": str(dumps)}
    pd = S.Pd(python, env, model, tmp_path_factory.mktemp("pd"), ("--page-size", str(PAGE_SIZE)),
              prefill_env=probe, decode_env=probe)
    try:
        pd.start_router()
        S.check_outputs(pd, prompts, reference, NEW_TOKENS)
    finally:
        pd.stop()
    assert "sglang-mla" in (pd.logs / "prefill.log").read_text(), "the prefill's agent did not take the sglang-mla format"
    landed = sorted(dumps.glob("decode-*-tp0.bin"))
    assert len(landed) >= len(prompts), f"{len(landed)} rooms landed for {len(prompts)} prompts"
    total = 0
    for d in landed:
        sent = dumps / d.name.replace("decode-", "prefill-")
        assert sent.exists(), f"{d.name} landed but its prefill announced no such room"
        assert d.read_bytes() == sent.read_bytes(), f"{d.name}: the landed bytes differ from the prefill's"
        total += d.stat().st_size
    print(f"{len(landed)} rooms, {total} bytes of latent KV: equal to the prefill's, byte for byte")
