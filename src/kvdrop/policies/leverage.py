"""``leverage``: keep the keys that are statistical outliers of their head (Chari & Van Durme)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdrop.errors import PolicyInputError
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import head_agg_param, kv_head_dim, layer_agg_param, reduce
from kvdrop.policies._prerope import head_dim_of, prerope, zscore
from kvdrop.policy import Scorer
from kvdrop.selector import Selection

__all__ = ["LeverageScorer", "leverage", "leverage_scores"]

#: Cholesky tries: the first adds ``1e-2 * I``, each next one ten times more (kvpress's).
CHOLESKY_TRIES = 5


def leverage_scores(keys: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """Approximate leverage ``[H, T]`` of pre-RoPE keys ``[H, T, d]`` under a right sketch
    ``[H, d, k]``: ``diag(X (X^T X)^-1 X^T)`` of the centred, sketched keys ``X``, through a
    Cholesky solve of ``X^T X + jitter * I`` (clamped at 0)."""
    x = (keys - keys.mean(dim=1, keepdim=True)) @ sketch  # [H, T, k]
    xt = x.transpose(1, 2)
    gram = xt @ x
    gram = 0.5 * (gram + gram.transpose(1, 2))
    eye = torch.eye(gram.shape[-1], device=gram.device)
    jitter = 1e-2
    for _ in range(CHOLESKY_TRIES):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if bool((info == 0).all()):
            solved = torch.cholesky_solve(xt, factor)  # (X^T X)^-1 X^T
            return (x * solved.transpose(1, 2)).sum(-1).clamp_min(0)
        jitter *= 10.0
    raise PolicyInputError(
        f"leverage: the keys' Gram matrix is not positive definite after {CHOLESKY_TRIES} "
        "jittered Cholesky tries; check the cached keys for extreme values"
    )


def gaussian_sketch(
    heads: int, dim: int, size: int, seed: int, device: torch.device
) -> torch.Tensor:
    """The right Gaussian sketch ``[H, d, k]`` (entries N(0, 1/k)) drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, dim, size, generator=gen)[0] / math.sqrt(size)).to(device)


@dataclass(frozen=True)
class LeverageScorer(Scorer):
    """Approximate leverage scores of pre-RoPE keys (Chari & Van Durme, 2025, "Compactor",
    arXiv:2507.08143; kvpress ``LeverageScorePress``).

    Per layer: the keys are rotated back to before RoPE (with the RoPE parameters and positions
    the engine registers; without them the cached keys are used), centred over the tokens,
    sketched by a Gaussian ``[d, sketch_dimension]`` matrix per KV head, and each token's
    leverage ``diag(X (X^T X)^-1 X^T)`` is z-normalised over the layer's heads and tokens; then
    combined over heads (``head_agg``) and layers (``layer_agg``). The sketch of layer ``l`` is
    drawn from ``seed + l`` (kvpress draws from torch's global generator), so the policy is
    deterministic.
    """

    needs_selection = True  # reads the layout's head_dim, RoPE and positions
    reads_values = False
    head_dim: int | None = kv_head_dim()
    sketch_dimension: int = param(
        48,
        "size of the Gaussian sketch",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
        serve_max=512,  # memory grows with its square (4000: +455 MB per request)
    )
    seed: int = param(0, "seed of the sketch", allowed="an int >= 0", check=lambda n: n >= 0)
    head_agg: str = head_agg_param()
    layer_agg: str = layer_agg_param()

    def head_scores(self, kv: torch.Tensor, selection: Selection) -> torch.Tensor:
        """``[L, Hkv, T]`` z-normalised leverage, before heads and layers combine."""
        d = head_dim_of("leverage", kv.shape[3], self.head_dim, selection)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = prerope(kv[0, layer], selection.positions, selection.rope, d)
            sketch = gaussian_sketch(
                keys.shape[0], d, self.sketch_dimension, self.seed + layer, kv.device
            )
            per_layer.append(zscore(leverage_scores(keys, sketch)))
        return torch.stack(per_layer)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        per_head = self.head_scores(kv, selection)
        return reduce(reduce(per_head, 1, self.head_agg), 0, self.layer_agg)


leverage = ScorerFactory(
    "leverage",
    LeverageScorer,
    "Leverage: keep keys that are statistical outliers of their head (query-agnostic)",
)
