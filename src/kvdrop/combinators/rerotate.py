"""RoPE re-rotation: move the kept keys from their old positions to contiguous ones.

Cached keys are post-RoPE at their original positions. After dropping, the engine reads the kept
prefix as positions ``0..k-1`` and appends new tokens at ``k, k+1, ...``; without re-rotation the
kept keys keep their old (larger, gappy) positions and relative distances are wrong. The wrapper
:class:`Rerotate` (``kvdrop.get(name, ..., rerotate=RopeConfig(...))``) works for every
policy: after the inner policy selects, each moved key is rotated back by its old angle and
forward by its new one (``kvdrop_rope``: theta, partial rotary dim, NeoX or interleaved
layout, HF scalings), in float32, and cast back to the cache dtype once. Keys that do not move
stay bit-identical; values are only gathered.

Positions: a cached token's position is its index in the retrieved prefix only if that prefix
was never edited before. After an earlier edit (or for any cache whose positions are not
``0..T-1``) pass ``positions=`` (``[T]`` ints) when calling the edit function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvdrop.errors import PolicyInputError, PolicyParamError
from kvdrop.policy import Policy, as_policy
from kvdrop_rope import RopeConfig, rotate
from kvdrop_sdk.types import ModifyFnType

__all__ = ["Rerotate", "RerotatedPolicy", "rerotate_keys", "rerotated", "rope_config"]


def rope_config(value: RopeConfig | Mapping[str, Any], *, policy: str = "rerotate") -> RopeConfig:
    """A :class:`RopeConfig` from itself or an HF ``config.json`` dict; PolicyParamError if not."""
    if isinstance(value, RopeConfig):
        return value
    if isinstance(value, Mapping):
        try:
            return RopeConfig.from_hf_config(value)
        except ValueError as exc:
            raise PolicyParamError(f"{policy}: parameter 'rerotate': {exc}") from None
    raise PolicyParamError(
        f"{policy}: parameter 'rerotate' got {value!r} ({type(value).__name__}); expected a "
        "kvdrop_rope.RopeConfig or an HF config.json dict"
    )


def rerotate_keys(
    keys: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    rope: RopeConfig,
    *,
    old_seq_len: int | None = None,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Keys ``[L, k, D]`` (post-RoPE at ``old`` positions) rotated to ``new`` positions.

    Per layer: float32, inverse rotation at ``old``, rotation at ``new``, one cast back to the
    input dtype. Rows whose position does not change are copied bit-identically. ``*_seq_len``
    matter only for dynamic NTK scaling (default: largest position + 1).
    """
    out = keys.clone()
    if old.numel():
        old_seq_len = int(old.max()) + 1 if old_seq_len is None else old_seq_len
        new_seq_len = int(new.max()) + 1 if new_seq_len is None else new_seq_len
    _rerotate_(out, old, new, rope, old_seq_len, new_seq_len)
    return out


def _rerotate_(
    keys: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    rope: RopeConfig,
    old_seq_len: int | None,
    new_seq_len: int | None,
) -> None:
    """In-place :func:`rerotate_keys` (one layer's float32 rows alive at a time)."""
    layers, _, width = keys.shape
    if width % rope.head_dim:
        raise PolicyInputError(
            f"rerotate: KV width D={width} is not a multiple of the RoPE head_dim="
            f"{rope.head_dim}; expected num_kv_heads * head_dim"
        )
    inv_old, attn_old = rope.inv_freq(old_seq_len)
    inv_new, attn_new = rope.inv_freq(new_seq_len)
    if torch.equal(inv_old, inv_new) and attn_old == attn_new:
        moved = (old != new).nonzero().squeeze(1)
    else:  # dynamic NTK: frequencies depend on the sequence length, so every key moves
        moved = torch.arange(old.numel())
    if moved.numel() == 0:
        return
    old_m, new_m = old[moved].to(torch.int64), new[moved].to(torch.int64)
    cos_old, sin_old = rope.cos_sin(old_m, old_seq_len)
    cos_new, sin_new = rope.cos_sin(new_m, new_seq_len)
    heads = width // rope.head_dim
    index = moved.to(keys.device)
    for layer in range(layers):
        x = keys[layer].index_select(0, index).to(torch.float32).view(-1, heads, rope.head_dim)
        x = rotate(x, cos_old, sin_old, rope, inverse=True, attention_factor=attn_old)
        x = rotate(x, cos_new, sin_new, rope)
        keys[layer].index_copy_(0, index, x.view(-1, width).to(keys.dtype))


class Rerotate(Policy):
    """``policy``'s selection, with kept keys moved to positions ``0..k-1`` (``rope``: a
    :class:`RopeConfig` or an HF ``config.json`` dict). A plain edit function is adapted by
    :func:`kvdrop.policy.as_policy` (kept rows found by matching token ids and key rows)."""

    def __init__(
        self,
        policy: Policy | ModifyFnType,
        rope: RopeConfig | Mapping[str, Any],
        name: str = "",
    ) -> None:
        self.policy = as_policy(policy, name or "rerotate")
        self.rope = rope_config(rope, policy=name or self.policy.name)
        self.name = name or self.policy.name

    def __repr__(self) -> str:
        return f"Rerotate({self.policy!r}, {self.rope!r})"

    @property
    def needs_query(self) -> bool:
        return self.policy.needs_query

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The validated KV and the sorted indices the inner policy keeps."""
        return self.policy.select_indices(tensors, tokens)

    def __call__(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        positions: Sequence[int] | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        kv, index = self.select_indices(tensors, tokens)
        num_tokens = kv.shape[2]
        if positions is None:
            pos = torch.arange(num_tokens)
        else:
            pos = torch.as_tensor(positions)
            if pos.shape != (num_tokens,) or pos.dtype.is_floating_point:
                raise PolicyInputError(
                    f"{self.name}: positions must be {num_tokens} ints (one per cached token); "
                    f"got shape {tuple(pos.shape)} dtype {pos.dtype}"
                )
            pos = pos.to(torch.int64).cpu()
        kept_tokens = [int(tokens[i]) for i in index.tolist()]
        old = pos[index]
        new = torch.arange(index.numel())
        if index.numel() == num_tokens and torch.equal(old, new):
            return kv, kept_tokens  # within budget and already contiguous: unchanged
        # index_select makes a fresh tensor; keys are re-rotated in it, values only gathered.
        out = kv.index_select(2, index.to(kv.device))
        _rerotate_(out[0], old, new, self.rope, int(pos.max()) + 1, len(new))
        return out, kept_tokens


#: The name of :class:`Rerotate` before the combinators took built policies.
RerotatedPolicy = Rerotate


def rerotated(
    inner: Policy | ModifyFnType, rope: RopeConfig | Mapping[str, Any], name: str = ""
) -> Rerotate:
    """Wrap any policy or edit function so its kept keys are re-rotated to ``0..k-1``."""
    return Rerotate(inner, rope, name)
