"""The edit-function contract shared by the SDK and every kvdrop policy."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvdrop_sdk.cache_kind import CacheKind, kind_value

__all__ = ["ModifyFnType", "get_tensor"]

#: An edit function: given the retrieved tensors of one request (``{KV: [2, L, T, D]}`` and
#: optionally ``{QUERY: [1, L, T, Dq]}``) and its T chunk-aligned token ids, return the edited KV
#: ``[2, L, T', D]`` and the T' token ids it is stored under.
ModifyFnType = Callable[
    [Mapping[CacheKind, torch.Tensor], Sequence[int]], tuple[torch.Tensor, Sequence[int]]
]


def get_tensor(tensors: Mapping[Any, torch.Tensor], kind: CacheKind) -> torch.Tensor | None:
    """Look up ``kind`` in a mapping keyed by any enum (or string) whose value matches."""
    for key, value in tensors.items():
        if kind_value(key) == kind.value:
            return value
    return None
