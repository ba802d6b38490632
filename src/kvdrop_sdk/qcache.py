"""``qcache.connect``: a context for query tensors (``[1, L, T, num_q_heads * head_dim]``).

They are stored under the server model name ``<model>##query``; the server must run with
``--enable transfer_query``.
"""

from __future__ import annotations

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context
from kvdrop_sdk.context import connect as _connect
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.query_capture import QueryCapture

__all__ = ["connect"]


def connect(
    url: str,
    http_url: str,
    model_name: str,
    timeout: float = 60.0,
    *,
    layout: CacheLayout | None = None,
    transport: str = "auto",
    capture: QueryCapture | None = None,
) -> Context:
    """Same as ``kvdrop_sdk.connect(CacheKind.QUERY, ...)``; ``capture`` is what the engine
    stores of the queries (a stream reads only what it stores)."""
    return _connect(
        CacheKind.QUERY,
        url,
        http_url,
        model_name,
        timeout,
        layout=layout,
        transport=transport,
        capture=capture,
    )
