"""Error types raised by the SDK (upstream's ``LMCache*`` names for them: ``kvdrop_sdk.compat``)."""

from __future__ import annotations

__all__ = ["BatchedStreamError", "CacheKindError", "RequestStreamError", "SDKError"]


class SDKError(RuntimeError):
    """A context, transport or server operation failed; the message says what and how to fix it."""


class RequestStreamError(SDKError):
    """A request stream was used out of order or its engine call failed."""


class BatchedStreamError(SDKError):
    """One or more streams of a batch failed (the message lists each), or an id is unknown."""


class CacheKindError(SDKError, ValueError):
    """An unknown cache kind (a ``ValueError`` too, as upstream's ``connect`` raises)."""
