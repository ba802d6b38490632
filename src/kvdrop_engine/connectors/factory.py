"""The connector factory: the one list of connector kinds, and :func:`make_connector`.

vLLM's ``KVConnectorFactory`` shape. :data:`CONNECTOR_KINDS` feeds every command line's
``--cache-server`` ``choices=`` (``kvdrop engine``, ``kvdrop demo``, ``kvdrop eval`` through the
experiment harness), so a new kind is added here and nowhere else. This module imports no
connector at import time (a command line reads the kinds without them, and LMCache stays
optional): each builder imports its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdrop_sdk.query_capture import QueryCapture

if TYPE_CHECKING:
    from kvdrop_engine.connectors.base import KVConnector

__all__ = ["CONNECTOR_KINDS", "capture_mode", "make_connector"]


def _kvdrop(
    url: str, http_url: str, model_name: str, queries: QueryCapture | None, **options: Any
) -> KVConnector:
    from kvdrop_engine.connectors.kvdrop import ServerConnector

    if queries is not None:  # a capture that uses the query store demands it
        options.setdefault("transfer_query", queries.uses_query_context or None)
    return ServerConnector(url, http_url, model_name, queries=queries, **options)


def _lmcache(
    url: str, http_url: str, model_name: str, queries: QueryCapture | None, **options: Any
) -> KVConnector:
    from kvdrop_engine.connectors.lmcache import LMCacheConnector, require_lmcache

    require_lmcache()
    if queries is not None:
        options.setdefault("transfer_query", queries.enabled or None)
    return LMCacheConnector(url, http_url, model_name, queries=queries, **options)


#: The connector kinds :func:`make_connector` builds, by name.
_BUILDERS: dict[str, Callable[..., KVConnector]] = {"kvdrop": _kvdrop, "lmcache": _lmcache}
#: Every connector kind, in the order command lines list them ("kvdrop" first: the default).
CONNECTOR_KINDS: tuple[str, ...] = tuple(_BUILDERS)
#: Kinds whose server stores queries only whole, in chunks (upstream's layout: no windows).
_CHUNK_QUERIES_ONLY = frozenset({"lmcache"})


def capture_mode(kind: str, asked: str) -> str:
    """The query capture mode a connector of ``kind`` serves for ``asked`` ("auto", "window" or
    "full"): "full" where its server keeps only chunk queries (LMCache), else ``asked``."""
    return "full" if kind in _CHUNK_QUERIES_ONLY else asked


def make_connector(
    kind: str,
    url: str,
    http_url: str,
    model_name: str,
    *,
    queries: QueryCapture | None = None,
    **options: Any,
) -> KVConnector:
    """The engine's connector of ``kind`` ("kvdrop": a kvdrop server, "lmcache": an LMCache
    server), capturing ``queries`` (:meth:`QueryCapture.for_policies`), handed over unchanged
    (omitted: the connector's own default, the lean window for kvdrop's, whole chunks for
    LMCache's). ``options`` are the connector's own keyword arguments."""
    build = _BUILDERS.get(kind)
    if build is None:
        raise ValueError(f"connector kind must be one of {CONNECTOR_KINDS}, got {kind!r}")
    return build(url, http_url, model_name, queries, **options)
