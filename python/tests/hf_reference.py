"""Greedy outputs of HF transformers' implementation of a model directory (the tiny Llama of
scripts/vllm/tiny_model.py, the tiny MLA model of scripts/sglang/tiny_mla_model.py): the
reference the SGLang tests compare with, computed without starting an engine (a plain SGLang
server gives the same tokens: SGLang's CPU engine for both models, the MLA model with the
test-only plugin sglang_stub/sglang_mla_path.py).

Usage (in an engine venv, which has torch and transformers):
    hf_reference.py MODELDIR NEW_TOKENS < prompts.json > outputs.json

Reads a JSON list of prompts (token ids); writes a JSON list of each prompt's NEW_TOKENS
greedy tokens (never stopped by an end of sequence token), and the smallest margin between the
best and the second best logit seen, which must be far above float32 noise for equal tokens to
mean anything.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """``new_tokens`` greedy tokens after ``prompt``, and the smallest top-1/top-2 logit margin."""
    ids = torch.tensor([prompt])
    out, margin, past = [], float("inf"), None
    with torch.no_grad():
        for _ in range(new_tokens):
            step = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            top = torch.topk(step.logits[0, -1], 2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            token = int(top.indices[0])
            out.append(token)
            ids = torch.tensor([[token]])
    return out, margin


def main() -> None:
    model_dir, new_tokens = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    outputs, margin = [], float("inf")
    for prompt in json.load(sys.stdin):
        tokens, m = greedy(model, prompt, new_tokens)
        outputs.append(tokens)
        margin = min(margin, m)
    json.dump({"outputs": outputs, "margin": margin}, sys.stdout)


if __name__ == "__main__":
    main()
