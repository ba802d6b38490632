"""The cache kinds a context can address: the KV cache and the query (intermediate) tensors.

``CacheKind`` also owns the server-side naming rule: a model's query tensors are stored under
their own server model name (``kind.server_model_name(model)``), so KV and queries of one model
never share chunk keys or layouts.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["CacheKind", "kind_value"]

#: Appended to a model name to name its query tensors on the server (as upstream LMCache does).
_QUERY_SUFFIX = "##query"


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

    def server_model_name(self, model_name: str) -> str:
        """The name ``model_name``'s tensors of this kind are stored under on the server: the
        model name for KV, ``"<model>##query"`` for QUERY (a name that has the suffix keeps it)."""
        if self is CacheKind.QUERY and not model_name.endswith(_QUERY_SUFFIX):
            return model_name + _QUERY_SUFFIX
        return model_name

    @staticmethod
    def base_model_name(server_model_name: str) -> str:
        """The model a server model name belongs to: ``"m##query"`` and ``"m"`` -> ``"m"``."""
        return server_model_name.removesuffix(_QUERY_SUFFIX)


def kind_value(key: Any) -> Any:
    """The plain value of a cache-kind key: ``.value`` of an enum, else the key itself.

    Edit functions may be handed keys from another SDK's enum (e.g. LMCache's own), so lookups go
    through the value, never through enum identity.
    """
    return key.value if isinstance(key, enum.Enum) else key
