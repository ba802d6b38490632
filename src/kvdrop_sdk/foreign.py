"""Objects from outside kvdrop_sdk, wrapped once in the shape a request stream reads.

- :class:`ForeignContext`: an ``lmcache.sdk`` context (``LMCacheSDKContext``: ``kind``,
  ``chunk_size``, ``retrieve``, ``store``) as a :class:`~kvdrop_sdk.capabilities.StreamContext`
  with kvdrop's ``lookup`` (by retrieving, as upstream polls) and none of the other
  capabilities (no layout, no cheap lookup, no records). A kvdrop
  :class:`~kvdrop_sdk.context.Context` is a stream context already and is used as it is.
- :func:`as_token_event`: an engine's event as a :class:`~kvdrop_sdk.events.TokenEvent`.

The upstream ``LMCache*`` names themselves are :mod:`kvdrop_sdk.compat`'s; this module sits below
the request stream so that it can import it (``compat`` imports the stream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.capabilities import StreamContext
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.validate import is_int

__all__ = ["Closeable", "ForeignContext", "StreamContext", "as_token_event", "wrap_contexts"]


class ForeignContext(StreamContext):
    """A context of another SDK (``lmcache.sdk``) with the members a request stream reads."""

    def __init__(self, ctx: Any) -> None:
        try:
            kind, self._retrieve, self._store = ctx.kind, ctx.retrieve, ctx.store
            int(ctx.chunk_size)
        except AttributeError as exc:
            raise TypeError(
                f"a context needs kind, chunk_size, retrieve and store (a kvdrop_sdk.Context or "
                f"lmcache.sdk's LMCacheSDKContext); a {type(ctx).__name__} has no {exc.name!r}"
            ) from None
        self.inner = ctx
        self.kind = CacheKind.parse(kind)

    @property
    def chunk_size(self) -> int:
        return int(self.inner.chunk_size)

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        return self._retrieve(tokens, cache_salt)

    def store(self, tensor: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> bool:
        return bool(self._store(tensor, tokens, cache_salt))

    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Cached chunk-aligned tokens: the length ``retrieve`` returns (no cheap lookup)."""
        tensor = self._retrieve(tokens, cache_salt)
        return 0 if tensor is None else int(tensor.shape[2])

    def __repr__(self) -> str:
        return f"ForeignContext({self.inner!r})"


def wrap_contexts(contexts: Iterable[Any] | Any) -> dict[CacheKind, StreamContext]:
    """One context per kind: kvdrop's as they are, others wrapped; ValueError on a repeat."""
    many = isinstance(contexts, Iterable) and not isinstance(contexts, StreamContext)
    out: dict[CacheKind, StreamContext] = {}
    for ctx in contexts if many else [contexts]:
        wrapped = ctx if isinstance(ctx, StreamContext) else ForeignContext(ctx)
        kind = CacheKind.parse(wrapped.kind)
        if kind in out:
            raise ValueError(f"two contexts for cache kind {kind.value!r}; pass one per kind")
        out[kind] = wrapped
    return out


@runtime_checkable
class Closeable(Protocol):
    """An engine's token stream that can be released early (a generator, a connection)."""

    def close(self) -> None: ...


def as_token_event(event: Any) -> TokenEvent:
    """``event`` as a TokenEvent: itself, or the fields of an event shaped like one (another
    engine's dataclass or plain object); TypeError when it carries no int ``token_id``."""
    given = type(event).__name__
    if not isinstance(event, TokenEvent):
        if dataclasses.is_dataclass(event) and not isinstance(event, type):
            fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        else:
            fields = dict(vars(event)) if "__dict__" in dir(event) else {}
        known = {f.name for f in dataclasses.fields(TokenEvent)}
        try:
            event = TokenEvent(**{k: v for k, v in fields.items() if k in known})
        except TypeError:
            event = None
    if event is None or not is_int(event.token_id):
        raise TypeError(
            f"post_completion yielded {given} without an int token_id; expected "
            "TokenEvent (kvdrop_sdk.events)"
        )
    return event
