"""Round 3 (issue 28): what one client can cost the others -- HTTP limits, leases, windows,
quarantine and what a policy's output or a client's scores may contain.

Every test talks to a real server (subprocess or in-process ``Server``) on 127.0.0.1 or to the
real ``ChunkStore``/``WindowStore``; each failed on the code before the fix.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvdrop_sdk.server.app import Server
from kvdrop_sdk.server.config import ServerConfig
from kvdrop_sdk.testing.server import spawn_server

pytestmark = pytest.mark.timeout(120)


def wait_until(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def http_exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` raw; the status and body of the answer (read until the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


@pytest.fixture
def in_process() -> Iterator[Server]:
    server = Server(
        ServerConfig(
            port=0,
            http_port=0,
            l1_size_gb=0.01,
            http_timeout_s=1.0,
            http_max_connections=3,
            max_request_bytes=1000,
        )
    ).start()
    try:
        yield server
    finally:
        server.stop()


# -- A/E/G: the cache server's HTTP endpoint -------------------------------------------------------
def test_cache_server_refuses_a_large_body_with_413_before_reading_it() -> None:
    with spawn_server(shm_name=None, l1_size_gb=0.01, max_request_bytes=1000) as srv:
        status, body = http_exchange(
            srv.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
        )
        assert status == 413
        assert "over the limit of 1000" in json.loads(body)["error"]
        assert srv.status()["requests"] >= 0  # still up
        config = json.loads(http_exchange(srv.http_port, b"GET /config HTTP/1.0\r\n\r\n")[1])
        assert config["max_request_bytes"] == 1000


def test_cache_server_closes_a_trickled_request_at_its_deadline(in_process: Server) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", in_process.http_port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        closed = None
        while closed is None and time.monotonic() - started < 30:
            if select.select([sock], [], [], 0.25)[0]:
                try:
                    if sock.recv(65536) == b"":
                        closed = time.monotonic() - started
                except ConnectionResetError:
                    closed = time.monotonic() - started
            else:
                try:
                    sock.sendall(b"a")  # a byte every 0.25 s: each read finishes in time
                except (BrokenPipeError, ConnectionResetError):
                    closed = time.monotonic() - started
    assert closed is not None and closed < 15, closed  # deadline 1 s (http_timeout_s)


def test_cache_server_bounds_open_connections(in_process: Server) -> None:
    port = in_process.http_port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
    try:
        httpd = in_process._http
        assert httpd is not None
        assert wait_until(lambda: httpd.open_connections == 3, 10)
        status, body = http_exchange(port, b"GET /health HTTP/1.0\r\n\r\n")
        assert status == 503
        assert "too many open connections (limit 3)" in json.loads(body)["error"]
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: http_exchange(port, b"GET /health HTTP/1.0\r\n\r\n")[0] == 200, 10)


def test_cache_server_log_fields_are_escaped_and_capped(
    in_process: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvdrop_sdk.server")
    path = "/\x1b[2J\x1b[31mforged\x07\x08" + "p" * 60_000
    status, body = http_exchange(
        in_process.http_port, f"GET {path} HTTP/1.0\r\n\r\n".encode("latin-1")
    )
    assert status == 404
    assert len(body) < 2000  # the 404 names the path, capped
    assert wait_until(lambda: any("forged" in r.getMessage() for r in caplog.records), 10)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvdrop_sdk.server"]
    for line in lines:
        assert not any(c in line for c in "\x1b\x07\x08"), repr(line[:200])
        assert len(line) < 1000, len(line)
