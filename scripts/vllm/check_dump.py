#!/usr/bin/env python3
"""Check a probe_kv.py dump: find every K and V element in vLLM's bytes and compare with HF.

Usage: check_dump.py OUTDIR [--atol 1e-4]

The layout under test (vLLM's CPU attention backend, the `vec` path): each layer's tensor is
[num_blocks, num_kv_heads, block_size, 2 * head_dim] of the cache dtype, at manifest
`layers[l].offset` bytes from layer 0, with the strides the manifest gives. Token t lives in
block `block_ids[t // block_size]` at slot `t % block_size`. Inside one (block, head) run of
2 * block_size * head_dim elements: K first, transposed ([head_dim][block_size]: element
(slot, d) at d * block_size + slot), then V ([block_size][head_dim]: element (slot, d) at
block_size * head_dim + slot * head_dim + d).

Prints the max abs error against reference.f32 and, to show the check can fail, the error
when K is read untransposed ([block_size][head_dim]) and when V is read transposed. Also
reports the layout facts it can see (compact layers, contiguous strides, zeroed slots past the
last token). Exit 0 when the layout matches within --atol and both wrong readings do not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ELEMENT_SIZE = {"fp32": 4}


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

    def read_f32(self, offsets: np.ndarray) -> np.ndarray:
        """Elements at these byte offsets of vLLM's buffer (relative to layer 0), from the extents."""
        idx = np.searchsorted(self.ext_off, offsets, side="right") - 1
        if (idx < 0).any():
            raise SystemExit("check_dump: an element lies before every extent")
        inside = offsets + self.esize <= self.ext_off[idx] + self.ext_len[idx]
        if not inside.all():
            bad = int(offsets[~inside][0])
            raise SystemExit(f"check_dump: byte {bad} of vLLM's buffer is in no extent")
        pos = self.ext_file[idx] + (offsets - self.ext_off[idx])
        four = self.kv[pos[..., None] + np.arange(self.esize)]
        return four.reshape(-1).view("<f4").reshape(offsets.shape)


def element_offsets(d: Dump, k_transposed: bool, v_transposed: bool) -> np.ndarray:
    """Byte offsets [L][2][H][T][D] of every K/V element under the given in-block orders."""
    m, B, D = d.m, d.B, d.D
    t = np.arange(d.T)
    blocks = np.asarray(m["block_ids"], dtype=np.int64)[t // B]
    slot = t % B
    dim = np.arange(D)
    out = np.empty((d.L, 2, d.H, d.T, D), dtype=np.int64)
    for layer, info in enumerate(m["layers"]):
        sb, sh = info["strides"][0], info["strides"][1]
        for h in range(d.H):
            run = info["offset"] + (blocks * sb + h * sh) * d.esize  # [T]: start of (block, head)
            for plane, transposed in ((0, k_transposed), (1, v_transposed)):
                base = plane * B * D
                if transposed:
                    el = base + dim[None, :] * B + slot[:, None]
                else:
                    el = base + slot[:, None] * D + dim[None, :]
                out[layer, plane, h] = run[:, None] + el * d.esize
    return out


def max_err(d: Dump, k_transposed: bool, v_transposed: bool) -> tuple[float, float]:
    """Max abs error of K and of V against the reference, read with the given orders."""
    got = d.read_f32(element_offsets(d, k_transposed, v_transposed))
    diff = np.abs(got.astype(np.float64) - d.ref.astype(np.float64))
    return float(diff[:, 0].max()), float(diff[:, 1].max())


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
        tail = []
        for layer, info in enumerate(m["layers"]):
            for h in range(H):
                run = info["offset"] + (last * info["strides"][0] + h * info["strides"][1]) * d.esize
                k = [run + (dd * B + s) * d.esize for dd in range(D) for s in range(used, B)]
                v = [run + (B * D + s * D + dd) * d.esize for s in range(used, B) for dd in range(D)]
                tail.append(d.read_f32(np.array(k + v, dtype=np.int64)))
        zeros = all((x == 0).all() for x in tail)
        facts.append(
            f"slots {used}..{B - 1} of the last block (block {last}): {'all zero' if zeros else 'NOT all zero'}"
        )
    return facts


def main(argv: list[str]) -> int:
    """Run the check; print the errors and the layout facts."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--atol", type=float, default=1e-4, help="max abs error allowed (default 1e-4)")
    args = p.parse_args(argv)
    d = Dump(args.out_dir)
    m = d.m
    print(
        f"{m['cpu_attention_path']} vLLM {m['vllm_version']}: {d.L} layers, {d.H} KV heads, "
        f"head_dim {d.D}, block {d.B}, {d.T} tokens in blocks {m['block_ids']}, "
        f"{len(m['extents'])} extents, {d.kv.size} bytes"
    )
    k, v = max_err(d, k_transposed=True, v_transposed=False)
    ok = max(k, v) <= args.atol
    print(f"K [head_dim][block] + V [block][head_dim]: max abs err K {k:.3g}, V {v:.3g}  {'OK' if ok else 'MISMATCH'}")
    wk, _ = max_err(d, k_transposed=False, v_transposed=False)
    _, wv = max_err(d, k_transposed=True, v_transposed=True)
    teeth = wk > args.atol and wv > args.atol
    print(f"wrong reading, K untransposed [block][head_dim]: max abs err K {wk:.3g}  {'mismatch, as it must' if wk > args.atol else 'MATCHES (the check has no teeth)'}")
    print(f"wrong reading, V transposed [head_dim][block]:   max abs err V {wv:.3g}  {'mismatch, as it must' if wv > args.atol else 'MATCHES (the check has no teeth)'}")
    scale = float(np.abs(d.ref).max())
    print(f"reference max |value| {scale:.3g} (K and V), tolerance {args.atol:g}")
    for fact in layout_facts(d):
        print(fact)
    return 0 if ok and teeth else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
