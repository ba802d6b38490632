"""kvdrop: pluggable KV-cache token-dropping policies.

>>> import kvdrop
>>> fn = kvdrop.get("knorm", keep_ratio=0.5)          # a Policy: a ModifyFnType for batch.modify
>>> kvdrop.available()                                 # every registered policy
>>> kvdrop.get("streaming+snapkv", head_dim=64)        # spec strings build combinators

Layout: :mod:`kvdrop.policy` (the Policy protocol, scorers), :mod:`kvdrop.factories` (what the
registry hands out), :mod:`kvdrop.function_policy` (plain plugin functions), :mod:`kvdrop.inputs`
(validated edit inputs), :mod:`kvdrop.selector` (budget and ranking), :mod:`kvdrop.policies`
(one module per built-in), :mod:`kvdrop.combinators` (Compose, Chunk, Budget, Rerotate over
built policies), :mod:`kvdrop.registry` (names, plugins),
:mod:`kvdrop.spec` (spec strings, ``get``/``describe``), :mod:`kvdrop.experiments` (demo and
benchmark pipeline; the only part that uses the engine and server).

Importing the package is light: torch and the registry load on first use of a name below, so
``kvdrop --help`` stays fast and a process can configure torch's threads before it starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvdrop.errors import (
    MissingQueryError,
    MissingTokenScoresError,
    PolicyConflictError,
    PolicyInputError,
    PolicyNotFoundError,
    PolicyParamError,
    PolicyWarning,
)
from kvdrop.params import Param, param

if TYPE_CHECKING:
    from kvdrop.combinators import Budget, Chunk, Compose, Rerotate
    from kvdrop.factories import PolicyFactory, PolicyInfo, ScorerFactory
    from kvdrop.policy import Policy, PolicyWrapper, Scorer, ScorerPolicy
    from kvdrop.registry import PluginWarning, available, register
    from kvdrop.selector import Selection, Selector
    from kvdrop.spec import describe, get
    from kvdrop_sdk.query_capture import Needs, QueryNeed, needs_of

_LAZY = {
    "Budget": "kvdrop.combinators",
    "Chunk": "kvdrop.combinators",
    "Compose": "kvdrop.combinators",
    "Rerotate": "kvdrop.combinators",
    "Policy": "kvdrop.policy",
    "PolicyWrapper": "kvdrop.policy",
    "PolicyFactory": "kvdrop.factories",
    "PolicyInfo": "kvdrop.factories",
    "Needs": "kvdrop_sdk.query_capture",
    "QueryNeed": "kvdrop_sdk.query_capture",
    "needs_of": "kvdrop_sdk.query_capture",
    "Scorer": "kvdrop.policy",
    "ScorerFactory": "kvdrop.factories",
    "ScorerPolicy": "kvdrop.policy",
    "PluginWarning": "kvdrop.registry",
    "available": "kvdrop.registry",
    "register": "kvdrop.registry",
    "Selection": "kvdrop.selector",
    "Selector": "kvdrop.selector",
    "describe": "kvdrop.spec",
    "get": "kvdrop.spec",
}

__all__ = [
    "Budget",
    "Chunk",
    "Compose",
    "MissingQueryError",
    "MissingTokenScoresError",
    "Needs",
    "Param",
    "PluginWarning",
    "Policy",
    "PolicyConflictError",
    "PolicyFactory",
    "PolicyInfo",
    "PolicyInputError",
    "PolicyNotFoundError",
    "PolicyParamError",
    "PolicyWarning",
    "PolicyWrapper",
    "QueryNeed",
    "Rerotate",
    "Scorer",
    "ScorerFactory",
    "ScorerPolicy",
    "Selection",
    "Selector",
    "available",
    "describe",
    "get",
    "needs_of",
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
