"""Typed readers of a decoded JSON request body: each returns the field's value (None when it
is absent) or raises :class:`BadRequestError` naming the field and what it must be. Shared by the
OpenAI routes (:mod:`kvdrop_engine.completions`) and their helpers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvdrop_engine import field_table
from kvdrop_sdk.validate import is_int, is_number, token_ids

#: Most ``stop`` strings, the longest one, and most ``stop_token_ids`` per request.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "DETOKENIZE_FIELDS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "NEUTRAL_FIELDS",
    "SAMPLING_FIELDS",
    "TOKENIZE_FIELDS",
    "BadRequestError",
    "check_body",
    "check_neutral",
    "get_bool",
    "get_float",
    "get_int",
    "get_stop_strings",
    "get_str",
    "get_streaming",
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


#: Sampling fields, passed to :class:`~kvdrop_engine.sampling.SamplingParams` (the one validator
#: of their values) under the same names.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "ignore_eos",
    "stop_token_ids",
)  # fmt: skip
#: Largest request body the engine reads by default (``--max-request-bytes``): a 100K-token
#: prompt as JSON ids is about 0.7 MB, 64 batched prompts of 8K tokens about 3.5 MB. Larger is a
#: 413 before a byte is read, so a hostile body never costs the engine's heap its size.
MAX_BODY_BYTES = 8 << 20
COMPLETION_FIELDS = field_table.accepted(field_table.COMPLETIONS)
CHAT_FIELDS = field_table.accepted(field_table.CHAT)
TOKENIZE_FIELDS = field_table.accepted(field_table.TOKENIZE)
DETOKENIZE_FIELDS = field_table.accepted(field_table.DETOKENIZE)
#: Fields accepted at their neutral values only (:mod:`kvdrop_engine.field_table` owns them).
NEUTRAL_FIELDS = field_table.neutral_fields()


def check_neutral(body: dict[str, Any], n: int) -> None:
    """Fields accepted only at a neutral value or of a checked shape (the table's rule), and
    ``best_of`` equal to ``n``."""
    best_of = get_int(body, "best_of", minimum=1)
    if best_of not in (None, n):
        raise BadRequestError(f"'best_of' must equal 'n' ({n}), got {best_of}", param="best_of")
    problem = field_table.check_accepted(body)
    if problem is not None:
        raise BadRequestError(problem[1], param=problem[0])


def get_stop_strings(body: Mapping[str, Any], has_tokenizer: bool) -> tuple[str, ...]:
    """``stop``: a string or a list of strings (capped); text output needs the tokenizer."""
    stop = body.get("stop")
    if stop is None or stop == "":
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequestError(
            "'stop' must be a string or a list of non-empty strings", param="stop"
        )
    if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in items):
        raise BadRequestError(
            f"'stop' allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            "characters each",
            param="stop",
        )
    if items and not has_tokenizer:
        raise BadRequestError(
            "'stop' strings need text output and this server has no tokenizer; use "
            "'stop_token_ids'",
            param="stop",
        )
    return tuple(dict.fromkeys(items))


def get_streaming(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = bool(get_bool(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequestError(
            "'stream_options' must be an object with only 'include_usage'", param="stream_options"
        )
    if not stream:
        raise BadRequestError(
            "'stream_options' is only allowed with 'stream': true", param="stream_options"
        )
    return stream, bool(get_bool(options, "include_usage"))


def check_body(body: Any, known: frozenset[str], model_name: str) -> dict[str, Any]:
    """A JSON object of known fields naming this server's model (or none)."""
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        served, neutral = field_table.listed(known)
        more = f"; accepted at their neutral values only: {', '.join(neutral)}" if neutral else ""
        raise BadRequestError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; supported: {', '.join(served)}"
            + more,
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
