"""The cache kinds a context can address: the KV cache and the query (intermediate) tensors."""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["CacheKind", "LMCacheSDKCacheKind", "kind_value"]


class CacheKind(str, enum.Enum):
    """Which tensor a context stores: ``KV`` ([2, L, T, D]) or ``QUERY`` ([1, L, T, Dq])."""

    KV = "kv"
    QUERY = "query"

    @classmethod
    def parse(cls, value: Any) -> CacheKind:
        """A ``CacheKind`` from itself, any enum whose ``.value`` is "kv"/"query", or the value."""
        raw = kind_value(value)
        try:
            return cls(raw)
        except ValueError:
            allowed = ", ".join(repr(k.value) for k in cls)
            raise ValueError(f"unknown cache kind {value!r}; expected one of {allowed}") from None


def kind_value(key: Any) -> Any:
    """The plain value of a cache-kind key: ``.value`` of an enum, else the key itself.

    Edit functions may be handed keys from another SDK's enum (e.g. LMCache's own), so lookups go
    through the value, never through enum identity.
    """
    return key.value if isinstance(key, enum.Enum) else key


LMCacheSDKCacheKind = CacheKind
