"""What a request captures while it runs: one decision, made once at submission.

Two readers want a request's query rows: the prompt cut after prefill (its policy's
:class:`~kvdrop_sdk.query_capture.Needs`, sized by ``--query-window`` / ``--query-stride``
through :meth:`QueryCapture.for_policies`) and the connector's window store (the
:class:`QueryCapture` it was built with, where it stores windows). :func:`window_for` joins
them into the one :class:`~kvdrop_engine.capture.WindowCapture` the request keeps: every row
the cut reads (all prompt rows for a ``FULL`` reader, else the wider of both windows) and the
store's strided sample. After the cut the kept keys sit at new positions, so the window
restarts on the kept sequence with the store's sizes (:func:`window_after_cut`): the stored
window then holds the rows computed after the cut.

A third reader, the cut while decoding (:mod:`kvdrop_engine.decode_cut`), reads the last rows
computed since its previous cut: its ``decode`` capture widens the window the same way, and the
window restarts after each of its cuts (``window_after_cut(k, None, decode)``; such a request
stores no window).
"""

from __future__ import annotations

from kvdrop_engine.capture import WindowCapture
from kvdrop_sdk.query_capture import QueryCapture

__all__ = ["store_capture", "window_after_cut", "window_for"]


def store_capture(
    capture: QueryCapture, stores_windows: bool, transfer_query: bool
) -> QueryCapture | None:
    """The window a bound connector stores per request (None: it stores none). Only a connector
    that stores windows and talks queries with its server keeps one; the others (an LMCache
    server's) take every prompt query in chunks, the upstream layout."""
    if stores_windows and transfer_query and capture.enabled:
        return capture
    return None


def window_for(
    num_prompt: int,
    cut: QueryCapture | None,
    store: QueryCapture | None,
    decode: QueryCapture | None = None,
) -> WindowCapture | None:
    """The one window a request of ``num_prompt`` tokens keeps for its ``cut``'s policy, the
    connector's window ``store`` and its ``decode`` cut's policy (each None: not wanted); None
    when none reads a row."""
    reads = cut is not None and cut.enabled
    decode = decode if decode is not None and decode.enabled else None
    if not reads and store is None and decode is None:
        return None
    if reads and cut is not None and cut.full:
        return WindowCapture(num_prompt, num_prompt, 0)  # every prompt row
    sizes = [c for c in (cut if reads else None, store, decode) if c is not None]
    window = max(c.window for c in sizes)
    stride = (store if store is not None else sizes[0]).stride
    return WindowCapture(num_prompt, window, stride)


def window_after_cut(
    num_kept: int, store: QueryCapture | None, decode: QueryCapture | None = None
) -> WindowCapture | None:
    """The window a request keeps once its cache was cut to ``num_kept`` tokens: the store's
    and its decode cut's, over the kept sequence (the rows captured before sit at positions the
    cache no longer has)."""
    return window_for(num_kept, None, store, decode)
