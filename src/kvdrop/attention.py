"""Attention of a set of saved queries over the cached keys, in float32, in linear memory.

Every query-based policy (SnapKV, H2O, TOVA, R-KV) needs the same thing: how much softmax
attention each cached key receives from some of the prefill queries. :func:`attention_mass`
computes it block by block over the queries: a block of ``b`` queries against the keys it can see
is a ``[Hq, b, T]`` float32 tile whose rows are complete, so the softmax is exact in one pass and
the ``T x T`` matrix is never built. ``b`` is picked so the tile stays under ``block_bytes``
(at least one query per block), so memory is linear in ``T`` for any number of queries.

Layouts follow the SDK: a layer's keys are ``[T, Hkv * d]`` and its queries ``[T, Hq * d]``,
heads head-major inside the last dimension. Query head ``h`` reads KV head ``h // G`` with
``G = Hq // Hkv`` (the HF ``repeat_kv`` convention).

The same module holds the blocked cosine-redundancy of R-KV (:func:`key_redundancy`), which is
quadratic in compute but linear in memory, and equals the quadratic reference exactly.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from kvdrop import kernels

__all__ = [
    "BF16_FILTER_MARGIN",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_TILE_BYTES",
    "attention_mass",
    "fast_bf16_matmul",
    "fp16_filter_margin",
    "heads_f32",
    "key_redundancy",
    "pool1d",
    "unit_keys",
]

#: Upper bound of one float32 score tile (per query block); 64 MiB keeps caches warm on CPU.
DEFAULT_BLOCK_BYTES = 64 << 20


def heads_f32(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[T, H * d]`` (any float dtype) as a contiguous float32 ``[H, T, d]`` copy in one pass."""
    num_tokens, width = x.shape
    num_heads = width // head_dim
    out = torch.empty(num_heads, num_tokens, head_dim, dtype=torch.float32, device=x.device)
    out.copy_(x.view(num_tokens, num_heads, head_dim).transpose(0, 1))
    return out


def attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed softmax attention each key receives from the queries: ``[Hq, Tk]`` float32.

    ``q`` is ``[Hq, n, d]`` and ``k`` is ``[Hkv, Tk, d]`` (float32, see :func:`heads_f32`), with
    ``Hq`` a multiple of ``Hkv``. ``q_pos`` (``[n]`` int) holds each query's position in the key
    sequence; with ``causal`` a query at position ``p`` sees keys ``0..p`` only (a query at
    ``p >= Tk`` sees all keys). Without ``q_pos`` every query sees every key. ``scale`` defaults
    to ``1 / sqrt(d)``. Each query's softmax row sums to 1, so the result sums to ``n`` per head.

    ``lse`` (``[Hq, n]``, optional) is each query's log-normaliser over ALL the keys it attended
    to, some of which may be missing from ``k`` (an uncached tail): its probabilities are then
    ``exp(logit - lse)``, its true attention, and its row sums to the share that went to ``k``.
    A NaN entry falls back to the softmax over ``k``.
    """
    num_q_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys, _ = k.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} are not a multiple of KV heads {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(num_q_heads, num_keys, dtype=torch.float32, device=k.device)
    if num_queries == 0 or num_keys == 0:
        return out
    if q_pos is None or not causal:
        q_pos = torch.full((num_queries,), num_keys - 1, dtype=torch.int64)
    q_pos = q_pos.to(torch.int64).cpu().clamp(max=num_keys - 1)
    block = max(1, block_bytes // (4 * num_q_heads * num_keys))
    if causal:  # smaller blocks let early queries skip the keys they cannot see
        block = min(block, 64)
    ones = torch.ones(num_q_heads, 1, min(block, num_queries), dtype=torch.float32, device=k.device)
    if lse is not None:
        lse = lse.to(device=k.device, dtype=torch.float32).reshape(num_q_heads, num_queries)
    for start in range(0, num_queries, block):
        pos = q_pos[start : start + block]
        b = pos.numel()
        limit = int(pos.max()) + 1  # keys past the last visible one get no mass
        qb = q[:, start : start + b].to(torch.float32) * scale
        qb = qb.reshape(num_kv_heads, group * b, head_dim)
        s = torch.matmul(qb, k[:, :limit].transpose(1, 2))  # [Hkv, G*b, limit]
        first_hidden = int(pos.min()) + 1
        if first_hidden < limit:  # only keys after the earliest query's position can be hidden
            cols = torch.arange(first_hidden, limit)
            hidden = (cols[None, :] > pos[:, None]).to(k.device)  # [b, limit - first_hidden]
            s.view(num_kv_heads, group, b, limit)[..., first_hidden:].masked_fill_(
                hidden, -torch.inf
            )
        if lse is None:
            p = torch.softmax(s, dim=-1).view(num_q_heads, b, limit)
        else:
            norm = lse[:, start : start + b]  # [Hq, b]
            p = torch.exp(s.view(num_q_heads, b, limit) - norm.nan_to_num(0.0)[..., None])
            unknown = torch.isnan(norm)
            if bool(unknown.any()):
                soft = torch.softmax(s, dim=-1).view(num_q_heads, b, limit)
                p = torch.where(unknown[..., None], soft, p)
        # Sum over the block's queries as a batched mat-vec (faster than a strided reduction).
        out[:, :limit] += torch.bmm(ones[:, :, :b], p).squeeze(1)
    return out


def pool1d(x: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """Same-size 1-D pooling of ``[..., T]`` over T (odd ``kernel``, padding ``kernel // 2``).

    ``avg`` counts the zero padding (``count_include_pad``, as SnapKV's ``avg_pool1d``); ``max``
    ignores it. ``kernel == 1`` returns ``x``.
    """
    if kernel == 1 or x.shape[-1] == 0:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if how == "avg":
        pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=pad)
    elif how == "max":
        # max_pool1d needs padding <= kernel/2, which holds; it pads with -inf.
        pooled = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        raise ValueError(f"unknown pooling {how!r}; expected 'avg' or 'max'")
    return pooled.view(shape)


def unit_keys(k: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Keys divided by ``(||k|| + eps)`` as R-KV does (float32 ``[H, T, d]``)."""
    return k / (k.norm(dim=-1, keepdim=True) + eps)


#: Bound on |S_bf16 - S| for unit-norm keys: bf16 inputs (2u + u^2 with u = 2^-8, by
#: Cauchy-Schwarz), float32 accumulation (~d * 2^-24) and the bf16 output (u * |S|) add up to
#: < 0.012; 0.02 leaves room. A bf16 value below ``threshold - margin`` proves S <= threshold.
BF16_FILTER_MARGIN = 0.02


@functools.cache
def fast_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 / AMX), so a bf16 pre-filter pays."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fp16_filter_margin(head_dim: int) -> float:
    """Bound on |S_fp16 - S| for unit-norm keys of ``head_dim`` through a float16 matmul.

    Rounding the inputs costs ``2u + u^2`` (``u = 2^-11``; Cauchy-Schwarz bounds the sum of
    ``|a_i b_i|`` by 1), any order of float16 accumulation at most ``gamma_d = d u / (1 - d u)``
    (cuBLAS may reduce in float16), the float16 output ``u (1 + |S|)``. 0.071 at d = 128.
    """
    u = 2.0**-11
    return 2 * u + u * u + head_dim * u / (1 - head_dim * u) + 3 * u


#: Bytes of one float32 similarity tile of the all-rows scan (heads x T x col_block).
DEFAULT_TILE_BYTES = 1 << 30


def key_redundancy(
    kn: torch.Tensor,
    threshold: float = 0.5,
    *,
    row_block: int = 512,
    col_block: int = 1024,
    bf16_filter: bool | None = None,
    all_rows: bool | None = None,
    tile_bytes: int = DEFAULT_TILE_BYTES,
) -> torch.Tensor:
    """R-KV redundancy of every key, ``[H, T]`` float32 (softmax over T per head).

    With ``S = kn @ kn.T`` per head (``kn`` from :func:`unit_keys`), R-KV zeroes the diagonal,
    then in each row ``i`` zeroes the entry of the LAST column ``j`` with ``S[i, j] > threshold``
    (column 0 when there is none -- upstream's ``argmax`` of an all-zero index row), takes the mean
    over rows and a softmax over keys. Here the column sums come from ``(sum_i kn_i) . kn_j``
    minus the diagonal and the zeroed entries; only the last similar column of each row needs
    ``S``, found by scanning column blocks from the right. Compute is ``O(T^2 d)`` in the worst
    case (no similar keys), memory linear in ``T``; the result equals the quadratic form.

    Two scans (same result): ``all_rows`` (default on a GPU) takes every row of a group of heads
    per column block, multiplies in float16 as a filter and recomputes in float32 only the rows
    the filter cannot rule out (:func:`fp16_filter_margin`), a few large launches; otherwise row
    blocks of ``row_block`` stop as soon as each row has its hit, with a bf16 pre-filter where
    the CPU multiplies bf16 natively (``bf16_filter``).
    """
    num_heads, num_keys, _ = kn.shape
    col_sum = torch.einsum("hd,htd->ht", kn.sum(dim=1), kn)
    col_sum -= torch.einsum("htd,htd->ht", kn, kn)  # the zeroed diagonal (no [H, T, d] temp)
    if all_rows is None:
        all_rows = kn.device.type != "cpu"
    if all_rows:
        last = _last_similar_all_rows(kn, threshold, col_block, tile_bytes)
    else:
        last = _last_similar_row_blocks(kn, threshold, row_block, col_block, bf16_filter)
    # The entry each row zeroes, S[i, last[i]] (0 when last[i] == i: the diagonal).
    row_index = torch.arange(num_keys, device=kn.device)
    zeroed = torch.empty(num_heads, num_keys, dtype=torch.float32, device=kn.device)
    for h0 in range(0, num_heads, 8):  # a gathered copy of 8 heads' keys at a time
        part = last[h0 : h0 + 8]
        partner = torch.gather(kn[h0 : h0 + 8], 1, part[..., None].expand(-1, -1, kn.shape[-1]))
        entry = (kn[h0 : h0 + 8] * partner).sum(dim=-1)
        zeroed[h0 : h0 + 8] = torch.where(part == row_index, 0.0, entry)
    # Subtract each row's zeroed entry from the column it sits in.
    col_sum.scatter_add_(1, last, -zeroed)
    return torch.softmax(col_sum / num_keys, dim=-1)


def _last_hit_diagonal(last: torch.Tensor, found: torch.Tensor, threshold: float) -> torch.Tensor:
    """With ``threshold < 0`` the zeroed diagonal (0 > threshold) is itself a hit of every row."""
    if threshold >= 0:
        return last
    row_index = torch.arange(last.shape[1], device=last.device)
    return torch.where(found, torch.maximum(last, row_index), row_index)


def _last_similar_row_blocks(
    kn: torch.Tensor, threshold: float, row_block: int, col_block: int, bf16_filter: bool | None
) -> torch.Tensor:
    """``[H, T]`` last column ``j != i`` with ``S[i, j] > threshold`` (0 if none), by row blocks."""
    num_heads, num_keys, _ = kn.shape
    last = torch.zeros(num_heads, num_keys, dtype=torch.int64, device=kn.device)
    found_all = torch.zeros(num_heads, num_keys, dtype=torch.bool, device=kn.device)
    if bf16_filter is None:
        bf16_filter = kn.device.type == "cpu" and fast_bf16_matmul()
    kn_bf16 = kn.to(torch.bfloat16) if bf16_filter else None
    for r0 in range(0, num_keys, row_block):
        rows = kn[:, r0 : r0 + row_block]
        nr = rows.shape[1]
        found = found_all[:, r0 : r0 + nr]
        hit_col = last[:, r0 : r0 + nr]
        c1 = num_keys
        while c1 > 0 and not bool(found.all()):
            c0 = max(0, c1 - col_block)
            lo, hi = max(r0, c0), min(r0 + nr, c1)
            diag = torch.arange(lo, max(lo, hi), device=kn.device)  # empty unless it crosses
            if kn_bf16 is not None:
                rough = torch.matmul(kn_bf16[:, r0 : r0 + nr], kn_bf16[:, c0:c1].transpose(1, 2))
                rough[:, diag - r0, diag - c0] = -torch.inf
                maybe = rough.amax(dim=-1).float() > threshold - BF16_FILTER_MARGIN
                if not bool((maybe & ~found).any()):
                    c1 = c0
                    continue
            sim = torch.matmul(rows, kn[:, c0:c1].transpose(1, 2))  # [H, nr, c1 - c0]
            sim[:, diag - r0, diag - c0] = -torch.inf  # the diagonal never counts as similar
            # One cheap pass finds the rows with a hit; only those are searched for the last one.
            new = (sim.amax(dim=-1) > threshold) & ~found
            if bool(new.any()):
                hh, rr = new.nonzero(as_tuple=True)
                similar = sim[hh, rr] > threshold  # [hits, c1 - c0]
                last_in_block = (c1 - c0 - 1) - similar.flip(-1).to(torch.uint8).argmax(dim=-1)
                hit_col[hh, rr] = last_in_block + c0
                found[hh, rr] = True
            c1 = c0
    return _last_hit_diagonal(last, found_all, threshold)


def _last_similar_all_rows(
    kn: torch.Tensor, threshold: float, col_block: int, tile_bytes: int
) -> torch.Tensor:
    """Same as :func:`_last_similar_row_blocks`, every row of a group of heads per column block.

    A float16 product of the block rules out the rows whose every entry is below ``threshold``
    minus :func:`fp16_filter_margin` (its row maxima come from the fused
    :func:`kvdrop.kernels.similarity_row_max` where Triton runs, else from a ``[h, T, block]``
    product); the rest (all rows, at worst) are multiplied again in float32 and decided exactly.
    The group's tiles stay under ``tile_bytes``.
    """
    num_heads, num_keys, head_dim = kn.shape
    last = torch.zeros(num_heads, num_keys, dtype=torch.int64, device=kn.device)
    found = torch.zeros(num_heads, num_keys, dtype=torch.bool, device=kn.device)
    rough_below = threshold - fp16_filter_margin(head_dim)
    kn16 = kn.to(torch.float16)
    width = min(col_block, max(num_keys, 1))
    group = max(1, tile_bytes // (4 * max(num_keys, 1) * width))
    for h0 in range(0, num_heads, group):
        heads = slice(h0, h0 + group)
        _scan_columns(
            kn[heads], kn16[heads], threshold, rough_below, width, last[heads], found[heads]
        )
    return _last_hit_diagonal(last, found, threshold)


def _scan_columns(
    kn: torch.Tensor,
    kn16: torch.Tensor,
    threshold: float,
    rough_below: float,
    width: int,
    last: torch.Tensor,
    found: torch.Tensor,
) -> None:
    """Fill ``last``/``found`` (``[h, T]``) in place for a group of heads, right to left."""
    num_keys, head_dim = kn.shape[1], kn.shape[2]
    c1 = num_keys
    while c1 > 0:
        c0 = max(0, c1 - width)
        diag = torch.arange(c0, c1, device=kn.device)
        best = _fused_row_max(kn16, c0, c1)  # the row maxima straight from a fused kernel
        if best is None:
            rough = torch.matmul(kn16, kn16[:, c0:c1].transpose(1, 2))  # [h, T, c1 - c0]
            rough[:, diag, diag - c0] = -torch.inf  # the diagonal never counts as similar
            best = rough.amax(dim=-1)
            del rough
        todo = (best > rough_below) & ~found
        counts = todo.sum(dim=-1)
        most, left = torch.stack([counts.max(), (~found).sum()]).tolist()  # the block's one sync
        if not left:
            return
        if most:
            # Per head, the rows to decide first (a stable sort keeps them in order), padded.
            order = torch.argsort(todo.to(torch.int8), dim=-1, descending=True, stable=True)
            order = order[:, :most]
            valid = torch.arange(most, device=kn.device) < counts[:, None]
            rows = torch.gather(kn, 1, order[..., None].expand(-1, -1, head_dim))
            sim = torch.matmul(rows, kn[:, c0:c1].transpose(1, 2))  # [h, most, c1 - c0] float32
            sim.masked_fill_(order[..., None] == diag, -torch.inf)
            similar = sim > threshold
            del sim
            hit = similar.any(dim=-1) & valid
            col = (c1 - 1) - similar.flip(-1).to(torch.uint8).argmax(dim=-1)
            last.scatter_(1, order, torch.where(hit, col, last.gather(1, order)))
            found.scatter_(1, order, found.gather(1, order) | hit)
        c1 = c0


_KERNEL_FAILED: list[BaseException] = []


def _fused_row_max(kn16: torch.Tensor, c0: int, c1: int) -> torch.Tensor | None:
    """:func:`kvdrop.kernels.similarity_row_max`, or None where it cannot run; a kernel that
    fails (a Triton that cannot compile it here) is logged once and not tried again."""
    if _KERNEL_FAILED or not kernels.available(kn16):
        return None
    try:
        return kernels.similarity_row_max(kn16, c0, c1)
    except Exception as exc:  # compile or launch failure: the PyTorch filter is exact too
        _KERNEL_FAILED.append(exc)
        logging.getLogger("kvdrop.attention").warning(
            "the fused similarity kernel failed (%r); using the PyTorch filter", exc
        )
        return None
