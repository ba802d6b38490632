"""Invariants every registered policy must keep (including plugins), drawn by hypothesis.

One list drives the matrix: ``kvdrop.available()``. The runs are deterministic
(``derandomize=True``: the same examples on every run and machine, whatever ``--hypothesis-seed``
says). The input domain drawn here is the one docs/policies.md promises a policy must accept:
T = 1..160 tokens, chunk sizes 1, 4, 16, 32, float32 / bfloat16 / float16, 1-3 layers, 1-3 KV
heads of head_dim 2, 4 or 8 with GQA groups 1-2, keep_ratio in [0.01, 1] or keep_tokens 1..200.
Every other declared parameter is drawn from its own domain (each choice; bools; ints 0..40,
floats in [-1, 1] and None where the type allows, kept where the parameter's validation accepts
them); parameters of other types keep the policy's ``PolicyInfo.example`` value or their default.
A plugin whose import fails, or two claiming one name, fails test_registry.py (one test per entry
point), so no plugin drops out of this matrix silently.
"""

from __future__ import annotations

import enum
import itertools
import types
import typing
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import kvdrop
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext

POLICIES = kvdrop.available()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Drawn specially (budget, chunk size and head_dim must fit the drawn tensors).
SHAPED = {"keep_ratio", "keep_tokens", "chunk_size", "head_dim"}
INTS = list(range(41))
FLOATS = [-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]


class ForeignKind(enum.Enum):
    """Another SDK's cache-kind enum (e.g. LMCache's): policies must accept it by value."""

    KV = "kv"
    QUERY = "query"


def declared(name: str) -> set[str]:
    return {p.name for p in kvdrop.describe(name).params}


def _types(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def domain(name: str, p: kvdrop.Param) -> list[Any]:
    """Values of parameter ``p`` to draw from: its choices, or candidates of its type that its
    own validation accepts; empty when none can be inferred."""
    if p.choices is not None:
        return list(p.choices)
    kinds = _types(p.type)
    candidates: list[Any] = []
    if bool in kinds:
        candidates += [False, True]
    if int in kinds:
        candidates += INTS
    if float in kinds:
        candidates += FLOATS
    if candidates and type(None) in kinds:
        candidates.append(None)
    ok = []
    for value in candidates:
        try:
            p.validate(name, value)
        except kvdrop.PolicyParamError:
            continue
        ok.append(value)
    return ok


@st.composite
def cases(draw: st.DrawFn, name: str) -> dict[str, Any]:
    info = kvdrop.describe(name)
    names = declared(name)
    head_dim = draw(st.sampled_from([2, 4, 8]))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2]))
    num_tokens = draw(st.integers(1, 160))
    chunk = draw(st.sampled_from([1, 4, 16, 32]))
    params: dict[str, Any] = {}
    for p in info.params:
        if p.name in SHAPED:
            continue
        values = domain(name, p)
        if values:
            params[p.name] = draw(st.sampled_from(values))
        elif p.name in info.example:
            params[p.name] = info.example[p.name]
    params["chunk_size"] = chunk
    if draw(st.booleans()):
        params["keep_ratio"] = draw(st.floats(0.01, 1.0))
    else:
        params["keep_tokens"] = draw(st.integers(1, 200))
    if "head_dim" in names:
        params["head_dim"] = head_dim
    dtype = draw(st.sampled_from(DTYPES))
    layers = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, layers, num_tokens, kv_heads * head_dim, generator=gen).to(dtype)
    query = torch.randn(1, layers, num_tokens, kv_heads * group * head_dim, generator=gen).to(dtype)
    # Distinct ids so every kept token maps back to exactly one input index.
    tokens = torch.randperm(10 * num_tokens + 10, generator=gen)[:num_tokens].tolist()
    # Per-token scores of the engine's reconstruction pass, for policies that read them.
    scores = torch.rand(layers, kv_heads, num_tokens, generator=gen)
    return {"params": params, "kv": kv, "query": query, "tokens": tokens, "scores": scores}


def context_for(fn: Any, case: dict[str, Any]) -> EditContext | None:
    """An edit context with the case's token scores for a policy that declares them."""
    if not fn.token_scores:
        return None
    return EditContext.of(case["kv"].shape[2], token_scores=case["scores"])


def expected_count(params: dict[str, Any], num_tokens: int) -> int:
    """The contract's budget: aligned down to chunk_size, at least one chunk, at most T."""
    chunk = params["chunk_size"]
    raw = params.get("keep_tokens")
    if raw is None:
        raw = int(params["keep_ratio"] * num_tokens + 1e-9)
    return min(max(chunk, raw - raw % chunk), num_tokens)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.filterwarnings("ignore::kvdrop.errors.PolicyWarning")  # tiny budgets, many parts
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_policy_invariants(name: str, data: st.DataObject) -> None:
    case = data.draw(cases(name))
    kv, query, tokens, params = case["kv"], case["query"], case["tokens"], case["params"]
    kv_before, q_before = kv.clone(), query.clone()
    fn = kvdrop.get(name, **params)
    context = context_for(fn, case)
    out, kept = fn({CacheKind.KV: kv, CacheKind.QUERY: query}, tokens, context=context)

    num_tokens = kv.shape[2]
    count = expected_count(params, num_tokens)
    assert out.dim() == 4 and out.shape[:2] == kv.shape[:2] and out.shape[3] == kv.shape[3]
    assert out.dtype == kv.dtype and out.device == kv.device
    assert out.shape[2] == len(kept) == count
    if count == num_tokens:
        assert list(kept) == tokens and torch.equal(out, kv)
    else:
        assert count % params["chunk_size"] == 0
    index = {t: i for i, t in enumerate(tokens)}
    positions = [index[t] for t in kept]
    assert all(a < b for a, b in itertools.pairwise(positions)), "kept tokens must keep order"
    assert torch.equal(out, kv[:, :, positions]), "kept rows must be the input rows, bit-identical"
    assert torch.equal(kv, kv_before) and torch.equal(query, q_before), "inputs were modified"

    out2, kept2 = kvdrop.get(name, **params)(
        {ForeignKind.KV: kv, ForeignKind.QUERY: query}, tokens, context=context
    )
    assert list(kept2) == list(kept) and torch.equal(out2, out), "not deterministic"


@pytest.mark.parametrize("name", POLICIES)
def test_invalid_parameters_name_the_parameter(name: str) -> None:
    example = dict(kvdrop.describe(name).example)
    with pytest.raises(kvdrop.PolicyParamError, match="keep_ratio"):
        kvdrop.get(name, **example, keep_ratio=0.0)
    with pytest.raises(kvdrop.PolicyParamError, match="keep_ratio"):
        kvdrop.get(name, **example, keep_ratio=1.5)
    with pytest.raises(kvdrop.PolicyParamError, match="keep_ratio"):
        kvdrop.get(name, **example, keep_ratio="half")
    with pytest.raises(kvdrop.PolicyParamError, match="chunk_size"):
        kvdrop.get(name, **example, chunk_size=0)
    with pytest.raises(kvdrop.PolicyParamError, match="not both"):
        kvdrop.get(name, **example, keep_ratio=0.5, keep_tokens=256)
    with pytest.raises(kvdrop.PolicyParamError, match="bogus"):
        kvdrop.get(name, **example, bogus=1)


@pytest.mark.parametrize("name", POLICIES)
def test_wrongly_shaped_inputs_raise(name: str) -> None:
    fn = kvdrop.get(name, **dict(kvdrop.describe(name).example), keep_tokens=4, chunk_size=4)
    needs_query = kvdrop.describe(name).needs_query
    kv = torch.randn(2, 2, 16, 8)
    query = torch.randn(1, 2, 16, 8)
    with pytest.raises(kvdrop.PolicyInputError, match=r"\[2, L, T, D\]"):
        fn({CacheKind.KV: kv[0], CacheKind.QUERY: query}, list(range(16)))
    with pytest.raises(kvdrop.PolicyInputError, match="token ids"):
        fn({CacheKind.KV: kv, CacheKind.QUERY: query}, list(range(15)))
    with pytest.raises(kvdrop.PolicyInputError, match="no KV tensor"):
        fn({CacheKind.QUERY: query}, list(range(16)))
    if needs_query:
        with pytest.raises(kvdrop.MissingQueryError, match="--enable transfer_query"):
            fn({CacheKind.KV: kv}, list(range(16)))
    if fn.token_scores:
        with pytest.raises(kvdrop.MissingTokenScoresError, match="reconstruction pass"):
            fn({CacheKind.KV: kv, CacheKind.QUERY: query}, list(range(16)))


@pytest.mark.parametrize("name", POLICIES)
def test_policy_objects_say_what_describe_says(name: str) -> None:
    info = kvdrop.describe(name)
    fn = kvdrop.get(name, **dict(info.example))
    assert isinstance(fn, kvdrop.Policy)
    assert fn.needs_query is info.needs_query
