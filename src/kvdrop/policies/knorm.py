"""``knorm``: keep the keys with the lowest L2 norm (Devoto et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.policies._common import (
    check_head_dim,
    head_agg_param,
    heads,
    kv_head_dim,
    layer_agg_param,
    per_layer,
    reduce,
)
from kvdrop.policy import Scorer

__all__ = ["KnormScorer", "knorm"]


@dataclass(frozen=True)
class KnormScorer(Scorer):
    """Knorm (Devoto et al., 2024): keys with the LOWEST L2 norm draw the most attention; keep them.

    Score = -||k|| per head, combined over heads (head_agg) then layers (layer_agg).
    """

    reads_values = False
    head_dim: int | None = kv_head_dim()
    head_agg: str = head_agg_param()
    layer_agg: str = layer_agg_param()

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_head_dim("knorm", kv.shape[3], self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        per = [
            reduce(-heads(k, self.head_dim).float().norm(dim=-1), 0, self.head_agg)
            for k in per_layer(kv)
        ]
        return reduce(torch.stack(per), 0, self.layer_agg)


knorm = ScorerFactory("knorm", KnormScorer, "Keep keys with the lowest L2 norm (Knorm)")
