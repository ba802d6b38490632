"""The contexts of one request stream: which tokens are cached, retrieval, and waiting for stores.

:class:`StreamContexts` holds one context per cache kind (kvdrop's, or another SDK's wrapped once
by :mod:`kvdrop_sdk.foreign`) and answers the cache questions a
:class:`~kvdrop_sdk.request.RequestStream` asks, so the stream itself only keeps tokens.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.capabilities import (
    CheapLookup,
    KeepsOnServer,
    KnowsLayout,
    StoresRecords,
    TransfersToDevice,
)
from kvdrop_sdk.edit import EditQueries, merge_queries, warn_plain_window
from kvdrop_sdk.errors import RequestStreamError, SDKError
from kvdrop_sdk.foreign import ForeignContext, StreamContext, wrap_contexts
from kvdrop_sdk.keep import EditPath
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.query_capture import UPSTREAM_CAPTURE, Needs, QueryCapture
from kvdrop_sdk.validate import edit_device
from kvdrop_sdk.window import retrieve_window

__all__ = ["EditTransfer", "Retrieved", "StreamContexts", "edit_device", "edit_transfer"]

logger = logging.getLogger(__name__)

#: Tensors per kind cut to their common cached length, and that length.
Retrieved = tuple[dict[CacheKind, torch.Tensor], int]


class EditTransfer(enum.Enum):
    """How an edit's tensors travel between a context and the device the edit runs on."""

    #: On the host: retrieved and stored as CPU tensors (no device, or a CPU one).
    HOST = "host"
    #: A kvdrop Context and a GPU: chunk slots DMA'd straight from/to the server's shared memory.
    DMA = "dma"
    #: Another SDK's context and a device: retrieved on the host, then ``.to(device)``; stored
    #: back with ``.cpu()`` (it takes host tensors only).
    COPY = "copy"


def edit_transfer(ctx: StreamContext, device: torch.device | str | None) -> EditTransfer:
    """The one rule for where an edit's tensors go (see :class:`EditTransfer`)."""
    where = None if device is None else torch.device(device)
    if where is None or where.type == "cpu":
        return EditTransfer.HOST
    if isinstance(ctx, TransfersToDevice) and where.type == "cuda":
        return EditTransfer.DMA
    return EditTransfer.COPY


class StreamContexts:
    """One context per cache kind for stream ``stream_id`` (see the module docstring)."""

    def __init__(self, contexts: Iterable[Any] | Any, stream_id: str) -> None:
        self.by_kind: dict[CacheKind, StreamContext] = wrap_contexts(contexts)
        self.stream_id = stream_id

    def given(self) -> dict[CacheKind, Any]:
        """The contexts as the caller passed them (another SDK's unwrapped)."""
        return {k: c.inner if isinstance(c, ForeignContext) else c for k, c in self.by_kind.items()}

    def get(self, kind: CacheKind) -> StreamContext:
        """The ``kind`` context; RequestStreamError naming what the stream has instead."""
        try:
            return self.by_kind[kind]
        except KeyError:
            have = ", ".join(k.value for k in self.by_kind) or "none"
            raise RequestStreamError(
                f"stream {self.stream_id} has no {kind.value!r} context (has: {have}); pass one "
                "to create_request"
            ) from None

    def query_capture(self) -> QueryCapture:
        """What the engine stores of the queries, as the query context was told (another SDK's
        context: upstream's full queries in chunks)."""
        ctx = self.by_kind.get(CacheKind.QUERY)
        return ctx.capture if isinstance(ctx, StoresRecords) else UPSTREAM_CAPTURE

    def add_queries(
        self,
        tensors: dict[CacheKind, torch.Tensor],
        tokens: list[int],
        salt: str,
        needs: Needs,
        with_context: bool,
    ) -> EditQueries | None:
        """Put the query rows an edit of the cached KV in ``tensors`` gets beside it (the KV cut
        to the rows they cover); None when the function reads none or there is no query
        context. Chunk queries are read only where the engine stores them (``capture.full``),
        the engine's window of the call over ``tokens`` only from a context that stores
        records; :func:`~kvdrop_sdk.edit.merge_queries` puts them together."""
        q_ctx = self.by_kind.get(CacheKind.QUERY)
        if q_ctx is None or not needs.reads_queries:
            return None
        capture = self.query_capture()
        dense = q_ctx.retrieve(tokens, salt) if capture.full else None
        has_dense = dense is not None and dense.shape[2] > 0
        window = None
        if capture.enabled and isinstance(q_ctx, StoresRecords) and (with_context or not has_dense):
            found = retrieve_window(q_ctx, tokens, salt)
            if found is not None:
                window = (found.queries, found.positions, found.lse)
        if window is not None and not has_dense and not with_context:
            warn_plain_window(self.stream_id)
        kv = tensors[CacheKind.KV]
        queries = merge_queries(dense, window, int(kv.shape[2]), with_context)
        if queries.query is not None:
            tensors[CacheKind.QUERY] = queries.query
        if kv.shape[2] != queries.rows:
            tensors[CacheKind.KV] = kv[:, :, : queries.rows].contiguous()
        return queries

    def kv_layout(self) -> CacheLayout | None:
        """The kvdrop KV context's layout, its RoPE re-read from the server when the engine
        registered it after the context read the layout (None for another SDK's context)."""
        ctx = self.by_kind.get(CacheKind.KV)
        if not isinstance(ctx, KnowsLayout):
            return None
        layout = ctx.layout
        if layout.rope is None:
            try:
                layout = ctx.register_caches()
            except SDKError:
                pass
        return layout

    def chunk_size(self) -> int:
        """The KV context's chunk size (else any context's; 0 without contexts)."""
        ctx = self.by_kind.get(CacheKind.KV) or next(iter(self.by_kind.values()), None)
        return int(ctx.chunk_size) if ctx is not None else 0

    def cached_len(self, tokens: list[int], salt: str) -> int:
        """Chunk-aligned cached length of the KV (queries may legitimately hold nothing), or
        the length common to every context without a KV one (0 without contexts)."""
        kv_ctx = self.by_kind.get(CacheKind.KV)
        if kv_ctx is not None:
            return int(kv_ctx.lookup(tokens, salt))
        if not self.by_kind:
            return 0
        return min(int(ctx.lookup(tokens, salt)) for ctx in self.by_kind.values())

    def retrieve_all(
        self,
        tokens: list[int],
        salt: str,
        kinds: Sequence[CacheKind] | None = None,
        device: torch.device | str | None = None,
    ) -> Retrieved | None:
        """Tensors of ``kinds`` (default every context's) cut to their common cached length, on
        ``device`` (default the host; :func:`edit_transfer` says how they get there); None when
        the KV (or, without a KV context, any kind) has nothing cached."""
        if not self.by_kind:
            raise RequestStreamError(
                f"stream {self.stream_id} has no contexts; pass them to create_request"
            )
        got: dict[CacheKind, torch.Tensor] = {}
        for kind, ctx in self.by_kind.items():
            if kinds is not None and kind not in kinds:
                continue
            tensor = _retrieve_onto(ctx, tokens, salt, device)
            if tensor is None or tensor.shape[2] == 0:
                if kind is CacheKind.KV or CacheKind.KV not in self.by_kind:
                    return None
                continue
            got[kind] = tensor
        if not got:
            return None
        common = min(t.shape[2] for t in got.values())
        for kind, tensor in got.items():
            if tensor.shape[2] != common:
                got[kind] = tensor[:, :, :common].contiguous()
        return got, common

    def retrieve_when_cached(
        self,
        tokens: list[int],
        salt: str,
        expected: int,
        timeout: float,
        poll_interval: float,
        kinds: Sequence[CacheKind] | None = None,
        device: torch.device | str | None = None,
    ) -> Retrieved | None:
        """:meth:`retrieve_all` (onto ``device``) once ``expected`` tokens are cached, or
        whatever is cached when ``timeout`` runs out."""
        deadline = time.monotonic() + max(timeout, 0.0)
        kv_ctx = self.get(CacheKind.KV)
        if isinstance(kv_ctx, CheapLookup):
            while (
                expected > 0
                and kv_ctx.lookup(tokens, salt) < expected
                and time.monotonic() < deadline
            ):
                time.sleep(poll_interval)
            return self.retrieve_all(tokens, salt, kinds, device)
        while True:  # no cheap lookup (lmcache.sdk's contexts): poll by retrieving, as upstream
            got = self.retrieve_all(tokens, salt, kinds, device)
            have = 0 if got is None else got[1]
            if expected <= 0 or have >= expected or time.monotonic() >= deadline:
                return got
            time.sleep(poll_interval)

    def retrieve_reads(
        self,
        tokens: list[int],
        salt: str,
        expected: int,
        timeout: float,
        poll_interval: float,
        path: EditPath,
        device: torch.device | None = None,
    ) -> tuple[Retrieved, int] | None:
        """For a server-kept edit (``path`` KEYS or INDEX, :func:`~kvdrop_sdk.keep.edit_path`),
        once ``expected`` tokens are cached (or at ``timeout``): ``{KV: [2, L, T, D]}`` holding
        only what the edit reads (the keys, standing in for the values too; or a broadcast
        zero), and the KV bytes fetched; None when nothing is cached."""
        ctx = self.get(CacheKind.KV)
        assert isinstance(ctx, KeepsOnServer) and isinstance(ctx, KnowsLayout)
        deadline = time.monotonic() + max(timeout, 0.0)
        cached = int(ctx.lookup(tokens, salt))
        while cached < expected and time.monotonic() < deadline:
            time.sleep(poll_interval)
            cached = int(ctx.lookup(tokens, salt))
        if cached == 0:
            return None
        if path is EditPath.KEYS:
            keys = ctx.retrieve_keys(tokens[:cached], salt, device=device)
            if keys is None or keys.shape[2] == 0:
                return None
            return ({CacheKind.KV: keys.expand(2, -1, -1, -1)}, int(keys.shape[2])), keys.nbytes
        layout = ctx.layout
        shape = layout.shape(CacheKind.KV, cached)
        zero = torch.zeros((), dtype=layout.dtype, device=device)
        return ({CacheKind.KV: zero.expand(shape)}, cached), 0

    def store(
        self, kind: CacheKind, tensor: torch.Tensor, tokens: list[int], salt: str, timeout: float
    ) -> bool:
        """Store ``tensor`` under ``tokens``; for another SDK's context, wait until it serves it.

        An LMCache server acknowledges a store before it commits it; without the wait the next
        request (the decode after a modify) could miss the edit and recompute the kept tokens.
        kvdrop's server commits before it answers (no wait). A device tensor goes to a kvdrop
        context as it is (stored by DMA) and to another SDK's as ``.cpu()``.
        """
        ctx = self.by_kind[kind]
        if edit_transfer(ctx, tensor.device) is EditTransfer.COPY:
            tensor = tensor.cpu()
        stored = bool(ctx.store(tensor, tokens, salt))
        if stored and not isinstance(ctx, CheapLookup):
            self._await_visible(ctx, tokens, timeout, salt)
        return stored

    def _await_visible(
        self, ctx: StreamContext, tokens: list[int], timeout: float, salt: str
    ) -> None:
        chunk = self.chunk_size()
        whole = len(tokens) // chunk * chunk
        deadline = time.monotonic() + max(timeout, 0.0)
        while ctx.lookup(tokens, salt) < whole:
            if time.monotonic() >= deadline:
                logger.warning(
                    "stream %s: the server does not serve the %d stored tokens after %gs",
                    self.stream_id,
                    whole,
                    timeout,
                )
                return
            time.sleep(0.005)


def _retrieve_onto(
    ctx: StreamContext, tokens: list[int], salt: str, device: torch.device | str | None
) -> torch.Tensor | None:
    """``ctx``'s tensor for ``tokens`` on ``device``, the way :func:`edit_transfer` says."""
    how = edit_transfer(ctx, device)
    if how is EditTransfer.DMA:
        assert isinstance(ctx, TransfersToDevice)
        return ctx.retrieve(tokens, salt, device=device)
    tensor = ctx.retrieve(tokens, salt)
    if how is EditTransfer.COPY and tensor is not None:
        return tensor.to(device)
    return tensor
