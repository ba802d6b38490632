"""The disconnect watcher on real sockets: a closed client is noticed, an open one is not."""

from __future__ import annotations

import socket
import threading

from kvdrop_engine.client_watch import ClientWatch, client_gone


def test_client_gone_only_once_the_peer_closed() -> None:
    server, client = socket.socketpair()
    with server:
        client.sendall(b"unread")  # pending bytes are peeked, never consumed
        assert not client_gone(server)
        client.close()
        assert server.recv(16) == b"unread"
        assert client_gone(server)


def test_client_gone_on_a_closed_socket() -> None:
    server, client = socket.socketpair()
    client.close()
    server.close()
    assert client_gone(server)


def test_watch_calls_on_gone_once_when_the_client_leaves() -> None:
    server, client = socket.socketpair()
    fired = threading.Event()
    calls: list[int] = []

    def on_gone() -> None:
        calls.append(1)
        fired.set()

    with server:
        watch = ClientWatch(lambda: client_gone(server), on_gone)
        assert not watch.gone
        client.close()
        assert fired.wait(10.0)
        watch.stop()
        assert watch.gone and calls == [1]
