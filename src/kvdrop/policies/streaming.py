"""``streaming``: StreamingLLM, attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.policy import Scorer

__all__ = ["StreamingScorer", "streaming"]


@dataclass(frozen=True)
class StreamingScorer(Scorer):
    """StreamingLLM: the first n_sink tokens (attention sinks) plus the most recent tokens."""

    reads_values = False
    reads_keys = False  # only the KV's shape

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        return torch.arange(kv.shape[2], dtype=torch.float32)


streaming = ScorerFactory(
    "streaming",
    StreamingScorer,
    "StreamingLLM: attention sinks plus the most recent tokens",
    defaults={"n_sink": 4},
    hidden=("window",),
)
