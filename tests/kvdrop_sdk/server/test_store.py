"""ChunkStore and Allocator bookkeeping, with a fake clock (no server process)."""

from __future__ import annotations

import pytest
import torch

from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.server.config import ServerConfig
from kvdrop_sdk.server.store import ALIGN, Allocator, ChunkStore, StoreError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(*names: str) -> list[bytes]:
    return [n.encode().ljust(32, b"_") for n in names]


def test_allocator_first_fit_and_coalescing() -> None:
    a = Allocator(ALIGN, ALIGN * 11)
    offs = [a.alloc(ALIGN) for _ in range(10)]
    assert offs == [ALIGN * (i + 1) for i in range(10)]
    assert a.alloc(1) is None and a.used == a.capacity
    for i in (1, 3, 2):  # free three neighbours in scrambled order: they merge
        a.free(offs[i], ALIGN)
    assert a.alloc(3 * ALIGN) == offs[1]
    a.free(offs[0], 10)  # sizes round up to ALIGN
    assert a.alloc(ALIGN - 5) == offs[0]
    for off in offs:
        a.free(off, ALIGN)
    assert a.used == 0 and a.alloc(10 * ALIGN) == ALIGN


def make_store(slots: int = 4) -> tuple[ChunkStore, Clock]:
    clock = Clock()
    return ChunkStore(0, slots * ALIGN, clock=clock), clock


def put(store: ChunkStore, names: list[bytes]) -> int:
    lid, _, _, _ = store.reserve(names, ALIGN, 10)
    return store.commit(lid) if lid is not None else 0


def test_lru_evicts_least_recently_used_unpinned() -> None:
    store, _ = make_store(4)
    assert put(store, keys("a", "b", "c", "d")) == 4
    lid, slots = store.pin(keys("a"), 10)  # a is now most recent and pinned
    assert len(slots) == 1
    assert put(store, keys("e")) == 1  # evicts b
    assert store.lookup(keys("b")) == 0
    assert store.lookup(keys("a")) == 1
    assert put(store, keys("f", "g", "h")) == 3  # evicts c, d, e; never the pinned a
    assert store.lookup(keys("a")) == 1 and store.lookup(keys("c")) == 0
    assert store.stats.evictions == 4
    assert store.release(lid) == 1
    assert put(store, keys("i")) == 1  # now a can go (it is the LRU unpinned chunk)
    assert store.lookup(keys("a")) == 0


def test_prefix_stops_at_first_missing_chunk() -> None:
    store, _ = make_store(4)
    put(store, keys("a", "b", "c"))
    lid, _, _, _ = store.reserve(keys("x"), ALIGN, 10)  # x reserved, not committed
    store.abort(lid)
    assert store.lookup(keys("a", "b", "c", "d")) == 3
    assert store.lookup(keys("a", "x", "c")) == 1
    assert store.pin(keys("z", "a"), 10) == (None, [])
    assert store.stats.misses == 1


def test_reserve_skips_present_and_reports_duplicates_and_dropped() -> None:
    store, _ = make_store(3)
    put(store, keys("a"))
    pins = [store.pin(keys("a"), 10)[0]]
    lid, slots, dup, dropped = store.reserve(keys("a", "b", "c", "d"), ALIGN, 10)
    assert dup == 1 and dropped == 1 and [i for i, _ in slots] == [1, 2]
    lid2, _, dup2, _ = store.reserve(keys("b"), ALIGN, 10)
    assert lid2 is None and dup2 == 1  # reserved by another writer: first copy wins
    assert store.commit(lid) == 2
    assert store.snapshot()["duplicate_chunks"] == 2
    assert pins[0] is not None
    with pytest.raises(StoreError, match="does not fit") as info:
        store.reserve(keys("big"), 4 * ALIGN, 10)
    assert info.value.code == "too_large"


def test_leases_expire_and_generations_detect_reuse() -> None:
    store, clock = make_store(2)
    put(store, keys("a", "b"))
    lid, _ = store.pin(keys("a", "b"), 5)
    wlid, _, _, dropped = store.reserve(keys("c"), ALIGN, 5)
    assert wlid is None and dropped == 1  # both slots pinned
    clock.now = 6  # the pin lapses (client crashed)
    assert store.snapshot()["pinned_objects"] == 0
    assert put(store, keys("c", "d")) == 2  # a and b evicted, their slots reused
    assert store.release(lid) == 0  # the late reader is told nothing it read is valid
    wlid, _, _, _ = store.reserve(keys("e"), ALIGN, 5)
    clock.now = 20
    with pytest.raises(StoreError) as info:
        store.commit(wlid)
    assert info.value.code == "lease_expired"
    assert store.lookup(keys("e")) == 0
    snap = store.snapshot()
    assert snap["expired_leases"] == 2 and snap["reserved_objects"] == 0
    assert snap["pool_bytes_used"] == ALIGN  # e evicted c, then e's reservation was dropped
    assert store.lookup(keys("d")) == 1


def test_expired_reservations_are_quarantined_until_their_writer_ends_them() -> None:
    """A writer stalled past its lease may still copy into its slots: they are not reused until
    it ends the lease (commit/abort) or ``quarantine_s`` passes."""
    clock = Clock()
    store = ChunkStore(0, 2 * ALIGN, clock=clock, quarantine_s=100)
    lid, _, _, _ = store.reserve(keys("a"), ALIGN, 5, owner="w1")
    clock.now = 6  # writer 1's lease lapses while it is stalled
    nlid, nslots, _, dropped = store.reserve(keys("a", "b"), ALIGN, 5, owner="w2")
    assert [off for _, off in nslots] == [ALIGN] and dropped == 1  # a's old slot is not handed on
    assert store.snapshot()["quarantined_bytes"] == ALIGN
    with pytest.raises(StoreError, match="expired"):
        store.commit(lid, owner="w1")  # writer 1 is back: done copying
    assert store.snapshot()["quarantined_bytes"] == 0
    assert store.commit(nlid, owner="w2") == 1
    assert put(store, keys("c")) == 1  # the freed slot is usable again
    # A writer that never comes back: the slot returns after quarantine_s.
    store.reserve(keys("d"), ALIGN, 5, owner="w3")
    clock.now = 20
    assert store.snapshot()["quarantined_bytes"] == ALIGN
    clock.now = 121
    assert store.snapshot()["quarantined_bytes"] == 0


def test_windows_hold_a_registration_like_chunks() -> None:
    held = {("m##query", "query"): 1}
    store = ChunkStore(0, 2 * ALIGN, holders=lambda tag: held.get(tag, 0))
    a = CacheLayout(1, 2, 8, torch.float32)
    store.register("m##query", "query", a)
    with pytest.raises(StoreError, match="1 query window"):
        store.register("m##query", "query", CacheLayout(1, 2, 8, torch.float16))
    held.clear()
    store.register("m##query", "query", CacheLayout(1, 2, 8, torch.float16))


def test_release_of_a_write_lease_is_refused() -> None:
    store, _ = make_store(2)
    wlid, _, _, _ = store.reserve(keys("a"), ALIGN, 5)
    with pytest.raises(StoreError, match="write reservation"):
        store.release(wlid)
    for unknown in (424242, "f" * 32, None):
        with pytest.raises(StoreError) as info:
            store.release(unknown)  # type: ignore[arg-type]
        assert info.value.code == "unknown_lease"


def test_leases_belong_to_their_owner() -> None:
    store, clock = make_store(4)
    put(store, keys("a", "b"))
    pin, _ = store.pin(keys("a", "b"), 5, owner="alice")
    res, _, _, _ = store.reserve(keys("c"), ALIGN, 5, owner="alice")
    assert isinstance(pin, str) and len(pin) == 32 and pin != res
    for call in (
        lambda: store.release(pin, owner="mallory"),
        lambda: store.commit(res, owner="mallory"),
        lambda: store.abort(res, owner="mallory"),
        lambda: store.release(pin),
    ):
        with pytest.raises(StoreError) as info:
            call()
        assert info.value.code == "unknown_lease"
    assert store.snapshot()["pinned_objects"] == 2 and store.lookup(keys("c")) == 0
    assert store.commit(res, owner="alice") == 1
    clock.now = 10  # the pin lapses: its owner learns "expired" (0 valid), others "unknown"
    with pytest.raises(StoreError, match="unknown"):
        store.release(pin, owner="mallory")
    assert store.release(pin, owner="alice") == 0
    with pytest.raises(StoreError, match="unknown"):  # told once; then it is gone
        store.release(pin, owner="alice")


def test_layout_registration_rules() -> None:
    store, _ = make_store(2)
    lay = CacheLayout(2, 2, 8, torch.float16)
    other = CacheLayout(2, 2, 8, torch.float32)
    assert store.register("m", "kv", other, owner="squatter") == other
    # No chunk stored under the first registration: a different layout replaces it.
    assert store.register("m", "kv", lay, owner="engine") == lay
    assert store.register("m", "kv", lay) == lay
    lid, _, _, _ = store.reserve(keys("a"), ALIGN, 5, tag=("m", "kv"))
    with pytest.raises(StoreError, match="holds 1 chunk") as info:
        store.register("m", "kv", other, owner="engine")
    assert info.value.code == "layout_conflict"
    store.abort(lid)  # the reservation's chunk is gone: the layout may change again
    assert store.register("m", "kv", other) == other
    assert store.layout("m", "query") is None
    assert store.layouts() == [{"model": "m", "kind": "kv", "layout": other.to_json()}]


def test_layout_registry_is_bounded() -> None:
    store = ChunkStore(0, 4 * ALIGN, max_layouts=3)
    lay = CacheLayout(2, 2, 8, torch.float16)
    for m in ("a", "b", "c"):
        store.register(m, "kv", lay)
    put_lid, _, _, _ = store.reserve(keys("x"), ALIGN, 5, tag=("a", "kv"))
    store.commit(put_lid)
    store.register("d", "kv", lay)  # evicts "b", the least recently used without chunks
    assert [r["model"] for r in store.layouts()] == ["a", "c", "d"]
    store.register("e", "kv", lay)
    store.register("f", "kv", lay)
    assert [r["model"] for r in store.layouts()] == ["a", "e", "f"]
    for m in ("e", "f"):
        store.reserve(keys(m), ALIGN, 5, tag=(m, "kv"))
    with pytest.raises(StoreError) as info:
        store.register("g", "kv", lay)
    assert info.value.code == "too_many_layouts"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 70000}, "--port"),
        ({"l1_size_gb": -1.0}, "--l1-size-gb"),
        ({"eviction_policy": "FIFO"}, "only LRU"),
        ({"shm_name": "../etc"}, "--shm-name"),
        ({"enable": ("transfer_kv",)}, "unknown feature"),
        ({"workers": 0}, "--workers"),
        ({"l1_size_gb": float("inf")}, "--l1-size-gb must be > 0 and finite"),
        ({"l1_size_gb": float("nan")}, "--l1-size-gb"),
        ({"http_timeout_s": float("inf")}, "--http-timeout-s"),
        ({"max_lease_s": 1e300}, "--max-lease-s"),
        ({"quarantine_s": -1.0}, "--quarantine-s"),
        ({"workers": True}, "--workers"),
    ],
)
def test_server_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


def test_server_config_defaults_match_the_document() -> None:
    cfg = ServerConfig()
    assert (cfg.host, cfg.port, cfg.http_port, cfg.chunk_size) == ("127.0.0.1", 6555, 8080, 256)
    assert cfg.l1_use_lazy and cfg.eviction_policy == "LRU" and not cfg.transfer_query
    assert ServerConfig(l1_size_gb=0.5).pool_bytes == 512 * 1024**2
