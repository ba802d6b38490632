"""Lean query capture: the query rows of one request that the drop policies can use.

Storing every prompt token's post-RoPE query costs ``Hq / (2 * Hkv)`` times the KV (2x for
Qwen3-8B), yet SnapKV, TOVA and R-KV read only the queries of the last 16-64 tokens and H2O a
strided sample. :class:`WindowCapture` keeps exactly those for one request while it runs:

* the last ``window`` computed positions of the WHOLE sequence: the prompt's last tokens (its
  uncached tail included) and then every generated token that was fed back (decode steps), so a
  second edit after decoding observes the latest tokens;
* the positions that are multiples of ``stride`` (a strided sample over everything computed).

When the request ends, :func:`log_normalisers` adds each row's attention log-normalisers (per
layer and query head, the log-sum-exp of its scaled logits over every key it attended to, the keys
of the uncached tail included), read once from the request's own KV before its blocks are freed:
with them a policy that scores the cached keys gets the row's true attention probabilities there.
Computing them at the end (not at every step) keeps decode steps free of that work.

Rows of positions the engine did not compute (a prefix loaded from the cache) are not available.
The rows go to the kvdrop server as one record keyed by the request's model, salt and token ids
(:mod:`kvdrop_sdk.window`). They stay on the model's device until then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["LSE_TILE_BYTES", "WindowCapture", "log_normalisers"]

#: Bound of one float32 logits tile in :func:`log_normalisers` (rows are blocked under it); on a
#: GPU four times this (fewer, larger launches: a request's whole window in one tile per layer).
LSE_TILE_BYTES = 64 << 20


class WindowCapture:
    """The rows one request keeps: last ``window`` computed positions + multiples of ``stride``.

    ``num_prompt`` is the request's prompt length: positions ``>= num_prompt`` are decode steps
    (always captured, they are the newest). ``stride`` 0 keeps no strided sample.
    """

    def __init__(self, num_prompt: int, window: int, stride: int) -> None:
        if window < 1 or stride < 0 or num_prompt < 1:
            raise ValueError(
                f"window >= 1, stride >= 0 and num_prompt >= 1 expected, got {window}, {stride}, "
                f"{num_prompt}"
            )
        self.num_prompt = num_prompt
        self.window = window
        self.stride = stride
        self._recent: deque[tuple[int, Tensor]] = deque()  # (position, query [L, Hq, d])
        self._sampled: list[tuple[int, Tensor]] = []
        self.last = -1

    def wanted(self, start: int, num_new: int) -> list[int]:
        """Offsets in ``0..num_new-1`` of the positions ``start..start+num_new-1`` to capture."""
        end = start + num_new
        keep = set(range(max(start, self.num_prompt - self.window), end))
        if self.stride:
            first = -(-start // self.stride) * self.stride
            keep.update(range(first, end, self.stride))
        return sorted(p - start for p in keep)

    def add(self, positions: list[int], rows: Tensor) -> None:
        """Keep ``rows`` ``[L, r, Hq, d]`` of ``positions`` (increasing, after every earlier
        one); rows that leave the window are dropped unless they are strided samples."""
        if not positions:
            return
        if positions[0] <= self.last or len(positions) != rows.shape[1]:
            raise ValueError("captured rows must come in position order, one per position")
        rows = rows.detach().clone()  # a private copy: the step's capture buffer is shared
        for i, p in enumerate(positions):
            self._recent.append((p, rows[:, i]))
        self.last = positions[-1]
        while self._recent and self._recent[0][0] <= self.last - self.window:
            p, row = self._recent.popleft()
            if self.stride and p % self.stride == 0:
                self._sampled.append((p, row.clone()))

    @property
    def num_rows(self) -> int:
        return len(self._sampled) + len(self._recent)

    def rows(self) -> tuple[Tensor, Tensor] | None:
        """``(positions [R] int64 CPU, queries [L, R, Hq, d])`` on the model's device, or None."""
        kept = self._sampled + list(self._recent)
        if not kept:
            return None
        positions = torch.tensor([p for p, _ in kept], dtype=torch.int64)
        return positions, torch.stack([row for _, row in kept], dim=1)


def log_normalisers(
    queries: Tensor, positions: Tensor, keys: Callable[[int], Tensor], scale: float
) -> Tensor:
    """``[L, R, Hq]`` float32: per layer, row and query head, ``logsumexp`` of the row's scaled
    logits ``q . k * scale`` over the keys at positions ``0..p`` (``p`` the row's position).

    ``queries`` is ``[L, R, Hq, d]``; ``keys(layer)`` returns that layer's keys ``[N, Hkv, d]``
    of positions ``0..N-1`` with ``N > max(positions)``. Float32 math (logits from
    :func:`_products`, scaled after the product). Rows are taken in position
    order, in blocks that read only the keys their last row sees (a strided sample's early rows
    skip most of the sequence) and whose logits tile stays under :data:`LSE_TILE_BYTES`; the
    logsumexp runs in place on that tile (no masked copy, no temporaries of its size).
    """
    num_layers, num_rows, num_q_heads, head_dim = queries.shape
    out = torch.empty(num_layers, num_rows, num_q_heads, dtype=torch.float32, device=queries.device)
    order = torch.argsort(positions.to("cpu", torch.int64), stable=True)
    pos = positions.to("cpu", torch.int64)[order]
    tile = LSE_TILE_BYTES * (4 if queries.is_cuda else 1)
    blocks = []  # (row indices on the device, their positions, keys the last one sees)
    i = 0
    while i < num_rows:
        limit = int(pos[min(num_rows, i + 64) - 1]) + 1
        j = min(num_rows, i + max(1, min(64, tile // (4 * num_q_heads * limit))))
        blocks.append((order[i:j], pos[i:j], int(pos[j - 1]) + 1))
        i = j
    # Each block's rows, positions and hidden-key mask on the device once, not per layer: a
    # host-to-device copy inside the loop would wait for the device every layer.
    dev = queries.device
    blocks = [
        (
            _to_device(rows, dev),
            row_pos,
            limit,
            _to_device(torch.arange(int(row_pos[0]) + 1, limit)[None, :] > row_pos[:, None], dev),
        )
        for rows, row_pos, limit in blocks
    ]
    for layer in range(num_layers):
        k = keys(layer)
        num_kv_heads = k.shape[1]
        group = num_q_heads // num_kv_heads
        kh = k.permute(1, 2, 0)  # [Hkv, d, N], the model's dtype
        for rows, row_pos, limit, hidden in blocks:
            r = rows.numel()
            q = queries[layer].index_select(0, rows)  # [r, Hq, d]
            qh = q.view(r, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
            logits = _products(qh.reshape(num_kv_heads, r * group, head_dim), kh[..., :limit])
            logits = logits.mul_(scale).view(num_kv_heads, r, group, limit)
            first_hidden = int(row_pos[0]) + 1
            if first_hidden < limit:  # only keys after the block's first row can be hidden
                logits[..., first_hidden:].masked_fill_(hidden[None, :, None, :], -torch.inf)
            peak = logits.amax(dim=-1, keepdim=True)  # every row sees key 0: finite
            total = logits.sub_(peak).exp_().sum(dim=-1)
            lse = (peak.squeeze(-1) + total.log_()).permute(1, 0, 2).reshape(r, num_q_heads)
            out[layer].index_copy_(0, rows, lse)
    return out


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; to a GPU through page-locked memory, asynchronously (a pageable copy
    would wait for the device, so the windows of one step could not be queued back to back)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _products(q: Tensor, k: Tensor) -> Tensor:
    """``q @ k`` in float32. bf16/fp16 inputs on a GPU multiply on the tensor cores with a
    float32 result (their products are exact in float32, the sums accumulate in float32), about
    ten times the rate of a float32 product; elsewhere the inputs are upcast first."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype:
        try:
            return torch.bmm(q, k, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # a torch without bmm(out_dtype=): the float32 product below
    return torch.matmul(q.to(torch.float32), k.to(torch.float32))
