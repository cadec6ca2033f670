#!/usr/bin/env python3
"""Make a tiny Gemma 2 model directory (sliding-window layers between full-attention ones) that
vLLM loads, without any hub.

Usage: tiny_gemma2_model.py OUTDIR [--seed N] [--layers N]

``--layers`` layers (2 by default; the tests take 4), alternating as Gemma 2's do: even layers
attend over a sliding window of 64 tokens, odd ones over the whole sequence, so vLLM's hybrid
allocator keeps them in two KV cache groups. 4 query and 2 KV heads of 64 dims, attention
logits soft-capped at 50 as Gemma 2's, fp32. Gemma ties its output projection to the
embeddings, so the final norm's scale is raised instead of the output projection's
(tiny_model.py's LOGIT_SCALE) and the final logits are not soft-capped: greedy choices stay
clear. The weights are random (seeded), the tokenizer is tiny_model.py's. The same seed gives
the same files, byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import LOGIT_SCALE, SHAPE  # noqa: E402
from tiny_model import main as write_model  # noqa: E402
from tiny_model import make_model as make_seeded  # noqa: E402

SLIDING_WINDOW = 64


def model_config(layers: int) -> Gemma2Config:
    """The tiny Gemma 2's shape: tiny_model's SHAPE, ``layers`` layers, sliding (even) and full
    (odd) in turn."""
    return Gemma2Config(
        **SHAPE,
        num_hidden_layers=layers,
        query_pre_attn_scalar=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        attn_logit_softcapping=50.0,
        final_logit_softcapping=None,
        rms_norm_eps=1e-6,
        pad_token_id=0,
    )


def make_model(seed: int, layers: int) -> Gemma2ForCausalLM:
    """The tiny Gemma 2 with weights drawn from ``seed``; its final norm scales by LOGIT_SCALE
    (Gemma's RMSNorm multiplies by 1 + weight)."""
    model = make_seeded(seed, Gemma2ForCausalLM, model_config(layers))
    with torch.no_grad():
        model.lm_head.weight.div_(LOGIT_SCALE)  # tied: undo make_seeded's scaling of the embeddings
        model.model.norm.weight.fill_(LOGIT_SCALE - 1)
    return model


if __name__ == "__main__":
    sys.exit(write_model(sys.argv[1:], make_model, __doc__))
