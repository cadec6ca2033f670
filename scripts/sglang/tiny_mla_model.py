#!/usr/bin/env python3
"""Make a tiny DeepSeek-V2-style MLA model directory that SGLang and HF transformers both load,
without any hub.

Usage: tiny_mla_model.py OUTDIR [--seed N] [--layers N] [--latent 512,64]

2 layers, both dense (first_k_dense_replace = num_hidden_layers: no MoE layer), multi-head
latent attention with kv_lora_rank 64 and qk_rope_head_dim 32 (SGLang's MLATokenToKVPool then
holds one [slots, 1, 96] buffer per layer), no q LoRA, fp32. ``--latent 512,64`` gives
kv_lora_rank 512 and qk_rope_head_dim 64 instead: vLLM's CPU MLA backend serves only that
shape (a 576-element latent per token and layer). RoPE is YaRN with factor 1.0,
which is plain interleaved RoPE: SGLang's CPU engine builds MLA RoPE only as deepseek_yarn. The
weights are random (seeded, transformers' init, output projection scaled as in tiny_model.py),
the tokenizer is tiny_model.py's (scripts/vllm). The same seed gives the same files, byte for
byte, in either venv.

Serve it with `--dtype float32` (SGLang's default "auto" downcasts an fp32 checkpoint to fp16).
SGLang 0.5.23's torch_native backend gives wrong tokens for a prompt with no cached prefix:
DeepSeek's MLA model takes its MHA path there (attention over the new tokens' k and v), and
torch_native's forward_extend ignores the k and v it is given and attends over the KV pool
(the latent cache) instead. With every batch routed to the absorbed MLA path (a test-side
override of that dispatch), SGLang's greedy tokens equal HF's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vllm"))
from tiny_model import VOCAB_SIZE  # noqa: E402
from tiny_model import make_model as make_seeded  # noqa: E402
from tiny_model import main as write_model  # noqa: E402

NUM_LAYERS = 2
KV_LORA_RANK = 64
QK_ROPE_HEAD_DIM = 32


def model_config(layers: int = NUM_LAYERS, latent: tuple[int, int] = (KV_LORA_RANK, QK_ROPE_HEAD_DIM)) -> DeepseekV2Config:
    """The tiny MLA model's shape: 2 dense layers (or ``layers``), 4 heads, a latent KV of
    ``latent`` (kv_lora_rank, RoPE dims): 64 + 32 by default."""
    return DeepseekV2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=latent[0],
        qk_nope_head_dim=64,
        qk_rope_head_dim=latent[1],
        v_head_dim=64,
        first_k_dense_replace=layers,  # every layer dense: no MoE
        n_routed_experts=4,  # unused (no MoE layer); small in case a loader sizes anything by it
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        moe_layer_freq=1,
        max_position_embeddings=4096,
        # SGLang's CPU engine builds MLA RoPE only as deepseek_yarn (get_rope_cpu asserts it);
        # YaRN with factor 1.0 and mscale 1 is plain RoPE (no interpolation, no rescaling).
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )


def make_model(seed: int, layers: int = NUM_LAYERS, latent: tuple[int, int] = (KV_LORA_RANK, QK_ROPE_HEAD_DIM)):
    """The tiny MLA model with weights drawn from `seed`, as tiny_model.py draws its Llama's."""
    return make_seeded(seed, DeepseekV2ForCausalLM, model_config(layers, latent))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--latent", default=f"{KV_LORA_RANK},{QK_ROPE_HEAD_DIM}")
    known, rest = ap.parse_known_args(argv)
    rank, rope = (int(x) for x in known.latent.split(","))
    return write_model(rest, lambda seed, layers: make_model(seed, layers, (rank, rope)), __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
