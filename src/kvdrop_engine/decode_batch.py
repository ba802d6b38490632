"""Batched decode cuts: one set of kernels ranks every due request of a step.

The policy library scores one request at a time (a Python loop over layers, a few host
synchronisations per call, e.g. R-KV's redundancy scan), which on a GPU costs tens of
milliseconds per request however small its cache. While decoding, the requests a step cuts
usually hold the same number of rows (``budget + every``) and the same query slots (the last
rows before the cut), so :class:`BatchedRank` scores them together: their keys as one
``[B, L, T, Hkv, d]`` view of the cut's gather, their query rows as one ``[B, L, r, Hq, d]``
stack, every layer and head in a few large launches, and one stable sort over ``[B, T]``
scores; nothing is read back to the host until the kept indices are.

It covers the common policies with their library parameters: ``rkv`` (importance minus
redundancy; on a GPU the redundancy of every head at once, a float16 filter then float32 for the
rows it keeps, with one host read: :func:`_last_similar`), ``snapkv``, ``tova``, ``knorm`` and
``streaming``, with the library's selector rules (the first ``n_sink`` rows and the last
``window`` always kept, then the highest scores, ties to the earlier row). The maths is the
library's, in float32; the kept rows equal the policy's own choice but where two scores differ
by float rounding at the budget's edge (the tests compare both). :func:`batched` returns None
for anything else (another policy, a chunked selector, a negative R-KV threshold), which the
cut then runs through the policy itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["BatchedRank", "batched"]

#: Bound of one float32 temporary (logits or similarities) of a batched scorer: chunks of the
#: flattened (request, layer) or (request, layer, head) dimension stay under it.
TILE_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}


def _tile(device: torch.device) -> int:
    return TILE_BYTES.get(device.type, TILE_BYTES["cpu"])


def _chunks(total: int, per_item: int, device: torch.device) -> Iterator[slice]:
    step = max(1, _tile(device) // max(per_item, 1))
    for start in range(0, total, step):
        yield slice(start, min(total, start + step))


def _reduce(x: Tensor, dim: int, how: str) -> Tensor:
    """The library's own aggregation, so a batched score aggregates as its scorer does."""
    from kvdrop.policies._common import reduce

    return reduce(x, dim, how)


def _pool(x: Tensor, kernel: int, how: str) -> Tensor:
    """The library's same-size pooling over the last dim (``kvdrop.attention.pool1d``)."""
    if kernel == 1 or x.shape[-1] == 0:
        return x
    flat = x.reshape(-1, 1, x.shape[-1])
    fn = torch.nn.functional.avg_pool1d if how == "avg" else torch.nn.functional.max_pool1d
    return fn(flat, kernel, stride=1, padding=kernel // 2).view(x.shape)


@dataclass(frozen=True)
class BatchedRank:
    """A policy's ranking over a batch (see the module docstring): ``kind`` names the scorer,
    ``scorer`` and ``selector`` are the policy's own (their parameters are read from them)."""

    kind: str
    scorer: Any
    selector: Any
    head_dim: int

    @property
    def reads_queries(self) -> bool:
        return self.kind in ("rkv", "snapkv", "tova")

    def query_count(self) -> int:
        """How many of the last rows the scorer observes (``last_rows``' count)."""
        if self.kind == "tova":
            return int(self.scorer.num_queries)
        return max(int(self.selector.window), 1)

    def budget(self, num_tokens: int) -> int:
        """Rows kept of ``num_tokens`` (the selector's budget: ``keep_tokens``, at most T)."""
        return int(self.selector.budget(num_tokens))

    def select(self, keys: Tensor, queries: Tensor | None, qpos: Tensor | None) -> Tensor:
        """Sorted kept row indices ``[B, k]`` (int64, on the keys' device) of ``keys``
        ``[B, L, T, Hkv*d]`` given the observed query rows ``[B, L, r, Hq*d]`` at slots
        ``qpos`` ``[r]`` (the same for every request)."""
        num_tokens = keys.shape[2]
        scores = self.scores(keys, queries, qpos)
        return self.rank(scores, num_tokens)

    def rank(self, scores: Tensor, num_tokens: int) -> Tensor:
        """The selector's order (sinks and recent window first, then by score, ties to the
        earlier row; NaN last), cut at the budget and sorted: ``[B, k]``."""
        k = self.budget(num_tokens)
        s = torch.nan_to_num(scores.float(), nan=-math.inf)
        forced = torch.zeros(num_tokens, dtype=torch.bool, device=s.device)
        forced[: min(int(self.selector.n_sink), num_tokens)] = True
        recent = min(num_tokens, int(self.selector.window))
        if recent:
            forced[num_tokens - recent :] = True
        s = s.masked_fill(forced, math.inf)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
        return torch.sort(order, dim=-1).values

    def scores(self, keys: Tensor, queries: Tensor | None, qpos: Tensor | None) -> Tensor:
        """``[B, T]`` float32 scores (higher: keep) on the keys' device."""
        b, num_layers, num_tokens, width = keys.shape
        if self.kind == "streaming":
            return torch.arange(num_tokens, dtype=torch.float32, device=keys.device).expand(b, -1)
        if self.kind == "knorm":
            d = width if self.scorer.head_dim is None else int(self.scorer.head_dim)
            norms = keys.reshape(b, num_layers, num_tokens, width // d, d).float().norm(dim=-1)
            per_layer = _reduce(-norms, 3, self.scorer.head_agg)  # [B, L, T]
            return _reduce(per_layer, 1, self.scorer.layer_agg)
        assert queries is not None and qpos is not None
        d = self.head_dim
        k = keys.reshape(b, num_layers, num_tokens, width // d, d)
        q = queries.reshape(b, num_layers, queries.shape[2], -1, d)
        if self.kind == "rkv":
            return self._rkv(k, q)
        if self.kind == "snapkv":
            return self._snapkv(k, q, qpos)
        return self._tova(k, q, qpos)

    # -- attention mass ------------------------------------------------------------------

    @staticmethod
    def _mass(k: Tensor, q: Tensor, qpos: Tensor | None, limit: int) -> Tensor:
        """Per (request, layer, query head) the summed softmax attention ``[B, L, Hq, limit]``
        the rows ``q`` ``[B, L, r, Hq, d]`` give the keys ``k[..., :limit]`` ``[B, L, T,
        Hkv, d]``; causal at slots ``qpos`` (None: every row sees the ``limit`` keys)."""
        b, num_layers, num_tokens, hkv, d = k.shape
        r, hq = q.shape[2], q.shape[3]
        group = hq // hkv
        scale = 1.0 / math.sqrt(d)
        flat_k = k.reshape(b * num_layers, num_tokens, hkv, d)
        flat_q = q.reshape(b * num_layers, r, hq, d)
        out = torch.empty(b * num_layers, hq, limit, dtype=torch.float32, device=k.device)
        hidden = None
        if qpos is not None:
            pos = qpos.to(torch.int64).clamp(max=num_tokens - 1)
            cols = torch.arange(limit)
            hidden = (cols[None, :] > pos[:, None]).to(k.device)  # [r, limit]
        for part in _chunks(b * num_layers, 4 * hq * r * limit * 2, k.device):
            kk = flat_k[part, :limit].float().permute(0, 2, 1, 3).contiguous()  # [n, Hkv, t, d]
            qq = (flat_q[part].float() * scale).permute(0, 2, 1, 3)  # [n, Hq, r, d]
            qq = qq.reshape(qq.shape[0], hkv, group * r, d)
            logits = torch.matmul(qq, kk.transpose(-1, -2))  # [n, Hkv, G*r, limit]
            logits = logits.view(-1, hkv, group, r, limit)
            if hidden is not None:
                logits.masked_fill_(hidden, -math.inf)
            probs = torch.softmax(logits, dim=-1)
            out[part] = probs.sum(dim=3).reshape(-1, hq, limit)
        return out.view(b, num_layers, hq, limit)

    def _window_obs(self, num_tokens: int) -> int:
        return max(num_tokens - max(int(self.selector.window), 1), 0)

    @staticmethod
    def _fill(prefix: Tensor, num_tokens: int) -> Tensor:
        """The library's ``window_fill`` per row: the prefix's scores, then its max."""
        b, obs = prefix.shape
        out = torch.zeros(b, num_tokens, dtype=torch.float32, device=prefix.device)
        out[:, :obs] = prefix
        if obs:
            out[:, obs:] = prefix.amax(dim=1, keepdim=True)
        return out

    def _snapkv(self, k: Tensor, q: Tensor, qpos: Tensor) -> Tensor:
        s = self.scorer
        b, num_layers, num_tokens, hkv, _ = k.shape
        obs = self._window_obs(num_tokens)
        if obs == 0:
            return torch.zeros(b, num_tokens, device=k.device)
        mass = self._mass(k, q, qpos, num_tokens)[..., :obs]  # [B, L, Hq, obs]
        pooled = _pool(mass, int(s.kernel), s.pooling)
        grouped = _reduce(pooled.view(b, num_layers, hkv, -1, obs), 3, s.group_agg)
        per_layer = _reduce(grouped, 2, s.head_agg)  # [B, L, obs]
        return self._fill(_reduce(per_layer, 1, s.layer_agg), num_tokens)

    def _tova(self, k: Tensor, q: Tensor, qpos: Tensor) -> Tensor:
        s = self.scorer
        num_tokens = k.shape[2]
        mass = self._mass(k, q, qpos, num_tokens)  # [B, L, Hq, T]
        scores = mass.mean(dim=2) / q.shape[2]  # [B, L, T]
        if num_tokens > 1:  # the last token, kvpress's rule (no uncached tail while decoding)
            scores[..., -1] = scores[..., :-1].amax(dim=-1) + 1.0
        return _reduce(scores, 1, s.layer_agg)

    def _rkv(self, k: Tensor, q: Tensor) -> Tensor:
        s = self.scorer
        b, num_layers, num_tokens, hkv, _ = k.shape
        obs = self._window_obs(num_tokens)
        if obs == 0:
            return torch.zeros(b, num_tokens, device=k.device)
        mass = self._mass(k, q, None, obs) / q.shape[2]  # every row sees the prefix only
        grouped = _reduce(mass.view(b, num_layers, hkv, -1, obs), 3, s.group_agg)
        importance = _pool(grouped, int(s.kernel), s.pooling)  # [B, L, Hkv, obs]
        redundancy = self._redundancy(k, float(s.threshold))  # [B, L, Hkv, T]
        mixed = s.mix_lambda * importance - (1 - s.mix_lambda) * redundancy[..., :obs]
        per_layer = _reduce(mixed, 2, s.head_agg)  # [B, L, obs]
        return self._fill(_reduce(per_layer, 1, s.layer_agg), num_tokens)

    @staticmethod
    def _redundancy(k: Tensor, threshold: float, dense: bool | None = None) -> Tensor:
        """R-KV's redundancy ``[B, L, Hkv, T]`` (the definition of
        :func:`kvdrop.attention.key_redundancy`, ``threshold >= 0``) of every head of every
        request. On the CPU the library's scan, a layer's heads at a time (it stops early); on
        an accelerator every head at once (:func:`_last_similar`): a float16 filter, then a
        float32 similarity of the rows it cannot rule out, with one host read in all (the
        library's scan reads the device once per column block). ``dense`` picks the way
        (None: by device)."""
        from kvdrop.attention import key_redundancy, unit_keys

        b, num_layers, num_tokens, hkv, d = k.shape
        keys = k.float().permute(0, 1, 3, 2, 4).reshape(-1, num_tokens, d)  # [B*L*Hkv, T, d]
        unit = unit_keys(keys)
        if not (k.device.type != "cpu" if dense is None else dense):
            red = torch.cat([key_redundancy(u, threshold) for u in unit.split(hkv)])
            return red.view(b, num_layers, hkv, num_tokens)
        col_sum = torch.einsum("nd,ntd->nt", unit.sum(dim=1), unit)
        col_sum -= torch.einsum("ntd,ntd->nt", unit, unit)  # the zeroed diagonal
        last = _last_similar(unit, threshold)
        diag = torch.arange(num_tokens, device=k.device)
        # The entry each row zeroes, S[i, last[i]] (0 on the diagonal), off its column's sum.
        partner = torch.gather(unit, 1, last[..., None].expand(-1, -1, d))
        entry = (unit * partner).sum(dim=-1)
        col_sum.scatter_add_(1, last, -torch.where(last == diag, 0.0, entry))
        red = torch.softmax(col_sum / num_tokens, dim=-1)
        return red.view(b, num_layers, hkv, num_tokens)


def _last_similar(unit: Tensor, threshold: float) -> Tensor:
    """``[n, T]`` int64: per head of unit keys ``unit`` ``[n, T, d]`` and row ``i``, the last
    column ``j != i`` whose float32 similarity passes ``threshold`` (0: none).

    A float16 product first finds each row's largest similarity (the fused
    :func:`kvdrop.kernels.similarity_row_max` where Triton runs: no ``[T, T]`` tile); a row
    whose largest is below ``threshold`` minus :func:`kvdrop.attention.fp16_filter_margin` has
    no similar key, exactly. Only the other rows (each head padded to the head with most of
    them) are multiplied again in float32 and decided as the library decides; one host read
    (that count). Keys in few directions (every row passes the filter) cost one float16 pass
    more than the float32 product alone; keys in many cost a fraction of it."""
    from kvdrop.attention import fp16_filter_margin

    n, num_tokens, d = unit.shape
    device = unit.device
    last = torch.zeros(n, num_tokens, dtype=torch.int64, device=device)
    todo = _rough_row_max(unit) > threshold - fp16_filter_margin(d)
    most = int(todo.sum(dim=-1).max())  # the one host read
    if most == 0:
        return last
    cols = torch.arange(num_tokens, device=device)
    order = None  # every row
    if most < num_tokens:  # the rows to decide first, per head (stable: in order), padded
        order = torch.argsort(todo.to(torch.int8), dim=-1, descending=True, stable=True)
        order = order[:, :most]
    for part in _chunks(n, 7 * most * num_tokens, device):
        u = unit[part]
        index = cols.expand(u.shape[0], -1) if order is None else order[part]
        rows = u if order is None else torch.gather(u, 1, index[..., None].expand(-1, -1, d))
        sim = torch.matmul(rows, u.transpose(1, 2))  # [p, most, T] float32
        sim.masked_fill_(index[..., None] == cols, -math.inf)  # the diagonal never counts
        similar = sim > threshold
        del sim
        found = similar.any(dim=-1)  # a padded row (ruled out by the filter) finds none
        col = (num_tokens - 1) - similar.view(torch.uint8).flip(-1).argmax(dim=-1)
        last[part] = last[part].scatter(1, index, torch.where(found, col, 0))
    return last


def _rough_row_max(unit: Tensor) -> Tensor:
    """``[n, T]`` float32: each row's largest float16 similarity to another key of its head."""
    import kvdrop.kernels as kernels

    half = unit.to(torch.float16)
    if kernels.available(half):
        try:
            return kernels.similarity_row_max(half, 0, half.shape[1])
        except Exception:  # a Triton that cannot compile it here: the product below
            pass
    n, num_tokens, _ = half.shape
    best = torch.empty(n, num_tokens, dtype=torch.float32, device=unit.device)
    for part in _chunks(n, 2 * num_tokens * num_tokens, unit.device):
        rough = torch.matmul(half[part], half[part].transpose(1, 2))  # [p, T, T] float16
        rough.diagonal(dim1=1, dim2=2).fill_(-math.inf)
        best[part] = rough.amax(dim=-1).float()
    return best


def batched(policy: Any, head_dim: int) -> BatchedRank | None:
    """The batched ranking of ``policy`` (a built decode policy), or None when it has none
    (see the module docstring); ``head_dim`` is the layout's (a query scorer's default)."""
    from kvdrop.policies.knorm import KnormScorer
    from kvdrop.policies.rkv import RKVScorer
    from kvdrop.policies.snapkv import SnapKVScorer
    from kvdrop.policies.streaming import StreamingScorer
    from kvdrop.policies.tova import TovaScorer
    from kvdrop.policy import ScorerPolicy

    if type(policy) is not ScorerPolicy:
        return None
    selector, scorer = policy.selector, policy.scorer
    if selector.chunked or selector.chunk_size != 1 or selector.keep_tokens is None:
        return None
    kinds = {
        RKVScorer: "rkv",
        SnapKVScorer: "snapkv",
        TovaScorer: "tova",
        KnormScorer: "knorm",
        StreamingScorer: "streaming",
    }
    kind = kinds.get(type(scorer))
    if kind is None or (kind == "rkv" and scorer.threshold < 0):
        return None
    if selector.n_sink + selector.window > selector.keep_tokens:
        return None  # the forced rows alone pass the budget: the library's order among them
    own = getattr(scorer, "head_dim", None) if kind in ("rkv", "snapkv", "tova") else None
    return BatchedRank(kind, scorer, selector, int(own or head_dim))
