"""Policies that need only the KV tensor: chunk halving, random, streaming, Knorm, KeyDiff.

Each is a small scorer dataclass; the shared :class:`kvdrop.selector.Selector` does the rest.
Scores are computed layer by layer in float32 so memory stays bounded for long prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.aggregate import HEAD_AGG, LAYER_AGG, check_head_dim, heads, per_layer, reduce
from kvdrop.params import param
from kvdrop.policy import Scorer, ScorerFactory

__all__ = ["chunk_halving", "keydiff", "knorm", "random", "streaming"]

# Scores for tokens that must survive any budget: the last chunk outranks the first.
_KEEP_FIRST = 1e30
_KEEP_LAST = 2e30

_head_dim = param(
    None,
    "per-head dimension (D = heads * head_dim); None treats each D row as one vector",
    allowed="None or an int >= 1 dividing D",
    check=lambda d: d >= 1,
)
_head_agg = param("mean", "how per-head scores combine", choices=HEAD_AGG)
_layer_agg = param("mean", "how per-layer scores combine", choices=LAYER_AGG)


@dataclass(frozen=True)
class ChunkHalvingScorer(Scorer):
    """The upstream demo policy: drop whole chunks from the middle, never the first or last chunk.

    Chunks are ranked by distance from the middle of the prompt (outermost kept first); the first
    and last chunk always rank highest. With keep_ratio=0.5 and n chunks this drops the middle
    n//2 chunks as upstream does, when n is even; for odd n the budget is floored to whole chunks.
    """

    chunk_size: int = 256

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        num_tokens = kv.shape[2]
        n_chunks = max(num_tokens // self.chunk_size, 1)
        chunk = torch.arange(num_tokens) // self.chunk_size
        scores = (chunk.to(torch.float32) - (n_chunks - 1) / 2).abs()
        scores[chunk == 0] = _KEEP_FIRST
        scores[chunk == n_chunks - 1] = _KEEP_LAST
        return scores


@dataclass(frozen=True)
class RandomScorer(Scorer):
    """Uniformly random tokens (seeded, reproducible); the last chunk is always kept."""

    seed: int = param(0, "random seed: same seed, same kept tokens")
    chunk_size: int = 256

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        num_tokens = kv.shape[2]
        gen = torch.Generator().manual_seed(self.seed)
        scores = torch.rand(num_tokens, generator=gen)
        scores[max(num_tokens - self.chunk_size, 0) :] = _KEEP_LAST
        return scores


@dataclass(frozen=True)
class StreamingScorer(Scorer):
    """StreamingLLM: the first n_sink tokens (attention sinks) plus the most recent tokens."""

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        return torch.arange(kv.shape[2], dtype=torch.float32)


@dataclass(frozen=True)
class KnormScorer(Scorer):
    """Knorm (Devoto et al., 2024): keys with the LOWEST L2 norm draw the most attention; keep them.

    Score = -||k|| per head, combined over heads (head_agg) then layers (layer_agg).
    """

    head_dim: int | None = _head_dim
    head_agg: str = _head_agg
    layer_agg: str = _layer_agg

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_head_dim("knorm", kv.shape[3], self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        per = [
            reduce(-heads(k, self.head_dim).float().norm(dim=-1), 0, self.head_agg)
            for k in per_layer(kv)
        ]
        return reduce(torch.stack(per), 0, self.layer_agg)


@dataclass(frozen=True)
class KeyDiffScorer(Scorer):
    """KeyDiff (Park et al., 2025): keep keys least similar (cosine) to the mean key.

    Per layer and head: s = -cos(k_t, mean_t k_t); combined over heads then layers.
    """

    head_dim: int | None = _head_dim
    head_agg: str = _head_agg
    layer_agg: str = _layer_agg

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_head_dim("keydiff", kv.shape[3], self.head_dim)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        per = []
        for k in per_layer(kv):
            unit = torch.nn.functional.normalize(heads(k, self.head_dim).float(), dim=-1)
            anchor = torch.nn.functional.normalize(unit.mean(dim=1, keepdim=True), dim=-1)
            per.append(reduce(-(unit * anchor).sum(-1), 0, self.head_agg))
        return reduce(torch.stack(per), 0, self.layer_agg)


chunk_halving = ScorerFactory(
    "chunk-halving",
    ChunkHalvingScorer,
    "Drop whole middle chunks, never the first or last (the upstream demo policy)",
    defaults={"chunked": True},
    hidden=("n_sink", "window", "chunked"),
)
random = ScorerFactory(
    "random", RandomScorer, "Seeded uniform random tokens; always keeps the last chunk"
)
streaming = ScorerFactory(
    "streaming",
    StreamingScorer,
    "StreamingLLM: attention sinks plus the most recent tokens",
    defaults={"n_sink": 4},
    hidden=("window",),
)
knorm = ScorerFactory("knorm", KnormScorer, "Keep keys with the lowest L2 norm (Knorm)")
keydiff = ScorerFactory(
    "keydiff", KeyDiffScorer, "Keep keys least similar (cosine) to the mean key (KeyDiff)"
)
