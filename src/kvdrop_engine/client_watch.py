"""Noticing that an HTTP client went away, so its request is cancelled at once.

A request's engine streams are closed the moment its client closes the connection (during a
prefix load or prefill too, with or without bytes to write): :class:`ClientWatch` checks every
``GONE_CHECK_S`` with :func:`client_gone`, which peeks at the socket without blocking or
consuming data. :data:`DISCONNECTS` are the errors a vanished client raises on a read or write.
Only standard-library networking.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Iterator

from kvdrop_engine.fanout import close_stream
from kvdrop_sdk.events import TokenEvent

__all__ = ["DISCONNECTS", "GONE_CHECK_S", "ClientWatch", "client_gone", "close_all"]

#: Seconds between checks that a request's client is still connected.
GONE_CHECK_S = 0.02
#: What reading from or writing to a client that went away (or stalled) raises.
DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


def client_gone(connection: socket.socket) -> bool:
    """Whether the client closed its side (checked without blocking or consuming data)."""
    try:
        ready, _, _ = select.select([connection], [], [], 0)
        if not ready:
            return False
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class ClientWatch:
    """A thread that checks every ``GONE_CHECK_S`` whether a request's client is gone and then
    calls ``on_gone`` once (it closes the engine's streams: the request is cancelled at once)."""

    def __init__(self, gone: Callable[[], bool], on_gone: Callable[[], None]) -> None:
        self.gone = False
        self._stop = threading.Event()
        self._gone_check, self._on_gone = gone, on_gone
        threading.Thread(target=self._run, name="kvdrop-client-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(GONE_CHECK_S):
            if self._gone_check():
                self.gone = True
                self._on_gone()
                return

    def stop(self) -> None:
        """End the watch (the request finished); ``on_gone`` is not called after it."""
        self._stop.set()


def close_all(streams: list[Iterator[TokenEvent]]) -> None:
    """Close every engine stream of a request (cancelling what is still running)."""
    for stream in streams:
        close_stream(stream)
