"""``tova``: keep the tokens the last query attends to most (Oren et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import attention_mass, heads_f32
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    check_query_shapes,
    last_rows,
    layer_agg_param,
    layer_lse,
    query_head_dim,
    reduce,
)
from kvdrop.policy import QueryNeed, Scorer
from kvdrop.selector import Selection

__all__ = ["TovaScorer", "tova"]


@dataclass(frozen=True)
class TovaScorer(Scorer):
    """TOVA (Oren et al., 2024): keep the tokens the last query attends to most.

    Per layer: softmax attention of the last ``num_queries`` queries of the whole prompt (the
    uncached tail included; causal; normalised over every key they saw when the engine recorded
    their log-normalisers, else over the cached keys) over all keys, averaged over
    those queries and over all query heads. When the prompt's last token is cached (no uncached
    tail) it is always kept, as kvpress's ``TOVAPress`` keeps it: its score in each layer is that
    layer's highest score plus 1. Layers combine by ``layer_agg``.
    """

    queries = QueryNeed.WINDOW
    reads_query_sample = False  # the last rows only (last_rows)
    needs_selection = True  # reads where the query rows sit
    reads_values = False
    head_dim: int | None = query_head_dim()
    num_queries: int = param(
        1,
        "last queries whose attention is averaged",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
        serve_max=1024,  # attention rows kept per query
    )
    layer_agg: str = layer_agg_param("mean", "how layers combine")

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_query_shapes("tova", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None and self.head_dim is not None
        rows, positions, lse = last_rows("tova", query, selection, self.num_queries)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(rows[0, layer], self.head_dim)
            mass = attention_mass(q, keys, positions, lse=layer_lse(lse, layer))
            per_layer.append(mass.mean(dim=0) / positions.numel())
        scores = torch.stack(per_layer)
        if selection.total_tokens == kv.shape[2] and kv.shape[2] > 1:
            scores[:, -1] = scores[:, :-1].amax(dim=1) + 1.0  # the last token, kvpress's rule
        return reduce(scores, 0, self.layer_agg)


tova = ScorerFactory(
    "tova",
    TovaScorer,
    "TOVA: keep the tokens the last query attends to most",
)
