"""Completions and chat requests and responses without a socket: parsing rules and bodies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdrop_engine.completions import BadRequestError, parse_chat_request, parse_completion_request
from kvdrop_engine.responses import ChatCompletionBuilder, CompletionBuilder
from kvdrop_engine.tokenizer import TokenizerError
from kvdrop_sdk.adapters.openai import parse_token_id_text, token_id_text
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
    assert req.max_tokens >= 1 and req.params.changed()["max_tokens"] == req.max_tokens
    assert set(req.params.changed()) <= {
        "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids",
        "logprobs",
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------


class ChatTokenizer(CharTokenizer):
    """Characters as tokens, and a chat template that writes ``<role>content|`` per message."""

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def chat(body: Any, **kw: Any) -> Any:
    kw.setdefault("tokenizer", ChatTokenizer())
    kw.setdefault("vocab_size", VOCAB)
    return parse_chat_request(body, model_name="m", **kw)


def test_chat_messages_go_through_the_template() -> None:
    req = chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert req.chat and req.prompt_token_ids == ChatTokenizer().encode("<user>hi|<assistant>")
    assert req.params.changed() == {"max_tokens": 3} and req.logprobs is None
    # OpenAI's list form of content, and no generation prompt when asked
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    req = chat(
        {
            "messages": [{"role": "user", "content": parts}],
            "add_generation_prompt": False,
            "max_completion_tokens": 2,
        }
    )
    assert req.prompt_token_ids == ChatTokenizer().encode("<user>hi|") and req.max_tokens == 2


def test_chat_max_tokens_default_is_the_rest_of_the_context() -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt = len("<user>hi|<assistant>")
    assert chat({"messages": messages}, max_model_len=100).max_tokens == 100 - prompt
    assert chat({"messages": messages}).max_tokens == 512  # context length unknown
    with pytest.raises(BadRequestError, match="fills the model's context length"):
        chat({"messages": messages}, max_model_len=prompt)
    with pytest.raises(BadRequestError, match="exceeds the model's context length") as info:
        chat({"messages": messages, "max_completion_tokens": 90}, max_model_len=100)
    assert info.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "'messages' is required"),
        ({"messages": []}, "'messages' is required"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        ({"messages": [{"content": "hi"}]}, "messages[0] must be an object"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "only text parts",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]},
            "messages[0].tool_calls must be a list of calls",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function must hold 'name'",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "toolz": []}, "unknown field(s)"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "unknown field(s)"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0}, "needs 'logprobs'"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "'top_logprobs' must be an int in [0, 20]",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 0}, "must be true or false"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 17}, "'n' must be at most 16"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "non-empty strings"),
    ],
)
def test_chat_bad_requests_say_what_is_wrong(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequestError) as info:
        chat(body)
    assert fragment in str(info.value) and info.value.status == 400


def test_chat_needs_a_tokenizer_with_a_template() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(BadRequestError, match="no tokenizer with a chat template"):
        chat(body, tokenizer=None)
    with pytest.raises(BadRequestError, match="no tokenizer with a chat template"):
        chat(body, tokenizer=CharTokenizer())

    class Refusing(CharTokenizer):
        def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> Any:
            raise TokenizerError("chat template error: roles must alternate")

    with pytest.raises(BadRequestError, match=r"cannot apply the chat template: .*alternate"):
        chat(body, tokenizer=Refusing())
    with pytest.raises(BadRequestError, match="outside the model's vocabulary"):
        chat(body, vocab_size=50)  # '<' is token 60
    with pytest.raises(BadRequestError, match="does not exist") as info:
        chat({**body, "model": "other"})
    assert info.value.status == 404


def test_chat_builder_body_and_chunks() -> None:
    tok = ChatTokenizer()
    req = chat(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True},
        return_tokens_as_token_ids=True,
    )
    build = ChatCompletionBuilder(req, "m", tokenizer=tok)
    (role,) = build.preamble()
    assert role["object"] == "chat.completion.chunk" and role["id"].startswith("chatcmpl-")
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    eos = ord("$")
    pieces = [build.add(TokenEvent(t, chr(t))) for t in map(ord, "ok")]
    # the token that stops the reply (EOS or a stop id) is listed but is not content
    pieces.append(build.add(TokenEvent(eos, "$", "stop")))
    chunks = [build.chunk(p) for p in pieces]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"content": "o"},
        {"content": "k"},
        {"content": ""},
    ]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks] == [
        token_id_text(t) for t in (ord("o"), ord("k"), eos)
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    body = build.body()
    assert body["object"] == "chat.completion" and body["id"] == role["id"]
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "ok"}
    assert choice["finish_reason"] == "stop"
    assert [t["token"] for t in choice["logprobs"]["content"]] == [
        token_id_text(t) for t in (ord("o"), ord("k"), eos)
    ]
    assert body["usage"] == {
        "prompt_tokens": len(req.prompt_token_ids),
        "completion_tokens": 3,
        "total_tokens": len(req.prompt_token_ids) + 3,
    }
    assert build.usage_chunk()["choices"] == [] and build.usage_chunk()["usage"] == body["usage"]
    assert build.chunk(finish="length")["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }


def test_chat_builder_without_logprobs_or_tokens_as_ids() -> None:
    req = chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    build = ChatCompletionBuilder(req, "m", tokenizer=ChatTokenizer())
    build.add(TokenEvent(ord("a"), "a"))
    piece = build.add(TokenEvent(ord("b"), "b"))
    assert piece.finish == "length"  # max_tokens reached, text kept
    body = build.body()
    assert body["choices"][0]["message"]["content"] == "ab"
    assert body["choices"][0]["logprobs"] is None


_chat_fields = st.sampled_from(
    ["messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "stop", "stream",
     "stream_options", "logprobs", "top_logprobs", "n", "model", "add_generation_prompt",
     "cache_salt", "tools"]
)  # fmt: skip
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | _json, "content": _json}
)


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(_chat_fields, _json, max_size=6)
    | st.fixed_dictionaries(
        {"messages": st.lists(_message | _json, max_size=3)},
        optional={"max_tokens": _json, "logprobs": _json, "top_logprobs": _json},
    )
    | _json
)
def test_chat_parse_never_fails_with_anything_but_bad_request(body: Any) -> None:
    try:
        req = chat(body, max_model_len=4096)
    except BadRequestError as exc:
        assert str(exc) and 400 <= exc.status < 500
        return
    assert req.chat and req.prompt_token_ids and req.max_tokens >= 1
    assert len(req.prompt_token_ids) + req.max_tokens <= 4096


class CountingTemplate(CharTokenizer):
    """Counts chat templating calls: bounds must refuse a request before any."""

    calls = 0

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        CountingTemplate.calls += 1
        return self.encode("".join(m["content"] for m in messages) or "x")


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([{"role": "r" * 4_000_000, "content": "x"}], "'role' is 4000000 characters"),
        ([{"role": "user", "content": "x", "name": "n" * 100}], "'name' is 100 characters"),
        ([{"role": "user", "content": ""}] * 150_000, "150000 messages"),
        ([{"role": "user", "content": [{"type": "text", "text": ""}] * 5000}], "content parts"),
        ([{"role": "user", "content": "x" * 70_000}], "the chat's text is 70004 characters"),
    ],
)
def test_chat_bounds_refuse_before_templating(messages: list[Any], fragment: str) -> None:
    CountingTemplate.calls = 0
    with pytest.raises(BadRequestError) as info:
        parse_chat_request(
            {"messages": messages}, model_name="m", tokenizer=CountingTemplate(), max_model_len=4096
        )
    assert fragment in str(info.value) and info.value.status == 400
    assert CountingTemplate.calls == 0


def test_stop_lists_are_capped_and_deduplicated() -> None:
    req = parse_completion_request(
        {"prompt": "x", "stop": ["a", "b", "a"], "stop_token_ids": [5, 3, 5]},
        model_name="m",
        tokenizer=CharTokenizer(),
    )
    assert req.stop == ("a", "b") and req.params.changed()["stop_token_ids"] == [3, 5]
    with pytest.raises(BadRequestError, match="at most 1024"):
        parse_completion_request(
            {"prompt": [1], "stop_token_ids": list(range(2_000_000))}, model_name="m"
        )


def test_a_tiny_temperature_is_raised_to_the_minimum() -> None:
    req = parse_completion_request({"prompt": [1], "temperature": 1e-39}, model_name="m")
    assert req.params.changed()["temperature"] == 0.01
