"""RoPE re-rotation of kept keys: the policy-side helpers (the math is :mod:`kvdrop_rope`).

Cached keys are post-RoPE at their original positions. After dropping, the engine reads the kept
prefix as positions ``0..k-1`` and appends new tokens at ``k, k+1, ...``; a kept key that is not
re-rotated keeps its old (larger, gappy) position and the model sees wrong distances. Every kvdrop
policy therefore re-rotates the keys it keeps (``Policy.__call__``) when it knows the model's RoPE
parameters: the ones given explicitly (``kvdrop.get(..., rerotate=config)``) or the ones the
engine registered with the cache layout (``EditContext.rope``). Each moved key is rotated back by
its old angle and forward by its new one, in float32, and cast back to the cache dtype once; keys
that do not move stay bit-identical; values are only gathered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvdrop.errors import PolicyInputError, PolicyParamError
from kvdrop_rope import RopeConfig, rerotate_rows

__all__ = ["rerotate_in_place", "rerotate_keys", "rope_config", "rope_from_layout"]


def rope_config(value: RopeConfig | Mapping[str, Any], *, policy: str = "rerotate") -> RopeConfig:
    """A :class:`RopeConfig` from itself, an HF ``config.json`` dict or a layout's ``rope`` dict
    (``RopeConfig.to_json()``); PolicyParamError if it is none of them."""
    if isinstance(value, RopeConfig):
        return value
    if isinstance(value, Mapping):
        try:
            if "rotary_dim" in value and "interleaved" in value:
                return RopeConfig.from_json(value)
            return RopeConfig.from_hf_config(value)
        except (ValueError, TypeError) as exc:
            raise PolicyParamError(f"{policy}: parameter 'rerotate': {exc}") from None
    raise PolicyParamError(
        f"{policy}: parameter 'rerotate' got {value!r} ({type(value).__name__}); expected a "
        "kvdrop_rope.RopeConfig or an HF config.json dict (or True/False)"
    )


def rope_from_layout(rope: Mapping[str, Any] | None, *, policy: str) -> RopeConfig | None:
    """The :class:`RopeConfig` of an edit context's ``rope`` dict (None stays None)."""
    if rope is None:
        return None
    try:
        return RopeConfig.from_json(rope)
    except (ValueError, TypeError) as exc:
        raise PolicyInputError(
            f"{policy}: the edit context carries RoPE parameters that cannot be read: {exc}"
        ) from None


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
    rerotate_in_place(out, old, new, rope, old_seq_len, new_seq_len)
    return out


def rerotate_in_place(
    keys: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    rope: RopeConfig,
    old_seq_len: int | None,
    new_seq_len: int | None,
) -> None:
    """In-place :func:`rerotate_keys` (:func:`kvdrop_rope.rerotate_rows`, the one rule the cache
    server's keep applies too); PolicyInputError when the width does not fit the RoPE."""
    try:
        rerotate_rows(keys, old, new, rope, old_seq_len, new_seq_len)
    except ValueError as exc:
        raise PolicyInputError(f"rerotate: {exc}") from None
