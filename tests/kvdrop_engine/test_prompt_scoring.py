"""Prompt scoring (``prompt_logprobs``) bounded (issue 33 C): computed in slices of at most
``SCORE_ROWS_PER_STEP`` rows, each reduced as it comes (never ``[T, V]`` rows at once), stopped
when its caller leaves, and an answer whose log-probabilities could pass ``MAX_LOGPROB_BYTES``
refused with a 400 before
anything runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
import torch

from kvdrop_engine.cli import prompt_scorer
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import EngineError
from kvdrop_engine.http import MAX_LOGPROB_BYTES, CompletionHTTPServer
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
    assert f"at most {MAX_LOGPROB_BYTES:,} bytes are answered" in error["message"]
    assert "1,348,032 log-probabilities" in error["message"]
    assert error["param"] == "prompt_logprobs"
    small = {"prompt": prompt_of(50), "max_tokens": 2, "prompt_logprobs": 2}
    ok = requests.post(server.url + "/v1/completions", json=small, timeout=60)
    assert ok.status_code == 200, ok.text[:300]
    lists = ok.json()["choices"][0]["prompt_logprobs"]
    assert lists[0] is None and len(lists) == 50


class LongTokens:
    """Each token's text is 400 characters (as a tokenizer with long whitespace runs has)."""

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 500 for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"{t:03d}" + "\u2003" * 397 for t in token_ids)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:  # type: ignore[type-arg]
        return self.encode("".join(f"<{m['role']}>{m['content']}|" for m in messages))


def test_the_bound_counts_bytes_not_entries(model: Transformer) -> None:
    """Issue 33 C: the bound counted entries, so long token texts passed it. 2 x 1,000 ids with
    prompt_logprobs 20 (41,958 entries, within the old 262,144) would answer tens of MB of
    escaped text: a 400 now; a smaller ask is answered within the bound it was checked by."""
    with Engine(model, num_blocks=512) as engine:
        with CompletionHTTPServer(
            engine.post_completion,
            model_name="m",
            tokenizer=LongTokens(),
            vocab_size=512,
            score_prompt=prompt_scorer(engine),
            port=0,
        ) as srv:
            body = {"prompt": [prompt_of(1000, s) for s in range(2)], "max_tokens": 1}
            r = requests.post(srv.url + "/v1/completions", json=body | {"prompt_logprobs": 20},
                              timeout=120)  # fmt: skip
            assert r.status_code == 400, r.text[:300]
            assert "bytes are answered" in r.json()["error"]["message"]
            for route, extra in [
                ("/v1/completions", {"prompt": prompt_of(300), "prompt_logprobs": 3}),
                ("/v1/completions", {"prompt": prompt_of(300), "echo": True, "logprobs": 3}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ]:
                ask = {"max_tokens": 8, "logprobs": 3, **extra}
                if route.endswith("chat/completions"):
                    ask |= {"logprobs": True, "top_logprobs": 3}
                ok = requests.post(srv.url + route, json=ask, timeout=120)
                assert ok.status_code == 200, ok.text[:300]
                entries = _entries(ok.json())
                bound = srv.logprob_bytes(False, route.endswith("chat/completions"))
                assert len(ok.content) <= entries * bound, (route, len(ok.content), entries)


def _entries(body: dict) -> int:  # type: ignore[type-arg]
    """Log-probabilities an answer lists (prompt and sampled, alternatives included)."""
    (choice,) = body["choices"]
    n = sum(len(e) for e in choice.get("prompt_logprobs") or [] if e)
    lp = choice.get("logprobs") or {}
    if "content" in lp:  # chat
        return n + sum(1 + len(c["top_logprobs"]) for c in lp["content"])
    return n + sum(len(t) for t in lp.get("top_logprobs") or [] if t)
