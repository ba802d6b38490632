"""Helpers of the scorers that read keys or queries per head and before RoPE (private).

The cache holds keys after RoPE at each row's position. Scorers ported from presses that read
pre-RoPE keys or queries (``leverage``, ``expected-attention``) undo the rotation with the model's
RoPE parameters and the rows' positions (``Selection.rope``, ``Selection.positions``), which the
engine registers with the cache layout; without them the rows are used as cached.
"""

from __future__ import annotations

import torch

from kvdrop.errors import PolicyInputError
from kvdrop.selector import Selection
from kvdrop_rope import RopeConfig, apply_rope

__all__ = ["head_dim_of", "head_rows", "prerope", "zscore"]


def head_dim_of(policy: str, width: int, head_dim: int | None, selection: Selection) -> int:
    """The per-head width to split ``D`` by: the parameter, else the layout's, else all of D."""
    d = head_dim if head_dim is not None else selection.head_dim
    d = width if d is None else d
    if width % d:
        raise PolicyInputError(
            f"{policy}: KV width D={width} is not a multiple of head_dim={d}; "
            "D must be num_heads * head_dim"
        )
    return d


def head_rows(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[T, H * d]`` as a float32 ``[H, T, d]``."""
    num_tokens, width = x.shape
    return x.float().view(num_tokens, width // head_dim, head_dim).transpose(0, 1)


def prerope(
    x: torch.Tensor, positions: torch.Tensor | None, rope: RopeConfig | None, head_dim: int
) -> torch.Tensor:
    """Rows ``[T, H * d]`` (post-RoPE at ``positions``) rotated back: float32 ``[H, T, d]``.

    Without RoPE parameters, positions, or when the RoPE head size is not ``head_dim``, the rows
    are returned as they are (the scorer then reads post-RoPE vectors)."""
    h = head_rows(x, head_dim)
    if rope is None or positions is None or rope.head_dim != head_dim:
        return h
    pos = positions.to(device=x.device, dtype=torch.int64)
    seq_len = int(pos.max()) + 1 if pos.numel() else None
    return apply_rope(h.transpose(0, 1), pos, rope, inverse=True, seq_len=seq_len).transpose(0, 1)


def zscore(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` over every element (std floored at 1e-6), as the presses do."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / x.std().clamp_min(1e-6)
