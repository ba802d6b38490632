"""Prompt scoring (``prompt_logprobs``) bounded (issue 33 C): computed in slices of at most
``SCORE_ROWS_PER_STEP`` rows, each reduced as it comes (never ``[T, V]`` rows at once), stopped
when its caller leaves, and an answer over ``MAX_LOGPROB_ENTRIES`` refused with a 400 before
anything runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
import torch

from kvdrop_engine.cli import prompt_scorer
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import EngineError
from kvdrop_engine.http import MAX_LOGPROB_ENTRIES, CompletionHTTPServer
from kvdrop_engine.loading import preset_config
from kvdrop_engine.logprobs import continuation_logprobs
from kvdrop_engine.model import Transformer
from kvdrop_engine.sampling import prompt_scores
from kvdrop_engine.scheduler import SCORE_ROWS_PER_STEP

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def prompt_of(n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=gen).tolist()


def test_scores_come_in_bounded_reduced_slices_and_equal_the_whole_rows(
    model: Transformer,
) -> None:
    """A 1,000-token prompt: the same scores as from its whole ``[T, V]`` rows, but no step
    scored more than ``SCORE_ROWS_PER_STEP`` rows and the request kept only reduced slices."""
    prompt = prompt_of(1000)
    with Engine(model, num_blocks=256) as engine:
        whole = continuation_logprobs(engine, [(prompt[:1], prompt[1:])])[0]
        want = prompt_scores(whole, prompt[1:], 5)
        steps: list[int] = []
        original = engine.runner.forward

        def spy(plan):  # type: ignore[no-untyped-def]
            steps.append(len(plan.score_rows))
            return original(plan)

        engine.runner.forward = spy  # type: ignore[method-assign]
        handle = engine.post_prompt_scoring(prompt, 5)
        got = handle.result()
        assert handle.req is not None
        parts = handle.req.score_parts
    assert max(steps) <= SCORE_ROWS_PER_STEP and sum(steps) == 999
    assert all(isinstance(p, tuple) and p[2].shape[1] == 5 for p in parts)  # reduced slices
    assert [(t, r) for t, (_, r), _ in got] == [(t, r) for t, (_, r), _ in want]
    for (_, (a, _), alts_a), (_, (b, _), alts_b) in zip(got, want, strict=True):
        assert abs(a - b) < 1e-5
        assert [t for t, _ in alts_a] == [t for t, _ in alts_b]


def test_scoring_stops_when_its_caller_leaves(model: Transformer) -> None:
    """16 prompts of 1,000 tokens: once the first is scored the others are closed (a client
    that left); they stop (all 15,984 rows were scored before) and their blocks come back."""
    with Engine(model, num_blocks=2048) as engine:
        handles = [engine.post_prompt_scoring(prompt_of(1000, s), 0) for s in range(16)]
        assert len(handles[0].result()) == 999
        for h in handles[1:]:
            h.close()
        for h in handles[1:]:
            with pytest.raises(EngineError, match="cancelled"):
                h.result()
        assert engine.generate([5, 6], {"max_tokens": 2}) is not None  # the loop turned
        computed = engine.stats().prefill_tokens_computed
        assert engine.num_free_blocks == engine.num_blocks
    assert computed < 4 * 999, f"{computed} of {16 * 999} prompt rows scored after leaving"


@pytest.fixture(scope="module")
def server(model: Transformer) -> Iterator[CompletionHTTPServer]:
    with Engine(model, num_blocks=512) as engine:
        with CompletionHTTPServer(
            engine.post_completion,
            model_name="m",
            vocab_size=512,
            score_prompt=prompt_scorer(engine),
            port=0,
        ) as srv:
            yield srv


def test_an_answer_over_the_logprob_bound_is_a_400_before_anything_runs(
    server: CompletionHTTPServer,
) -> None:
    """64 prompts x 1,000 ids with prompt_logprobs 20 and logprobs 20 was a 97.2 MB answer."""
    body = {
        "prompt": [prompt_of(1000, s) for s in range(64)],
        "max_tokens": 4,
        "prompt_logprobs": 20,
        "logprobs": 20,
    }
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert f"at most {MAX_LOGPROB_ENTRIES:,} are answered" in error["message"]
    assert "1,348,032" in error["message"] and error["param"] == "prompt_logprobs"
    small = {"prompt": prompt_of(50), "max_tokens": 2, "prompt_logprobs": 2}
    ok = requests.post(server.url + "/v1/completions", json=small, timeout=60)
    assert ok.status_code == 200, ok.text[:300]
    lists = ok.json()["choices"][0]["prompt_logprobs"]
    assert lists[0] is None and len(lists) == 50
