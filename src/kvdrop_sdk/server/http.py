"""The server's HTTP JSON endpoint: ``GET /config``, ``/status`` and ``/health``.

Read-only and unauthenticated, like the ZMQ port: ``/status`` lists every registered model and
its layout to any client that can reach the port (see docs/reliability.md, trust boundary).
What one client may cost (body size, whole-request deadline, open connections, log fields) is
:mod:`kvdrop_sdk.http_limits`, shared with the engine's OpenAI server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from kvdrop_sdk.http_limits import LimitedHandler, LimitedHTTPServer, log_field

__all__ = ["HTTPServer", "JsonRoutes", "handler_for"]

log = logging.getLogger("kvdrop_sdk.server")

#: The cache server's HTTP server: the shared limits, nothing of its own.
HTTPServer = LimitedHTTPServer


class JsonRoutes(Protocol):
    """What the HTTP endpoint serves (``Server`` implements it)."""

    def config_json(self) -> dict[str, Any]:
        """``GET /config``."""
        ...

    def status_json(self) -> dict[str, Any]:
        """``GET /status``."""
        ...


def handler_for(server: JsonRoutes) -> type[LimitedHandler]:
    """An HTTP handler class bound to ``server`` (GET /config, /status, /health)."""

    class Handler(LimitedHandler):
        access_log = log

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
                self._send(
                    404, {"error": f"unknown path {log_field(path)!r}", "paths": sorted(routes)}
                )
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

    return Handler
