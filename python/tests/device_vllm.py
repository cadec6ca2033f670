"""vLLM's CUDA KV caches as the connector hands them to kvferry (kvferry.vllm.memory), on the
CUDA driver emulator's memory. Stand-ins for torch's tensors (torch cannot allocate on the
emulator) carry what vLLM 0.32's per-layer views have: the logical shape
``[blocks, kv_heads, block_size, 2 x head_size]`` and the strides of the KV cache layout
(``LBNHC``: NHD cells, ``LBHNC``: HND cells), over one cuMemAlloc per layer. A prefill with
NHD caches and a decode with HND caches move a room in the formats the connector picks; the
decode's layers are read back and compared, as vLLM's own indexing reads them, with the
prefill's. Refusals: a layout kvferry has no format for, strides that are not the layout's,
layers on two devices, a shape that is not vLLM's. MLA caches (``[blocks, block_size, 576]`` a
layer, one latent per token) move in the ``vllm-mla`` format, token rows compared.

Usage: device_vllm.py REGISTRY_URL (the emulator's libcuda first on LD_LIBRARY_PATH; test_device.py)
"""

import sys
from types import SimpleNamespace

import numpy as np

import kvferry
from device_engine import POISON, Cuda
from engine import options
from kvferry.vllm.memory import AXIS_ORDER, cuda_cache, mla_cache

PAGES, BLOCK, TOKENS = 32, 16, 40


class Layer:
    """What kvferry reads of a CUDA tensor: a dense view whose axes lie in memory in `order`."""

    def __init__(self, ptr: int, shape: tuple, itemsize: int, order: tuple, device: int = 0) -> None:
        self.ptr, self.shape = ptr, shape
        self.nbytes = int(np.prod(shape)) * itemsize
        self.device = SimpleNamespace(type="cuda", index=device)
        self.strides = [0] * len(shape)
        step = 1
        for axis in reversed(order):
            self.strides[axis] = step
            step *= shape[axis]

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple:
        return tuple(self.strides)

    def is_contiguous(self) -> bool:
        return list(self.strides) == sorted(self.strides, reverse=True) and self.strides[-1] == 1


def device_caches(cuda: Cuda, layers: int, size: int, fill, layer_at) -> dict:
    """vLLM's per-layer caches on the emulator: ``size`` bytes a layer, filled with
    ``fill(layer)``, each seen through ``layer_at(pointer)``."""
    out = {}
    for layer in range(layers):
        p = cuda.alloc(size)
        cuda.upload(p, fill(layer))
        out[f"model.layers.{layer}.self_attn.attn"] = layer_at(p)
    return out


def refused(call, words: str) -> None:
    try:
        call()
    except ValueError as e:
        assert words in str(e), e
        return
    raise AssertionError(f"accepted: {words}")


def physical(data: np.ndarray, layout: str, heads: int, head_bytes: int) -> np.ndarray:
    """A layer's bytes indexed as vLLM indexes them: [block, head, token, K|V, byte]."""
    if layout == "LBNHC":
        return data.reshape(PAGES, BLOCK, heads, 2, head_bytes).transpose(0, 2, 1, 3, 4)
    return data.reshape(PAGES, heads, BLOCK, 2, head_bytes)


def main() -> int:
    cuda = Cuda()
    dtypes()
    dense = [nhd_to_hnd(cuda, dtype) for dtype in (None, "fp8_e4m3")]
    latent = [mla(cuda, dtype) for dtype in ("bf16", "fp8_e5m2")]
    print(f"vLLM CUDA caches, NHD prefill to HND decode: {dense} bytes landed as sent (tiny's dtype, fp8_e4m3), "
          f"the rest poison; MLA: {latent} bytes of latent rows (bf16, fp8_e5m2)")
    return 0


def dtypes() -> None:
    """The connector's KV dtype for vLLM's spec dtype and --kv-cache-dtype: FP8 caches (uint8
    tensors) by their encoding; scale-carrying and other quantized caches refused."""
    import torch

    from kvferry.vllm.worker import kv_dtype

    assert kv_dtype(torch.bfloat16, "auto") == "bf16"
    assert kv_dtype(torch.float32, "float32") == "fp32"
    assert kv_dtype(torch.uint8, "fp8") == kv_dtype(torch.uint8, "fp8_e4m3") == "fp8_e4m3"
    assert kv_dtype(torch.uint8, "fp8_e5m2") == "fp8_e5m2"
    for spec, cache in ((torch.uint8, "fp8_ds_mla"), (torch.uint8, "fp8_per_token_head"),
                        (torch.int8, "int8_per_token_head"), (torch.float8_e4m3fn, "fp8_inc")):
        refused(lambda: kv_dtype(spec, cache), "is not served")


def nhd_to_hnd(cuda: Cuda, dtype: str | None) -> int:
    """A room from NHD caches to HND caches of ``dtype`` (None: the tests' model's); returns the
    bytes that landed."""
    base = options(sys.argv[1], kv_format="vllm-nhd", pool_pages=PAGES, page_size=BLOCK,
                   **({"dtype": dtype} if dtype else {}))
    layout = kvferry.memory_layout(**base)
    heads = layout["heads"][1] - layout["heads"][0]
    item, head_bytes = layout["dtype_bytes"], layout["head_bytes"]
    shape = (PAGES, heads, BLOCK, 2 * head_bytes // item)
    n, size = layout["num_regions"], layout["region_bytes"]

    def caches(vllm_layout: str, fill) -> dict:
        return device_caches(cuda, n, size, fill, lambda p: Layer(p, shape, item, AXIS_ORDER[vllm_layout]))

    rng = np.random.default_rng(11)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    prefill_kv = caches("LBNHC", lambda layer: sources[layer])
    decode_kv = caches("LBHNC", lambda layer: np.full(size, POISON, dtype=np.uint8))

    sent = cuda_cache(list(prefill_kv.values()), "LBNHC")
    assert sent.kv_format == "vllm-nhd" and sent.device == 0 and sent.bytes == size * n, sent
    assert sent.regions == [(t.ptr, size) for t in prefill_kv.values()], sent.regions
    landing = cuda_cache(list(decode_kv.values()), "LBHNC")
    assert landing.kv_format == "vllm-hnd" and landing.bytes == size * n, landing
    refused(lambda: cuda_cache(list(prefill_kv.values()), "BLHNC"), "has no kvferry format")
    refused(lambda: cuda_cache(list(prefill_kv.values()), None), "has no kvferry format")
    refused(lambda: cuda_cache(list(prefill_kv.values()), "LBHNC"), "is not a dense LBHNC layer")
    apart = dict(prefill_kv)
    apart["model.layers.1.self_attn.attn"] = Layer(1, shape, item, AXIS_ORDER["LBNHC"], device=1)
    refused(lambda: cuda_cache(list(apart.values()), "LBNHC"), "several CUDA devices")
    flat = {k: Layer(t.ptr, (PAGES, heads, BLOCK * shape[3]), item, (0, 1, 2)) for k, t in prefill_kv.items()}
    refused(lambda: cuda_cache(list(flat.values()), "LBNHC"), "is not vLLM's")

    prefill = kvferry.PrefillAgent(sent.regions, device=sent.device, **(base | dict(kv_format=sent.kv_format)))
    decode = kvferry.DecodeAgent(landing.regions, device=landing.device, **(base | dict(kv_format=landing.kv_format)))
    src, dst = [3, 4, 30], [9, 1, 2]
    decode.request(7, TOKENS, pages=dst)
    for layer in range(n):
        prefill.ready(7, TOKENS, pages=src, layer_range=(layer, layer + 1), last=layer == n - 1)
    done = decode.wait(7, 60)
    assert done["state"] == "success", done
    taken = decode.take(7)
    landed = 0
    for layer, t in enumerate(decode_kv.values()):
        got = physical(cuda.download(t.ptr, size), "LBHNC", heads, head_bytes)
        want = physical(sources[layer], "LBNHC", heads, head_bytes)
        expect = np.full_like(got, POISON)
        for i, (s, d) in enumerate(zip(src, dst)):
            rows = min(BLOCK, TOKENS - i * BLOCK)
            expect[d, :, :rows] = want[s, :, :rows]
            landed += expect[d, :, :rows].size
        if not (got == expect).all():
            bad = np.argwhere(got != expect)[0].tolist()
            raise AssertionError(f"layer {layer}: first wrong byte at [block, head, token, K|V, byte] {bad}")
    assert taken["bytes"] == landed, (taken, landed)
    prefill.close()
    decode.close()
    return landed


def mla(cuda: Cuda, dtype: str) -> int:
    """A room between MLA caches (format vllm-mla) of ``dtype``: the decode's token rows equal
    the prefill's, every other byte poison. Returns the bytes that landed."""
    width, layers = 576, 3
    item = 2 if dtype == "bf16" else 1
    base = options(sys.argv[1], kv_format="vllm-mla", pool_pages=PAGES, page_size=BLOCK, attention="mla",
                   layers=layers, kv_heads=1, head_dim=width, dtype=dtype)
    size = PAGES * BLOCK * width * item
    rng = np.random.default_rng(12)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(layers)]

    def caches(fill) -> dict:
        return device_caches(cuda, layers, size, fill, lambda p: Layer(p, (PAGES, BLOCK, width), item, (0, 1, 2)))

    prefill_kv = caches(lambda layer: sources[layer])
    decode_kv = caches(lambda layer: np.full(size, POISON, dtype=np.uint8))
    sent, landing = mla_cache(list(prefill_kv.values())), mla_cache(list(decode_kv.values()))
    assert sent.kv_format == "vllm-mla" and sent.device == 0 and sent.regions == [(t.ptr, size) for t in prefill_kv.values()]
    layout = kvferry.memory_layout(**base)
    assert layout["num_regions"] == layers and layout["region_bytes"] == size, layout
    strided = {k: Layer(t.ptr, (PAGES, BLOCK, width), item, (1, 0, 2)) for k, t in prefill_kv.items()}
    refused(lambda: mla_cache(list(strided.values())), "is not a dense layer")
    prefill = kvferry.PrefillAgent(sent.regions, device=sent.device, **base)
    decode = kvferry.DecodeAgent(landing.regions, device=landing.device, **base)
    src, dst = [5, 6, 20], [2, 31, 0]
    decode.request(8, TOKENS, pages=dst)
    prefill.ready(8, TOKENS, pages=src)
    done = decode.wait(8, 60)
    assert done["state"] == "success", done
    taken = decode.take(8)
    row = width * item
    landed = 0
    for layer, t in enumerate(decode_kv.values()):
        got = cuda.download(t.ptr, size).reshape(PAGES * BLOCK, row)
        want = sources[layer].reshape(PAGES * BLOCK, row)
        expect = np.full_like(got, POISON)
        for token in range(TOKENS):
            at = token // BLOCK
            expect[dst[at] * BLOCK + token % BLOCK] = want[src[at] * BLOCK + token % BLOCK]
            landed += row
        if not (got == expect).all():
            bad = np.argwhere(got != expect)[0].tolist()
            raise AssertionError(f"MLA layer {layer}: first wrong byte at [slot, byte] {bad}")
    assert taken["bytes"] == landed, (taken, landed)
    prefill.close()
    decode.close()
    return landed


if __name__ == "__main__":
    sys.exit(main())
