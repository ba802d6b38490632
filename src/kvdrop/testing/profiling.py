"""Peak-memory measurement for CPU tensors (tracemalloc does not see torch's allocator).

:class:`PeakRSS` samples the process's resident set size in a background thread while a block
runs and reports the peak increase over the RSS at entry. Large torch buffers are mmapped by the
C allocator and returned to the OS when freed, so RSS follows them; glibc's small-object arenas are
trimmed at entry (``malloc_trim``) so earlier garbage does not hide new allocations. Sampling at
~0.2 ms can miss spikes shorter than that; it is a measurement for benchmarks and budget tests,
not an exact accounting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time
from types import TracebackType

__all__ = ["PeakRSS", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _trim() -> None:
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        try:
            ctypes.CDLL(libc_name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


class PeakRSS:
    """``with PeakRSS() as m: work()`` then ``m.peak`` = peak RSS increase in bytes during work."""

    def __init__(self, interval_s: float = 0.0002) -> None:
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes() - self.start)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        _trim()
        self.start = rss_bytes()
        self.peak = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.peak = max(self.peak, rss_bytes() - self.start)
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
