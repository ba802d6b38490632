"""Completions requests and responses without a socket: parsing rules and response bodies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdrop_engine.completions import (
    BadRequestError,
    CompletionBuilder,
    parse_completion_request,
)
from kvdrop_sdk.adapters.openai import parse_token_id_text
from kvdrop_sdk.events import TokenEvent

VOCAB = 1000


class CharTokenizer:
    """One token per character (code point)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def test_parse_rejects_non_dict_and_reports_param() -> None:
    with pytest.raises(BadRequestError, match="JSON object"):
        parse_completion_request("x", model_name="m")
    with pytest.raises(BadRequestError) as info:
        parse_completion_request({"prompt": [1], "seed": 1.5}, model_name="m")
    assert info.value.param == "seed" and info.value.status == 400


def test_builder_writes_token_ids_the_sdk_adapter_reads_back() -> None:
    req = parse_completion_request(
        {"prompt": [1, 2], "max_tokens": 3, "logprobs": 0, "return_tokens_as_token_ids": True},
        model_name="m",
    )
    build = CompletionBuilder(req, "m")
    pieces = [build.add(TokenEvent(t, f"<{t}>")) for t in (7, 8, 9)]
    assert [p.finish for p in pieces] == [None, None, "length"]  # max_tokens reached
    assert [parse_token_id_text(p.token) for p in pieces] == [7, 8, 9]
    body = build.body()
    assert body["choices"][0]["text"] == "<7><8><9>"
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 3, 6]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_builder_detokenizes_and_flushes_on_the_last_token() -> None:
    class ByteTokenizer:
        def encode(self, text: str) -> list[int]:
            return list(text.encode())

        def decode(self, token_ids: Sequence[int]) -> str:
            return bytes(token_ids).decode("utf-8", errors="replace")

    req = parse_completion_request({"prompt": [1], "max_tokens": 3}, model_name="m")
    build = CompletionBuilder(req, "m", tokenizer=ByteTokenizer(), detokenize=True)
    euro = "€".encode()  # three bytes: text only once the character is complete
    assert [build.add(TokenEvent(b, "ignored")).text for b in euro] == ["", "", "€"]
    req = parse_completion_request({"prompt": [1], "max_tokens": 2}, model_name="m")
    build = CompletionBuilder(req, "m", tokenizer=ByteTokenizer(), detokenize=True)
    # the request ends inside a character: the last token flushes what is held back
    assert [build.add(TokenEvent(b, "")).text for b in euro[:2]] == ["", "\ufffd"]


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
_field_names = st.sampled_from(
    ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
     "stream", "stream_options", "logprobs", "n", "echo", "cache_salt", "model", "ignore_eos",
     "presence_penalty", "user", "return_tokens_as_token_ids", "max_token"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(_field_names, _json, max_size=6)
    | st.fixed_dictionaries(
        {"prompt": st.lists(st.integers(-5, 2000), max_size=5)},
        optional={"max_tokens": _json, "seed": _json, "top_p": _json, "stop_token_ids": _json},
    )
    | _json
)
def test_parse_never_fails_with_anything_but_bad_request(body: Any) -> None:
    """Whatever JSON arrives, validation either accepts it or raises BadRequestError."""
    try:
        req = parse_completion_request(
            body, model_name="m", tokenizer=CharTokenizer(), vocab_size=VOCAB, max_model_len=4096
        )
    except BadRequestError as exc:
        assert str(exc) and 400 <= exc.status < 500
        return
    assert req.prompt_token_ids and all(0 <= t < VOCAB for t in req.prompt_token_ids)
    assert req.max_tokens >= 1 and req.sampling_params["max_tokens"] == req.max_tokens
    assert set(req.sampling_params) <= {
        "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids"
    }  # fmt: skip
