"""``Rerotate``: any policy, with its kept keys re-rotated with RoPE parameters given explicitly.

Every kvdrop policy already re-rotates the keys it keeps to positions ``0..k-1`` when the edit
context carries the model's RoPE parameters (engines register them with the cache layout; see
:mod:`kvdrop.rope`). :class:`Rerotate` (``kvdrop.get(name, ..., rerotate=RopeConfig(...))`` or
an HF ``config.json`` dict) fixes the parameters instead, for callers that have no context (e.g.
inside ``lmcache.sdk``) or whose engine registers none; they win over the context's. It works for
every policy, plain edit functions included (their kept rows are found by matching token ids and
key rows).

Positions: a cached token's position is its index in the retrieved prefix (the edit context's
``positions``, ``0..T-1`` after re-rotated edits); pass ``positions=`` (``[T]`` ints) when calling
the edit function for a cache whose keys sit elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdrop.function_policy import as_policy
from kvdrop.policy import Policy, PolicyWrapper
from kvdrop.rope import rerotate_keys, rope_config
from kvdrop_rope import RopeConfig
from kvdrop_sdk.edit import ModifyFnType

__all__ = ["Rerotate", "rerotate_keys", "rerotated", "rope_config"]


class Rerotate(PolicyWrapper):
    """``policy``'s selection, with kept keys moved to positions ``0..k-1`` with ``rope`` (a
    :class:`RopeConfig` or an HF ``config.json`` dict). A plain edit function is adapted by
    :func:`kvdrop.policy.as_policy` (kept rows found by matching token ids and key rows)."""

    def __init__(
        self,
        policy: Policy | ModifyFnType,
        rope: RopeConfig | Mapping[str, Any],
        name: str = "",
    ) -> None:
        inner = as_policy(policy, name or "rerotate")
        super().__init__(inner, name or None)
        self.rope = rope_config(rope, policy=name or inner.name)
        self.rerotate = True

    def __repr__(self) -> str:
        return f"Rerotate({self.policy!r}, {self.rope!r})"


def rerotated(
    inner: Policy | ModifyFnType, rope: RopeConfig | Mapping[str, Any], name: str = ""
) -> Rerotate:
    """Wrap any policy or edit function so its kept keys are re-rotated to ``0..k-1``."""
    return Rerotate(inner, rope, name)
