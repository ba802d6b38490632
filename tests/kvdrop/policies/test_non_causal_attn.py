"""non-causal-attn: Compactor's chunked non-causal attention scores on hand-computed cases."""

from __future__ import annotations

import pytest
import torch

import kvdrop
from kvdrop.policies.non_causal_attn import chunk_column_sums
from kvdrop_sdk import CacheKind


def test_queries_see_later_keys_of_their_chunk_only() -> None:
    q = torch.tensor([[[10.0, 0.0], [0.0, 0.0], [5.0, 0.0]]])  # one head, 3 tokens
    k = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])
    sums = chunk_column_sums(q, k, 2, partial="mask")
    # chunk [0, 1]: query 0 puts softmax([0, 10]) on keys 0, 1 (a causal mask would give key 1
    # nothing), query 1 puts [1/2, 1/2]; chunk [2]: one query on one key.
    p = torch.softmax(torch.tensor([0.0, 10.0]), 0)
    expected = torch.tensor([[p[0] + 0.5, p[1] + 0.5, 1.0]])
    torch.testing.assert_close(sums, expected)


def test_a_partial_last_chunk_is_padded_as_kvpress_pads_it() -> None:
    # kvpress 0.5.5 pads the last chunk [2] to 2 tokens with a zero query and a zero key whose
    # logit it sets to -1e-9 (not masked): query 2 (q.k = 5) splits softmax([5, -1e-9]) over its
    # key and the pad; the zero query adds its near-uniform row softmax([0, -1e-9]).
    q = torch.tensor([[[10.0, 0.0], [0.0, 0.0], [5.0, 0.0]]])
    k = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])
    sums = chunk_column_sums(q, k, 2)
    p = torch.softmax(torch.tensor([0.0, 10.0]), 0)
    last = (
        torch.softmax(torch.tensor([5.0, -1e-9]), 0)[0]
        + torch.softmax(torch.tensor([0.0, -1e-9]), 0)[0]
    )
    torch.testing.assert_close(sums, torch.tensor([[p[0] + 0.5, p[1] + 0.5, float(last)]]))
    whole = chunk_column_sums(q[:, :2], k[:, :2], 2)  # no partial chunk: both ways agree
    torch.testing.assert_close(whole, chunk_column_sums(q[:, :2], k[:, :2], 2, partial="mask"))
    with pytest.raises(kvdrop.PolicyParamError, match="partial"):
        kvdrop.get("non-causal-attn", partial="zero")


def test_scores_are_value_weighted_pooled_and_z_normalised() -> None:
    # Zero queries attend uniformly inside each 2-token chunk: every key gets 1 in all.
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    kv = torch.zeros(2, 1, 4, 2)
    kv[1, 0, :, 0] = values
    query = torch.zeros(1, 1, 4, 2)
    fn = kvdrop.get(
        "non-causal-attn", head_dim=2, chunk_length=2, keep_tokens=1, chunk_size=1, rerotate=False
    )
    pooled = torch.tensor([(0 + 1 + 2) / 3, (1 + 2 + 3) / 3, (2 + 3 + 4) / 3, (3 + 4 + 0) / 3])
    expected = (pooled - pooled.mean()) / pooled.std()
    torch.testing.assert_close(fn.scores(kv, query), expected)
    _, kept = fn({CacheKind.KV: kv, CacheKind.QUERY: query}, [5, 6, 7, 8])
    assert kept == [7]


def test_needs_every_cached_query() -> None:
    assert kvdrop.describe("non-causal-attn").queries is kvdrop.QueryNeed.FULL
    with pytest.raises(kvdrop.PolicyParamError, match="chunk_length"):
        kvdrop.get("non-causal-attn", chunk_length=0)
