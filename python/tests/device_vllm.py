"""vLLM's CUDA KV caches as the connector hands them to kvferry (kvferry.vllm.memory), on the
CUDA driver emulator's memory: per-layer tensors stand in for torch's (torch cannot allocate on
the emulator) with the attributes vLLM's tensors have, over cuMemAlloc'd layers. The regions
and format the connector picks for flash attention start a prefill and a decode agent that
move a room; the decode's layers are read back and compared. Refusals: a layout kvferry has
no format for, layers on two devices, a layer that is not the backend's shape.

Usage: device_vllm.py REGISTRY_URL (the emulator's libcuda on LD_LIBRARY_PATH; test_device.py)
"""

import sys
from types import SimpleNamespace

import numpy as np

import kvferry
from device_engine import POISON, Cuda
from engine import options
from kvferry.vllm.memory import cuda_cache

PAGES, BLOCK, TOKENS = 32, 16, 40


class Layer:
    """What kvferry reads of a CUDA tensor."""

    def __init__(self, ptr: int, shape: tuple, itemsize: int, device: int = 0) -> None:
        self.ptr, self.shape = ptr, shape
        self.nbytes = int(np.prod(shape)) * itemsize
        self.device = SimpleNamespace(type="cuda", index=device)

    def data_ptr(self) -> int:
        return self.ptr

    def is_contiguous(self) -> bool:
        return True


def refused(call, words: str) -> None:
    try:
        call()
    except ValueError as e:
        assert words in str(e), e
        return
    raise AssertionError(f"accepted: {words}")


def main() -> int:
    cuda = Cuda()
    opts = options(sys.argv[1], kv_format="vllm-flash-nhd", pool_pages=PAGES, page_size=BLOCK)
    layout = kvferry.memory_layout(**opts)
    heads = layout["heads"][1] - layout["heads"][0]
    head_size = layout["head_bytes"] // layout["dtype_bytes"]
    shape = (2, PAGES, BLOCK, heads, head_size)  # flash attention, NHD
    size = layout["region_bytes"]

    def caches(fill):
        out = {}
        for layer in range(layout["num_regions"]):
            p = cuda.alloc(size)
            cuda.upload(p, fill(layer))
            out[f"model.layers.{layer}.self_attn.attn"] = Layer(p, shape, layout["dtype_bytes"])
        return out

    rng = np.random.default_rng(11)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(layout["num_regions"])]
    prefill_kv = caches(lambda layer: sources[layer])
    decode_kv = caches(lambda layer: np.full(size, POISON, dtype=np.uint8))

    cache = cuda_cache(prefill_kv, "FLASH_ATTN", "NHD", BLOCK)
    assert cache.kv_format == "vllm-flash-nhd" and cache.device == 0 and cache.bytes == size * len(prefill_kv), cache
    refused(lambda: cuda_cache(prefill_kv, "FLASHINFER", "HND", BLOCK), "no kvferry format")
    refused(lambda: cuda_cache(prefill_kv, "FLASHINFER", "NHD", BLOCK), "is not that layout")
    refused(lambda: cuda_cache(prefill_kv, "TRITON_ATTN", "NHD", BLOCK), "has no kvferry format")
    apart = dict(prefill_kv)
    apart["model.layers.1.self_attn.attn"] = Layer(1, shape, layout["dtype_bytes"], device=1)
    refused(lambda: cuda_cache(apart, "FLASH_ATTN", "NHD", BLOCK), "several CUDA devices")

    decode_cache = cuda_cache(decode_kv, "FLASH_ATTN", "NHD", BLOCK)
    prefill = kvferry.PrefillAgent(cache.regions, device=cache.device, **opts)
    decode = kvferry.DecodeAgent(decode_cache.regions, device=decode_cache.device, **opts)
    src, dst = [3, 4, 30], [9, 1, 2]
    decode.request(7, TOKENS, pages=dst)
    prefill.ready(7, TOKENS, pages=src)
    done = decode.wait(7, 60)
    assert done["state"] == "success", done
    decode.take(7)
    row = heads * layout["head_bytes"]
    for layer, t in enumerate(decode_kv.values()):
        got = cuda.download(t.ptr, size).reshape(2, PAGES, BLOCK, row)
        want = sources[layer].reshape(2, PAGES, BLOCK, row)
        expect = np.full_like(got, POISON)
        for i, (s, d) in enumerate(zip(src, dst)):
            rows = min(BLOCK, TOKENS - i * BLOCK)
            expect[:, d, :rows] = want[:, s, :rows]
        assert (got == expect).all(), f"layer {layer} differs"
    prefill.close()
    decode.close()
    print("flash attention NHD caches: regions, format and every byte of the room as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
