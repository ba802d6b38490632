"""The server's window store: keyed by kind and every token, first copy wins, LRU bounded."""

from __future__ import annotations

import pytest

from kvdrop_sdk.server.windows import WindowRecord, WindowStore, window_key


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
    store = WindowStore(1000)
    assert store.put(b"a", record(6))
    assert not store.put(b"a", record(2))  # a second put for the same call is not kept...
    assert not store.put(b"a", record(7))  # ...even with more rows (it could be anyone's)
    assert store.get(b"a").rows == 6
    for name in (b"b", b"c", b"d", b"e", b"f"):  # 158 bytes each: 148 + 5 * 158 = 938
        assert store.put(name, record(1, 150))
    assert store.get(b"a") is not None  # a is now the most recently used
    assert store.put(b"g", record(1, 150))  # 1096 > 1000: the least recently used (b) goes
    assert store.get(b"b") is None and store.get(b"a") is not None
    snap = store.snapshot()
    assert snap == {
        "windows": 6,
        "window_bytes": 938,
        "window_capacity_bytes": 1000,
        "window_evictions": 1,
    }
    assert not store.put(b"huge", record(1, 2000))  # larger than everything: refused
    assert store.held(("m", "query")) == 6 and store.held(("m", "kv")) == 0
    with pytest.raises(ValueError, match="capacity_bytes"):
        WindowStore(0)
