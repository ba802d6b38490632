"""What a request's output must follow, read from its body: OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and their newer ``structured_outputs`` object. At most
one may be given; each becomes one :class:`~kvdrop_engine.structured.Guide`, which the engine
compiles (a schema or grammar that does not compile is its 400). Bounded here: the guide's
text, the number of choices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvdrop_engine.request_fields import BadRequestError
from kvdrop_engine.structured import MISSING, Guide, available

__all__ = ["GUIDE_FIELDS", "MAX_CHOICES", "MAX_GUIDE_CHARS", "guide_from_body"]

#: The request fields that ask for structure.
GUIDE_FIELDS = (
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs",
)  # fmt: skip
#: Longest schema, regex or grammar text (compiling one costs the vocabulary times its size).
MAX_GUIDE_CHARS = 32768
#: Most ``choice`` alternatives.
MAX_CHOICES = 256

#: vLLM's ``structured_outputs`` keys and the guide kind each names.
_STRUCTURED_KEYS = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def _schema_text(value: Any, name: str) -> str:
    """A JSON schema sent as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadRequestError(f"'{name}' is not valid JSON: {exc}", param=name) from None
    if not isinstance(value, (dict, bool)):
        raise BadRequestError(f"'{name}' must be a JSON schema (an object)", param=name)
    return _bounded(json.dumps(value), name)


def _bounded(text: str, name: str) -> str:
    if len(text) > MAX_GUIDE_CHARS:
        raise BadRequestError(
            f"'{name}' is {len(text)} characters; at most {MAX_GUIDE_CHARS} allowed", param=name
        )
    return text


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"'{name}' must be a non-empty string", param=name)
    return _bounded(value, name)


def _choices(value: Any, name: str) -> str:
    if (
        not isinstance(value, list)
        or not value
        or len(value) > MAX_CHOICES
        or not all(isinstance(c, str) and c for c in value)
    ):
        raise BadRequestError(
            f"'{name}' must be a list of 1 to {MAX_CHOICES} non-empty strings", param=name
        )
    return _bounded(json.dumps(value), name)


def _response_format(value: Any) -> Guide | None:
    name = "response_format"
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Guide("json_object")
    if kind == "json_schema" and set(value) <= {"type", "json_schema"}:
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or set(spec) - {"name", "schema", "strict", "description"}:
            raise BadRequestError(
                "'response_format.json_schema' must be {'name': ..., 'schema': {...}, "
                "'strict': ...}",
                param=name,
            )
        schema = spec.get("schema", {"type": "object"})  # OpenAI's default: any object
        return Guide("json", _schema_text(schema, "response_format.json_schema.schema"))
    raise BadRequestError(
        "'response_format' must be {'type': 'text'}, {'type': 'json_object'} or "
        "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
        param=name,
    )


def _structured_outputs(value: Any) -> Guide:
    name = "structured_outputs"
    given = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else {}
    kinds = [k for k in given if k in _STRUCTURED_KEYS]
    if not isinstance(value, dict) or set(given) - set(_STRUCTURED_KEYS) or len(kinds) != 1:
        raise BadRequestError(
            "'structured_outputs' must hold exactly one of "
            + ", ".join(repr(k) for k in _STRUCTURED_KEYS),
            param=name,
        )
    key = kinds[0]
    return _guide(_STRUCTURED_KEYS[key], given[key], f"{name}.{key}")


def _guide(kind: str, value: Any, name: str) -> Guide:
    if kind == "json":
        return Guide("json", _schema_text(value, name))
    if kind == "json_object":
        if value is not True:
            raise BadRequestError(f"'{name}' must be true", param=name)
        return Guide("json_object")
    if kind == "choice":
        return Guide("choice", _choices(value, name))
    return Guide(kind, _text(value, name))


def guide_from_body(body: Mapping[str, Any]) -> Guide | None:
    """The body's one guide (None when it asks for none); a 400 for two, a malformed one, or
    one while xgrammar is not installed (naming the extra)."""
    sent = [name for name in GUIDE_FIELDS if body.get(name) is not None]
    if len(sent) > 1:
        raise BadRequestError(
            f"give one structured output, not {' and '.join(map(repr, sent))}", param=sent[1]
        )
    if not sent:
        return None
    name = sent[0]
    value = body[name]
    if name == "response_format":
        guide = _response_format(value)
    elif name == "structured_outputs":
        guide = _structured_outputs(value)
    else:
        guide = _guide(name.removeprefix("guided_"), value, name)
    if guide is not None and not available():
        raise BadRequestError(f"'{name}': {MISSING}", param=name)
    return guide
