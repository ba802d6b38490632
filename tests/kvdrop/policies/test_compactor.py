"""compactor: kvpress's CompactorPress as leverage blended with non-causal chunked attention
between the kept sinks and recent tokens."""

from __future__ import annotations

import torch

import kvdrop
from kvdrop.policies.compactor import CompactorScorer
from kvdrop.policies.leverage import LeverageScorer
from kvdrop.policies.non_causal_attn import NonCausalAttnScorer
from kvdrop.selector import Selector
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext


def _inputs(tokens: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 2, tokens, 8, generator=gen), torch.randn(1, 2, tokens, 16, generator=gen)


def test_blends_leverage_and_attention_between_the_kept_ends() -> None:
    kv, query = _inputs()
    sel = Selector(n_sink=3, window=2, chunk_size=1, keep_tokens=10).selection(40, head_dim=4)
    scores = CompactorScorer(head_dim=4, chunk_length=8).score(kv, query, sel)
    inner, q_inner = kv[:, :, 3:38], query[:, :, 3:38]
    lev = LeverageScorer(head_dim=4).head_scores(inner, Selector(chunk_size=1).selection(35))
    attn = NonCausalAttnScorer(head_dim=4, chunk_length=8).head_scores(inner, q_inner)
    blended = (1 - 10 / 40) * lev + attn  # blending None, keep_tokens: the fraction dropped
    torch.testing.assert_close(scores[3:38], blended.mean(1).mean(0))
    top = blended.amax(dim=(1, 2)).mean()  # each layer's ends score its max
    torch.testing.assert_close(scores[:3], top.expand(3))
    torch.testing.assert_close(scores[38:], top.expand(2))
    fixed = CompactorScorer(head_dim=4, chunk_length=8, blending=0.0).score(kv, query, sel)
    torch.testing.assert_close(fixed[3:38], attn.mean(1).mean(0))
    # Under keep_ratio the blending is kvpress's compression ratio, 1 - 0.3, not 1 - 12 / 40 of
    # the budget aligned to chunks of 4.
    by_ratio = Selector(n_sink=3, window=2, chunk_size=4, keep_ratio=0.3).selection(40, head_dim=4)
    assert by_ratio.budget == 12
    scores = CompactorScorer(head_dim=4, chunk_length=8).score(kv, query, by_ratio)
    torch.testing.assert_close(scores[3:38], ((1 - 0.3) * lev + attn).mean(1).mean(0))


def test_keeps_the_sinks_and_recent_tokens_through_the_registry() -> None:
    kv, query = _inputs(512)
    fn = kvdrop.get("compactor", keep_ratio=0.5, chunk_size=16, rerotate=False)
    _, index = fn.select_indices(
        {CacheKind.KV: kv, CacheKind.QUERY: query},
        list(range(512)),
        context=EditContext.of(512, head_dim=4),
    )
    assert index.numel() == 256
    assert set(range(8)) <= set(index.tolist()) and set(range(508, 512)) <= set(index.tolist())
