"""Error types raised by the SDK (upstream's ``LMCache*`` names for them: ``kvdrop_sdk.compat``)."""

from __future__ import annotations

__all__ = [
    "BatchedStreamError",
    "CacheKindError",
    "EditTimeoutError",
    "PartialStoreError",
    "RequestStreamError",
    "SDKError",
    "ServerRestartedError",
    "ServerUnavailableError",
]


class SDKError(RuntimeError):
    """A context, transport or server operation failed; the message says what and how to fix it."""


class RequestStreamError(SDKError):
    """A request stream was used out of order or its engine call failed."""


class EditTimeoutError(RequestStreamError, TimeoutError):
    """An edit function did not return within the modify timeout; the stream is unchanged."""


class BatchedStreamError(SDKError):
    """One or more streams of a batch failed (the message lists each), or an id is unknown."""


class PartialStoreError(SDKError):
    """A store kept only some chunks (the server's pool was full of chunks it may not evict).

    ``stored`` chunks are in the server (a prefix of the request), ``dropped`` are not,
    ``duplicates`` were cached already. ``store()`` still returns False when every chunk was
    cached already; it raises this instead of returning True when chunks were dropped.
    """

    def __init__(
        self, stored: int, dropped: int, duplicates: int = 0, reason: str | None = None
    ) -> None:
        self.stored = stored
        self.dropped = dropped
        self.duplicates = duplicates
        total = stored + dropped + duplicates
        cached = f" ({duplicates} were cached already)" if duplicates else ""
        # The server says what holds its pool (pinned, being written, quarantined).
        why = reason or "the server pool is full of pinned or reserved chunks"
        super().__init__(
            f"stored {stored} of {total} chunk(s){cached}: {why}, and the last {dropped} were "
            "dropped; retry later or start the server with a larger --l1-size-gb"
        )


class ServerRestartedError(SDKError):
    """The server answering is not the one this context mapped (it restarted); nothing was read
    or written through the old mapping. Contexts re-synchronise and retry once on their own."""


class CacheKindError(SDKError, ValueError):
    """An unknown cache kind (a ``ValueError`` too, as upstream's ``connect`` raises)."""


class ServerUnavailableError(SDKError):
    """No reply from the server within the timeout, or the connection failed: the server may be
    down or hung. The one SDK error that says so; any other error means the server answered (an
    engine backs off from the server only for this one, never for a refused request)."""
