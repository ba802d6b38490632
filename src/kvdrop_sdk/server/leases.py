"""The chunk store's leases and quarantines, indexed by id, by deadline and by owner.

A store operation must not cost more because one client holds many leases: expiry pops due
entries from a heap (no scan of every lease), and an owner's leases are a set, so a client that
went away is cleaned up without looking at anyone else's. Each client (owner) may hold at most
``max_per_owner`` leases and quarantines together (``too_many_leases`` beyond); the server's own
leases (``exempt``) are bounded by its workers instead.
"""

from __future__ import annotations

import heapq
import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["Lease", "LeaseTable", "Quarantine", "TooManyLeases"]

#: Ids of recently ended leases remembered (so their owner hears "expired", not "unknown").
_EXPIRED_MEMORY = 4096


class TooManyLeases(Exception):
    """An owner already holds its most leases; the message says how many and what to do."""


@dataclass
class Lease:
    """Pinned (``write`` False) or reserved chunks: (key, generation) of each."""

    write: bool
    items: list[tuple[bytes, int]]
    expiry: float
    owner: str


@dataclass
class Quarantine:
    """Slots of an expired reservation whose writer may still be copying into them."""

    owner: str
    blocks: list[tuple[int, int]]  # (offset, nbytes)
    until: float


@dataclass
class _Index:
    """Entries of one kind (leases or quarantines) by id, by owner and by deadline."""

    by_id: dict[str, Lease | Quarantine] = field(default_factory=dict)
    by_owner: dict[str, set[str]] = field(default_factory=dict)
    heap: list[tuple[float, str]] = field(default_factory=list)

    def add(self, key: str, item: Lease | Quarantine, deadline: float) -> None:
        self.by_id[key] = item
        self.by_owner.setdefault(item.owner, set()).add(key)
        if math.isfinite(deadline):
            heapq.heappush(self.heap, (deadline, key))
            if len(self.heap) > 2 * len(self.by_id) + 1024:  # drop entries of ended ones
                self.heap = [(d, k) for d, k in self.heap if k in self.by_id]
                heapq.heapify(self.heap)

    def pop(self, key: str) -> Lease | Quarantine | None:
        item = self.by_id.pop(key, None)
        if item is not None:
            keys = self.by_owner[item.owner]
            keys.discard(key)
            if not keys:
                del self.by_owner[item.owner]
        return item

    def due(self, now: float, deadline_of: str) -> list[str]:
        """Ids whose deadline (attribute ``deadline_of``) has passed, removed from the heap."""
        out = []
        while self.heap and self.heap[0][0] <= now:
            deadline, key = heapq.heappop(self.heap)
            item = self.by_id.get(key)
            if item is not None and getattr(item, deadline_of) == deadline:
                out.append(key)
        return out


class LeaseTable:
    """Leases and quarantines of a ``ChunkStore`` (called with the store's lock held)."""

    def __init__(self, max_per_owner: int, exempt: str) -> None:
        self.max_per_owner = max_per_owner
        self._exempt = exempt
        self._leases = _Index()
        self._quarantines = _Index()
        self._expired: OrderedDict[str, tuple[str, bool]] = OrderedDict()  # id -> (owner, write)

    def __len__(self) -> int:
        return len(self._leases.by_id)

    def held_by(self, owner: str) -> int:
        """Leases and quarantines ``owner`` holds now."""
        return len(self._leases.by_owner.get(owner, ())) + len(
            self._quarantines.by_owner.get(owner, ())
        )

    def check_room(self, owner: str, extra: int = 0) -> None:
        """``TooManyLeases`` when ``owner`` holds its most leases and quarantines (plus
        ``extra`` the caller counts, such as slots still verified because of it)."""
        held = self.held_by(owner) + extra
        if owner != self._exempt and held >= self.max_per_owner:
            raise TooManyLeases(
                f"this client holds {held} leases and quarantined or suspect reservations, the "
                f"most one client may hold (--max-client-leases {self.max_per_owner}); release, "
                "commit or abort some first"
            )

    def add(self, lease: Lease) -> str:
        """A new random id for ``lease``; ``TooManyLeases`` when its owner holds its most."""
        self.check_room(lease.owner)
        lid = secrets.token_hex(16)
        self._leases.add(lid, lease, lease.expiry)
        return lid

    def get(self, lid: object) -> Lease | None:
        item = self._leases.by_id.get(lid) if isinstance(lid, str) else None
        return item if isinstance(item, Lease) else None

    def pop(self, lid: str) -> Lease | None:
        item = self._leases.pop(lid)
        return item if isinstance(item, Lease) else None

    def due(self, now: float) -> list[str]:
        """Leases whose expiry has passed (still live; the caller ends them)."""
        return self._leases.due(now, "expiry")

    def owned_by(self, owner: str) -> list[str]:
        return list(self._leases.by_owner.get(owner, ()))

    # -- quarantines ---------------------------------------------------------------------------
    def quarantine(self, lid: str, q: Quarantine) -> None:
        self._quarantines.add(lid, q, q.until)

    def end_quarantine(self, lid: str) -> Quarantine | None:
        item = self._quarantines.pop(lid)
        return item if isinstance(item, Quarantine) else None

    def quarantines_due(self, now: float) -> list[str]:
        return self._quarantines.due(now, "until")

    def quarantines_of(self, owner: str) -> list[str]:
        return list(self._quarantines.by_owner.get(owner, ()))

    def quarantined(self) -> list[Quarantine]:
        return [q for q in self._quarantines.by_id.values() if isinstance(q, Quarantine)]

    # -- ended leases --------------------------------------------------------------------------
    def remember(self, lid: str, owner: str, write: bool) -> None:
        """Keep an ended lease's id for a while, so its owner learns it expired."""
        self._expired[lid] = (owner, write)
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)

    def recall(self, lid: object) -> tuple[str, bool] | None:
        return self._expired.get(lid) if isinstance(lid, str) else None

    def forget(self, lid: str) -> None:
        self._expired.pop(lid, None)
