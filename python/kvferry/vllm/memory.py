"""How vLLM's KV cache tensors become the regions of a kvferry agent.

vLLM's CPU backend keeps every attention layer's cache in one buffer, layer after layer
(``[num_blocks, kv_heads, block_size, 2 * head_size]`` each): that buffer is the one region, in
the ``vllm-cpu-vec`` or ``vllm-cpu-amx`` format by the attention path vLLM took.

CUDA caches are refused (:data:`CUDA_REFUSED`): this vLLM keeps them as cells of K and V side by
side per (token, head), ``[blocks, heads, tokens, K|V]`` or ``[blocks, tokens, heads, K|V]``
views of one buffer that every layer shares, and kvferry has no format, and its CUDA kernel no
page order, for that yet. Its CUDA formats (``vllm-flash-nhd``, ``vllm-flash-hnd``,
``flashinfer``) describe the separate K and V planes of earlier vLLM versions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ISA_FORMATS = {"vec": "vllm-cpu-vec", "amx": "vllm-cpu-amx"}

CUDA_REFUSED = (
    "KvferryConnector: CUDA KV caches are not supported yet: this vLLM keeps K and V side by side "
    "in each (token, head) cell of one buffer shared by all layers, and kvferry has no format for "
    "that (its CUDA formats are the separate K and V planes of earlier vLLM versions)"
)


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
    return Cache(ISA_FORMATS[isa], [(base, length)], length)
