"""finch: the question after a delimiter is observed and kept; position-weighted attention."""

from __future__ import annotations

import torch

import kvdrop
from kvdrop.policies.finch import FinchScorer, position_weighted_mass
from kvdrop.selector import Selector
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext


def test_rows_count_their_position_times() -> None:
    q = torch.zeros(1, 2, 2)  # uniform causal attention
    k = torch.zeros(1, 4, 2)
    mass = position_weighted_mass(q, k, torch.tensor([2, 3]))
    # row 2 puts 1/3 on keys 0..2 (x2), row 3 puts 1/4 on keys 0..3 (x3).
    expected = torch.tensor([[2 / 3 + 3 / 4, 2 / 3 + 3 / 4, 2 / 3 + 3 / 4, 3 / 4]])
    torch.testing.assert_close(mass, expected)


def _case() -> tuple[dict, list[int]]:
    kv = torch.zeros(2, 1, 6, 2)
    kv[0, 0, 2] = torch.tensor([1.0, 0.0])  # the key the question looks at
    query = torch.zeros(1, 1, 6, 2)
    query[0, 0, 4:] = torch.tensor([8.0, 0.0])
    tokens = [10, 11, 12, 99, 13, 14]  # context 10 11 12, delimiter 99, question 13 14
    return {CacheKind.KV: kv, CacheKind.QUERY: query}, tokens


def test_the_question_after_the_delimiter_is_observed_and_kept() -> None:
    tensors, tokens = _case()
    fn = kvdrop.get("finch", delimiter=99, head_dim=2, keep_tokens=3, chunk_size=1, rerotate=False)
    _, kept = fn(tensors, tokens, context=EditContext.of(6))
    assert kept == [12, 13, 14]


def test_without_a_delimiter_the_uncached_tail_is_the_question() -> None:
    tensors, tokens = _case()
    cached = {
        CacheKind.KV: tensors[CacheKind.KV][:, :, :4],
        CacheKind.QUERY: tensors[CacheKind.QUERY],
    }
    fn = kvdrop.get("finch", head_dim=2, keep_tokens=1, chunk_size=1, rerotate=False)
    ctx = EditContext.of(4, prompt_tokens=6, query_positions=torch.arange(6))
    _, kept = fn(cached, tokens[:4], context=ctx)
    assert kept == [12]


def test_the_question_rows_normalise_over_their_own_keys_too() -> None:
    # One question row at position 2 sees keys 0..2 uniformly (1/3 each), counted twice: the
    # context keys 0 and 1 score 2/3 (normalised over the context alone they would score 1).
    scorer = FinchScorer(head_dim=2)
    selection = Selector(keep_tokens=2, chunk_size=1, window=1).selection(3)
    scores = scorer.head_scores(torch.zeros(2, 1, 3, 2), torch.zeros(1, 1, 3, 2), selection)
    torch.testing.assert_close(scores, torch.full((1, 1, 2), 2 / 3))
