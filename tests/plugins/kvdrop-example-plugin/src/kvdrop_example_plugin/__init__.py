"""An example third-party policy: keep tokens whose VALUE vectors have the largest L2 norm.

Written only against kvdrop's public API (Scorer, ScorerFactory, param), the way a plugin would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop import Scorer, ScorerFactory, param


@dataclass(frozen=True)
class ValueNormScorer(Scorer):
    """Tokens with large value vectors move the attention output most; keep them."""

    layer_agg: str = param("mean", "how per-layer norms combine", choices=("mean", "max"))

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        norms = torch.stack([kv[1, layer].float().norm(dim=-1) for layer in range(kv.shape[1])])
        return norms.mean(0) if self.layer_agg == "mean" else norms.amax(0)


value_norm = ScorerFactory("value-norm", ValueNormScorer, "Keep tokens with the largest value norm")
