"""Typed readers of a decoded JSON request body: each returns the field's value (None when it
is absent) or raises :class:`BadRequestError` naming the field and what it must be. Shared by the
OpenAI routes (:mod:`kvdrop_engine.completions`) and their helpers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvdrop_sdk.validate import is_int, is_number, token_ids

__all__ = [
    "BadRequestError",
    "check_body",
    "get_bool",
    "get_float",
    "get_int",
    "get_str",
    "get_token_ids",
]


class BadRequestError(ValueError):
    """A request the server rejects; ``status`` is the HTTP status, the message says what to fix."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def get_int(body: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise BadRequestError(f"'{name}' must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise BadRequestError(f"'{name}' must be >= {minimum}, got {value}", param=name)
    return int(value)


def get_float(
    body: Mapping[str, Any], name: str, *, low: float, high: float, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value):
        raise BadRequestError(f"'{name}' must be a finite number, got {value!r}", param=name)
    value = float(value)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise BadRequestError(
            f"'{name}' must be in {bracket}{low}, {high}], got {value}", param=name
        )
    return value


def get_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise BadRequestError(f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def get_str(body: Mapping[str, Any], name: str, max_chars: int | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequestError(f"'{name}' must be a string, got {type(value).__name__}", param=name)
    if max_chars is not None and len(value) > max_chars:
        raise BadRequestError(
            f"'{name}' is {len(value)} characters; at most {max_chars} allowed", param=name
        )
    return value


def get_token_ids(value: Any, vocab_size: int | None, name: str, max_len: int | None) -> list[int]:
    """A list of token ids; its length is bounded before any id is looked at."""
    if not isinstance(value, list):
        raise BadRequestError(f"'{name}' must be a list of token ids", param=name)
    if max_len is not None and len(value) > max_len:
        raise BadRequestError(
            f"'{name}' has {len(value)} entries; at most {max_len} allowed", param=name
        )
    try:
        return token_ids(value, name, vocab_size=vocab_size)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(str(exc), param=name) from None


def check_body(body: Any, known: frozenset[str], model_name: str) -> dict[str, Any]:
    """A JSON object of known fields naming this server's model (or none)."""
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequestError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; supported: "
            + ", ".join(sorted(known)),
            param=unknown[0],
        )
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequestError(
            f"the model {model!r} does not exist; this server serves {model_name!r}",
            status=404,
            param="model",
        )
    return body
