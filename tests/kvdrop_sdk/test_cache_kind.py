"""CacheKind: parsing, and the one rule for query tensors' server model names."""

from __future__ import annotations

import enum

import pytest

from kvdrop_sdk.cache_kind import CacheKind, KindMap


def test_parse_accepts_values_and_foreign_enums() -> None:
    class Other(enum.Enum):
        QUERY = "query"

    assert CacheKind.parse("kv") is CacheKind.KV
    assert CacheKind.parse(Other.QUERY) is CacheKind.QUERY
    with pytest.raises(ValueError, match="unknown cache kind 'v'"):
        CacheKind.parse("v")


def test_server_model_names_follow_upstream() -> None:
    assert CacheKind.KV.server_model_name("m") == "m"
    assert CacheKind.QUERY.server_model_name("m") == "m##query"
    # As upstream's LMCacheSDKCacheKind: the suffix is always appended, and only QUERY strips it.
    assert CacheKind.QUERY.server_model_name("m##query") == "m##query##query"
    assert CacheKind.KV.base_model_name("m##query") == "m##query"
    for name in ("m", "org/model-7b"):
        for kind in CacheKind:
            assert kind.base_model_name(kind.server_model_name(name)) == name


def test_kind_map_finds_kinds_by_value() -> None:
    class Foreign(enum.Enum):  # hashes and compares like LMCache's own enum: by identity
        KV = "kv"
        QUERY = "query"

    kv, q = object(), object()
    m = KindMap({CacheKind.KV: kv, CacheKind.QUERY: q})
    assert m[Foreign.KV] is kv and m["query"] is q and m[CacheKind.QUERY] is q
    assert Foreign.QUERY in m and "kv" in m and m.get(Foreign.KV) is kv
    only_kv = KindMap({CacheKind.KV: kv})
    assert Foreign.QUERY not in only_kv and only_kv.get(Foreign.QUERY, 7) == 7
    with pytest.raises(KeyError, match="no 'query' tensor \\(have: 'kv'\\)"):
        only_kv[Foreign.QUERY]
    assert list(m) == [CacheKind.KV, CacheKind.QUERY]
