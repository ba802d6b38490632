"""The shared HTTP limits (issue 28 A, E, G) on a real socket: body size before reading, JSON cost
before parsing, a whole-request deadline, a bound on open connections, safe log fields."""

from __future__ import annotations

import gc
import json
import logging
import select
import socket
import threading
import time
import tracemalloc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdrop_sdk.http_limits import (
    HTTPLimitError,
    HTTPLimits,
    LimitedHandler,
    LimitedHTTPServer,
    dumps_sliced,
    freeze_heap,
    json_cost,
    loads_bounded,
    log_field,
)
from kvdrop_sdk.testing.server import wait_until

pytestmark = pytest.mark.timeout(120)


class _Echo(LimitedHandler):
    """POST: the parsed JSON's type and size back; GET: ok."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        try:
            body = self.read_json()
        except HTTPLimitError as exc:
            self.send_limit_error(exc.status, str(exc))
            return
        self._send(200, {"type": type(body).__name__, "len": len(body)})

    def do_GET(self) -> None:
        nodelay = self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        self._send(200, {"ok": True, "nodelay": bool(nodelay)})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def serve() -> Iterator[Any]:
    """Start an echo server with the given limits; stopped at teardown."""
    started: list[tuple[LimitedHTTPServer, threading.Thread]] = []

    def start(**limits: Any) -> LimitedHTTPServer:
        httpd = LimitedHTTPServer(("127.0.0.1", 0), _Echo, HTTPLimits(**limits))
        thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        started.append((httpd, thread))
        return httpd

    yield start
    for httpd, thread in started:
        httpd.shutdown()
        thread.join(10)
        httpd.server_close()


def _connect(httpd: LimitedHTTPServer) -> socket.socket:
    return socket.create_connection(httpd.server_address[:2], timeout=30)


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and everything the server sent until it closed or sent a whole JSON body."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
        if length and len(body) >= int(length[0].split(b":")[1]):
            break
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def _post(body_len: int, extra: str = "") -> bytes:
    return (
        f"POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {body_len}\r\n{extra}\r\n"
    ).encode()


# -- A: bodies and JSON cost -----------------------------------------------------------------------
def test_oversized_body_is_413_before_it_is_read(serve: Any) -> None:
    httpd = serve(max_body_bytes=1000)
    with _connect(httpd) as sock:
        sock.sendall(_post(10**9))  # no body follows: the answer must not wait for one
        status, body = _response(sock)
    assert status == 413
    assert "over the limit of 1000" in json.loads(body)["error"]
    with _connect(httpd) as sock:
        sock.sendall(_post(10**9, "Expect: 100-continue\r\n"))
        status, _ = _response(sock)
    assert status == 413  # refused instead of "100 Continue"


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Content-Length: -1", 400),
        ("Content-Length: 1e3", 400),
        ("Content-Length: " + "9" * 5000, 413),
        ("Transfer-Encoding: chunked", 411),
    ],
)
def test_bad_body_headers_are_refused(serve: Any, header: str, status: int) -> None:
    httpd = serve()
    with _connect(httpd) as sock:
        sock.sendall(f"POST /x HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n".encode())
        assert _response(sock)[0] == status


def test_wide_json_body_is_refused_before_it_is_built(serve: Any) -> None:
    """A 32 MB ``[{},{},...]`` is about 10.7M dicts (~800 MB) if parsed; refused from counts."""
    httpd = serve()
    body = b"[" + b"{}," * (32 * 1024 * 1024 // 3 - 1) + b"{}]"
    tracemalloc.start()
    try:
        with _connect(httpd) as sock:
            sock.sendall(_post(len(body)) + body)
            status, reply = _response(sock)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert status == 413, reply
    assert "objects and arrays, over the limit of 65536" in json.loads(reply)["error"]
    # The body itself (32 MiB, read once) plus the counting; parsing would be hundreds of MB.
    assert peak < 120 * 1024 * 1024, f"{peak / 2**20:.0f} MiB traced while refusing"


def test_json_limits_name_what_was_over() -> None:
    limits = HTTPLimits(max_json_depth=4, max_json_containers=10, max_json_values=20)
    assert loads_bounded(b'{"a": [[[1]]], "s": "[[[[[[[[,,,,,"}', limits) == {
        "a": [[[1]]],
        "s": "[[[[[[[[,,,,,",
    }
    with pytest.raises(HTTPLimitError, match="nested over 4 levels") as exc:
        loads_bounded(b"[[[[[1]]]]]", limits)
    assert exc.value.status == 400
    with pytest.raises(HTTPLimitError, match="about 21 values, over the limit of 20"):
        loads_bounded(b"[" + b"1," * 20 + b"1]", limits)
    with pytest.raises(HTTPLimitError, match="12 objects and arrays"):
        loads_bounded(b"[" + b"[]," * 10 + b"[]]", limits)
    for bad in (b"[1,", b"\xff", b"1" * 5000, b"[}"):
        with pytest.raises(HTTPLimitError, match="not valid JSON") as exc:
            loads_bounded(bad, limits)
        assert exc.value.status == 400


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{},:"\\ab\x1b'),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=30,
)


def _real_cost(value: Any, level: int = 1) -> tuple[int, int, int]:
    if isinstance(value, (list, dict)):
        items = list(value.values()) if isinstance(value, dict) else value
        parts = [_real_cost(v, level + 1) for v in items]
        return (
            1 + sum(p[0] for p in parts),
            len(items) + sum(p[1] for p in parts),
            max([level, *(p[2] for p in parts)]),
        )
    return 0, 0, 0


@settings(derandomize=True, max_examples=300, deadline=None)
@given(_JSON)
def test_json_cost_counts_what_json_loads_builds(value: Any) -> None:
    raw = json.dumps(value).encode()
    containers, values, depth = json_cost(raw, HTTPLimits())
    real_containers, real_values, real_depth = _real_cost(value)
    assert (containers, depth) == (real_containers, real_depth)
    assert real_values <= values <= real_values + real_containers


# -- E: whole-request deadline and open connections ------------------------------------------------
def _trickle_until_closed(port: int, gap_s: float, give_up_s: float) -> float:
    """Send a never-ending header a byte every ``gap_s``; seconds until the server closed."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        while time.monotonic() - started < give_up_s:
            readable, _, _ = select.select([sock], [], [], gap_s)
            if readable:
                try:
                    if sock.recv(65536) == b"":
                        return time.monotonic() - started
                except ConnectionResetError:
                    return time.monotonic() - started
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
    return float("inf")


def test_a_trickled_request_is_closed_at_its_deadline(serve: Any) -> None:
    httpd = serve(request_timeout_s=1.0, idle_timeout_s=1.0)
    closed_after = _trickle_until_closed(httpd.server_address[1], gap_s=0.25, give_up_s=30)
    assert 0.9 <= closed_after < 15, closed_after  # per-read timeouts never fire here
    assert wait_until(lambda: httpd.open_connections == 0, 10)
    with _connect(httpd) as sock:  # and the server still serves
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(sock)[0] == 200


def test_a_trickled_body_is_408(serve: Any) -> None:
    httpd = serve(request_timeout_s=1.0, idle_timeout_s=5.0)
    with _connect(httpd) as sock:
        sock.sendall(_post(1000))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if select.select([sock], [], [], 0.25)[0]:
                break
            sock.sendall(b" ")
        status, reply = _response(sock)
    assert status == 408
    assert "did not arrive within 1 s" in json.loads(reply)["error"]


def test_open_connections_are_bounded(serve: Any) -> None:
    httpd = serve(max_connections=3, idle_timeout_s=30)
    idle = [_connect(httpd) for _ in range(3)]
    try:
        assert wait_until(lambda: httpd.open_connections == 3, 10)
        with _connect(httpd) as extra:
            extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            status, reply = _response(extra)
        assert status == 503
        assert "too many open connections (limit 3)" in json.loads(reply)["error"]
        assert httpd.refused_connections == 1
        idle.pop().close()
        assert wait_until(lambda: httpd.open_connections == 2, 10)
        with _connect(httpd) as again:
            again.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _response(again)[0] == 200
    finally:
        for sock in idle:
            sock.close()


def test_connections_send_without_nagles_delay(serve: Any) -> None:
    """A response's headers and body are two writes: with Nagle's algorithm on, the body
    waited for the client's delayed ACK of the headers (about 40 ms a response on Linux)."""
    httpd = serve()
    with _connect(httpd) as sock:
        for _ in range(2):  # and again on the kept-alive connection
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            status, reply = _response(sock)
            assert status == 200
            assert json.loads(reply) == {"ok": True, "nodelay": True}


def test_freeze_heap_collects_garbage_then_freezes_what_is_alive() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cyclic collector frees it

    alive, garbage = Node(), Node()
    gone = weakref.ref(garbage)
    del garbage
    gc.disable()  # no collection but freeze_heap's own
    try:
        frozen = freeze_heap()
        assert gone() is None  # collected first, not frozen for ever
        # frozen objects freed since (by another thread, say) leave the permanent generation
        assert frozen >= gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # collections skip it now
    finally:
        gc.unfreeze()
        gc.enable()
    assert any(o is alive for o in gc.get_objects())


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=7) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.integers(1, 4), st.integers(0, 5))
def test_dumps_sliced_is_json_dumps(value: Any, items: int, depth: int) -> None:
    assert dumps_sliced(value, items, depth) == json.dumps(value)


def test_dumps_sliced_encodes_a_long_list_in_bounded_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """No single ``json.dumps`` (which holds the GIL throughout) gets more than ``items`` list
    items, however deep the long list is within ``depth``."""
    scores = [{"17": {"logprob": -0.5 * i, "rank": 1}} for i in range(3000)]
    answer = {"choices": [{"index": 0, "prompt_logprobs": [None, *scores]}], "id": "x"}
    expected = json.dumps(answer)
    sizes: list[int] = []
    dumps = json.dumps

    def counted(value: Any, **kwargs: Any) -> str:
        sizes.append(len(value) if isinstance(value, list) else 0)
        return dumps(value, **kwargs)

    monkeypatch.setattr(json, "dumps", counted)
    assert dumps_sliced(answer, items=256) == expected
    assert max(sizes) == 256
    assert sum(sizes) == 3001


# -- G: log fields ---------------------------------------------------------------------------------
def test_log_field_escapes_controls_and_caps() -> None:
    assert (
        log_field("a\x1b[2Jb\x07c\x08d\n\r\x7f\x9b") == "a\\x1b[2Jb\\x07c\\x08d\\x0a\\x0d\\x7f\\x9b"
    )
    long = log_field("x" * 60_000, 100)
    assert long == "x" * 100 + "...(+59900 chars)"
    assert log_field("é ok") == "é ok"


def test_access_log_lines_are_escaped_and_capped(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    httpd = serve(max_log_chars=200)
    caplog.set_level(logging.DEBUG, logger="kvdrop_sdk.http")
    path = "/\x1b[31mforged\x07\x08" + "p" * 60_000
    with _connect(httpd) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode("latin-1"))
        assert _response(sock)[0] == 200
    assert wait_until(lambda: any("forged" in r.getMessage() for r in caplog.records), 10)
    for record in caplog.records:
        line = record.getMessage()
        assert not any(c in line for c in "\x1b\x07\x08"), repr(line)
        assert len(line) < 1000
    assert any("\\x1b[31mforged\\x07\\x08" in r.getMessage() for r in caplog.records)
