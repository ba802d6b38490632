"""kvdrop: pluggable KV-cache token-dropping policies.

>>> import kvdrop
>>> fn = kvdrop.get("knorm", keep_ratio=0.5)          # a ModifyFnType for batch.modify(fn)
>>> kvdrop.available()                                 # every registered policy
"""

from __future__ import annotations

from kvdrop.errors import (
    MissingQueryError,
    PolicyConflictError,
    PolicyInputError,
    PolicyNotFoundError,
    PolicyParamError,
)
from kvdrop.params import Param, param
from kvdrop.policy import PolicyInfo, Scorer, ScorerFactory, ScorerPolicy
from kvdrop.registry import PluginWarning, available, describe, get, register
from kvdrop.selector import Selector

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
