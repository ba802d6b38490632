"""``h2o``: heavy hitters of accumulated prefill attention plus recent tokens (Zhang et al.)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import attention_mass, heads_f32
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    HEAD_AGG,
    KEEP,
    check_query_shapes,
    group_heads,
    layer_agg_param,
    layer_lse,
    query_head_dim,
    reduce,
    spread_rows,
)
from kvdrop.policy import QueryNeed, Scorer
from kvdrop.selector import Selection

__all__ = ["H2OScorer", "h2o"]


@dataclass(frozen=True)
class H2OScorer(Scorer):
    """H2O heavy hitters (Zhang et al., 2023): attention accumulated over the prefill queries.

    Per layer and query head: each key's softmax attention summed over the queries (all saved
    ones, or ``num_queries`` spread evenly over the whole prompt -- for each evenly spaced
    position the nearest saved query -- always including the last; causal; normalised over every
    key the query saw when its log-normaliser is known, else over the cached keys), divided by how
    many of those queries can see it (so early keys are not favoured
    just for being seen more often). Combined over GQA groups, KV heads and layers.
    ``recent_ratio`` of the whole prompt's kept tokens goes to the most recent ones (H2O's local
    window; the uncached tail counts towards it), the rest to the heaviest hitters. In the lean
    query mode the engine saves a strided sample (every ``--query-stride``-th position) and the
    last tokens' queries, so the spread is that of the sample.
    """

    queries = QueryNeed.WINDOW
    needs_selection = True  # gives a share of the budget to recent tokens
    reads_values = False
    head_dim: int | None = query_head_dim()
    num_queries: int | None = param(
        128,
        "queries whose attention is accumulated: None = all T (cost O(T^2)); else this many, "
        "evenly strided, always including the last",
        allowed="None or an int >= 1",
        check=lambda n: n >= 1,
        serve_max=1024,  # attention rows kept per query
    )
    recent_ratio: float = param(
        0.5,
        "fraction of the keep budget given to the most recent tokens (heavy hitters get the rest)",
        allowed="0 <= r <= 1",
        check=lambda r: 0 <= r <= 1,
    )
    group_agg: str = param("mean", "how the query heads of a GQA group combine", choices=HEAD_AGG)
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = layer_agg_param("mean", "how layers combine")

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_query_shapes("h2o", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None and self.head_dim is not None
        num_tokens = kv.shape[2]
        rows, positions, lse = spread_rows(query, selection, self.num_queries)
        # How many of the chosen queries see key j (position >= j, or the key is cached and the
        # query sits in the tail); at least 1 for every key the last query sees.
        seen_by = torch.searchsorted(positions, torch.arange(num_tokens), side="left")
        seen_by = (positions.numel() - seen_by).clamp(min=1).to(torch.float32).to(kv.device)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(rows[0, layer], self.head_dim)
            mass = attention_mass(q, keys, positions, lse=layer_lse(lse, layer)) / seen_by
            grouped = group_heads(mass, keys.shape[0], self.group_agg)
            per_layer.append(reduce(grouped, 0, self.head_agg))
        scores = reduce(torch.stack(per_layer), 0, self.layer_agg)
        tail = selection.tail
        recent = int(self.recent_ratio * (selection.budget + tail) + 1e-9) - tail
        recent = max(0, min(recent, num_tokens))
        if recent:
            scores[num_tokens - recent :] = KEEP
        return scores


h2o = ScorerFactory(
    "h2o",
    H2OScorer,
    "H2O: heavy hitters of accumulated prefill attention plus recent tokens",
)
