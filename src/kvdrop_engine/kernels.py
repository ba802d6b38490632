"""Triton kernels of the engine's GPU path (optional: ``pip install 'kvdrop[gpu]'``).

:func:`paged_decode` is attention of one new token per sequence over its paged KV cache, read in
place through the block table (no gathered copy): each program takes one (sequence, KV head,
split) and runs an online softmax over its share of the sequence's tokens for the ``G`` query
heads of that KV head at once (grouped-query attention without repeating K/V); a second kernel
merges the splits. Its cost is the bytes of K and V it must read, once.

:func:`rms_norm` and :func:`silu_mul` fuse the elementwise chains of the model's norms and MLP
into one pass each, with the same rounding as the plain PyTorch ops they replace.

Every kernel also runs on CPU tensors through Triton's interpreter, in a process started with
``TRITON_INTERPRET=1`` (Triton reads it when first imported): that is how CI, which has no GPU,
tests them. Without Triton the engine uses its plain PyTorch path (``available()`` is False).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = [
    "available",
    "decode_splits",
    "interpreted",
    "paged_decode",
    "rms_norm",
    "silu_mul",
]

_LOG2E = 1.4426950408889634


def available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA with Triton importable, or any
    device under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    if interpreted():
        return True
    return device is not None and torch.device(device).type == "cuda"


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def decode_splits(batch: int, kv_heads: int, device: torch.device | str | None = None) -> int:
    """Splits per sequence for :func:`paged_decode`: enough programs for every multiprocessor to
    hold several (memory-bound work needs loads in flight), between 8 and 32. Measured on an
    H200 (16 x 11K and 30 x 5.6K tokens, 8 KV heads): 8 splits were within 2% of the best."""
    sms = 132
    if device is not None and torch.device(device).type == "cuda":
        sms = _sm_count(torch.device(device).index or 0)
    want = max(1, math.ceil(4 * sms / max(1, batch * kv_heads)))
    return min(32, max(8, 1 << (want - 1).bit_length()))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


if triton is not None:

    def _decode_partial(
        Q,
        K,
        V,
        Table,
        Lens,
        Acc,
        M,
        L,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_tb,
        stride_ab,
        stride_ah,
        stride_as,
        stride_mb,
        stride_mh,
        scale_log2,
        splits,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        seq_len = tl.load(Lens + b)
        tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.cdiv(tiles, splits)
        t0 = s * per * BLOCK_N
        t1 = tl.minimum(t0 + per * BLOCK_N, seq_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None],
            other=0.0,
        )
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(t0, t1, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < t1
            page = tl.load(Table + b * stride_tb + n // PAGE, mask=nmask, other=0)
            off = page.to(tl.int64) * stride_kb + (n % PAGE) * stride_ks + kvh * stride_kh
            k = tl.load(K + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale_log2
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(
            Acc + b * stride_ab + heads[:, None] * stride_ah + s * stride_as + d[None, :],
            acc,
            mask=gmask[:, None],
        )
        tl.store(M + b * stride_mb + heads * stride_mh + s, m_i, mask=gmask)
        tl.store(L + b * stride_mb + heads * stride_mh + s, l_i, mask=gmask)

    def _decode_reduce(
        Acc,
        M,
        L,
        Out,
        stride_ab,
        stride_ah,
        stride_as,
        stride_mb,
        stride_mh,
        stride_ob,
        stride_oh,
        splits,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        smask = s < splits
        m = tl.load(M + b * stride_mb + h * stride_mh + s, mask=smask, other=float("-inf"))
        lsum = tl.load(L + b * stride_mb + h * stride_mh + s, mask=smask, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
        acc = tl.load(
            Acc + b * stride_ab + h * stride_ah + s[:, None] * stride_as + d[None, :],
            mask=smask[:, None],
            other=0.0,
        )
        out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))

    def _rms_norm(
        X,
        W,
        Y,
        stride_x,
        stride_y,
        n_cols,
        eps,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
        # As RMSNorm.forward: normalise in float32, round to the input dtype, then scale by the
        # weight (a product rounded to the output dtype).
        y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row.to(tl.int64) * stride_y + cols, (y * w).to(Y.dtype.element_ty), mask=mask)

    def _silu_mul(G, U, Y, n_cols, stride_g, stride_u, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        # As F.silu(gate) * up: silu rounded to the dtype, then the product rounded.
        act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * stride_y + cols, (act * u).to(Y.dtype.element_ty), mask=mask)

    _SOURCES = {
        "decode_partial": _decode_partial,
        "decode_reduce": _decode_reduce,
        "rms_norm": _rms_norm,
        "silu_mul": _silu_mul,
    }


@functools.cache
def _kernel(name: str) -> Any:
    """The kernel ``name`` (compiled for the GPU, or interpreted under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; pip install 'kvdrop[gpu]'")
    # Integer arguments equal to 1 or divisible by 16 get kernels of their own; the split count
    # changes with the batch size, and recompiling for it mid-run cost a second.
    return triton.jit(_SOURCES[name], do_not_specialize=_NO_SPECIALIZE.get(name, ()))


_NO_SPECIALIZE = {"decode_partial": ("splits",), "decode_reduce": ("splits",)}


def _opts(**launch: int) -> dict[str, int]:
    """Launch options, which the interpreter does not take."""
    return {} if interpreted() else launch


def _check_decode_shapes(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """``ValueError`` unless ``paged_decode`` can read these shapes and strides."""
    _, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d or hq % hkv or d & (d - 1) or d < 16:
        raise ValueError(
            f"paged_decode needs q [B, Hq, d] and caches [N, bs, Hkv, d] with Hq a multiple of "
            f"Hkv and d a power of two >= 16; got q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with contiguous rows")
    if page & (page - 1):
        raise ValueError(f"paged_decode needs a power-of-two block size, got {page}")


def _reduce_splits(acc: Tensor, m: Tensor, lsum: Tensor, out: Tensor) -> None:
    """Combine each head's ``splits`` partial softmaxes (``acc [B, Hq, splits, d]``, their maxima
    ``m`` and sums ``lsum``) into ``out [B, Hq, d]``: the second launch of ``paged_decode``."""
    bsz, hq, splits, d = acc.shape
    _kernel("decode_reduce")[(bsz, hq)](
        acc,
        m,
        lsum,
        out,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        m.stride(0),
        m.stride(1),
        out.stride(0),
        out.stride(1),
        splits,
        # At least 32 (the most decode_splits picks): one compiled reduce for every batch size.
        SPLITS_PAD=max(32, 1 << (splits - 1).bit_length()),
        HEAD_DIM=d,
        **_opts(num_warps=4),
    )


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    splits: int | None = None,
    out: Tensor | None = None,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Tensor:
    """Attention of ``q [B, Hq, d]`` (one token per sequence) over paged ``k_cache``/``v_cache``
    ``[num_blocks, block_size, Hkv, d]`` (one layer): sequence ``b`` reads its first
    ``seq_lens[b]`` tokens through ``block_table[b]`` (int32 block ids). Returns ``[B, Hq, d]``.

    ``seq_lens`` must be >= 1 for every row (a row with nothing to attend to has no softmax). The
    launch reads no host value, so it can be captured in a CUDA graph.
    """
    bsz, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    _check_decode_shapes(q, k_cache, v_cache)
    group = hq // hkv
    splits = splits or decode_splits(bsz, hkv, q.device)
    scale = d**-0.5 if scale is None else scale
    acc = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=q.device)
    m = torch.empty(bsz, hq, splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    if out is None:
        out = torch.empty_like(q)
    _kernel("decode_partial")[(bsz, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        acc,
        m,
        lsum,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        m.stride(0),
        m.stride(1),
        scale * _LOG2E,
        splits,
        GROUP=group,
        GROUP_PAD=max(16, 1 << (group - 1).bit_length()),
        HEAD_DIM=d,
        PAGE=page,
        BLOCK_N=max(block_n, 16),
        **_opts(num_warps=num_warps, num_stages=num_stages),
    )
    _reduce_splits(acc, m, lsum, out)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` over the last dim,
    in one pass (rows of ``x`` must be contiguous)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x2.shape[0]:
        block = 1 << (n - 1).bit_length()
        _kernel("rms_norm")[(x2.shape[0],)](
            x2,
            weight,
            y,
            x2.stride(0),
            y.stride(0),
            n,
            eps,
            BLOCK=block,
            **_opts(num_warps=8 if block >= 2048 else 4),
        )
    return y.view(*x.shape[:-1], n)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` (same shapes, rows contiguous) in one pass."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    y = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if g.shape[0]:
        block = 1024
        grid = (g.shape[0], triton.cdiv(n, block))
        _kernel("silu_mul")[grid](
            g, u, y, n, g.stride(0), u.stride(0), y.stride(0), BLOCK=block, **_opts(num_warps=4)
        )
    return y.view(gate.shape)
