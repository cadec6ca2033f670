"""An engine whose KV cache is CUDA device memory, with a prefill and a decode agent embedded in
this process over it (``PrefillAgent(regions, device=0)``). The memory is allocated through the
CUDA driver API with ctypes (torch cannot run on the CUDA driver emulator), one allocation per
layer as vLLM's CUDA layouts have it (``vllm-flash-nhd``). Run as a script with the emulator's
libcuda first on LD_LIBRARY_PATH (test_device.py); prints what it checked as JSON, exits non-zero
on any mismatch.

Usage: device_engine.py REGISTRY_URL
"""

import ctypes
import json
import sys

import numpy as np

import kvferry
from engine import options

PAGES = 64
TOKENS = 70
POISON = 0xDE


class Cuda:
    """The driver calls the engine makes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check(self.lib.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what}: CUDA error {result}")

    def alloc(self, n: int) -> int:
        p = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
        return p.value

    def upload(self, p: int, data: np.ndarray) -> None:
        src = ctypes.c_void_p(data.ctypes.data)
        self.check(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(p), src, ctypes.c_size_t(data.nbytes)), "cuMemcpyHtoD")

    def download(self, p: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint8)
        dst = ctypes.c_void_p(out.ctypes.data)
        self.check(self.lib.cuMemcpyDtoH_v2(dst, ctypes.c_uint64(p), ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return out


def main() -> int:
    registry = sys.argv[1]
    cuda = Cuda()
    opts = options(registry, kv_format="vllm-flash-nhd", pool_pages=PAGES)
    layout = kvferry.memory_layout(**opts)
    n, size = layout["num_regions"], layout["region_bytes"]
    rng = np.random.default_rng(5)
    prefill_layers = [cuda.alloc(size) for _ in range(n)]
    decode_layers = [cuda.alloc(size) for _ in range(n)]
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    for p, data in zip(prefill_layers, sources):
        cuda.upload(p, data)
    for p in decode_layers:
        cuda.upload(p, np.full(size, POISON, dtype=np.uint8))

    # Host memory named as device memory is refused: the driver does not know it.
    host = np.zeros(size, dtype=np.uint8)
    try:
        kvferry.DecodeAgent([(host.ctypes.data, size)] * n, device=0, **opts)
        raise AssertionError("host memory was taken for device memory")
    except kvferry.RegionError as e:
        assert "not device memory" in str(e), e

    prefill = kvferry.PrefillAgent([(p, size) for p in prefill_layers], device=0, **opts)
    decode = kvferry.DecodeAgent([(p, size) for p in decode_layers], device=0, **opts)
    src, dst = [5, 9, 2], [7, 3, 11]
    decode.request(1, TOKENS, pages=dst)
    for layer in range(n):
        prefill.ready(1, TOKENS, pages=src, layer_range=(layer, layer + 1), last=layer == n - 1)
    done = decode.wait(1, 60)
    assert done["state"] == "success", done
    decode.take(1)

    # vLLM's flash layout, NHD: per layer [2, pages, page_size, heads * head bytes].
    page, row = layout["page_size"], layout["heads"][1] - layout["heads"][0]
    row *= layout["head_bytes"]
    landed = 0
    for layer in range(n):
        got = cuda.download(decode_layers[layer], size).reshape(2, PAGES, page, row)
        want = sources[layer].reshape(2, PAGES, page, row)
        expect = np.full_like(got, POISON)
        for i, (s, d) in enumerate(zip(src, dst)):
            rows = min(page, TOKENS - i * page)
            expect[:, d, :rows] = want[:, s, :rows]
            landed += 2 * rows * row
        if not (got == expect).all():
            bad = np.argwhere(got != expect)[0].tolist()
            raise AssertionError(f"layer {layer}: first wrong byte at [plane, page, token, byte] {bad}")
    prefill.close()
    decode.close()
    print(json.dumps({"landed_bytes": landed, "pool_bytes": 2 * n * size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
