"""``tova``: keep the tokens the last query attends to most (Oren et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import attention_mass, heads_f32
from kvdrop.params import param
from kvdrop.policies._common import LAYER_AGG, check_query_shapes, query_head_dim, reduce
from kvdrop.policy import Scorer, ScorerFactory

__all__ = ["TovaScorer", "tova"]


@dataclass(frozen=True)
class TovaScorer(Scorer):
    """TOVA (Oren et al., 2024): keep the tokens the last query attends to most.

    Per layer: softmax attention of the last ``num_queries`` queries (causal) over all keys,
    averaged over those queries and over all query heads; layers combine by ``layer_agg``.
    """

    needs_query = True
    head_dim: int = query_head_dim()
    num_queries: int = param(
        1, "last queries whose attention is averaged", allowed="an int >= 1", check=lambda n: n >= 1
    )
    layer_agg: str = param("mean", "how layers combine", choices=LAYER_AGG)

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_query_shapes("tova", kv, query, self.head_dim)

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


tova = ScorerFactory(
    "tova",
    TovaScorer,
    "TOVA: keep the tokens the last query attends to most",
)
