"""Compose: a union of built scorer policies under one budget."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.combinators import Chunk, Compose
from kvdrop_sdk import CacheKind


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("snapkv", {"head_dim": 8, "window": 5}),
        ("streaming", {"n_sink": 3}),
        ("chunk-halving", {}),
        ("knorm", {"head_dim": 8, "chunked": True, "window": 9}),
        ("rkv", {"head_dim": 8}),
        ("h2o", {"head_dim": 8}),  # its recent share is of the part's budget, not a default
    ],
)
def test_one_part_equals_the_policy_alone(
    name: str, params: dict[str, Any], inputs: Callable[..., dict[Any, torch.Tensor]]
) -> None:
    tensors = inputs(96, seed=3)
    alone = kvdrop.get(name, keep_tokens=40, chunk_size=8, **params)(tensors, list(range(96)))
    fn = kvdrop.get("compose", policies=[{"name": name, **params}], keep_tokens=40, chunk_size=8)
    out, kept = fn(tensors, list(range(96)))
    assert kept == alone[1] and torch.equal(out, alone[0])


def test_union_gives_each_part_its_share_in_order(
    inputs: Callable[..., dict[Any, torch.Tensor]],
) -> None:
    tensors = inputs(128, seed=4)
    kv = tensors[CacheKind.KV]
    fn = kvdrop.get("streaming(n_sink=4)+knorm", keep_tokens=64, chunk_size=16)
    assert isinstance(fn, Compose) and fn.quotas(64) == [32, 32]
    _, kept = fn(tensors, list(range(128)))
    streaming_part = set(range(4)) | set(range(100, 128))  # sinks, then the most recent
    norms = kv[0].norm(dim=-1).mean(0)  # knorm: lowest mean L2 norm over layers
    rest = [i for i in torch.argsort(norms, stable=True).tolist() if i not in streaming_part]
    assert kept == sorted(streaming_part | set(rest[:32]))


def test_weights_split_the_budget_in_tokens_and_chunked_parts_in_whole_chunks() -> None:
    """Only the union must fill whole chunks, so shares are tokens (two parts share a one-chunk
    budget: issue 35's kvzip+snapkv at keep 0.25 of 1,024 tokens gave snapkv nothing when shares
    were chunks); a part that keeps whole chunks gets whole chunks."""
    fn = kvdrop.get("compose", policies="streaming+knorm", weights=[3, 1], chunk_size=16)
    assert isinstance(fn, Compose) and fn.share_unit == 1
    assert fn.quotas(64) == [48, 16]
    assert fn.quotas(16) == [12, 4]
    thirds = kvdrop.get("compose", policies="streaming+knorm+keydiff", chunk_size=8)
    assert isinstance(thirds, Compose) and thirds.quotas(32) == [11, 11, 10]
    chunked = kvdrop.get("compose", policies="streaming+chunk(policy=knorm)", chunk_size=16)
    assert isinstance(chunked, Compose) and chunked.share_unit == 16
    assert chunked.quotas(16) == [16, 0] and chunked.quotas(48) == [32, 16]


def test_built_policies_compose_like_the_spec(
    inputs: Callable[..., dict[Any, torch.Tensor]],
) -> None:
    tensors = inputs(96, seed=7)
    parts = [
        kvdrop.get("streaming", n_sink=2, chunk_size=8),
        Chunk(kvdrop.get("snapkv", head_dim=8, window=4, chunk_size=8)),
    ]
    union = Compose(parts, weights=[1, 2], keep_tokens=48)
    assert union.name == "streaming+chunk(policy=snapkv)" and kvdrop.needs_of(union).reads_queries
    spec = kvdrop.get(
        "streaming(n_sink=2)+chunk(policy=snapkv, window=4)",
        weights=[1, 2],
        keep_tokens=48,
        chunk_size=8,
        head_dim=8,
    )
    assert union(tensors, list(range(96)))[1] == spec(tensors, list(range(96)))[1]


def test_compose_checks_its_parts() -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="chunk sizes"):
        Compose([kvdrop.get("streaming", chunk_size=8), kvdrop.get("knorm", chunk_size=16)])
    with pytest.raises(kvdrop.PolicyParamError, match="not a scorer policy"):
        Compose([kvdrop.get("knorm"), kvdrop.get("budget")])  # type: ignore[list-item]
    with pytest.raises(kvdrop.PolicyParamError, match="no parts"):
        Compose([])


def test_a_part_left_without_budget_is_reported(
    inputs: Callable[..., dict[Any, torch.Tensor]],
) -> None:
    """One chunk of budget for a part and a chunked part: the first takes it, the chunked one
    gets nothing, and the PolicyWarning says so (rather than silently running streaming alone).
    Two token-scored parts share the chunk."""
    fn = kvdrop.get("streaming+chunk(policy=knorm)", keep_ratio=0.25, chunk_size=16, rerotate=False)
    with pytest.warns(kvdrop.PolicyWarning, match=r"1 chunk\(s\) .* leaves chunk\(policy=knorm\)"):
        _, kept = fn(inputs(64), list(range(64)))
    alone = kvdrop.get("streaming", keep_tokens=16, chunk_size=16)(inputs(64), list(range(64)))
    assert kept == alone[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(inputs(128), list(range(128)))  # 32 tokens: one chunk each, no warning
        shared = kvdrop.get("streaming+knorm", keep_ratio=0.25, chunk_size=16, rerotate=False)
        _, kept = shared(inputs(64), list(range(64)))  # 8 tokens each
    assert len(kept) == 16 and set(kept) != set(alone[1])


def test_the_warning_of_a_compose_of_many_parts_is_capped(
    inputs: Callable[..., dict[Any, torch.Tensor]],
) -> None:
    """Issue 33 A: a compose of more parts than chunks named every part and weight in one
    warning (3,000 terms: a 53,632-character line); each field is a capped log field now."""
    fn = kvdrop.get("+".join(["knorm"] * 300), keep_tokens=16, chunk_size=16, rerotate=False)
    with pytest.warns(kvdrop.PolicyWarning, match=r"without tokens \(284 of 300 parts\)") as rec:
        fn(inputs(64), list(range(64)))
    (message,) = {str(w.message) for w in rec}
    assert len(message) < 1000 and "...(+" in message, len(message)
