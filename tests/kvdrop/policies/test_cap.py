"""cap: CAPKV's capacity scores on hand-computed cases, and its RoPE-averaged anchor."""

from __future__ import annotations

import math

import torch

import kvdrop
from kvdrop.policies.cap import CapScorer, capacity_scores
from kvdrop.selector import Selector
from kvdrop_rope import RopeConfig, apply_rope
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext


def test_a_value_direction_no_other_token_covers_scores_highest() -> None:
    anchor = torch.tensor([[1.0, 0.0]])
    keys = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]])  # all aligned: weights 1
    values = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    # A = I + v0 v0^T + v1 v1^T + v2 v2^T = diag(3, 2): leverages 1/3, 1/2, 1/3.
    scores = capacity_scores(anchor, keys, values, tau=5.0, eps=0.0)
    torch.testing.assert_close(scores, torch.tensor([[1 / 3, 1 / 2, 1 / 3]]))


def test_weights_follow_the_alignment_with_the_anchor() -> None:
    anchor = torch.tensor([[1.0, 0.0]])
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # cos 1 and 0: weights 1 and e^-tau
    values = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    w = math.exp(-2.0)
    scores = capacity_scores(anchor, keys, values, tau=2.0, eps=0.0)
    torch.testing.assert_close(scores, torch.tensor([[1 / 2, w / (1 + w)]]))


def test_anchor_is_the_mean_pre_rope_query_under_the_mean_future_rotation() -> None:
    rope = RopeConfig(head_dim=4, theta=100.0)
    pre = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(0))  # [R, Hq, d]
    positions = torch.arange(4, 10)
    post = apply_rope(pre, positions, rope).reshape(6, 8)
    scorer = CapScorer(head_dim=4, n_future_positions=3)
    # The reference's matrix form: R(j) = cos I + sin rotate_half, averaged over j = T..T+2.
    half = torch.zeros(4, 4)
    half[2:, :2], half[:2, 2:] = torch.eye(2), -torch.eye(2)
    cos, sin = rope.cos_sin(torch.arange(10, 13))
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    mean_rot = (cos[:, :, None] * torch.eye(4) + sin[:, :, None] * half).mean(0)
    expected = (pre @ mean_rot.T).mean(0)
    torch.testing.assert_close(scorer.anchor(post, positions, 10, rope), expected)
    torch.testing.assert_close(scorer.anchor(post, positions, 10, None), post.view(6, 2, 4).mean(0))


def test_sinks_are_kept_and_the_context_rope_reaches_the_anchor() -> None:
    kv = torch.randn(2, 1, 12, 4, generator=torch.Generator().manual_seed(1))
    query = torch.randn(1, 1, 12, 4, generator=torch.Generator().manual_seed(2))
    tensors, tokens = {CacheKind.KV: kv, CacheKind.QUERY: query}, list(range(12))
    fn = kvdrop.get("cap", head_dim=4, keep_tokens=6, chunk_size=1, rerotate=False)
    _, kept = fn(tensors, tokens)
    assert kept[:4] == [0, 1, 2, 3] and len(kept) == 6
    rope = RopeConfig(head_dim=4, theta=100.0)
    context = EditContext.of(12, rope=rope.to_json(), query_positions=torch.arange(12))
    with_rope = fn.select_indices(tensors, tokens, context=context)[1]
    selection = Selector(keep_tokens=6, chunk_size=1, n_sink=4).selection(
        12, query_positions=torch.arange(12), rope=rope
    )
    scores = CapScorer(head_dim=4).score(kv, query, selection)
    expected = Selector(keep_tokens=6, chunk_size=1, n_sink=4).select(scores)
    assert with_rope.tolist() == expected.tolist()
