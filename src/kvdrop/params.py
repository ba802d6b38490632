"""Declared policy parameters and their validation.

Scorers are dataclasses whose fields are declared with :func:`param`; the selector's parameters use
the same :class:`Param`. Validation happens when a factory is called, so a typo fails at set-up, not
in the middle of a batch.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdrop.errors import PolicyParamError

__all__ = ["Param", "param", "params_of_dataclass", "validate_params"]


@dataclass(frozen=True)
class Param:
    """One parameter of a policy: its name, type, default, meaning and allowed values."""

    name: str
    type: Any
    default: Any
    help: str
    allowed: str = ""  # human description of the valid range, e.g. "0 < r <= 1"
    check: Callable[[Any], bool] | None = None
    choices: tuple[Any, ...] | None = None
    #: The largest value a serving client may ask for (``kvdrop.limits``): the policy's cost
    #: grows with this parameter. None: no client cap. Library calls and the operator's own
    #: ``--policy`` are not capped.
    serve_max: float | None = None

    @property
    def type_name(self) -> str:
        """The type as a user would write it (``int``, ``float | None``)."""
        return _type_name(self.type)

    def validate(self, policy: str, value: Any) -> Any:
        """Return ``value`` (ints accepted for floats) or raise :class:`PolicyParamError`."""
        if not _isinstance(value, self.type):
            raise PolicyParamError(
                f"{policy}: parameter {self.name!r} got {value!r} ({type(value).__name__}); "
                f"expected {self.type_name}" + (f" with {self.allowed}" if self.allowed else "")
            )
        if value is None:
            return value
        if self.choices is not None and value not in self.choices:
            raise PolicyParamError(
                f"{policy}: parameter {self.name!r} got {value!r}; expected one of "
                + ", ".join(repr(c) for c in self.choices)
            )
        if self.check is not None and not self.check(value):
            raise PolicyParamError(
                f"{policy}: parameter {self.name!r} got {value!r}; expected {self.allowed}"
            )
        if _accepts(self.type, float) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value

    def describe(self) -> dict[str, Any]:
        """JSON-friendly description used by ``kvdrop describe``."""
        allowed = self.allowed
        if self.choices is not None and not allowed:
            allowed = " | ".join(str(c) for c in self.choices)
        return {
            "name": self.name,
            "type": self.type_name,
            "default": self.default if _jsonable(self.default) else repr(self.default),
            "allowed": allowed,
            "help": self.help,
            **({} if self.serve_max is None else {"serve_max": self.serve_max}),
        }


def param(
    default: Any,
    help: str,
    *,
    allowed: str = "",
    check: Callable[[Any], bool] | None = None,
    choices: Sequence[Any] | None = None,
    serve_max: float | None = None,
) -> Any:
    """Declare a scorer dataclass field as a documented, validated policy parameter;
    ``serve_max`` bounds what a serving client may ask for (see :class:`Param`)."""
    meta = {
        "help": help,
        "allowed": allowed,
        "check": check,
        "choices": tuple(choices or ()) or None,
        "serve_max": serve_max,
    }
    return dataclasses.field(default=default, metadata={"kvdrop": meta})


def check_positive_int(policy: str, name: str, value: object) -> int:
    """``value`` when it is an int >= 1 (a bool is not); else PolicyParamError naming the
    parameter of ``policy`` (for constructors that take a count outside a dataclass param)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyParamError(f"{policy}: parameter {name!r} got {value!r}; expected an int >= 1")
    return value


def params_of_dataclass(cls: type) -> list[Param]:
    """The :class:`Param` list of a scorer dataclass (fields declared with :func:`param`)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("kvdrop")
        if meta is None or not f.init:
            continue
        out.append(Param(name=f.name, type=hints[f.name], default=f.default, **meta))
    return out


def validate_params(
    policy: str, declared: Sequence[Param], given: Mapping[str, Any]
) -> dict[str, Any]:
    """Check names, types and ranges; return every declared parameter with defaults filled in."""
    by_name = {p.name: p for p in declared}
    for name in given:
        if name not in by_name:
            close = difflib.get_close_matches(name, list(by_name), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise PolicyParamError(
                f"{policy}: unknown parameter {name!r}.{hint} Allowed: {', '.join(sorted(by_name))}"
            )
    return {p.name: p.validate(policy, given.get(p.name, p.default)) for p in declared}


def _args(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _accepts(tp: Any, target: type) -> bool:
    return any(a is target for a in _args(tp))


def _isinstance(value: Any, tp: Any) -> bool:
    for a in _args(tp):
        if a is Any:
            return True
        if a is type(None) or a is None:
            if value is None:
                return True
            continue
        if typing.get_origin(a) is typing.Literal:
            if value in typing.get_args(a):
                return True
            continue
        origin = typing.get_origin(a) or a
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if origin is int and isinstance(value, bool):
            continue
        if isinstance(origin, type) and isinstance(value, origin):
            return True
    return False


def _type_name(tp: Any) -> str:
    names = []
    for a in _args(tp):
        if a is type(None):
            names.append("None")
        elif typing.get_origin(a) is typing.Literal:
            names.append(" | ".join(repr(x) for x in typing.get_args(a)))
        else:
            names.append(getattr(a, "__name__", str(a)))
    return " | ".join(names)


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
