"""First-fit allocation of the pool's byte range into aligned slots (the chunk store's)."""

from __future__ import annotations

import bisect

__all__ = ["ALIGN", "Allocator", "align"]

#: Slot offsets and sizes are rounded up to this many bytes (page aligned copies).
ALIGN = 4096


def align(n: int) -> int:
    """``n`` rounded up to ``ALIGN``."""
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
        size = align(nbytes)
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
        size = align(nbytes)
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
