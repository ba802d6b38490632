"""Combining per-head and per-layer token scores into the one ``[T]`` score a request keeps.

The cache is keyed by token ids, so every layer and head must keep the same tokens; how their
scores are combined is a documented, configurable choice of each scorer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvdrop.errors import PolicyInputError

__all__ = ["HEAD_AGG", "LAYER_AGG", "check_head_dim", "heads", "reduce"]

HEAD_AGG = ("mean", "max")
LAYER_AGG = ("mean", "max", "sum")


def reduce(x: torch.Tensor, dim: int, how: str) -> torch.Tensor:
    """Reduce ``x`` over ``dim`` with ``how`` in mean | max | min | sum."""
    if how == "mean":
        return x.mean(dim)
    if how == "max":
        return x.amax(dim)
    if how == "min":
        return x.amin(dim)
    if how == "sum":
        return x.sum(dim)
    raise ValueError(f"unknown aggregation {how!r}; expected mean, max, min or sum")


def check_head_dim(policy: str, width: int, head_dim: int | None, what: str = "KV") -> None:
    """Raise PolicyInputError unless ``width`` (D) is a multiple of ``head_dim``."""
    if head_dim is not None and width % head_dim:
        raise PolicyInputError(
            f"{policy}: {what} width D={width} is not a multiple of head_dim={head_dim}; "
            "D must be num_heads * head_dim"
        )


def heads(x: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """View ``[T, D]`` as ``[H, T, d]`` (HND order inside D); ``head_dim=None`` means one head."""
    num_tokens, width = x.shape
    d = width if head_dim is None else head_dim
    return x.view(num_tokens, width // d, d).transpose(0, 1)


def per_layer(kv_or_q: torch.Tensor, index: int = 0) -> Iterator[torch.Tensor]:
    """Yield ``[T, D]`` slices of ``kv_or_q[index]`` layer by layer (bounded float32 memory)."""
    for layer in range(kv_or_q.shape[1]):
        yield kv_or_q[index, layer]
