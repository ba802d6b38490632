"""``chunk-halving``: the upstream demo policy, whole middle chunks dropped."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.policies._common import KEEP, KEEP_LAST
from kvdrop.policy import Scorer
from kvdrop.selector import Selection

__all__ = ["ChunkHalvingScorer", "chunk_halving"]


@dataclass(frozen=True)
class ChunkHalvingScorer(Scorer):
    """The upstream demo policy: drop whole chunks from the middle, never the first or last chunk.

    Chunks are ranked by distance from the middle of the prompt (outermost kept first); the first
    and last chunk always rank highest. With keep_ratio=0.5 and n chunks this drops the middle
    n//2 chunks as upstream does, when n is even; for odd n the budget is floored to whole chunks.
    """

    needs_selection = True  # ranks the selector's chunks
    reads_values = False
    reads_keys = False  # only the KV's shape

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        num_tokens = kv.shape[2]
        n_chunks = max(num_tokens // selection.chunk_size, 1)
        chunk = torch.arange(num_tokens) // selection.chunk_size
        scores = (chunk.to(torch.float32) - (n_chunks - 1) / 2).abs()
        scores[chunk == 0] = KEEP
        scores[chunk == n_chunks - 1] = KEEP_LAST
        return scores


chunk_halving = ScorerFactory(
    "chunk-halving",
    ChunkHalvingScorer,
    "Drop whole middle chunks, never the first or last (the upstream demo policy)",
    defaults={"chunked": True},
    hidden=("n_sink", "window", "chunked"),
)
