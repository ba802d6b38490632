"""kvdrop_sdk: retrieve a request's KV cache from a kvdrop server, edit it, store it back.

The transport SDK, one module per concept: ``context`` (a connection for one model and cache
kind; ``kvcache`` / ``qcache`` open one), ``request`` and ``batch`` (request streams: prefill ->
modify -> decode), ``metrics``, ``protocol`` (the wire format), ``transport`` (shared memory or
socket), ``server`` (the cache server) and ``adapters`` (engines it talks to: any
OpenAI-compatible server, a deterministic toy engine). It follows the API of the upstream KV
Cache SDK: ``import kvdrop_sdk as lmc_sdk`` works for code written against it, with the upstream
``LMCache*`` names from :mod:`kvdrop_sdk.compat`.
"""

from __future__ import annotations

from kvdrop_sdk import batch, compat, context, kvcache, qcache, request
from kvdrop_sdk.batch import BatchedStream
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.compat import (  # noqa: F401 (re-exported: __all__ += compat.__all__)
    LMCacheBatchedStream,
    LMCacheBatchedStreamError,
    LMCacheRequestStream,
    LMCacheRequestStreamError,
    LMCacheSDKCacheKind,
    LMCacheSDKContext,
    LMCacheSDKError,
)
from kvdrop_sdk.context import Context, connect
from kvdrop_sdk.edit import ModifyFnType
from kvdrop_sdk.errors import BatchedStreamError, RequestStreamError, SDKError
from kvdrop_sdk.events import PostCompletion, TokenEvent
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.metrics import Metrics
from kvdrop_sdk.request import RequestStream, StreamPerfMetrics, create_request

__all__ = [
    "BatchedStream",
    "BatchedStreamError",
    "CacheKind",
    "CacheLayout",
    "Context",
    "Metrics",
    "ModifyFnType",
    "PostCompletion",
    "RequestStream",
    "RequestStreamError",
    "SDKError",
    "StreamPerfMetrics",
    "TokenEvent",
    "batch",
    "connect",
    "context",
    "create_request",
    "kvcache",
    "qcache",
    "request",
]
__all__ += compat.__all__  # the upstream LMCache* names
