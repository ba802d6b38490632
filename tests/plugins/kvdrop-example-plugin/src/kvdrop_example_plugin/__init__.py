"""Example third-party policies, written only against kvdrop's public API, the way a plugin would.

- ``value-norm`` (KV only): keep tokens whose VALUE vectors have the largest L2 norm;
- ``last-queries`` (query-based): keep the keys the last ``window`` prompt tokens attend to most.

docs/policies.md shows both; the test suite installs this distribution and runs the property
tests over every registered policy, these included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop import PolicyInputError, QueryNeed, Scorer, ScorerFactory, param
from kvdrop.attention import attention_mass, heads_f32


@dataclass(frozen=True)
class ValueNormScorer(Scorer):
    """Tokens with large value vectors move the attention output most; keep them."""

    layer_agg: str = param("mean", "how per-layer norms combine", choices=("mean", "max"))

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        norms = torch.stack([kv[1, layer].float().norm(dim=-1) for layer in range(kv.shape[1])])
        return norms.mean(0) if self.layer_agg == "mean" else norms.amax(0)


value_norm = ScorerFactory("value-norm", ValueNormScorer, "Keep tokens with the largest value norm")


@dataclass(frozen=True)
class LastQueriesScorer(Scorer):
    """Keep the keys the last `window` prompt tokens attend to most.

    Per layer: softmax attention of the last `window` queries (causal) over all keys, summed
    over those queries and averaged over query heads, then over layers. This `window` is the
    scorer's own parameter, not the selector's always-kept window.
    """

    # score() gets every cached token's query [1, L, T, Dq] (so the engine captures them all);
    # without them kvdrop raises MissingQueryError before score() is called.
    queries = QueryNeed.FULL
    head_dim: int | None = param(
        None,
        "per-head dimension (None: the engine's layout's); D and Dq must be multiples of it",
        allowed="None or an int >= 1 dividing D and Dq",
        check=lambda d: d is None or d >= 1,
    )
    window: int = param(
        8, "how many of the last queries vote", allowed="an int >= 1", check=lambda w: w >= 1
    )

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        assert query is not None and self.head_dim is not None  # filled in before check()
        kv_heads, rest = divmod(kv.shape[3], self.head_dim)
        q_heads, q_rest = divmod(query.shape[3], self.head_dim)
        if rest or q_rest or q_heads % kv_heads:
            raise PolicyInputError(
                f"last-queries: D={kv.shape[3]} and Dq={query.shape[3]} must be multiples of "
                f"head_dim={self.head_dim}, with Dq a multiple of D (GQA)"
            )

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None and self.head_dim is not None
        num_tokens = kv.shape[2]
        first = max(num_tokens - self.window, 0)
        positions = torch.arange(first, num_tokens)  # where the voting queries sit
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)  # [Hkv, T, d]
            q = heads_f32(query[0, layer, first:], self.head_dim)  # [Hq, window, d]
            per_layer.append(attention_mass(q, keys, positions).mean(0))  # [T]
        return torch.stack(per_layer).mean(0)


last_queries = ScorerFactory(
    "last-queries",
    LastQueriesScorer,
    "Keep what the last `window` prompt tokens attend to most",
    defaults={"n_sink": 4},
    example={"head_dim": 64, "window": 16},
)
