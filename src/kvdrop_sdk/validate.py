"""Input checks shared by the public entry points: contexts, request streams, the reference
engine and its HTTP parser. Each value is checked once, where it enters; inner layers trust it.

The checks raise ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
with a message that names the value (``what``); callers re-raise them as their own error types.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "check_fields",
    "is_int",
    "is_number",
    "keep_ratio",
    "positive_int",
    "tensor_problem",
    "token_ids",
]


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool`` (``True`` is an int to Python, not to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for an ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def keep_ratio(value: Any, what: str = "keep_ratio") -> float:
    """``value`` as a float in ``(0, 1]`` (a fraction of tokens kept); ``ValueError`` naming
    ``what`` otherwise. The one check of a keep ratio wherever one comes in."""
    if not is_number(value) or not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError(f"{what} must be a number in (0, 1], got {value!r}")
    return float(value)


def tensor_problem(value: Any) -> str | None:
    """Why ``value`` cannot be read as a dense tensor's elements (not a tensor, sparse or another
    non-strided layout, on the ``meta`` device: no data), or None when it can."""
    if not isinstance(value, torch.Tensor):
        return f"got {type(value).__name__}"
    if value.layout != torch.strided:
        return f"got a {value.layout} tensor (convert with .to_dense())"
    if value.device.type == "meta":
        return "got a tensor on the meta device, which has no data"
    return None


def positive_int(value: Any, what: str, *, minimum: int = 1) -> int:
    """``value`` if it is an int ``>= minimum``; else ``ValueError`` naming ``what``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_fields(
    obj: object,
    *,
    ints: Mapping[str, int] | None = None,
    bools: Iterable[str] = (),
    error: type[Exception] = ValueError,
) -> None:
    """The one check of a dataclass's plain fields: each of ``ints`` an int (not a bool) ``>=``
    its minimum, each of ``bools`` a bool; else ``error`` naming ``Class.field``, what it must
    be and what it was."""
    owner = type(obj).__name__
    for name, low in (ints or {}).items():
        value = getattr(obj, name)
        if not is_int(value) or value < low:
            expected = "a positive int" if low == 1 else f"an int >= {low}"
            raise error(f"{owner}.{name} must be {expected}, got {value!r}")
    for name in bools:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise error(f"{owner}.{name} must be a bool, got {value!r}")


def token_ids(value: Any, what: str, *, vocab_size: int | None = None) -> list[int]:
    """``value`` (a sequence or 1-D integer tensor of token ids) as a list of ints.

    Each id must be an int ``>= 0`` (and ``< vocab_size`` when given); errors name the offending
    position as ``what[i]``. An empty list is returned as is: whether that is allowed is the
    caller's rule.
    """
    if isinstance(value, torch.Tensor):
        problem = tensor_problem(value)
        if problem is not None:
            raise ValueError(f"{what} must be a dense integer tensor; {problem}")
        if value.dtype == torch.bool:
            raise ValueError(f"{what} must be integer token ids, got a bool tensor")
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(
                f"{what} must be a 1-D integer tensor, got {value.dim()}-D {value.dtype}"
            )
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a list of ints (token ids), got {type(value).__name__}")
    out: list[int] = []
    for i, t in enumerate(value):
        if not is_int(t):
            raise TypeError(f"{what}[{i}] must be an int token id, got {type(t).__name__} {t!r}")
        if t < 0:
            raise ValueError(f"{what}[{i}] must be a non-negative token id, got {t}")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(f"{what}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
        out.append(int(t))
    return out
