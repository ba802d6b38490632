"""The kvdrop cache server: a ZMQ ROUTER front end, worker threads, an HTTP JSON endpoint, a pool.

Requests arrive on ``tcp://host:port`` (ROUTER) and are forwarded to ``workers`` threads over an
inproc DEALER; each worker answers one request at a time. Bulk copies happen outside the store's
lock on pinned/reserved slots, so a slow copy never blocks bookkeeping for other clients.

Every reply carries the server's ``instance`` id (random per start, also in the shm segment's
header). A request larger than ``ServerConfig.max_message_bytes`` in all its frames together is
refused (``oversized``) and freed before anything else happens; workers keep no reference to a
request or a reply once it is answered, so pool slots pinned for a socket retrieve are released as
soon as ZMQ has sent their bytes. Leases belong to the client token of the request that created
them (or, without one, to the connection).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import zmq

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.hashing import TOKEN_BYTES, chunk_keys, root_hash
from kvdrop_sdk.layout import CacheLayout, dtype_name
from kvdrop_sdk.protocol import (
    PROTOCOL_VERSION,
    SOCKET_BUFFER_BYTES,
    ProtocolError,
    decode_header,
    encode_header,
    error_reply,
)
from kvdrop_sdk.server.config import ServerConfig
from kvdrop_sdk.server.pool import HEADER_BYTES, Pool, check_pool_size, reap_stale_segments
from kvdrop_sdk.server.store import INTERNAL_OWNER, ChunkStore, StoreError
from kvdrop_sdk.server.windows import (
    WindowStore,
    parse_put,
    record_kind,
    reply_get,
    window_key,
)
from kvdrop_sdk.transport.buffers import copy_rows
from kvdrop_sdk.validate import is_int, is_number

__all__ = ["Server", "ServerStartError"]

log = logging.getLogger("kvdrop_sdk.server")

#: Largest token frame accepted (16 Mi tokens).
MAX_TOKEN_BYTES = TOKEN_BYTES * (1 << 24)
_BACKEND = "inproc://kvdrop-workers"

Reply = tuple[dict[str, Any], list[Any]]


class ServerStartError(RuntimeError):
    """The server cannot start; the one-line message says why and which flag to change."""


def _split_envelope(parts: list[zmq.Frame]) -> tuple[list[zmq.Frame], list[zmq.Frame]]:
    """(routing envelope, request) of a message from the ROUTER: DEALER peers send the request
    right after their identity; ``zmq.REQ`` peers put an empty delimiter frame in between, which
    must come back in the reply or REQ drops it."""
    if len(parts) >= 3 and len(parts[1]) == 0:
        return parts[:2], parts[2:]
    return parts[:1], parts[1:]


def _owner_of(header: dict[str, Any], peer: bytes) -> str:
    """Who owns the leases a request creates: its client token, else its connection."""
    client = header.get("client")
    if isinstance(client, str) and 0 < len(client) <= 128:
        return "c:" + client
    return "p:" + peer.hex()


def _field(header: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProtocolError("bad_field", f"field {name!r} must be {names}, got {value!r}")
    return value


class Server:
    """A kvdrop cache server; ``start()`` runs it on background threads, ``stop()`` ends it."""

    def __init__(self, config: ServerConfig) -> None:
        config.validate()
        self.config = config
        self.pool: Pool | None = None
        self.store: ChunkStore | None = None
        self.windows: WindowStore | None = None
        self.port = config.port
        self.http_port = config.http_port
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._zctx: zmq.Context | None = None
        self._http: ThreadingHTTPServer | None = None
        self._started = time.monotonic()
        self._requests = 0
        self._errors = 0
        self._count_lock = threading.Lock()
        self._tls = threading.local()
        self._ops: dict[str, Callable[[dict[str, Any], list[zmq.Frame]], Reply]] = {
            "ping": self._op_ping,
            "register": self._op_register,
            "layout": self._op_layout,
            "lookup": self._op_lookup,
            "get": self._op_get,
            "put": self._op_put,
            "reserve": self._op_reserve,
            "commit": self._op_commit,
            "abort": self._op_abort,
            "pin": self._op_pin,
            "release": self._op_release,
            "put_window": self._op_put_window,
            "get_window": self._op_get_window,
        }

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """ZMQ address clients connect to."""
        return f"tcp://{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """HTTP base address of /config, /status and /health."""
        return f"http://{self.config.host}:{self.http_port}"

    @property
    def instance(self) -> str | None:
        """This start's instance id (sent in every reply and written in the segment header)."""
        return self.pool.instance_id if self.pool else None

    def start(self) -> Server:
        """Allocate the pool, bind the sockets and start the threads; returns self.

        Raises ``ServerStartError`` (one line: what is wrong, which flag to change) when the pool
        does not fit, the shared-memory name is taken, or a port is in use. Segments left in
        /dev/shm by servers that died are reclaimed first.
        """
        cfg = self.config
        for path in reap_stale_segments():
            log.info("removed %s, left behind by a server that died", path)
        try:
            check_pool_size(
                cfg.pool_bytes + HEADER_BYTES,
                shm=cfg.shm_name is not None,
                lazy=cfg.l1_use_lazy,
            )
            self.pool = Pool(cfg.pool_bytes, cfg.shm_name, lazy=cfg.l1_use_lazy)
        except (ValueError, FileExistsError) as exc:
            raise ServerStartError(str(exc)) from None
        try:
            self.store = ChunkStore(HEADER_BYTES, self.pool.nbytes)
            # Query windows live on the heap beside the pool, bounded to a quarter of it.
            self.windows = WindowStore(max(64 << 20, cfg.pool_bytes // 4))
            self._zctx = zmq.Context()
            frontend = self._zctx.socket(zmq.ROUTER)
            frontend.setsockopt(zmq.LINGER, 0)
            frontend.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
            frontend.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)
            # A frame over the message limit can never be valid: drop such peers early.
            frontend.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
            try:
                frontend.bind(f"tcp://{cfg.host}:{cfg.port or '*'}")
            except zmq.ZMQError as exc:
                raise ServerStartError(_bind_error("--port", cfg.host, cfg.port, exc)) from None
            self.port = int(frontend.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
            backend = self._zctx.socket(zmq.DEALER)
            backend.setsockopt(zmq.LINGER, 0)
            backend.bind(_BACKEND)
            try:
                self._http = _HTTPServer((cfg.host, cfg.http_port), _handler_for(self))
            except OSError as exc:
                raise ServerStartError(
                    _bind_error("--http-port", cfg.host, cfg.http_port, exc)
                ) from None
            self.http_port = self._http.server_address[1]
        except BaseException:
            if self._zctx is not None:
                self._zctx.destroy(0)
                self._zctx = None
            self.pool.close()
            raise
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._route, args=(frontend, backend), name="kvdrop-router"),
            threading.Thread(target=self._http.serve_forever, args=(0.2,), name="kvdrop-http"),
        ]
        self._threads += [
            threading.Thread(target=self._work, name=f"kvdrop-worker-{i}", daemon=True)
            for i in range(cfg.workers)
        ]
        for t in self._threads:
            t.daemon = True
            t.start()
        log.info("kvdrop server on %s, http %s, shm %s", self.url, self.http_url, cfg.shm_name)
        if cfg.ready_file:
            tmp = f"{cfg.ready_file}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self.config_json() | {"pid": os.getpid()}, fh)
            os.replace(tmp, cfg.ready_file)
        return self

    def stop(self) -> None:
        """Stop all threads, close the sockets and unlink the shared memory (idempotent)."""
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- threads -------------------------------------------------------------------------------
    def _route(self, frontend: zmq.Socket, backend: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(frontend, zmq.POLLIN)
        poller.register(backend, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if frontend in events:
                    backend.send_multipart(frontend.recv_multipart(copy=False), copy=False)
                if backend in events:
                    frontend.send_multipart(backend.recv_multipart(copy=False), copy=False)
        finally:
            frontend.close(0)
            backend.close(0)

    def _work(self) -> None:
        assert self._zctx is not None
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(_BACKEND)
        # Replies sent straight from pinned pool slots: (tracker, unpin) until ZMQ is done.
        pending: list[tuple[zmq.MessageTracker, Callable[[], None]]] = []
        try:
            while not self._stop.is_set():
                for item in [p for p in pending if p[0].done]:
                    pending.remove(item)
                    item[1]()
                if sock.poll(5 if pending else 100, zmq.POLLIN):
                    self._serve_one(sock, pending)
        finally:
            sock.close(0)
            for _, after_send in pending:
                after_send()

    def _serve_one(
        self, sock: zmq.Socket, pending: list[tuple[zmq.MessageTracker, Callable[[], None]]]
    ) -> None:
        """Receive, answer and forget one request. Everything it holds dies on return: a tracked
        reply frame that stayed referenced would keep its pool slots pinned."""
        parts = sock.recv_multipart(copy=False)
        envelope, request = _split_envelope(parts)
        if not request:
            return  # no identity + header: nothing to answer
        self._tls.after_send = None
        reply = self.handle(request, peer=parts[0].bytes)
        del parts, request
        after_send, self._tls.after_send = self._tls.after_send, None
        try:
            if after_send is None:
                sock.send_multipart([*envelope, *reply], copy=False)
                return
            frames = [zmq.Frame(f, copy=False, track=True) for f in reply[1:]]
            tracker = zmq.MessageTracker(*frames)
            sock.send_multipart([*envelope, reply[0], *frames], copy=False)
            pending.append((tracker, after_send))
        except zmq.ZMQError:
            log.exception("could not send a reply")  # the worker keeps serving
            if after_send is not None:
                after_send()

    # -- request handling ----------------------------------------------------------------------
    def handle(self, parts: list[zmq.Frame], peer: bytes = b"") -> list[Any]:
        """Answer one request (header + payload frames) from connection ``peer``; never raises."""
        rid: Any = None
        self._tls.owner = ""
        with self._count_lock:
            self._requests += 1
        try:
            total = sum(len(p) for p in parts)
            limit = self.config.max_message_bytes
            if total > limit:
                raise ProtocolError(
                    "oversized",
                    f"message of {len(parts)} frames and {total} bytes is over the limit of "
                    f"{limit} bytes (all frames together); split it into smaller requests",
                )
            header = decode_header(parts[0].buffer)
            rid = header.get("rid")
            self._tls.owner = _owner_of(header, peer)
            if header.get("v") != PROTOCOL_VERSION:
                raise ProtocolError(
                    "bad_version",
                    f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}",
                )
            op = header.get("op")
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ProtocolError(
                    "unknown_op", f"unknown op {op!r}; expected one of {sorted(self._ops)}"
                )
            fields, frames = handler(header, list(parts[1:]))
            reply = {"v": PROTOCOL_VERSION, "rid": rid, "ok": True, **fields}
            reply["instance"] = self.instance
            return [encode_header(reply), *frames]
        except (ProtocolError, StoreError) as exc:
            code, message = exc.code, str(exc)
        except Exception as exc:  # keep serving whatever went wrong
            log.exception("request failed")
            code, message = "internal", f"{type(exc).__name__}: {exc}"
        with self._count_lock:
            self._errors += 1
        try:
            return [error_reply(rid, code, message, self.instance)]
        except (TypeError, ValueError, RecursionError):
            return [error_reply(None, code, message, self.instance)]

    def _model_kind(self, header: dict[str, Any]) -> tuple[str, CacheKind]:
        model = _field(header, "model", str)
        try:
            kind = CacheKind.parse(header.get("kind"))
        except ValueError as exc:
            raise ProtocolError("unknown_kind", str(exc)) from None
        if kind is CacheKind.QUERY and not self.config.transfer_query:
            raise StoreError(
                "query_disabled",
                "this server does not accept query tensors; start it with "
                "`kvdrop server --enable transfer_query`",
            )
        expected = kind.server_model_name(kind.base_model_name(model))
        if expected != model:
            raise ProtocolError(
                "bad_model", f"{kind.value}-kind model names look like {expected!r}, got {model!r}"
            )
        return model, kind

    def _layout(self, model: str, kind: CacheKind) -> CacheLayout:
        assert self.store is not None
        layout = self.store.layout(model, kind.value)
        if layout is None:
            raise StoreError(
                "unregistered",
                f"no layout registered for model {model!r} kind {kind.value!r}; an engine "
                "registers it when it connects, or pass layout=CacheLayout(num_layers, num_heads, "
                "head_dim, dtype) to connect() to register it yourself",
            )
        return layout

    def _checked_layout(self, header: dict[str, Any], model: str, kind: CacheKind) -> CacheLayout:
        """The registered layout; ``layout_changed`` when the request says it assumes another
        (its client read the layout before a re-registration or a server restart)."""
        layout = self._layout(model, kind)
        assumed = header.get("layout")
        if assumed is not None:
            try:
                same = CacheLayout.from_json(assumed) == layout
            except ValueError as exc:
                raise ProtocolError("bad_layout", f"bad layout: {exc}") from None
            if not same:
                raise StoreError(
                    "layout_changed",
                    f"model {model!r} kind {kind.value!r} is registered with {layout.to_json()}, "
                    f"but the request assumes {assumed}; read the layout again (connect())",
                )
        return layout

    @property
    def _owner(self) -> str:
        return str(getattr(self._tls, "owner", "") or "")

    def _keys(
        self, header: dict[str, Any], frames: list[zmq.Frame], model: str, kind: CacheKind
    ) -> tuple[list[bytes], int]:
        if not frames:
            raise ProtocolError("bad_frames", "missing the token-id frame")
        raw = frames[0].buffer
        if len(raw) > MAX_TOKEN_BYTES or len(raw) % TOKEN_BYTES:
            raise ProtocolError(
                "bad_tokens",
                f"token frame must be a multiple of {TOKEN_BYTES} bytes and at most "
                f"{MAX_TOKEN_BYTES}, got {len(raw)}",
            )
        salt = header.get("salt", "")
        if not isinstance(salt, str):
            raise ProtocolError("bad_field", f"field 'salt' must be str, got {salt!r}")
        keys = chunk_keys(root_hash(model, kind.value, salt), raw, self.config.chunk_size)
        return keys, len(raw) // TOKEN_BYTES

    def _lease_s(self, header: dict[str, Any]) -> float:
        value = header.get("lease_s", 60.0)
        if not is_number(value) or not value > 0:
            raise ProtocolError(
                "bad_field", f"field 'lease_s' must be a positive number, got {value!r}"
            )
        return float(min(value, self.config.max_lease_s))

    def _slot(self, offset: int, layout: CacheLayout, kind: CacheKind) -> torch.Tensor:
        assert self.pool is not None
        nbytes = layout.nbytes(kind, self.config.chunk_size)
        flat = self.pool.data[offset : offset + nbytes].view(layout.dtype)
        return flat.view(layout.shape(kind, self.config.chunk_size))

    def _need_shm(self) -> None:
        if self.config.shm_name is None:
            raise StoreError(
                "no_shm", "this server has no shared memory; use the socket ops (get/put)"
            )

    def _op_ping(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        return {"instance": self.instance}, []

    def _op_register(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        model, kind = self._model_kind(header)
        try:
            layout = CacheLayout.from_json(header.get("layout"))
        except ValueError as exc:
            raise ProtocolError("bad_layout", f"bad layout: {exc}") from None
        self.store.register(model, kind.value, layout, owner=self._owner)
        return {"layout": layout.to_json()}, []

    def _op_layout(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        model, kind = self._model_kind(header)
        return {"layout": self._layout(model, kind).to_json()}, []

    def _op_lookup(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        model, kind = self._model_kind(header)
        self._layout(model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        return {"num_tokens": self.store.lookup(keys) * self.config.chunk_size}, []

    def _op_pin(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        self._need_shm()
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        lid, slots = self.store.pin(keys, self._lease_s(header), owner=self._owner)
        return {
            "lease": lid,
            "offsets": [off for off, _ in slots],
            "nbytes": layout.nbytes(kind, self.config.chunk_size),
            "num_tokens": len(slots) * self.config.chunk_size,
        }, []

    def _op_release(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        lease = _field(header, "lease", str)
        return {"valid_chunks": self.store.release(lease, owner=self._owner)}, []

    def _op_reserve(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        self._need_shm()
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        nbytes = layout.nbytes(kind, self.config.chunk_size)
        lid, slots, dup, dropped = self.store.reserve(
            keys, nbytes, self._lease_s(header), owner=self._owner, tag=(model, kind.value)
        )
        return {
            "lease": lid,
            "chunks": [i for i, _ in slots],
            "offsets": [off for _, off in slots],
            "nbytes": nbytes,
            "duplicates": dup,
            "dropped": dropped,
        }, []

    def _op_commit(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        lease = _field(header, "lease", str)
        return {"stored": self.store.commit(lease, owner=self._owner)}, []

    def _op_abort(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        self.store.abort(_field(header, "lease", str), owner=self._owner)
        return {}, []

    def _op_get(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None and self.pool is not None
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        keys, _ = self._keys(header, frames, model, kind)
        # Pinned until ZMQ has sent the slots' bytes (no expiry: the worker unpins them). The
        # lease is the server's own: no client can release it early.
        lid, slots = self.store.pin(keys, float("inf"), owner=INTERNAL_OWNER)
        if lid is None:
            return {"num_tokens": 0}, []
        try:
            # One frame per (chunk, kv/layer row): bounded frame sizes stream best over TCP.
            mem = memoryview(self.pool.buffer)
            num_rows = layout.shape(kind, 1)[0] * layout.num_layers
            span = self.config.chunk_size * layout.width * layout.itemsize
            out = [
                mem[off + r * span : off + (r + 1) * span]
                for off, _ in slots
                for r in range(num_rows)
            ]
        except BaseException:
            self.store.release(lid, owner=INTERNAL_OWNER)
            raise
        store = self.store
        self._tls.after_send = lambda: store.release(lid, owner=INTERNAL_OWNER)
        shape = layout.shape(kind, len(slots) * self.config.chunk_size)
        return {
            "num_tokens": shape[2],
            "shape": list(shape),
            "dtype": dtype_name(layout.dtype),
        }, out

    def _op_put(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.store is not None
        model, kind = self._model_kind(header)
        layout = self._checked_layout(header, model, kind)
        keys, num_tokens = self._keys(header, frames, model, kind)
        c = self.config.chunk_size
        if num_tokens % c:
            raise ProtocolError(
                "bad_tokens",
                f"put takes whole chunks: {num_tokens} tokens is not a multiple of {c}",
            )
        if not keys:
            raise ProtocolError("bad_tokens", "put needs at least one whole chunk of tokens")
        # ``first_chunk``: the tokens frame holds the whole prefix (for the key chain) but data
        # only for chunks [first_chunk, end), so one store can be split into pipelined requests.
        first = header.get("first_chunk", 0)
        if not is_int(first) or not 0 <= first < len(keys):
            raise ProtocolError(
                "bad_field",
                f"field 'first_chunk' must be an int in [0, {len(keys)}), got {first!r}",
            )
        keys = keys[first:]
        num_tokens = len(keys) * c
        if header.get("dtype") != dtype_name(layout.dtype):
            raise ProtocolError(
                "dtype_mismatch",
                f"data dtype {header.get('dtype')!r} but {model!r} is registered with "
                f"{dtype_name(layout.dtype)!r}",
            )
        shape = list(layout.shape(kind, num_tokens))
        if header.get("shape") != shape:
            raise ProtocolError(
                "shape_mismatch", f"data shape {header.get('shape')!r}, expected {shape}"
            )
        num_rows = shape[0] * shape[1]
        span = c * shape[3] * layout.itemsize
        data = frames[1:]
        if len(data) != len(keys) * num_rows or any(len(f.buffer) != span for f in data):
            raise ProtocolError(
                "bad_data",
                f"put takes {len(keys) * num_rows} data frames (one per chunk and kv/layer row) "
                f"of {span} bytes each; got {len(data)} frames",
            )
        nbytes = layout.nbytes(kind, c)
        lid, slots, dup, dropped = self.store.reserve(
            keys, nbytes, self.config.max_lease_s, owner=INTERNAL_OWNER, tag=(model, kind.value)
        )
        if lid is None:
            return {"stored": 0, "duplicates": dup, "dropped": dropped}, []
        try:
            for i, off in slots:
                slot_rows = self._slot(off, layout, kind).view(num_rows, -1)
                for r in range(num_rows):
                    src = torch.frombuffer(data[i * num_rows + r].buffer, dtype=layout.dtype)
                    copy_rows(slot_rows[r], src)
        except BaseException:
            self.store.abort(lid, owner=INTERNAL_OWNER)
            raise
        stored = self.store.commit(lid, owner=INTERNAL_OWNER)
        return {"stored": stored, "duplicates": dup, "dropped": dropped}, []

    def _op_put_window(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.windows is not None
        model, kind = self._model_kind(header)
        tokens, record = parse_put(header, frames, self._layout(model, kind))
        key = window_key(model, _field(header, "salt", str), tokens, record_kind(header))
        return {"stored": self.windows.put(key, record)}, []

    def _op_get_window(self, header: dict[str, Any], frames: list[zmq.Frame]) -> Reply:
        assert self.windows is not None
        model, kind = self._model_kind(header)
        self._layout(model, kind)
        if len(frames) != 1:
            raise ProtocolError("bad_frames", "get_window takes one frame: the token ids")
        record = record_kind(header)
        key = window_key(model, _field(header, "salt", str), frames[0].buffer, record)
        return reply_get(self.windows.get(key), record)

    # -- HTTP ------------------------------------------------------------------------------------
    def config_json(self) -> dict[str, Any]:
        """What ``GET /config`` returns."""
        cfg = self.config
        return {
            "host": cfg.host,
            "port": self.port,
            "http_port": self.http_port,
            "chunk_size": cfg.chunk_size,
            "shm_name": cfg.shm_name,
            "shm_bytes": self.pool.nbytes if self.pool else None,
            "instance": self.instance,
            "features": list(cfg.enable),
            "l1_size_gb": cfg.l1_size_gb,
            "l1_bytes": cfg.pool_bytes,
            "l1_use_lazy": cfg.l1_use_lazy,
            "eviction_policy": cfg.eviction_policy.upper(),
            "workers": cfg.workers,
            "max_message_bytes": cfg.max_message_bytes,
            "protocol_version": PROTOCOL_VERSION,
        }

    def status_json(self) -> dict[str, Any]:
        """What ``GET /status`` returns."""
        assert self.store is not None
        with self._count_lock:
            counts = {"requests": self._requests, "errors": self._errors}
        return {
            "layouts": self.store.layouts(),
            **self.store.snapshot(),
            **(self.windows.snapshot() if self.windows is not None else {}),
            **counts,
            "uptime_s": round(time.monotonic() - self._started, 3),
        }


def _bind_error(flag: str, host: str, port: int, exc: Exception) -> str:
    number = getattr(exc, "errno", None)
    if number == errno.EADDRINUSE:
        return f"{flag} {port} is in use on {host} (another server?); choose another {flag}"
    return f"cannot bind {flag} {port} on {host}: {exc}"


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left or stalled is one log line; anything else keeps its traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.info("http client %s disconnected: %s", client_address, type(exc).__name__)
        else:
            log.exception("http request from %s failed", client_address)


def _handler_for(server: Server) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class bound to ``server`` (GET /config, /status, /health)."""

    class Handler(BaseHTTPRequestHandler):
        # Idle or half-sent requests are dropped after this long instead of holding a thread.
        timeout = server.config.http_timeout_s

        def do_GET(self) -> None:
            """Answer /config, /status or /health as JSON; 404 with the known paths otherwise."""
            path = self.path.split("?", 1)[0].rstrip("/")
            routes: dict[str, Callable[[], dict[str, Any]]] = {
                "/config": server.config_json,
                "/status": server.status_json,
                "/health": lambda: {"status": "ok"},
            }
            route = routes.get(path)
            if route is None:
                self._send(404, {"error": f"unknown path {self.path!r}", "paths": sorted(routes)})
            else:
                self._send(200, route())

        def _send(self, status: int, body: dict[str, Any]) -> None:
            """Write ``body`` as a JSON response."""
            raw = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:
            """Route access logs to the server logger at DEBUG (no stderr noise)."""
            log.debug("http: " + format, *args)

    return Handler
