"""``random``: seeded uniform random tokens (a baseline; kvpress's ``RandomPress``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policy import Scorer

__all__ = ["RandomScorer", "random"]


@dataclass(frozen=True)
class RandomScorer(Scorer):
    """Uniformly random tokens (seeded, reproducible): ``torch.rand(T)`` from a generator seeded
    with ``seed``, the draws kvpress's ``RandomPress(seed=seed)`` gives its first KV head (it
    draws ``[B, Hkv, T]``; kvdrop keeps one list). No token is forced: the selector's ``n_sink``
    and ``window`` protect the ends when asked to."""

    seed: int = param(0, "random seed: same seed, same kept tokens")
    reads_values = False
    reads_keys = False  # only the KV's shape

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.rand(kv.shape[2], generator=gen)


random = ScorerFactory(
    "random", RandomScorer, "Seeded uniform random tokens (kvpress's RandomPress, first KV head)"
)
