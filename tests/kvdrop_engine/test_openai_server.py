"""vLLM parity of ``kvdrop engine``'s OpenAI server, with the official ``openai`` client against
the real engine (tiny random model, a byte-level tokenizer with special tokens) served on
127.0.0.1: logprob values, ``n`` choices, ``stop`` strings, ``skip_special_tokens``,
``/metrics``, ``/tokenize`` and ``/detokenize``, one log line per request, and the bounds of
issue 20 (tiny temperatures, chat size, stop lists)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kvdrop_engine.engine import Engine
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.loading import preset_config
from kvdrop_engine.metrics import engine_load
from kvdrop_engine.model import Transformer
from kvdrop_engine.tokenizer import JSONTokenizer
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.testing.server import wait_until

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(120)

SPECIAL = ["<|endoftext|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_tokenizer(folder: Path) -> JSONTokenizer:
    """A byte-level tokenizer of 256 byte tokens plus two special tokens (ids 256, 257)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return JSONTokenizer(folder / "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> JSONTokenizer:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def engine(tokenizer: JSONTokenizer) -> Iterator[Engine]:
    config = dataclasses.replace(preset_config("tiny"), vocab_size=258, eos_token_ids=(257,))
    with Engine(Transformer.random(config, seed=0), tokenizer=tokenizer) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: Engine, tokenizer: JSONTokenizer) -> Iterator[CompletionHTTPServer]:
    with CompletionHTTPServer(
        engine.post_completion,
        model_name="tiny",
        tokenizer=tokenizer,
        vocab_size=258,
        max_model_len=4096,
        gauges=lambda: engine_load(engine),
        port=0,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: CompletionHTTPServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


PROMPT = "The pass key is 1234. Remember it."


def greedy_text(client: Any, max_tokens: int = 12) -> str:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return reply.choices[0].text


def test_completion_logprobs_are_values_with_top_alternatives(client: Any) -> None:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # greedy: the sampled token is the most likely of the 3 alternatives
        assert len(top) == 3 and top[token] == value == pytest.approx(max(top.values()))


def test_chat_logprobs_list_top_logprobs(client: Any) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())


def test_n_choices_differ_by_seed_and_stream_by_index(client: Any) -> None:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(reply.choices, key=lambda c: c.index)] == [0, 1]
    assert texts[0] != texts[1]
    assert reply.usage.completion_tokens == 16
    again = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = {0: "", 1: ""}
    finished = {}
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert [streamed[0], streamed[1]] == texts and finished == {0: "length", 1: "length"}


def test_stop_strings_cut_the_text_streaming_or_not(client: Any) -> None:
    full = greedy_text(client)
    stop = full[5:7]
    want = full[: full.find(stop)]
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "never-seen"],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    (choice,) = reply.choices
    assert (choice.text, choice.finish_reason) == (want, "stop")
    assert choice.model_extra["stop_reason"] == stop
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"


class SpecialEngine:
    """Replies "hi", a special token, "!", then EOS (the tokenizer's ids)."""

    def __init__(self, tokenizer: JSONTokenizer) -> None:
        self.ids = [*tokenizer.encode("hi"), 256, *tokenizer.encode("!"), 257]

    def __call__(
        self, prompt: list[int], params: dict[str, Any], salt: str
    ) -> Iterator[TokenEvent]:
        for i, tok in enumerate(self.ids):
            yield TokenEvent(tok, "", "stop" if i == len(self.ids) - 1 else None)


def test_skip_special_tokens_by_default(tokenizer: JSONTokenizer) -> None:
    with CompletionHTTPServer(
        SpecialEngine(tokenizer), model_name="m", tokenizer=tokenizer, port=0
    ) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model="m", prompt="x", max_tokens=10)
        kept = client.completions.create(
            model="m", prompt="x", max_tokens=10, extra_body={"skip_special_tokens": False}
        )
        chat = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=10
        )
    assert plain.choices[0].text == "hi!" and plain.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == "hi<|endoftext|>!"  # the EOS that stopped it: never text
    assert chat.choices[0].message.content == "hi!"


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^kvdrop:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"kvdrop:{name} missing from:\n{text}"
    return float(match.group(1))


def test_metrics_in_prometheus_text(server: CompletionHTTPServer, engine: Engine) -> None:
    before = requests.get(server.url + "/metrics", timeout=30)
    assert before.status_code == 200 and before.headers["Content-Type"].startswith("text/plain")
    generated = _metric(before.text, "generation_tokens_total")
    requests.post(
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=60,
    ).raise_for_status()
    text = requests.get(server.url + "/metrics", timeout=30).text
    assert _metric(text, "generation_tokens_total") == generated + 5
    assert _metric(text, "prompt_tokens_total") >= len(PROMPT)
    assert _metric(text, "kv_blocks_total") == engine.num_blocks
    assert _metric(text, "num_requests_running") == 0 == _metric(text, "num_requests_waiting")
    assert _metric(text, "generation_tokens_per_second") > 0
    assert "# TYPE kvdrop:prompt_tokens_total counter" in text
    assert 'finished_reason="length"' in text


def test_tokenize_and_detokenize_as_vllm(
    server: CompletionHTTPServer, tokenizer: JSONTokenizer
) -> None:
    r = requests.post(
        server.url + "/tokenize", json={"model": "tiny", "prompt": "hello"}, timeout=30
    )
    assert r.json() == {
        "count": 5, "max_model_len": 4096, "tokens": tokenizer.encode("hello"), "token_strs": None
    }  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    r = requests.post(server.url + "/tokenize", json={"messages": messages}, timeout=30)
    assert r.json()["tokens"] == tokenizer.apply_chat_template(messages)
    r = requests.post(
        server.url + "/detokenize", json={"tokens": tokenizer.encode("hello")}, timeout=30
    )
    assert r.json() == {"prompt": "hello"}
    r = requests.post(server.url + "/detokenize", json={"tokens": [9999]}, timeout=30)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_one_log_line_per_request(
    server: CompletionHTTPServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvdrop_engine.http"):
        requests.post(
            server.url + "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=60,
        ).raise_for_status()
        requests.get(server.url + "/health", timeout=30)

        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "kvdrop_engine.http"]

        # A request's line is written once its handler returns, which may be just after the
        # client has its reply: wait for both (bounded), in either order.
        wait_until(lambda: len(lines()) >= 2, timeout=30)
    got = lines()
    assert len(got) == 2, got
    post = '"POST /v1/completions" 200 prompt_tokens=3 completion_tokens=4'
    health = '"GET /health" 200 prompt_tokens=0 completion_tokens=0'
    assert sum(post in line for line in got) == 1 and sum(health in line for line in got) == 1


def test_a_tiny_temperature_is_served_not_a_crash(client: Any) -> None:
    # Served at vLLM's floor (0.01), not a crash. A random tiny model's logits are close, so
    # 0.01 is not greedy here: check that the request is served, and seeded sampling repeats.
    replies = [
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=1e-39, seed=3,
            extra_body={"ignore_eos": True},
        )
        for _ in range(2)
    ]  # fmt: skip
    assert [r.usage.completion_tokens for r in replies] == [4, 4]
    assert replies[0].choices[0].text == replies[1].choices[0].text


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"messages": [{"role": "u" * 4_000_000, "content": "x"}]}, 400,
         "'role' is 4000000 characters"),
        # Bodies of many containers or values are refused before json.loads builds them.
        ({"messages": [{"role": "user", "content": ""}] * 150_000}, 413,
         "150002 objects and arrays, over the limit"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 5000}]}, 400,
         "content parts"),
        ({"prompt": "x", "stop_token_ids": [0] * 1_100_000}, 413,  # 3.3 MB: under the 8 MiB body
         "values, over the limit"),
        ({"prompt": "x", "stop_token_ids": list(range(2_000))}, 400, "at most 1024"),
        ({"prompt": "x", "stop": ["a"] * 65}, 400, "at most 64 strings"),
    ],
)  # fmt: skip
def test_oversized_requests_are_refused_and_health_stays_up(
    server: CompletionHTTPServer, body: dict[str, Any], status: int, fragment: str
) -> None:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = requests.post(server.url + route, json=body, timeout=60)
    assert r.status_code == status and fragment in r.json()["error"]["message"], r.text
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
