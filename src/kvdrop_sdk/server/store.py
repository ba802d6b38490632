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
the writer is known gone (every connection of its client closed: ``owner_gone``, which also ends
its leases at once). After ``quarantine_s`` a still-silent writer's slots are reused, but only
*verified*: a chunk stored in a slot that such a writer might still reach gets a checksum at
commit, checked again when a reader releases its pin (and before a socket read is sent), so a
late copy makes that chunk a miss, never foreign bytes.

Leases are indexed (``leases.LeaseTable``): expiry pops a heap and an owner's leases are a set,
so one client's 20,000 pins cost the others nothing; each client may hold at most
``max_client_leases`` leases and quarantines (``too_many_leases``).

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

import itertools
import threading
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.server.allocator import ALIGN, Allocator, align
from kvdrop_sdk.server.leases import Lease, LeaseTable, Quarantine, TooManyLeases

__all__ = [
    "ALIGN",
    "INTERNAL_OWNER",
    "MAX_CLIENT_LEASES",
    "MAX_LAYOUTS",
    "QUARANTINE_S",
    "Allocator",
    "ChunkStore",
    "StoreError",
]

#: Owner of the server's own pins (socket retrieves); client owners never look like it.
INTERNAL_OWNER = "server"
#: Largest number of (model, kind) layout registrations kept.
MAX_LAYOUTS = 1024
#: Longest an expired reservation's slots stay quarantined when its writer never comes back.
QUARANTINE_S = 600.0
#: Most leases (pins, reservations) and quarantines one client may hold at once.
MAX_CLIENT_LEASES = 1024
Tag = tuple[str, str]


class StoreError(Exception):
    """A store operation was refused; ``code`` is sent back to the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Entry:
    offset: int
    nbytes: int
    gen: int
    tag: Tag | None = None
    committed: bool = False
    pins: int = 0
    verify: bool = False  # in a slot a stalled writer may still reach: checksummed
    crc: int = 0


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
    verified_chunks: int = 0
    corrupted_chunks: int = 0
    clients_gone: int = 0


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
        max_client_leases: int = MAX_CLIENT_LEASES,
        checksum: Callable[[int, int], int] | None = None,
    ) -> None:
        self._alloc = Allocator(start, end)
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._book = LeaseTable(max_client_leases, INTERNAL_OWNER)
        self._layouts: OrderedDict[Tag, _Registration] = OrderedDict()
        self._tag_chunks: Counter[Tag] = Counter()
        self.max_layouts = max_layouts
        self.quarantine_s = quarantine_s
        # Slots reused after quarantine_s whose writer may still copy: lid -> (owner, blocks).
        self._suspect: dict[str, tuple[str, list[tuple[int, int]]]] = {}
        self._checksum = checksum
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
        for lid in self._book.quarantines_due(now):
            self._unquarantine(lid, writer_done=False)
        for lid in self._book.due(now):
            self.stats.expired_leases += 1
            lease = self._end_lease(lid, expired=True)
            if lease is not None:
                self._book.remember(lid, lease.owner, lease.write)

    def _owned(self, lid: Any, owner: str, write: bool) -> Lease | None:
        """The live lease ``lid`` of ``owner``; None if it expired; StoreError if it is unknown,
        someone else's, or of the other kind (pin vs reservation)."""
        lease = self._book.get(lid)
        if lease is not None and lease.owner == owner:
            if lease.write != write:
                what = "a write reservation, not a pin" if lease.write else "a pin"
                raise StoreError("bad_lease", f"lease {lid} is {what}")
            return lease
        if self._book.recall(lid) == (owner, write):
            return None
        raise StoreError(
            "unknown_lease", f"lease {lid!r} is unknown, already ended, or not this client's"
        )

    def _end_lease(self, lid: str, *, expired: bool = False) -> Lease | None:
        """End lease ``lid``: unpin its chunks, or drop its uncommitted ones (quarantining their
        slots when it ``expired``: its writer may still be copying)."""
        lease = self._book.pop(lid)
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
            self._book.quarantine(lid, Quarantine(lease.owner, held, until))
            self.stats.quarantined_chunks += len(held)
        return lease

    def _unquarantine(self, lid: str, *, writer_done: bool) -> None:
        """Free the slots quarantined for the expired reservation ``lid`` (if any). Unless its
        writer is done (ended the lease, or gone), they stay *suspect*: chunks stored there are
        verified by checksum."""
        q = self._book.end_quarantine(lid)
        if writer_done:
            self._suspect.pop(lid, None)
        if q is None:
            return
        for offset, nbytes in q.blocks:
            self._alloc.free(offset, nbytes)
        if not writer_done and self._checksum is not None:
            self._suspect[lid] = (q.owner, q.blocks)

    def _is_suspect(self, offset: int, nbytes: int) -> bool:
        end = offset + align(nbytes)
        return any(
            o < end and offset < o + align(n)
            for _, blocks in self._suspect.values()
            for o, n in blocks
        )

    def _to_check(self, lid: str, owner: str, write: bool) -> list[tuple[bytes, int, int, int]]:
        """(under the lock) ``(key, gen, offset, nbytes)`` of lease ``lid``'s verified chunks,
        whose checksums the caller computes *outside* the lock: a suspect slot's check costs its
        owner, not every other client waiting for the lock (a held reservation made a third
        client's lookups 6.6x slower). The lease pins or reserves them, so their slots stay."""
        if self._checksum is None:
            return []
        try:
            lease = self._owned(lid, owner, write)
        except StoreError:
            return []  # the call itself answers it, under the lock
        out = []
        for key, gen in lease.items if lease is not None else ():
            entry = self._entries.get(key)
            if entry is not None and entry.gen == gen and entry.verify:
                out.append((key, gen, entry.offset, entry.nbytes))
        return out

    def _sums(self, todo: list[tuple[bytes, int, int, int]]) -> dict[tuple[bytes, int], int]:
        """(outside the lock) The checksums of :meth:`_to_check`'s chunks."""
        assert self._checksum is not None or not todo
        return {(key, gen): self._checksum(off, n) for key, gen, off, n in todo}  # type: ignore[misc]

    def _crc_of(self, key: bytes, entry: _Entry, sums: dict[tuple[bytes, int], int]) -> int:
        got = sums.get((key, entry.gen))
        if got is None:  # not computed beforehand (a chunk verified meanwhile): here
            assert self._checksum is not None
            got = self._checksum(entry.offset, entry.nbytes)
        return got

    def _intact(
        self, key: bytes, gen: int, sums: dict[tuple[bytes, int], int] | None = None
    ) -> bool:
        """Whether chunk ``key`` of generation ``gen`` is stored and (if verified) unchanged
        (its checksum from ``sums`` when computed outside the lock); a verified chunk whose
        bytes changed is dropped."""
        entry = self._entries.get(key)
        if entry is None or entry.gen != gen:
            return False
        if not entry.verify or self._checksum is None:
            return True
        if self._crc_of(key, entry, sums or {}) == entry.crc:
            return True
        # Dropped at once: readers still holding pins find it gone at their release too.
        self.stats.corrupted_chunks += 1
        self._drop(key)
        return False

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
        return self._book.add(Lease(write, items, self._clock() + lease_s, owner))

    def _check_room(self, owner: str) -> None:
        """``too_many_leases`` before any work when ``owner`` holds its most leases."""
        # Suspect slots count too: a writer that keeps letting reservations lapse cannot grow
        # the set every allocation is checked against.
        suspect = sum(1 for o, _ in self._suspect.values() if o == owner) if self._suspect else 0
        try:
            self._book.check_room(owner, suspect)
        except TooManyLeases as exc:
            raise StoreError("too_many_leases", str(exc)) from None

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
            self._check_room(owner)
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
            todo = self._to_check(lid, owner, write=False)
        sums = self._sums(todo)  # while still pinned, outside the lock
        with self._lock:
            self._expire()
            lease = self._owned(lid, owner, write=False)
            if lease is None:
                self._book.forget(lid)
                return 0
            valid = 0
            for key, gen in lease.items:  # checked while still pinned
                if not self._intact(key, gen, sums):
                    break
                valid += 1
            self._end_lease(lid)
            return valid

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
            self._check_room(owner)
            if align(nbytes) > self._alloc.capacity:
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
                verify = bool(self._suspect) and self._is_suspect(off, nbytes)
                self._entries[key] = _Entry(off, nbytes, gen, tag, verify=verify)
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
            todo = self._to_check(lid, owner, write=True)
        sums = self._sums(todo)  # the reservation holds the slots; outside the lock
        with self._lock:
            self._expire()
            lease = self._owned(lid, owner, write=True)
            if lease is None:
                self._book.forget(lid)
                self._unquarantine(lid, writer_done=True)  # its writer is done copying
                raise StoreError(
                    "lease_expired", f"reservation {lid} expired before commit; nothing was stored"
                )
            self._book.pop(lid)
            stored = 0
            for key, gen in lease.items:
                entry = self._entries.get(key)
                if entry is None or entry.gen != gen:
                    continue
                if entry.verify and self._checksum is not None:
                    entry.crc = self._crc_of(key, entry, sums)
                    self.stats.verified_chunks += 1
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
                self._book.forget(lid)
                self._unquarantine(lid, writer_done=True)  # its writer is done copying
                return
            self._end_lease(lid)

    def owner_gone(self, owner: str) -> int:
        """Every connection of client ``owner`` closed: end its leases at once (pins released,
        reservations dropped and their slots free: no writer is left to copy into them), free
        its quarantined slots and stop verifying the ones it might have reached. Returns how
        many leases and quarantines ended."""
        with self._lock:
            lids = self._book.owned_by(owner)
            for lid in lids:
                lease = self._end_lease(lid)
                if lease is not None:
                    self._book.remember(lid, lease.owner, lease.write)
            quarantined = self._book.quarantines_of(owner)
            for lid in quarantined:
                self._unquarantine(lid, writer_done=True)
            for lid in [lid for lid, (o, _) in self._suspect.items() if o == owner]:
                del self._suspect[lid]
            if lids or quarantined:
                self.stats.clients_gone += 1
            return len(lids) + len(quarantined)

    def verified_copy(self, lid: str, copy: Callable[[int, int], bytes]) -> list[bytes | None]:
        """For server pin ``lid``'s chunks in order: None for a chunk that needs no check, else
        ``copy(offset, nbytes)`` of a verified one, checked after copying. The list ends before
        the first chunk whose bytes changed (a socket read sends only the intact prefix)."""
        with self._lock:  # what to copy, under the lock; copies and checks outside it
            lease = self._book.get(lid)
            chunks: list[tuple[bytes, int, _Entry | None]] = []
            for key, gen in lease.items if lease is not None else ():
                entry = self._entries.get(key)
                if entry is None or entry.gen != gen:
                    break
                verify = entry.verify and self._checksum is not None
                chunks.append((key, gen, entry if verify else None))
        out: list[bytes | None] = []
        for key, gen, entry in chunks:  # the server's pin holds every slot
            if entry is None:
                out.append(None)
                continue
            data = copy(entry.offset, entry.nbytes)
            if zlib.crc32(data) != entry.crc:
                with self._lock:
                    self._corrupted(key, gen)
                break
            out.append(data)
        return out

    def _corrupted(self, key: bytes, gen: int) -> None:
        """Count and drop chunk ``key`` of ``gen`` (its bytes changed), if it is still there."""
        entry = self._entries.get(key)
        if entry is not None and entry.gen == gen:
            self.stats.corrupted_chunks += 1
            self._drop(key)

    def full_reason(self) -> str:
        """Why chunks did not fit: what holds the pool (for a reply's ``dropped_reason``)."""
        with self._lock:
            pinned = sum(e.nbytes for e in self._entries.values() if e.pins)
            reserved = sum(e.nbytes for e in self._entries.values() if not e.committed)
            quarantined = sum(n for q in self._book.quarantined() for _, n in q.blocks)
            return (
                f"the pool is full: its {self._alloc.capacity} bytes hold {pinned} of pinned "
                f"chunks, {reserved} of chunks being written and {quarantined} quarantined "
                f"(slots of {len(self._book.quarantined())} expired reservations whose writers "
                "are still connected and may still be copying)"
            )

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
                "active_leases": len(self._book),
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
                "quarantined_bytes": sum(n for q in self._book.quarantined() for _, n in q.blocks),
                "suspect_reservations": len(self._suspect),
                "verified_chunks": s.verified_chunks,
                "corrupted_chunks": s.corrupted_chunks,
                "clients_gone": s.clients_gone,
            }
