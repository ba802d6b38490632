"""The cut while decoding on one dense cache: the offline reference of the engine's, and what
``kvdrop eval --decode-budget`` measures with.

:class:`DenseDecode` feeds one sequence through the model on a contiguous
:class:`~kvdrop_engine.model.DenseAttention` cache and applies a
:class:`~kvdrop_engine.decode_cut.DecodeCut` at the points the engine does: before a token
would make the cache pass ``budget + every`` (and, for a policy that reads queries, once a row
was computed since the last cut), the same policy call (:meth:`DecodeCompressor.select`) on the
same inputs (the rows' true positions, the queries of the last ``query_window`` tokens computed
since the last cut) picks the rows kept; tokens keep their true positions. Unlike the engine it
can be teacher-forced (any token sequence, one token at a time after the prompt), so the eval
compares its next-token distributions with full KV's (``cut=None``) over a long continuation.
The engine's tests check that both decode the same tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from kvdrop_engine.decode_cut import DecodeCompressor, DecodeCut
from kvdrop_engine.model import DenseAttention, ModelConfig, Transformer
from kvdrop_sdk.query_capture import QueryNeed

__all__ = ["DenseDecode"]


class _Recording(DenseAttention):
    """A dense cache that keeps each layer's queries of the last call."""

    def __init__(self, config: ModelConfig, capacity: int) -> None:
        super().__init__(config, capacity)
        self.q: list[Tensor] = [torch.empty(0)] * config.num_layers

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.q[layer] = q.detach()
        return super().__call__(layer, q, k, v)

    def kv(self) -> Tensor:
        """Every cached row in the server layout ``[2, L, n, Hkv*d]``."""
        n, layers = self.length, range(self.config.num_layers)
        keys = torch.stack([self.keys(i).reshape(n, -1) for i in layers])
        values = torch.stack([self.values(i).reshape(n, -1) for i in layers])
        return torch.stack([keys, values])

    def keep(self, index: Tensor) -> None:
        """Keep only the rows at ``index`` (in order) of every layer."""
        n = self.length
        for layer in range(self.config.num_layers):
            k, v = self._k[layer], self._v[layer]
            assert k is not None and v is not None
            self._k[layer] = k[:, :n].index_select(1, index.to(k.device)).contiguous()
            self._v[layer] = v[:, :n].index_select(1, index.to(v.device)).contiguous()
        self.length = self._capacity = int(index.numel())


class DenseDecode:
    """One sequence on a dense cache, cut by ``cut`` while it decodes (None: full KV).

    ``compressor`` builds cuts and owns the policy call (its ``query_window`` sizes the rows).
    """

    def __init__(
        self,
        model: Transformer,
        cut: DecodeCut | None,
        compressor: DecodeCompressor,
        capacity: int = 1024,
    ) -> None:
        self.model, self.cut, self.compressor = model, cut, compressor
        self.cache = _Recording(model.config, capacity)
        self.sequence: list[int] = []
        self.positions = torch.empty(0, dtype=torch.int64)  # true positions of the cached rows
        self.rows: deque[tuple[int, Tensor]] = deque(maxlen=compressor.query_window)
        self.cuts = 0

    @property
    def num_cached(self) -> int:
        """Rows in the cache now."""
        return self.cache.length

    def prefill(self, tokens: Sequence[int]) -> Tensor:
        """Compute ``tokens`` (the prompt) in one pass; the next-token logits ``[V]``."""
        return self._run(list(tokens))[-1]

    def feed(self, token: int) -> Tensor:
        """Cut if due, then compute one more token; the next-token logits ``[V]``."""
        if self._due():
            self._cut()
        return self._run([int(token)])[-1]

    def feed_many(self, tokens: Sequence[int]) -> Tensor:
        """Teacher-force ``tokens``: the next-token logits ``[n, V]`` after each, as
        :meth:`feed` one at a time would give them (up to float rounding), computed in chunks
        that end where a cut is due (the cut runs at the same points, on the same rows)."""
        out: list[Tensor] = []
        tokens = [int(t) for t in tokens]
        i = 0
        while i < len(tokens):
            if self._due():
                self._cut()
            room = len(tokens) - i
            if self.cut is not None:  # tokens until the cache would pass budget + every
                room = min(room, max(1, self.cut.budget + self.cut.every - self.cache.length))
            out.append(self._run(tokens[i : i + room]))
            i += room
        return torch.cat(out) if out else torch.empty(0)

    def _due(self) -> bool:
        cut = self.cut
        if cut is None or not cut.due(self.cache.length):
            return False
        return cut.policy.queries is QueryNeed.NONE or bool(self.rows)

    def _run(self, tokens: list[int]) -> Tensor:
        device = self.model.device
        start = len(self.sequence)
        first_slot = self.cache.length
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(tokens, device=device),
                torch.arange(start, start + len(tokens), device=device),
                self.cache,
            )
        self.sequence.extend(tokens)
        self.positions = torch.cat([self.positions, torch.arange(start, start + len(tokens))])
        queries = torch.stack(self.cache.q)  # [L, t, Hq, d]
        for i in range(max(0, len(tokens) - self.compressor.query_window), len(tokens)):
            self.rows.append((first_slot + i, queries[:, i].clone()))
        return logits

    def _cut(self) -> None:
        assert self.cut is not None
        rows = None
        if self.rows:
            qpos = torch.tensor([p for p, _ in self.rows], dtype=torch.int64)
            rows = (qpos, torch.stack([q for _, q in self.rows], dim=1))
        tokens = [self.sequence[p] for p in self.positions.tolist()]
        with torch.inference_mode():
            index = self.compressor.select(self.cut, self.cache.kv(), self.positions, tokens, rows)
        self.cache.keep(index)
        self.positions = self.positions[index]
        self.rows.clear()  # their slots moved
        self.cuts += 1
