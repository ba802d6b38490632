"""kvdrop: pluggable KV-cache token-dropping policies.

>>> import kvdrop
>>> fn = kvdrop.get("knorm", keep_ratio=0.5)          # a ModifyFnType for batch.modify(fn)
>>> kvdrop.available()                                 # every registered policy

Importing the package is light: torch and the registry load on first use of a name below, so
``kvdrop --help`` stays fast and a process can configure torch's threads before it starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvdrop.errors import (
    MissingQueryError,
    PolicyConflictError,
    PolicyInputError,
    PolicyNotFoundError,
    PolicyParamError,
)
from kvdrop.params import Param, param

if TYPE_CHECKING:
    from kvdrop.policy import PolicyInfo, Scorer, ScorerFactory, ScorerPolicy
    from kvdrop.registry import PluginWarning, available, describe, get, register
    from kvdrop.selector import Selector

_LAZY = {
    "PolicyInfo": "kvdrop.policy",
    "Scorer": "kvdrop.policy",
    "ScorerFactory": "kvdrop.policy",
    "ScorerPolicy": "kvdrop.policy",
    "PluginWarning": "kvdrop.registry",
    "available": "kvdrop.registry",
    "describe": "kvdrop.registry",
    "get": "kvdrop.registry",
    "register": "kvdrop.registry",
    "Selector": "kvdrop.selector",
}

__all__ = [
    "MissingQueryError",
    "Param",
    "PluginWarning",
    "PolicyConflictError",
    "PolicyInfo",
    "PolicyInputError",
    "PolicyNotFoundError",
    "PolicyParamError",
    "Scorer",
    "ScorerFactory",
    "ScorerPolicy",
    "Selector",
    "available",
    "describe",
    "get",
    "param",
    "register",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvdrop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
