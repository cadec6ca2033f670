"""A stand-in for the ``sgl_kernel`` module, for tests only: this is NOT SGLang's kernel library.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports ``sgl_kernel`` unconditionally, and
no wheel on PyPI ships its CPU ops (``sgl-kernel`` there is a CUDA build). The tests put this
directory on ``PYTHONPATH`` so that SGLang can serve a tiny fp32 Llama on a CPU-only machine:

- ``assign_req_to_token_pool_cpu`` is implemented here in plain torch (slow, but exact);
- the names in ``IMPORTED_NOT_IMPLEMENTED`` are imported by SGLang at start-up but not called
  on the tiny-Llama path; they are defined so that the imports succeed, and raise
  ``NotImplementedError`` naming themselves if they are ever called;
- any other name raises ``AttributeError`` naming it (``from sgl_kernel import X`` then fails
  with ``ImportError``), so that code which tests for an op finds it absent.

Nothing here registers ``torch.ops.sgl_kernel``: SGLang then sees no AMX kernels and keeps to
its torch-native paths. Never ship this module in a package.
"""

from __future__ import annotations

import torch

STAND_IN = True  # lets a test assert that it runs against this module, not the real one


def _not_here(name: str) -> str:
    return (
        f"sgl_kernel.{name} is not implemented: this 'sgl_kernel' is kvferry's test-only stand-in "
        f"({__file__}), not SGLang's kernel library; it implements only assign_req_to_token_pool_cpu"
    )


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table.

    For request i of the batch, ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``
    receives the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``, which
    holds the batch's slots back to back in request order. ``pool_len`` is the row length of
    ``req_to_token``. In place; returns nothing.
    """
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: req_to_token of shape {tuple(req_to_token.shape)} "
                         f"does not have rows of pool_len={pool_len}")
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    if not len(rows) == len(starts) == len(ends):
        raise ValueError("assign_req_to_token_pool_cpu: req_pool_indices, start_offset and end_offset "
                         f"differ in length ({len(rows)}, {len(starts)}, {len(ends)})")
    at = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n <= 0:
            continue
        if start < 0 or end > pool_len or at + n > out_cache_loc.numel():
            raise IndexError(f"assign_req_to_token_pool_cpu: request row {row} [{start}:{end}) with "
                             f"{out_cache_loc.numel() - at} slots left is out of range (pool_len={pool_len})")
        req_to_token[row, start:end] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


# Names that SGLang 0.5.23 imports from sgl_kernel at module level when its CPU engine starts,
# but never calls when serving a plain Llama (speculative decoding and KV moves between slots).
# Each is defined so that the import succeeds; calling one raises NotImplementedError naming it.
IMPORTED_NOT_IMPLEMENTED = (
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py
    "build_tree_kernel_efficient_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "verify_tree_greedy_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "assign_draft_cache_locs_contiguous_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "assign_extend_cache_locs_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "fill_accept_out_cache_loc_cpu",  # sglang/kernels/ops/speculative/eagle.py
    "fill_bonus_tokens_cpu",  # sglang/kernels/ops/speculative/eagle.py
)


def _placeholder(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(_not_here(name))

    op.__name__ = op.__qualname__ = name
    op.__doc__ = "Not implemented by this test-only stand-in: calling it raises NotImplementedError."
    return op


globals().update({name: _placeholder(name) for name in IMPORTED_NOT_IMPLEMENTED})


def __getattr__(name: str):
    """Any name not defined above: an ``AttributeError`` that says what this module is."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise AttributeError(_not_here(name))
