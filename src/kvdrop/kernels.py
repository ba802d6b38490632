"""Triton kernels of the policies' GPU path (optional: ``pip install 'kvdrop[gpu]'``).

:func:`similarity_row_max` is the filter of R-KV's exact redundancy scan
(:func:`kvdrop.attention.key_redundancy`): for every key ``i`` of a head, the largest cosine
``kn_i . kn_j`` over the keys ``j`` of one column block (``j != i``), from float16 keys with
float32 accumulation. The plain PyTorch filter writes the whole ``[H, T, block]`` product to memory
and reads it back for its maximum; this kernel keeps each tile in registers and writes one value
per row, so the scan costs its multiplications only.

Like the engine's kernels (:mod:`kvdrop_engine.kernels`), it runs on CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1`` when Triton is first imported): that is how CI tests it.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["available", "interpreted", "similarity_row_max"]


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def available(kn16: Tensor) -> bool:
    """Whether :func:`similarity_row_max` takes ``kn16``: float16 ``[H, T, d]`` with a power-of-two
    ``16 <= d <= 256``, on CUDA with Triton importable (or any device under the interpreter)."""
    if triton is None or kn16.dtype != torch.float16 or kn16.dim() != 3:
        return False
    d = kn16.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        return False
    return interpreted() or kn16.device.type == "cuda"


if triton is not None:

    @triton.jit
    def _row_max_kernel(
        k_ptr,
        out_ptr,
        num_keys,
        c0,
        c1,
        stride_h,
        stride_t,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D: tl.constexpr,
    ):
        """One program: ``BLOCK_M`` rows of one head against columns ``c0 .. c1-1``."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        head = tl.program_id(1).to(tl.int64)
        dims = tl.arange(0, D)
        base = k_ptr + head * stride_h
        q = tl.load(
            base + rows[:, None].to(tl.int64) * stride_t + dims[None, :],
            mask=rows[:, None] < num_keys,
            other=0.0,
        )
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for start in range(c0, c1, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            k = tl.load(
                base + cols[:, None].to(tl.int64) * stride_t + dims[None, :],
                mask=cols[:, None] < c1,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k))  # float32 accumulation
            hidden = (cols[None, :] >= c1) | (cols[None, :] == rows[:, None])
            s = tl.where(hidden, float("-inf"), s)
            best = tl.maximum(best, tl.max(s, axis=1))
        tl.store(out_ptr + head * num_keys + rows, best, mask=rows < num_keys)


def similarity_row_max(kn16: Tensor, c0: int, c1: int) -> Tensor:
    """``[H, T]`` float32: per head and key ``i``, ``max_j kn16_i . kn16_j`` over ``c0 <= j < c1``,
    ``j != i`` (``-inf`` when no such ``j``). Only for tensors :func:`available` accepts."""
    if not available(kn16):
        raise ValueError("similarity_row_max needs float16 [H, T, d] (d a power of two) on CUDA")
    kn16 = kn16.contiguous()
    num_heads, num_keys, head_dim = kn16.shape
    out = torch.empty(num_heads, num_keys, dtype=torch.float32, device=kn16.device)
    block_m = 128 if head_dim <= 128 else 64
    grid = (triton.cdiv(num_keys, block_m), num_heads)
    _row_max_kernel[grid](
        kn16,
        out,
        num_keys,
        c0,
        c1,
        kn16.stride(0),
        kn16.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=64,
        D=head_dim,
        num_warps=8,
        num_stages=2,
    )
    return out
