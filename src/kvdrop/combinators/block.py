"""``Block``: any KV-only scorer policy applied block by block, as a chunked prefill would
(Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments", https://arxiv.org/abs/2504.15364; kvpress's
``BlockPress``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvdrop.combinators.inner import build, inner_info, inner_params, policy_name
from kvdrop.errors import PolicyParamError
from kvdrop.factories import PolicyFactory
from kvdrop.inputs import EditInputs
from kvdrop.params import Param, check_positive_int
from kvdrop.policy import QueryNeed, ScorerPolicy, SelectorPolicy
from kvdrop.selector import Selector
from kvdrop_sdk.query_capture import Needs, needs_of

__all__ = ["Block", "BlockFactory", "block"]

#: BlockPress's block size (kvpress's default).
DEFAULT_BLOCK_SIZE = 128


class Block(SelectorPolicy):
    """``policy`` evicting block by block: the first ``budget`` tokens are kept, then each next
    ``block_size`` tokens join the kept ones and ``policy`` keeps ``budget`` of that union.

    Every round runs ``policy``'s own scorer and selector on the union alone (a scorer that reads
    the whole cache, e.g. keydiff's mean key, sees only what is still kept): its protected
    prefix and sinks are forced in every round, its recent window in the last (the only round
    that ends at the prompt's end). The budget is the policy's, chunk-aligned. Only KV-only
    policies: the queries saved at prefill attended to the whole prompt, not to the kept union.
    """

    def __init__(self, policy: ScorerPolicy, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if not isinstance(policy, ScorerPolicy):
            raise PolicyParamError(
                f"block: policy {policy!r} is a {type(policy).__name__}, not a scorer policy; "
                "expected a KV-only built-in such as knorm or keydiff"
            )
        if policy.queries is not QueryNeed.NONE or policy.token_scores:
            raise PolicyParamError(
                f"block: policy {policy.name!r} reads prefill queries or engine token scores, "
                "which were computed over the whole prompt, not over each block's kept tokens; "
                "expected a KV-only policy (knorm, keydiff, streaming, random, ...)"
            )
        self.policy = policy
        self.block_size = check_positive_int("block", "block_size", block_size)
        self.selector = policy.selector
        self.name = f"block(policy={policy.name})"

    def __repr__(self) -> str:
        return f"Block({self.policy!r}, block_size={self.block_size})"

    @property
    def queries(self) -> QueryNeed:
        return QueryNeed.NONE

    @property
    def needs(self) -> Needs:
        """No queries nor scores; the KV its policy's scorer reads."""
        return Needs(QueryNeed.NONE, False, needs_of(self.policy).kv)

    def with_selector(self, selector: Selector) -> Block:
        return Block(self.policy.with_selector(selector), self.block_size)

    def _select(self, inputs: EditInputs, budget: int) -> torch.Tensor:
        kv, num_tokens = inputs.kv, inputs.num_tokens
        tail = inputs.prompt_tokens - num_tokens
        middle = self.policy.with_selector(dataclasses.replace(self.selector, window=0))
        kept = torch.arange(budget)
        for start in range(budget, num_tokens, self.block_size):
            end = min(start + self.block_size, num_tokens)
            last = end == num_tokens
            part = self.policy if last else middle
            union = torch.cat([kept, torch.arange(start, end)])
            sub = kv.index_select(2, union.to(kv.device))
            scores = part.scores(sub, None, budget)
            chosen = part.selector.select(
                scores,
                budget,
                prompt_tokens=union.numel() + (tail if last else 0),
                protected=inputs.protected,
            )
            kept = union[chosen]
        return kept


# The registered factory: names -> built policies -> this combinator


class BlockFactory(PolicyFactory):
    """``block``: :class:`~kvdrop.combinators.Block` of a KV-only policy given by name."""

    name = "block"
    info = inner_info(
        "block",
        "Block-wise eviction over any KV-only policy, e.g. 'block(policy=keydiff)'",
        Param(
            "block_size",
            int,
            DEFAULT_BLOCK_SIZE,
            "tokens that join the kept ones each round",
            "an int >= 1",
            lambda n: n >= 1,
        ),
        "Keeps the first `budget` tokens, then adds `block_size` tokens at a time and lets the "
        "policy keep `budget` of them (KeyDiff's block-wise prefill, kvpress's BlockPress); "
        "KV-only policies only.",
    )

    def __call__(
        self, policy: str = "knorm", block_size: int = DEFAULT_BLOCK_SIZE, **params: Any
    ) -> Block:
        name = policy_name("block", policy, spec_ok=False)
        return Block(build(name, **inner_params(params)), block_size)  # type: ignore[arg-type]


block = BlockFactory()
