"""The query-agnostic and statistics policies ported from kvpress's presses (cur, lagkv,
leverage, expected-attention): each score formula on a small hand-computed case, and the
pre-RoPE handling on keys and queries rotated with a real RoPE configuration."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.policies.cur import CURScorer
from kvdrop.policies.expected_attention import ExpectedAttentionScorer
from kvdrop.policies.lagkv import LagKVScorer
from kvdrop.policies.leverage import LeverageScorer
from kvdrop.selector import Selection, Selector
from kvdrop_rope import RopeConfig, apply_rope
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext


def _selection(num_tokens: int, n_sink: int = 0, **fields: Any) -> Selection:
    return Selector(n_sink=n_sink, chunk_size=1).selection(num_tokens, **fields)


def _kv(keys: list[list[float]], values: list[list[float]]) -> torch.Tensor:
    return torch.stack([torch.tensor(keys), torch.tensor(values)])[:, None]  # [2, 1, T, D]


def test_cur_is_the_normalised_key_times_value_leverage() -> None:
    kv = _kv([[1, 0], [0, 2], [3, 0], [0, 4]], [[1, 0]] * 4)
    # k2 = 1, 4, 9, 16 and v2 = 1 each, normalised in one local window, multiplied, normalised.
    scores = CURScorer().score(kv, None, _selection(4))
    torch.testing.assert_close(scores, torch.tensor([1.0, 4.0, 9.0, 16.0]) / 30)
    with_sink = CURScorer().score(kv, None, _selection(4, n_sink=1))
    assert with_sink[0] == 1.0
    # Two local windows of 2 tokens: k2 -> (1/5, 4/5), (9/25, 16/25); v2 -> 1/2 each.
    local = CURScorer(local_window_size=2, leverage_type="key").score(kv, None, _selection(4))
    torch.testing.assert_close(local, torch.tensor([1 / 5, 4 / 5, 9 / 25, 16 / 25]) / 2)


def test_cur_random_projection_is_seeded() -> None:
    kv = torch.randn(2, 2, 32, 8, generator=torch.Generator().manual_seed(1))
    a = CURScorer(use_random_leverage=True).score(kv, None, _selection(32))
    b = CURScorer(use_random_leverage=True).score(kv, None, _selection(32))
    c = CURScorer(use_random_leverage=True, seed=1).score(kv, None, _selection(32))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_lagkv_scores_each_partition_against_the_next() -> None:
    # lag 2, no sinks, 6 tokens: partitions [0, 1], [2, 3], [4, 5]; the last one scores 1.
    keys = [[0, 0], [1, 3], [0, 0], [2, 2], [0, 1], [4, 0]]
    kv = _kv(keys, keys)
    scores = LagKVScorer(lag_size=2, cross_scoring=True).score(kv, None, _selection(6))
    # Partition 0 scaled by partition 1's range (0..2 in both channels): token 1 -> (0.5, 1.5),
    # std 1/sqrt(2); token 0 -> std 0. Partition 1 by partition 2's (0..4, 0..1): token 2 ->
    # (0, 0), token 3 -> (0.5, 2), std 1.5/sqrt(2).
    p0 = torch.tensor([0.0, 1 / math.sqrt(2)]).softmax(0)
    p1 = torch.tensor([0.0, 1.5 / math.sqrt(2)]).softmax(0)
    torch.testing.assert_close(scores, torch.cat([p0, p1, torch.ones(2)]))
    ranked = LagKVScorer(lag_size=2).score(kv, None, _selection(6))
    torch.testing.assert_close(ranked, torch.tensor([0.0, 0.5, 0.0, 0.5, 1.0, 1.0]))


def test_lagkv_keeps_the_sinks_and_short_prompts_by_recency() -> None:
    kv = torch.randn(2, 1, 10, 4, generator=torch.Generator().manual_seed(0))
    short = LagKVScorer(lag_size=4).score(kv, None, _selection(10, n_sink=4))
    torch.testing.assert_close(short, torch.tensor([1.0] * 4 + [i / 6 for i in range(6)]))
    kv = torch.randn(2, 1, 14, 4, generator=torch.Generator().manual_seed(0))
    scores = LagKVScorer(lag_size=4).score(kv, None, _selection(14, n_sink=2))
    # Partitions [2, 6), [6, 10) are scored; the last one, [10, 14), is kept like the sinks.
    assert scores[:2].tolist() == [1.0, 1.0] and scores[10:].eq(1.0).all()
    assert scores[2:10].lt(1.0).all()


def test_leverage_is_the_z_scored_hat_diagonal_of_centred_keys() -> None:
    # One head of width 1: centred keys -2, -1, 0, 3, leverage x^2 / sum x^2 (up to the sketch's
    # scale and the 1e-2 jitter); z-scoring removes the scale.
    kv = _kv([[1.0], [2.0], [3.0], [6.0]], [[0.0]] * 4)
    scores = LeverageScorer().score(kv, None, _selection(4))
    lev = torch.tensor([4.0, 1.0, 0.0, 9.0])
    torch.testing.assert_close(scores, (lev - lev.mean()) / lev.std(), atol=2e-3, rtol=0)


def test_leverage_reads_the_keys_before_rope() -> None:
    rope = RopeConfig(head_dim=8)
    raw = torch.randn(24, 2, 8, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(24)
    rotated = apply_rope(raw, positions, rope)
    kv_raw = torch.stack([raw.reshape(24, 16), raw.reshape(24, 16)])[:, None]
    kv_rot = torch.stack([rotated.reshape(24, 16), rotated.reshape(24, 16)])[:, None]
    scorer = LeverageScorer(head_dim=8)
    plain = scorer.score(kv_raw, None, _selection(24))
    undone = scorer.score(kv_rot, None, _selection(24, rope=rope, positions=positions))
    as_cached = scorer.score(kv_rot, None, _selection(24))
    torch.testing.assert_close(undone, plain, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(as_cached, plain, atol=1e-2)


def _ea(**params: object) -> ExpectedAttentionScorer:
    base = {"head_dim": 2, "use_covariance": False, "use_vnorm": False}
    return ExpectedAttentionScorer(**(base | params))  # type: ignore[arg-type]


def test_expected_attention_mean_term_is_a_softmax_over_the_keys() -> None:
    kv = _kv([[0, 0], [math.sqrt(2) * math.log(3), 0]], [[1, 0], [0, 2]])
    query = torch.tensor([[1.0, 0.0], [1.0, 0.0]])[None, None]  # [1, 1, R, Dq]
    sel = _selection(2, query_positions=torch.arange(2))
    torch.testing.assert_close(_ea().score(kv, query, sel), torch.tensor([0.25, 0.75]))
    # ||v|| rescales: 0.25 * 1, 0.75 * 2.
    torch.testing.assert_close(_ea(use_vnorm=True).score(kv, query, sel), torch.tensor([0.25, 1.5]))


def test_expected_attention_covariance_term() -> None:
    # Queries (1, 1) and (1, -1): mean (1, 0), covariance diag(0, 1). Key (0, 2): 2^2 / (2 * 2).
    kv = _kv([[0, 0], [0, 2]], [[1, 0], [1, 0]])
    query = torch.tensor([[1.0, 1.0], [1.0, -1.0]])[None, None]
    sel = _selection(2, query_positions=torch.arange(2))
    e = math.e
    expected = torch.tensor([1 / (1 + e), e / (1 + e)])
    torch.testing.assert_close(_ea(use_covariance=True).score(kv, query, sel), expected)


def test_expected_attention_sinks_score_above_every_key() -> None:
    kv = torch.randn(2, 1, 8, 4, generator=torch.Generator().manual_seed(0))
    query = torch.randn(1, 1, 8, 4, generator=torch.Generator().manual_seed(1))
    sel = _selection(8, n_sink=2, query_positions=torch.arange(8))
    scores = _ea(head_dim=4, use_covariance=True, use_vnorm=True).score(kv, query, sel)
    assert scores[:2].min() > scores[2:].max()


def test_expected_attention_moves_the_query_mean_to_the_next_positions() -> None:
    # Every query is q0 before RoPE; with one future position the expected logit of a key is
    # the true logit of q0 at position N (the prompt's length) against the cached (rotated) key.
    rope = RopeConfig(head_dim=4, theta=100.0)
    n = 6
    q0 = torch.tensor([1.0, -0.5, 0.25, 2.0])
    raw_keys = torch.randn(n, 1, 4, generator=torch.Generator().manual_seed(2))
    keys = apply_rope(raw_keys, torch.arange(n), rope)[:, 0]
    queries = apply_rope(q0.expand(n, 1, 4), torch.arange(n), rope)[:, 0]
    kv = torch.stack([keys, keys])[:, None]
    sel = _selection(n, query_positions=torch.arange(n), rope=rope, positions=torch.arange(n))
    scores = _ea(head_dim=4, n_future_positions=1).score(kv, queries[None, None], sel)
    q_next = apply_rope(q0[None, None], torch.tensor([n]), rope)[0, 0]
    torch.testing.assert_close(scores, (keys @ q_next / 2).softmax(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["cur", "lagkv", "leverage", "expected-attention"])
def test_through_the_registry_with_the_layouts_rope(name: str) -> None:
    rope = RopeConfig(head_dim=8)
    kv = torch.randn(2, 2, 512, 16, generator=torch.Generator().manual_seed(0))
    tensors = {CacheKind.KV: kv, CacheKind.QUERY: torch.randn(1, 2, 512, 32)}
    context = EditContext.of(512, head_dim=8, rope=rope.to_json())
    fn = kvdrop.get(name, keep_ratio=0.5)
    out, kept = fn(tensors, list(range(512)), context=context)
    assert out.shape == (2, 2, 256, 16) and len(kept) == 256
