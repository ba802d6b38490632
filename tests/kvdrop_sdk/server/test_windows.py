"""The server's window store: keyed by kind and every token, first copy wins, LRU bounded."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest

from kvdrop_sdk.server.windows import (
    RECORD_OVERHEAD_BYTES,
    ScoresRecord,
    WindowRecord,
    WindowStore,
    window_key,
)


def record(rows: int, size: int = 100, tag: tuple[str, str] = ("m", "query")) -> WindowRecord:
    return WindowRecord(rows, "float32", b"p" * 8 * rows, b"d" * size, tag=tag)


def test_key_covers_model_kind_salt_and_every_token() -> None:
    base = window_key("m", "query", "s", b"\x01" * 16)
    assert base != window_key("m", "query", "s", b"\x01" * 8)
    assert base != window_key("m", "query", "t", b"\x01" * 16)
    assert base != window_key("n", "query", "s", b"\x01" * 16)
    assert base != window_key("m", "kv", "s", b"\x01" * 16)  # the kind is part of the key
    assert window_key("ab", "c", "", b"") != window_key("a", "bc", "", b"")  # length-prefixed


def test_first_copy_wins_and_lru_evicts_by_bytes() -> None:
    o = RECORD_OVERHEAD_BYTES  # each record counts its heap overhead too
    store = WindowStore(5000)
    assert store.put(b"a", record(6))
    assert not store.put(b"a", record(2))  # a second put for the same call is not kept...
    assert not store.put(b"a", record(7))  # ...even with more rows (it could be anyone's)
    assert store.get(b"a").rows == 6
    for name in (b"b", b"c", b"d", b"e", b"f"):  # 158 + o bytes each
        assert store.put(name, record(1, 150))
    assert store.get(b"a") is not None  # a is now the most recently used
    assert store.put(b"g", record(1, 150))  # over 5000: the least recently used (b) goes
    assert store.get(b"b") is None and store.get(b"a") is not None
    snap = store.snapshot()
    assert snap == {
        "windows": 6,
        "window_bytes": 148 + o + 5 * (158 + o),
        "window_capacity_bytes": 5000,
        "window_evictions": 1,
    }
    assert not store.put(b"huge", record(1, 5000))  # larger than everything: refused
    assert store.held(("m", "query")) == 6 and store.held(("m", "kv")) == 0
    with pytest.raises(ValueError, match="capacity_bytes"):
        WindowStore(0)


def test_the_bound_counts_what_records_really_cost() -> None:
    """4-byte score records cost hundreds of bytes of heap each: a store "full" by payload alone
    would be many times its bound (issue 28 A)."""
    capacity = 1 << 20
    store = WindowStore(capacity)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):  # about 8x what fits with the overhead counted
            key = hashlib.sha256(i.to_bytes(8, "little")).digest()
            store.put(key, ScoresRecord(1, 1, 1, bytes(bytearray(4)), ("m##query", "query")))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.snapshot()["window_bytes"] <= capacity
    assert grown <= 1.25 * capacity, f"{grown / 2**20:.1f} MiB for a bound of 1 MiB"
