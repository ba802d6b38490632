"""``lagkv``: score each partition of tokens against the one after it (Liang et al., 2025)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import head_agg_param, kv_head_dim, layer_agg_param, reduce
from kvdrop.policies._prerope import head_dim_of, head_rows
from kvdrop.policy import Scorer
from kvdrop.selector import Selection

__all__ = ["LagKVScorer", "lagkv"]


@dataclass(frozen=True)
class LagKVScorer(Scorer):
    """LagKV (Liang et al., 2025, arXiv:2504.04704): lag-relative information, query-agnostic.

    After the ``n_sink`` sinks the cached tokens are cut into partitions of ``lag_size``; each
    partition is scored against the next one (its reference): per layer, KV head and channel, a
    token's keys (and values) are min-max scaled by the reference partition's range, the std over
    the head's channels is softmaxed over the partition, and key and value scores are averaged.
    Without ``cross_scoring`` a token's score is its rank inside its partition divided by
    ``lag_size`` (kvpress's default). Sinks and the last partition with the remainder score 1
    (kept first); a prompt shorter than ``n_sink + 2 * lag_size`` scores its tokens by recency.
    Then combined over heads (``head_agg``) and layers (``layer_agg``). kvpress's ``LagKVPress``
    at its defaults (the selector's ``n_sink``, default 4); a channel whose reference range is 0
    scales to 0 (kvpress divides by 0).
    """

    needs_selection = True  # reads the layout's head_dim and n_sink
    head_dim: int | None = kv_head_dim()
    lag_size: int = param(
        128, "tokens per partition", allowed="an int >= 1", check=lambda n: n >= 1
    )
    cross_scoring: bool = param(
        False, "keep the softmax scores instead of ranks inside each partition"
    )
    head_agg: str = head_agg_param()
    layer_agg: str = layer_agg_param()

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        d = head_dim_of("lagkv", kv.shape[3], self.head_dim, selection)
        num_tokens, sink, lag = kv.shape[2], min(selection.n_sink, kv.shape[2]), self.lag_size
        if num_tokens < sink + 2 * lag:
            out = torch.ones(num_tokens, device=kv.device)
            rest = num_tokens - sink
            out[sink:] = torch.arange(rest, device=kv.device) / max(rest, 1)
            return out
        end = sink + ((num_tokens - sink) // lag) * lag
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = head_rows(kv[0, layer, sink:end], d)
            values = head_rows(kv[1, layer, sink:end], d)
            score = (self._states(keys) + self._states(values)) / 2  # [H, P - 1, lag]
            if not self.cross_scoring:
                score = score.argsort(-1).argsort(-1).float() / lag
            out = torch.ones(keys.shape[0], num_tokens, device=kv.device)
            out[:, sink : end - lag] = score.reshape(keys.shape[0], -1)
            per_layer.append(reduce(out, 0, self.head_agg))
        return reduce(torch.stack(per_layer), 0, self.layer_agg)

    def _states(self, x: torch.Tensor) -> torch.Tensor:
        """``[H, P * lag, d]`` -> ``[H, P - 1, lag]``: each partition against the next one."""
        parts = x.view(x.shape[0], -1, self.lag_size, x.shape[2])
        ref, target = parts[:, 1:], parts[:, :-1]
        low = ref.amin(dim=2, keepdim=True)
        span = ref.amax(dim=2, keepdim=True) - low
        scaled = torch.where(span > 0, (target - low) / span.clamp_min(1e-30), 0.0)
        spread = scaled.std(dim=-1) if x.shape[2] > 1 else torch.zeros(scaled.shape[:-1])
        return spread.softmax(dim=-1)


lagkv = ScorerFactory(
    "lagkv",
    LagKVScorer,
    "LagKV: score each token partition against the next one (query-agnostic)",
    defaults={"n_sink": 4},
)
