"""The plugin kit catches real bugs at its defaults: planted broken scorers (a non-finite score
at one in-range parameter value; edits of the KV, the queries or the token scores in place) fail
``check_policy`` with a message naming the cause and the parameter value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvdrop import MissingTokenScoresError, QueryNeed, Scorer, ScorerFactory, Selection, param
from kvdrop.testing import check_policy, explicit_cases


@dataclass(frozen=True)
class InfAtOneValue(Scorer):
    """Key norms divided by ``2 - sharpness``... except at 0.75, where it divides by zero."""

    sharpness: float = param(
        0.5, "how sharp", allowed="0 <= s <= 1", check=lambda s: 0.0 <= s <= 1.0
    )

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        norms = kv[0].float().norm(dim=-1).mean(0)
        return norms / (0.0 if self.sharpness == 0.75 else 2.0 - self.sharpness)


@dataclass(frozen=True)
class ZeroLevelsInf(Scorer):
    """Integer bug: ``levels=0`` (in range) gives inf."""

    levels: int = param(4, "quantisation levels", allowed=">= 0", check=lambda n: n >= 0)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        return kv[0].float().norm(dim=-1).mean(0) / self.levels


@dataclass(frozen=True)
class EditsKV(Scorer):
    """``.float()`` of a float32 KV is the KV itself: the in-place scale edits the cache."""

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        keys = kv[0].float()
        keys.mul_(2.0)
        return keys.norm(dim=-1).mean(0)


@dataclass(frozen=True)
class EditsQueries(Scorer):
    queries = QueryNeed.FULL

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None
        q = query.float()
        q.clamp_(min=0.0)
        return q[0].norm(dim=-1).mean(0)


@dataclass(frozen=True)
class EditsTokenScores(Scorer):
    needs_selection = True
    token_scores = True

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        scores = selection.token_scores
        if scores is None:
            raise MissingTokenScoresError("edits-input")
        scores.sub_(0.5)  # centred in place: the caller's tensor
        return scores.mean(dim=(0, 1))[: kv.shape[2]].clone()


def test_a_non_finite_score_at_one_float_value_fails_naming_it() -> None:
    factory = ScorerFactory("inf-at-one", InfAtOneValue, "planted bug")
    with pytest.raises(AssertionError, match=r"sharpness=0\.75.*non-finite"):
        check_policy(factory)


def test_a_non_finite_score_at_an_int_bound_fails_naming_it() -> None:
    factory = ScorerFactory("zero-levels", ZeroLevelsInf, "planted bug")
    with pytest.raises(AssertionError, match=r"levels=0\b.*non-finite"):
        check_policy(factory)


@pytest.mark.parametrize(
    ("scorer", "what"),
    [(EditsKV, "KV"), (EditsQueries, "queries"), (EditsTokenScores, "token scores")],
)
def test_editing_an_input_in_place_fails_naming_the_input(scorer: type, what: str) -> None:
    factory = ScorerFactory("edits-input", scorer, "planted bug")
    with pytest.raises(AssertionError, match=f"changed its input {what} in place"):
        check_policy(factory)


def test_the_explicit_examples_cover_every_parameter_value_and_the_budget_extremes() -> None:
    factory = ScorerFactory("zero-levels", ZeroLevelsInf, "planted bug")
    cases = list(explicit_cases(factory))
    levels = {c.params.get("levels") for c in cases}
    assert set(range(41)) <= levels  # every int the domain holds, the bound 0 included
    assert {c.kv.dtype for c in cases} == {torch.float32, torch.bfloat16, torch.float16}
    assert any(c.params.get("keep_tokens") == 1 for c in cases)
    assert any(c.params.get("keep_ratio") == 0.01 for c in cases)
    assert any(c.params.get("chunk_size", 0) > c.kv.shape[2] for c in cases)


@dataclass(frozen=True)
class FailsOnShortPrompts(Scorer):
    """Indexes the fifth token: fine on the 48-token examples, an IndexError on 2-4 tokens (as
    ``cap`` did with its four sinks)."""

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        norms = kv[0].float().norm(dim=-1).mean(0)
        return norms - norms[4]


def test_a_policy_that_fails_on_short_prompts_fails_the_kit() -> None:
    factory = ScorerFactory("short-bug", FailsOnShortPrompts, "planted bug")
    with pytest.raises(AssertionError, match=r"on T=2,.*raised IndexError"):
        check_policy(factory)
    lengths = {c.kv.shape[2] for c in explicit_cases(factory)}
    assert set(range(1, 9)) <= lengths


@pytest.mark.parametrize("num_tokens", [2, 3, 4])
def test_cap_runs_on_prompts_of_sinks_only(num_tokens: int) -> None:
    """``cap`` (four sinks) raised IndexError on 2-4-token prompts in the engine and in
    ``KVDropPress``; the kit passed it. The kit now tries 1-8 tokens and ``cap`` passes it."""
    import kvdrop
    from kvdrop_sdk import CacheKind

    gen = torch.Generator().manual_seed(num_tokens)
    kv = torch.randn(2, 2, num_tokens, 32, generator=gen)
    query = torch.randn(1, 2, num_tokens, 64, generator=gen)
    policy = kvdrop.get("cap", keep_tokens=1, chunk_size=1, head_dim=16)
    kept, tokens = policy({CacheKind.KV: kv, CacheKind.QUERY: query}, list(range(num_tokens)))
    assert kept.shape[2] == len(tokens) >= 1
    if num_tokens == 4:
        check_policy("cap", max_examples=5)


def _twice_first(keep_ratio: float | None = None, keep_tokens: int | None = None,
                 chunk_size: int = 256) -> Any:  # fmt: skip
    """A plain function that keeps its first position twice (and checks its inputs)."""
    from kvdrop.inputs import edit_inputs
    from kvdrop.params import validate_params
    from kvdrop.selector import SELECTOR_PARAMS, Selector

    asked = {"keep_ratio": keep_ratio, "keep_tokens": keep_tokens, "chunk_size": chunk_size}
    selector = Selector(**validate_params("twice", SELECTOR_PARAMS, asked))

    def edit(tensors: Any, tokens: Any) -> Any:
        kv = edit_inputs(tensors, tokens, policy="twice", queries=QueryNeed.NONE).kv
        count = selector.budget(len(tokens))
        rows = [0, *range(count - 1)] if count > 1 else [0]
        return kv[:, :, rows].clone(), [tokens[i] for i in rows]

    return edit


def test_a_duplicate_index_is_named_as_such() -> None:
    """Issue 34: it was reported as "kept tokens must keep order"."""
    from kvdrop.factories import FunctionFactory

    _twice_first.queries = QueryNeed.NONE  # type: ignore[attr-defined]
    with pytest.raises(
        AssertionError, match=r"kept positions \[0\] more than once \(a duplicate index\)"
    ):
        check_policy(FunctionFactory("twice", _twice_first), max_examples=3)


@dataclass(frozen=True)
class ReadsTheSampleSilently(Scorer):
    """Scores keys by the mean query over EVERY saved row (the strided sample included), yet
    declares that it reads only the last rows: the engine would then store no sample for it."""

    queries = QueryNeed.WINDOW
    reads_query_sample = False
    reads_values = False
    head_dim: int = param(4, "head dimension", allowed="> 0", check=lambda d: d > 0)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None
        keys = kv[0].float()  # [L, T, Hkv*d]
        q = query[0].float().mean(dim=1)  # [L, Hq*d]
        d = self.head_dim
        q = q.view(q.shape[0], -1, d).mean(dim=1)  # [L, d]
        k = keys.view(keys.shape[0], keys.shape[1], -1, d).mean(dim=2)  # [L, T, d]
        return torch.einsum("ltd,ld->t", k, q)


def test_a_policy_that_reads_the_sample_it_disowns_fails_the_kit() -> None:
    """``reads_query_sample = False`` tells the engine to store no strided sample of query rows
    (snapkv, tova, rkv, finch: 64 rows a layer instead of 288 at 14K tokens); a scorer that says
    so but reads every row keeps other tokens without the sample, and the kit says so."""
    factory = ScorerFactory("sample-bug", ReadsTheSampleSilently, "planted bug")
    with pytest.raises(AssertionError, match=r"declares reads_query_sample = False"):
        check_policy(factory)
    honest = dataclass(frozen=True)(
        type("ReadsTheSample", (ReadsTheSampleSilently,), {"reads_query_sample": True})
    )
    check_policy(ScorerFactory("sample-ok", honest, "reads the sample and says so"))
