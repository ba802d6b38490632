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
and over layers by ``layer_agg``.
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
        if per_layer.shape[1] < num_tokens:
            pad = torch.ones(num_layers, num_tokens - per_layer.shape[1], device=kv.device)
            per_layer = torch.cat([per_layer, pad], dim=1)
        return reduce(per_layer, 0, self.layer_agg)


kvzip = ScorerFactory(
    "kvzip",
    KVzipScorer,
    "KVzip: keep what the model needs to repeat its context (query-agnostic)",
    defaults={"n_sink": 4},
)
