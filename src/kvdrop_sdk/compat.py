"""Upstream LMCache names for kvdrop_sdk's classes, so code written against ``lmcache.sdk`` ports
with ``import kvdrop_sdk as lmc_sdk``.

Every alias is defined here and nowhere else. Upstream documents them on its modules
(``context.LMCacheSDKContext``, ``request.LMCacheRequestStream``, ``batch.LMCacheBatchedStream``,
``cache_kind.LMCacheSDKCacheKind``, ...), so this module also attaches each alias to the kvdrop
module of the same name; ``kvdrop_sdk/__init__`` imports it, which makes those paths work as soon
as any part of ``kvdrop_sdk`` is imported.
"""

from __future__ import annotations

import importlib

from kvdrop_sdk.batch import BatchedStream
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context
from kvdrop_sdk.errors import BatchedStreamError, RequestStreamError, SDKError
from kvdrop_sdk.request import RequestStream

__all__ = [
    "LMCacheBatchedStream",
    "LMCacheBatchedStreamError",
    "LMCacheRequestStream",
    "LMCacheRequestStreamError",
    "LMCacheSDKCacheKind",
    "LMCacheSDKContext",
    "LMCacheSDKError",
]

LMCacheSDKCacheKind = CacheKind
LMCacheSDKContext = Context
LMCacheRequestStream = RequestStream
LMCacheBatchedStream = BatchedStream
LMCacheSDKError = SDKError
LMCacheRequestStreamError = RequestStreamError
LMCacheBatchedStreamError = BatchedStreamError

#: kvdrop_sdk module -> the aliases importable from it (upstream's module paths, plus ``errors``).
MODULE_ALIASES: dict[str, tuple[str, ...]] = {
    "cache_kind": ("LMCacheSDKCacheKind",),
    "context": ("LMCacheSDKContext", "LMCacheSDKCacheKind", "LMCacheSDKError"),
    "request": ("LMCacheRequestStream", "LMCacheRequestStreamError"),
    "batch": ("LMCacheBatchedStream", "LMCacheBatchedStreamError"),
    "errors": ("LMCacheSDKError", "LMCacheRequestStreamError", "LMCacheBatchedStreamError"),
}


def _attach() -> None:
    """Make each alias an attribute of its upstream module (see the module docstring)."""
    for module, names in MODULE_ALIASES.items():
        target = importlib.import_module(f"kvdrop_sdk.{module}")
        for name in names:
            setattr(target, name, globals()[name])


_attach()
