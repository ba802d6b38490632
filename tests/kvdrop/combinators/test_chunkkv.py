"""ChunkKV: whole small chunks, ranked by the mean of their token scores."""

from __future__ import annotations

import pytest
import torch

import kvdrop
from kvdrop.combinators import ChunkKV
from kvdrop.combinators.chunkkv import chunk_means
from kvdrop_sdk import CacheKind


def test_chunk_means_average_each_chunk_and_the_partial_last() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    torch.testing.assert_close(chunk_means(scores, 2), torch.tensor([1.5, 1.5, 3.5, 3.5, 10.0]))
    torch.testing.assert_close(chunk_means(scores, 8), scores)  # no whole chunk: as is


def test_the_best_chunk_is_kept_whole() -> None:
    kv = torch.zeros(2, 1, 4, 1)
    kv[0, 0, :, 0] = torch.tensor([1.0, 5.0, 2.0, 2.0])  # knorm scores -1 -5 -2 -2
    tensors = {CacheKind.KV: kv}
    plain = kvdrop.get("knorm", keep_tokens=2, chunk_size=1, rerotate=False)
    assert plain(tensors, [0, 1, 2, 3])[1] == [0, 2]
    fn = kvdrop.get("chunkkv(policy=knorm, chunk_length=2)", keep_tokens=2, chunk_size=1)
    fn.rerotate = False
    assert isinstance(fn, ChunkKV) and fn.name == "chunkkv(policy=knorm)"
    assert fn(tensors, [0, 1, 2, 3])[1] == [2, 3]  # chunk means -3, -2


def test_chunkkv_refuses_what_it_cannot_chunk() -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="chunk_length"):
        ChunkKV(kvdrop.get("knorm"), chunk_length=0)  # type: ignore[arg-type]
    with pytest.raises(kvdrop.PolicyParamError, match="no token scores"):
        ChunkKV(kvdrop.get("streaming+knorm"))  # type: ignore[arg-type]
