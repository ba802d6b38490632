"""``snapkv``: keep what the last ``window`` prompt tokens attend to (Li et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import attention_mass, heads_f32, pool1d
from kvdrop.params import param
from kvdrop.policies._common import (
    HEAD_AGG,
    LAYER_AGG,
    check_query_shapes,
    group_heads,
    odd_kernel,
    query_head_dim,
    reduce,
    window_fill,
)
from kvdrop.policy import Scorer, ScorerFactory
from kvdrop.selector import Selection

__all__ = ["SnapKVScorer", "snapkv"]


@dataclass(frozen=True)
class SnapKVScorer(Scorer):
    """SnapKV (Li et al., 2024): what the last ``window`` prompt tokens attend to.

    Per layer and query head: softmax(q.k / sqrt(d)) of the observation window's queries (the
    last ``window`` cached tokens) over all keys, causal inside the window; summed over the
    window queries and kept for the earlier keys only; pooled along tokens (``kernel``,
    ``pooling``); combined over each GQA group (``group_agg``), then over KV heads
    (``head_agg``), then over layers (``layer_agg``). The window itself is always kept (it is
    the selector's ``window``; ``window=0`` observes the last query alone and forces nothing). As
    upstream, the defaults are window 64, kernel 5, avg pooling, mean everywhere -- but the budget
    is chunk-aligned.
    """

    needs_query = True
    needs_selection = True  # observes the selector's window
    head_dim: int = query_head_dim()
    kernel: int = odd_kernel(5)
    pooling: str = param("avg", "pooling of token scores", choices=("avg", "max"))
    group_agg: str = param("mean", "how the query heads of a GQA group combine", choices=HEAD_AGG)
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = param("mean", "how layers combine", choices=LAYER_AGG)

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_query_shapes("snapkv", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None
        num_tokens = kv.shape[2]
        # Tokens before the observation window (window 0 observes the last query alone).
        obs = max(num_tokens - max(selection.window, 1), 0)
        if obs == 0:
            return torch.zeros(num_tokens)
        positions = torch.arange(obs, num_tokens)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(query[0, layer, obs:], self.head_dim)
            mass = attention_mass(q, keys, positions)[:, :obs]
            pooled = pool1d(mass, self.kernel, self.pooling)
            grouped = group_heads(pooled, keys.shape[0], self.group_agg)
            per_layer.append(reduce(grouped, 0, self.head_agg))
        return window_fill(reduce(torch.stack(per_layer), 0, self.layer_agg), num_tokens)


snapkv = ScorerFactory(
    "snapkv",
    SnapKVScorer,
    "SnapKV: keep what the last `window` prompt tokens attend to",
    defaults={"window": 64},
)
