"""``kvzip``: keep what the model needs to repeat its context (Kim et al., 2025).

KVzip scores a cache without the question: after prefill the engine teacher-forces "Repeat the
previous context exactly." followed by the context itself over the cached prefix (in chunks,
each attending to the whole cache) and records, per layer, KV head and cached token, the largest
attention any reconstruction query paid it (:mod:`kvdrop_engine.reconstruct`). The scores come
to the policy through the edit context (``EditContext.token_scores``, ``[L, Hkv, S]``), so the
policy itself runs without the model, on CPU or GPU, and costs about as much as ``knorm``.

kvdrop keeps one token list for every head and layer (the cache is keyed by token ids), so the
per-head scores are combined: over the KV heads of a layer by ``head_agg`` (``max`` by default:
a token one head needs to reproduce the context is kept, as KVzip's per-head selection would)
and over layers by ``layer_agg``. ``select="vote"`` instead mimics KVzipPress's one budget over
every head and layer: the ``budget x L x H`` best (layer, head, token) scores are chosen
together, and a token ranks by how many of them it holds (ties by the pooled score), so a token
many heads need outranks one a single head needs a little more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import pool1d
from kvdrop.errors import MissingTokenScoresError, PolicyInputError
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import head_agg_param, layer_agg_param, odd_kernel, reduce
from kvdrop.policy import Scorer
from kvdrop.selector import Selection

__all__ = ["KVzipScorer", "kvzip"]


@dataclass(frozen=True)
class KVzipScorer(Scorer):
    """KVzip (Kim et al., 2025): importance from context reconstruction, query-agnostic.

    A cached token's score is the engine's reconstruction score (max attention of the
    reconstruction queries, per layer and KV head), combined over heads (``head_agg``) and layers
    (``layer_agg``); with ``kernel`` > 1 each layer's scores are pooled along the tokens first
    (``pooling``), so a span around a needed token is kept with it. Tokens past the scored ones
    (decoded after the pass) score 1, the largest attention there is. Needs
    ``EditContext.token_scores``: see :class:`~kvdrop.MissingTokenScoresError` for where they
    come from.
    """

    needs_selection = True  # reads selection.token_scores
    token_scores = True
    reads_values = False
    reads_keys = False  # only the KV's shape
    head_agg: str = head_agg_param("max", "how the KV heads of a layer combine")
    layer_agg: str = layer_agg_param("mean", "how layers combine")
    kernel: int = odd_kernel(1)
    pooling: str = param("max", "pooling of token scores (with kernel > 1)", choices=("avg", "max"))
    select: str = param(
        "pool",
        "how one token list comes from per-head scores: 'pool' (head_agg, then layer_agg) or "
        "'vote' (the budget x L x H best (layer, head, token) scores, as KVzipPress's global "
        "budget; a token ranks by its share of them)",
        choices=("pool", "vote"),
    )

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        scores = selection.token_scores
        if scores is None:
            raise MissingTokenScoresError("kvzip")
        num_layers, num_tokens = kv.shape[1], kv.shape[2]
        if scores.shape[0] != num_layers:
            raise PolicyInputError(
                f"kvzip: token scores have {scores.shape[0]} layers but the KV has {num_layers}"
            )
        scores = scores.to(device=kv.device, dtype=torch.float32)[:, :, :num_tokens]
        per_layer = pool1d(reduce(scores, 1, self.head_agg), self.kernel, self.pooling)  # [L, S]
        pooled = reduce(per_layer, 0, self.layer_agg)  # [S]
        # Tokens decoded after the pass score as the largest attention (1) in every layer.
        top = float(reduce(torch.ones(num_layers, 1), 0, self.layer_agg))
        if self.select == "vote" and pooled.numel():
            pooled = _votes(pool1d(scores, self.kernel, self.pooling), pooled, selection.budget)
            top = float(scores.shape[0] * scores.shape[1] + 1)  # above every count
        pad = torch.full((num_tokens - pooled.shape[0],), top, device=kv.device)
        return torch.cat([pooled, pad])


def _votes(scores: torch.Tensor, pooled: torch.Tensor, budget: int) -> torch.Tensor:
    """KVzipPress's global budget on a token-keyed cache: of ``scores`` ``[L, H, S]`` the
    ``budget * L * H`` largest entries are chosen; a token scores the number it holds, plus its
    ``pooled`` score scaled into [0, 0.5) to order equal counts."""
    flat = scores.flatten()
    picks = min(flat.numel(), max(1, budget) * scores.shape[0] * scores.shape[1])
    threshold = flat.topk(picks).values[-1]
    counts = (scores >= threshold).sum(dim=(0, 1)).to(torch.float32)
    return counts + 0.5 * pooled / (pooled.max().clamp_min(1e-30) * (1 + 1e-6))


kvzip = ScorerFactory(
    "kvzip",
    KVzipScorer,
    "KVzip: keep what the model needs to repeat its context (query-agnostic)",
    defaults={"n_sink": 4},
)
