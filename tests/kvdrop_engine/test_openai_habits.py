"""vLLM habits, round two (issue 27 item 3), with the official ``openai`` client against the real
engine (tiny random model, a byte-level tokenizer) on 127.0.0.1: neutral values of every field,
``logit_bias``, ``min_tokens``, penalties, ``min_p``, ``echo``, batched prompts,
``prompt_logprobs``, ``/tokenize``'s ``return_token_strs``, ``/version``, ``/ping``, an API key,
and ``/metrics`` in vLLM's names with histogram buckets."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from kvdrop_engine.engine import Engine
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.loading import preset_config
from kvdrop_engine.metrics import engine_load
from kvdrop_engine.model import DenseAttention, Transformer
from kvdrop_engine.tokenizer import JSONTokenizer

openai = pytest.importorskip("openai")
prometheus = pytest.importorskip("prometheus_client.parser")
pytestmark = pytest.mark.timeout(180)

EOS = 257
PROMPT = "The pass key is 1234."


def _tokenizer(folder: Path) -> JSONTokenizer:
    """256 byte tokens and two special ones (256, 257 = EOS)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|x|>", "<|end|>")])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{% if greeting %}{{ greeting }}{% endif %}{% if tools %}[{{ tools | length }} tools]"
        "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    config = {"eos_token": "<|end|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return JSONTokenizer(folder / "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> JSONTokenizer:
    return _tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model() -> Transformer:
    config = dataclasses.replace(preset_config("tiny"), vocab_size=258, eos_token_ids=(EOS,))
    return Transformer.random(config, seed=0)


@pytest.fixture(scope="module")
def server(engine: Engine, tokenizer: JSONTokenizer) -> Iterator[CompletionHTTPServer]:
    from kvdrop_engine.cli import prompt_scorer

    with CompletionHTTPServer(
        engine.post_completion,
        model_name="tiny",
        tokenizer=tokenizer,
        vocab_size=258,
        max_model_len=1024,
        gauges=lambda: engine_load(engine),
        score_prompt=prompt_scorer(engine),
        port=0,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(model: Transformer, tokenizer: JSONTokenizer) -> Iterator[Engine]:
    with Engine(model, tokenizer=tokenizer) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(server: CompletionHTTPServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _complete(client: Any, **kw: Any) -> Any:
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    return client.completions.create(**{**base, **kw})


def test_neutral_values_of_every_field_are_accepted(client: Any) -> None:
    plain = _complete(client)
    neutral = _complete(
        client,
        logit_bias=None, suffix=None, presence_penalty=0.0, frequency_penalty=0.0, best_of=1,
        echo=False, user="u",
        extra_body={
            "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "top_k": 0,
            "use_beam_search": False, "length_penalty": 1.0, "logit_bias": {},
            "spaces_between_special_tokens": True, "response_format": {"type": "text"},
            "prompt_logprobs": None, "truncate_prompt_tokens": None, "priority": 0,
        },
    )  # fmt: skip
    assert neutral.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logit_bias=None, tools=None, tool_choice=None, n=1, stop=None, response_format=None,
        extra_body={"repetition_penalty": 1.0, "min_p": 0.0},
    )  # fmt: skip
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError, match="'suffix' is not supported"):
        _complete(client, suffix="tail")


def test_what_todays_client_sends_is_accepted(client: Any) -> None:
    """Issue 34: fields of openai 3.57's request types that were refused as unknown."""
    messages = [{"role": "user", "content": "hi"}]
    base = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0}
    plain = client.chat.completions.create(**base)
    sent = client.chat.completions.create(
        **base, safety_identifier="user-7", prompt_cache_key="k", verbosity=None,
        metadata={"team": "search", "run": "3"}, prompt_cache_retention="24h",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"}, store=False,
        service_tier="auto", moderation=None,
    )  # fmt: skip
    assert sent.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="'verbosity' is not supported") as err:
        client.chat.completions.create(**base, verbosity="low")
    assert err.value.body["param"] == "verbosity"


def test_models_retrieve_and_an_unknown_id_is_openais_404(client: Any) -> None:
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "kvdrop"
    assert card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist") as err:
        client.models.retrieve("gpt-4o")
    assert err.value.status_code == 404 and err.value.body["param"] == "model"
    assert set(err.value.body) == {"message", "type", "param", "code"}


def test_the_chat_template_gets_its_options(server: CompletionHTTPServer) -> None:
    """``add_generation_prompt``, ``chat_template_kwargs``, ``tools`` and
    ``continue_final_message`` reach the template (as the prompt it renders shows)."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok so"}]

    def rendered(**body: Any) -> str:
        ids = requests.post(
            server.url + "/tokenize", json={"messages": chat, **body}, timeout=30
        ).json()["tokens"]
        text = requests.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30)
        return str(text.json()["prompt"])

    assert rendered() == "<user>hi<assistant>ok so<a>"
    assert rendered(add_generation_prompt=False) == "<user>hi<assistant>ok so"
    assert rendered(chat_template_kwargs={"greeting": "Yo"}).startswith("Yo<user>")
    cont = rendered(continue_final_message=True, add_generation_prompt=False)
    assert cont == "<user>hi<assistant>ok so"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    reply = requests.post(
        server.url + "/v1/chat/completions",
        json={"messages": chat[:1], "tools": [tool], "max_tokens": 2, "temperature": 0},
        timeout=30,
    ).json()
    assert reply["usage"]["prompt_tokens"] == len("[1 tools]<user>hi<a>"), reply


def test_logit_bias_and_min_tokens_steer_the_sampler(client: Any) -> None:
    forced = _complete(client, logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "b" * 6  # byte-level id 65 is "b"
    # EOS pushed to the top: the request ends at its first token, unless min_tokens bans it.
    eos = {str(EOS): 100}
    assert _complete(client, logit_bias=eos).usage.completion_tokens == 1
    held = _complete(client, logit_bias=eos, extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        _complete(client, logit_bias={"999": 1})
    with pytest.raises(openai.BadRequestError, match=r"'min_tokens' .* at most 'max_tokens'"):
        _complete(client, extra_body={"min_tokens": 7})


def test_penalties_change_greedy_output_deterministically(client: Any) -> None:
    body = {"max_tokens": 24, "extra_body": {"ignore_eos": True}}
    plain = _complete(client, **body).choices[0].text
    penalised = [
        _complete(client, frequency_penalty=2.0, presence_penalty=2.0, **body).choices[0].text
        for _ in range(2)
    ]
    assert penalised[0] == penalised[1]
    repeats = lambda text: len(text) - len(set(text))  # noqa: E731
    assert repeats(penalised[0]) < repeats(plain), (plain, penalised[0])
    rep = _complete(client, max_tokens=24, extra_body={"ignore_eos": True,
                                                       "repetition_penalty": 100.0})  # fmt: skip
    assert repeats(rep.choices[0].text) < repeats(plain)


def test_echo_and_batched_prompts_index_choices_as_vllm(client: Any) -> None:
    echoed = _complete(client, echo=True, max_tokens=3)
    assert echoed.choices[0].text.startswith(PROMPT)
    batch = _complete(client, prompt=["ab", "xyz"], n=2, echo=True, max_tokens=2,
                      temperature=1.0, seed=1)  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text[:2] for c in batch.choices[:2]] == ["ab", "ab"]
    assert all(c.text.startswith("xyz") for c in batch.choices[2:])
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 8


def test_prompt_logprobs_are_the_models_teacher_forced_values(
    client: Any, model: Transformer, tokenizer: JSONTokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    reply = _complete(client, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    with torch.inference_mode():  # the model's own dense forward over the whole prompt
        attn = DenseAttention(model.config, capacity=len(ids))
        rows = torch.arange(len(ids) - 1)
        logits = model(torch.tensor(ids), torch.arange(len(ids)), attn, logits_rows=rows)
    want = torch.log_softmax(logits.float(), dim=-1)
    for i, entry in enumerate(scored[1:]):
        mine = entry[str(ids[i + 1])]
        assert mine["logprob"] == pytest.approx(float(want[i, ids[i + 1]]), abs=1e-4)
        assert mine["rank"] == int((want[i] > want[i, ids[i + 1]]).sum()) + 1
        assert 1 <= len(entry) <= 3
    stream = _complete(client, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 2})
    chunks = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    assert chunks[0] == scored and chunks[1:] == [None] * (len(chunks) - 1)
    echo = _complete(client, echo=True, logprobs=1, max_tokens=2)
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[1] == pytest.approx(float(want[0, ids[1]]), abs=1e-4)


def test_tokenize_strs_version_and_ping(server: CompletionHTTPServer) -> None:
    r = requests.post(
        server.url + "/tokenize", json={"prompt": "hey", "return_token_strs": True}, timeout=30
    )
    assert r.json()["token_strs"] == ["h", "e", "y"]
    version = requests.get(server.url + "/version", timeout=30).json()["version"]
    assert version and version[0].isdigit()
    assert requests.get(server.url + "/ping", timeout=30).status_code == 200
    assert requests.post(server.url + "/ping", timeout=30).status_code == 200


def test_an_api_key_is_required_when_set(model: Transformer, tokenizer: JSONTokenizer) -> None:
    with (
        Engine(model, tokenizer=tokenizer) as engine,
        CompletionHTTPServer(
            engine.post_completion, model_name="tiny", tokenizer=tokenizer, port=0,
            api_key="sekret",
        ) as srv,
    ):  # fmt: skip
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert requests.get(srv.url + "/v1/models", timeout=30).status_code == 401
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).choices


def test_metrics_have_vllm_names_and_buckets(client: Any, server: CompletionHTTPServer) -> None:
    _complete(client, max_tokens=4, extra_body={"ignore_eos": True})
    text = requests.get(server.url + "/metrics", timeout=30).text
    families = {f.name: f for f in prometheus.text_string_to_metric_families(text)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds"):  # fmt: skip
        assert families[name].type == "histogram"
        buckets = [s for s in families[name].samples if s.name == name + "_bucket"]
        assert buckets and buckets[-1].labels["le"] == "+Inf" and buckets[-1].value >= 1
    assert "vllm:time_to_first_token_seconds_bucket{" in text
    assert families["vllm:num_requests_running"].samples[0].value == 0
    assert families["vllm:num_requests_waiting"].type == "gauge"
    assert families["vllm:generation_tokens"].samples[0].value >= 4
    assert families["vllm:prompt_tokens"].samples[0].value >= len(PROMPT)
    assert "kvdrop:kv_blocks_total" in text  # kvdrop's own, beside vLLM's


def test_penalties_edit_batched_rows_like_a_per_row_reference() -> None:
    from kvdrop_engine.penalties import edit_logits
    from kvdrop_engine.sampling import SamplingParams

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen)
    rows = [
        (SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [1, 2], [3, 3, 4]),
        (SamplingParams(), [1], [1]),
        (SamplingParams(repetition_penalty=1.5, logit_bias=((7, 2.0),), min_tokens=5,
                        stop_token_ids=(9,)), [5, 6], [6, 8]),
    ]  # fmt: skip
    out = edit_logits(logits, rows, eos=[0])
    want = logits.clone()
    want[0, 3] -= 0.5 * 2 + 0.25
    want[0, 4] -= 0.5 + 0.25
    for t in (5, 6, 8):
        v = want[2, t]
        want[2, t] = v / 1.5 if v > 0 else v * 1.5
    want[2, 7] += 2.0
    want[2, 0] = want[2, 9] = float("-inf")
    torch.testing.assert_close(out, want)
    assert edit_logits(logits, [rows[1]] * 3, eos=[0]) is logits  # nothing to edit: no copy
