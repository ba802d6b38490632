"""``snapkv``: keep what the last ``window`` prompt tokens attend to (Li et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import attention_mass, heads_f32, pool1d
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    HEAD_AGG,
    check_query_shapes,
    group_heads,
    last_rows,
    layer_agg_param,
    layer_lse,
    odd_kernel,
    query_head_dim,
    reduce,
    window_fill,
)
from kvdrop.policy import QueryNeed, Scorer
from kvdrop.selector import Selection

__all__ = ["SnapKVScorer", "snapkv"]


@dataclass(frozen=True)
class SnapKVScorer(Scorer):
    """SnapKV (Li et al., 2024): what the last ``window`` prompt tokens attend to.

    Per layer and query head: softmax(q.k / sqrt(d)) of the observation window's queries (the
    last ``window`` tokens of the WHOLE prompt: the uncached tail the engine recomputes is
    included) over the cached keys, causal inside the window; summed over the window queries
    and kept for the keys before the window only; pooled along tokens (``kernel``, ``pooling``);
    combined over each GQA group (``group_agg``), then over KV heads (``head_agg``), then over
    layers (``layer_agg``). The window is always kept (its cached part is the selector's forced
    ``window``, the rest is the tail; ``window=0`` observes the last query alone and forces
    nothing). A window query in the tail sees every cached key. Its attention is the true one:
    normalised over every key it saw, the tail's included (the engine records each saved row's
    log-normaliser, ``EditContext.query_lse``), so a query that looked mostly at the tail adds
    little; without log-normalisers the softmax runs over the cached keys only. The defaults
    are upstream's (window 64, avg pooling, mean everywhere) but for the pooling kernel: 15, not
    5 -- chosen with ``kvdrop eval`` on development seeds (docs/quality.md): under one shared
    selection a wider kernel keeps the digits that follow the token the question attends to --
    and the budget is chunk-aligned.
    """

    queries = QueryNeed.WINDOW
    reads_query_sample = False  # the last rows only (last_rows)
    needs_selection = True  # observes the selector's window
    reads_values = False
    head_dim: int | None = query_head_dim()
    kernel: int = odd_kernel(15)
    pooling: str = param("avg", "pooling of token scores", choices=("avg", "max"))
    group_agg: str = param("mean", "how the query heads of a GQA group combine", choices=HEAD_AGG)
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = layer_agg_param("mean", "how layers combine")

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_query_shapes("snapkv", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None and self.head_dim is not None
        num_tokens = kv.shape[2]
        window = max(selection.window, 1)  # window 0 observes the last query alone
        # Cached tokens before the observation window (it may lie entirely in the tail).
        obs = max(min(num_tokens, selection.total_tokens - window), 0)
        if obs == 0:
            return torch.zeros(num_tokens, device=kv.device)
        rows, positions, lse = last_rows("snapkv", query, selection, window)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(rows[0, layer], self.head_dim)
            mass = attention_mass(q, keys, positions, lse=layer_lse(lse, layer))[:, :obs]
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
