"""How vLLM's KV cache tensors become the regions of a kvferry agent, on either backend.

- CPU: vLLM keeps every attention layer's cache in one buffer, layer after layer
  (``[num_blocks, kv_heads, block_size, 2 * head_size]`` each): that buffer is the one region,
  in the ``vllm-cpu-vec`` or ``vllm-cpu-amx`` format by the attention path vLLM took.
- CUDA: each layer is a view ``[num_blocks, kv_heads, block_size, 2 * head_size]`` whose memory
  order is the KV cache layout vLLM resolved: ``LBNHC`` (NHD, ``[blocks][block_size][kv_heads]``
  cells) is the ``vllm-nhd`` format, ``LBHNC`` (HND) ``vllm-hnd``; each cell holds a head's K
  then its V. Every layer is one region of device memory. Layouts that interleave layers inside
  a block (``BL...``) or blocks inside a head (``LHBNC``) are refused.
- Several KV cache groups (groups.py): the groups overlay one buffer layer for layer, so the
  agent's layers are one group's, and each is any group's layer at that place.
- MLA (``CPU_MLA`` on the CPU, the MLA backends on CUDA): each layer is
  ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, one latent per token: the
  ``vllm-mla`` format, one region per layer (on the CPU the layers lie back to back in one
  buffer, and each is still its own region).

Only the tensors' attributes are read (``data_ptr()``, ``nbytes``, ``shape``, ``stride()``,
``device``, ``is_contiguous()``), so that the CUDA path is tested on the CUDA driver emulator,
where torch cannot allocate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ISA_FORMATS = {"vec": "vllm-cpu-vec", "amx": "vllm-cpu-amx"}

# vLLM's KV cache layouts (``vllm.v1.kv_cache_layout.KVCacheLayout`` names) with a kvferry
# format, and the memory order of their per-layer view's axes (blocks, heads, tokens, K|V).
CUDA_FORMATS = {"LBNHC": "vllm-nhd", "LBHNC": "vllm-hnd"}
AXIS_ORDER = {"LBNHC": (0, 2, 1, 3), "LBHNC": (0, 1, 2, 3)}


def layer_index(name: str) -> int:
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"KvferryConnector: no layer index in the KV cache name {name!r}")
    return int(m.group(1))


@dataclass
class Cache:
    """vLLM's KV cache as an agent's memory."""

    kv_format: str
    # The agent's regions: (address, length) pairs.
    regions: list[Any]
    # Bytes of all regions together.
    bytes: int
    # The CUDA device of the regions; None for host memory.
    device: int | None = None


def layers_in_order(kv_caches: dict[str, Any]) -> list[str]:
    """The names of a model's KV cache layers (one KV cache group), in the model's order."""
    names = sorted(kv_caches, key=layer_index)
    if [layer_index(n) for n in names] != list(range(len(names))):
        raise ValueError(f"KvferryConnector: KV cache layers {names} are not numbered 0..{len(names) - 1}")
    return names


def nbytes(t: Any) -> int:
    n = t.nbytes
    return n() if callable(n) else n


def cpu_cache(layers: list[Any], isa: str) -> Cache:
    """The one buffer of vLLM's CPU backend, its layers (``layers``, in order) back to back."""
    if isa not in ISA_FORMATS:
        raise ValueError(
            f"KvferryConnector: vLLM's CPU attention path {isa!r} has no kvferry format "
            f"(supported: {sorted(ISA_FORMATS)}; vLLM takes vec16 for a head size that is an odd multiple "
            "of 16, or a block size that is not a multiple of 32)"
        )
    first = layers[0]
    layer_bytes, base = nbytes(first), first.data_ptr()
    for i, t in enumerate(layers):
        if not t.is_contiguous() or t.data_ptr() != base + i * layer_bytes or tuple(t.shape) != tuple(first.shape):
            raise ValueError(
                f"KvferryConnector: layer {i} is not at its place in one buffer of dense "
                "layers (vLLM's CPU layout); kvferry cannot describe this KV cache"
            )
    length = len(layers) * layer_bytes
    # The raw (address, length) pair: the connector keeps the tensors, hence the buffer.
    return Cache(ISA_FORMATS[isa], [(base, length)], length)


def mla_cache(layers: list[Any]) -> Cache:
    """One region per layer of vLLM's MLA caches (one latent per token and layer; ``layers`` in
    order), on the CPU or on one CUDA device."""
    shape = tuple(layers[0].shape)
    devices = {(t.device.index or 0) if t.device.type == "cuda" else None for t in layers}
    if len(devices) != 1:
        raise ValueError(f"KvferryConnector: the MLA cache layers are on several devices {sorted(map(str, devices))}")
    for i, t in enumerate(layers):
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"KvferryConnector: MLA layer {i} (shape {tuple(t.shape)}) is not a dense layer of shape {shape} "
                "([blocks, block_size, kv_lora_rank + qk_rope_head_dim])"
            )
    regions = [(t.data_ptr(), nbytes(t)) for t in layers]
    return Cache("vllm-mla", regions, sum(n for _, n in regions), devices.pop())


def cuda_cache(layers: list[Any], layout: str | None) -> Cache:
    """One region per layer of vLLM's CUDA caches (``layers``, in order), in the format of
    ``layout``, the KV cache layout vLLM resolved (``cache_config.kv_cache_layout``)."""
    if layout not in CUDA_FORMATS:
        raise ValueError(
            f"KvferryConnector: vLLM's KV cache layout {layout} has no kvferry format (supported: "
            f"{', '.join(f'{k} ({v})' for k, v in CUDA_FORMATS.items())}; VLLM_KV_CACHE_LAYOUT picks one)"
        )
    devices = {t.device.index or 0 for t in layers}
    if len(devices) != 1:
        raise ValueError(f"KvferryConnector: the KV cache layers are on several CUDA devices {sorted(devices)}")
    shape = tuple(layers[0].shape)
    if len(shape) != 4 or shape[3] % 2:
        raise ValueError(
            f"KvferryConnector: a CUDA KV cache layer of shape {shape} is not vLLM's "
            "[blocks, kv_heads, block_size, 2 x head_size]"
        )
    # The strides of a dense tensor whose axes lie in memory in the layout's order.
    order = AXIS_ORDER[layout]
    dense = [0] * 4
    step = 1
    for axis in reversed(order):
        dense[axis] = step
        step *= shape[axis]
    for i, t in enumerate(layers):
        if tuple(t.shape) != shape or tuple(t.stride()) != tuple(dense):
            raise ValueError(
                f"KvferryConnector: layer {i} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) is not a dense "
                f"{layout} layer of shape {shape} (strides {tuple(dense)})"
            )
    regions = [(t.data_ptr(), nbytes(t)) for t in layers]
    return Cache(CUDA_FORMATS[layout], regions, sum(n for _, n in regions), devices.pop())
