"""Policies that score tokens with the prefill queries: SnapKV, H2O, TOVA and R-KV.

Each needs the query tensor the engine saved at prefill (``[1, L, T, Dq]``, all query heads,
post-RoPE, like the keys). All share :func:`kvdrop.attention.attention_mass` (float32, blocked,
memory linear in T) and the shared selector; each scorer only says what a token is worth.

Shapes: ``D = Hkv * head_dim`` and ``Dq = Hq * head_dim`` with ``Hq`` a multiple of ``Hkv``
(GQA group ``G = Dq / D``; query head ``h`` reads KV head ``h // G``). Work is done layer by
layer, so only one layer's float32 keys (``[Hkv, T, head_dim]``) live at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdrop.aggregate import HEAD_AGG, LAYER_AGG, reduce
from kvdrop.attention import attention_mass, heads_f32, key_redundancy, pool1d, unit_keys
from kvdrop.errors import PolicyInputError
from kvdrop.params import param
from kvdrop.policy import Scorer, ScorerFactory
from kvdrop.selector import Selector

__all__ = ["h2o", "rkv", "snapkv", "tova"]

# Tokens forced by a scorer (H2O's recent window) outrank every attention score.
_KEEP = 1e30


def _head_dim() -> int:
    return param(
        128,
        "per-head dimension: D and Dq must be multiples of it (GQA group = Dq / D)",
        allowed="an int >= 1 dividing D and Dq",
        check=lambda d: d >= 1,
    )


def _odd_kernel(default: int) -> int:
    return param(
        default,
        "1-D pooling kernel over token scores (same-size, padding kernel // 2); 1 = none",
        allowed="an odd int >= 1",
        check=lambda k: k >= 1 and k % 2 == 1,
    )


def _check_shapes(policy: str, kv: torch.Tensor, query: torch.Tensor | None, head_dim: int) -> None:
    """Raise PolicyInputError unless D, Dq are multiples of head_dim and Hq of Hkv."""
    if query is None:  # check_inputs already raised MissingQueryError; be defensive
        raise PolicyInputError(f"{policy}: needs the query tensor")
    width, q_width = kv.shape[3], query.shape[3]
    for what, w in (("KV", width), ("query", q_width)):
        if w % head_dim:
            raise PolicyInputError(
                f"{policy}: {what} width {w} is not a multiple of head_dim={head_dim}; "
                "expected num_heads * head_dim"
            )
    if (q_width // head_dim) % (width // head_dim):
        raise PolicyInputError(
            f"{policy}: {q_width // head_dim} query heads (Dq={q_width}) are not a multiple of "
            f"{width // head_dim} KV heads (D={width}); GQA needs Dq a multiple of D"
        )


def _group(x: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """``[Hq, ...]`` -> ``[Hkv, ...]`` by ``how`` over each GQA group."""
    return reduce(x.view(num_kv_heads, x.shape[0] // num_kv_heads, *x.shape[1:]), 1, how)


def _window_fill(prefix_scores: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]`` scores: the prefix's, then the window (always kept by the selector) at the max."""
    out = torch.zeros(num_tokens, dtype=torch.float32)
    n = prefix_scores.numel()
    out[:n] = prefix_scores
    if n:
        out[n:] = prefix_scores.max()
    return out


@dataclass(frozen=True)
class SnapKVScorer(Scorer):
    """SnapKV (Li et al., 2024): what the last ``window`` prompt tokens attend to.

    Per layer and query head: softmax(q.k / sqrt(d)) of the observation window's queries (the
    last ``window`` cached tokens) over all keys, causal inside the window; summed over the
    window queries and kept for the earlier keys only; pooled along tokens (``kernel``,
    ``pooling``); combined over each GQA group (``group_agg``), then over KV heads
    (``head_agg``), then over layers (``layer_agg``). The window itself is always kept (it is
    the selector's ``window``; ``window=0`` observes the last query alone and forces nothing). As
    upstream, the defaults are window 64, kernel 5, avg pooling, mean everywhere -- but the budget
    is chunk-aligned.
    """

    needs_query = True
    head_dim: int = _head_dim()
    kernel: int = _odd_kernel(5)
    pooling: str = param("avg", "pooling of token scores", choices=("avg", "max"))
    group_agg: str = param("mean", "how the query heads of a GQA group combine", choices=HEAD_AGG)
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = param("mean", "how layers combine", choices=LAYER_AGG)
    window: int = field(default=64, repr=False)  # the selector's window = observation window

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        _check_shapes("snapkv", kv, query, self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None
        num_tokens = kv.shape[2]
        # Tokens before the observation window (window 0 observes the last query alone).
        obs = max(num_tokens - max(self.window, 1), 0)
        if obs == 0:
            return torch.zeros(num_tokens)
        positions = torch.arange(obs, num_tokens)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(query[0, layer, obs:], self.head_dim)
            mass = attention_mass(q, keys, positions)[:, :obs]
            pooled = pool1d(mass, self.kernel, self.pooling)
            grouped = _group(pooled, keys.shape[0], self.group_agg)
            per_layer.append(reduce(grouped, 0, self.head_agg))
        return _window_fill(reduce(torch.stack(per_layer), 0, self.layer_agg), num_tokens)


def _strided_positions(num_tokens: int, num_queries: int | None) -> torch.Tensor:
    """All positions, or ``num_queries`` evenly spaced ones that always include the last."""
    if num_queries is None or num_queries >= num_tokens:
        return torch.arange(num_tokens)
    if num_queries == 1:
        return torch.tensor([num_tokens - 1])
    pos = torch.linspace(0, num_tokens - 1, num_queries, dtype=torch.float64).round().long()
    return torch.unique(pos)  # sorted; endpoints 0 and T-1 are exact


@dataclass(frozen=True)
class H2OScorer(Scorer):
    """H2O heavy hitters (Zhang et al., 2023): attention accumulated over the prefill queries.

    Per layer and query head: each key's softmax attention summed over the queries (all, or
    ``num_queries`` evenly strided ones that always include the last; causal), divided by how
    many of those queries can see it (so early keys are not favoured just for being seen more
    often). Combined over GQA groups, KV heads and layers. ``recent_ratio`` of the keep budget
    goes to the most recent tokens (H2O's local window), the rest to the heaviest hitters.
    """

    needs_query = True
    head_dim: int = _head_dim()
    num_queries: int | None = param(
        128,
        "queries whose attention is accumulated: None = all T (cost O(T^2)); else this many, "
        "evenly strided, always including the last",
        allowed="None or an int >= 1",
        check=lambda n: n >= 1,
    )
    recent_ratio: float = param(
        0.5,
        "fraction of the keep budget given to the most recent tokens (heavy hitters get the rest)",
        allowed="0 <= r <= 1",
        check=lambda r: 0 <= r <= 1,
    )
    group_agg: str = param("mean", "how the query heads of a GQA group combine", choices=HEAD_AGG)
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = param("mean", "how layers combine", choices=LAYER_AGG)
    keep_ratio: float | None = field(default=None, repr=False)  # from the selector
    keep_tokens: int | None = field(default=None, repr=False)
    chunk_size: int = field(default=256, repr=False)

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        _check_shapes("h2o", kv, query, self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None
        num_tokens = kv.shape[2]
        positions = _strided_positions(num_tokens, self.num_queries)
        # How many of the chosen queries see key j (position >= j); >= 1 as T-1 is chosen.
        seen_by = torch.searchsorted(positions, torch.arange(num_tokens), side="left")
        seen_by = (positions.numel() - seen_by).to(torch.float32)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(query[0, layer].index_select(0, positions), self.head_dim)
            mass = attention_mass(q, keys, positions) / seen_by
            grouped = _group(mass, keys.shape[0], self.group_agg)
            per_layer.append(reduce(grouped, 0, self.head_agg))
        scores = reduce(torch.stack(per_layer), 0, self.layer_agg)
        budget = Selector(self.keep_ratio, self.keep_tokens, self.chunk_size).budget(num_tokens)
        recent = min(int(self.recent_ratio * budget + 1e-9), num_tokens)
        if recent:
            scores[num_tokens - recent :] = _KEEP
        return scores


@dataclass(frozen=True)
class TovaScorer(Scorer):
    """TOVA (Oren et al., 2024): keep the tokens the last query attends to most.

    Per layer: softmax attention of the last ``num_queries`` queries (causal) over all keys,
    averaged over those queries and over all query heads; layers combine by ``layer_agg``.
    """

    needs_query = True
    head_dim: int = _head_dim()
    num_queries: int = param(
        1, "last queries whose attention is averaged", allowed="an int >= 1", check=lambda n: n >= 1
    )
    layer_agg: str = param("mean", "how layers combine", choices=LAYER_AGG)

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        _check_shapes("tova", kv, query, self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None
        num_tokens = kv.shape[2]
        first = max(num_tokens - self.num_queries, 0)
        positions = torch.arange(first, num_tokens)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(query[0, layer, first:], self.head_dim)
            mass = attention_mass(q, keys, positions)
            per_layer.append(mass.mean(dim=0) / positions.numel())
        return reduce(torch.stack(per_layer), 0, self.layer_agg)


@dataclass(frozen=True)
class RKVScorer(Scorer):
    """R-KV (Cai et al., 2025): SnapKV-style importance minus key redundancy.

    Per layer, for the tokens before the observation window (the last ``window`` tokens, always
    kept): importance = softmax attention of the window queries over those earlier keys only,
    averaged over the window, combined over each GQA group (``group_agg``, default max), then
    max-pooled (``kernel`` 7); redundancy = R-KV's key similarity per KV head: cosine matrix of
    ``k / (||k|| + 1e-8)`` over all T keys with the diagonal zeroed, in each row the entry of the
    last key more similar than ``threshold`` zeroed, mean over rows, softmax over keys.
    score = ``mix_lambda`` * importance - (1 - ``mix_lambda``) * redundancy, combined over KV
    heads then layers. The redundancy is computed blockwise (no T x T matrix), exactly.
    """

    needs_query = True
    head_dim: int = _head_dim()
    kernel: int = _odd_kernel(7)
    pooling: str = param("max", "pooling of importance scores", choices=("avg", "max"))
    group_agg: str = param("max", "how the query heads of a GQA group combine", choices=HEAD_AGG)
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = param("mean", "how layers combine", choices=LAYER_AGG)
    threshold: float = param(
        0.5,
        "cosine similarity above which a key counts as a duplicate",
        allowed="-1 <= t <= 1",
        check=lambda t: -1 <= t <= 1,
    )
    mix_lambda: float = param(
        0.25,
        "weight of importance; redundancy gets 1 - mix_lambda",
        allowed="0 <= l <= 1",
        check=lambda x: 0 <= x <= 1,
    )
    window: int = field(default=16, repr=False)  # the selector's window = observation window

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        _check_shapes("rkv", kv, query, self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None
        num_tokens = kv.shape[2]
        obs = max(num_tokens - max(self.window, 1), 0)
        if obs == 0:
            return torch.zeros(num_tokens)
        window = num_tokens - obs
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(query[0, layer, obs:], self.head_dim)
            # Every window query sees every earlier key: no mask, softmax over the prefix only.
            importance = attention_mass(q, keys[:, :obs], None) / window
            importance = pool1d(
                _group(importance, keys.shape[0], self.group_agg), self.kernel, self.pooling
            )
            keys = unit_keys(keys)  # the raw float32 keys are no longer needed
            redundancy = key_redundancy(keys, self.threshold)[:, :obs]
            mixed = self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy
            per_layer.append(reduce(mixed, 0, self.head_agg))
        return _window_fill(reduce(torch.stack(per_layer), 0, self.layer_agg), num_tokens)


snapkv = ScorerFactory(
    "snapkv",
    SnapKVScorer,
    "SnapKV: keep what the last `window` prompt tokens attend to",
    defaults={"window": 64},
)
h2o = ScorerFactory(
    "h2o",
    H2OScorer,
    "H2O: heavy hitters of accumulated prefill attention plus recent tokens",
)
tova = ScorerFactory(
    "tova",
    TovaScorer,
    "TOVA: keep the tokens the last query attends to most",
)
rkv = ScorerFactory(
    "rkv",
    RKVScorer,
    "R-KV: SnapKV-style importance minus key redundancy",
    defaults={"window": 16},
)
