"""``cur``: keep the tokens with the largest approximate leverage of keys and values (CurDKV)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import head_agg_param, kv_head_dim, layer_agg_param, reduce
from kvdrop.policies._prerope import head_dim_of, head_rows
from kvdrop.policy import Scorer
from kvdrop.selector import Selection

__all__ = ["CURScorer", "cur"]

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")
#: Width of the random projection of ``use_random_leverage`` (kvpress's ``r``).
RANDOM_RANK = 20


@dataclass(frozen=True)
class CURScorer(Scorer):
    """CurDKV (Sengupta et al., 2025, arXiv:2509.15038): approximate CUR leverage of K and V.

    Per layer and KV head: ``k2 = ||k_t||^2`` and ``v2 = ||v_t||^2`` (after a seeded Gaussian
    projection to 20 dims when ``use_random_leverage``), each normalised to sum 1 inside
    consecutive windows of ``local_window_size`` tokens when ``use_local_approximation``;
    combined by ``leverage_type`` (``kv_product``: ``k2 * v2``), normalised to sum 1 over the
    tokens, the first ``n_sink`` set to 1; then combined over heads (``head_agg``) and layers
    (``layer_agg``). kvpress's ``CURPress`` at its defaults (``num_sinks`` is the selector's
    ``n_sink``, default 4); the random projection draws from ``seed`` instead of torch's global
    generator, so the policy is deterministic.
    """

    needs_selection = True  # reads the layout's head_dim and n_sink
    head_dim: int | None = kv_head_dim()
    leverage_type: str = param(
        "kv_product", "how key and value leverage combine", choices=LEVERAGE_TYPES
    )
    use_random_leverage: bool = param(False, "project K and V to 20 random dims first")
    use_local_approximation: bool = param(True, "normalise leverage inside local windows")
    local_window_size: int = param(
        16, "tokens per local window", allowed="an int >= 1", check=lambda n: n >= 1
    )
    seed: int = param(
        0, "seed of the random projection", allowed="an int >= 0", check=lambda n: n >= 0
    )
    head_agg: str = head_agg_param()
    layer_agg: str = layer_agg_param()

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        d = head_dim_of("cur", kv.shape[3], self.head_dim, selection)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys, values = head_rows(kv[0, layer], d), head_rows(kv[1, layer], d)
            if self.use_random_leverage:
                gen = torch.Generator().manual_seed(self.seed + layer)
                proj = torch.randn(d, RANDOM_RANK, generator=gen) / math.sqrt(RANDOM_RANK)
                proj = proj.to(kv.device)
                keys, values = keys @ proj, values @ proj
            scores = self._combine(
                self._local(keys.square().sum(-1)), self._local(values.square().sum(-1))
            )
            scores = scores / scores.sum(-1, keepdim=True)
            scores[:, : selection.n_sink] = 1.0
            per_layer.append(reduce(scores, 0, self.head_agg))
        return reduce(torch.stack(per_layer), 0, self.layer_agg)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """``[H, T]`` normalised to sum 1 inside each window of ``local_window_size`` tokens."""
        if not self.use_local_approximation:
            return x
        w, n = self.local_window_size, x.shape[1]
        padded = torch.nn.functional.pad(x, (0, (w - n % w) % w)).view(x.shape[0], -1, w)
        return (padded / padded.sum(-1, keepdim=True)).reshape(x.shape[0], -1)[:, :n]

    def _combine(self, k2: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        if self.leverage_type == "key":
            return k2
        if self.leverage_type == "value":
            return v2
        if self.leverage_type == "kv_avg":
            return (k2 + v2) / 2
        return k2 * v2


cur = ScorerFactory(
    "cur",
    CURScorer,
    "CurDKV: keep tokens with the largest approximate key x value leverage (query-agnostic)",
    defaults={"n_sink": 4},
)
