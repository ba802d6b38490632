"""``compactor``: leverage of the keys blended with non-causal chunked attention (Chari & Van
Durme, 2025)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    check_query_shapes,
    head_agg_param,
    layer_agg_param,
    query_head_dim,
    reduce,
)
from kvdrop.policies.leverage import LeverageScorer
from kvdrop.policies.non_causal_attn import NonCausalAttnScorer
from kvdrop.policy import QueryNeed, Scorer
from kvdrop.selector import Selection

__all__ = ["CompactorScorer", "compactor"]


def _blending_ok(x: float) -> bool:
    return x >= 0


@dataclass(frozen=True)
class CompactorScorer(Scorer):
    """Compactor (Chari & Van Durme, 2025, arXiv:2507.08143; kvpress ``CompactorPress``).

    Between the first ``n_sink`` tokens (default 8) and the recent ``window`` (default 4; both
    kept by the selector and scored the maximum), per layer and KV head:
    ``blending * leverage + non_causal_attn`` -- the z-scored approximate leverage of the pre-RoPE
    keys (:class:`~kvdrop.policies.leverage.LeverageScorer`) and the z-scored attention each key
    receives inside non-causal chunks of ``chunk_length`` tokens, times ``||v||``
    (:class:`~kvdrop.policies.non_causal_attn.NonCausalAttnScorer`), both over those tokens only;
    then combined over KV heads and layers. ``blending=None`` (kvpress's default) is the
    compression ratio asked, ``1 - keep_ratio`` (``1 - budget / T`` under ``keep_tokens``).
    Reads every cached token's query
    (``QueryNeed.FULL``: the engine's ``--query-capture full``).
    """

    queries = QueryNeed.FULL
    needs_selection = True  # reads n_sink, the recent window, the budget, RoPE and positions
    head_dim: int | None = query_head_dim()
    chunk_length: int = param(
        256,
        "tokens per non-causal attention chunk",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
        serve_max=4096,  # attention memory grows with its square
    )
    sketch_dimension: int = param(
        48,
        "size of the leverage's Gaussian sketch",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
        serve_max=512,  # memory grows with its square
    )
    seed: int = param(0, "seed of the sketch", allowed="an int >= 0", check=lambda n: n >= 0)
    blending: float | None = param(
        None,
        "weight of the leverage scores; None = 1 - keep_ratio (kvpress's compression ratio)",
        allowed="None or a float >= 0",
        check=_blending_ok,
    )
    head_agg: str = head_agg_param()
    layer_agg: str = layer_agg_param()

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        assert self.head_dim is not None
        check_query_shapes("compactor", kv, query, self.head_dim)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None and self.head_dim is not None
        num_tokens = kv.shape[2]
        left = min(selection.n_sink, num_tokens)
        right = min(selection.recent, num_tokens - left)
        end = num_tokens - right
        if end - left < 2:  # nothing left to rank between the kept ends
            return torch.zeros(num_tokens, device=kv.device)
        inner = kv[:, :, left:end]
        positions = None if selection.positions is None else selection.positions[left:end]
        context = selection.inputs.with_context(positions=positions, head_dim=self.head_dim)
        sliced = dataclasses.replace(selection, inputs=context)
        lev = LeverageScorer(
            head_dim=self.head_dim, sketch_dimension=self.sketch_dimension, seed=self.seed
        ).head_scores(inner, sliced)
        attn = NonCausalAttnScorer(head_dim=self.head_dim, chunk_length=self.chunk_length)
        blended = self._blending(selection) * lev + attn.head_scores(inner, query[:, :, left:end])
        top = blended.amax(dim=(1, 2), keepdim=True).expand(-1, blended.shape[1], -1)
        full = torch.cat([top.expand(-1, -1, left), blended, top.expand(-1, -1, right)], dim=2)
        return reduce(reduce(full, 1, self.head_agg), 0, self.layer_agg)

    def _blending(self, selection: Selection) -> float:
        """``blending``, else kvpress's default, its compression ratio: ``1 - keep_ratio`` as
        asked (not the chunk-aligned budget), or ``1 - budget / T`` under ``keep_tokens``."""
        if self.blending is not None:
            return self.blending
        if selection.selector.keep_ratio is not None:
            return 1.0 - selection.selector.keep_ratio
        return 1.0 - selection.budget / max(selection.num_tokens, 1)


compactor = ScorerFactory(
    "compactor",
    CompactorScorer,
    "Compactor: key leverage blended with non-causal chunked attention (Compactor's scores)",
    defaults={"n_sink": 8, "window": 4},
)
