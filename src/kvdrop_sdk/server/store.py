"""Chunk bookkeeping of the L1 pool: allocator, key -> slot map, LRU eviction, pins and leases.

Only metadata lives here; the bytes live in ``pool.Pool``. A chunk is first *reserved* (invisible
to readers) while its bytes are written, then *committed*. Readers *pin* committed chunks under a
lease; pinned or reserved chunks are never evicted. Leases expire so a crashed client cannot leak
the pool; every allocation gets a fresh generation number so a reader whose lease expired can tell
whether its chunks were evicted (and possibly overwritten) in the meantime.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvdrop_sdk.layout import CacheLayout

__all__ = ["ALIGN", "Allocator", "ChunkStore", "StoreError"]

#: Slot offsets and sizes are rounded up to this many bytes (page aligned copies).
ALIGN = 4096


class StoreError(Exception):
    """A store operation was refused; ``code`` is sent back to the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Allocator:
    """First-fit allocator over ``[start, end)`` with coalescing of adjacent free blocks."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self._offsets: list[int] = [start] if end > start else []
        self._sizes: list[int] = [end - start] if end > start else []
        self.used = 0

    @property
    def capacity(self) -> int:
        """Bytes this allocator manages."""
        return self.end - self.start

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free block of ``nbytes`` (aligned), or None when nothing fits."""
        size = _align(nbytes)
        for i, free in enumerate(self._sizes):
            if free >= size:
                off = self._offsets[i]
                if free == size:
                    del self._offsets[i]
                    del self._sizes[i]
                else:
                    self._offsets[i] += size
                    self._sizes[i] -= size
                self.used += size
                return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a block from ``alloc``; merges with free neighbours."""
        size = _align(nbytes)
        i = bisect.bisect_left(self._offsets, offset)
        self._offsets.insert(i, offset)
        self._sizes.insert(i, size)
        self.used -= size
        if i + 1 < len(self._offsets) and offset + size == self._offsets[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._offsets[i + 1]
        if i > 0 and self._offsets[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += self._sizes.pop(i)
            del self._offsets[i]


@dataclass
class _Entry:
    offset: int
    nbytes: int
    gen: int
    committed: bool = False
    pins: int = 0


@dataclass
class _Lease:
    write: bool
    items: list[tuple[bytes, int]]
    expiry: float
    stored: int = 0


@dataclass
class _Stats:
    hits: int = 0
    misses: int = 0
    hit_chunks: int = 0
    lookups: int = 0
    stores: int = 0
    duplicate_chunks: int = 0
    evictions: int = 0
    dropped_chunks: int = 0
    expired_leases: int = 0


class ChunkStore:
    """Thread-safe map of chunk keys to pool slots: LRU eviction, leased pins and reservations."""

    def __init__(self, start: int, end: int, clock: Any = time.monotonic) -> None:
        self._alloc = Allocator(start, end)
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._leases: dict[int, _Lease] = {}
        self._layouts: dict[tuple[str, str], CacheLayout] = {}
        self._gens = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._clock = clock
        self._lock = threading.Lock()
        self.stats = _Stats()

    # -- layouts -------------------------------------------------------------------------------
    def register(self, model: str, kind: str, layout: CacheLayout) -> CacheLayout:
        """Register ``layout`` for (model, kind); re-registering a different layout is refused
        (one without RoPE parameters matches one with them, which are kept)."""
        with self._lock:
            old = self._layouts.get((model, kind))
            if old is not None:
                try:
                    layout = old.merged(layout)
                except ValueError:
                    raise StoreError(
                        "layout_conflict",
                        f"model {model!r} kind {kind!r} is registered with {old.to_json()}, "
                        f"not {layout.to_json()}; restart the server to change a layout",
                    ) from None
            self._layouts[(model, kind)] = layout
            return layout

    def layout(self, model: str, kind: str) -> CacheLayout | None:
        """The registered layout of (model, kind), or None."""
        with self._lock:
            return self._layouts.get((model, kind))

    def layouts(self) -> list[dict[str, Any]]:
        """Every registered layout as JSON rows."""
        with self._lock:
            return [
                {"model": m, "kind": k, "layout": lay.to_json()}
                for (m, k), lay in sorted(self._layouts.items())
            ]

    # -- internals (lock held) -----------------------------------------------------------------
    def _expire(self) -> None:
        now = self._clock()
        for lid in [lid for lid, lease in self._leases.items() if lease.expiry <= now]:
            self.stats.expired_leases += 1
            self._end_lease(lid)

    def _end_lease(self, lid: int) -> _Lease | None:
        lease = self._leases.pop(lid, None)
        if lease is None:
            return None
        for key, gen in lease.items:
            entry = self._entries.get(key)
            if entry is None or entry.gen != gen:
                continue
            if lease.write:
                if not entry.committed:
                    self._drop(key)
            else:
                entry.pins -= 1
        return lease

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._lru.pop(key, None)
        self._alloc.free(entry.offset, entry.nbytes)

    def _allocate(self, nbytes: int) -> int | None:
        while True:
            off = self._alloc.alloc(nbytes)
            if off is not None:
                return off
            victim = next((k for k in self._lru if self._entries[k].pins == 0), None)
            if victim is None:
                return None
            self._drop(victim)
            self.stats.evictions += 1

    def _prefix(self, keys: list[bytes]) -> list[bytes]:
        found = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.committed:
                break
            found.append(key)
        return found

    def _new_lease(self, write: bool, items: list[tuple[bytes, int]], lease_s: float) -> int:
        lid = next(self._lease_ids)
        self._leases[lid] = _Lease(write, items, self._clock() + lease_s)
        return lid

    # -- operations ----------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """How many leading chunks of ``keys`` are committed (no pins, no LRU update)."""
        with self._lock:
            self._expire()
            self.stats.lookups += 1
            return len(self._prefix(keys))

    def pin(self, keys: list[bytes], lease_s: float) -> tuple[int | None, list[tuple[int, int]]]:
        """Pin the longest committed prefix; returns (lease id or None on a miss, slots)."""
        with self._lock:
            self._expire()
            found = self._prefix(keys)
            if not found:
                self.stats.misses += 1
                return None, []
            self.stats.hits += 1
            self.stats.hit_chunks += len(found)
            items = []
            slots = []
            for key in found:
                entry = self._entries[key]
                entry.pins += 1
                self._lru.move_to_end(key)
                items.append((key, entry.gen))
                slots.append((entry.offset, entry.nbytes))
            return self._new_lease(False, items, lease_s), slots

    def release(self, lid: int) -> int:
        """Unpin a read lease; returns how many leading chunks were still intact (not evicted)."""
        with self._lock:
            self._expire()
            lease = self._leases.get(lid)
            if lease is not None and lease.write:
                raise StoreError("bad_lease", f"lease {lid} is a write reservation, not a pin")
            if lease is None:
                return 0
            self._end_lease(lid)
            return len(lease.items)

    def reserve(
        self, keys: list[bytes], nbytes: int, lease_s: float
    ) -> tuple[int | None, list[tuple[int, int]], int, int]:
        """Reserve slots for the chunks of ``keys`` not present yet.

        Returns (lease id or None, [(chunk index, offset)], duplicate count, dropped count).
        Chunks present (committed or being written by another client) are skipped: first copy
        wins. Chunks that do not fit even after evicting every unpinned chunk are dropped.
        """
        with self._lock:
            self._expire()
            if _align(nbytes) > self._alloc.capacity:
                raise StoreError(
                    "too_large",
                    f"a chunk of {nbytes} bytes does not fit in the pool of "
                    f"{self._alloc.capacity} bytes; start the server with a larger --l1-size-gb",
                )
            for key in keys:
                if key in self._lru:
                    self._lru.move_to_end(key)
            items: list[tuple[bytes, int]] = []
            slots: list[tuple[int, int]] = []
            duplicates = dropped = 0
            for i, key in enumerate(keys):
                if key in self._entries:
                    duplicates += 1
                    continue
                off = self._allocate(nbytes)
                if off is None:
                    dropped = len(keys) - i
                    break
                gen = next(self._gens)
                self._entries[key] = _Entry(off, nbytes, gen)
                items.append((key, gen))
                slots.append((i, off))
            self.stats.duplicate_chunks += duplicates
            self.stats.dropped_chunks += dropped
            if not items:
                return None, [], duplicates, dropped
            return self._new_lease(True, items, lease_s), slots, duplicates, dropped

    def commit(self, lid: int) -> int:
        """Make a reservation's chunks visible; returns how many were committed."""
        with self._lock:
            self._expire()
            lease = self._leases.get(lid)
            if lease is None or not lease.write:
                raise StoreError(
                    "lease_expired",
                    f"reservation {lid} is unknown or expired; nothing was stored",
                )
            del self._leases[lid]
            stored = 0
            for key, gen in lease.items:
                entry = self._entries.get(key)
                if entry is None or entry.gen != gen:
                    continue
                entry.committed = True
                self._lru[key] = None
                stored += 1
            self.stats.stores += stored
            return stored

    def abort(self, lid: int) -> None:
        """Drop a reservation without storing (unknown ids are ignored)."""
        with self._lock:
            lease = self._leases.get(lid)
            if lease is not None and lease.write:
                self._end_lease(lid)

    def snapshot(self) -> dict[str, Any]:
        """Pool usage and counters for ``/status``."""
        with self._lock:
            self._expire()
            s = self.stats
            return {
                "pool_bytes_used": self._alloc.used,
                "pool_bytes_total": self._alloc.capacity,
                "objects": len(self._lru),
                "reserved_objects": len(self._entries) - len(self._lru),
                "pinned_objects": sum(1 for e in self._entries.values() if e.pins),
                "active_leases": len(self._leases),
                "hits": s.hits,
                "misses": s.misses,
                "hit_chunks": s.hit_chunks,
                "lookups": s.lookups,
                "stores": s.stores,
                "duplicate_chunks": s.duplicate_chunks,
                "dropped_chunks": s.dropped_chunks,
                "evictions": s.evictions,
                "expired_leases": s.expired_leases,
            }
