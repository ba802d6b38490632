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

import collections
import errno
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvdrop_sdk.protocol import (
    PROTOCOL_VERSION,
    SOCKET_BUFFER_BYTES,
    ProtocolError,
    decode_header,
    encode_header,
    error_reply,
    peek_rid,
)
from kvdrop_sdk.server.config import ServerConfig
from kvdrop_sdk.server.http import HTTPServer, handler_for
from kvdrop_sdk.server.ops import HANDLERS, OPS, RequestOps, owner_of
from kvdrop_sdk.server.pool import HEADER_BYTES, Pool, check_pool_size, reap_stale_segments
from kvdrop_sdk.server.store import ChunkStore, StoreError
from kvdrop_sdk.server.windows import WindowStore

__all__ = ["Server", "ServerStartError"]

log = logging.getLogger("kvdrop_sdk.server")

_BACKEND = "inproc://kvdrop-workers"


class ServerStartError(RuntimeError):
    """The server cannot start; the one-line message says why and which flag to change."""


def _split_envelope(parts: list[zmq.Frame]) -> tuple[list[zmq.Frame], list[zmq.Frame]]:
    """(routing envelope, request) of a message from the ROUTER: DEALER peers send the request
    right after their identity; ``zmq.REQ`` peers put an empty delimiter frame in between, which
    must come back in the reply or REQ drops it."""
    if len(parts) >= 3 and len(parts[1]) == 0:
        return parts[:2], parts[2:]
    return parts[:1], parts[1:]


class Server(RequestOps):
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
        self._http: HTTPServer | None = None
        self._started = time.monotonic()
        self._requests = 0
        self._errors = 0
        self._calls: collections.Counter[str] = collections.Counter()  # "op/kind" -> answered
        self._count_lock = threading.Lock()
        self._tls = threading.local()
        # Which connections each client (lease owner) has open, to notice when all are gone.
        self._peers_lock = threading.Lock()
        self._owner_peers: dict[str, set[bytes]] = {}
        self._peer_owners: dict[bytes, set[str]] = {}

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """ZMQ address clients connect to."""
        return f"tcp://{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """HTTP base address of /config, /status and /health."""
        return f"http://{self.config.host}:{self.http_port}"

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
        except (ValueError, FileExistsError) as exc:  # PoolSizeError is a ValueError
            raise ServerStartError(str(exc)) from None
        try:
            # Query windows live on the heap beside the pool, bounded to a quarter of it.
            self.windows = WindowStore(max(64 << 20, cfg.pool_bytes // 4))
            self.store = ChunkStore(
                HEADER_BYTES,
                self.pool.nbytes,
                quarantine_s=cfg.quarantine_s,
                holders=self.windows.held,
                max_client_leases=cfg.max_client_leases,
                checksum=self._checksum,
            )
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
                handler = handler_for(self)
                self._http = HTTPServer((cfg.host, cfg.http_port), handler, cfg.http_limits)
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
        """Forward requests to the workers and replies back; notice closed connections.

        A connection is known by its ROUTER identity (never reused) and, to the monitor, by its
        file descriptor (reused): each request records fd -> identity, and a ``DISCONNECTED``
        event for the fd ends that identity. The monitor is drained before each read of the
        frontend, so a reused fd's old disconnect is seen before the new connection's requests.
        """
        monitor = frontend.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        fd_peer: dict[int, bytes] = {}
        poller = zmq.Poller()
        for sock in (frontend, backend, monitor):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                while monitor.poll(0):
                    gone = fd_peer.pop(recv_monitor_message(monitor)["value"], None)
                    if gone is not None:
                        self._peer_gone(gone)
                if frontend in events:
                    _forward(frontend, backend, fd_peer)
                if backend in events:
                    frontend.send_multipart(backend.recv_multipart(copy=False), copy=False)
        finally:
            frontend.disable_monitor()
            monitor.close(0)
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

    def _checksum(self, offset: int, nbytes: int) -> int:
        """CRC-32 of a pool slot (the store checks chunks in slots a stalled writer may reach)."""
        assert self.pool is not None
        return zlib.crc32(memoryview(self.pool.buffer)[offset : offset + nbytes])

    def _peer_seen(self, owner: str, peer: bytes) -> None:
        with self._peers_lock:
            self._owner_peers.setdefault(owner, set()).add(peer)
            self._peer_owners.setdefault(peer, set()).add(owner)

    def _peer_gone(self, peer: bytes) -> None:
        """Connection ``peer`` closed: clients with no connection left are gone (a crashed
        writer's reservations come back now, not after its lease and quarantine)."""
        gone = []
        with self._peers_lock:
            for owner in self._peer_owners.pop(peer, ()):
                peers = self._owner_peers.get(owner, set())
                peers.discard(peer)
                if not peers:
                    self._owner_peers.pop(owner, None)
                    gone.append(owner)
        for owner in gone:
            if self.store is not None and self.store.owner_gone(owner):
                log.info("client %s disconnected: its leases ended", owner[:18])

    # -- request handling ----------------------------------------------------------------------
    def handle(self, parts: list[zmq.Frame], peer: bytes = b"") -> list[Any]:
        """Answer one request (header + payload frames) from connection ``peer``; never raises."""
        rid: Any = None
        self._tls.owner = ""
        with self._count_lock:
            self._requests += 1
        try:
            # The rid first, so even an oversized request gets an answer its caller can match.
            rid = peek_rid(parts[0].buffer)
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
            self._tls.owner = owner_of(header, peer)
            if peer:
                self._peer_seen(self._tls.owner, peer)
            if header.get("v") != PROTOCOL_VERSION:
                raise ProtocolError(
                    "bad_version",
                    f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}",
                )
            op = header.get("op")
            handler = HANDLERS.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ProtocolError("unknown_op", f"unknown op {op!r}; expected one of {OPS}")
            with self._count_lock:
                self._calls[f"{op}/{header.get('kind', '')}"] += 1
            fields, frames = handler(self, header, list(parts[1:]))
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
            "max_lease_s": cfg.max_lease_s,
            "quarantine_s": cfg.quarantine_s,
            "max_client_leases": cfg.max_client_leases,
            "max_request_bytes": cfg.max_request_bytes,
            "http_max_connections": cfg.http_max_connections,
            "protocol_version": PROTOCOL_VERSION,
        }

    def status_json(self) -> dict[str, Any]:
        """What ``GET /status`` returns."""
        assert self.store is not None
        with self._count_lock:
            counts = {
                "requests": self._requests,
                "errors": self._errors,
                "calls": dict(self._calls),
            }
        return {
            "layouts": self.store.layouts(),
            **self.store.snapshot(),
            **(self.windows.snapshot() if self.windows is not None else {}),
            **counts,
            "uptime_s": round(time.monotonic() - self._started, 3),
        }


def _forward(frontend: zmq.Socket, backend: zmq.Socket, fd_peer: dict[int, bytes]) -> None:
    """Pass one request to the workers, noting which connection (fd) it came on. A function,
    so that nothing keeps the request's frames once they are handed on."""
    parts = frontend.recv_multipart(copy=False)
    if len(parts) > 1:
        fd_peer[parts[1].get(zmq.SRCFD)] = parts[0].bytes
    backend.send_multipart(parts, copy=False)


def _bind_error(flag: str, host: str, port: int, exc: Exception) -> str:
    number = getattr(exc, "errno", None)
    if number == errno.EADDRINUSE:
        return f"{flag} {port} is in use on {host} (another server?); choose another {flag}"
    return f"cannot bind {flag} {port} on {host}: {exc}"
