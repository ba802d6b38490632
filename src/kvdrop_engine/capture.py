"""Lean query capture: the query rows of one request that the drop policies can use.

Storing every prompt token's post-RoPE query costs ``Hq / (2 * Hkv)`` times the KV (2x for
Qwen3-8B), yet SnapKV, TOVA and R-KV read only the queries of the last 16-64 tokens and H2O a
strided sample. :class:`WindowCapture` keeps exactly those for one request while it runs:

* the last ``window`` computed positions of the WHOLE sequence: the prompt's last tokens (its
  uncached tail included) and then every generated token that was fed back (decode steps), so a
  second edit after decoding observes the latest tokens;
* the positions that are multiples of ``stride`` (a strided sample over everything computed).

Each row comes with its attention log-normalisers (per query head, the log-sum-exp of its logits
over every key it attended to, the keys of the uncached tail included), so a policy that scores
the cached keys with it gets the row's true attention probabilities there.

Rows of positions the engine did not compute (a prefix loaded from the cache) are not available.
At the end of the request the rows go to the kvdrop server as one record keyed by the request's
model, salt and token ids (:mod:`kvdrop_sdk.window`). Rows stay on the model's device until then.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

__all__ = ["WindowCapture"]


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
        # (position, query [L, Hq, d], log-normalisers [L, Hq])
        self._recent: deque[tuple[int, Tensor, Tensor]] = deque()
        self._sampled: list[tuple[int, Tensor, Tensor]] = []
        self.last = -1

    def wanted(self, start: int, num_new: int) -> list[int]:
        """Offsets in ``0..num_new-1`` of the positions ``start..start+num_new-1`` to capture."""
        end = start + num_new
        keep = set(range(max(start, self.num_prompt - self.window), end))
        if self.stride:
            first = -(-start // self.stride) * self.stride
            keep.update(range(first, end, self.stride))
        return sorted(p - start for p in keep)

    def add(self, positions: list[int], rows: Tensor, lse: Tensor) -> None:
        """Keep ``rows`` ``[L, r, Hq, d]`` and their log-normalisers ``lse`` ``[L, r, Hq]`` of
        ``positions`` (increasing, after every earlier one); rows that leave the window are
        dropped unless they are strided samples."""
        if not positions:
            return
        if (
            positions[0] <= self.last
            or len(positions) != rows.shape[1]
            or lse.shape[:2] != rows.shape[:2]
        ):
            raise ValueError("captured rows must come in position order, one per position")
        rows = rows.detach().clone()  # a private copy: the step's capture buffer is shared
        lse = lse.detach().clone()
        for i, p in enumerate(positions):
            self._recent.append((p, rows[:, i], lse[:, i]))
        self.last = positions[-1]
        while self._recent and self._recent[0][0] <= self.last - self.window:
            p, row, norm = self._recent.popleft()
            if self.stride and p % self.stride == 0:
                self._sampled.append((p, row.clone(), norm.clone()))

    @property
    def num_rows(self) -> int:
        return len(self._sampled) + len(self._recent)

    def record(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(positions [R] int64, queries [1, L, R, Hq*d], lse [1, L, R, Hq] float32)`` on the
        CPU, or None when empty."""
        kept = self._sampled + list(self._recent)
        if not kept:
            return None
        positions = torch.tensor([p for p, _, _ in kept], dtype=torch.int64)
        q = torch.stack([row for _, row, _ in kept], dim=1)  # [L, R, Hq, d]
        q = q.reshape(q.shape[0], q.shape[1], -1).unsqueeze(0)
        lse = torch.stack([norm for _, _, norm in kept], dim=1).unsqueeze(0)  # [1, L, R, Hq]
        return positions, q.to("cpu"), lse.to(device="cpu", dtype=torch.float32)
