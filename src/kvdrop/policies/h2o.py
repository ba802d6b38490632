"""``h2o``: heavy hitters of accumulated prefill attention plus recent tokens (Zhang et al.)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import attention_mass, heads_f32
from kvdrop.params import param
from kvdrop.policies._common import (
    HEAD_AGG,
    KEEP,
    LAYER_AGG,
    check_query_shapes,
    group_heads,
    query_head_dim,
    reduce,
)
from kvdrop.policy import Scorer, ScorerFactory
from kvdrop.selector import Selection

__all__ = ["H2OScorer", "h2o"]


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
    needs_selection = True  # gives a share of the budget to recent tokens
    head_dim: int = query_head_dim()
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

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_query_shapes("h2o", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
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
            grouped = group_heads(mass, keys.shape[0], self.group_agg)
            per_layer.append(reduce(grouped, 0, self.head_agg))
        scores = reduce(torch.stack(per_layer), 0, self.layer_agg)
        recent = min(int(self.recent_ratio * selection.budget + 1e-9), num_tokens)
        if recent:
            scores[num_tokens - recent :] = KEEP
        return scores


h2o = ScorerFactory(
    "h2o",
    H2OScorer,
    "H2O: heavy hitters of accumulated prefill attention plus recent tokens",
)
