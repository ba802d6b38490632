"""``cap``: CAPKV's capacity scores -- a token's query relevance times its value's leverage in
a relevance-weighted capacity matrix (https://arxiv.org/abs/2604.25975; kvpress's
``CapPress``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdrop.attention import heads_f32
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
from kvdrop.policies._prerope import prerope
from kvdrop.policy import QueryNeed, Scorer
from kvdrop.selector import Selection
from kvdrop_rope import RopeConfig, apply_rope

__all__ = ["CapScorer", "cap", "capacity_scores"]


def capacity_scores(
    anchor: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tau: float, eps: float
) -> torch.Tensor:
    """``[Hq, T]`` CAPKV scores ``s_i = w_i * v_i^T A^-1 v_i`` with ``A = I + sum_i w_i v_i v_i^T``
    and ``w_i = exp(tau * cos(k_i, anchor) - max)`` (``+ eps`` inside ``A``), per query head.

    ``anchor`` ``[Hq, d]``; ``keys``, ``values`` ``[Hkv, T, d]`` float32 (GQA: repeated).
    """
    group = anchor.shape[0] // keys.shape[0]
    k = F.normalize(keys.repeat_interleave(group, dim=0), dim=-1)
    v = values.repeat_interleave(group, dim=0)
    statistic = torch.einsum("hd,htd->ht", F.normalize(anchor, dim=-1), k).clamp(-1.0, 1.0)
    logits = tau * statistic
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    scaled = v * torch.sqrt(weights + eps).unsqueeze(-1)
    eye = torch.eye(v.shape[-1], dtype=v.dtype, device=v.device)
    capacity = eye + scaled.transpose(1, 2) @ scaled  # [Hq, d, d]
    solution = torch.linalg.solve(capacity, v.transpose(1, 2))  # [Hq, d, T]
    return weights * (v.transpose(1, 2) * solution).sum(dim=1)


@dataclass(frozen=True)
class CapScorer(Scorer):
    """CAPKV (kvpress ``CapPress``): relevance to the historical query, times capacity leverage.

    Per layer: the anchor is the mean of the query rows after the ``n_sink`` sinks, each taken
    back to its pre-RoPE form and rotated by the mean RoPE rotation of the next
    ``n_future_positions`` positions (the model's RoPE, ``Selection.rope``; with none known, the
    rows as saved); then
    :func:`capacity_scores` over the cached tokens after the sinks, averaged over each GQA
    group. Sinks score above every other token (the selector keeps them anyway). Combined over
    KV heads (``head_agg``) and layers (``layer_agg``). The reference reads every prompt
    token's query: run the engine with ``--query-capture full`` for the same anchor (a query
    window gives the mean of its rows).
    """

    queries = QueryNeed.WINDOW
    needs_selection = True  # reads n_sink and the prompt length
    head_dim: int | None = query_head_dim()
    tau: float = param(
        5.0,
        "sharpness of the query-key alignment weights",
        allowed="a float > 0",
        check=lambda t: t > 0,
    )
    n_future_positions: int = param(
        512,
        "future positions the anchor's RoPE rotation is averaged over",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
        serve_max=8192,  # one rotated copy per position (400,000: +230 MB)
    )
    epsilon: float = param(
        1e-6,
        "added to the weights inside the capacity matrix",
        allowed="a float >= 0",
        check=lambda e: e >= 0,
    )
    head_agg: str = head_agg_param("mean", "how the KV heads of a layer combine")
    layer_agg: str = layer_agg_param("mean", "how layers combine")

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        assert self.head_dim is not None
        check_query_shapes("cap", kv, query, self.head_dim)

    def anchor(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        total: int,
        rope: RopeConfig | None,
    ) -> torch.Tensor:
        """``[Hq, d]`` historical-query anchor of one layer's ``[R, Dq]`` query rows at
        ``positions`` (``total``: the prompt's length; ``rope``: None leaves the rows as saved)."""
        assert self.head_dim is not None
        pre = prerope(rows, positions, rope, self.head_dim).mean(dim=1)  # [Hq, d]
        if rope is None or rope.head_dim != self.head_dim:
            return pre
        future = torch.arange(total, total + self.n_future_positions, device=rows.device)
        spread = pre.expand(self.n_future_positions, *pre.shape)
        return apply_rope(spread, future, rope).mean(dim=0)

    def head_scores(
        self, kv: torch.Tensor, query: torch.Tensor, selection: Selection
    ) -> torch.Tensor:
        """``[L, Hkv, T]``: the sinks at each layer's maximum + 1, then the capacity scores."""
        assert self.head_dim is not None
        sinks = min(selection.n_sink, kv.shape[2])
        if sinks == kv.shape[2]:  # a prompt of sinks only (2-4 tokens): nothing to weigh
            return torch.ones(kv.shape[1], kv.shape[3] // self.head_dim, sinks, device=kv.device)
        qpos = selection.query_positions
        qpos = torch.arange(query.shape[2]) if qpos is None else qpos.to("cpu")
        rows = (qpos >= sinks).nonzero().squeeze(1)
        if rows.numel() == 0:
            rows = torch.arange(qpos.numel())
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer, sinks:], self.head_dim)
            values = heads_f32(kv[1, layer, sinks:], self.head_dim)
            anchor = self.anchor(
                query[0, layer].index_select(0, rows.to(query.device)),
                qpos[rows],
                selection.total_tokens,
                selection.rope,
            )
            scores = capacity_scores(anchor, keys, values, self.tau, self.epsilon)
            grouped = group_heads(scores, keys.shape[0], "mean")
            top = grouped.max() + 1 if grouped.numel() else torch.ones((), device=kv.device)
            per_layer.append(F.pad(grouped, (sinks, 0), value=float(top)))
        return torch.stack(per_layer)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None
        per_head = self.head_scores(kv, query, selection)
        return reduce(reduce(per_head, 1, self.head_agg), 0, self.layer_agg)


cap = ScorerFactory(
    "cap",
    CapScorer,
    "CAPKV: query relevance times value leverage in a relevance-weighted capacity matrix",
    defaults={"n_sink": 4},
)
