"""Budget: a per-request budget by prompt length over a built policy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.combinators import Budget
from kvdrop.combinators.budget import parse_tiers
from kvdrop_sdk import CacheKind


def test_budget_tiers_pick_the_budget_per_request(
    inputs: Callable[..., dict[Any, torch.Tensor]],
) -> None:
    fn = kvdrop.get("budget", policy="knorm", tiers="64:1.0,128:0.5,*:16", chunk_size=16)
    assert isinstance(fn, Budget)
    for t, expected in [(64, 64), (128, 64), (512, 16)]:
        out, kept = fn(inputs(t), list(range(t)))
        assert len(kept) == expected == out.shape[2]
    short = inputs(48)
    out, kept = fn(short, list(range(48)))
    assert out is short[CacheKind.KV] and kept == list(range(48)), "keep-all tier: unchanged"


def test_budget_rule_and_default(inputs: Callable[..., dict[Any, torch.Tensor]]) -> None:
    fn = kvdrop.get("budget", policy="streaming+knorm", rule=lambda t: t // 4, chunk_size=8)
    _, kept = fn(inputs(128), list(range(128)))
    assert len(kept) == 32
    same = kvdrop.get("budget", policy="knorm", keep_tokens=24, chunk_size=8)
    plain = kvdrop.get("knorm", keep_tokens=24, chunk_size=8)
    assert same(inputs(64), list(range(64)))[1] == plain(inputs(64), list(range(64)))[1]
    bad = kvdrop.get("budget", policy="knorm", rule=lambda t: "half")
    with pytest.raises(kvdrop.PolicyInputError, match="budget rule returned 'half'"):
        bad(inputs(64), list(range(64)))


@pytest.mark.parametrize(
    ("tiers", "match"),
    [
        ("64:0.5", "must end with a '\\*'"),
        ("64:0.5,32:0.25,*:0.1", "increasing"),
        ("64:1.5,*:0.5", "ratio"),
        ("64-0.5,*:0.5", "no ':'"),
        ("x:0.5,*:0.5", "expected an int"),
        ("*:0.5,64:0.5", "after"),
    ],
)
def test_bad_tiers(tiers: str, match: str) -> None:
    with pytest.raises(kvdrop.PolicyParamError, match=match):
        parse_tiers(tiers)
    with pytest.raises(kvdrop.PolicyParamError):
        kvdrop.get("budget", tiers=tiers)


def test_budget_rejects_tiers_and_rule_together() -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="not both"):
        kvdrop.get("budget", tiers="*:0.5", rule=lambda t: 0.5)


def test_budget_takes_a_built_policy(inputs: Callable[..., dict[Any, torch.Tensor]]) -> None:
    union = kvdrop.get("streaming+knorm", chunk_size=8)
    fn = Budget(union, tiers="32:1.0,*:16")
    assert fn.name == "budget(streaming+knorm)" and not kvdrop.needs_of(fn).reads_queries
    assert len(fn(inputs(32), list(range(32)))[1]) == 32
    assert len(fn(inputs(96), list(range(96)))[1]) == 16
    h2o = Budget(kvdrop.get("h2o", head_dim=8, chunk_size=8, recent_ratio=0.5), rule=lambda t: 16)
    _, kept = h2o(inputs(96), list(range(96)))
    assert kept[-8:] == list(range(88, 96)), "h2o's recent half of the per-request budget"
    with pytest.raises(kvdrop.PolicyParamError, match="something with a selector"):
        Budget(fn)  # type: ignore[arg-type]
