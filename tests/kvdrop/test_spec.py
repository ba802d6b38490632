"""Spec strings: grammar, names -> built combinators, what `kvdrop describe` says about them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop import registry
from kvdrop.cli import main
from kvdrop.spec import parse_spec
from kvdrop_sdk import CacheKind


@pytest.mark.parametrize(
    ("spec", "terms"),
    [
        ("snapkv", [("snapkv", {})]),
        ("streaming+snapkv", [("streaming", {}), ("snapkv", {})]),
        (
            " streaming(n_sink=8) + snapkv(window=32, pooling=max, head_dim=null) ",
            [
                ("streaming", {"n_sink": 8}),
                ("snapkv", {"window": 32, "pooling": "max", "head_dim": None}),
            ],
        ),
        (
            "budget(policy='streaming+snapkv', tiers=\"4096:1.0,*:0.5\", chunked=true)",
            [
                (
                    "budget",
                    {"policy": "streaming+snapkv", "tiers": "4096:1.0,*:0.5", "chunked": True},
                )
            ],
        ),
        ("chunk(policy=chunk-halving)", [("chunk", {"policy": "chunk-halving"})]),
        ("value-l1(layers=[1,3])", [("value-l1", {"layers": [1, 3]})]),
        (
            'x(m={"a": [1, "b,c"]}, s=\'a, b)\', n=-1.5e2)',
            [("x", {"m": {"a": [1, "b,c"]}, "s": "a, b)", "n": -150.0})],
        ),
        (
            "budget(policy=chunk(policy=snapkv), tiers='*:0.5')+streaming",
            [("budget", {"policy": "chunk(policy=snapkv)", "tiers": "*:0.5"}), ("streaming", {})],
        ),
        ("budget(policy=streaming+snapkv)", [("budget", {"policy": "streaming+snapkv"})]),
    ],
)
def test_parse_spec(spec: str, terms: list[tuple[str, dict[str, Any]]]) -> None:
    assert parse_spec(spec) == terms


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "+snapkv",
        "snapkv+",
        "snapkv(window)",
        "snapkv(window=3",
        "snapkv window",
        "a(=1)",
        "a(x=[1,)",
        "a(x=[1, 2)",
        "a(x='open)",
        "a(x='q' y=2)",
    ],
)
def test_bad_specs_say_what_is_expected(bad: str) -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="expected NAME"):
        parse_spec(bad)


def test_compose_validates_at_factory_time() -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="weights"):
        kvdrop.get("compose", policies="streaming+knorm", weights=[1])
    with pytest.raises(kvdrop.PolicyParamError, match="weights"):
        kvdrop.get("compose", policies="streaming+knorm", weights=[1, 0])
    with pytest.raises(kvdrop.PolicyParamError, match="policies"):
        kvdrop.get("compose", policies=[])
    with pytest.raises(kvdrop.PolicyParamError, match="kernel"):
        kvdrop.get("streaming+snapkv(kernel=4)")
    with pytest.raises(kvdrop.PolicyNotFoundError, match="snapkv"):
        kvdrop.get("streaming+snapkvv")
    with pytest.raises(kvdrop.PolicyParamError, match="not both"):
        kvdrop.get("compose", keep_ratio=0.5, keep_tokens=8)


@pytest.fixture
def plain_policy() -> Iterator[str]:
    def keep_all(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> Any:
        return tensors[CacheKind.KV], list(tokens)

    def factory() -> Any:
        """A policy that is not a scorer."""
        return keep_all

    kvdrop.register("test-plain-policy", factory)
    yield "test-plain-policy"
    registry._reset()


def test_only_scorer_policies_can_be_composed(plain_policy: str) -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="not a scorer policy"):
        kvdrop.get(f"streaming+{plain_policy}")
    with pytest.raises(kvdrop.PolicyParamError, match="no chunk-level mode"):
        kvdrop.get("chunk", policy=plain_policy)


def test_query_needs_follow_the_parts() -> None:
    assert kvdrop.describe("streaming+snapkv").needs.reads_queries
    assert not kvdrop.describe("streaming+knorm").needs.reads_queries
    assert kvdrop.describe("chunk(policy=tova)").needs.reads_queries
    fn = kvdrop.get("streaming+snapkv", keep_tokens=8, chunk_size=8, head_dim=8)
    with pytest.raises(kvdrop.MissingQueryError, match="--enable transfer_query"):
        fn({CacheKind.KV: torch.randn(2, 1, 32, 16)}, list(range(32)))


def test_cli_describes_a_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", "streaming(n_sink=8)+snapkv(window=32)"]) == 0
    text = capsys.readouterr().out
    assert "needs query tensors: yes" in text and "streaming(n_sink=8)" in text
    assert "snapkv(window=32)" in text and "weights" in text
    assert main(["describe", "streaming+"]) == 2
    assert "missing a policy name" in capsys.readouterr().err
    assert main(["describe", "chunk(policy=snapkv)"]) == 0
    assert "needs query tensors: yes" in capsys.readouterr().out


@pytest.fixture
def list_policy() -> Iterator[list[Any]]:
    """A plain-function policy taking a list, recording what it was given."""
    seen: list[Any] = []

    def factory(layers: list[int] | None = None) -> Any:
        """Keep everything (records ``layers``)."""
        seen.append(layers)
        return lambda tensors, tokens: (tensors[CacheKind.KV], list(tokens))

    kvdrop.register("test-layers", factory)
    yield seen
    registry._reset()


def test_json_list_values_reach_the_factory(list_policy: list[Any]) -> None:
    kvdrop.get("test-layers(layers=[1,3])")
    assert list_policy[-1] == [1, 3]
    assert kvdrop.describe("test-layers(layers=[1, 3])").example == {"layers": [1, 3]}


def test_nested_specs_build(capsys: pytest.CaptureFixture[str]) -> None:
    fn = kvdrop.get("budget(policy=chunk(policy=snapkv), tiers='*:0.5')", head_dim=8)
    assert isinstance(fn, kvdrop.Budget) and isinstance(fn.policy, kvdrop.Chunk)
    assert (
        kvdrop.needs_of(fn).reads_queries
        and kvdrop.describe("budget(policy=streaming+snapkv)").needs.reads_queries
    )


def test_keep_budget_is_the_one_keep_ratio_rule() -> None:
    """A spec's own keep_ratio wins over the default, an explicit one is used when the spec
    has none, and an explicit one beside a different own value is refused (never silent)."""
    from kvdrop.spec import keep_budget

    assert (keep_budget("snapkv").keep_ratio, keep_budget("snapkv").source) == (0.5, "default")
    assert keep_budget("snapkv", 0.3).params == {"keep_ratio": 0.3}
    own = keep_budget("snapkv(keep_ratio=0.3)", default=0.7)
    assert (own.keep_ratio, own.params, str(own)) == (0.3, {}, "0.3 (the spec's)")
    assert keep_budget("snapkv(keep_ratio=0.3)", 0.3).source == "spec"  # the same value: fine
    assert keep_budget("snapkv(keep_tokens=40)").keep_tokens == 40
    # A composition shares its own budget; its parts' are ignored.
    assert keep_budget("streaming+snapkv(keep_ratio=0.2)", 0.4).keep_ratio == 0.4
    with pytest.raises(
        kvdrop.PolicyParamError, match=r"sets keep_ratio=0\.3 and keep_ratio 0\.5 was"
    ):
        keep_budget("snapkv(keep_ratio=0.3)", 0.5)
    with pytest.raises(kvdrop.PolicyParamError, match="keep_tokens=40"):
        keep_budget("snapkv(keep_tokens=40)", 0.5)
    with pytest.raises(ValueError, match=r"keep_ratio must be a number in \(0, 1\]"):
        keep_budget("snapkv", 1.5)
    # ``kvdrop describe`` shows the spec's bound value as its default.
    params = {p.name: p.default for p in kvdrop.describe("snapkv(keep_ratio=0.3)").params}
    assert params["keep_ratio"] == 0.3
