"""An engine whose KV cache is CUDA device memory, with a prefill and a decode agent embedded in
this process over it (``PrefillAgent(regions, device=0)``). The memory is allocated through the
CUDA driver API with ctypes (torch cannot run on the CUDA driver emulator), one allocation per
layer as vLLM's CUDA layouts have it (``vllm-flash-nhd``). Run as a script with the emulator's
libcuda first on LD_LIBRARY_PATH (test_device.py); prints what it checked as JSON, exits non-zero
on any mismatch.

A second room is written by the engine on its own CUDA stream and announced with the event it
records there (``ready(..., cuda_event=...)``): it must not land before the writes run.

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

    # A host-only format on device memory is refused at start, not at the first gather.
    try:
        cpu_opts = options(registry, kv_format="vllm-cpu-vec", pool_pages=PAGES)
        kvferry.DecodeAgent([(prefill_layers[0], size)], device=0, **cpu_opts)
        raise AssertionError("a host-only format was taken for device memory")
    except kvferry.RegionError as e:
        assert "host-memory format" in str(e), e

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
    # Ready on the device: the engine writes a second room's KV on its own stream, held until
    # after `ready`, and hands over the event it records behind the writes. The gathers wait
    # for it; the room cannot land before the engine's stream runs.
    stream, event = ctypes.c_void_p(), ctypes.c_void_p()
    cuda.check(cuda.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    cuda.check(cuda.lib.cuEventCreate(ctypes.byref(event), 0), "cuEventCreate")
    flag = ctypes.c_void_p()
    cuda.check(cuda.lib.cuMemHostAlloc(ctypes.byref(flag), ctypes.c_size_t(4), 0), "cuMemHostAlloc")
    hold = ctypes.c_uint32.from_address(flag.value)
    hold.value = 0
    cuda.check(cuda.lib.cuStreamWaitValue32_v2(stream, ctypes.c_uint64(flag.value), ctypes.c_uint32(1), 0), "hold")
    fresh = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    for p, data in zip(prefill_layers, fresh):
        src_ptr = ctypes.c_void_p(data.ctypes.data)
        cuda.check(cuda.lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(p), src_ptr, ctypes.c_size_t(size), stream), "upload")
    cuda.check(cuda.lib.cuEventRecord(event, stream), "cuEventRecord")
    src2, dst2 = [20, 21, 22], [40, 41, 42]
    decode.request(2, TOKENS, pages=dst2)
    prefill.ready(2, TOKENS, pages=src2, cuda_event=event.value)
    cuda.check(cuda.lib.cuEventDestroy_v2(event), "cuEventDestroy")  # the agent follows its own
    try:
        early = decode.view(2)
        while early["state"] != "success":
            early = decode.wait(2, 1.0)  # a change within the second, or WaitTimeout
        raise AssertionError(f"the room landed before the engine's writes ran: {early}")
    except kvferry.WaitTimeout:
        pass
    finally:
        hold.value = 1
    done = decode.wait(2, 60)
    assert done["state"] == "success", done
    decode.take(2)
    for layer in range(n):
        got = cuda.download(decode_layers[layer], size).reshape(2, PAGES, page, row)
        want = fresh[layer].reshape(2, PAGES, page, row)
        for i, (s, d) in enumerate(zip(src2, dst2)):
            rows = min(page, TOKENS - i * page)
            if not (got[:, d, :rows] == want[:, s, :rows]).all():
                raise AssertionError(f"layer {layer}: page {d} is not the engine's write behind the event")
    for bad, why in [(0, "null"), (event.value + 3, "not a CUevent"), (1 << 60, "not a CUevent")]:
        try:
            prefill.ready(3, TOKENS, pages=src2, cuda_event=bad)
            raise AssertionError(f"the event {bad:#x} was taken")
        except kvferry.RegionError as e:
            assert why in str(e), e
    prefill.close()
    decode.close()
    print(json.dumps({"landed_bytes": landed, "pool_bytes": 2 * n * size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
