"""Input checks shared by the public entry points: contexts, request streams, the reference
engine and its HTTP parser. Each value is checked once, where it enters; inner layers trust it.

The checks raise ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
with a message that names the value (``what``); callers re-raise them as their own error types.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "check_fields",
    "check_text",
    "edit_device",
    "is_int",
    "is_number",
    "json_surrogate",
    "keep_ratio",
    "positive_int",
    "tensor_problem",
    "token_ids",
]

#: A JSON escape of a UTF-16 surrogate (``\\ud800``): the only way JSON text decodes to a str
#: that cannot be encoded as UTF-8 (raw surrogate bytes are invalid UTF-8 and refused earlier).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def _surrogate_problem(text: str) -> str | None:
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (
        f"holds a lone UTF-16 surrogate (U+{ord(found.group()):04X}) at character "
        f"{found.start()}; expected valid Unicode text (in JSON, \\ud800-\\udfff escapes "
        "only as pairs)"
    )


def check_text(value: str, what: str) -> str:
    """``value`` if it encodes as UTF-8 (no lone surrogate, which every store, hash and log
    would fail on later); else ``ValueError`` naming ``what`` and the character."""
    problem = _surrogate_problem(value)
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    return value


def json_surrogate(raw: bytes | memoryview, value: Any) -> str | None:
    """Why the JSON ``value`` decoded from ``raw`` is not valid Unicode text (a str or key with
    a lone surrogate, named by its path like ``field 'cache_salt'``), or None. The walk runs
    only when ``raw`` holds a surrogate escape at all, so ordinary bodies cost one scan."""
    if _SURROGATE_ESCAPE.search(bytes(raw)) is None:
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            problem = _surrogate_problem(item)
            if problem is not None:
                return f"field {path!r} {problem}" if path else f"the body {problem}"
        elif isinstance(item, dict):
            for key, inner in item.items():
                problem = _surrogate_problem(key)
                if problem is not None:
                    return f"a key in {repr(path) if path else 'the body'} {problem}"
                stack.append((f"{path}.{key}" if path else key, inner))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", inner) for i, inner in enumerate(item))
    return None


def edit_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` of ``modify_kv``, ``modify`` and ``retrieve`` as a torch device (None: the
    host): the one rule for where the SDK may put a tensor. TypeError when torch cannot parse
    it; ValueError for a device that holds no data (``meta``), is neither the host nor a GPU,
    or is a GPU this process cannot use (no CUDA)."""
    if device is None:
        return None
    try:
        where = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise TypeError(
            f"device must be None or a torch device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None
    if where.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device {str(where)!r} cannot hold cached tensors (a 'meta' tensor has no data); "
            "expected None, 'cpu' or a CUDA device such as 'cuda:0'"
        )
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(where)!r}: CUDA is not available in this process; pass None or 'cpu'"
            )
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(where)!r}: this process sees {torch.cuda.device_count()} CUDA "
                "device(s)"
            )
    return where


def positive_int(value: Any, what: str, *, minimum: int = 1) -> int:
    """``value`` if it is an int ``>= minimum``; else ``ValueError`` naming ``what``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_fields(
    obj: object,
    *,
    ints: Mapping[str, int] | None = None,
    optional_ints: Mapping[str, int] | None = None,
    int_ranges: Mapping[str, tuple[int, int]] | None = None,
    numbers: Mapping[str, tuple[float, float]] | None = None,
    bools: Iterable[str] = (),
    error: type[Exception] = ValueError,
    label: Callable[[str], str] | None = None,
) -> None:
    """The one check of a dataclass's plain fields: each of ``ints`` an int (not a bool) ``>=``
    its minimum, each of ``optional_ints`` that or None, each of ``int_ranges`` an int in
    ``low..high`` (both included), each of ``numbers`` a finite number in
    ``(low, high]``, each of ``bools`` a bool; else ``error`` naming the field, what it must be
    and what it was. ``label(name)`` is how a field is named (default ``Class.field``; e.g. a
    command's flag, ``--max-tokens``, where the values came from flags)."""
    owner = type(obj).__name__
    if label is None:

        def label(name: str) -> str:
            return f"{owner}.{name}"

    for name, low in (ints or {}).items():
        value = getattr(obj, name)
        if not is_int(value) or value < low:
            expected = "a positive int" if low == 1 else f"an int >= {low}"
            raise error(f"{label(name)} must be {expected}, got {value!r}")
    for name, low in (optional_ints or {}).items():
        value = getattr(obj, name)
        if value is not None and (not is_int(value) or value < low):
            expected = "a positive int" if low == 1 else f"an int >= {low}"
            raise error(f"{label(name)} must be {expected} or None, got {value!r}")
    for name, (low, high) in (int_ranges or {}).items():
        value = getattr(obj, name)
        if not is_int(value) or not low <= value <= high:
            raise error(f"{label(name)} must be an int in {low}..{high}, got {value!r}")
    for name, (low, high) in (numbers or {}).items():
        value = getattr(obj, name)
        if not is_number(value) or not math.isfinite(value) or not low < value <= high:
            raise error(f"{label(name)} must be in ({low:g}, {high:g}], got {value!r}")
    for name in bools:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise error(f"{label(name)} must be a bool, got {value!r}")


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
