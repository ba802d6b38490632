"""Composition without code: spec strings, union of policies, chunk variant, per-request budget."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop import registry
from kvdrop.cli import main
from kvdrop.compose import BudgetPolicy, ComposePolicy, parse_spec, parse_tiers, ranking
from kvdrop.rerotate import RerotatedPolicy
from kvdrop.selector import Selector
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind


def inputs(t: int, seed: int = 0, layers: int = 2) -> dict[Any, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        CacheKind.KV: torch.randn(2, layers, t, 16, generator=gen),
        CacheKind.QUERY: torch.randn(1, layers, t, 32, generator=gen),
    }


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
    ],
)
def test_parse_spec(spec: str, terms: list[tuple[str, dict[str, Any]]]) -> None:
    assert parse_spec(spec) == terms


@pytest.mark.parametrize(
    "bad", ["", "+snapkv", "snapkv+", "snapkv(window)", "snapkv(window=3", "snapkv window", "a(=1)"]
)
def test_bad_specs_say_what_is_expected(bad: str) -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="expected NAME"):
        parse_spec(bad)


def random_cases() -> Iterator[tuple[torch.Tensor, Selector]]:
    gen = torch.Generator().manual_seed(11)
    for i in range(60):
        t = int(torch.randint(1, 90, (1,), generator=gen))
        scores = torch.randint(0, 5, (t,), generator=gen).float()  # many ties
        if i % 7 == 0:
            scores[0] = float("nan")
        chunk = [1, 4, 8, 16][i % 4]
        yield (
            scores,
            Selector(
                keep_tokens=int(torch.randint(1, 100, (1,), generator=gen)),
                chunk_size=chunk,
                n_sink=i % 5,
                window=(3 * i) % 11,
                chunked=i % 3 == 0,
            ),
        )


def test_ranking_prefix_is_exactly_what_the_selector_keeps() -> None:
    for scores, sel in random_cases():
        k = sel.budget(scores.numel())
        order = ranking(sel, scores)
        assert sorted(order.tolist()) == list(range(scores.numel()))
        assert torch.equal(torch.sort(order[:k]).values, sel.select(scores, k))


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("snapkv", {"head_dim": 8, "window": 5}),
        ("streaming", {"n_sink": 3}),
        ("chunk-halving", {}),
        ("knorm", {"head_dim": 8, "chunked": True, "window": 9}),
        ("rkv", {"head_dim": 8}),
    ],
)
def test_one_part_equals_the_policy_alone(name: str, params: dict[str, Any]) -> None:
    tensors = inputs(96, seed=3)
    alone = kvdrop.get(name, keep_tokens=40, chunk_size=8, **params)(tensors, list(range(96)))
    fn = kvdrop.get("compose", policies=[{"name": name, **params}], keep_tokens=40, chunk_size=8)
    out, kept = fn(tensors, list(range(96)))
    assert kept == alone[1] and torch.equal(out, alone[0])


def test_union_gives_each_part_its_share_in_order() -> None:
    tensors = inputs(128, seed=4)
    kv = tensors[CacheKind.KV]
    fn = kvdrop.get("streaming(n_sink=4)+knorm", keep_tokens=64, chunk_size=16)
    assert isinstance(fn, ComposePolicy) and fn.quotas(64) == [32, 32]
    _, kept = fn(tensors, list(range(128)))
    streaming_part = set(range(4)) | set(range(100, 128))  # sinks, then the most recent
    norms = kv[0].norm(dim=-1).mean(0)  # knorm: lowest mean L2 norm over layers
    rest = [i for i in torch.argsort(norms, stable=True).tolist() if i not in streaming_part]
    assert kept == sorted(streaming_part | set(rest[:32]))


def test_weights_split_the_budget_in_whole_chunks() -> None:
    fn = kvdrop.get("compose", policies="streaming+knorm", weights=[3, 1], chunk_size=16)
    assert isinstance(fn, ComposePolicy)
    assert fn.quotas(64) == [48, 16]
    assert fn.quotas(16) == [16, 0]
    thirds = kvdrop.get("compose", policies="streaming+knorm+keydiff", chunk_size=8)
    assert isinstance(thirds, ComposePolicy) and thirds.quotas(32) == [16, 8, 8]


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
    assert kvdrop.describe("streaming+snapkv").needs_query
    assert not kvdrop.describe("streaming+knorm").needs_query
    assert kvdrop.describe("chunk(policy=tova)").needs_query
    fn = kvdrop.get("streaming+snapkv", keep_tokens=8, chunk_size=8, head_dim=8)
    with pytest.raises(kvdrop.MissingQueryError, match="--enable transfer_query"):
        fn({CacheKind.KV: torch.randn(2, 1, 32, 16)}, list(range(32)))


@pytest.mark.parametrize("name", ["snapkv", "knorm", "h2o"])
def test_chunk_variant_is_the_chunked_scorer(name: str) -> None:
    tensors = inputs(100, seed=5)
    ref = kvdrop.get(name, keep_tokens=48, chunk_size=16, head_dim=8, chunked=True)
    fn = kvdrop.get(f"chunk(policy={name})", keep_tokens=48, chunk_size=16, head_dim=8)
    out, kept = fn(tensors, list(range(100)))
    ref_out, ref_kept = ref(tensors, list(range(100)))
    assert kept == ref_kept and torch.equal(out, ref_out)
    for i in range(0, 48, 16):  # whole chunks only
        assert kept[i] % 16 == 0 and kept[i : i + 16] == list(range(kept[i], kept[i] + 16))
    assert kvdrop.get("chunk", policy="chunk-halving", chunk_size=16) is not None


def test_budget_tiers_pick_the_budget_per_request() -> None:
    fn = kvdrop.get("budget", policy="knorm", tiers="64:1.0,128:0.5,*:16", chunk_size=16)
    assert isinstance(fn, BudgetPolicy)
    for t, expected in [(64, 64), (128, 64), (512, 16)]:
        out, kept = fn(inputs(t), list(range(t)))
        assert len(kept) == expected == out.shape[2]
    short = inputs(48)
    out, kept = fn(short, list(range(48)))
    assert out is short[CacheKind.KV] and kept == list(range(48)), "keep-all tier: unchanged"


def test_budget_rule_and_default() -> None:
    fn = kvdrop.get("budget", policy="streaming+knorm", rule=lambda t: t // 4, chunk_size=8)
    _, kept = fn(inputs(128), list(range(128)))
    assert len(kept) == 32
    same = kvdrop.get("budget", policy="knorm", keep_tokens=24, chunk_size=8)
    plain = kvdrop.get("knorm", keep_tokens=24, chunk_size=8)
    assert same(inputs(64), list(range(64)))[1] == plain(inputs(64), list(range(64)))[1]
    bad = kvdrop.get("budget", policy="knorm", rule=lambda t: "half")
    with pytest.raises(kvdrop.PolicyInputError, match="budget rule returned 'half'"):
        bad(inputs(64), list(range(64)))


@pytest.mark.parametrize(
    ("tiers", "match"),
    [
        ("64:0.5", "must end with a '\\*'"),
        ("64:0.5,32:0.25,*:0.1", "increasing"),
        ("64:1.5,*:0.5", "ratio"),
        ("64-0.5,*:0.5", "no ':'"),
        ("x:0.5,*:0.5", "expected an int"),
        ("*:0.5,64:0.5", "after"),
    ],
)
def test_bad_tiers(tiers: str, match: str) -> None:
    with pytest.raises(kvdrop.PolicyParamError, match=match):
        parse_tiers(tiers)
    with pytest.raises(kvdrop.PolicyParamError):
        kvdrop.get("budget", tiers=tiers)


def test_budget_rejects_tiers_and_rule_together() -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="not both"):
        kvdrop.get("budget", tiers="*:0.5", rule=lambda t: 0.5)


def test_compositions_can_be_rerotated() -> None:
    cfg = RopeConfig(8)
    tensors = inputs(64, seed=6)
    for spec in ["streaming+snapkv", "budget(policy=snapkv, tiers='*:0.25')"]:
        plain = kvdrop.get(spec, chunk_size=8, head_dim=8)(tensors, list(range(64)))
        fn = kvdrop.get(spec, chunk_size=8, head_dim=8, rerotate=cfg)
        assert isinstance(fn, RerotatedPolicy)
        out, kept = fn(tensors, list(range(64)))
        assert kept == plain[1] and torch.equal(out[1], plain[0][1])


def test_cli_describes_a_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", "streaming(n_sink=8)+snapkv(window=32)"]) == 0
    text = capsys.readouterr().out
    assert "needs query tensors: yes" in text and "streaming(n_sink=8)" in text
    assert "snapkv(window=32)" in text and "weights" in text
    assert main(["describe", "streaming+"]) == 2
    assert "missing a policy name" in capsys.readouterr().err
    assert main(["describe", "chunk(policy=snapkv)"]) == 0
    assert "needs query tensors: yes" in capsys.readouterr().out
