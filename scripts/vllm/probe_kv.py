#!/usr/bin/env python3
"""Ground truth for vLLM's CPU KV cache: the bytes vLLM wrote, and K/V computed by HF.

Usage: probe_kv.py MODELDIR OUTDIR [--block-size 32] [--full-blocks 5] [--tail 7]

1. In a child process (its own session, killed as a group when this script exits, even on
   error), runs vLLM offline on MODELDIR once: CPU, float32 (or --dtype bfloat16), eager, no
   prefix caching, one
   prompt of full_blocks * block_size + tail tokens, max_tokens=1. The observe-only connector
   in kv_probe_connector.py dumps the raw bytes of every (layer, block) of that request's
   blocks once its prefill forward pass is done.
2. Here, computes the same prompt's K (after the rotary embedding, as attention caches it) and
   V with HF transformers' LlamaForCausalLM (float32, use_cache=True).

Writes to OUTDIR: manifest.json (layout facts, block ids, extents), kv.bin (the extents'
bytes, concatenated), reference.f32 (little-endian f32 [layers][2][kv_heads][tokens][head_dim],
plane 0 = K, 1 = V). Progress and vLLM's logs go to stderr; stdout gets OUTDIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONNECTOR_MODULE = "kv_probe_connector"
CONNECTOR_CLASS = "KvProbeConnector"
DUMP_FLAG = "kvferry_probe_dump"  # kv_probe_connector.DUMP_FLAG (not imported: it imports vllm)
STAGE_DIR = ".probe-stage"
VLLM_TIMEOUT_S = 900.0
KV_CACHE_MEMORY_BYTES = 64 << 20
MANIFEST_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
PROMPT_TEXT = (
    "Prefill computes the KV cache of a prompt; decode extends it one token at a time. "
    "A page of KV cache holds the keys and values of a fixed number of tokens. "
    "Rotary embeddings turn each key by an angle that grows with its position. "
    "The quick brown fox jumps over the lazy dog. "
    "Sphinx of black quartz, judge my vow. Pack my box with five dozen liquor jugs. "
)
QUIET_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(f"probe_kv: {msg}", file=sys.stderr, flush=True)


# ---- the prompt --------------------------------------------------------------------------------


def prompt_token_ids(model_dir: Path, count: int) -> list[int]:
    """The first `count` token ids of PROMPT_TEXT repeated, tokenized by the model's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids: list[int] = []
    while len(ids) < count:
        ids.extend(tok(PROMPT_TEXT, add_special_tokens=not ids)["input_ids"])
    return ids[:count]


# ---- stage 1: vLLM, in a child process group ---------------------------------------------------


def vllm_stage(model_dir: Path, stage: Path, spec: dict[str, Any]) -> None:
    """Run vLLM once on spec['token_ids'] with the probe connector; write stage/vllm.json."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    token_ids: list[int] = spec["token_ids"]
    started = time.monotonic()
    llm = LLM(
        model=str(model_dir),
        dtype=spec["dtype"],
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=spec["block_size"],
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],
        max_num_seqs=1,
        num_gpu_blocks_override=spec["num_blocks"],
        # Explicit, so vLLM neither reserves a fraction of the machine's memory nor fails
        # its start-up check when other processes use memory.
        kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        seed=0,
        kv_transfer_config={
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"dump_dir": str(stage)},
        },
    )
    ready = time.monotonic()
    try:
        if spec["warmup_tokens"]:
            # Without prefix caching, vLLM reuses a finished request's blocks first, last block
            # first (block_pool.py free_blocks: LIFO): the probe's block ids then start with
            # the warm-up's in reverse ([3, 2, 1, 4, ...]), not 1..n.
            llm.generate(
                [TokensPrompt(prompt_token_ids=token_ids[: spec["warmup_tokens"]])],
                SamplingParams(max_tokens=1, temperature=0.0),
                use_tqdm=False,
            )
        warmed = time.monotonic()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=token_ids)],
            SamplingParams(
                max_tokens=1,
                temperature=0.0,
                extra_args={"kv_transfer_params": {DUMP_FLAG: True}},
            ),
            use_tqdm=False,
        )
        generated = time.monotonic()
    finally:
        llm.llm_engine.engine_core.shutdown()
    out = outputs[0]
    result = {
        "prompt_token_ids": list(out.prompt_token_ids or []),
        "output_token_ids": list(out.outputs[0].token_ids),
        "kv_transfer_params": out.kv_transfer_params,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "kernel_library": kernel_library(),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "engine_ready_s": round(ready - started, 3),
        "generate_s": round(generated - warmed, 3),
    }
    (stage / "vllm.json").write_text(json.dumps(result))


def kernel_library() -> str:
    """Which of vLLM's x86 kernel libraries the CPU platform loads here (platforms/cpu.py)."""
    import platform

    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return "_C"
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def child_env() -> dict[str, str]:
    """This environment plus vLLM's quiet settings and the connector's directory on PYTHONPATH."""
    env = dict(os.environ)
    env.update(QUIET_ENV)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ of the connector in the repository
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(HERE) + (os.pathsep + path if path else "")
    return env


def live_group_members(pgid: int) -> list[int]:
    """Pids of processes in group `pgid` that are not zombies (read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the whole group, then SIGKILL what is left after `grace_s`; verify none remain."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not live_group_members(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and live_group_members(pgid):
            time.sleep(0.1)
    left = live_group_members(pgid)
    if left:
        raise RuntimeError(f"processes {left} of the vLLM run survived SIGKILL")


def run_vllm_child(model_dir: Path, stage: Path, spec: dict[str, Any]) -> float:
    """Run vllm_stage in a new session; return its wall time. No process of it outlives this."""
    (stage / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--vllm-stage", str(model_dir), str(stage)]
    started = time.monotonic()
    child = subprocess.Popen(cmd, env=child_env(), stdout=sys.stderr, start_new_session=True)
    try:
        code = child.wait(timeout=VLLM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the vLLM run took more than {VLLM_TIMEOUT_S:.0f} s") from None
    finally:
        kill_group(child.pid)
        if child.poll() is None:
            child.wait()
    if code != 0:
        raise RuntimeError(f"the vLLM run exited with status {code} (its log is above)")
    return time.monotonic() - started


# ---- stage 2: the HF reference -----------------------------------------------------------------


def cache_layer(cache: Any, layer: int) -> tuple[Any, Any]:
    """(keys, values) of one layer of an HF cache object, across transformers versions."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def hf_reference(model_dir: Path, token_ids: list[int]) -> Any:
    """K (post-rotary) and V of every layer from HF: float32 array [L][2][H][T][D]."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]), use_cache=True)
    planes = []
    for layer in range(model.config.num_hidden_layers):
        k, v = cache_layer(out.past_key_values, layer)
        planes.append(torch.stack([k[0], v[0]]))  # each [H, T, D]
    return torch.stack(planes).to(torch.float32).numpy().astype("<f4", copy=False)


# ---- the manifest ------------------------------------------------------------------------------


def check_vllm_result(spec: dict[str, Any], worker: dict[str, Any], result: dict[str, Any]) -> list[int]:
    """Cross-check the dump against what vLLM returned; return the request's block ids."""
    ids = spec["token_ids"]
    if result["prompt_token_ids"] != ids:
        raise RuntimeError("vLLM's prompt token ids differ from the ones given")
    if worker["token_ids"] != ids:
        raise RuntimeError("the dumped request is not the probe prompt")
    blocks: list[int] = worker["block_ids"]
    params = (result.get("kv_transfer_params") or {}).get("kvferry_probe") or {}
    if params.get("block_ids") != blocks:
        raise RuntimeError(
            f"block ids at request_finished {params.get('block_ids')} differ from the "
            f"scheduled ones {blocks}"
        )
    needed = math.ceil(len(ids) / spec["block_size"])
    if len(blocks) != needed:
        raise RuntimeError(f"{len(blocks)} blocks for {len(ids)} tokens, expected {needed}")
    return blocks


def attention_path(worker: dict[str, Any]) -> str:
    """'CPU_ATTN:<isa>' from the ISA vLLM set on the attention layers (one value expected)."""
    isas = sorted(set(worker["isa"].values()))
    if len(isas) != 1:
        raise RuntimeError(f"attention layers report ISAs {isas}, expected one")
    return f"CPU_ATTN:{isas[0]}"


def build_manifest(
    spec: dict[str, Any], worker: dict[str, Any], result: dict[str, Any], blocks: list[int]
) -> dict[str, Any]:
    """manifest.json's content (the format the Rust test parses)."""
    expected = f"torch.{spec['dtype']}"
    if worker["dtype"] != expected:
        raise RuntimeError(f"the KV cache is {worker['dtype']}, expected {expected}")
    shape = worker["layers"][0]["shape"]
    num_blocks, num_kv_heads, block_size, two_d = shape
    return {
        "dtype": MANIFEST_DTYPE[spec["dtype"]],
        "num_layers": len(worker["layers"]),
        "num_kv_heads": num_kv_heads,
        "head_dim": two_d // 2,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "layers": worker["layers"],
        "tokens": len(spec["token_ids"]),
        "token_ids": spec["token_ids"],
        "block_ids": blocks,
        "extents": worker["extents"],
        "reference": {"file": "reference.f32", "order": "layer, plane (0=K,1=V), head, token, dim"},
        "vllm_version": result["vllm_version"],
        "torch_version": result["torch_version"],
        "cpu_attention_path": attention_path(worker),
    }


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """MODELDIR OUTDIR and the prompt/cache shape options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--block-size", type=int, default=32, help="vLLM block size (CPU: a multiple of 32)")
    p.add_argument("--full-blocks", type=int, default=5, help="full blocks in the prompt")
    p.add_argument("--tail", type=int, default=7, help="tokens in the partial last block (1..block-1)")
    p.add_argument("--num-blocks", type=int, help="blocks per layer in vLLM's cache (default: full-blocks + 4)")
    p.add_argument("--max-model-len", type=int, help="default: (full-blocks + 2) x block-size")
    p.add_argument(
        "--warmup-tokens",
        type=int,
        help="tokens of a request run (and freed) before the probe, so the probe's blocks are "
        "not 1..n (default: 2 x block-size + 1; 0: none)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(MANIFEST_DTYPE),
        default="float32",
        help="vLLM's model and KV dtype (bfloat16 takes vLLM's AMX path where the CPU has AMX); "
        "the reference is always HF in float32",
    )
    p.add_argument("--vllm-stage", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_stage:
        return args
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} has no config.json (make a model with tiny_model.py)")
    if not 0 < args.tail < args.block_size:
        p.error("--tail must be in 1..block-size-1 (the last block must be partial)")
    tokens = args.full_blocks * args.block_size + args.tail
    if args.max_model_len is None:
        args.max_model_len = (args.full_blocks + 2) * args.block_size
    if args.num_blocks is None:
        args.num_blocks = args.full_blocks + 4
    if args.warmup_tokens is None:
        args.warmup_tokens = 2 * args.block_size + 1
    if not 0 <= args.warmup_tokens <= tokens:
        p.error("--warmup-tokens must be in 0..the probe's token count")
    if tokens >= args.max_model_len:
        p.error(f"{tokens} prompt tokens do not fit --max-model-len {args.max_model_len}")
    # Block 0 is vLLM's null block; the rest must hold one request of max_model_len tokens.
    if (args.num_blocks - 1) * args.block_size < args.max_model_len:
        p.error("--num-blocks - 1 blocks must hold --max-model-len tokens (vLLM refuses to start)")
    return args


OUTPUTS = ("manifest.json", "kv.bin", "reference.f32")


def probe(args: argparse.Namespace) -> None:
    """Both stages; OUTDIR gets manifest.json, kv.bin, reference.f32 (none of them on failure)."""
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    stage = out / STAGE_DIR
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        write_outputs(args, stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def write_outputs(args: argparse.Namespace, stage: Path) -> None:
    """Run vLLM into `stage`, check it, compute the reference, write the outputs."""
    started = time.monotonic()
    out: Path = args.out_dir
    tokens = args.full_blocks * args.block_size + args.tail
    spec = {
        "token_ids": prompt_token_ids(args.model_dir, tokens),
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_model_len": args.max_model_len,
        "warmup_tokens": args.warmup_tokens,
        "dtype": args.dtype,
    }
    log(
        f"vLLM: {tokens} tokens, block size {args.block_size}, {args.num_blocks} blocks, "
        f"{args.dtype}"
    )
    vllm_wall = run_vllm_child(args.model_dir, stage, spec)
    if not (stage / "worker.json").exists():
        raise RuntimeError(
            "vLLM ran but the probe connector dumped nothing (its prefill must be one step: "
            "max_num_batched_tokens >= the prompt)"
        )
    worker = json.loads((stage / "worker.json").read_text())
    result = json.loads((stage / "vllm.json").read_text())
    blocks = check_vllm_result(spec, worker, result)
    st = worker["storage"]
    log(
        f"vLLM's KV buffer: {st['nbytes']} bytes, layer 0 at byte {st['offset_of_layer0']}, "
        f"one buffer for all layers: {st['shared_by_all_layers']}; attention ISA per layer "
        f"{worker['isa']}; kernels {result['kernel_library']}, AMX {result['amx']}"
    )
    ref_started = time.monotonic()
    ref = hf_reference(args.model_dir, spec["token_ids"])
    ref_s = time.monotonic() - ref_started
    manifest = build_manifest(spec, worker, result, blocks)
    expect = (manifest["num_layers"], 2, manifest["num_kv_heads"], tokens, manifest["head_dim"])
    if ref.shape != expect:
        raise RuntimeError(f"HF reference has shape {ref.shape}, expected {expect}")
    (out / "reference.f32").write_bytes(ref.tobytes())
    os.replace(stage / "kv.bin", out / "kv.bin")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(
        f"done in {time.monotonic() - started:.1f} s (vLLM child {vllm_wall:.1f} s: engine ready "
        f"{result['engine_ready_s']} s, generate {result['generate_s']} s; HF reference "
        f"{ref_s:.1f} s); blocks {blocks}; kv.bin {(out / 'kv.bin').stat().st_size} bytes; "
        f"{manifest['cpu_attention_path']}"
    )


def on_signal(signum: int, _frame: Any) -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so cleanup (the child group's kill) runs."""
    log(f"signal {signum}: stopping the vLLM run")
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """Entry point: the parent flow, or the vLLM child when --vllm-stage is given."""
    args = parse_args(argv)
    os.environ.update(QUIET_ENV)
    if args.vllm_stage:
        stage: Path = args.out_dir
        vllm_stage(args.model_dir, stage, json.loads((stage / "spec.json").read_text()))
        return 0
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        probe(args)
    except (RuntimeError, OSError) as e:
        log(f"error: {e}")
        return 1
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
