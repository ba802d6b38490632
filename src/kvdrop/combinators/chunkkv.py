"""``ChunkKV``: any scorer policy choosing small semantic chunks instead of tokens (Liu et al.,
2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", https://arxiv.org/abs/2502.00299; kvpress's ``ChunkKVPress``)."""

from __future__ import annotations

from typing import Any

import torch

from kvdrop.combinators.inner import build, inner_info, inner_params, policy_name
from kvdrop.errors import PolicyParamError
from kvdrop.factories import PolicyFactory
from kvdrop.inputs import EditInputs
from kvdrop.params import Param, check_positive_int
from kvdrop.policy import ScorerPolicy
from kvdrop.selector import Selector

__all__ = ["ChunkKV", "ChunkKVFactory", "chunk_means", "chunkkv"]

#: ChunkKV's chunk length (the paper's and kvpress's default).
DEFAULT_CHUNK_LENGTH = 20


def chunk_means(scores: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """``[T]``: each token scored by the mean of its chunk (tokens ``[c*i, c*(i+1))``; a partial
    last chunk averages its own tokens); ``scores`` as they are when ``T < chunk_length``."""
    num_tokens = scores.shape[0]
    if num_tokens < chunk_length:
        return scores
    starts = torch.arange(0, num_tokens, chunk_length)
    sums = torch.zeros(starts.numel(), dtype=scores.dtype).index_add_(
        0, torch.arange(num_tokens) // chunk_length, scores
    )
    counts = (num_tokens - starts).clamp(max=chunk_length).to(scores.dtype)
    return (sums / counts).repeat_interleave(counts.long())


class ChunkKV(ScorerPolicy):
    """``policy`` keeping whole chunks of ``chunk_length`` tokens (20 by default), the best
    chunks first by the mean of their token scores.

    Each token is scored by its chunk's mean, so the policy's own selector keeps its forced
    tokens (protected, recent window, sinks) first, then whole chunks, best first (equal means:
    the earlier chunk). kvpress keeps ``int(chunks * keep_ratio)`` whole chunks; kvdrop's budget
    is a multiple of the server's chunk size, so the last chunk taken may be cut (chunk
    alignment). Unlike :class:`~kvdrop.combinators.Chunk` (whole server chunks by their score
    sums) the chunks are small and independent of the server's.
    """

    def __init__(self, policy: ScorerPolicy, chunk_length: int = DEFAULT_CHUNK_LENGTH) -> None:
        if not isinstance(policy, ScorerPolicy):
            raise PolicyParamError(
                f"chunkkv: policy {policy!r} is a {type(policy).__name__} and has no token "
                "scores to average per chunk; expected a scorer policy "
                "(`kvdrop describe NAME` lists its parameters)"
            )
        self.policy = policy
        self.chunk_length = check_positive_int("chunkkv", "chunk_length", chunk_length)
        super().__init__(f"chunkkv(policy={policy.name})", policy.scorer, policy.selector)

    def __repr__(self) -> str:
        return f"ChunkKV({self.policy!r}, chunk_length={self.chunk_length})"

    def with_selector(self, selector: Selector) -> ChunkKV:
        return ChunkKV(self.policy.with_selector(selector), self.chunk_length)

    def scores(
        self,
        kv: torch.Tensor,
        query: torch.Tensor | None,
        budget: int | None = None,
        *,
        inputs: EditInputs | None = None,
    ) -> torch.Tensor:
        """The inner policy's ``[T]`` scores, each replaced by its chunk's mean."""
        token_scores = super().scores(kv, query, budget, inputs=inputs)
        return chunk_means(token_scores, self.chunk_length)


# The registered factory: names -> built policies -> this combinator


class ChunkKVFactory(PolicyFactory):
    """``chunkkv``: :class:`~kvdrop.combinators.ChunkKV` of a policy given by name."""

    name = "chunkkv"
    info = inner_info(
        "chunkkv",
        "ChunkKV: any scorer policy keeping whole small chunks, e.g. 'chunkkv(policy=snapkv)'",
        Param(
            "chunk_length",
            int,
            DEFAULT_CHUNK_LENGTH,
            "tokens per chunk; chunks are ranked by the mean of their token scores",
            "an int >= 1",
            lambda n: n >= 1,
        ),
        "Scores each token by the mean of its chunk of `chunk_length` tokens (ChunkKV, Liu et "
        "al. 2025), so whole chunks are kept, best first, after the policy's forced tokens; "
        "the last chunk taken may be cut to the chunk-aligned budget.",
    )

    def __call__(
        self, policy: str = "knorm", chunk_length: int = DEFAULT_CHUNK_LENGTH, **params: Any
    ) -> ChunkKV:
        name = policy_name("chunkkv", policy, spec_ok=False)
        return ChunkKV(build(name, **inner_params(params)), chunk_length)  # type: ignore[arg-type]


chunkkv = ChunkKVFactory()
