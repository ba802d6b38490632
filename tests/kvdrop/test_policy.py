"""The policy contract: scorers, what reaches score(), factories for scorers and plain functions."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop import Scorer, ScorerFactory, Selection, param, registry
from kvdrop.function_policy import FunctionPolicy
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import QueryNeed


@dataclass(frozen=True)
class WindowedScorer(Scorer):
    """A plugin scorer with its own parameter named like a selector parameter."""

    window: int = param(3, "how many of the last keys vote", check=lambda w: w >= 1)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        votes = kv[0, :, -self.window :].float().sum(dim=(0, 1))  # [D]
        return kv[0].float().matmul(votes).mean(0)


def test_a_scorer_field_named_window_is_its_own() -> None:
    factory = ScorerFactory("windowed", WindowedScorer, "test")
    names = [p.name for p in factory.params]
    assert names.count("window") == 1 and "n_sink" in names
    fn = factory(window=7, keep_tokens=4, chunk_size=4)
    assert fn.scorer.window == 7 and fn.selector.window == 0
    assert next(p for p in factory.params if p.name == "window").help.startswith("how many")
    with pytest.raises(kvdrop.PolicyParamError, match="window"):
        factory(window=0)


def test_a_plain_field_named_like_a_selector_parameter_is_refused() -> None:
    @dataclass(frozen=True)
    class OldStyle(Scorer):
        chunk_size: int = 256  # used to be overwritten from the selector

        def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
            return torch.zeros(kv.shape[2])

    with pytest.raises(TypeError, match=r"OldStyle.chunk_size.*needs_selection"):
        ScorerFactory("old", OldStyle, "test")


SEEN: list[Selection] = []


@dataclass(frozen=True)
class RecordingScorer(Scorer):
    """Scores by position and records the Selection it was handed."""

    needs_selection = True

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        SEEN.append(selection)
        return torch.arange(kv.shape[2], dtype=torch.float32)


def test_a_scorer_that_asks_gets_the_selection_of_its_own_budget() -> None:
    factory = ScorerFactory("rec", RecordingScorer, "test")
    kv = torch.randn(2, 1, 64, 4)
    fn = factory(keep_tokens=24, chunk_size=8, n_sink=2, window=5)
    fn({CacheKind.KV: kv}, list(range(64)))
    got = SEEN[-1]
    assert (got.num_tokens, got.budget, got.chunk_size, got.n_sink, got.window) == (64, 24, 8, 2, 5)
    assert not got.chunked and got.prompt_tokens == 64 and got.query_positions is None
    kvdrop.Compose([fn, kvdrop.get("knorm", chunk_size=8)], keep_tokens=32)(
        {CacheKind.KV: kv}, list(range(64))
    )
    assert SEEN[-1].budget == 16, "a composition part sees its share"


@pytest.mark.parametrize(
    ("name", "where"),
    [("knorm", (0, 0, 5, 0)), ("lagkv", (0, 0, 5, 0)), ("lagkv", (1, 0, 20, 3))],
)
def test_nan_kv_is_an_input_error_naming_the_policy(
    name: str, where: tuple[int, int, int, int]
) -> None:
    """NaN keys and values a scorer reads are refused before scoring, like NaN scores
    (``lagkv`` ranked a NaN key as an ordinary token and dropped it silently)."""
    kv = torch.randn(2, 1, 32, 8)
    kv[where] = float("nan")
    with pytest.raises(
        kvdrop.PolicyInputError,
        match=rf"{name}: 1 non-finite value\(s\) \(NaN or inf\) in its cached KV",
    ):
        kvdrop.get(name, keep_tokens=8, chunk_size=8)({CacheKind.KV: kv}, list(range(32)))
    # Within budget nothing is scored, so nothing is wrong.
    kvdrop.get(name, keep_tokens=32, chunk_size=8)({CacheKind.KV: kv}, list(range(32)))


def test_bytes_a_scorer_does_not_read_are_not_checked() -> None:
    """knorm reads the keys only (``Needs.kv`` KEYS): NaN values are not its input, so the SDK
    can hand it keys alone; chunk-halving reads no byte at all."""
    kv = torch.randn(2, 1, 32, 8)
    kv[1] = float("nan")
    kept, _ = kvdrop.get("knorm", keep_tokens=8, chunk_size=8)({CacheKind.KV: kv}, list(range(32)))
    assert kept.shape[2] == 8
    kv[0] = float("nan")
    kept, _ = kvdrop.get("chunk-halving", chunk_size=8)({CacheKind.KV: kv}, list(range(32)))
    assert kept.shape[2] < 32


@dataclass
class InfScorer(Scorer):
    """Scores one token +inf: a broken scorer (the selector cannot rank on inf)."""

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        scores = torch.zeros(kv.shape[2])
        scores[3] = float("inf")
        return scores


def test_inf_scores_are_refused_naming_the_policy() -> None:
    fn = ScorerFactory("inf-scorer", InfScorer, "test")(keep_tokens=8, chunk_size=8)
    kv = torch.randn(2, 1, 32, 8)
    with pytest.raises(kvdrop.PolicyInputError, match=r"inf-scorer: 1 non-finite .* scores"):
        fn({CacheKind.KV: kv}, list(range(32)))


@dataclass(frozen=True)
class NaNRope(RopeConfig):
    """RoPE parameters whose angles come out non-finite (as theta=1e-300 did, issue 20)."""

    def cos_sin(
        self, positions: torch.Tensor, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().cos_sin(positions, seq_len)
        return torch.full_like(cos, float("nan")), sin


def test_non_finite_rerotated_keys_are_refused_naming_the_policy() -> None:
    """A re-rotation that writes NaN keys fails the edit instead of storing them."""
    kv = torch.randn(2, 1, 32, 8)
    fn = kvdrop.get("knorm", keep_tokens=8, chunk_size=8, rerotate=NaNRope(head_dim=8))
    with pytest.raises(kvdrop.PolicyInputError, match=r"knorm: .* re-rotated keys.*RoPE"):
        fn({CacheKind.KV: kv}, list(range(32)))
    good = kvdrop.get("knorm", keep_tokens=8, chunk_size=8, rerotate=RopeConfig(head_dim=8))
    out, kept = good({CacheKind.KV: kv}, list(range(32)))
    assert bool(torch.isfinite(out).all()) and len(kept) == 8


def test_every_policy_kvdrop_builds_is_a_policy() -> None:
    for name in ["knorm", "snapkv", "streaming+snapkv", "chunk(policy=h2o)", "budget"]:
        assert isinstance(kvdrop.get(name), kvdrop.Policy)


@pytest.fixture
def plain() -> Iterator[str]:
    def keep_first(keep_tokens: int, chunk_size: int = 1) -> Any:
        """Keep the first keep_tokens tokens (a plain factory returning a plain function)."""

        def fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> Any:
            return tensors[CacheKind.KV][:, :, :keep_tokens], list(tokens[:keep_tokens])

        return fn

    kvdrop.register("test-keep-first", keep_first)
    yield "test-keep-first"
    registry._reset()


def test_a_plain_function_plugin_gets_its_parameters_checked(plain: str) -> None:
    with pytest.raises(
        kvdrop.PolicyParamError, match=r"unknown parameter 'keep_token'.*keep_tokens"
    ):
        kvdrop.get(plain, keep_token=4)
    with pytest.raises(kvdrop.PolicyParamError, match=r"missing parameter.*'keep_tokens'"):
        kvdrop.get(plain)
    fn = kvdrop.get(plain, keep_tokens=3)
    # It declares nothing: it is served upstream's full queries (and reads what it wants).
    assert isinstance(fn, FunctionPolicy) and kvdrop.needs_of(fn) == kvdrop.Needs(QueryNeed.FULL)
    kv = torch.randn(2, 1, 8, 4)
    out, kept = fn({CacheKind.KV: kv}, list(range(10, 18)))
    assert kept == [10, 11, 12] and torch.equal(out, kv[:, :, :3])
    _, index = fn.select_indices({CacheKind.KV: kv}, list(range(10, 18)))
    assert index.tolist() == [0, 1, 2]
    assert [p.type for p in kvdrop.describe(plain).params] == [int, int]


def test_alignment_that_keeps_far_less_than_asked_is_reported_once() -> None:
    kv = torch.randn(2, 1, 768, 8)
    fn = kvdrop.get("knorm", keep_ratio=0.5, chunk_size=256, rerotate=False)
    with pytest.warns(
        kvdrop.PolicyWarning, match=r"keeps 256 of 768 prompt tokens \(kept_fraction 0\.33\), 67%"
    ):
        fn({CacheKind.KV: kv}, list(range(768)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn({CacheKind.KV: kv}, list(range(768)))  # once per policy
        # The whole prompt is 1018 tokens: 256 cached + the 250-token tail is what was asked.
        again = kvdrop.get("knorm", keep_ratio=0.5, chunk_size=256, rerotate=False)
        _, kept = again(
            {CacheKind.KV: kv}, list(range(768)), context=EditContext.of(768, prompt_tokens=1018)
        )
    assert len(kept) == 256


def test_alignment_that_keeps_far_more_than_asked_is_reported() -> None:
    """A 367-token prompt whose one cached chunk is all a 256-token chunk size can keep: any
    ratio keeps the whole prompt, and the warning says so with the kept fraction."""
    kv = torch.randn(2, 1, 256, 8)
    context = EditContext.of(256, prompt_tokens=367)
    fn = kvdrop.get("knorm", keep_ratio=0.25, chunk_size=256, rerotate=False)
    with pytest.warns(kvdrop.PolicyWarning, match=r"keeps 367 of 367 .*kept_fraction 1\.00.*400%"):
        _, kept = fn({CacheKind.KV: kv}, list(range(256)), context=context)
    assert len(kept) == 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keep 0.5 of 540 keeps 256 + 28 = 284 of 270: close enough
        again = kvdrop.get("knorm", keep_ratio=0.5, chunk_size=256, rerotate=False)
        again({CacheKind.KV: torch.randn(2, 1, 512, 8)}, list(range(512)),
              context=EditContext.of(512, prompt_tokens=540))  # fmt: skip


def test_needs_say_whether_a_query_window_is_enough() -> None:
    """Built-in query scorers read the lean window; a QueryNeed.FULL scorer, or a function that
    declares it, needs every cached token's query; wrappers answer for what they hold."""
    assert kvdrop.needs_of(kvdrop.get("snapkv", keep_ratio=0.5)).queries is not QueryNeed.FULL
    assert kvdrop.needs_of(kvdrop.get("h2o", keep_ratio=0.5)).queries is not QueryNeed.FULL
    assert kvdrop.needs_of(kvdrop.get("knorm", keep_ratio=0.5)).queries is not QueryNeed.FULL
    assert kvdrop.needs_of(kvdrop.get("chunk(policy=snapkv)")).queries is not QueryNeed.FULL
    fn = FunctionPolicy("fn", lambda t, k: (t, k), kvdrop.Needs(QueryNeed.FULL))
    assert kvdrop.needs_of(fn).queries is QueryNeed.FULL and fn.queries is QueryNeed.FULL
    assert kvdrop.get("snapkv").queries is QueryNeed.WINDOW
    assert kvdrop.get("streaming+snapkv").queries is QueryNeed.WINDOW
    assert kvdrop.get("knorm").queries is QueryNeed.NONE
    if "last-queries" in kvdrop.available():  # the example plugin
        assert kvdrop.needs_of(kvdrop.get("last-queries", keep_ratio=0.5)).queries is QueryNeed.FULL
        assert (
            kvdrop.needs_of(kvdrop.get("streaming+last-queries", keep_ratio=0.5)).queries
            is QueryNeed.FULL
        )
        assert (
            kvdrop.needs_of(kvdrop.get("streaming+snapkv", keep_ratio=0.5)).queries
            is not QueryNeed.FULL
        )
