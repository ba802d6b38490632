"""CacheKind: parsing, and the one rule for query tensors' server model names."""

from __future__ import annotations

import enum

import pytest

from kvdrop_sdk.cache_kind import CacheKind


def test_parse_accepts_values_and_foreign_enums() -> None:
    class Other(enum.Enum):
        QUERY = "query"

    assert CacheKind.parse("kv") is CacheKind.KV
    assert CacheKind.parse(Other.QUERY) is CacheKind.QUERY
    with pytest.raises(ValueError, match="unknown cache kind 'v'"):
        CacheKind.parse("v")


def test_server_model_names() -> None:
    assert CacheKind.KV.server_model_name("m") == "m"
    assert CacheKind.QUERY.server_model_name("m") == "m##query"
    assert CacheKind.QUERY.server_model_name("m##query") == "m##query"  # idempotent
    for name in ("m", "org/model-7b"):
        for kind in CacheKind:
            assert CacheKind.base_model_name(kind.server_model_name(name)) == name
