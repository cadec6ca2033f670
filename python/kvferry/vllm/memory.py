"""How vLLM's KV cache tensors become the regions of a kvferry agent, on either backend.

- CPU: vLLM keeps every attention layer's cache in one buffer, layer after layer
  (``[num_blocks, kv_heads, block_size, 2 * head_size]`` each): that buffer is the one region,
  in the ``vllm-cpu-vec`` or ``vllm-cpu-amx`` format by the attention path vLLM took.
- CUDA: one tensor per layer, each a region of the layer's format: flash attention's
  ``[2, num_blocks, block_size, kv_heads, head_size]`` (``vllm-flash-nhd``) or, with vLLM's HND
  cache layout, ``[2, num_blocks, kv_heads, block_size, head_size]`` (``vllm-flash-hnd``);
  FlashInfer's ``[num_blocks, 2, block_size, kv_heads, head_size]`` (``flashinfer``).

Only the tensors' attributes are read (``data_ptr()``, ``nbytes``, ``shape``, ``device``,
``is_contiguous()``), so that the CUDA path can be tested on the CUDA driver emulator, where
torch cannot allocate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ISA_FORMATS = {"vec": "vllm-cpu-vec", "amx": "vllm-cpu-amx"}


def layer_index(name: str) -> int:
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"KvferryConnector: no layer index in the KV cache name {name!r}")
    return int(m.group(1))


@dataclass
class Cache:
    """vLLM's KV cache as an agent's memory."""

    kv_format: str
    # The agent's regions: (address, length) pairs or the tensors themselves.
    regions: list[Any]
    # The CUDA device of the tensors; None for host memory.
    device: int | None
    # Bytes of all regions together.
    bytes: int


def layers_in_order(kv_caches: dict[str, Any]) -> list[Any]:
    names = sorted(kv_caches, key=layer_index)
    if [layer_index(n) for n in names] != list(range(len(names))):
        raise ValueError(f"KvferryConnector: KV cache layers {names} are not numbered 0..{len(names) - 1}")
    return [kv_caches[n] for n in names]


def nbytes(t: Any) -> int:
    n = t.nbytes
    return n() if callable(n) else n


def cpu_cache(kv_caches: dict[str, Any], isa: str) -> Cache:
    """The one buffer of vLLM's CPU backend, its layers back to back."""
    if isa not in ISA_FORMATS:
        raise ValueError(
            f"KvferryConnector: vLLM's CPU attention path {isa!r} has no kvferry format "
            f"(supported: {sorted(ISA_FORMATS)}; vec16 is taken when block_size is not a multiple of 32)"
        )
    layers = layers_in_order(kv_caches)
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
    return Cache(ISA_FORMATS[isa], [(base, length)], None, length)


def cuda_cache(kv_caches: dict[str, Any], backend: str, layout: str, block_size: int) -> Cache:
    """One region per layer of vLLM's CUDA backends; `backend` is the attention backend's name
    (``FLASH_ATTN``, ``FLASHINFER``), `layout` vLLM's KV cache layout (``NHD`` or ``HND``)."""
    layers = layers_in_order(kv_caches)
    first = layers[0]
    devices = {getattr(t.device, "index", None) or 0 for t in layers}
    if len(devices) != 1:
        raise ValueError(f"KvferryConnector: the KV cache layers are on several CUDA devices {sorted(devices)}")
    for i, t in enumerate(layers):
        if not t.is_contiguous() or tuple(t.shape) != tuple(first.shape):
            raise ValueError(f"KvferryConnector: layer {i} is not a contiguous tensor of the first layer's shape")
    shape = tuple(first.shape)
    if len(shape) != 5:
        raise ValueError(f"KvferryConnector: a CUDA KV cache layer of shape {shape} is not one kvferry knows")
    if backend.startswith("FLASH_ATTN"):
        kv_format = {"NHD": "vllm-flash-nhd", "HND": "vllm-flash-hnd"}.get(layout)
        block_axis = 2 if layout == "NHD" else 3
        planes_first = shape[0] == 2
    elif backend.startswith("FLASHINFER"):
        kv_format = "flashinfer" if layout == "NHD" else None
        block_axis, planes_first = 2, shape[1] == 2
    else:
        raise ValueError(
            f"KvferryConnector: attention backend {backend} has no kvferry format (FLASH_ATTN and FLASHINFER do)"
        )
    if kv_format is None:
        raise ValueError(f"KvferryConnector: {backend} with vLLM's {layout} KV cache layout has no kvferry format")
    if not planes_first or shape[block_axis] != block_size:
        raise ValueError(f"KvferryConnector: a {backend} {layout} layer of shape {shape} is not that layout")
    return Cache(kv_format, list(layers), devices.pop(), sum(nbytes(t) for t in layers))
