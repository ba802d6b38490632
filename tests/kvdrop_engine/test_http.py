"""The OpenAI-compatible HTTP server, end to end over real sockets, around small Python engines."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import requests

from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.request_options import RequestOptions
from kvdrop_engine.sampling import SamplingParams
from kvdrop_sdk.events import TokenEvent

VOCAB = 1000
EOS = 999
pytestmark = pytest.mark.timeout(60)


class CountingEngine:
    """Deterministic engine: token i of a reply is (last prompt token + 1 + i) % VOCAB.

    Stops with "stop" on EOS or a stop token id, with "length" at max_tokens, and records every
    call so tests can check what the server forwarded.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], dict[str, Any], str]] = []
        self.closed = 0
        self.lock = threading.Lock()

    def __call__(
        self, prompt_token_ids: list[int], params: SamplingParams, options: RequestOptions
    ) -> Iterator[TokenEvent]:
        """The server's call: the request's validated ``SamplingParams`` and ``RequestOptions``
        (recorded as the sampling values that are not the default, and the salt)."""
        sent = params.changed()
        with self.lock:
            self.calls.append((list(prompt_token_ids), sent, options.cache_salt))
        return self._gen(prompt_token_ids, sent)

    def _gen(self, prompt: list[int], params: dict[str, Any]) -> Iterator[TokenEvent]:
        stops = set(params.get("stop_token_ids", []))
        if not params.get("ignore_eos"):
            stops.add(EOS)
        n = params["max_tokens"]
        try:
            for i in range(n):
                tok = (prompt[-1] + 1 + i) % VOCAB
                finish = "stop" if tok in stops else ("length" if i == n - 1 else None)
                yield TokenEvent(tok, f"<{tok}>", finish)
                if finish:
                    return
        finally:
            with self.lock:
                self.closed += 1


class CharTokenizer:
    """One token per character (code point), enough to test text prompts and text output."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)


@pytest.fixture
def engine() -> CountingEngine:
    return CountingEngine()


@pytest.fixture
def server(engine: CountingEngine) -> Iterator[CompletionHTTPServer]:
    with CompletionHTTPServer(
        engine, model_name="counting", port=0, return_tokens_as_token_ids=True, vocab_size=VOCAB
    ) as srv:
        yield srv


def post(srv: CompletionHTTPServer, body: Any, **kw: Any) -> requests.Response:
    return requests.post(srv.url + "/v1/completions", json=body, timeout=30, **kw)


def sse_events(response: requests.Response) -> list[Any]:
    """Parse a whole SSE body strictly: every event is one 'data: ...' line then a blank line."""
    text = response.content.decode()
    assert text.endswith("\n\n"), text[-50:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        assert "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------


def test_binds_localhost_by_default(engine: CountingEngine) -> None:
    srv = CompletionHTTPServer(engine, model_name="m", port=0)
    try:
        assert srv.host == "127.0.0.1"
        assert srv.url == f"http://127.0.0.1:{srv.port}"
    finally:
        srv.stop()


def test_health_and_models(server: CompletionHTTPServer) -> None:
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = requests.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["counting"]
    assert body["data"][0]["object"] == "model"


def test_health_reports_unhealthy_engine(engine: CountingEngine) -> None:
    healthy = {"ok": True}
    with CompletionHTTPServer(engine, model_name="m", port=0, health=lambda: healthy["ok"]) as srv:
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200
        healthy["ok"] = False
        r = requests.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503 and "not healthy" in r.json()["error"]["message"]


def test_stats_route_only_when_configured(
    server: CompletionHTTPServer, engine: CountingEngine
) -> None:
    assert requests.get(server.url + "/stats", timeout=10).status_code == 404
    with CompletionHTTPServer(
        engine, model_name="m", port=0, stats=lambda: {"calls": len(engine.calls)}
    ) as srv:
        post(srv, {"prompt": [1], "max_tokens": 1})
        assert requests.get(srv.url + "/stats", timeout=10).json() == {"calls": 1}


def test_unknown_routes_and_methods(server: CompletionHTTPServer) -> None:
    r = requests.get(server.url + "/v1/chat", timeout=10)
    message = r.json()["error"]["message"]
    assert r.status_code == 404
    assert "POST /v1/completions" in message and "POST /v1/chat/completions" in message
    for route in ("/v1/completions", "/v1/chat/completions"):
        assert requests.get(server.url + route, timeout=10).status_code == 405
    r = requests.post(server.url + "/health", json={}, timeout=10)
    assert r.status_code == 405


# ---------------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------------


def test_non_streaming_completion(server: CompletionHTTPServer, engine: CountingEngine) -> None:
    r = post(server, {"model": "counting", "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "counting"
    (choice,) = body["choices"]
    assert choice["text"] == "<8><9><10>"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["token_id:8", "token_id:9", "token_id:10"]
    assert choice["logprobs"]["text_offset"] == [0, 3, 6]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    # "logprobs": 0 reaches the engine: it computes the sampled tokens' values
    assert engine.calls == [([5, 6, 7], {"max_tokens": 3, "logprobs": 0}, "")]


def test_default_max_tokens_and_no_logprobs(server: CompletionHTTPServer) -> None:
    body = post(server, {"prompt": [1]}).json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["logprobs"] is None


def test_stop_token_finishes_with_stop(server: CompletionHTTPServer) -> None:
    body = post(server, {"prompt": [1], "max_tokens": 10, "stop_token_ids": [4]}).json()
    assert body["choices"][0]["text"] == "<2><3>"  # the stop token's text is left out (vLLM)
    assert body["choices"][0]["finish_reason"] == "stop"


def test_streaming_sse_one_event_per_token(server: CompletionHTTPServer) -> None:
    body = {"prompt": [[100]], "max_tokens": 4, "stream": True, "logprobs": 0}
    r = post(server, body, stream=True)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 4
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [
        ["token_id:101"],
        ["token_id:102"],
        ["token_id:103"],
        ["token_id:104"],
    ]
    assert [c["choices"][0]["text"] for c in chunks] == ["<101>", "<102>", "<103>", "<104>"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all(c["object"] == "text_completion" and c["model"] == "counting" for c in chunks)


def test_streaming_usage_chunk(server: CompletionHTTPServer) -> None:
    body = {
        "prompt": [1, 2],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(post(server, body))
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert all(c["choices"][0]["logprobs"] is None for c in events[:-2])


def test_stream_events_arrive_before_generation_ends(engine: CountingEngine) -> None:
    """Tokens are flushed as produced, not buffered until the end."""
    release = threading.Event()

    def slow(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        yield TokenEvent(1, "a")
        release.wait(10)
        yield TokenEvent(2, "b", "stop")

    with CompletionHTTPServer(slow, model_name="m", port=0) as srv:
        r = post(srv, {"prompt": [0], "stream": True}, stream=True)
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len(b"data: ") :])["choices"][0]["text"] == "a"
        assert not release.is_set()
        release.set()
        rest = [line for line in lines if line]
        assert rest[-1] == b"data: [DONE]"


def test_sampling_params_and_salt_are_forwarded(
    server: CompletionHTTPServer, engine: CountingEngine
) -> None:
    body = {
        "model": "counting",
        "prompt": [3],
        "max_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 1234,
        "ignore_eos": True,
        "stop_token_ids": [998],
        "cache_salt": "tenant-a",
        "user": "someone",
        "n": 1,
        "presence_penalty": 0,
    }
    assert post(server, body).status_code == 200
    prompt, params, salt = engine.calls[-1]
    assert prompt == [3] and salt == "tenant-a"
    assert params == {
        "max_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 1234,
        "ignore_eos": True,
        "stop_token_ids": [998],
    }
    # vLLM spells "top_k disabled" as -1; it is not passed on.
    assert post(server, {"prompt": [3], "max_tokens": 1, "top_k": -1}).status_code == 200
    assert engine.calls[-1][1] == {"max_tokens": 1}


def test_token_text_without_token_ids_option(engine: CountingEngine) -> None:
    with CompletionHTTPServer(engine, model_name="m", port=0) as srv:
        body = post(srv, {"prompt": [1], "max_tokens": 2, "logprobs": 0}).json()
        assert body["choices"][0]["logprobs"]["tokens"] == ["<2>", "<3>"]
        # vLLM's per-request override of the server option.
        body = post(
            srv, {"prompt": [1], "max_tokens": 1, "logprobs": 0, "return_tokens_as_token_ids": True}
        ).json()
        assert body["choices"][0]["logprobs"]["tokens"] == ["token_id:2"]


def test_text_prompt_and_detokenized_output(engine: CountingEngine) -> None:
    with CompletionHTTPServer(
        engine, model_name="m", port=0, tokenizer=CharTokenizer(), detokenize=True
    ) as srv:
        body = post(srv, {"prompt": "AB", "max_tokens": 3, "logprobs": 0}).json()
        assert engine.calls[-1][0] == [65, 66]
        # Text comes from the tokenizer ("C", "D", "E"), not from TokenEvent.text.
        assert body["choices"][0]["text"] == "CDE"
        assert body["choices"][0]["logprobs"]["tokens"] == ["C", "D", "E"]
        body = post(srv, {"prompt": ["hi"], "max_tokens": 1}).json()
        assert engine.calls[-1][0] == [104, 105]


def test_tokenizer_larger_than_the_model_vocabulary(engine: CountingEngine) -> None:
    with CompletionHTTPServer(
        engine, model_name="m", port=0, tokenizer=CharTokenizer(), vocab_size=100
    ) as srv:
        assert post(srv, {"prompt": "AB", "max_tokens": 1}).status_code == 200
        r = post(srv, {"prompt": "é", "max_tokens": 1})  # code point 233 >= 100
        assert r.status_code == 400
        assert "does not match the model" in r.json()["error"]["message"]


def test_engine_generator_without_finish_reason(engine: CountingEngine) -> None:
    def quiet(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        yield TokenEvent(7, "x")  # ends early (say, an unlabelled EOS)

    with CompletionHTTPServer(quiet, model_name="m", port=0) as srv:
        body = post(srv, {"prompt": [1], "max_tokens": 5}).json()
        assert body["choices"][0]["finish_reason"] == "stop"
        events = sse_events(post(srv, {"prompt": [1], "max_tokens": 5, "stream": True}))
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, "stop"]
        # Reaching max_tokens without a label is "length".
        body = post(srv, {"prompt": [1], "max_tokens": 1}).json()
        assert body["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"max_tokens": 3}, 400, "'prompt' is required"),
        ({"prompt": []}, 400, "'prompt' is empty"),
        ({"prompt": [1, -2]}, 400, "prompt[1] must be a non-negative token id"),
        ({"prompt": [1, 2.5]}, 400, "prompt[1] must be an int token id"),
        ({"prompt": [1, True]}, 400, "prompt[1] must be an int token id"),
        ({"prompt": [VOCAB]}, 400, "outside the vocabulary [0, 1000)"),
        ({"prompt": [[1]] * 65}, 400, "holds 65 prompts; at most 64"),
        ({"prompt": 5}, 400, "'prompt' must be a string, a list of token ids"),
        ({"prompt": "hello"}, 400, "no tokenizer; send a list of token ids"),
        ({"prompt": [1], "max_tokens": 0}, 400, "'max_tokens' must be an int >= 1, got 0"),
        ({"prompt": [1], "max_tokens": "5"}, 400, "'max_tokens' must be an int >= 1, got '5'"),
        ({"prompt": [1], "temperature": "hot"}, 400, "'temperature' must be a finite number"),
        (
            {"prompt": [1], "temperature": -1},
            400,
            "'temperature' must be a finite number >= 0, got -1",
        ),
        ({"prompt": [1], "top_p": 0}, 400, "'top_p' must be a finite number in (0, 1], got 0"),
        ({"prompt": [1], "top_k": -5}, 400, "'top_k' must be an int >= -1, got -5"),
        (
            {"prompt": [1], "seed": 2**64},
            400,
            "'seed' must be an int in [-9223372036854775808, 18446744073709551615]",
        ),
        ({"prompt": [1], "ignore_eos": "yes"}, 400, "'ignore_eos' must be true or false"),
        ({"prompt": [1], "stop_token_ids": 5}, 400, "'stop_token_ids' must be a list"),
        ({"prompt": [1], "stop": ["\n"]}, 400, "'stop' strings need text output"),
        ({"prompt": [1], "max_token": 5}, 400, "unknown field(s) 'max_token'"),
        ({"prompt": [1], "n": 17}, 400, "'n' must be at most 16"),
        ({"prompt": [1], "echo": True}, 400, "'echo' needs text output"),
        ({"prompt": [1], "logprobs": 21}, 400, "'logprobs' must be an int in [0, 20] or null"),
        ({"prompt": [1], "cache_salt": 3}, 400, "'cache_salt' must be a string"),
        ({"prompt": [1], "stream_options": {"include_usage": True}}, 400, "only allowed with"),
        ({"prompt": [1], "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
        ([1, 2, 3], 400, "must be a JSON object"),
    ],
)
def test_bad_requests_get_clear_errors(
    server: CompletionHTTPServer, engine: CountingEngine, body: Any, status: int, fragment: str
) -> None:
    r = post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"], error["message"]
    assert error["code"] == status
    assert engine.calls == []


def test_invalid_json_body(server: CompletionHTTPServer) -> None:
    r = requests.post(
        server.url + "/v1/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def _raw_request(srv: CompletionHTTPServer, head: str) -> tuple[int, dict[str, Any]]:
    """Send a hand-written request head (no body) and parse the JSON error that comes back."""
    with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
        sock.sendall(head.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_body_framing_errors(server: CompletionHTTPServer) -> None:
    status, body = _raw_request(server, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 411 and "Content-Length" in body["error"]["message"]
    status, body = _raw_request(
        server, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n"
    )
    assert status == 413 and "over the limit" in body["error"]["message"]


def test_context_length_check(engine: CountingEngine) -> None:
    with CompletionHTTPServer(engine, model_name="m", port=0, max_model_len=8) as srv:
        assert post(srv, {"prompt": [1] * 4, "max_tokens": 4}).status_code == 200
        r = post(srv, {"prompt": [1] * 4, "max_tokens": 5})
        assert r.status_code == 400 and "context length 8" in r.json()["error"]["message"]
        assert (
            requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 8
        )


def test_engine_errors(engine: CountingEngine) -> None:
    def picky(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        if len(prompt) > 3:
            raise ValueError("prompt needs 4 blocks but the KV budget holds 3")
        yield TokenEvent(1, "a")
        raise RuntimeError("decode step exploded")

    with CompletionHTTPServer(picky, model_name="m", port=0) as srv:
        r = post(srv, {"prompt": [1, 2, 3, 4]})
        assert r.status_code == 400
        assert "KV budget holds 3" in r.json()["error"]["message"]
        r = post(srv, {"prompt": [1]})
        assert r.status_code == 500
        assert "RuntimeError: decode step exploded" in r.json()["error"]["message"]
        events = sse_events(post(srv, {"prompt": [1], "stream": True}))
        assert events[0]["choices"][0]["text"] == "a"
        assert "decode step exploded" in events[1]["error"]["message"]
        assert events[-1] == "[DONE]"
        # The server survives and keeps answering.
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------
# Concurrency and lifecycle
# ---------------------------------------------------------------------------------------------


def test_concurrent_requests_reach_the_engine_together() -> None:
    """Eight requests are inside the engine at once (a barrier of 8 would time out otherwise)."""
    n = 8
    barrier = threading.Barrier(n, timeout=20)

    def batching(prompt: list[int], params: Any, options: Any) -> Iterator[TokenEvent]:
        barrier.wait()
        for i in range(params.max_tokens):
            yield TokenEvent(
                prompt[0] * 10 + i, "", "length" if i == params.max_tokens - 1 else None
            )

    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    with CompletionHTTPServer(
        batching, model_name="m", port=0, return_tokens_as_token_ids=True
    ) as srv:

        def client(k: int) -> None:
            try:
                r = post(srv, {"prompt": [k], "max_tokens": 3, "stream": True, "logprobs": 0})
                events = sse_events(r)[:-1]
                results[k] = [e["choices"][0]["logprobs"]["tokens"][0] for e in events]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(1, n + 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert results == {k: [f"token_id:{k * 10 + i}" for i in range(3)] for k in range(1, n + 1)}


def test_client_disconnect_closes_the_engine_stream() -> None:
    closed = threading.Event()
    produced = []

    def endless(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        try:
            for i in range(10_000):
                produced.append(i)
                yield TokenEvent(i, "x" * 1000)
                time.sleep(0.01)
        finally:
            closed.set()

    with CompletionHTTPServer(endless, model_name="m", port=0) as srv:
        r = post(srv, {"prompt": [1], "max_tokens": 10_000, "stream": True}, stream=True)
        next(r.iter_lines())
        r.close()
        assert closed.wait(20), "the engine generator was not closed after the client left"
        assert len(produced) < 10_000


def test_stop_ends_streams_and_frees_the_port(engine: CountingEngine) -> None:
    srv = CompletionHTTPServer(engine, model_name="m", port=0).start()
    url = srv.url
    assert requests.get(url + "/health", timeout=10).status_code == 200
    srv.stop()
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(url + "/health", timeout=5)


def test_keep_alive_connection_serves_several_requests(server: CompletionHTTPServer) -> None:
    with requests.Session() as session:
        for k in range(3):
            r = session.post(
                server.url + "/v1/completions",
                json={"prompt": [k], "max_tokens": 2, "stream": bool(k % 2)},
                timeout=10,
            )
            assert r.status_code == 200
        r = session.post(server.url + "/v1/completions", json={"prompt": []}, timeout=10)
        assert r.status_code == 400
        assert session.get(server.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------


def test_server_rejects_bad_configuration(engine: CountingEngine) -> None:
    with pytest.raises(ValueError, match="model_name"):
        CompletionHTTPServer(engine, model_name="", port=0)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        CompletionHTTPServer(engine, model_name="m", port=0, detokenize=True)


# ---------------------------------------------------------------------------------------------
# Chat completions, and the official openai client on both routes
# ---------------------------------------------------------------------------------------------


class ChatTokenizer(CharTokenizer):
    """Characters as tokens; the template writes ``<role>content|`` per message."""

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@pytest.fixture
def chat_server(engine: CountingEngine) -> Iterator[CompletionHTTPServer]:
    with CompletionHTTPServer(
        engine,
        model_name="counting",
        tokenizer=ChatTokenizer(),
        detokenize=False,  # the engine's text ("<63>"), to see what the server forwards
        port=0,
        return_tokens_as_token_ids=True,
        vocab_size=VOCAB,
        max_model_len=100,
    ) as srv:
        yield srv


QUESTION = [{"role": "user", "content": "hi"}]
PROMPT = ChatTokenizer().encode("<user>hi|<assistant>")  # last token '>' = 62: replies 63, 64, ...


def test_chat_over_http(chat_server: CompletionHTTPServer, engine: CountingEngine) -> None:
    body = {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "cache_salt": "s"}
    r = requests.post(chat_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["object"] == "chat.completion" and reply["model"] == "counting"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "<63><64><65>"}
    assert reply["choices"][0]["finish_reason"] == "length"
    assert engine.calls == [(PROMPT, {"max_tokens": 3, "temperature": 0.0}, "s")]
    # default max_tokens: the rest of the context (max_model_len 100)
    r = requests.post(
        chat_server.url + "/v1/chat/completions", json={"messages": QUESTION}, timeout=30
    )
    assert engine.calls[-1][1] == {"max_tokens": 100 - len(PROMPT)}
    assert r.json()["usage"]["total_tokens"] <= 100


def test_chat_errors_over_http(
    chat_server: CompletionHTTPServer, server: CompletionHTTPServer
) -> None:
    r = requests.post(chat_server.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # a server without a chat template says where to go instead
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": QUESTION}, timeout=30)
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]


def test_openai_client_completions(server: CompletionHTTPServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["counting"]
    reply = client.completions.create(
        model="counting", prompt=[5, 6, 7], max_tokens=3, temperature=0, logprobs=0
    )
    (choice,) = reply.choices
    assert choice.text == "<8><9><10>" and choice.finish_reason == "length"
    assert choice.logprobs.tokens == ["token_id:8", "token_id:9", "token_id:10"]
    assert reply.usage.prompt_tokens == 3 and reply.usage.completion_tokens == 3
    stream = client.completions.create(
        model="counting", prompt=[997], max_tokens=5, logprobs=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    tokens = [c.choices[0].logprobs.tokens[0] for c in chunks if c.choices]
    assert tokens == ["token_id:998", "token_id:999"]  # 999 is EOS
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "stop"]
    assert chunks[-1].usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="max_token"):
        client.completions.create(model="counting", prompt=[1], extra_body={"max_token": 3})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=[1])


def test_openai_client_chat(chat_server: CompletionHTTPServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="counting", messages=QUESTION, max_tokens=3, temperature=0, logprobs=True
    )
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == "<63><64><65>"
    assert [t.token for t in choice.logprobs.content] == [
        "token_id:63",
        "token_id:64",
        "token_id:65",
    ]
    assert reply.usage.prompt_tokens == len(PROMPT)
    stream = client.chat.completions.create(
        model="counting", messages=QUESTION, max_completion_tokens=2, stream=True, logprobs=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    deltas = [(c.choices[0].delta.role, c.choices[0].delta.content) for c in chunks if c.choices]
    assert deltas == [("assistant", ""), (None, "<63>"), (None, "<64>")]
    tokens = [
        c.choices[0].logprobs.content[0].token
        for c in chunks
        if c.choices and c.choices[0].logprobs
    ]
    assert tokens == ["token_id:63", "token_id:64"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model="counting",
            messages=QUESTION,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )


# ---------------------------------------------------------------------------------------------
# Clients that go away: one log line, no traceback
# ---------------------------------------------------------------------------------------------


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_disconnects_are_one_log_line(
    server: CompletionHTTPServer,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.INFO, logger="kvdrop_engine.http")
    # reset while the server reads the body
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    time.sleep(0.2)
    _reset(sock)
    # reset in the middle of a stream
    sock = socket.create_connection((server.host, server.port))
    data = json.dumps({"prompt": [1], "max_tokens": 20_000, "stream": True, "ignore_eos": True})
    head = f"POST /v1/completions HTTP/1.1\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data.encode())
    sock.recv(100)
    _reset(sock)
    deadline = time.monotonic() + 10
    while len([r for r in caplog.records if "disconnected" in r.getMessage()]) < 2:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in lines)
    assert all("\n" not in r.getMessage() for r in lines)
    assert any("request cancelled" in r.getMessage() for r in lines)
    assert "Traceback" not in capsys.readouterr().err
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_keep_alive_closed_between_requests_is_not_a_disconnect(
    server: CompletionHTTPServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A pooled client dropping its idle connection (RST) after a full answer logs nothing."""
    caplog.set_level(logging.INFO, logger="kvdrop_engine.http")
    sock = socket.create_connection((server.host, server.port))
    data = json.dumps({"prompt": [1, 2], "max_tokens": 2})
    head = f"POST /v1/completions HTTP/1.1\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data.encode())
    reply = b""
    while b'"usage"' not in reply:
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    _reset(sock)
    # the server noticed the reset (its next read failed) and is still healthy
    time.sleep(0.5)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert not [r for r in caplog.records if "disconnected" in r.getMessage()], caplog.text
