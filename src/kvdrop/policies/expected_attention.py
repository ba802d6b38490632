"""``expected-attention``: the attention future queries are expected to pay each key (Devoto
et al., 2025)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    check_query_shapes,
    group_heads,
    head_agg_param,
    layer_agg_param,
    query_head_dim,
    reduce,
)
from kvdrop.policies._prerope import head_rows, prerope
from kvdrop.policy import QueryNeed, Scorer
from kvdrop.selector import Selection
from kvdrop_rope import RopeConfig, rotate

__all__ = ["ExpectedAttentionScorer", "expected_attention"]


@dataclass(frozen=True)
class ExpectedAttentionScorer(Scorer):
    """Expected Attention (Devoto et al., 2025, arXiv:2510.00636; kvpress
    ``ExpectedAttentionPress``): score keys by the attention the next queries should pay them.

    Per layer and query head, the saved query rows (all but those at the first ``n_sink``
    positions) are rotated back to before RoPE; their mean ``mu`` and covariance ``S`` are moved
    by the RoPE rotation averaged over the ``n_future_positions`` positions after the prompt
    (``R``: ``mu <- R mu``, ``S <- R S R^T``). A cached key's expected logit is
    ``k.mu / sqrt(d) + k^T S k / (2 d)`` (the log of E[exp(q.k / sqrt(d))] for Gaussian
    queries; ``use_covariance=False`` drops the second term); softmaxed over the keys after the
    sinks, averaged over each GQA group, times ``||v||`` (plus ``epsilon``) when ``use_vnorm``;
    the sinks score the layer's max + 1. Then combined over KV heads and layers.

    kvpress computes the statistics from every prompt query; kvdrop from the query rows the
    engine saves (by default the last 64 and every 64th position), so the mean and covariance
    are estimates from fewer rows. Without RoPE parameters the rows are used as cached and not
    moved (no ``R``).
    """

    queries = QueryNeed.WINDOW
    needs_selection = True  # reads n_sink, the prompt length, RoPE and the rows' positions
    head_dim: int | None = query_head_dim()
    n_future_positions: int = param(
        512,
        "future positions the RoPE rotation is averaged over",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
        serve_max=8192,  # one rotated copy per position (4,000,000: +401 MB)
    )
    use_covariance: bool = param(True, "include the query covariance term")
    use_vnorm: bool = param(True, "multiply by the value norm")
    epsilon: float = param(
        0.0,
        "added to the attention before the value-norm rescale",
        allowed="a float >= 0",
        check=lambda x: x >= 0,
    )
    head_agg: str = head_agg_param()
    layer_agg: str = layer_agg_param()

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        assert self.head_dim is not None
        check_query_shapes("expected-attention", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None and self.head_dim is not None
        d, sink = self.head_dim, min(selection.n_sink, kv.shape[2] - 1)
        qpos = selection.query_positions
        qpos = torch.arange(query.shape[2]) if qpos is None else qpos.to("cpu")
        rows = (qpos >= selection.n_sink).nonzero().squeeze(1)
        if rows.numel() == 0:
            rows = torch.arange(qpos.numel())
        rope = (
            selection.rope if selection.rope is not None and selection.rope.head_dim == d else None
        )
        future = (
            None
            if rope is None
            else _mean_rotation(rope, selection.total_tokens, self.n_future_positions, kv.device)
        )
        per_layer = []
        for layer in range(kv.shape[1]):
            q = query[0, layer].index_select(0, rows.to(query.device))
            q = prerope(q, qpos[rows], rope, d)  # [Hq, n, d]
            keys = head_rows(kv[0, layer, sink:], d)  # [Hkv, T - sink, d]
            scores = self._attention(q, keys, future, rope)
            if self.use_vnorm:
                scores = (scores + self.epsilon) * head_rows(kv[1, layer, sink:], d).norm(dim=-1)
            top = scores.max() + 1
            full = torch.cat([top.expand(scores.shape[0], sink), scores], dim=1)
            per_layer.append(reduce(full, 0, self.head_agg))
        return reduce(torch.stack(per_layer), 0, self.layer_agg)

    def _attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        future: tuple[torch.Tensor, torch.Tensor] | None,
        rope: RopeConfig | None,
    ) -> torch.Tensor:
        """``[Hkv, T']``: the expected softmax attention of each key, GQA groups averaged."""
        d = q.shape[-1]
        mu = q.mean(dim=1)  # [Hq, d]
        centred = q - mu[:, None]
        cov = centred.transpose(1, 2) @ centred / q.shape[1]  # [Hq, d, d]
        if future is not None and rope is not None:
            mu = _apply(mu, future, rope)
            cov = _apply(_apply(cov, future, rope).transpose(1, 2), future, rope)
        group = q.shape[0] // keys.shape[0]
        k = keys.repeat_interleave(group, dim=0)  # [Hq, T', d]
        logits = (k @ mu[:, :, None]).squeeze(-1) / math.sqrt(d)
        if self.use_covariance:
            logits = logits + ((k @ cov) * k).sum(-1) / d / 2
        return group_heads(logits.softmax(dim=-1), keys.shape[0], "mean")


def _mean_rotation(
    rope: RopeConfig, start: int, count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[1, rotary_dim / 2]`` averaged over positions ``start .. start+count-1``:
    the averaged rotation matrix ``R`` is linear in them."""
    positions = torch.arange(start, start + count)
    cos, sin = rope.cos_sin(positions, start + count)
    return cos.mean(0, keepdim=True).to(device), sin.mean(0, keepdim=True).to(device)


def _apply(
    x: torch.Tensor, future: tuple[torch.Tensor, torch.Tensor], rope: RopeConfig
) -> torch.Tensor:
    """``x @ R^T`` for ``x [..., d]`` (each last-dim row rotated by the averaged ``R``)."""
    rows = x.reshape(-1, 1, x.shape[-1])
    return rotate(rows, future[0], future[1], rope).reshape(x.shape)


expected_attention = ScorerFactory(
    "expected-attention",
    ExpectedAttentionScorer,
    "Expected Attention: keep keys future queries should attend to (query statistics + RoPE)",
    defaults={"n_sink": 4},
)
