"""The kvdrop cache server (``kvdrop server``): chunk pool, ZMQ requests, HTTP JSON status.

Kept import-light so ``kvdrop server --help`` starts fast; ``Server``, ``ServerConfig`` and
``spawn_server`` load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Server", "ServerConfig", "spawn_server"]

_LAZY = {
    "Server": "kvdrop_sdk.server.app",
    "ServerConfig": "kvdrop_sdk.server.config",
    "spawn_server": "kvdrop_sdk.testing.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvdrop_sdk.server' has no attribute {name!r}")
