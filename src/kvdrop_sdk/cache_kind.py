"""The cache kinds a context can address: the KV cache and the query (intermediate) tensors.

``CacheKind`` also owns the server-side naming rule: a model's query tensors are stored under
their own server model name (``kind.server_model_name(model)``), so KV and queries of one model
never share chunk keys or layouts. Its methods behave as upstream ``LMCacheSDKCacheKind``'s.
:class:`KindMap` is the mapping handed to edit functions: it finds a kind by value, so an edit
function may index it with LMCache's own enum.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["CacheKind", "KindMap", "kind_value"]

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
        model name for KV, ``"<model>##query"`` for QUERY (as upstream: the suffix is always
        appended)."""
        if self is CacheKind.QUERY:
            return model_name + _QUERY_SUFFIX
        return model_name

    def base_model_name(self, model_name: str) -> str:
        """The inverse of :meth:`server_model_name`: QUERY strips ``"##query"``, KV keeps the
        name."""
        if self is CacheKind.QUERY:
            return model_name.removesuffix(_QUERY_SUFFIX)
        return model_name


def kind_value(key: Any) -> Any:
    """The plain value of a cache-kind key: ``.value`` of an enum, else the key itself.

    Edit functions may be handed keys from another SDK's enum (e.g. LMCache's own), so lookups go
    through the value, never through enum identity.
    """
    return key.value if isinstance(key, enum.Enum) else key


class KindMap(dict):  # type: ignore[type-arg]
    """``{CacheKind: tensor}`` whose lookups also accept any enum or string of the same value.

    Edit functions written for ``lmcache.sdk`` index with LMCache's own ``LMCacheSDKCacheKind``,
    whose members neither hash nor compare like kvdrop's; ``m[key]``, ``key in m`` and
    ``m.get(key)`` resolve such keys through their ``.value``. Iteration yields ``CacheKind`` keys.
    """

    def _resolve(self, key: Any) -> Any:
        value = kind_value(key)
        for own in self:
            if kind_value(own) == value:
                return own
        return _MISSING

    def __missing__(self, key: Any) -> Any:
        own = self._resolve(key)
        if own is _MISSING:
            have = ", ".join(repr(kind_value(k)) for k in self) or "none"
            raise KeyError(f"no {kind_value(key)!r} tensor (have: {have})")
        return dict.__getitem__(self, own)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or self._resolve(key) is not _MISSING

    def get(self, key: Any, default: Any = None) -> Any:
        """``m[key]`` or ``default``, with the same value-based key resolution."""
        return self[key] if key in self else default


_MISSING = object()
