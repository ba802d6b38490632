"""The one owner of "what does this edit read": ``needs_of`` (one default, upstream's) and the
engine capture ``QueryCapture.for_policies`` derives from the needs of every policy."""

from __future__ import annotations

from typing import Any

import pytest

import kvdrop
from kvdrop.function_policy import FunctionPolicy
from kvdrop_sdk.query_capture import (
    DEFAULT_QUERY_STRIDE,
    UPSTREAM_NEEDS,
    KVNeed,
    Needs,
    QueryCapture,
    QueryNeed,
    needs_of,
)


def plain(tensors: Any, tokens: Any) -> Any:
    return tensors, tokens


class Declares:
    """An edit function declaring both needs on its class."""

    queries = QueryNeed.WINDOW
    token_scores = True

    def __call__(self, tensors: Any, tokens: Any) -> Any:
        return tensors, tokens


def test_a_function_that_declares_nothing_gets_upstreams_full_queries() -> None:
    assert needs_of(plain) == UPSTREAM_NEEDS == Needs(QueryNeed.FULL, False)
    assert needs_of(Declares()) == Needs(QueryNeed.WINDOW, True)
    assert needs_of(plain, default=Needs(QueryNeed.NONE)) == Needs(QueryNeed.NONE)
    assert needs_of(kvdrop.get("knorm")) == Needs(QueryNeed.NONE, kv=KVNeed.KEYS)
    assert needs_of(kvdrop.get("kvzip")) == Needs(QueryNeed.NONE, True, KVNeed.NONE)


class KeysOnly:
    """A plain function that declares it reads the keys only."""

    reads_values = False

    def __call__(self, tensors: Any, tokens: Any) -> Any:
        return tensors, tokens


class ShapeOnly(KeysOnly):
    reads_keys = False


def test_the_kv_an_edit_reads_comes_from_reads_values_and_reads_keys() -> None:
    """Undeclared: all of it (upstream's); the scorers' flags: keys only or nothing."""
    assert needs_of(plain).kv is KVNeed.ALL
    assert needs_of(KeysOnly()).kv is KVNeed.KEYS
    assert needs_of(ShapeOnly()).kv is KVNeed.NONE
    assert needs_of(plain, default=Needs(kv=KVNeed.NONE)).kv is KVNeed.NONE
    read = {name: needs_of(kvdrop.get(name)).kv for name in ("chunk-halving", "streaming")}
    assert read == {"chunk-halving": KVNeed.NONE, "streaming": KVNeed.NONE}
    assert needs_of(kvdrop.get("random")).kv is KVNeed.NONE
    assert needs_of(kvdrop.get("snapkv")).kv is KVNeed.KEYS
    assert needs_of(kvdrop.get("value-norm")).kv is KVNeed.ALL
    # A composition reads the widest of its parts; a plain function's policy all of the KV.
    assert Needs(kv=KVNeed.NONE) | Needs(kv=KVNeed.KEYS) == Needs(kv=KVNeed.KEYS)
    assert needs_of(FunctionPolicy("shape", ShapeOnly())).kv is KVNeed.ALL
    with pytest.raises(ValueError, match="kv must be one of"):
        Needs(kv="values")  # type: ignore[arg-type]


def test_needs_combine_to_the_widest_and_refuse_bad_values() -> None:
    assert Needs(QueryNeed.NONE, True) | Needs(QueryNeed.WINDOW) == Needs(QueryNeed.WINDOW, True)
    assert Needs("window") == Needs(QueryNeed.WINDOW)
    with pytest.raises(ValueError, match="queries must be one of"):
        Needs("some")
    with pytest.raises(ValueError, match="token_scores must be a bool"):
        Needs(QueryNeed.NONE, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "mode", "expected"),
    [
        ("knorm", "auto", QueryNeed.NONE),
        ("knorm", "full", QueryNeed.NONE),  # no query policy: nothing captured either way
        ("snapkv", "auto", QueryNeed.WINDOW),
        ("snapkv", "window", QueryNeed.WINDOW),
        ("snapkv", "full", QueryNeed.FULL),
        ("last-queries", "window", QueryNeed.FULL),  # reads every cached token's query
    ],
)
def test_capture_follows_the_policies(policy: str, mode: Any, expected: QueryNeed) -> None:
    if policy not in kvdrop.available():
        pytest.skip("the example plugin is not installed")
    fn = kvdrop.get(policy, keep_ratio=0.5)
    assert QueryCapture.for_policies([fn], mode).mode is expected


def test_capture_takes_the_widest_need_and_says_what_it_serves() -> None:
    fns = [kvdrop.get(p, keep_ratio=0.5) for p in ("rkv", "snapkv", "h2o")]
    assert QueryCapture.for_policies(fns).mode is QueryNeed.WINDOW
    assert QueryCapture.for_policies([]) == QueryCapture()
    assert QueryCapture.for_policies([plain]).mode is QueryNeed.FULL
    capture = QueryCapture.for_policies([kvdrop.get("knorm"), kvdrop.get("kvzip")])
    assert capture.mode is QueryNeed.NONE and capture.scores and capture.uses_query_context
    assert capture.serves(Needs(QueryNeed.WINDOW, True)) == Needs(QueryNeed.NONE, True)
    assert QueryCapture(QueryNeed.FULL).serves(UPSTREAM_NEEDS) == UPSTREAM_NEEDS
    with pytest.raises(ValueError, match=r"query capture must be one of \('auto'"):
        QueryCapture.for_policies([], "none")  # type: ignore[arg-type]


def test_the_strided_sample_is_captured_only_for_a_policy_that_reads_it() -> None:
    """snapkv, tova, rkv and finch read the last rows only: their capture stores no strided
    sample (stride 0); h2o's accumulated attention reads it, and so does any union with h2o or
    a function that does not say (upstream's default)."""
    lean = [kvdrop.get(p, keep_ratio=0.5) for p in ("snapkv", "tova", "rkv", "finch")]
    assert {needs_of(fn).query_sample for fn in lean} == {False}
    assert QueryCapture.for_policies(lean).stride == 0
    assert QueryCapture.for_policies(lean, "window", stride=16).stride == 0
    h2o = kvdrop.get("h2o", keep_ratio=0.5)
    assert QueryCapture.for_policies([h2o]).stride == DEFAULT_QUERY_STRIDE
    assert QueryCapture.for_policies([*lean, h2o], stride=16).stride == 16
    assert QueryCapture.for_policies([*lean, Declares()]).stride == DEFAULT_QUERY_STRIDE
    # A part that reads no queries wants no sample; a composition asks its parts.
    assert QueryCapture.for_policies([*lean, kvdrop.get("knorm")]).stride == 0
    assert QueryCapture.for_policies([kvdrop.get("streaming+snapkv")]).stride == 0
    assert QueryCapture.for_policies([kvdrop.get("knorm+h2o")]).stride == DEFAULT_QUERY_STRIDE
    with pytest.raises(ValueError, match="query_sample must be a bool"):
        Needs(QueryNeed.WINDOW, query_sample=1)  # type: ignore[arg-type]
