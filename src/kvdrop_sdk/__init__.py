"""kvdrop_sdk: retrieve a request's KV cache from a kvdrop server, edit it, store it back.

Follows the API of the upstream KV Cache SDK (``import kvdrop_sdk as lmc_sdk`` works for code
written against it).
"""

from __future__ import annotations

from kvdrop_sdk import batch, kvcache, qcache, request
from kvdrop_sdk.batch import BatchedStream, LMCacheBatchedStream
from kvdrop_sdk.cache_kind import CacheKind, LMCacheSDKCacheKind
from kvdrop_sdk.context import Context, LMCacheSDKContext, connect
from kvdrop_sdk.errors import (
    BatchedStreamError,
    LMCacheBatchedStreamError,
    LMCacheRequestStreamError,
    LMCacheSDKError,
    RequestStreamError,
    SDKError,
)
from kvdrop_sdk.events import PostCompletion, TokenEvent
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.metrics import Metrics
from kvdrop_sdk.request import (
    LMCacheRequestStream,
    RequestStream,
    StreamPerfMetrics,
    create_request,
)
from kvdrop_sdk.types import ModifyFnType

__all__ = [
    "BatchedStream",
    "BatchedStreamError",
    "CacheKind",
    "CacheLayout",
    "Context",
    "LMCacheBatchedStream",
    "LMCacheBatchedStreamError",
    "LMCacheRequestStream",
    "LMCacheRequestStreamError",
    "LMCacheSDKCacheKind",
    "LMCacheSDKContext",
    "LMCacheSDKError",
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
    "create_request",
    "kvcache",
    "qcache",
    "request",
]
