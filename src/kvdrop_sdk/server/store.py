"""Chunk bookkeeping of the L1 pool: allocator, key -> slot map, LRU eviction, pins and leases.

Only metadata lives here; the bytes live in ``pool.Pool``. A chunk is first *reserved* (invisible
to readers) while its bytes are written, then *committed*. Readers *pin* committed chunks under a
lease; pinned or reserved chunks are never evicted. Leases expire so a crashed client cannot leak
the pool; every allocation gets a fresh generation number so a reader whose lease expired can tell
whether its chunks were evicted (and possibly overwritten) in the meantime.

Quarantine: a shared-memory writer copies into its reserved slots itself, after the server said
where. A writer stalled past its reservation's lease could still be copying, so the slots of an
expired reservation are not handed on: their keys are forgotten (another client may store the same
chunk, into other slots) but the bytes stay allocated until the writer ends that lease (its
``commit`` or ``abort``, which the SDK sends after its copies, answered ``lease_expired``) or
``quarantine_s`` passes. So a late copy lands in a slot nobody reads.

Leases are owned: their ids are 128 random bits and only the owner (the client token the request
carried) may release, commit or abort one; anything else is answered like an id that never
existed (``unknown_lease``). The ids of recently expired leases are remembered (bounded) so their
owner learns "expired" rather than "unknown".

Layouts: one per (model, kind). Registering the same layout again is a no-op; a different one
replaces the registration only while nothing of that (model, kind) is held -- no chunk stored or
being written, and no query window (``holders``, the window store's count) -- so a client that
registered a wrong layout first cannot lock the real engine out, and is refused
(``layout_conflict``) once data exists. At most ``max_layouts`` registrations are kept; when full,
the least recently used registration without chunks makes room, else ``too_many_layouts``.
"""

from __future__ import annotations

import bisect
import itertools
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdrop_sdk.layout import CacheLayout

__all__ = [
    "ALIGN",
    "INTERNAL_OWNER",
    "MAX_LAYOUTS",
    "QUARANTINE_S",
    "Allocator",
    "ChunkStore",
    "StoreError",
]

#: Slot offsets and sizes are rounded up to this many bytes (page aligned copies).
ALIGN = 4096
#: Owner of the server's own pins (socket retrieves); client owners never look like it.
INTERNAL_OWNER = "server"
#: Largest number of (model, kind) layout registrations kept.
MAX_LAYOUTS = 1024
#: Longest an expired reservation's slots stay quarantined when its writer never comes back.
QUARANTINE_S = 600.0
_EXPIRED_MEMORY = 4096
Tag = tuple[str, str]


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
    tag: Tag | None = None
    committed: bool = False
    pins: int = 0


@dataclass
class _Lease:
    write: bool
    items: list[tuple[bytes, int]]
    expiry: float
    owner: str


@dataclass
class _Quarantine:
    """Slots of an expired reservation whose writer may still be copying into them."""

    owner: str
    blocks: list[tuple[int, int]]  # (offset, nbytes)
    until: float


@dataclass
class _Registration:
    layout: CacheLayout
    owner: str


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
    quarantined_chunks: int = 0


class ChunkStore:
    """Thread-safe map of chunk keys to pool slots: LRU eviction, leased pins and reservations."""

    def __init__(
        self,
        start: int,
        end: int,
        clock: Any = time.monotonic,
        *,
        max_layouts: int = MAX_LAYOUTS,
        quarantine_s: float = QUARANTINE_S,
        holders: Callable[[Tag], int] | None = None,
    ) -> None:
        self._alloc = Allocator(start, end)
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._leases: dict[str, _Lease] = {}
        self._expired: OrderedDict[str, tuple[str, bool]] = OrderedDict()  # id -> (owner, write)
        self._layouts: OrderedDict[Tag, _Registration] = OrderedDict()
        self._tag_chunks: Counter[Tag] = Counter()
        self.max_layouts = max_layouts
        self.quarantine_s = quarantine_s
        self._quarantine: dict[str, _Quarantine] = {}
        self._holders = holders or (lambda tag: 0)
        self._gens = itertools.count(1)
        self._clock = clock
        self._lock = threading.Lock()
        self.stats = _Stats()

    # -- layouts -------------------------------------------------------------------------------
    def register(self, model: str, kind: str, layout: CacheLayout, owner: str = "") -> CacheLayout:
        """Register ``layout`` for (model, kind) (see the module docstring for the rules); a
        layout without RoPE parameters matches one with them, which are kept."""
        tag = (model, kind)
        with self._lock:
            old = self._layouts.get(tag)
            if old is not None:
                try:
                    merged = old.layout.merged(layout)
                except ValueError:
                    pass
                else:
                    old.layout = merged
                    self._layouts.move_to_end(tag)
                    return merged
            chunks, windows = self._tag_chunks[tag], self._holders(tag)
            if old is not None and (chunks or windows):
                raise StoreError(
                    "layout_conflict",
                    f"model {model!r} kind {kind!r} is registered with {old.layout.to_json()}, "
                    f"not {layout.to_json()}, and holds {chunks} chunk(s) and {windows} query "
                    "window(s) stored under it; use another model name, or wait until they are "
                    "evicted",
                )
            if old is None and len(self._layouts) >= self.max_layouts:
                idle = next(
                    (t for t in self._layouts if not self._tag_chunks[t] and not self._holders(t)),
                    None,
                )
                if idle is None:
                    raise StoreError(
                        "too_many_layouts",
                        f"{len(self._layouts)} layouts are registered and each holds chunks; "
                        f"the server keeps at most {self.max_layouts}",
                    )
                del self._layouts[idle]
            self._layouts[tag] = _Registration(layout, owner)
            self._layouts.move_to_end(tag)
            return layout

    def layout(self, model: str, kind: str) -> CacheLayout | None:
        """The registered layout of (model, kind), or None."""
        with self._lock:
            reg = self._layouts.get((model, kind))
            return None if reg is None else reg.layout

    def layouts(self) -> list[dict[str, Any]]:
        """Every registered layout as JSON rows."""
        with self._lock:
            return [
                {"model": m, "kind": k, "layout": reg.layout.to_json()}
                for (m, k), reg in sorted(self._layouts.items())
            ]

    # -- internals (lock held) -----------------------------------------------------------------
    def _expire(self) -> None:
        now = self._clock()
        for lid in [lid for lid, q in self._quarantine.items() if q.until <= now]:
            self._unquarantine(lid)
        for lid in [lid for lid, lease in self._leases.items() if lease.expiry <= now]:
            self.stats.expired_leases += 1
            lease = self._end_lease(lid, expired=True)
            if lease is not None:
                self._expired[lid] = (lease.owner, lease.write)
                while len(self._expired) > _EXPIRED_MEMORY:
                    self._expired.popitem(last=False)

    def _owned(self, lid: Any, owner: str, write: bool) -> _Lease | None:
        """The live lease ``lid`` of ``owner``; None if it expired; StoreError if it is unknown,
        someone else's, or of the other kind (pin vs reservation)."""
        lease = self._leases.get(lid) if isinstance(lid, str) else None
        if lease is not None and lease.owner == owner:
            if lease.write != write:
                what = "a write reservation, not a pin" if lease.write else "a pin"
                raise StoreError("bad_lease", f"lease {lid} is {what}")
            return lease
        if isinstance(lid, str) and self._expired.get(lid) == (owner, write):
            return None
        raise StoreError(
            "unknown_lease", f"lease {lid!r} is unknown, already ended, or not this client's"
        )

    def _end_lease(self, lid: str, *, expired: bool = False) -> _Lease | None:
        """End lease ``lid``: unpin its chunks, or drop its uncommitted ones (quarantining their
        slots when it ``expired``: its writer may still be copying)."""
        lease = self._leases.pop(lid, None)
        if lease is None:
            return None
        held: list[tuple[int, int]] = []
        for key, gen in lease.items:
            entry = self._entries.get(key)
            if entry is None or entry.gen != gen:
                continue
            if lease.write:
                if not entry.committed:
                    self._drop(key, free=not expired)
                    held.append((entry.offset, entry.nbytes))
            else:
                entry.pins -= 1
        if expired and held:
            until = self._clock() + self.quarantine_s
            self._quarantine[lid] = _Quarantine(lease.owner, held, until)
            self.stats.quarantined_chunks += len(held)
        return lease

    def _unquarantine(self, lid: str) -> None:
        """Free the slots quarantined for the expired reservation ``lid`` (if any)."""
        q = self._quarantine.pop(lid, None)
        for offset, nbytes in q.blocks if q is not None else ():
            self._alloc.free(offset, nbytes)

    def _drop(self, key: bytes, *, free: bool = True) -> None:
        entry = self._entries.pop(key)
        self._lru.pop(key, None)
        if free:
            self._alloc.free(entry.offset, entry.nbytes)
        if entry.tag is not None:
            self._tag_chunks[entry.tag] -= 1
            if not self._tag_chunks[entry.tag]:
                del self._tag_chunks[entry.tag]

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

    def _new_lease(
        self, write: bool, items: list[tuple[bytes, int]], lease_s: float, owner: str
    ) -> str:
        lid = secrets.token_hex(16)
        self._leases[lid] = _Lease(write, items, self._clock() + lease_s, owner)
        return lid

    # -- operations ----------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> int:
        """How many leading chunks of ``keys`` are committed (no pins, no LRU update)."""
        with self._lock:
            self._expire()
            self.stats.lookups += 1
            return len(self._prefix(keys))

    def pin(
        self, keys: list[bytes], lease_s: float, *, owner: str = ""
    ) -> tuple[str | None, list[tuple[int, int]]]:
        """Pin the longest committed prefix for ``owner``; returns (lease id or None on a miss,
        [(offset, nbytes)])."""
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
            return self._new_lease(False, items, lease_s, owner), slots

    def release(self, lid: str, *, owner: str = "") -> int:
        """Unpin ``owner``'s read lease; returns how many leading chunks were still intact (0 when
        the lease had expired: they may have been evicted and overwritten)."""
        with self._lock:
            self._expire()
            lease = self._owned(lid, owner, write=False)
            if lease is None:
                self._expired.pop(lid, None)
                return 0
            self._end_lease(lid)
            return len(lease.items)

    def reserve(
        self,
        keys: list[bytes],
        nbytes: int,
        lease_s: float,
        *,
        owner: str = "",
        tag: Tag | None = None,
    ) -> tuple[str | None, list[tuple[int, int]], int, int]:
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
                self._entries[key] = _Entry(off, nbytes, gen, tag)
                if tag is not None:
                    self._tag_chunks[tag] += 1
                items.append((key, gen))
                slots.append((i, off))
            self.stats.duplicate_chunks += duplicates
            self.stats.dropped_chunks += dropped
            if not items:
                return None, [], duplicates, dropped
            return self._new_lease(True, items, lease_s, owner), slots, duplicates, dropped

    def commit(self, lid: str, *, owner: str = "") -> int:
        """Make ``owner``'s reservation's chunks visible; returns how many were committed."""
        with self._lock:
            self._expire()
            lease = self._owned(lid, owner, write=True)
            if lease is None:
                self._expired.pop(lid, None)
                self._unquarantine(lid)  # its writer is done copying
                raise StoreError(
                    "lease_expired", f"reservation {lid} expired before commit; nothing was stored"
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

    def abort(self, lid: str, *, owner: str = "") -> None:
        """Drop ``owner``'s reservation without storing (an expired one is already gone)."""
        with self._lock:
            self._expire()
            if self._owned(lid, owner, write=True) is None:
                self._expired.pop(lid, None)
                self._unquarantine(lid)  # its writer is done copying
                return
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
                "quarantined_chunks": s.quarantined_chunks,
                "quarantined_bytes": sum(n for q in self._quarantine.values() for _, n in q.blocks),
            }
