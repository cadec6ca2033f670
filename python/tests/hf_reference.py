"""Greedy outputs of HF transformers' implementation of a model directory (the tiny Llama of
scripts/vllm/tiny_model.py, the tiny MLA model of scripts/sglang/tiny_mla_model.py): the
reference the engine tests compare with, computed without starting an engine. A plain engine
server gives the same outputs: vLLM's CPU build for the tiny Llama (every prompt and chat of
vllm_servers, token for token and text for text), SGLang's CPU engine for both models (the MLA
model with the test-only plugin sglang_stub/sglang_mla_path.py).

``outputs`` runs this file in an engine venv (which has torch and transformers):
    hf_reference.py MODELDIR NEW_TOKENS < request.json > outputs.json

The request is ``{"prompts": [[token ids]...], "chats": [[messages]...]}``; the answer each
prompt's NEW_TOKENS greedy tokens (never stopped by an end of sequence token), each chat's
answer as text (the model's chat template with the assistant's turn opened, NEW_TOKENS greedy
tokens decoded without special tokens, as an OpenAI server answers), and the smallest margin
between the best and the second best logit seen, which must be far above float32 noise for
equal tokens to mean anything.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys


def outputs(python: str, env: dict, model: pathlib.Path, new_tokens: int, prompts: list[list[int]],
            chats: list[list[dict]] = (), margin: float = 1e-2) -> dict:
    """The reference for ``prompts`` (by their tuple) and ``chats`` (by ``("chat", i)``), run in
    the venv of ``python``; the smallest logit margin must exceed ``margin``."""
    run = subprocess.run([python, __file__, str(model), str(new_tokens)],
                         input=json.dumps({"prompts": prompts, "chats": list(chats)}), env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    print(f"reference: smallest top-1/top-2 logit margin {got['margin']:.4g}")
    assert got["margin"] > margin, f"the model's margin {got['margin']} is within float32 noise: choose another seed"
    out: dict = {tuple(p): tokens for p, tokens in zip(prompts, got["outputs"])}
    out.update({("chat", i): text for i, text in enumerate(got["chats"])})
    return out


def greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """``new_tokens`` greedy tokens after ``prompt``, and the smallest top-1/top-2 logit margin."""
    import torch

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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, new_tokens = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    request = json.load(sys.stdin)
    answer: dict = {"outputs": [], "chats": [], "margin": float("inf")}
    for prompt in request["prompts"]:
        tokens, m = greedy(model, prompt, new_tokens)
        answer["outputs"].append(tokens)
        answer["margin"] = min(answer["margin"], m)
    if request["chats"]:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for messages in request["chats"]:
            # The template renders the text (its own special tokens included), as a server does.
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            tokens, m = greedy(model, tokenizer(text, add_special_tokens=False)["input_ids"], new_tokens)
            answer["chats"].append(tokenizer.decode(tokens, skip_special_tokens=True))
            answer["margin"] = min(answer["margin"], m)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
