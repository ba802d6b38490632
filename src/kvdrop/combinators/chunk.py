"""``Chunk``: any scorer policy at chunk granularity (ChunkKV-style)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdrop.combinators.inner import HEAD_DIM, build, inner_params, policy_name
from kvdrop.errors import PolicyParamError
from kvdrop.factories import PolicyFactory, PolicyInfo
from kvdrop.params import Param
from kvdrop.policy import QueryNeed, ScorerPolicy
from kvdrop.selector import SELECTOR_PARAMS, Selector

__all__ = ["Chunk", "ChunkFactory", "chunk"]


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


# The registered factory: names -> built policies -> this combinator


class ChunkFactory(PolicyFactory):
    """``chunk``: :class:`~kvdrop.combinators.Chunk` of a policy given by name."""

    name = "chunk"
    info = PolicyInfo(
        "chunk",
        "Any scorer policy at chunk granularity (ChunkKV-style), e.g. 'chunk(policy=snapkv)'",
        QueryNeed.NONE,  # as its default inner policy (knorm); the inner policy decides
        (
            Param("policy", str, "knorm", "the scorer policy to run at chunk granularity"),
            *(p for p in SELECTOR_PARAMS if p.name != "chunked"),
            HEAD_DIM,
        ),
        "Runs `policy` with chunked=True: whole chunks are ranked by the sum of their token "
        "scores, so the kept prefix is made of whole server chunks. Every parameter other than "
        "`policy` goes to the inner policy and is validated by it. Needs query tensors if the "
        "inner policy does.",
        {},
    )

    def __call__(self, policy: str = "knorm", **params: Any) -> Chunk:
        name = policy_name("chunk", policy, spec_ok=False)
        return Chunk(build(name, **inner_params(params)))  # type: ignore[arg-type]


chunk = ChunkFactory()
