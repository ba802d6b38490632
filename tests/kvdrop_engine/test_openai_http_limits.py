"""What one client may cost the engine's OpenAI server (issue 28 A, E, F, G), against the real
server on 127.0.0.1: bodies refused before they are read or parsed, one deadline for a whole
request, a bound on open connections, escaped log fields, and logprobs offsets under hold-back."""

from __future__ import annotations

import logging
import socket
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import requests

from kvdrop_engine.completions import parse_completion_request
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.responses import CompletionBuilder
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.http_limits import HTTPLimits

pytestmark = pytest.mark.timeout(120)


def _one(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
    yield TokenEvent(1, "a", "length")


def _recv_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _raw(srv: CompletionHTTPServer, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        sock.sendall(data)
        return _recv_all(sock)


def test_a_body_over_max_request_bytes_is_413_before_it_is_sent() -> None:
    limits = HTTPLimits(max_body_bytes=1000)
    with CompletionHTTPServer(_one, model_name="m", port=0, limits=limits) as srv:
        # Only the head goes out: the answer must not wait for a body.
        reply = _raw(srv, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2000\r\n\r\n")
        assert b" 413 " in reply.split(b"\r\n", 1)[0] and b"over the limit of 1000" in reply
        ok = requests.post(srv.url + "/v1/completions", json={"prompt": [1]}, timeout=30)
        assert ok.status_code == 200


def test_a_body_of_many_containers_is_refused_before_it_is_parsed() -> None:
    body = b"[" + b"{}," * ((4 << 20) // 3) + b"{}]"  # 4 MB: under the 8 MiB bound
    with CompletionHTTPServer(_one, model_name="m", port=0) as srv:
        tracemalloc.start()
        try:
            r = requests.post(
                srv.url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert r.status_code == 413 and "objects and arrays" in r.json()["error"]["message"]
        # json.loads would have built ~1.4M dicts (hundreds of MB); the body and its scans stay
        # within a few copies of 4 MB (the client's copy included).
        assert peak < 80 << 20, f"peak {peak / 2**20:.0f} MiB"


def test_a_trickled_request_is_closed_at_its_deadline() -> None:
    with CompletionHTTPServer(_one, model_name="m", port=0, read_timeout=1.5) as srv:
        with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n"
            started = time.monotonic()
            closed_after = None
            for byte in head + b"x" * 100:  # one byte every 0.25 s: each read is quick
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed_after = time.monotonic() - started
                    break
                sock.settimeout(0.25)
                try:
                    if sock.recv(65536) is not None:
                        closed_after = time.monotonic() - started
                        break
                except TimeoutError:
                    pass
            assert closed_after is not None and closed_after < 6, closed_after


def test_open_connections_are_bounded() -> None:
    limits = HTTPLimits(max_connections=2)
    with CompletionHTTPServer(_one, model_name="m", port=0, limits=limits) as srv:
        held = [socket.create_connection((srv.host, srv.port), timeout=30) for _ in range(2)]
        try:
            for sock in held:  # each holds a thread: half a request head
                sock.sendall(b"GET /health HTTP/1.1\r\n")
            _wait_until(lambda: srv._httpd.open_connections == 2)
            reply = _raw(srv, b"GET /health HTTP/1.1\r\n\r\n")
            assert b" 503 " in reply and b"too many open connections" in reply
        finally:
            for sock in held:
                sock.close()
        _wait_until(lambda: srv._httpd.open_connections == 0)
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200


def _wait_until(done: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_control_characters_and_long_paths_are_escaped_and_capped_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvdrop_engine.http")
    with CompletionHTTPServer(_one, model_name="m", port=0) as srv:
        assert b" 404 " in _raw(srv, b"GET /\x1b[2J\x07\x08x HTTP/1.1\r\nConnection: close\r\n\r\n")
        long_path = b"/" + b"p" * 60_000
        _raw(srv, b"GET " + long_path + b" HTTP/1.1\r\nConnection: close\r\n\r\n")
        _wait_until(lambda: len([r for r in caplog.records if '" 404 ' in r.getMessage()]) >= 2)
    lines = [r.getMessage() for r in caplog.records if '" 404 ' in r.getMessage()]
    assert not any(c in line for line in lines for c in "\x1b\x07\x08")
    assert "\\x1b[2J\\x07\\x08x" in lines[0]
    assert max(len(line) for line in lines) < 1000


class _Chars:
    """A tokenizer of one character per token (for stop strings)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_text_offset_is_right_under_stop_string_hold_back() -> None:
    req = parse_completion_request(
        {"prompt": [1], "max_tokens": 6, "stop": ["zz"], "logprobs": 0},
        model_name="m",
        tokenizer=_Chars(),
    )
    build = CompletionBuilder(req, "m", tokenizer=_Chars(), detokenize=False)
    for i, c in enumerate("abcdef"):
        build.add(TokenEvent(ord(c), c, "length" if i == 5 else None, logprob=-1.0))
    body = build.body()["choices"][0]
    assert body["text"] == "abcdef"
    assert body["logprobs"]["text_offset"] == [0, 1, 2, 3, 4, 5]
