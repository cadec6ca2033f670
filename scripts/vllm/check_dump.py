#!/usr/bin/env python3
"""Check a probe_kv.py dump: find every K and V element in vLLM's bytes and compare with HF.

Usage: check_dump.py OUTDIR [--atol A]

The layout under test (vLLM's CPU attention backend): each layer's tensor is
[num_blocks, num_kv_heads, block_size, 2 * head_dim] of the cache dtype, at manifest
`layers[l].offset` bytes from layer 0, with the strides the manifest gives. Token t lives in
block `block_ids[t // block_size]` at slot `t % block_size`. One (block, head) run holds
2 * block_size * head_dim elements, K's block_size * head_dim first, then V's. Inside each half
the order depends on the ISA vLLM picked (manifest `cpu_attention_path`, `CPU_ATTN:<isa>`);
with B = block_size, D = head_dim, element (slot s, dim d) of a half is at:

  vec  K  [D][B]                d * B + s                       (K transposed)
  vec  V  [B][D]                s * D + d
  amx  K  [B/16][D/2][16][2]    (s/16)*16*D + (d/2)*32 + (s%16)*2 + d%2
  amx  V  [D/16][B/2][16][2]    (d/16)*16*B + (s/2)*32 + (d%16)*2 + s%2

Prints the max abs error against reference.f32 for the ISA's order and, to show the check
can fail, for wrong orders (K untransposed, V transposed, the other ISA's). Also reports the
layout facts it can see (compact layers, dense strides, zeroed slots past the last token).
Exit 0 when the ISA's order matches within --atol and every wrong order does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

ELEMENT_SIZE = {"fp32": 4, "bf16": 2}
# Default tolerances: fp32 vLLM vs fp32 HF agree to ~1e-6; bf16 vLLM carries bf16 rounding
# through every layer (a bf16 step near 1.0 is 2^-7).
DEFAULT_ATOL = {"fp32": 1e-4, "bf16": 5e-2}


class Dump:
    """A dump directory: its manifest, kv.bin as bytes, and the reference array."""

    def __init__(self, out_dir: Path) -> None:
        self.m: dict[str, Any] = json.loads((out_dir / "manifest.json").read_text())
        if self.m["dtype"] not in ELEMENT_SIZE:
            raise SystemExit(f"check_dump: dtype {self.m['dtype']} is not handled")
        self.esize = ELEMENT_SIZE[self.m["dtype"]]
        self.kv = np.fromfile(out_dir / "kv.bin", dtype=np.uint8)
        m = self.m
        self.L, self.H, self.D = m["num_layers"], m["num_kv_heads"], m["head_dim"]
        self.B, self.T = m["block_size"], m["tokens"]
        ref = np.fromfile(out_dir / m["reference"]["file"], dtype="<f4")
        self.ref = ref.reshape(self.L, 2, self.H, self.T, self.D)
        ext = sorted(m["extents"], key=lambda e: e["offset"])
        self.ext_off = np.array([e["offset"] for e in ext], dtype=np.int64)
        self.ext_len = np.array([e["len"] for e in ext], dtype=np.int64)
        self.ext_file = np.array([e["file_offset"] for e in ext], dtype=np.int64)
        if int((self.ext_file + self.ext_len).max()) > self.kv.size:
            raise SystemExit("check_dump: an extent points past the end of kv.bin")

    def read(self, offsets: np.ndarray) -> np.ndarray:
        """Elements (as float32) at these byte offsets of vLLM's buffer (relative to layer 0)."""
        idx = np.searchsorted(self.ext_off, offsets, side="right") - 1
        if (idx < 0).any():
            raise SystemExit("check_dump: an element lies before every extent")
        inside = offsets + self.esize <= self.ext_off[idx] + self.ext_len[idx]
        if not inside.all():
            bad = int(offsets[~inside][0])
            raise SystemExit(f"check_dump: byte {bad} of vLLM's buffer is in no extent")
        pos = self.ext_file[idx] + (offsets - self.ext_off[idx])
        raw = self.kv[pos[..., None] + np.arange(self.esize)].reshape(-1)
        if self.m["dtype"] == "bf16":  # the high half of an f32
            return (raw.view("<u2").astype(np.uint32) << 16).view("<f4").reshape(offsets.shape)
        return raw.view("<f4").reshape(offsets.shape)


Order = Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]

# Element index inside one half (K or V) of a (block, head) run, from slot s and dim d
# (broadcast arrays), block size B and head dim D.
ORDERS: dict[str, Order] = {
    "[B][D]": lambda s, d, B, D: s * D + d,
    "[D][B]": lambda s, d, B, D: d * B + s,
    "[B/16][D/2][16][2]": lambda s, d, B, D: (s // 16) * 16 * D + (d // 2) * 32 + (s % 16) * 2 + d % 2,
    "[D/16][B/2][16][2]": lambda s, d, B, D: (d // 16) * 16 * B + (s // 2) * 32 + (d % 16) * 2 + s % 2,
}
# (K order, V order) per ISA string of vLLM's CPU attention.
ISA_ORDERS = {
    "vec": ("[D][B]", "[B][D]"),
    "amx": ("[B/16][D/2][16][2]", "[D/16][B/2][16][2]"),
}


def element_offsets(d: Dump, k_order: str, v_order: str) -> np.ndarray:
    """Byte offsets [L][2][H][T][D] of every K/V element, K and V halves read in these orders."""
    m, B, D = d.m, d.B, d.D
    t = np.arange(d.T)
    blocks = np.asarray(m["block_ids"], dtype=np.int64)[t // B]
    slot, dim = (t % B)[:, None], np.arange(D)[None, :]
    out = np.empty((d.L, 2, d.H, d.T, D), dtype=np.int64)
    for layer, info in enumerate(m["layers"]):
        sb, sh = info["strides"][0], info["strides"][1]
        for h in range(d.H):
            run = info["offset"] + (blocks * sb + h * sh) * d.esize  # [T]: start of (block, head)
            for plane, order in ((0, k_order), (1, v_order)):
                el = plane * B * D + ORDERS[order](slot, dim, B, D)
                out[layer, plane, h] = run[:, None] + el * d.esize
    return out


def max_err(d: Dump, k_order: str, v_order: str) -> tuple[float, float]:
    """Max abs error of K and of V against the reference, read in the given orders."""
    got = d.read(element_offsets(d, k_order, v_order))
    diff = np.abs(got.astype(np.float64) - d.ref.astype(np.float64))
    return float(diff[:, 0].max()), float(diff[:, 1].max())


def wrong_orders(k_order: str, v_order: str) -> list[tuple[str, str, str]]:
    """(label, K order, V order) readings that must NOT match: each changes one plane's order."""
    wrong = [("K " + o, o, v_order) for o in ORDERS if o != k_order]
    return wrong + [("V " + o, k_order, o) for o in ORDERS if o != v_order]


def layout_facts(d: Dump) -> list[str]:
    """What the manifest and bytes say about padding, strides and the unused slots."""
    m, B, D, H = d.m, d.B, d.D, d.H
    facts = []
    page = H * B * 2 * D * d.esize
    layer_bytes = m["num_blocks"] * page
    offs = [info["offset"] for info in m["layers"]]
    compact = offs == [i * layer_bytes for i in range(d.L)]
    facts.append(
        f"layer offsets {offs}: {'layer after layer, no gap' if compact else 'NOT compact'} "
        f"(layer = {m['num_blocks']} blocks x {page} bytes)"
    )
    dense = [H * B * 2 * D, B * 2 * D, 2 * D, 1]
    strides_ok = all(info["strides"] == dense for info in m["layers"])
    facts.append(
        f"strides {m['layers'][0]['strides']}: {'dense, no padding between blocks or heads' if strides_ok else 'NOT dense'}"
    )
    used = d.T % B
    if used:
        last = m["block_ids"][-1]
        k_order, v_order = ISA_ORDERS[isa_of(m)]
        slot, dim = np.arange(used, B)[:, None], np.arange(D)[None, :]
        halves = [ORDERS[k_order](slot, dim, B, D), B * D + ORDERS[v_order](slot, dim, B, D)]
        zeros = True
        for info in m["layers"]:
            for h in range(H):
                run = info["offset"] + (last * info["strides"][0] + h * info["strides"][1]) * d.esize
                for el in halves:
                    zeros &= bool((d.read(run + el * d.esize) == 0).all())
        facts.append(
            f"slots {used}..{B - 1} of the last block (block {last}): {'all zero' if zeros else 'NOT all zero'}"
        )
    return facts


def isa_of(m: dict[str, Any]) -> str:
    """The ISA part of manifest `cpu_attention_path` (`CPU_ATTN:<isa>`)."""
    return str(m["cpu_attention_path"]).split(":", 1)[-1]


def main(argv: list[str]) -> int:
    """Run the check; print the errors and the layout facts."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--atol", type=float, help="max abs error allowed (default 1e-4 for fp32, 5e-2 for bf16)")
    args = p.parse_args(argv)
    d = Dump(args.out_dir)
    m = d.m
    if args.atol is None:
        args.atol = DEFAULT_ATOL[m["dtype"]]
    print(
        f"{m['cpu_attention_path']} vLLM {m['vllm_version']}: {d.L} layers, {d.H} KV heads, "
        f"head_dim {d.D}, block {d.B}, {d.T} tokens in blocks {m['block_ids']}, "
        f"{len(m['extents'])} extents, {d.kv.size} bytes"
    )
    isa = isa_of(m)
    if isa not in ISA_ORDERS:
        print(f"no in-block order known for ISA {isa!r} (known: {sorted(ISA_ORDERS)})")
        return 1
    k_order, v_order = ISA_ORDERS[isa]
    k, v = max_err(d, k_order, v_order)
    ok = max(k, v) <= args.atol
    print(f"{isa}: K {k_order} + V {v_order}: max abs err K {k:.3g}, V {v:.3g}  {'OK' if ok else 'MISMATCH'}")
    teeth = True
    for label, ko, vo in wrong_orders(k_order, v_order):
        wk, wv = max_err(d, ko, vo)
        err = wk if ko != k_order else wv
        teeth &= err > args.atol
        verdict = "mismatch, as it must" if err > args.atol else "MATCHES (the check has no teeth)"
        print(f"  wrong reading, {label:22s} max abs err {err:.3g}  {verdict}")
    scale = float(np.abs(d.ref).max())
    print(f"reference max |value| {scale:.3g} (K and V), tolerance {args.atol:g}")
    for fact in layout_facts(d):
        print(fact)
    return 0 if ok and teeth else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
