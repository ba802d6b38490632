"""Block: a KV-only scorer policy applied block by block to the kept tokens plus the next block."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvdrop
from kvdrop.combinators import Block
from kvdrop.policy import Scorer, ScorerPolicy
from kvdrop.selector import Selector
from kvdrop_sdk import CacheKind

SEEN: list[list[float]] = []


@dataclass(frozen=True)
class _Recording(Scorer):
    """Scores each token by its distance from the mean key it is scored with (keydiff-like)."""

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        x = kv[0, 0, :, 0].float()
        SEEN.append(x.tolist())
        return (x - x.mean()).abs()


def test_rounds_score_the_kept_tokens_plus_the_next_block() -> None:
    SEEN.clear()
    kv = torch.zeros(2, 1, 6, 1)
    kv[0, 0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 11.0])
    inner = ScorerPolicy("far", _Recording(), Selector(keep_tokens=2, chunk_size=1))
    fn = Block(inner, block_size=2)
    fn.rerotate = False
    _, kept = fn({CacheKind.KV: kv}, list(range(6)))
    # round 1: [0, 1, 2, 3] mean 1.5 -> 0 and 3 (ties: earlier first);
    # round 2: [0, 3, 10, 11] mean 6 -> 0 (6) and 11 (5).
    assert SEEN == [[0.0, 1.0, 2.0, 3.0], [0.0, 3.0, 10.0, 11.0]]
    assert kept == [0, 5]
    inner.rerotate = False  # scored once over all six (mean 4.5): 10 and 11
    assert inner({CacheKind.KV: kv}, list(range(6)))[1] == [4, 5]


def test_a_token_wise_scorer_keeps_what_it_keeps_without_blocks() -> None:
    kv = torch.randn(2, 2, 50, 8, generator=torch.Generator().manual_seed(3))
    plain = kvdrop.get("knorm", keep_tokens=16, chunk_size=4, n_sink=2, window=4, rerotate=False)
    fn = kvdrop.get("block(policy=knorm, block_size=7)", keep_tokens=16, chunk_size=4, n_sink=2)
    fn.rerotate = False
    ref = kvdrop.get("knorm", keep_tokens=16, chunk_size=4, n_sink=2, rerotate=False)
    assert fn({CacheKind.KV: kv}, list(range(50)))[1] == ref({CacheKind.KV: kv}, list(range(50)))[1]
    windowed = Block(plain, block_size=7)
    windowed.rerotate = False
    kept = windowed({CacheKind.KV: kv}, list(range(50)))[1]
    assert kept[:2] == [0, 1] and kept[-4:] == [46, 47, 48, 49]


def test_block_refuses_query_policies() -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="KV-only"):
        Block(kvdrop.get("snapkv"))  # type: ignore[arg-type]
    with pytest.raises(kvdrop.PolicyParamError, match="block_size"):
        kvdrop.get("block(policy=knorm, block_size=0)")
