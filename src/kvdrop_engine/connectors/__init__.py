"""The engine's connectors to a cache server, one module per role.

* :mod:`~kvdrop_engine.connectors.base` -- :class:`KVConnector`, the contract the engine uses;
* :mod:`~kvdrop_engine.connectors.factory` -- :data:`CONNECTOR_KINDS` (the only list of kinds)
  and :func:`make_connector`;
* :mod:`~kvdrop_engine.connectors.kvdrop` -- :class:`ServerConnector`, a kvdrop server;
* :mod:`~kvdrop_engine.connectors.lmcache` -- :class:`LMCacheConnector`, a real LMCache server.

The names are importable from here too, each on first use: importing the package loads no
connector (a command line reads :data:`CONNECTOR_KINDS` without torch or LMCache).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CONNECTOR_KINDS",
    "KVConnector",
    "LMCacheConnector",
    "ServerConnector",
    "make_connector",
]

_HOME = {
    "CONNECTOR_KINDS": "factory",
    "make_connector": "factory",
    "KVConnector": "base",
    "ServerConnector": "kvdrop",
    "LMCacheConnector": "lmcache",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
