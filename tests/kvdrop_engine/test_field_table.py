"""The one table of accepted request fields against the official ``openai`` client: every field
its request types can send is in the table (a new client version with a new field fails here
until the table says what the field does), each with a reason, and the unknown-field error lists
only what is served."""

from __future__ import annotations

import re
import typing
from typing import Any

import pytest

from kvdrop_engine import field_table
from kvdrop_engine.completions import (
    BadRequestError,
    parse_chat_request,
    parse_completion_request,
)
from kvdrop_engine.field_table import FIELDS, Kind

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")


def _client_fields(params: Any) -> set[str]:
    """Every key of a client's request ``TypedDict`` union (streaming and not)."""
    keys: set[str] = set()
    for kind in typing.get_args(params) or (params,):
        keys |= set(kind.__required_keys__ | kind.__optional_keys__)
    return keys


ROUTES = [
    (field_table.COMPLETIONS, openai_types.CompletionCreateParams),
    (field_table.CHAT, chat_types.CompletionCreateParams),
]


@pytest.mark.parametrize(("route", "params"), ROUTES)
def test_every_client_field_is_in_the_table(route: str, params: Any) -> None:
    sent = _client_fields(params)
    assert len(sent) > 15  # the walk found the client's fields
    missing = sorted(sent - field_table.accepted(route))
    assert not missing, f"openai sends {missing}: say in field_table.FIELDS what they do"


def test_every_row_says_why_and_neutral_rows_name_values_or_none() -> None:
    for name, row in FIELDS.items():
        assert row.why and row.routes, name
        assert row.kind is Kind.NEUTRAL or not row.neutral, name
        assert row.kind is Kind.IGNORED or row.check is None, name


def _parse(route: str, body: dict[str, Any]) -> Any:
    if route == field_table.CHAT:
        body = {"messages": [{"role": "user", "content": "x"}], **body}
        return parse_chat_request(body, model_name="m", tokenizer=_Chat(), vocab_size=300)
    return parse_completion_request({"prompt": [1, 2], **body}, model_name="m", vocab_size=300)


class _Chat:
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        return [1, 2, 3]


@pytest.mark.parametrize("route", [field_table.COMPLETIONS, field_table.CHAT])
def test_neutral_rows_take_their_values_and_refuse_others_saying_why(route: str) -> None:
    for name, row in FIELDS.items():
        if row.kind is not Kind.NEUTRAL or route not in row.routes:
            continue
        for value in (None, *row.neutral):
            _parse(route, {name: value})
        with pytest.raises(BadRequestError, match=re.escape(row.why)) as err:
            _parse(route, {name: "something else"})
        assert err.value.param == name


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"metadata": {"k": 1}}, "'metadata' keys are at most 64"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "at most 16 string keys"),
        ({"safety_identifier": "x" * 129}, "at most 128"),
        ({"prompt_cache_retention": "7d"}, "'in_memory', '24h'"),
        ({"prompt_cache_options": {"ttl": "1h"}}, "'prompt_cache_options.ttl' must be '30m'"),
        ({"user": 5}, "'user' must be a string"),
    ],
)
def test_ignored_fields_are_checked_for_shape(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequestError, match=re.escape(fragment)):
        _parse(field_table.CHAT, body)


def test_ignored_fields_at_any_well_formed_value_change_nothing() -> None:
    plain = _parse(field_table.CHAT, {})
    sent = _parse(
        field_table.CHAT,
        {
            "metadata": {"team": "a", "run": "7"}, "safety_identifier": "u-1",
            "prompt_cache_key": "k", "prompt_cache_retention": "24h",
            "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}, "user": "u",
            "verbosity": "medium", "store": False, "service_tier": "default",
        },
    )  # fmt: skip
    assert sent == plain


@pytest.mark.parametrize("route", [field_table.COMPLETIONS, field_table.CHAT])
def test_the_unknown_field_error_lists_only_what_is_served(route: str) -> None:
    with pytest.raises(BadRequestError, match="unknown field") as err:
        _parse(route, {"no_such_field": 1})
    message = str(err.value)
    served_part, _, neutral_part = message.partition("; accepted at their neutral values only: ")
    served = served_part.split("supported: ", 1)[1].split(", ")
    assert served and all(FIELDS[n].kind is not Kind.NEUTRAL for n in served), served
    assert set(served) | set(neutral_part.split(", ")) == field_table.accepted(route)
    assert all(FIELDS[n].kind is Kind.NEUTRAL for n in neutral_part.split(", "))
