"""Wire protocol between SDK contexts and the kvdrop server (ZMQ DEALER -> ROUTER).

A request is a multipart message ``[header, *payload]``: ``header`` is a small UTF-8 JSON object
``{"v": 1, "op": ..., "rid": ..., "client": ..., ...}``; payload frames are raw bytes (token ids as
little-endian int64, tensors as their contiguous bytes). A reply is ``[header, *payload]`` with
``"ok": true`` or ``"ok": false, "code": ..., "error": ...``, the request's ``rid`` and the server's
``instance`` (random per server start: a client tells a restarted server from the one it mapped).
``client`` is a random token per ``RpcClient``: the server binds leases to it. ``zmq.REQ`` peers
work too (the server echoes their empty delimiter frame). Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvdrop_sdk.errors import SDKError, ServerUnavailableError
from kvdrop_sdk.validate import check_text, is_int, json_surrogate

__all__ = [
    "EDIT_SCOPE",
    "MAX_HEADER_BYTES",
    "MAX_SALT_CHARS",
    "PROTOCOL_VERSION",
    "SOCKET_BUFFER_BYTES",
    "ProtocolError",
    "RpcClient",
    "RpcError",
    "check_salt",
    "decode_header",
    "encode_header",
    "error_reply",
    "peek_rid",
    "scoped_salt",
    "server_hint",
    "tenant_salt",
]

PROTOCOL_VERSION = 1
#: Largest accepted JSON header; headers carry no bulk data.
MAX_HEADER_BYTES = 64 * 1024
#: Kernel socket buffer size for both ends (bulk transfers stream better with larger buffers).
SOCKET_BUFFER_BYTES = 4 << 20
#: Longest ``cache_salt`` accepted (characters), the one limit every layer asks through
#: :func:`check_salt`: the SDK before sending, the server on receipt, the engine and its OpenAI
#: server on submit. Salts derived from it (:func:`scoped_salt`) stay short enough for LMCache.
MAX_SALT_CHARS = 4096
#: Longest salt LMCache accepts; :func:`scoped_salt` hashes a longer one into this many.
_LMCACHE_SALT_CHARS = 128
_RID = re.compile(rb'"rid":(\d{1,18})[,}]')


class ProtocolError(ValueError):
    """A message is malformed; ``code`` is a stable machine-readable reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RpcError(SDKError):
    """The server answered a request with an error reply: it is up, and refused this request
    (``code`` says why). Not a reason to think the server is down (that is
    ``ServerUnavailableError``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_salt(salt: object, what: str = "cache_salt") -> str:
    """``salt`` if it is a str of at most ``MAX_SALT_CHARS`` characters of valid Unicode text;
    else ``TypeError`` or ``ValueError`` naming ``what`` (callers re-raise it as their own error
    type)."""
    if not isinstance(salt, str):
        raise TypeError(f"{what} must be a string, got {type(salt).__name__}")
    if len(salt) > MAX_SALT_CHARS:
        raise ValueError(
            f"{what} is {len(salt)} characters; at most {MAX_SALT_CHARS} are accepted (use a "
            "short id or a hash of a longer one)"
        )
    return check_text(salt, what)


def scoped_salt(cache_salt: str, scope: str) -> str:
    """The salt of data private to ``scope`` (e.g. one stream's edited KV):
    ``f"{cache_salt}.{scope}"``, with ``cache_salt`` replaced by its hash when the result would
    be longer than LMCache accepts (it also refuses "/", so only the salt's hash is used)."""
    salt = f"{cache_salt}.{scope}"
    if len(salt) > _LMCACHE_SALT_CHARS:
        digest = hashlib.sha256(cache_salt.encode()).hexdigest()[:32]
        salt = f"{digest}.{scope}"
    return salt


#: The scope of one stream's edited KV (:func:`kvdrop_sdk.edit.edit_salt`):
#: ``f"{cache_salt}.{EDIT_SCOPE}.{request_stream_id}"``.
EDIT_SCOPE = "edit"
_EDIT_MARK = f".{EDIT_SCOPE}."


def tenant_salt(salt: str) -> str:
    """The tenant a request's salt belongs to: the salt a stream's edit salt was scoped from
    (``"t.edit.<stream id>"`` -> ``"t"``; ``".edit.<id>"`` -> ``""``, unsalted), else ``salt``.
    An engine shares its memory and prefill budget per tenant, so a tenant's edited streams
    count with its other requests, not each as a client of its own. (A tenant salt that
    :func:`scoped_salt` had to hash, longer than LMCache accepts with the scope, has its edited
    streams counted under the hash.)"""
    cut = salt.rfind(_EDIT_MARK)
    return salt if cut < 0 else salt[:cut]


def _error(reply: dict[str, Any]) -> RpcError:
    code = str(reply.get("code", "error"))
    return RpcError(code, f"server error ({code}): {reply.get('error', 'unknown error')}")


def encode_header(header: dict[str, Any]) -> bytes:
    """Compact JSON bytes of a header dict."""
    return json.dumps(header, separators=(",", ":")).encode("utf-8")


def decode_header(raw: bytes | memoryview) -> dict[str, Any]:
    """Parse a header frame; ProtocolError for oversized, non-UTF-8, non-JSON or non-object."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError("oversized", f"header is {len(raw)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        value = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError("bad_header", f"header is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("bad_header", "header JSON is nested too deeply") from None
    if not isinstance(value, dict):
        raise ProtocolError(
            "bad_header", f"header must be a JSON object, got {type(value).__name__}"
        )
    problem = json_surrogate(raw, value)
    if problem is not None:  # refused here, not when a store encodes it
        raise ProtocolError("bad_field", problem)
    return value


def peek_rid(raw: bytes | memoryview) -> int | None:
    """The integer ``rid`` of a header that may be too large or malformed to decode, read from
    its first bytes (clients write ``{"v":..,"op":..,"rid":N,...}``); None when not found. Lets
    the server answer even a refused request so that its caller can match the reply."""
    match = _RID.search(bytes(raw[:256]))
    return int(match.group(1)) if match else None


def error_reply(rid: Any, code: str, message: str, instance: str | None = None) -> bytes:
    """Header of an error reply (``instance``: the answering server's instance id)."""
    return encode_header(
        {
            "v": PROTOCOL_VERSION,
            "rid": rid,
            "ok": False,
            "code": code,
            "error": message,
            "instance": instance,
        }
    )


def server_hint(url: str, http_url: str | None = None) -> str:
    """How to start a server matching ``url`` (appended to connection errors)."""
    port = url.rsplit(":", 1)[-1] if ":" in url else "6555"
    cmd = f"kvdrop server --port {port}"
    if http_url and ":" in http_url.split("//", 1)[-1]:
        cmd += f" --http-port {http_url.rsplit(':', 1)[-1].rstrip('/')}"
    return f"is the kvdrop server running? start it with `{cmd}`"


class RpcClient:
    """Thread-safe request/reply client: one DEALER socket per in-flight call, from a pool.

    A call that gets no reply within ``timeout`` raises SDKError and throws its socket away, so a
    late reply can never be read as the answer to another request. Sockets come from the
    process-wide ZMQ context, which is never terminated here: an unclosed client that the garbage
    collector finds in a reference cycle is freed without blocking (terminating a private context
    waits for sockets that the same collection has not closed yet). ``client_id`` is sent with
    every request; the server binds the leases it hands out to it.
    """

    def __init__(self, url: str, timeout: float, http_url: str | None = None) -> None:
        self.url = url
        self.timeout = timeout
        self.client_id = secrets.token_hex(16)
        self._hint = server_hint(url, http_url)
        self._zctx = zmq.Context.instance()
        self._free: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._closed = False

    def _socket(self) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise SDKError("context is closed")
            if self._free:
                return self._free.pop()
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)
        try:
            sock.connect(self.url)
        except zmq.ZMQError as exc:
            sock.close()
            raise SDKError(
                f"bad server url {self.url!r}: {exc}; expected tcp://HOST:PORT"
            ) from None
        return sock

    def call(
        self,
        op: str,
        fields: dict[str, Any] | None = None,
        frames: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send ``op`` with ``fields`` and raw ``frames``; return the reply header and frames.

        Raises RpcError for an error reply and SDKError when no reply arrives in time.
        """
        return self.call_many([(op, fields or {}, frames)], timeout)[0]

    def call_many(
        self,
        calls: Sequence[tuple[str, dict[str, Any], Sequence[Any]]],
        timeout: float | None = None,
    ) -> list[tuple[dict[str, Any], list[zmq.Frame]]]:
        """Send several requests back to back on one socket, then collect every reply.

        The server's workers handle them in parallel, so a large transfer split into several
        requests overlaps the server's copies with the network. Replies come back in request
        order; the first error reply (after all replies arrived) raises RpcError.
        """
        ops = [op for op, _, _ in calls]
        sock = self._socket()
        wait = self.timeout if timeout is None else timeout
        replies: dict[int, tuple[dict[str, Any], list[zmq.Frame]]] = {}
        rids: list[int] = []
        ok = False
        try:
            for op, fields, frames in calls:
                rid = next(self._rids)
                rids.append(rid)
                header = {
                    "v": PROTOCOL_VERSION,
                    "op": op,
                    "rid": rid,
                    "client": self.client_id,
                    **fields,
                }
                sock.send_multipart([encode_header(header), *frames], copy=False)
            deadline = time.monotonic() + wait
            while len(replies) < len(rids):
                left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not sock.poll(left_ms, zmq.POLLIN):
                    raise ServerUnavailableError(
                        f"no reply from kvdrop server at {self.url} within {wait:g} s "
                        f"(op {ops[0]!r}); {self._hint}"
                    )
                parts = sock.recv_multipart(copy=False)
                reply = decode_header(parts[0].buffer)
                rid = reply.get("rid")
                if is_int(rid) and rid in rids:
                    replies[rid] = (reply, list(parts[1:]))
                elif rid is None and reply.get("ok") is False:
                    # This socket serves only this call, so a refusal the server could not match
                    # to a request is about one of ours: give its reason at once.
                    raise _error(reply)
            ok = True
        except zmq.ZMQError as exc:
            raise ServerUnavailableError(
                f"transport error talking to {self.url} (op {ops[0]!r}): {exc}"
            ) from None
        except ProtocolError as exc:
            raise SDKError(f"{self.url} sent a malformed reply to {ops[0]!r}: {exc}") from None
        finally:
            if ok:
                with self._lock:
                    if self._closed:
                        sock.close(0)
                    else:
                        self._free.append(sock)
            else:
                sock.close(0)
        ordered = [replies[rid] for rid in rids]
        for reply, _ in ordered:
            if not reply.get("ok"):
                raise _error(reply)
        return ordered

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every pooled socket (idempotent); the shared ZMQ context stays."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks, self._free = self._free, []
        for sock in socks:
            sock.close(0)
