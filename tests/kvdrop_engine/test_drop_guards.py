"""What the engine does not trust a drop policy with (reliability round 4): the rows a policy
(or a plugin) returns are checked before any block changes, and a policy that fails at serve
time fails its own request with the policy named, while the engine keeps serving."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.registry import _reset
from kvdrop_engine.drop import PromptDropper
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import PolicyFailedError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk import CacheKind
from kvdrop_sdk.query_capture import QueryNeed

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}
#: Tokens of the prompt the dropper's start check runs a policy on (a plugin that misbehaves
#: only on other prompts passes it).
CHECK_TOKENS = 160


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def prompt_of(n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=gen).tolist()


Edit = Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, list[int]]]


def plugin(bad: Edit) -> Callable[..., Any]:
    """A plugin factory whose edit keeps the first half, except off the start check's prompt
    length, where ``bad`` answers."""

    def factory(keep_ratio: float = 0.5) -> Any:
        def edit(tensors: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
            kv = tensors[CacheKind.KV]
            if len(tokens) != CHECK_TOKENS:
                return bad(kv, tokens)
            k = len(tokens) // 2
            return kv[:, :, :k], list(tokens[:k])

        return edit

    factory.queries = QueryNeed.NONE  # type: ignore[attr-defined]
    return factory


def doubled(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    return torch.cat([kv, kv], dim=2), list(tokens) * 2


def duplicates(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    index = torch.tensor([0, 1, 1, 2])
    return kv.index_select(2, index), [tokens[i] for i in index.tolist()]


def raises(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    raise RuntimeError("plugin bug")


@pytest.fixture
def plugins() -> Iterator[None]:
    for name, bad in (("doubled", doubled), ("dupes", duplicates), ("raises", raises)):
        kvdrop.register(f"guard-{name}", plugin(bad), replace=True)
    yield
    _reset()


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("doubled", "returned 600 rows for a 300-token input"),
        ("dupes", "repeats or precedes an earlier kept row"),
        ("raises", "RuntimeError: plugin bug"),
    ],
)
def test_a_bad_policy_fails_its_request_only_and_is_named(
    model: Transformer, plugins: None, name: str, fragment: str
) -> None:
    """The bad request fails naming the policy; the blocks are all back, and the next request's
    tokens equal those of a fresh engine (no stale rows of the failed one are read)."""
    prompt, other = prompt_of(300), prompt_of(300, seed=2)
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5, client_policies="all")
    params = {"max_tokens": 6, **GREEDY}
    with Engine(model, num_blocks=64, dropper=PromptDropper(model.config, "knorm")) as fresh:
        expected = fresh.generate(other, params)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        bad = {**params, "kvdrop": {"policy": f"guard-{name}"}}
        with pytest.raises(PolicyFailedError) as err:
            list(engine.post_completion(prompt, bad))
        assert f"policy 'guard-{name}' failed on this request's 300-token prompt" in str(err.value)
        assert fragment in str(err.value)
        assert engine.generate(other, params) == expected
        assert engine.num_free_blocks == 64


# -- A: what a client's override may ask -----------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("leverage(sketch_dimension=4000)", "'sketch_dimension' got 4000; a serving client may"),
        ("expected-attention(n_future_positions=4000000)", "'n_future_positions' got 4000000"),
        ("cap(n_future_positions=400000)", "at most 8192"),
        ("chunk(policy=leverage(sketch_dimension=1500))", "at most 512"),
        ("h2o(num_queries=null)", "'num_queries' got None; a serving client may ask for at most"),
        ("+".join(["knorm"] * 3000), "characters; a client may send at most 512"),
        ("+".join(["knorm"] * 40), "builds 40 policy terms; a client may ask for at most 16"),
        ("guard-doubled", "may not be picked by this server's clients"),
    ],
)
def test_an_override_over_its_bounds_is_refused_before_it_is_built(
    model: Transformer, plugins: None, spec: str, fragment: str
) -> None:
    """Each ran on the loop (10.9 s and +455 MB for the sketch of 4000; 5.2 s for 3000 terms):
    now a 400 naming what is over, before anything is built or run."""
    from kvdrop_engine.errors import InvalidRequestError

    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        with pytest.raises(InvalidRequestError) as err:
            engine.post_completion(prompt_of(300), {"max_tokens": 2, "kvdrop": {"policy": spec}})
        assert fragment in str(err.value)
        assert len(str(err.value)) < 400  # the spec is shown cut, not whole
        assert len(dropper._built) == 1  # nothing built but the server's own
        fine = {"max_tokens": 2, **GREEDY, "kvdrop": {"policy": "leverage(sketch_dimension=512)"}}
        assert len(engine.generate(prompt_of(300), fine)) == 2  # at the bound: served


def test_the_operator_may_allow_plugins_and_its_own_policy_is_always_allowed(
    model: Transformer, plugins: None
) -> None:
    raises = {"max_tokens": 2, "kvdrop": {"policy": "guard-raises"}}
    own = PromptDropper(model.config, "guard-raises")  # its own policy: clients may name it
    assert own.may_pick("guard-raises") and own.may_pick("knorm")
    assert not own.may_pick("guard-dupes")
    listed = PromptDropper(model.config, client_policies="guard-dupes, knorm")
    assert listed.may_pick("guard-dupes") and not listed.may_pick("snapkv")
    with Engine(model, num_blocks=64, dropper=PromptDropper(model.config)) as engine:
        from kvdrop_engine.errors import InvalidRequestError

        with pytest.raises(InvalidRequestError, match="--client-policies"):
            engine.post_completion(prompt_of(300), raises)


# -- A: a slow cut runs beside the loop ------------------------------------------------------------
def blocking(release: threading.Event) -> Edit:
    def bad(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        release.wait(60)
        k = len(tokens) // 2
        return kv[:, :, :k], list(tokens[:k])

    return bad


def test_a_slow_cut_does_not_stop_the_other_streams(model: Transformer) -> None:
    """A plugin that blocks on every prompt but the start check's stalled every stream (3 s
    per cut of a sleeping one); now the loop steps the others while it runs: a second stream
    gets all its tokens before the cut is let go, then the cut request finishes. The cut
    request's own first token (from its prefill's logits) is not held by its cut either."""
    release = threading.Event()
    kvdrop.register("guard-blocks", plugin(blocking(release)), replace=True)
    try:
        dropper = PromptDropper(model.config, "guard-blocks", keep_ratio=0.5)
        params = {"max_tokens": 8, **GREEDY}
        with Engine(model, num_blocks=64, dropper=dropper) as engine:
            slow = engine.post_completion(prompt_of(300), params)
            other = engine.post_completion(prompt_of(100, seed=2), {**params, "max_tokens": 30})
            stream = iter(slow)
            first = next(stream)  # while its cut is still blocked
            assert len(list(other)) == 30  # while the cut is still blocked
            assert engine.stats().prompt_cuts == 0 and first.kept_prompt_tokens is None
            release.set()
            events = [first, *stream]
            assert len(events) == 8 and events[1].kept_prompt_tokens == 150
            assert engine.num_free_blocks == 64
    finally:
        release.set()
        _reset()


def test_a_cut_past_its_deadline_fails_its_request_only(model: Transformer) -> None:
    release = threading.Event()
    kvdrop.register("guard-hangs", plugin(blocking(release)), replace=True)
    try:
        dropper = PromptDropper(model.config, "guard-hangs", cut_timeout_s=0.5)
        with Engine(model, num_blocks=64, dropper=dropper) as engine:
            with pytest.raises(PolicyFailedError, match=r"did not finish .* within 0.5 s"):
                list(engine.post_completion(prompt_of(300), {"max_tokens": 4, **GREEDY}))
            assert engine.num_free_blocks == 64
            short = engine.generate(prompt_of(100), {"max_tokens": 4, **GREEDY})
            assert len(short) == 4  # under --min-drop-tokens: no cut, served
    finally:
        release.set()
        _reset()


# -- B: a preempted cut request keeps its answer ---------------------------------------------------
def test_a_preempted_cut_request_keeps_its_answer(model: Transformer) -> None:
    """Six 200-token prompts cut to half by knorm in a 60-block budget: requests are preempted
    after their cut. Each recomputes its whole prompt and keeps the same rows, so its greedy
    tokens and log-probabilities equal its solo run's (they diverged by 1.6e-2 to 2.3e-2 when
    the recompute prefilled the kept tokens alone)."""
    prompts = [prompt_of(200, seed) for seed in range(6)]
    params = {"max_tokens": 120, "logprobs": 0, **GREEDY}

    def run(engine: Engine, prompt: list[int]) -> list[tuple[int, float]]:
        return [(e.token_id, e.logprob) for e in engine.post_completion(prompt, params)]

    solo = []
    with Engine(model, num_blocks=64, dropper=PromptDropper(model.config, "knorm")) as engine:
        for p in prompts:
            solo.append(run(engine, p))
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5)
    with Engine(model, num_blocks=60, dropper=dropper) as engine:
        streams = [engine.post_completion(p, params) for p in prompts]
        got: list[list[tuple[int, float]]] = [[] for _ in prompts]
        readers = [
            threading.Thread(
                target=lambda i=i: got[i].extend((e.token_id, e.logprob) for e in streams[i])
            )
            for i in range(len(prompts))
        ]
        for r in readers:
            r.start()
        for r in readers:
            r.join(240)
        stats = engine.stats()
        assert engine.num_free_blocks == 60
    assert stats.preemptions >= 1 and stats.prompt_cuts == 6
    for i, (mine, alone) in enumerate(zip(got, solo, strict=True)):
        assert [t for t, _ in mine] == [t for t, _ in alone], f"request {i}: other tokens"
        worst = max(abs(a - b) for (_, a), (_, b) in zip(mine, alone, strict=True))
        assert worst <= 1e-5, f"request {i}: logprobs differ by {worst:.2e}"


def test_a_decode_override_is_bounded_by_the_same_rule(model: Transformer) -> None:
    """A request's decode cut (``"kvdrop": {"decode": ...}``) names a policy too: the same
    bounds and the same ``--client-policies`` rule (:mod:`kvdrop_engine.client_specs`)."""
    from kvdrop_engine.decode_cut import DecodeCompressor
    from kvdrop_engine.errors import InvalidRequestError

    compressor = DecodeCompressor(model.config, "knorm", budget=40, every=10)
    with Engine(model, num_blocks=64, compressor=compressor) as engine:
        bomb = {"policy": "leverage(sketch_dimension=4000)", "budget": 40}
        with pytest.raises(InvalidRequestError, match=r"'kvdrop.decode.policy'.*at most 512"):
            engine.post_completion(prompt_of(50), {"max_tokens": 4, "kvdrop": {"decode": bomb}})
        with pytest.raises(InvalidRequestError, match="may not be picked"):
            decode = {"policy": "value-norm", "budget": 40}
            engine.post_completion(prompt_of(50), {"max_tokens": 4, "kvdrop": {"decode": decode}})
        fine = {"kvdrop": {"decode": {"policy": "tova", "budget": 40}}}
        assert len(engine.generate(prompt_of(50), {"max_tokens": 4, **GREEDY, **fine})) == 4
