"""The engine's connector to a kvdrop server: load cached prefixes, store prompts and windows.

:class:`ServerConnector` talks to a kvdrop server through ``kvdrop_sdk`` contexts; it is one
:class:`~kvdrop_engine.connectors.base.KVConnector` (the contract the engine uses), built by name
by :func:`~kvdrop_engine.connectors.factory.make_connector`. What admission loads and stores is
the scheduler's decision (:func:`kvdrop_engine.scheduler.plan_prefix`); the jobs that ship
results are :mod:`kvdrop_engine.transfer`'s.

The engine calls ``bind`` once with its model config and dtype; the connector then registers the
model's KV layout ``[2, L, T, Hkv*d]`` with the model's RoPE parameters (so edit functions can
re-rotate kept keys without being told) and, when the server runs with ``transfer_query``, the
query layout ``[1, L, T, Hq*d]`` of all query heads, post-RoPE, by opening one SDK ``Context`` per
kind.

Queries come in two modes (``query_capture``):

* ``"window"`` (default, lean): per request, only the rows a policy can use -- the last
  ``query_window`` computed positions of the whole sequence (the prompt's uncached tail and the
  generated tokens included) and every ``query_stride``-th position -- stored once at the end of
  the request as a window record keyed by its token ids (:mod:`kvdrop_sdk.window`,
  :class:`~kvdrop_engine.capture.WindowCapture`), with each row's attention log-normalisers.
  About ``(W + T / S) / T`` of the full queries.
* ``"full"`` (upstream layout, for LMCache-style consumers): every prompt token's query in whole
  chunks under ``<model>##query``, plus the window record.

``load`` returns the longest cached chunk-aligned KV prefix of a prompt (queries are never needed to
decode); ``store`` pushes a prompt's whole chunks of KV (and chunk queries); ``store_window`` the
window record. Every call is keyed by the request's own token ids and cache salt, and SDK contexts
are thread-safe (each call borrows its own socket), so any number of concurrent requests can go
through one connector.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import requests
import torch
from torch import Tensor

from kvdrop_engine.connectors.base import KVConnector, check_server_args
from kvdrop_engine.model import ModelConfig
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed
from kvdrop_sdk.transport import cuda_host
from kvdrop_sdk.window import QueryWindow, TokenScores, store_scores, store_window

__all__ = ["ServerConnector", "server_has_transfer_query"]


def server_has_transfer_query(http_url: str, timeout: float = 10.0) -> bool:
    """Whether the server at ``http_url`` lists "transfer_query" in ``GET /config``'s "features"
    (the kvdrop server's key; "enabled" is accepted too)."""
    url = http_url.rstrip("/") + "/config"
    try:
        resp = requests.get(url, timeout=timeout)
        resp.raise_for_status()
        body = resp.json()
    except (requests.RequestException, ValueError) as exc:
        raise SDKError(f"could not read the kvdrop server's config from {url}: {exc}") from exc
    enabled = body.get("features", body.get("enabled", [])) if isinstance(body, dict) else None
    if not isinstance(enabled, list):
        raise SDKError(f"{url} answered {body!r}; expected a JSON object with a 'features' list")
    return "transfer_query" in enabled


class ServerConnector(KVConnector):
    """The engine's link to a kvdrop server (see module docstring).

    ``transfer_query=None`` follows the server's ``/config``; ``True`` demands it (error if the
    server lacks it); ``False`` never stores queries. ``queries`` (a :class:`QueryCapture`, taken
    as it is) says what is captured when queries are on: mode "full" stores every prompt query
    in chunks (and the window), "window" the lean window of ``queries.window`` (W) last and every
    ``queries.stride``-th (S; 0 = none) positions, "none" no query; not given: the lean window.
    ``store_decoded`` also stores, at the end of a request, the KV of the whole chunks its
    generated tokens completed (so a later edit can drop from them too; off by default: it reads
    the request's KV back once more).
    """

    stores_windows = True
    stores_scores = True

    def __init__(
        self,
        url: str,
        http_url: str,
        model_name: str,
        *,
        queries: QueryCapture | None = None,
        transfer_query: bool | None = None,
        timeout: float = 60.0,
        transport: str = "auto",
        store_decoded: bool = False,
    ) -> None:
        check_server_args(model_name, transfer_query)
        if queries is None:
            queries = QueryCapture(QueryNeed.WINDOW)
        super().__init__(queries, store_decoded=store_decoded)
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.timeout = timeout
        self.transport = transport
        self._want_query = transfer_query
        self.kv_layout: CacheLayout | None = None
        self.query_layout: CacheLayout | None = None
        self._kv_ctx: Any = None
        self._load_device: torch.device | None = None
        self._q_ctx: Any = None

    def bind(
        self, config: ModelConfig, dtype: torch.dtype, *, device: torch.device | None = None
    ) -> None:
        """Register the layouts of a model with ``config`` (L, heads, head_dim) in ``dtype``;
        prefixes load straight to a CUDA ``device`` (DMA from the server's shared memory)."""
        if self._kv_ctx is not None:
            raise SDKError("this connector is already bound to an engine; make one per engine")
        gpu = device is not None and device.type == "cuda" and cuda_host.enabled()
        self._load_device = device if gpu else None
        self.kv_layout = CacheLayout(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            rope=config.rope.to_json(),
        )
        server_q = server_has_transfer_query(self.http_url, timeout=min(self.timeout, 10.0))
        if self._want_query and not server_q:
            raise SDKError(
                f"transfer_query=True but the server at {self.http_url} does not enable it; "
                "start it with --enable transfer_query or pass transfer_query=None/False"
            )
        want_q = server_q if self._want_query is None else self._want_query
        kv_ctx = self._connect(CacheKind.KV, self.kv_layout)
        q_ctx = None
        if want_q:
            self.query_layout = CacheLayout(
                config.num_layers, config.num_heads, config.head_dim, dtype
            )
            try:
                q_ctx = self._connect(CacheKind.QUERY, self.query_layout)
            except Exception:
                kv_ctx.close()
                raise
        self._kv_ctx, self._q_ctx = kv_ctx, q_ctx
        self.transfer_query = q_ctx is not None
        self.chunk_size = int(kv_ctx.chunk_size)

    def _connect(self, kind: CacheKind, layout: CacheLayout) -> Any:
        return connect(
            kind,
            self.url,
            self.http_url,
            self.model_name,
            self.timeout,
            layout=layout,
            transport=self.transport,
        )

    def _ctx(self) -> Any:
        if self._kv_ctx is None:
            raise SDKError("connector is not bound; pass it to Engine(connector=...) first")
        return self._kv_ctx

    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Length of the longest cached chunk-aligned KV prefix of ``tokens``."""
        ctx = self._ctx()
        return int(ctx.lookup(list(tokens), cache_salt))

    def lookup_queries(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Length of the longest cached chunk-aligned query prefix (0 without transfer_query)."""
        self._ctx()
        if self._q_ctx is None:
            return 0
        return int(self._q_ctx.lookup(list(tokens), cache_salt))

    def load(self, tokens: Sequence[int], cache_salt: str = "") -> Tensor | None:
        """KV ``[2, L, T, Hkv*d]`` of the longest cached prefix of ``tokens``, or None: on the
        engine's GPU when it has one (a side stream made it: ``record_stream`` before use on
        another), else on the CPU."""
        ctx = self._ctx()
        try:
            kv = ctx.retrieve(list(tokens), cache_salt, device=self._load_device)
        except torch.OutOfMemoryError:  # no room for the prefix on the GPU now: via the host
            kv = ctx.retrieve(list(tokens), cache_salt)
        if kv is None or kv.shape[2] == 0:
            return None
        assert self.kv_layout is not None
        expected = self.kv_layout.shape(CacheKind.KV, kv.shape[2])
        if tuple(kv.shape) != expected:
            raise SDKError(
                f"server returned KV of shape {tuple(kv.shape)}; expected {expected} for "
                f"model {self.model_name!r}"
            )
        return kv

    def store(
        self,
        kv: Tensor,
        queries: Tensor | None,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        query_offset: int = 0,
    ) -> int:
        """Store whole chunks of ``kv`` ``[2, L, T, Hkv*d]`` and of the queries; returns how
        many query tokens were stored.

        ``queries`` ``[1, L, T - query_offset, Hq*d]`` are those of tokens ``query_offset..``;
        the first ``query_offset`` (a prefix shared with an earlier prompt) are read back from
        the server to complete them. Queries are skipped when the server has no
        ``transfer_query`` or no longer holds that prefix.
        """
        ctx = self._ctx()
        toks = list(tokens)
        # Queries go in BEFORE the KV: another request that finds this KV prefix (and loads it
        # instead of computing it) then always finds its queries too. Storing KV first left a
        # window in which that request stored no queries, and the query cache had a hole.
        stored = self._store_queries(queries, toks, cache_salt, query_offset)
        ctx.store(kv, toks, cache_salt)
        return stored

    def _store_queries(
        self, queries: Tensor | None, toks: list[int], cache_salt: str, query_offset: int
    ) -> int:
        if queries is None or self._q_ctx is None:
            return 0
        if query_offset:
            head = self._q_ctx.retrieve(toks[:query_offset], cache_salt)
            if head is None or head.shape[2] < query_offset:
                return 0  # evicted meanwhile: a partial query prefix would mislead policies
            queries = torch.cat([head[:, :, :query_offset].to(queries.dtype), queries], dim=2)
        if queries.shape[2] != len(toks):
            raise SDKError(
                f"queries cover {queries.shape[2]} tokens but {len(toks)} tokens are stored"
            )
        self._q_ctx.store(queries, toks, cache_salt)
        return len(toks) // self.chunk_size * self.chunk_size

    def store_window(
        self, tokens: Sequence[int], window: QueryWindow, cache_salt: str = ""
    ) -> bool:
        """Store the query window of the call over ``tokens`` (False without transfer_query)."""
        self._ctx()
        if self._q_ctx is None:
            return False
        return store_window(self._q_ctx, list(tokens), window, cache_salt)

    def store_scores(
        self, tokens: Sequence[int], scores: TokenScores, cache_salt: str = ""
    ) -> bool:
        """Store a call's reconstruction scores (kvzip) beside its window (False without
        transfer_query: the scores live in the query store)."""
        self._ctx()
        if self._q_ctx is None:
            return False
        return store_scores(self._q_ctx, list(tokens), scores, cache_salt)

    def close(self) -> None:
        """Close the contexts (idempotent)."""
        for ctx in (self._q_ctx, self._kv_ctx):
            if ctx is not None:
                ctx.close()
        self._kv_ctx = self._q_ctx = None
