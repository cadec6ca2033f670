"""An engine whose KV cache is CUDA device memory, with a prefill and a decode agent as
sidecars (``kvferry.spawn``) over its two pools, each one allocation opened by the sidecar by
CUDA IPC handle (``cuda-ipc:0:<handle>``). The engine writes a room's KV on a stream of its own,
held (``cuStreamWaitValue32``) until after ``ready``, records an interprocess event behind the
writes and announces the room with the event's IPC handle (``ready(..., cuda_ipc_event=)``): the
room must not land before the writes run, and once they did, every byte of its decode pages is
the engine's write and every other byte the poison. Run as a script with the emulator's libcuda
first on LD_LIBRARY_PATH (test_device.py); prints what it checked as JSON.

Usage: device_sidecar.py REGISTRY_URL
"""

import ctypes
import json
import sys

import numpy as np

import kvferry
from device_engine import Cuda
from engine import options

PAGES = 64
TOKENS = 70  # three pages of 32 tokens, the last partial
POISON = 0xDE


def main() -> int:
    registry = sys.argv[1]
    cuda = Cuda()
    opts = options(registry, kv_format="kvferry", pool_pages=PAGES)
    layout = kvferry.memory_layout(**opts)
    size = layout["pool_bytes"]
    row = (layout["heads"][1] - layout["heads"][0]) * layout["head_bytes"]  # one token of a plane
    block = layout["page_size"] * row  # one page of a plane (kvferry's format)
    assert size % (PAGES * block) == 0, layout
    prefill_pool, decode_pool = cuda.alloc(size), cuda.alloc(size)
    cuda.upload(prefill_pool, np.zeros(size, dtype=np.uint8))
    cuda.upload(decode_pool, np.full(size, POISON, dtype=np.uint8))

    def descriptor(p: int) -> str:
        handle = (ctypes.c_uint8 * 64)()
        cuda.check(cuda.lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(p)), "cuIpcGetMemHandle")
        return f"cuda-ipc:0:{bytes(handle).hex()}"

    # The engine's stream, held on a pinned word, and an interprocess event.
    stream, event, flag = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    cuda.check(cuda.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    cuda.check(cuda.lib.cuEventCreate(ctypes.byref(event), 2 | 4), "cuEventCreate(INTERPROCESS)")
    cuda.check(cuda.lib.cuMemHostAlloc(ctypes.byref(flag), ctypes.c_size_t(4), 0), "cuMemHostAlloc")
    hold = ctypes.c_uint32.from_address(flag.value)
    hold.value = 0
    cuda.check(cuda.lib.cuStreamWaitValue32_v2(stream, ctypes.c_uint64(flag.value), ctypes.c_uint32(1), 0), "hold")
    written = np.random.default_rng(11).integers(1, 256, size, dtype=np.uint8)
    src = ctypes.c_void_p(written.ctypes.data)
    cuda.check(cuda.lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(prefill_pool), src, ctypes.c_size_t(size), stream), "upload")
    cuda.check(cuda.lib.cuEventRecord(event, stream), "cuEventRecord")
    handle = (ctypes.c_uint8 * 64)()
    cuda.check(cuda.lib.cuIpcGetEventHandle(handle, event), "cuIpcGetEventHandle")

    src_pages, dst_pages = [9, 4, 30], [1, 50, 7]
    with kvferry.spawn("prefill", descriptor(prefill_pool), **opts) as prefill, \
            kvferry.spawn("decode", descriptor(decode_pool), **opts) as decode:
        for bad, says in [(b"\x00" * 63, "64 bytes"), (b"\x5a" * 64, "CUDA_ERROR_INVALID_HANDLE")]:
            try:
                prefill.ready(5, TOKENS, pages=src_pages, cuda_ipc_event=bad)
                raise AssertionError(f"the event handle {bad[:4]!r}... was taken")
            except kvferry.BadRequest as e:
                assert says in str(e), e
        decode.request(6, TOKENS, pages=dst_pages)
        prefill.ready(6, TOKENS, pages=src_pages, cuda_ipc_event=bytes(handle))
        try:
            for _ in range(3):  # held: nothing behind the event ran, so nothing can land
                early = decode.wait(6, 1.0)
                raise AssertionError(f"the room landed before the engine's writes ran: {early}")
        except kvferry.WaitTimeout:
            pass
        finally:
            hold.value = 1
        done = decode.wait(6, 30)
        assert done["state"] == "success", done
        decode.take(6)
    got = cuda.download(decode_pool, size).reshape(-1, PAGES, block)
    want = written.reshape(-1, PAGES, block)
    expect = np.full_like(got, POISON)
    landed = 0
    for i, (s, d) in enumerate(zip(src_pages, dst_pages)):
        n = min(layout["page_size"], TOKENS - i * layout["page_size"]) * row
        expect[:, d, :n] = want[:, s, :n]
        landed += expect.shape[0] * n
    if not (got == expect).all():
        bad = np.argwhere(got != expect)[0].tolist()
        raise AssertionError(f"first wrong byte at [plane, page, byte] {bad}")
    print(json.dumps({"landed_bytes": landed, "pool_bytes": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
