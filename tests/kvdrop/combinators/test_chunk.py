"""Chunk: a scorer policy at chunk granularity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.combinators import Chunk


@pytest.mark.parametrize("name", ["snapkv", "knorm", "h2o"])
def test_chunk_variant_is_the_chunked_scorer(
    name: str, inputs: Callable[..., dict[Any, torch.Tensor]]
) -> None:
    tensors = inputs(100, seed=5)
    ref = kvdrop.get(name, keep_tokens=48, chunk_size=16, head_dim=8, chunked=True)
    fn = kvdrop.get(f"chunk(policy={name})", keep_tokens=48, chunk_size=16, head_dim=8)
    out, kept = fn(tensors, list(range(100)))
    ref_out, ref_kept = ref(tensors, list(range(100)))
    assert kept == ref_kept and torch.equal(out, ref_out)
    for i in range(0, 48, 16):  # whole chunks only
        assert kept[i] % 16 == 0 and kept[i : i + 16] == list(range(kept[i], kept[i] + 16))
    assert kvdrop.get("chunk", policy="chunk-halving", chunk_size=16) is not None


def test_chunk_takes_a_built_scorer_policy(inputs: Callable[..., dict[Any, torch.Tensor]]) -> None:
    tensors = inputs(64, seed=2)
    fn = Chunk(kvdrop.get("knorm", keep_tokens=32, chunk_size=8))
    assert (
        fn.selector.chunked
        and fn.name == "chunk(policy=knorm)"
        and not kvdrop.needs_of(fn).reads_queries
    )
    ref = kvdrop.get("knorm", keep_tokens=32, chunk_size=8, chunked=True)
    assert fn(tensors, list(range(64)))[1] == ref(tensors, list(range(64)))[1]
    halving = kvdrop.get("chunk-halving", chunk_size=8)  # already chunk-level: unchanged
    assert Chunk(halving)(tensors, list(range(64)))[1] == halving(tensors, list(range(64)))[1]
    with pytest.raises(kvdrop.PolicyParamError, match="no chunk-level mode"):
        Chunk(kvdrop.get("streaming+knorm"))  # type: ignore[arg-type]
