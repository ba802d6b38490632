"""What one HTTP client may cost a stdlib (``http.server``) server: the one owner of those limits.

Both HTTP servers of the project (the cache server's ``/config`` endpoint and the engine's
OpenAI server) build on :class:`LimitedHTTPServer` and :class:`LimitedHandler`, so every rule
below lives here once:

- **Body size.** A ``Content-Length`` over ``max_body_bytes`` is answered 413 (and a chunked body
  411) right after the headers, before a byte of the body is read.
- **JSON cost.** :func:`loads_bounded` counts containers, values and nesting depth with a cheap
  pre-scan (string contents removed, then byte counts: C speed, no Python objects) and refuses a
  body over the limits *before* ``json.loads`` builds it: a 32 MB ``[{},{},...]`` would otherwise
  become about 800 MB of dicts.
- **Whole-request deadline.** Once the first byte of a request arrives, its request line, headers
  and body must all arrive within ``request_timeout_s``; socket timeouts alone are per read, so a
  client trickling a byte every 0.5 s would hold its thread forever. Idle keep-alive connections
  are closed after ``idle_timeout_s``.
- **Open connections.** At most ``max_connections`` are served at once (one thread each); more
  are answered 503 and closed without a thread.
- **Log fields.** :func:`log_field` escapes control characters (ESC, BEL, backspace, ...) and caps
  length, so a path cannot forge or flood log lines; the handler's access log uses it.
- **No stalls.** Connections send without Nagle's delay (``TCP_NODELAY``); :func:`dumps_sliced`
  encodes a large answer in bounded calls and :func:`freeze_heap` keeps collections off the
  start-up heap, so one client's answer does not hold the GIL for tens of milliseconds.

Only the standard library; nothing here imports torch or ZMQ.
"""

from __future__ import annotations

import ctypes
import gc
import io
import json
import logging
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from kvdrop_sdk.validate import check_fields, json_surrogate

__all__ = [
    "HTTPLimitError",
    "HTTPLimits",
    "LimitedHTTPServer",
    "LimitedHandler",
    "capped_warnings",
    "json_cost",
    "loads_bounded",
    "log_field",
]

log = logging.getLogger("kvdrop_sdk.http")

#: A JSON string literal, escapes included (unrolled so that ``re`` stays linear).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: Every byte but the four brackets, for ``bytes.translate(None, delete=...)``.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
#: Objects and arrays nest the same way; one bracket kind makes the depth count simple.
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
#: C0 controls, DEL and C1 controls, each written as ``\xNN`` in logs.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


class HTTPLimitError(ValueError):
    """A request broke one of :class:`HTTPLimits`; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HTTPLimits:
    """Bounds on one HTTP request and on the server's open connections."""

    #: Largest request body (``Content-Length``); larger is 413 before reading.
    max_body_bytes: int = 32 << 20
    #: Deepest JSON nesting (objects and arrays together).
    max_json_depth: int = 64
    #: Most JSON objects and arrays in one body (each costs about 60-250 bytes of heap).
    max_json_containers: int = 1 << 16
    #: Most JSON values in all arrays and objects together (each costs about 30-60 bytes).
    max_json_values: int = 1 << 20
    #: Seconds from a request's first byte until its headers and body must have arrived.
    request_timeout_s: float = 30.0
    #: Seconds an idle connection (between requests) or a stalled write is kept.
    idle_timeout_s: float = 30.0
    #: Connections served at once; more are answered 503 and closed.
    max_connections: int = 256
    #: Characters of one field in a log line (path, method, ...); longer ones are cut.
    max_log_chars: int = 200

    def __post_init__(self) -> None:
        positive = ("max_body_bytes", "max_json_depth", "max_json_containers", "max_json_values")
        check_fields(
            self,
            ints={**dict.fromkeys(positive, 1), "max_connections": 1, "max_log_chars": 16},
            numbers={"request_timeout_s": (0, 86400), "idle_timeout_s": (0, 86400)},
        )


# -- JSON -----------------------------------------------------------------------------------------
def json_cost(raw: bytes, limits: HTTPLimits) -> tuple[int, int, int]:
    """``(containers, values, depth)`` of a JSON text, counted without building it.

    Strings are blanked first, so brackets and commas inside them do not count. ``values`` is an
    upper bound (commas plus containers). The depth is exact up to ``limits.max_json_depth``
    (``max_json_depth + 1`` beyond it) and is only counted (0 otherwise) when the containers are
    within their limit, so the scan never copies more than the body. Malformed text gets numbers
    too; ``json.loads`` then refuses it.
    """
    bare = _STRING.sub(b'""', raw) if b'"' in raw else raw
    containers = bare.count(b"[") + bare.count(b"{")
    values = bare.count(b",") + containers
    depth = 0
    if containers <= limits.max_json_containers:
        brackets = bare.translate(_ONE_KIND, _NOT_BRACKETS)
        while brackets and depth <= limits.max_json_depth:
            inner = brackets.replace(b"[]", b"")
            if len(inner) == len(brackets):
                break  # unbalanced brackets: malformed, left to json.loads
            brackets, depth = inner, depth + 1
    return containers, values, depth


#: Most list items one ``json.dumps`` call of :func:`dumps_sliced` encodes.
SLICE_ITEMS = 256


def dumps_sliced(value: Any, items: int = SLICE_ITEMS, depth: int = 4) -> str:
    """``json.dumps(value)``, the same text, built from calls that each encode at most ``items``
    items of a list (dicts and lists are entered ``depth`` levels down). One ``json.dumps`` holds
    the GIL from start to end: a 3,000-token ``prompt_logprobs`` answer held it 16-21 ms while the
    engine's loop waited (benchmarks/engine_probe.py); between calls other threads run."""
    if depth <= 0:
        return json.dumps(value)
    if isinstance(value, dict) and all(type(k) is str for k in value):
        parts = (f"{json.dumps(k)}: {dumps_sliced(v, items, depth - 1)}" for k, v in value.items())
        return "{" + ", ".join(parts) + "}"
    if isinstance(value, (list, tuple)) and len(value) > items:
        slices = (json.dumps(value[i : i + items])[1:-1] for i in range(0, len(value), items))
        return "[" + ", ".join(slices) + "]"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(dumps_sliced(v, items, depth - 1) for v in value) + "]"
    return json.dumps(value)


def loads_bounded(raw: bytes, limits: HTTPLimits) -> Any:
    """Parse a JSON body within ``limits``; ``HTTPLimitError`` (413 for too many containers or
    values, 400 for too deep, not JSON, or text with a lone UTF-16 surrogate) names what was
    over and the limit."""
    containers, values, depth = json_cost(raw, limits)
    if containers > limits.max_json_containers:
        raise HTTPLimitError(
            413,
            f"the JSON body has {containers} objects and arrays, over the limit of "
            f"{limits.max_json_containers}",
        )
    if values > limits.max_json_values:
        raise HTTPLimitError(
            413,
            f"the JSON body has about {values} values, over the limit of {limits.max_json_values}",
        )
    if depth > limits.max_json_depth:
        raise HTTPLimitError(
            400, f"the JSON body is nested over {limits.max_json_depth} levels deep"
        )
    try:
        value = json.loads(raw)
    except RecursionError:
        raise HTTPLimitError(400, "the JSON body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise HTTPLimitError(400, f"the request body is not valid JSON: {exc}") from None
    problem = json_surrogate(raw, value)
    if problem is not None:  # e.g. "\ud800": no store, hash or tokenizer could encode it
        raise HTTPLimitError(400, problem)
    return value


# -- logs -----------------------------------------------------------------------------------------
def log_field(value: object, max_chars: int = 200) -> str:
    """``value`` as one safe log field: cut to ``max_chars`` (saying how much was cut) and with
    control characters written as ``\\xNN``, so it cannot move the cursor or start a new line."""
    text = str(value)
    if len(text) > max_chars:
        text = f"{text[:max_chars]}...(+{len(text) - max_chars} chars)"
    return text.translate(_CONTROL)


#: Characters of a warning's text in a server's log (:func:`capped_warnings`).
MAX_WARNING_CHARS = 1000


@contextmanager
def capped_warnings(logger: logging.Logger, max_chars: int = MAX_WARNING_CHARS) -> Iterator[None]:
    """While inside, every warning shown (a policy's or a plugin's, whatever text a request
    made it carry) is one line on ``logger``: its category, its text as a :func:`log_field` of
    ``max_chars`` and its place, not the raw text on stderr (a compose of 3,000 terms wrote a
    53,632-character line). The previous ``warnings.showwarning`` comes back on exit."""
    previous = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:  # fmt: skip
        logger.warning(
            "%s: %s (%s:%d)",
            category.__name__,
            log_field(message, max_chars),
            log_field(filename),
            lineno,
        )

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


# -- deadline -------------------------------------------------------------------------------------
class _DeadlineReader(io.RawIOBase):
    """A socket reader whose every ``recv`` waits at most until the current request's deadline.

    Between requests (``deadline`` None) a read waits ``idle_s``; the first bytes that arrive
    start the request's clock of ``request_s``. Writes on the socket keep the idle timeout.
    """

    def __init__(self, sock: socket.socket, idle_s: float, request_s: float) -> None:
        super().__init__()
        self._sock = sock
        self._idle_s = idle_s
        self._request_s = request_s
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        timeout = self._idle_s
        if self.deadline is not None:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError(f"the request did not arrive within {self._request_s:g} s")
        self._sock.settimeout(timeout)
        try:
            n = self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._idle_s)
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self._request_s
        return n


# -- server and handler ---------------------------------------------------------------------------
class LimitedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``limits.max_connections`` connections at once
    (more get a 503 and are closed without a thread) and logs a client that left in one line."""

    daemon_threads = True
    block_on_close = False
    # Many clients connect at once (a batch of 30 streams); the stdlib's backlog of 5 drops some.
    request_queue_size = 256

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        limits: HTTPLimits | None = None,
    ) -> None:
        self.limits = limits or HTTPLimits()
        self._open = 0
        self.refused_connections = 0
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        """Connections being served now."""
        return self._open

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = self._open >= self.limits.max_connections
            if full:
                self.refused_connections += 1
            else:
                self._open += 1
        if full:
            _refuse_busy(request, self.limits.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._open_lock:
            self._open -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left or stalled is one log line; anything else keeps its traceback."""
        import sys

        exc = sys.exc_info()[1]
        client = ":".join(str(part) for part in client_address[:2])
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.info("http client %s disconnected (%s)", client, type(exc).__name__)
        else:
            log.exception("http request from %s failed", client)


def _refuse_busy(request: socket.socket, limit: int) -> None:
    """Answer 503 without blocking (a client that does not read just misses it)."""
    body = f'{{"error": "too many open connections (limit {limit}); retry later"}}'.encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
    )
    try:
        request.setblocking(False)
        request.send(head.encode() + body)
    except OSError:
        pass


class LimitedHandler(BaseHTTPRequestHandler):
    """A request handler bound by its server's :class:`HTTPLimits`.

    The whole-request deadline covers the request line, headers and :meth:`read_body`; a bad
    ``Content-Length`` or ``Transfer-Encoding`` is refused right after the headers (before any
    body is read). Refusals go through :meth:`limit_error_body`, which a server overrides for its
    own error shape. Access logs go to ``access_log`` with every field passed by :func:`log_field`.
    """

    server: LimitedHTTPServer
    access_log: ClassVar[logging.Logger] = log
    #: TCP_NODELAY on every connection: a response's headers and body are separate writes, and
    #: with Nagle's algorithm the body waited for the client's delayed ACK of the headers (about
    #: 40 ms on Linux: a 1 ms ``GET /health`` took 44 ms on a keep-alive connection).
    disable_nagle_algorithm = True
    #: ``Content-Length`` of the current request (0 without one), set once its headers are read.
    body_length: int = 0

    def setup(self) -> None:
        limits = self.server.limits
        self.timeout = limits.idle_timeout_s
        super().setup()
        self.rfile.close()
        self._reader = _DeadlineReader(
            self.connection, limits.idle_timeout_s, limits.request_timeout_s
        )
        self.rfile = io.BufferedReader(self._reader, 1 << 16)

    def handle_one_request(self) -> None:
        self._reader.deadline = None  # idle until the next request's first byte
        self._limits_checked = False
        super().handle_one_request()

    def parse_request(self) -> bool:
        return super().parse_request() and self._check_body_headers()

    def handle_expect_100(self) -> bool:
        # Refuse an oversized body before inviting the client to send it.
        return self._check_body_headers() and super().handle_expect_100()

    def _check_body_headers(self) -> bool:
        """413/411/400 for a body this server will not read; sets ``body_length``."""
        if self._limits_checked:
            return True
        self._limits_checked = True
        self.body_length = 0
        limit = self.server.limits.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._refuse(
                411, "chunked request bodies are not supported; send Content-Length"
            )
        raw = self.headers.get("Content-Length")
        if raw is not None:
            digits = raw.strip()
            if not digits.isdigit() or not digits.isascii():
                return self._refuse(400, f"bad Content-Length {log_field(raw, 40)!r}")
            # More digits than any limit has is over it (and int() of 5,000 digits raises).
            self.body_length = int(digits) if len(digits) <= 18 else 1 << 62
            if self.body_length > limit:
                return self._refuse(
                    413, f"request body of {self.body_length} bytes is over the limit of {limit}"
                )
        return True

    def _refuse(self, status: int, message: str) -> bool:
        self.close_connection = True
        self.send_limit_error(status, message)
        return False

    def send_limit_error(self, status: int, message: str) -> None:
        """Answer ``status`` with :meth:`limit_error_body` as JSON and close the connection."""
        data = json.dumps(self.limit_error_body(status, message)).encode()
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def limit_error_body(self, status: int, message: str) -> dict[str, Any]:
        """The JSON body of a refusal (override for another error shape)."""
        return {"error": message, "status": status}

    def read_body(self, *, required: bool = False) -> bytes:
        """The request's body, within the request deadline. ``HTTPLimitError``: 411 if
        ``required`` and there is no ``Content-Length``, 408 if it did not arrive in time;
        ``ConnectionResetError`` if the client closed the connection before sending it all."""
        if required and self.headers.get("Content-Length") is None:
            raise HTTPLimitError(411, "a JSON body with a Content-Length header is required")
        try:
            raw = self.rfile.read(self.body_length)
        except TimeoutError:
            self.close_connection = True
            raise HTTPLimitError(
                408,
                f"the request did not arrive within {self.server.limits.request_timeout_s:g} s",
            ) from None
        if len(raw) < self.body_length:
            raise ConnectionResetError("the client closed the connection before its body")
        self._reader.deadline = None  # read in full: writing the answer is not on the clock
        return raw

    def read_json(self) -> Any:
        """:meth:`read_body` (required) parsed by :func:`loads_bounded`."""
        return loads_bounded(self.read_body(required=True), self.server.limits)

    def log_message(self, format: str, *args: Any) -> None:
        cap = self.server.limits.max_log_chars
        safe = tuple(log_field(a, cap) if isinstance(a, str) else a for a in args)
        self.access_log.debug("%s " + format, log_field(self.address_string(), cap), *safe)


#: glibc's ``mallopt`` parameter for the number of heap arenas.
_M_ARENA_MAX = -8


def freeze_heap() -> int:
    """Collect, then move every object alive now (imported modules, the model, torch's
    registries: about 300,000 objects in ``kvdrop engine --random-preset tiny``) into the
    permanent generation, which the cyclic garbage collector skips (``gc.freeze``; vLLM's
    ``freeze_gc_heap`` does the same after start-up). A full collection while serving then walks
    only what requests made: before, one walked the start-up heap too, 145 ms with the GIL held,
    and every stream stood still meanwhile (benchmarks/soak_round4.py). Call once, after start-up
    and before traffic; returns how many objects are frozen. Objects made later are collected
    as before."""
    gc.collect()  # garbage frozen now would never be freed
    gc.freeze()
    return gc.get_freeze_count()


def bound_heap(arenas: int = 2) -> bool:
    """Keep a threaded server's heap to ``arenas`` glibc arenas: each request thread otherwise
    gets an arena of its own, and a large body freed there stays with it (glibc raises its mmap
    threshold after the first large free), so a stream of big requests grew the engine by
    hundreds of MB (benchmarks/soak_round3_engine.py). Returns whether it was applied (False off
    glibc); ``KVDROP_BOUND_HEAP=0`` skips it."""
    if os.environ.get("KVDROP_BOUND_HEAP", "1") == "0":
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, int(arenas)))
    except (OSError, AttributeError):
        return False
