"""make_post_completion against a real OpenAI-compatible server (ours) on a free port."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_sdk.adapters.openai import (
    CompletionHTTPError,
    HTTPPostCompletion,
    MissingTokenIdsError,
    make_post_completion,
)
from kvdrop_sdk.errors import RequestStreamError, SDKError
from kvdrop_sdk.events import TokenEvent

pytestmark = pytest.mark.timeout(60)


class ScriptedEngine:
    """Reply = a fixed function of the prompt, salt and seed, so runs can be compared exactly."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], dict[str, Any], str]] = []
        self.lock = threading.Lock()

    def __call__(
        self, prompt_token_ids: list[int], sampling_params: Any, cache_salt: Any
    ) -> Iterator[TokenEvent]:
        """Called directly (a dict and a salt) or by the server (``SamplingParams`` and
        ``RequestOptions``: recorded as the values that are not the default, and the salt)."""
        if not isinstance(sampling_params, dict):
            sampling_params, cache_salt = sampling_params.changed(), cache_salt.cache_salt
        with self.lock:
            self.calls.append((list(prompt_token_ids), dict(sampling_params), cache_salt))
        return self._gen(list(prompt_token_ids), dict(sampling_params), cache_salt)

    @staticmethod
    def _gen(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        base = sum(prompt) * 31 + len(salt) * 7 + int(params.get("seed", 0))
        n = params["max_tokens"]
        for i in range(n):
            tok = (base + i * 13) % 50_000
            yield TokenEvent(tok, f"t{tok} ", "length" if i == n - 1 else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def server(engine: ScriptedEngine) -> Iterator[CompletionHTTPServer]:
    with CompletionHTTPServer(
        engine, model_name="scripted", port=0, return_tokens_as_token_ids=True
    ) as srv:
        yield srv


def test_tokens_equal_the_engine_called_directly(
    server: CompletionHTTPServer, engine: ScriptedEngine
) -> None:
    post = make_post_completion(server.url, "scripted", timeout=30)
    prompt = list(range(100, 140))
    params = {"max_tokens": 6, "temperature": 0.0, "seed": 3}
    got = list(post(prompt, params, "salt"))
    want = list(engine(prompt, params, "salt"))
    assert [e.token_id for e in got] == [e.token_id for e in want]
    assert [e.text for e in got] == [e.text for e in want]
    assert [e.finish_reason for e in got] == [None] * 5 + ["length"]
    times = [e.time for e in got]
    assert times == sorted(times)
    # What reached the engine: the sampling params unchanged (plus the adapter's "logprobs": 0,
    # the token ids it reads back), the salt, the prompt ids.
    assert engine.calls[0] == (prompt, {**params, "logprobs": 0}, "salt")


def test_payload_matches_the_upstream_adapter() -> None:
    post = HTTPPostCompletion("http://127.0.0.1:1/v1/", "m")
    assert post.endpoint == "http://127.0.0.1:1/v1/completions"
    body = post.payload([1, 2], {"max_tokens": 5, "temperature": 0.5}, "")
    assert body == {
        "max_tokens": 5,
        "temperature": 0.5,
        "model": "m",
        "prompt": [1, 2],
        "stream": True,
        "logprobs": 0,
    }
    assert post.payload([1], {"stream": False, "model": "x"}, "s")["cache_salt"] == "s"
    assert post.payload([1], {"stream": False, "model": "x"}, "s")["stream"] is True


def test_empty_salt_is_not_sent(server: CompletionHTTPServer, engine: ScriptedEngine) -> None:
    post = make_post_completion(server.url + "/v1", "scripted", timeout=30)
    assert len(list(post([1, 2, 3], {"max_tokens": 1}, ""))) == 1
    assert engine.calls[-1][2] == ""


def test_prefill_style_single_token(server: CompletionHTTPServer) -> None:
    post = make_post_completion(server.url, "scripted")
    (event,) = list(post([5] * 300, {"max_tokens": 1}, ""))
    assert event.finish_reason == "length"


def test_server_without_token_ids_is_a_clear_error(engine: ScriptedEngine) -> None:
    with CompletionHTTPServer(engine, model_name="scripted", port=0) as srv:
        post = make_post_completion(srv.url, "scripted", timeout=30)
        with pytest.raises(MissingTokenIdsError, match="--return-tokens-as-token-ids") as info:
            list(post([1, 2], {"max_tokens": 3}, ""))
        assert isinstance(info.value, RequestStreamError)
        assert "instead of 'token_id:N'" in str(info.value)


def test_http_error_carries_the_server_message(server: CompletionHTTPServer) -> None:
    post = make_post_completion(server.url, "scripted", timeout=30)
    with pytest.raises(CompletionHTTPError, match=r"HTTP 400: .*unknown field\(s\) 'bogus'"):
        list(post([1], {"max_tokens": 2, "bogus": 1}, ""))
    wrong_model = make_post_completion(server.url, "other-model", timeout=30)
    with pytest.raises(CompletionHTTPError, match=r"HTTP 404: .*serves 'scripted'"):
        list(wrong_model([1], {"max_tokens": 2}, ""))


def test_nothing_listening_is_a_clear_error() -> None:
    post = make_post_completion(f"http://127.0.0.1:{free_port()}", "m", timeout=5)
    with pytest.raises(CompletionHTTPError, match=r"cannot connect .* Is the server running"):
        list(post([1], {"max_tokens": 1}, ""))


def test_timeout_is_a_clear_error() -> None:
    def sleepy(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        time.sleep(3)
        yield TokenEvent(1, "", "stop")

    with CompletionHTTPServer(
        sleepy, model_name="m", port=0, return_tokens_as_token_ids=True
    ) as srv:
        post = make_post_completion(srv.url, "m", timeout=0.5)
        with pytest.raises(CompletionHTTPError, match="raise timeout="):
            list(post([1], {"max_tokens": 1}, ""))


def test_error_event_mid_stream(engine: ScriptedEngine) -> None:
    def failing(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        yield TokenEvent(1, "a")
        raise RuntimeError("out of KV blocks")

    with CompletionHTTPServer(
        failing, model_name="m", port=0, return_tokens_as_token_ids=True
    ) as srv:
        post = make_post_completion(srv.url, "m", timeout=30)
        received: list[TokenEvent] = []
        with pytest.raises(CompletionHTTPError, match=r"reported an error: .*out of KV blocks"):
            for event in post([1], {"max_tokens": 4}, ""):
                received.append(event)
        assert [e.token_id for e in received] == [1]


def test_concurrent_calls_get_their_own_tokens(
    server: CompletionHTTPServer, engine: ScriptedEngine
) -> None:
    post = make_post_completion(server.url, "scripted", timeout=30)
    prompts = {k: list(range(k, k + 20)) for k in range(12)}
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = [e.token_id for e in post(prompts[k], {"max_tokens": 5}, f"s{k % 3}")]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for k, prompt in prompts.items():
        want = [e.token_id for e in engine._gen(prompt, {"max_tokens": 5}, f"s{k % 3}")]
        assert results[k] == want


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="base_url must look like"):
        make_post_completion("localhost:8000", "m")
    with pytest.raises(ValueError, match="model must be"):
        make_post_completion("http://127.0.0.1:8000", "")
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        make_post_completion("http://127.0.0.1:8000", "m", timeout=0)
    assert issubclass(CompletionHTTPError, SDKError)


# ---------------------------------------------------------------------------------------------
# vLLM-shaped streams our own server never sends (vLLM cannot run here, so a stub replays its
# documented chunk shapes): several tokens in one chunk (speculative decoding), a finish-only
# chunk, a usage-only chunk, and a stream that breaks before [DONE].
# ---------------------------------------------------------------------------------------------


def _stub(lines: list[str]) -> ThreadingHTTPServer:
    body = "".join(f"{line}\n\n" for line in lines).encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(body)  # HTTP/1.0: the body ends when the connection closes

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _chunk(text: str, tokens: list[str] | None, finish: str | None) -> str:
    lp = None if tokens is None else {"tokens": tokens, "token_logprobs": [None] * len(tokens)}
    choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
    return "data: " + json.dumps({"id": "cmpl-1", "choices": [choice]})


def test_vllm_shaped_stream() -> None:
    httpd = _stub(
        [
            ": keep-alive comment",
            _chunk("Hel", ["token_id:10"], None),
            _chunk("lo wo", ["token_id:11", "token_id:12"], None),
            _chunk("", ["token_id:13"], None),  # a partial UTF-8 character: no text yet
            _chunk("rld", ["token_id:14"], "stop"),
            _chunk("", None, "stop"),
            'data: {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 5}}',
            "data: [DONE]",
        ]
    )
    try:
        post = make_post_completion(f"http://127.0.0.1:{httpd.server_address[1]}", "m")
        events = list(post([1], {"max_tokens": 8}, ""))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [e.token_id for e in events] == [10, 11, 12, 13, 14]
    assert "".join(e.text for e in events) == "Hello world"
    assert [e.finish_reason for e in events] == [None, None, None, None, "stop"]


def test_stream_cut_before_done() -> None:
    httpd = _stub([_chunk("a", ["token_id:1"], None)])
    try:
        post = make_post_completion(f"http://127.0.0.1:{httpd.server_address[1]}", "m")
        got: list[int] = []
        with pytest.raises(CompletionHTTPError, match=r"ended before 'data: \[DONE\]'"):
            for event in post([1], {"max_tokens": 8}, ""):
                got.append(event.token_id)
        assert got == [1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_non_json_event() -> None:
    httpd = _stub(["data: <html>oops</html>"])
    try:
        post = make_post_completion(f"http://127.0.0.1:{httpd.server_address[1]}", "m")
        with pytest.raises(CompletionHTTPError, match="not JSON"):
            list(post([1], {"max_tokens": 8}, ""))
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---------------------------------------------------------------------------------------------
# The reference engine behind the HTTP server: the adapter gives exactly the in-process tokens.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[Any]:
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.loading import preset_config
    from kvdrop_engine.model import Transformer

    model = Transformer.random(preset_config("tiny"), seed=0)
    with Engine(model, kv_budget_tokens=1024, block_size=16, max_prefill_tokens=128) as eng:
        yield eng


@pytest.fixture
def engine_server(tiny_engine: Any) -> Iterator[CompletionHTTPServer]:
    cfg = tiny_engine.config
    with CompletionHTTPServer(
        tiny_engine.post_completion,
        model_name="tiny",
        port=0,
        return_tokens_as_token_ids=True,
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
    ) as srv:
        yield srv


def _prompt(k: int, n: int) -> list[int]:
    return [(k * 97 + i * 31) % 500 + 3 for i in range(n)]


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7},
    ],
    ids=["greedy", "seeded-sampling"],
)
def test_reference_engine_tokens_equal_direct_call(
    tiny_engine: Any, engine_server: CompletionHTTPServer, params: dict[str, Any]
) -> None:
    post = make_post_completion(engine_server.url, "tiny", timeout=60)
    for k, n in ((0, 5), (1, 70), (2, 300)):
        prompt = _prompt(k, n)
        direct = list(tiny_engine.post_completion(prompt, params, ""))
        over_http = list(post(prompt, params, ""))
        assert [e.token_id for e in over_http] == [e.token_id for e in direct]
        assert [e.finish_reason for e in over_http] == [e.finish_reason for e in direct]


def test_reference_engine_concurrent_http_requests(
    tiny_engine: Any, engine_server: CompletionHTTPServer
) -> None:
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    prompts = [_prompt(k, 20 + 15 * k) for k in range(8)]
    want = [tiny_engine.generate(p, params) for p in prompts]
    post = make_post_completion(engine_server.url, "tiny", timeout=60)
    got: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        try:
            barrier.wait(20)
            got[i] = [e.token_id for e in post(prompts[i], params, "")]
        except BaseException as exc:
            errors.append(exc)

    tiny_engine.reset_stats()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == want
    assert tiny_engine.stats().peak_running >= 2  # the HTTP requests were batched together


def test_reference_engine_rejections_reach_the_client(engine_server: CompletionHTTPServer) -> None:
    post = make_post_completion(engine_server.url, "tiny", timeout=60)
    # 1000 prompt + 100 new tokens need 69 blocks; the engine has 64 (1024 tokens).
    with pytest.raises(CompletionHTTPError, match=r"HTTP 400: .*KV budget"):
        list(post(_prompt(0, 1000), {"max_tokens": 100}, ""))
    with pytest.raises(CompletionHTTPError, match=r"HTTP 400: .*outside the vocabulary"):
        list(post([600], {"max_tokens": 1}, ""))
