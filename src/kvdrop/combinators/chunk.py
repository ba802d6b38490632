"""``Chunk``: any scorer policy at chunk granularity (ChunkKV-style)."""

from __future__ import annotations

import dataclasses

from kvdrop.errors import PolicyParamError
from kvdrop.policy import ScorerPolicy
from kvdrop.selector import Selector

__all__ = ["Chunk"]


class Chunk(ScorerPolicy):
    """``policy`` selecting whole chunks by the sum of their token scores (like kvpress's
    ``ChunkKVPress(press=...)``): its scorer under its selector with ``chunked=True``, so the
    kept prefix is made of whole server chunks. A chunk-level policy (chunk-halving) is unchanged.
    """

    def __init__(self, policy: ScorerPolicy) -> None:
        if not isinstance(policy, ScorerPolicy):
            raise PolicyParamError(
                f"chunk: policy {policy!r} is a {type(policy).__name__} and has no chunk-level "
                "mode (no scores to sum per chunk); expected a scorer policy "
                "(`kvdrop describe NAME` lists its parameters)"
            )
        self.policy = policy
        super().__init__(
            f"chunk(policy={policy.name})",
            policy.scorer,
            dataclasses.replace(policy.selector, chunked=True),
        )

    def __repr__(self) -> str:
        return f"Chunk({self.policy!r})"

    def with_selector(self, selector: Selector) -> Chunk:
        return Chunk(self.policy.with_selector(selector))
