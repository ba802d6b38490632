"""The server's window store: keyed by the whole token list, the richer record kept, LRU bounded."""

from __future__ import annotations

import pytest

from kvdrop_sdk.server.windows import WindowRecord, WindowStore, window_key


def record(rows: int, size: int = 100) -> WindowRecord:
    return WindowRecord(rows, "float32", b"p" * 8 * rows, b"d" * size)


def test_key_covers_model_salt_and_every_token() -> None:
    base = window_key("m", "s", b"\x01" * 16)
    assert base != window_key("m", "s", b"\x01" * 8)
    assert base != window_key("m", "t", b"\x01" * 16) != window_key("n", "s", b"\x01" * 16)
    assert window_key("ab", "c", b"") != window_key("a", "bc", b"")  # length-prefixed fields


def test_more_rows_win_and_lru_evicts_by_bytes() -> None:
    store = WindowStore(1000)
    assert store.put(b"a", record(4))
    assert not store.put(b"a", record(2))  # a poorer record for the same call is not kept
    assert store.get(b"a").rows == 4
    assert store.put(b"a", record(6))  # a richer one replaces it
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
    with pytest.raises(ValueError, match="capacity_bytes"):
        WindowStore(0)
