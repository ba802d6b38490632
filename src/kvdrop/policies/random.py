"""``random``: seeded uniform random tokens, the last chunk always kept (a baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import KEEP_LAST
from kvdrop.policy import Scorer
from kvdrop.selector import Selection

__all__ = ["RandomScorer", "random"]


@dataclass(frozen=True)
class RandomScorer(Scorer):
    """Uniformly random tokens (seeded, reproducible); the last chunk is always kept."""

    seed: int = param(0, "random seed: same seed, same kept tokens")
    needs_selection = True  # keeps the selector's last chunk
    reads_values = False
    reads_keys = False  # only the KV's shape

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        num_tokens = kv.shape[2]
        gen = torch.Generator().manual_seed(self.seed)
        scores = torch.rand(num_tokens, generator=gen)
        scores[max(num_tokens - selection.chunk_size, 0) :] = KEEP_LAST
        return scores


random = ScorerFactory(
    "random", RandomScorer, "Seeded uniform random tokens; always keeps the last chunk"
)
