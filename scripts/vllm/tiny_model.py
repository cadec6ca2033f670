#!/usr/bin/env python3
"""Make a tiny Llama model directory that vLLM and HF transformers both load, without any hub.

Usage: tiny_model.py OUTDIR [--seed N] [--layers N]

The weights are random (seeded), the tokenizer a byte-level BPE trained here on a few
sentences and padded with added tokens up to the vocabulary size. The same seed gives the same
files, byte for byte (config, weights, tokenizer).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the KV cache of a prompt; decode extends it one token at a time.",
    "A page of KV cache holds the keys and values of a fixed number of tokens.",
    "Rotary embeddings turn each key by an angle that grows with its position.",
    "Sphinx of black quartz, judge my vow. Pack my box with five dozen liquor jugs.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @ ^ _ ` | ~",
]


NUM_LAYERS = 2

# The tiny models' common shape (tiny_gemma2_model.py takes it too): GQA with 4 query and 2 KV
# heads of 64 dims, fp32.
SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def model_config(layers: int = NUM_LAYERS) -> LlamaConfig:
    """The tiny Llama's shape: SHAPE, 2 layers (or ``layers``)."""
    return LlamaConfig(
        **SHAPE,
        num_hidden_layers=layers,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


# transformers' init (std 0.02) gives nearly flat logits: the best two tokens of a step are
# often within 1e-5 of each other, where float32 rounding alone may swap them. The output
# projection is scaled so that greedy choices are clear (tests compare token ids exactly).
LOGIT_SCALE = 200.0


def make_model(seed: int, cls=LlamaForCausalLM, config=None):
    """A model of class `cls` (this tiny Llama by default) and `config` with weights drawn from
    `seed` (transformers' own init scheme), its output projection scaled by LOGIT_SCALE."""
    torch.manual_seed(seed)
    model = cls(config or model_config()).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.eval()
    return model


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on CORPUS, padded with added tokens to exactly VOCAB_SIZE ids."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    missing = VOCAB_SIZE - tok.get_vocab_size(with_added_tokens=True)
    if missing < 0:
        raise SystemExit(f"tiny_model: the trained vocabulary exceeds {VOCAB_SIZE} ids")
    tok.add_tokens([f"<pad_{i}>" for i in range(missing)])
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise SystemExit("tiny_model: could not pad the vocabulary to its size")
    return tok


# A plain chat template, so that /v1/chat/completions works (one line per message).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tokenizer(tok: Tokenizer, outdir: Path) -> None:
    """Save as PreTrainedTokenizerFast (tokenizer.json + tokenizer_config.json, with the chat
    template)."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(outdir)


def parse_args(argv: list[str], doc: str) -> argparse.Namespace:
    """OUTDIR, --seed and --layers."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("outdir", type=Path, help="directory to write the model into (created)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--layers", type=int, default=NUM_LAYERS, help=f"decoder layers (default {NUM_LAYERS})")
    return p.parse_args(argv)


def make_llama(seed: int, layers: int = NUM_LAYERS) -> LlamaForCausalLM:
    """This tiny Llama with ``layers`` layers, its weights drawn from ``seed``."""
    return make_model(seed, config=model_config(layers))


def main(argv: list[str], make=make_llama, doc: str = __doc__) -> int:
    """Write the model (``make(seed, layers)``, by default this tiny Llama) and the tokenizer;
    print the directory."""
    args = parse_args(argv, doc)
    args.outdir.mkdir(parents=True, exist_ok=True)
    make(args.seed, args.layers).save_pretrained(args.outdir, safe_serialization=True)
    save_tokenizer(train_tokenizer(), args.outdir)
    print(args.outdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
