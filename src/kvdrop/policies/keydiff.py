"""``keydiff``: keep the keys least similar to the mean key (Park et al., 2025)."""

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

__all__ = ["KeyDiffScorer", "keydiff"]


@dataclass(frozen=True)
class KeyDiffScorer(Scorer):
    """KeyDiff (Park et al., 2025): keep keys least similar (cosine) to the mean key.

    Per layer and head: s = -cos(k_t, mean_t k_t); combined over heads then layers.
    """

    reads_values = False
    head_dim: int | None = kv_head_dim()
    head_agg: str = head_agg_param()
    layer_agg: str = layer_agg_param()

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_head_dim("keydiff", kv.shape[3], self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        per = []
        for k in per_layer(kv):
            unit = torch.nn.functional.normalize(heads(k, self.head_dim).float(), dim=-1)
            anchor = torch.nn.functional.normalize(unit.mean(dim=1, keepdim=True), dim=-1)
            per.append(reduce(-(unit * anchor).sum(-1), 0, self.head_agg))
        return reduce(torch.stack(per), 0, self.layer_agg)


keydiff = ScorerFactory(
    "keydiff", KeyDiffScorer, "Keep keys least similar (cosine) to the mean key (KeyDiff)"
)
