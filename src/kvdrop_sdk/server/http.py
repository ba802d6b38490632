"""The server's HTTP JSON endpoint: ``GET /config``, ``/status`` and ``/health``.

Read-only and unauthenticated, like the ZMQ port: ``/status`` lists every registered model and
its layout to any client that can reach the port (see docs/reliability.md, trust boundary).
Idle or half-sent requests are dropped after ``http_timeout_s``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

__all__ = ["HTTPServer", "JsonRoutes", "handler_for"]

log = logging.getLogger("kvdrop_sdk.server")


class JsonRoutes(Protocol):
    """What the HTTP endpoint serves (``Server`` implements it)."""

    def config_json(self) -> dict[str, Any]:
        """``GET /config``."""
        ...

    def status_json(self) -> dict[str, Any]:
        """``GET /status``."""
        ...


class HTTPServer(ThreadingHTTPServer):
    """A threading HTTP server whose client disconnects are one log line."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left or stalled is one log line; anything else keeps its traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.info("http client %s disconnected: %s", client_address, type(exc).__name__)
        else:
            log.exception("http request from %s failed", client_address)


def handler_for(server: JsonRoutes, timeout_s: float) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class bound to ``server`` (GET /config, /status, /health)."""

    class Handler(BaseHTTPRequestHandler):
        # Idle or half-sent requests are dropped after this long instead of holding a thread.
        timeout = timeout_s

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
