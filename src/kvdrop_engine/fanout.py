"""The ``n`` event streams of one request (``n`` choices) read as one: ``(index, event)`` pairs
in the order the tokens arrive.

One stream is read in the caller's thread. Several are pumped by one thread each into one queue,
so that the engine sees every choice at once and batches them, whatever ``PostCompletion`` is
behind them; a choice that is done (a stop string ended it) or a reader that goes away closes
its streams, which cancels their requests in the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from kvdrop_sdk.events import TokenEvent

__all__ = ["ChoiceStreams", "close_stream"]

logger = logging.getLogger(__name__)


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


def close_stream(events: Iterator[TokenEvent] | None) -> None:
    """Close a generator so the engine frees the request's blocks (no-op for other iterators)."""
    if isinstance(events, _Closable):
        try:
            events.close()
        except Exception:
            logger.exception("closing the engine's event stream failed")


_END = object()


class ChoiceStreams:
    """``(index, event)`` pairs of ``streams`` (one per choice); an engine's error is raised
    where it arrives. :meth:`done` closes one choice's stream, :meth:`close` every stream."""

    def __init__(self, streams: list[Iterator[TokenEvent]]) -> None:
        self._streams = streams
        self._done = [threading.Event() for _ in streams]
        self._queue: queue.Queue[tuple[int, object]] = queue.Queue()
        self._open = len(streams)
        if len(streams) > 1:
            for i in range(len(streams)):
                name = f"kvdrop-choice-{i}"
                threading.Thread(target=self._pump, args=(i,), name=name, daemon=True).start()

    def _pump(self, index: int) -> None:
        stream = self._streams[index]
        try:
            for event in stream:
                self._queue.put((index, event))
                if self._done[index].is_set():
                    break
        except BaseException as exc:
            self._queue.put((index, exc))
        finally:
            close_stream(stream)
            self._queue.put((index, _END))

    def __iter__(self) -> Iterator[tuple[int, TokenEvent]]:
        if len(self._streams) == 1:
            for event in self._streams[0]:
                yield 0, event
            return
        while self._open:
            index, item = self._queue.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            elif not self._done[index].is_set():
                assert isinstance(item, TokenEvent)
                yield index, item

    def done(self, index: int) -> None:
        """Choice ``index`` needs no more tokens."""
        self._done[index].set()

    def close(self) -> None:
        """Stop every stream (the reader went away, or every choice is done)."""
        for flag in self._done:
            flag.set()
        if len(self._streams) == 1:
            close_stream(self._streams[0])
