"""``rkv``: SnapKV-style importance minus key redundancy (R-KV, Cai et al., 2025)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import attention_mass, heads_f32, key_redundancy, pool1d, unit_keys
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    HEAD_AGG,
    check_query_shapes,
    group_heads,
    last_rows,
    layer_agg_param,
    odd_kernel,
    query_head_dim,
    reduce,
    window_fill,
)
from kvdrop.policy import QueryNeed, Scorer
from kvdrop.selector import Selection

__all__ = ["RKVScorer", "one_scan", "rkv"]


def one_scan(device: torch.device) -> bool:
    """Whether every layer's redundancy is computed in one scan: on accelerators (few large
    launches), not on the CPU (one layer's float32 keys at a time in memory)."""
    return device.type != "cpu"


@dataclass(frozen=True)
class RKVScorer(Scorer):
    """R-KV (Cai et al., 2025): SnapKV-style importance minus key redundancy.

    Per layer, for the cached tokens before the observation window (the last ``window`` tokens
    of the whole prompt, uncached tail included, always kept): importance = softmax attention of
    the window queries over those earlier keys only,
    averaged over the window, combined over each GQA group (``group_agg``, default max), then
    max-pooled (``kernel`` 7); redundancy = R-KV's key similarity per KV head: cosine matrix of
    ``k / (||k|| + 1e-8)`` over all T keys with the diagonal zeroed, in each row the entry of the
    last key more similar than ``threshold`` zeroed, mean over rows, softmax over keys.
    score = ``mix_lambda`` * importance - (1 - ``mix_lambda``) * redundancy, combined over KV
    heads then layers. The redundancy is computed blockwise (no T x T matrix), exactly.
    """

    queries = QueryNeed.WINDOW
    reads_query_sample = False  # the last rows only (last_rows)
    needs_selection = True  # observes the selector's window
    reads_values = False
    head_dim: int | None = query_head_dim()
    kernel: int = odd_kernel(7)
    pooling: str = param("max", "pooling of importance scores", choices=("avg", "max"))
    group_agg: str = param("max", "how the query heads of a GQA group combine", choices=HEAD_AGG)
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = layer_agg_param("mean", "how layers combine")
    threshold: float = param(
        0.5,
        "cosine similarity above which a key counts as a duplicate",
        allowed="-1 <= t <= 1",
        check=lambda t: -1 <= t <= 1,
    )
    mix_lambda: float = param(
        0.25,
        "weight of importance; redundancy gets 1 - mix_lambda",
        allowed="0 <= l <= 1",
        check=lambda x: 0 <= x <= 1,
    )

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        check_query_shapes("rkv", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None and self.head_dim is not None
        num_tokens = kv.shape[2]
        window = max(selection.window, 1)
        obs = max(min(num_tokens, selection.total_tokens - window), 0)
        if obs == 0:
            return torch.zeros(num_tokens, device=kv.device)
        rows, _, _ = last_rows("rkv", query, selection, window)
        num_layers = kv.shape[1]
        importance, unit = [], []
        for layer in range(num_layers):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(rows[0, layer], self.head_dim)
            # Every window query sees every earlier key: no mask, softmax over the prefix only.
            mass = attention_mass(q, keys[:, :obs], None) / rows.shape[2]
            importance.append(
                pool1d(group_heads(mass, keys.shape[0], self.group_agg), self.kernel, self.pooling)
            )
            unit.append(unit_keys(keys))  # the raw float32 keys are no longer needed
            if not one_scan(kv.device):  # one layer's keys at a time in host memory
                unit[-1] = key_redundancy(unit[-1], self.threshold)
        if not one_scan(kv.device):
            redundancy = torch.stack(unit)
        else:  # every layer's heads in one scan: a few large launches instead of many small
            heads = unit[0].shape[0]
            stacked = torch.cat(unit)
            del unit[:]
            redundancy = key_redundancy(stacked, self.threshold)
            redundancy = redundancy.view(num_layers, heads, num_tokens)
        del unit
        per_layer = [
            reduce(
                self.mix_lambda * importance[layer]
                - (1 - self.mix_lambda) * redundancy[layer, :, :obs],
                0,
                self.head_agg,
            )
            for layer in range(num_layers)
        ]
        return window_fill(reduce(torch.stack(per_layer), 0, self.layer_agg), num_tokens)


rkv = ScorerFactory(
    "rkv",
    RKVScorer,
    "R-KV: SnapKV-style importance minus key redundancy",
    defaults={"window": 16},
)
